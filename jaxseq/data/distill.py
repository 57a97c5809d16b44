"""Distillation data: conversations whose last turn is the completion, tokenised as TRL's GKD trainer tokenises
them (trl 1.x ``DataCollatorForChatML``).

A record is ``messages`` (a list of ``{"role", "content"}``; the last message is the completion, the ones
before it the prompt), or ``prompt`` and ``completion`` (strings: a user turn and the assistant's answer, or
lists of messages), with the record's ``tools`` and ``chat_template_kwargs`` given to the chat template (as
``jaxseq chat`` reads them). When every step samples its own completions (``--lmbda 1``) a ``prompt`` alone
will do. The prompt is rendered with the generation prompt, the whole conversation without; the whole is
tokenised (no special tokens added) and the completion starts at the first token at or after the prompt's
last byte (a byte-level BPE tokenizer: its offsets), else after the prompt's own token count. Sequences
longer than --max_length keep their last tokens, as TRL's collator does; a row left without a prompt token is
an error.

Rows hold ``input_ids`` (right-padded with the pad id), ``attention_mask`` (1 on tokens), ``loss_mask`` (1 on
the completion's tokens: TRL's labels) and ``prompt_length``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxseq.config import arg
from jaxseq.data.chat import Chat, conversation, template_kwargs
from jaxseq.data.preference import load_pair_records
from jaxseq.errors import JaxseqError

Log = Callable[[str], None]


@dataclasses.dataclass
class DistillDataConfig:
    train_file: str | None = arg(
        None, "training conversations: .jsonl or .json records of messages, or prompt and completion"
    )
    validation_file: str | None = arg(None, "validation conversations, same format")
    dataset_name: str | None = arg(None, "Hugging Face Hub dataset of conversations instead of --train_file")
    dataset_config_name: str | None = arg(
        None, "configuration of --dataset_name (TRL's --dataset_config)", aliases=("dataset_config",)
    )
    max_length: int = arg(1024, "tokens per sequence; longer ones keep their last tokens (TRL's default 1024)")
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, for a tokenizer without its own (it is exported too)"
    )
    validation_split_percentage: float = arg(
        0.0, "without a validation file or split: percentage of the conversations held out for validation (0: none)"
    )
    max_train_samples: int | None = arg(None, "use only the first N training conversations")
    max_eval_samples: int | None = arg(None, "use only the first N validation conversations")

    def __post_init__(self):
        if self.max_length < 2:
            raise JaxseqError(f"--max_length must be at least 2, got {self.max_length}")


def read_prompt(record, where: str, prompts_only: bool) -> tuple[list[dict], list[dict] | None, dict]:
    """(prompt messages, completion messages or None, template kwargs) of one record."""
    if prompts_only and isinstance(record, dict) and "prompt" in record and "completion" not in record:
        prompt = record["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(prompt, list) or not prompt:
            raise JaxseqError(f"{where}: the prompt must be a string or a non-empty list of messages")
        return prompt, None, template_kwargs(record, where)
    chat: Chat = conversation(record, where)
    split = chat.learned_from or len(chat.messages) - 1
    if split == 0:
        raise JaxseqError(f"{where} has one message: the completion needs a prompt before it")
    return chat.messages[:split], chat.messages[split:], chat.kwargs


def _byte_level(tokenizer) -> bool:
    """Whether ``tokenizer`` is a byte-level BPE (GPT-2, Llama 3, Qwen): TRL's test, on its pre-tokenizer and
    decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and ("ByteLevel" in repr(backend.pre_tokenizer) or "ByteLevel" in repr(backend.decoder))


def encode_record(tokenizer, record, max_length: int, where: str, prompts_only: bool = False) -> tuple[list, int]:
    """(token ids, the prompt's length in them) of one record, as TRL's ``DataCollatorForChatML``."""
    prompt, completion, kwargs = read_prompt(record, where, prompts_only)
    render = lambda messages, generation: tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, **kwargs
    )
    prompt_text = render(prompt, True)
    if completion is None:
        ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        start = len(ids)
    else:
        text = render(prompt + completion, False)
        if _byte_level(tokenizer):
            encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = encoding["input_ids"]
            to_bytes = np.concatenate([[0], np.cumsum([len(ch.encode("utf-8")) for ch in text])])
            prompt_bytes = len(prompt_text.encode("utf-8"))
            starts = [int(to_bytes[s]) for s, _ in encoding["offset_mapping"]]
            start = next((i for i, s in enumerate(starts) if s >= prompt_bytes), len(ids))
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            start = len(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    if len(ids) > max_length:  # the last max_length tokens: the oldest context goes first
        start, ids = max(0, start - (len(ids) - max_length)), ids[-max_length:]
    if start == 0:
        raise JaxseqError(
            f"{where} has no prompt token left in --max_length {max_length} tokens (the completion fills them); "
            "raise --max_length"
        )
    return list(ids), min(start, len(ids))


def distill_rows(encoded: Sequence[tuple[list, int]], pad_id: int) -> dict[str, np.ndarray]:
    """The encoded records as right-padded rows (module docstring)."""
    width = max(len(ids) for ids, _ in encoded)
    out = {name: np.zeros((len(encoded), width), np.int32) for name in ("input_ids", "attention_mask", "loss_mask")}
    out["input_ids"][:] = pad_id
    for row, (ids, start) in enumerate(encoded):
        out["input_ids"][row, : len(ids)] = ids
        out["attention_mask"][row, : len(ids)] = 1
        out["loss_mask"][row, start : len(ids)] = 1
    out["prompt_length"] = np.array([start for _, start in encoded], np.int32)
    return out


def check_records(records: list, where: str) -> list[dict]:
    if not records:
        raise JaxseqError(f"{where} has no rows")
    return records


def load_distill_rows(
    config: DistillDataConfig,
    tokenizer,
    *,
    prompts_only: bool = False,
    progress: bool = True,
    train: bool = True,
    evaluate: bool = True,
) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
    """Training and validation rows from the configured files or Hub dataset (``load_pair_records``' rules);
    None for a stage not asked for and for validation where there are no validation rows. ``prompts_only``:
    training rows may be prompts alone (every step samples its completions); validation rows never."""
    from tqdm.auto import tqdm

    records, valid = load_pair_records(
        config, train=train, evaluate=evaluate, check=check_records, what="conversations"
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for name, found, prompts in (("training", records, prompts_only), ("validation", valid, False)):
        if found is None:
            out.append(None)
            continue
        bar = tqdm(found, desc=f"tokenizing {name} rows", unit="row", disable=not progress)
        encoded = [
            encode_record(tokenizer, r, config.max_length, f"{name} row {i + 1}", prompts) for i, r in enumerate(bar)
        ]
        out.append(distill_rows(encoded, pad))
    return out[0], out[1]
