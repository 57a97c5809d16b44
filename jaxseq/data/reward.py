"""Preference data for a reward model: rows of ``chosen`` and ``rejected`` (with or without ``prompt``, and an
optional ``margin``), tokenised as TRL's RewardTrainer tokenises them (trl 1.x ``RewardTrainer._prepare_dataset``
and its ``DataCollatorForPreference``).

Strings get the tokenizer's EOS appended to ``chosen`` and ``rejected`` (unless they end with it);
conversations (lists of ``{"role", "content"}``) are rendered whole by the chat template, without a generation
prompt. A ``prompt`` is put in front of each (string or list concatenation); without one, ``chosen`` and
``rejected`` are scored as they are (TRL's implicit prompt: nothing is extracted, each sequence is whole). Each
pair becomes ``[2, length]`` arrays (chosen first): ``input_ids`` right-padded with the pad token and
``pair_mask`` (1 on real tokens), and ``margin`` when the records have one. ``--max_length`` leaves out the
pairs whose chosen or rejected sequence is longer, as TRL filters them (no sequence is cut).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxseq.config import arg
from jaxseq.data.chat import template_kwargs
from jaxseq.data.preference import load_pair_records
from jaxseq.errors import JaxseqError

Log = Callable[[str], None]


@dataclasses.dataclass
class RewardDataConfig:
    train_file: str | None = arg(
        None, "training pairs: .jsonl or .json records of chosen and rejected (prompt and margin optional)"
    )
    validation_file: str | None = arg(None, "validation pairs, same format")
    dataset_name: str | None = arg(None, "Hugging Face Hub preference dataset instead of --train_file")
    dataset_config_name: str | None = arg(
        None, "configuration of --dataset_name (TRL's --dataset_config)", aliases=("dataset_config",)
    )
    max_length: int | None = arg(
        1024,
        "pairs whose chosen or rejected sequence has more tokens are left out, as TRL's RewardTrainer filters "
        "them (TRL's default 1024; YAML null: none)",
    )
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, for conversations and a tokenizer without its own"
    )
    validation_split_percentage: float = arg(
        0.0, "without a validation file or split: percentage of the pairs held out for validation (0: none)"
    )
    max_train_samples: int | None = arg(None, "use only the first N training pairs")
    max_eval_samples: int | None = arg(None, "use only the first N validation pairs")

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 1:
            raise JaxseqError(f"--max_length must be at least 1, got {self.max_length}")


def _conversational(record: dict) -> bool:
    return any(isinstance(record.get(c), list) for c in ("prompt", "chosen", "rejected"))


def encode_reward_pair(tokenizer, record: dict) -> tuple[list[int], list[int]]:
    """(chosen, rejected) token ids of one record, as TRL's RewardTrainer tokenises them."""
    chosen, rejected = record["chosen"], record["rejected"]
    conversational = _conversational(record)
    if not conversational:
        eos = tokenizer.eos_token
        chosen, rejected = (text if text.endswith(eos) else text + eos for text in (chosen, rejected))
    if record.get("prompt") is not None:
        chosen, rejected = record["prompt"] + chosen, record["prompt"] + rejected
    if not conversational:
        return tokenizer(text=chosen)["input_ids"], tokenizer(text=rejected)["input_ids"]
    kwargs = template_kwargs(record)
    return tuple(
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
        for messages in (chosen, rejected)
    )


def encode_reward_pairs(tokenizer, records: Sequence[dict], *, progress: bool = True) -> list:
    """Every record tokenised (``encode_reward_pair``), with a progress bar."""
    from tqdm.auto import tqdm

    if not getattr(tokenizer, "chat_template", None) and any(_conversational(r) for r in records[:1]):
        raise JaxseqError("the pairs are conversations and the tokenizer has no chat template; pass --chat_template")
    return [
        encode_reward_pair(tokenizer, r)
        for r in tqdm(records, desc="tokenizing pairs", unit="pair", disable=not progress)
    ]


def reward_rows(
    encoded: Sequence[tuple[list[int], list[int]]],
    max_length: int | None,
    pad_id: int,
    margins: Sequence[float] | None = None,
) -> dict[str, np.ndarray]:
    """``[pairs, 2, length]`` arrays of the encoded pairs (chosen first), right-padded with ``pad_id`` to the
    longest sequence, and ``margin`` ``[pairs]`` if given; pairs with a sequence longer than ``max_length``
    are left out, as TRL leaves them out."""
    keep = [i for i, pair in enumerate(encoded) if max_length is None or max(len(ids) for ids in pair) <= max_length]
    if not keep:
        raise JaxseqError(f"every pair has a sequence longer than --max_length {max_length}; raise it")
    width = max(len(ids) for i in keep for ids in encoded[i])
    out = {
        "input_ids": np.full((len(keep), 2, width), pad_id, np.int32),
        "pair_mask": np.zeros((len(keep), 2, width), np.int32),
    }
    for row, i in enumerate(keep):
        for j, ids in enumerate(encoded[i]):
            out["input_ids"][row, j, : len(ids)] = ids
            out["pair_mask"][row, j, : len(ids)] = 1
    if margins is not None:
        out["margin"] = np.asarray([margins[i] for i in keep], np.float32)
    return out


def _rows(records: list[dict], config: RewardDataConfig, tokenizer, pad: int, progress: bool, where: str):
    margins = None
    if "margin" in records[0]:
        lacking = sum("margin" not in r for r in records)
        if lacking:
            raise JaxseqError(f"{lacking} of {len(records)} {where} lack 'margin': give every pair one, or none")
        margins = [float(r["margin"]) for r in records]
    return reward_rows(encode_reward_pairs(tokenizer, records, progress=progress), config.max_length, pad, margins)


def load_reward_rows(
    config: RewardDataConfig,
    tokenizer,
    *,
    progress: bool = True,
    log: Log = print,
    train: bool = True,
    evaluate: bool = True,
) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
    """Training and validation rows (``reward_rows``) from the configured files or Hub dataset; None for a
    stage not asked for and for validation where there are no validation pairs (``load_pair_records``)."""
    records, valid = load_pair_records(config, train=train, evaluate=evaluate)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for name, found in (("training", records), ("validation", valid)):
        rows = None if found is None else _rows(found, config, tokenizer, pad, progress, f"{name} pairs")
        if rows is not None and len(rows["input_ids"]) < len(found):
            log(f"{len(found) - len(rows['input_ids'])} {name} pairs longer than --max_length were left out")
        out.append(rows)
    return out[0], out[1]
