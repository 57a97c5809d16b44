"""Preference data for DPO: rows of ``prompt``, ``chosen`` and ``rejected``, tokenised as TRL's DPOTrainer
tokenises them (trl 1.x ``DPOTrainer._prepare_dataset`` and ``DataCollatorForPreference``).

A record holds ``prompt``, ``chosen`` and ``rejected`` as strings, or as conversations (lists of
``{"role", "content"}``); without ``prompt``, the prompt is the longest common start of ``chosen`` and
``rejected`` (TRL's ``extract_prompt``). Strings get the tokenizer's EOS appended to each completion;
conversations are rendered by the chat template (the prompt with the generation prompt), given the record's
``tools`` (JSON schemas of functions, a list or a JSON string of one; its messages may carry ``tool_calls``
and ``tool`` turns) and ``chat_template_kwargs`` as TRL gives them. The prompt and
prompt+completion are tokenised apart and the completion starts where they diverge. Each pair becomes
``[2, length]`` arrays (chosen first): ``input_ids``, ``pair_mask`` (1 on real tokens) and ``completion_mask``
(1 on the completion's tokens); ``--max_length`` cuts each sequence as TRL's collator does (``keep_start`` or
``keep_end``), after ``--max_prompt_length`` (the prompt's end kept) and ``--max_completion_length`` (each
completion's start kept) if set, as TRL's 0.x did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxseq.config import arg
from jaxseq.data.chat import template_kwargs
from jaxseq.data.records import read_records, require_columns
from jaxseq.data.text import load_hub_dataset
from jaxseq.errors import JaxseqError

COLUMNS = ("prompt", "chosen", "rejected")
TRUNCATION = ("keep_start", "keep_end")
Log = Callable[[str], None]


@dataclasses.dataclass
class PreferenceDataConfig:
    train_file: str | None = arg(None, "training pairs: .jsonl or .json records of prompt, chosen and rejected")
    validation_file: str | None = arg(None, "validation pairs, same format")
    dataset_name: str | None = arg(None, "Hugging Face Hub preference dataset instead of --train_file")
    dataset_config_name: str | None = arg(None, "configuration of --dataset_name")
    max_length: int | None = arg(
        1024, "tokens of prompt + completion per sequence (TRL's default 1024); longer ones are cut (--truncation_mode)"
    )
    truncation_mode: str = arg(
        "keep_start",
        "which end of a sequence longer than --max_length stays: keep_start (pairs whose prompt alone fills "
        "--max_length are dropped, as TRL) or keep_end",
        choices=TRUNCATION,
    )
    max_prompt_length: int | None = arg(None, "cut each prompt to its last N tokens first (TRL 0.x's flag)")
    max_completion_length: int | None = arg(None, "cut each completion to its first N tokens first (TRL 0.x's flag)")
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, for conversations and a tokenizer without its own"
    )
    validation_split_percentage: float = arg(
        0.0, "without a validation file or split: percentage of the pairs held out for validation (0: none)"
    )
    max_train_samples: int | None = arg(None, "use only the first N training pairs")
    max_eval_samples: int | None = arg(None, "use only the first N validation pairs")

    def __post_init__(self):
        for name in ("max_length", "max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise JaxseqError(f"--{name} must be at least 1, got {value}")


def extract_prompt(record: dict) -> dict:
    """``record`` with the longest common start of ``chosen`` and ``rejected`` as its ``prompt`` (TRL's
    ``extract_prompt``: turns of conversations, characters of strings, a space before the cut left out)."""
    chosen, rejected = record["chosen"], record["rejected"]
    for i in range(min(len(chosen), len(rejected))):
        if chosen[i] != rejected[i]:
            if chosen[i - 1] == " ":
                i -= 1
            return {**record, "prompt": chosen[:i], "chosen": chosen[i:], "rejected": rejected[i:]}
    raise JaxseqError(
        "a pair without 'prompt' has chosen equal to rejected or one the start of the other; give 'prompt'"
    )


def encode_pair(tokenizer, record: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) token ids of one record, as TRL tokenises them."""
    if "prompt" not in record:
        record = extract_prompt(record)
    prompt, (chosen, rejected) = encode_completions(tokenizer, record, (record["chosen"], record["rejected"]))
    return prompt, chosen, rejected


