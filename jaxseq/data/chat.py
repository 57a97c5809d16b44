"""Chat data for supervised fine-tuning: conversations rendered with the tokenizer's chat template, the loss
on the assistant's tokens only, optionally several conversations packed into one row.

A conversation is a JSON(L) record (or a Hub dataset row) with ``messages``, a list of ``{"role", "content"}``;
or ``prompt`` and ``completion``: strings (a user turn and the assistant's answer) or lists of messages, as in
TRL's prompt-completion format. For tool calling, as TRL's: a record's ``tools`` (a list of JSON schemas of
functions, or a JSON string of one) and ``chat_template_kwargs`` go to the template with its messages, an
assistant message may carry ``tool_calls`` (with or without ``content``), and ``tool`` messages hold the
results. Rows hold:

- ``input_ids`` ``[rows, seq]``: the rendered conversations' tokens, right-padded;
- ``attention_mask``: 0 on padding, else the conversation's number in its row (1, 2, ...: attention never
  crosses conversations, ``jaxseq.models.attention.make_mask``);
- ``position_ids``: restarting at 0 in every conversation;
- ``loss_mask``: 1 on the tokens the assistant wrote, every assistant turn with its end-of-turn tokens (of a
  prompt-completion record, those of its completion: TRL's completion mask with its assistant mask).

The assistant's tokens are found by rendering: the text of the conversation up to each assistant turn with
the generation prompt, and up to the end of that turn, must both be prefixes of the whole conversation's text;
the characters between them are the assistant's, and so are the tokens that start there (the tokenizer's
offsets). Templates need no ``{% generation %}`` markers. An assistant turn's tool calls are the assistant's;
the ``tool`` turns' results are not.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jaxseq.config import arg
from jaxseq.data.packing import first_fit_decreasing
from jaxseq.data.text import load_hub_dataset
from jaxseq.errors import JaxseqError

Log = Callable[[str], None]
ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass
class ChatDataConfig:
    train_file: str | None = arg(None, "training conversations: .jsonl or .json records (see --help's description)")
    validation_file: str | None = arg(None, "validation conversations, same format")
    dataset_name: str | None = arg(None, "Hugging Face Hub dataset of conversations instead of --train_file")
    dataset_config_name: str | None = arg(None, "configuration of --dataset_name")
    max_seq_length: int | None = arg(None, "tokens per row (default: the model's positions, at most 2048)")
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, for a tokenizer without its own (it is exported too)"
    )
    pack_sequences: bool = arg(True, "pack several conversations into each row (attention stays inside each)")
    validation_split_percentage: float = arg(
        5.0, "without a validation file or split: percentage of the conversations held out for validation"
    )
    max_train_samples: int | None = arg(None, "use only the first N training conversations")
    max_eval_samples: int | None = arg(None, "use only the first N validation conversations")


# --------------------------------------------------------------------------- reading conversations


def template_kwargs(record: dict, where: str = "a record") -> dict:
    """What TRL's trainers pass to ``apply_chat_template`` beside a row's messages: ``tools``, the row's
    function schemas (a list, or a JSON string of one as datasets often store it; None without), and the
    row's own ``chat_template_kwargs``."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise JaxseqError(f"{where}: 'tools' is not valid JSON: {e}") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise JaxseqError(f"{where}: 'tools' must be a list of JSON schemas (objects), got {tools!r:.80}")
    extra = record.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise JaxseqError(f"{where}: 'chat_template_kwargs' must be an object, got {extra!r:.80}")
    return {"tools": tools, **extra}


@dataclasses.dataclass(frozen=True)
class Chat:
    """One conversation: its messages, the keyword arguments its template gets with them (``template_kwargs``:
    the row's tools and chat_template_kwargs) and the first message whose assistant turns are learned (a
    prompt-completion record's completion: TRL's completion mask with its assistant mask)."""

    messages: list[dict]
    kwargs: dict = dataclasses.field(default_factory=dict)
    learned_from: int = 0


def _message_ok(message) -> bool:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        return False
    calls = message.get("tool_calls")
    if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
        return False
    return message.get("content") is not None or bool(calls)


