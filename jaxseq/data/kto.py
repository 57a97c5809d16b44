"""Unpaired preference data for KTO: rows of ``prompt``, ``completion`` and ``label`` (True: a desirable
completion), tokenised as TRL's KTOTrainer tokenises them (trl 1.x ``KTOTrainer._prepare_dataset`` and its
``DataCollatorForUnpairedPreference``).

``prompt`` and ``completion`` are strings, or conversations (lists of ``{"role", "content"}``) rendered by the
chat template, the prompt alone with the generation prompt, given the record's ``tools`` (JSON schemas of
functions, a list or a JSON string of one; messages may carry ``tool_calls`` and ``tool`` turns) and
``chat_template_kwargs`` as TRL gives them. Strings get the tokenizer's EOS appended to the
completion (unless it ends with it). The prompt and prompt+completion are tokenised apart and the completion
starts where they diverge. Paired records (``chosen`` and ``rejected``, with or without ``prompt``) are
unpaired as TRL unpairs them: the prompt extracted where there is none, then each run of 1,000 records gives
its chosen completions (label True) followed by its rejected ones (label False). Rows whose prompt alone has
--max_length tokens or more are left out, as TRL filters them.

Each example keeps its whole prompt and completion, so that the step can pair a prompt with another
example's completion (the KL term): ``input_ids`` (prompt then completion, right-padded to the longest prompt
plus the longest completion; a completion cut to --max_length tokens, more never reach a sequence), the parts'
lengths ``prompt_length`` and ``completion_length``, and ``label`` (1: desirable). The objective
(``jaxseq.train.kto``) makes the sequences of at most --max_length tokens from them, as TRL's collator does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxseq.config import arg
from jaxseq.data.preference import encode_completions, extract_prompt, load_pair_records
from jaxseq.data.records import require_columns
from jaxseq.errors import JaxseqError

Log = Callable[[str], None]
UNPAIR_BATCH = 1000
"""Records per ``datasets.map`` batch when TRL unpairs paired data (``unpair_preference_dataset``'s default)."""


@dataclasses.dataclass
class KTODataConfig:
    train_file: str | None = arg(
        None,
        "training rows: .jsonl or .json records of prompt, completion and label (true: desirable), or pairs of "
        "chosen and rejected",
    )
    validation_file: str | None = arg(None, "validation rows, same format")
    dataset_name: str | None = arg(None, "Hugging Face Hub dataset (unpaired or paired) instead of --train_file")
    dataset_config_name: str | None = arg(
        None, "configuration of --dataset_name (TRL's --dataset_config)", aliases=("dataset_config",)
    )
    max_length: int | None = arg(
        1024,
        "tokens of prompt + completion per sequence, cut on the right (TRL's default 1024; YAML null: none); rows "
        "whose prompt alone fills it are left out, as TRL",
    )
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, for conversations and a tokenizer without its own"
    )
    validation_split_percentage: float = arg(
        0.0, "without a validation file or split: percentage of the rows held out for validation (0: none)"
    )
    max_train_samples: int | None = arg(None, "use only the first N training records")
    max_eval_samples: int | None = arg(None, "use only the first N validation records")

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 2:
            raise JaxseqError(f"--max_length must be at least 2, got {self.max_length}")


def _paired(record: dict) -> bool:
    return "chosen" in record and "rejected" in record


def check_records(records: list, where: str) -> list[dict]:
    """The records, each with prompt, completion and label, or chosen and rejected; else one line."""
    if not records:
        raise JaxseqError(f"{where} has no rows")
    if not isinstance(records[0], dict):
        raise JaxseqError(f"{where}: each record must be an object with prompt, completion and label")
    if not _paired(records[0]):
        require_columns(records, ["prompt", "completion", "label"], where)
    return records


def unpair(records: Sequence[dict]) -> list[dict]:
    """Unpaired records (prompt, completion, label) of ``records``, as TRL's ``_prepare_dataset`` makes them:
    paired ones get their prompt extracted (``extract_prompt``) if they have none, and each run of
    ``UNPAIR_BATCH`` gives its chosen completions, then its rejected ones; unpaired ones stay, their labels
    checked."""
    if not records or not _paired(records[0]):
        out = []
        for r in records:
            if r.get("label") not in (True, False):
                raise JaxseqError(f"a row's label must be true or false, got {r.get('label')!r}")
            out.append({**r, "label": bool(r["label"])})
        return out
    with_prompt = [r if "prompt" in r else extract_prompt(r) for r in records]
    out = []
    for start in range(0, len(with_prompt), UNPAIR_BATCH):
        run = with_prompt[start : start + UNPAIR_BATCH]
        rest = lambda r: {k: v for k, v in r.items() if k not in ("chosen", "rejected")}
        out += [{**rest(r), "completion": r["chosen"], "label": True} for r in run]
        out += [{**rest(r), "completion": r["rejected"], "label": False} for r in run]
    return out