def encode_completions(tokenizer, record: dict, completions: Sequence) -> tuple[list[int], list[list[int]]]:
    """The token ids of ``record``'s prompt and of each of ``completions`` after it, as TRL's preference
    trainers tokenise them: strings with EOS appended to each completion, conversations by the chat template
    (the prompt with the generation prompt, given ``template_kwargs(record)``); the prompt and each
    prompt+completion are tokenised apart and the completions start where they diverge."""
    prompt = record["prompt"]
    if isinstance(prompt, list) or any(isinstance(c, list) for c in completions):
        kwargs = template_kwargs(record)

        def tokens(messages, generation_prompt=False):
            return tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt, **kwargs
            )["input_ids"]

        prompt_ids = tokens(prompt, True)
        whole = [tokens(prompt + c) for c in completions]
    else:
        eos = tokenizer.eos_token
        prompt_ids = tokenizer(prompt)["input_ids"]
        whole = [tokenizer(prompt + (c if c.endswith(eos) else c + eos))["input_ids"] for c in completions]
    shared = min(_common_prefix(prompt_ids, ids) for ids in whole)
    return prompt_ids[:shared], [ids[shared:] for ids in whole]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def pair_rows(
    encoded: Sequence[tuple[list[int], list[int], list[int]]], config: PreferenceDataConfig, pad_id: int
) -> dict[str, np.ndarray]:
    """``[pairs, 2, length]`` arrays of the encoded pairs (chosen first), cut as TRL's collator cuts them and
    right-padded with ``pad_id`` to the longest sequence; pairs whose prompt fills ``max_length`` under
    ``keep_start`` are dropped, as TRL drops them."""
    seqs = []
    for prompt, chosen, rejected in encoded:
        if config.max_prompt_length is not None:
            prompt = prompt[-config.max_prompt_length :]
        if config.max_completion_length is not None:
            chosen, rejected = chosen[: config.max_completion_length], rejected[: config.max_completion_length]
        if (
            config.max_length is not None
            and config.truncation_mode == "keep_start"
            and len(prompt) >= config.max_length
        ):
            continue
        pair = []
        for completion in (chosen, rejected):
            ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
            if config.max_length is not None:
                cut = (
                    slice(None, config.max_length)
                    if config.truncation_mode == "keep_start"
                    else slice(-config.max_length, None)
                )
                ids, mask = ids[cut], mask[cut]
            pair.append((ids, mask))
        seqs.append(pair)
    if not seqs:
        raise JaxseqError(f"every pair's prompt fills --max_length {config.max_length}; raise it")
    width = max(len(ids) for pair in seqs for ids, _ in pair)
    out = {
        "input_ids": np.full((len(seqs), 2, width), pad_id, np.int32),
        "pair_mask": np.zeros((len(seqs), 2, width), np.int32),
        "completion_mask": np.zeros((len(seqs), 2, width), np.int32),
    }
    for i, pair in enumerate(seqs):
        for j, (ids, mask) in enumerate(pair):
            out["input_ids"][i, j, : len(ids)] = ids
            out["pair_mask"][i, j, : len(ids)] = 1
            out["completion_mask"][i, j, : len(ids)] = mask
    return out


def check_records(records: list, where: str) -> list[dict]:
    """The records, each with chosen and rejected (and a prompt, or one to extract); else one line."""
    if not records:
        raise JaxseqError(f"{where} has no pairs")
    if not isinstance(records[0], dict):
        raise JaxseqError(f"{where}: each record must be an object with prompt, chosen and rejected")
    require_columns(records, ["chosen", "rejected"], where)
    return records


def encode_pairs(tokenizer, records: Sequence[dict], *, progress: bool = True) -> list:
    """Every record tokenised (``encode_pair``), with a progress bar."""
    from tqdm.auto import tqdm

    if not getattr(tokenizer, "chat_template", None) and any(
        isinstance(r.get(c), list) for r in records[:1] for c in COLUMNS
    ):
        raise JaxseqError("the pairs are conversations and the tokenizer has no chat template; pass --chat_template")
    return [
        encode_pair(tokenizer, r) for r in tqdm(records, desc="tokenizing pairs", unit="pair", disable=not progress)
    ]


def load_pair_records(
    config,
    *,
    train: bool = True,
    evaluate: bool = True,
    check: Callable[[list, str], list[dict]] = check_records,
    what: str = "preference pairs",
) -> tuple[list[dict] | None, list[dict] | None]:
    """Training and validation records from the configured files or Hub dataset (``config``: a
    ``PreferenceDataConfig`` or any section with its file, dataset and sample flags), each cut to
    --max_train_samples or --max_eval_samples; None for a stage not asked for (``train``, ``evaluate``), and
    for validation where there are no validation pairs. Pairs held out by --validation_split_percentage are
    held out whichever stages run. ``check``: what a set's records must hold (default: pairs); ``what``: the
    records' name in errors."""
    splits = None
    if config.dataset_name:
        splits = {
            k: [dict(r) for r in v]
            for k, v in load_hub_dataset(config.dataset_name, config.dataset_config_name).items()
        }
    valid = (splits.get("validation") or splits.get("test")) if splits is not None else None
    if config.validation_file:
        valid = check(read_records(config.validation_file), config.validation_file)
    held_out = valid is None and config.validation_split_percentage > 0
    records = None
    if train or (evaluate and held_out):
        if splits is not None:
            if "train" not in splits:
                raise JaxseqError(f"dataset {config.dataset_name!r} has no train split (it has {', '.join(splits)})")
            records, where = splits["train"], config.dataset_name
        elif config.train_file:
            records, where = read_records(config.train_file), config.train_file
        elif train:
            raise JaxseqError(f"give the {what}: --train_file FILE.jsonl or --dataset_name NAME")
        else:
            raise JaxseqError(
                f"no validation {what} for --do_eval: pass --validation_file (or --train_file or --dataset_name "
                "with --validation_split_percentage)"
            )
        records = check(records, where)
        if held_out:
            held = max(1, int(len(records) * config.validation_split_percentage / 100))
            if held >= len(records):
                raise JaxseqError(f"{len(records)} {what} are too few to hold out a validation split; add more")
            order = np.random.default_rng(0).permutation(len(records))
            valid, records = [records[i] for i in order[:held]], [records[i] for i in order[held:]]
    records = records[: config.max_train_samples] if train else None
    valid = valid[: config.max_eval_samples] if evaluate and valid is not None else None
    return records, valid


def load_pair_rows(
    config: PreferenceDataConfig,
    tokenizer,
    *,
    progress: bool = True,
    log: Log = print,
    train: bool = True,
    evaluate: bool = True,
) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
    """Training and validation rows (``pair_rows``) of ``load_pair_records``' records."""
    records, valid = load_pair_records(config, train=train, evaluate=evaluate)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = None
    if records is not None:
        rows = pair_rows(encode_pairs(tokenizer, records, progress=progress), config, pad)
        if len(rows["input_ids"]) < len(records):
            log(f"{len(records) - len(rows['input_ids'])} pairs whose prompt fills --max_length were left out")
    if valid is None:
        return rows, None
    return rows, pair_rows(encode_pairs(tokenizer, valid, progress=progress), config, pad)