def conversation(record, where: str) -> Chat:
    """The conversation of one record (``messages``, or ``prompt`` and ``completion``; ``tools``), checked."""
    if not isinstance(record, dict):
        raise JaxseqError(f"{where} is a {type(record).__name__}, not a record with 'messages'")
    learned_from = 0
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        as_turns = lambda value, role: [{"role": role, "content": value}] if isinstance(value, str) else value
        prompt = as_turns(prompt, "user")
        messages, learned_from = prompt + as_turns(completion, "assistant"), len(prompt)
    else:
        raise JaxseqError(f"{where} has neither 'messages' nor 'prompt' and 'completion' (it has {', '.join(record)})")
    if not isinstance(messages, list) or not messages:
        raise JaxseqError(f"{where}: the messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not _message_ok(message):
            roles = ", ".join(ROLES)
            raise JaxseqError(
                f"{where} message {i + 1} must be {{'role': one of {roles}, 'content': ...}} (an assistant's may "
                f"have 'tool_calls', a list, instead of 'content'), got {message!r:.80}"
            )
    if not any(m["role"] == "assistant" for m in messages[learned_from:]):
        part = " in its completion" if learned_from else ""
        raise JaxseqError(f"{where} has no assistant message{part}: there is nothing to learn from it")
    return Chat(messages, template_kwargs(record, where), learned_from)


def read_chats(path: str | Path) -> list[Chat]:
    """The conversations of a .jsonl (one record per line) or .json (a list of records) file."""
    path = Path(path)
    if not path.is_file():
        raise JaxseqError(f"conversation file {path} does not exist")
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise JaxseqError(f"{path}: conversations must be .jsonl or .json, not {path.suffix!r}")
    text = path.read_text(encoding="utf-8")
    try:
        if text.lstrip().startswith("["):
            records = [(f"{path} record {i + 1}", r) for i, r in enumerate(json.loads(text))]
        else:
            lines = enumerate(text.splitlines(), 1)
            records = [(f"{path}:{n}", json.loads(line)) for n, line in lines if line.strip()]
    except json.JSONDecodeError as e:
        raise JaxseqError(f"{path} is not valid JSON/JSONL: {e}") from None
    return [conversation(record, where) for where, record in records]


def load_hub_chats(name: str, config_name: str | None) -> dict[str, list[Chat]]:
    """The conversations of each split of a Hub dataset."""
    splits = load_hub_dataset(name, config_name)
    return {
        split: [conversation(dict(row), f"{name} {split} row {i + 1}") for i, row in enumerate(rows)]
        for split, rows in splits.items()
    }


# --------------------------------------------------------------------------- rendering and tokenizing


def use_chat_template(tokenizer, template: str | None) -> None:
    """Give ``tokenizer`` the ``template`` (text or a file) if set; stop in one line if it has none then."""
    if template:
        path = Path(template)
        tokenizer.chat_template = path.read_text(encoding="utf-8") if path.is_file() else template
    if not getattr(tokenizer, "chat_template", None):
        raise JaxseqError("the tokenizer has no chat template; pass --chat_template (a Jinja template or a file)")


def _render(tokenizer, messages, generation_prompt: bool, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def assistant_spans(
    tokenizer, chat: Chat | list[dict], where: str = "a conversation"
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the assistant wrote (one per assistant turn learned,
    its tool calls included)."""
    chat = chat if isinstance(chat, Chat) else Chat(chat)
    messages, kwargs = chat.messages, chat.kwargs
    text = _render(tokenizer, messages, False, kwargs)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < chat.learned_from:
            continue
        prefix = _render(tokenizer, messages[:i], True, kwargs) if i else ""
        end_text = _render(tokenizer, messages[: i + 1], False, kwargs)
        if not (text.startswith(prefix) and text.startswith(end_text) and len(prefix) <= len(end_text)):
            raise JaxseqError(
                f"{where}: the chat template renders turn {i + 1} differently inside the whole conversation, "
                "so the assistant's tokens cannot be found; use a template that renders turns in order"
            )
        start = len(prefix)
        spans.append((start, len(end_text)))
    return text, spans


def encode_chat(tokenizer, chat: Chat | list[dict], where: str = "a conversation") -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the rendered conversation (a ``Chat``, or its messages alone) and its loss mask (1 on the
    assistant's tokens)."""
    text, spans = assistant_spans(tokenizer, chat, where)
    if not getattr(tokenizer, "is_fast", False):
        raise JaxseqError("chat fine-tuning needs a fast tokenizer (character offsets); load one with use_fast")
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.asarray([start for start, _ in encoding["offset_mapping"]], np.int64)
    mask = np.zeros(len(starts), np.int32)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return np.asarray(encoding["input_ids"], np.int32), mask


def encode_chats(
    tokenizer, chats: Sequence[Chat | list[dict]], max_len: int, *, progress: bool = True, log: Log = print
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every conversation encoded and cut to ``max_len`` tokens; those left without an assistant token go."""
    from tqdm.auto import tqdm

    encoded, cut, dropped = [], 0, 0
    for i, chat in enumerate(tqdm(chats, desc="rendering chats", unit="chat", disable=not progress)):
        ids, mask = encode_chat(tokenizer, chat, f"conversation {i + 1}")
        cut += len(ids) > max_len
        ids, mask = ids[:max_len], mask[:max_len]
        if mask.any():
            encoded.append((ids, mask))
        else:
            dropped += 1
    if cut:
        log(f"{cut} of {len(chats)} conversations were cut to {max_len} tokens")
    if dropped:
        log(f"{dropped} conversations had no assistant token within {max_len} tokens and were left out")
    if not encoded:
        raise JaxseqError(f"no conversation has an assistant token within {max_len} tokens; raise --max_seq_length")
    return encoded


def chat_rows(encoded: Sequence[tuple[np.ndarray, np.ndarray]], seq: int, pack: bool) -> dict[str, np.ndarray]:
    """Rows of ``seq`` tokens (module docstring): one conversation each, or packed first-fit decreasing."""
    lengths = np.asarray([len(ids) for ids, _ in encoded])
    rows = first_fit_decreasing(lengths, seq) if pack else [[i] for i in range(len(encoded))]
    out = {name: np.zeros((len(rows), seq), np.int32) for name in ("input_ids", "attention_mask", "position_ids")}
    out["loss_mask"] = np.zeros((len(rows), seq), np.int32)
    for r, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, 1):
            ids, mask = encoded[i]
            span = slice(start, start + len(ids))
            out["input_ids"][r, span] = ids
            out["loss_mask"][r, span] = mask
            out["attention_mask"][r, span] = segment
            out["position_ids"][r, span] = np.arange(len(ids))
            start += len(ids)
    return out


def load_chat_rows(
    config: ChatDataConfig,
    tokenizer,
    seq: int,
    *,
    progress: bool = True,
    log: Log = print,
    train: bool = True,
    evaluate: bool = True,
) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
    """Training and validation rows of ``seq`` tokens from the configured files or Hub dataset, None for a stage
    not asked for (``train``, ``evaluate``). Without validation conversations, --validation_split_percentage of
    the training ones are held out, whichever stages run."""
    splits = load_hub_chats(config.dataset_name, config.dataset_config_name) if config.dataset_name else None
    valid = (splits.get("validation") or splits.get("test")) if splits is not None else None
    if config.validation_file:
        valid = read_chats(config.validation_file)
    chats = None
    if train or valid is None:
        if splits is not None and "train" not in splits:
            raise JaxseqError(f"dataset {config.dataset_name!r} has no train split (it has {', '.join(splits)})")
        if splits is not None:
            chats = splits["train"]
        elif config.train_file:
            chats = read_chats(config.train_file)
        elif train:
            raise JaxseqError("give the conversations: --train_file FILE.jsonl or --dataset_name NAME")
        else:
            raise JaxseqError(
                "no validation conversations for --do_eval: pass --validation_file (or --train_file or "
                "--dataset_name, to hold out --validation_split_percentage of them)"
            )
    if valid is None:
        held = max(1, int(len(chats) * config.validation_split_percentage / 100))
        if held >= len(chats):
            raise JaxseqError(f"{len(chats)} conversations are too few to hold out a validation split; add more")
        order = np.random.default_rng(0).permutation(len(chats))
        valid, chats = [chats[i] for i in order[:held]], [chats[i] for i in order[held:]]

    def rows(chats):
        return chat_rows(encode_chats(tokenizer, chats, seq, progress=progress, log=log), seq, config.pack_sequences)

    return (
        rows(chats[: config.max_train_samples]) if train else None,
        rows(valid[: config.max_eval_samples]) if evaluate else None,
    )