def _conversational(record: dict) -> bool:
    return isinstance(record["prompt"], list) or isinstance(record["completion"], list)


def encode_unpaired(tokenizer, record: dict) -> tuple[list[int], list[int]]:
    """(prompt, completion) token ids of one unpaired record, as TRL tokenises them."""
    prompt, (completion,) = encode_completions(tokenizer, record, (record["completion"],))
    return prompt, completion


def encode_unpaired_rows(tokenizer, records: Sequence[dict], *, progress: bool = True) -> list:
    """Every (unpaired) record tokenised (``encode_unpaired``), with a progress bar."""
    from tqdm.auto import tqdm

    if not getattr(tokenizer, "chat_template", None) and any(_conversational(r) for r in records[:1]):
        raise JaxseqError("the rows are conversations and the tokenizer has no chat template; pass --chat_template")
    return [
        encode_unpaired(tokenizer, r) for r in tqdm(records, desc="tokenizing rows", unit="row", disable=not progress)
    ]


def kto_rows(
    encoded: Sequence[tuple[list[int], list[int]]],
    labels: Sequence[bool],
    max_length: int | None,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """The examples' arrays: ``input_ids``, each prompt followed by its whole completion (cut to
    ``max_length`` tokens: a sequence never holds more), right-padded with ``pad_id`` to the longest prompt
    plus the longest completion (room for any prompt with any completion); ``prompt_length``,
    ``completion_length`` and ``label`` (1: desirable). Rows whose prompt has ``max_length`` tokens or more
    are left out, as TRL leaves them out."""
    keep = [i for i, (prompt, _) in enumerate(encoded) if max_length is None or len(prompt) < max_length]
    if not keep:
        raise JaxseqError(f"every row's prompt fills --max_length {max_length}; raise it")
    prompts = [encoded[i][0] for i in keep]
    completions = [encoded[i][1][:max_length] for i in keep]
    width = max(map(len, prompts)) + max(1, max(map(len, completions)))
    ids = np.full((len(keep), width), pad_id, np.int32)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids[row, : len(prompt) + len(completion)] = prompt + completion
    return {
        "input_ids": ids,
        "prompt_length": np.array([len(p) for p in prompts], np.int32),
        "completion_length": np.array([len(c) for c in completions], np.int32),
        "label": np.array([bool(labels[i]) for i in keep], np.int32),
    }


def weight_advice(labels: np.ndarray, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's warning when the desirable and undesirable rows are unbalanced and neither weight is in the
    range Eq. (8) of the KTO paper suggests (arXiv:2402.01306); None when it has nothing to say."""
    desirable = max(int(np.sum(labels)), 1)
    undesirable = max(len(labels) - desirable, 1)
    if desirable == undesirable:
        return None
    des_mid, und_mid = undesirable * undesirable_weight / desirable, desirable * desirable_weight / undesirable
    des, und = (round(des_mid, 2), round(des_mid * 1.33, 2)), (round(und_mid / 1.33, 2), round(und_mid, 2))
    if des[0] <= desirable_weight <= des[1] or und[0] <= undesirable_weight <= und[1]:
        return None
    return (
        f"{desirable} desirable and {undesirable} undesirable training rows, and the weights of their losses are "
        f"not in the range the KTO paper suggests: set EITHER --desirable_weight in [{des[0]}, {des[1]}] or "
        f"--undesirable_weight in [{und[0]}, {und[1]}] (not both)"
    )


def load_kto_rows(
    config: KTODataConfig,
    tokenizer,
    *,
    progress: bool = True,
    log: Log = print,
    train: bool = True,
    evaluate: bool = True,
) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
    """Training and validation rows (``kto_rows``) from the configured files or Hub dataset; None for a stage
    not asked for and for validation where there are no validation rows (``load_pair_records``)."""
    records, valid = load_pair_records(config, train=train, evaluate=evaluate, check=check_records)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for name, found in (("training", records), ("validation", valid)):
        rows = None
        if found is not None:
            found = unpair(found)
            encoded = encode_unpaired_rows(tokenizer, found, progress=progress)
            rows = kto_rows(encoded, [r["label"] for r in found], config.max_length, pad)
            if len(rows["label"]) < len(found):
                log(f"{len(found) - len(rows['label'])} {name} rows whose prompt fills --max_length were left out")
        out.append(rows)
    return out[0], out[1]
