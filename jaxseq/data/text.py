"""Causal-LM data: documents from local files or a Hub dataset, tokenized once (cached on disk), joined
with EOS between documents and cut into blocks of ``block_size`` tokens (transformers' ``run_clm``
``group_texts``: concatenate, chunk, drop the incomplete tail; the model shifts the labels itself).

Documents: a plain-text file (``.txt``, ``.text``, ``.tokens``, ``.raw``) is one document; each record of
a ``.jsonl``/``.json`` file and each row of a ``.csv``/``.tsv`` file is one (its ``--text_column``), and
so is each row of a Hub dataset. A long document is tokenized in pieces cut at line breaks between two
non-blank lines; for byte-level BPE tokenizers (GPT-2, GPT-J) that gives exactly the tokens of the whole
document, while the pieces are encoded in parallel batches with a progress bar.

The cache holds the token stream of each source (``.npy``, no pickle, keyed by a hash of the file's
bytes, or the Hub dataset's fingerprint, and of the tokenizer), not the blocks: cutting blocks is a
reshape of a memory map, so a rerun with another ``--block_size`` reuses it too.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from jaxseq.config import arg
from jaxseq.errors import JaxseqError, first_line
from jaxseq.files import atomic_write

TEXT_SUFFIXES = (".txt", ".text", ".tokens", ".raw")
JSON_SUFFIXES = (".json", ".jsonl")
CSV_SUFFIXES = (".csv", ".tsv")
CACHE_VERSION = 1  # bump when the tokenization rules change
PIECE_CHARS = 1 << 16  # a long document is encoded in pieces of about this many characters
BATCH_CHARS = 1 << 18  # characters of pieces encoded per tokenizer call
PROGRESS_CHARS = 1 << 20  # show a progress bar from this much text on
_CUT = re.compile(r"(?<=\S\n)(?=\S)")  # a line break between two non-blank lines

Log = Callable[[str], None]


@dataclasses.dataclass
class TextDataConfig:
    train_file: str | None = arg(
        None,
        "training text: .txt (one document per file), .jsonl/.json or .csv/.tsv "
        "(one document per record, see --text_column)",
    )
    validation_file: str | None = arg(
        None,
        "validation text, same formats (default: the dataset's validation "
        "split, else the last --validation_split_percentage of the blocks)",
    )
    dataset_name: str | None = arg(None, "Hugging Face Hub dataset to train on instead of --train_file, e.g. wikitext")
    dataset_config_name: str | None = arg(None, "configuration of --dataset_name, e.g. wikitext-2-raw-v1")
    text_column: str = arg("text", "column holding the text in jsonl/csv files and Hub datasets")
    block_size: int | None = arg(None, "tokens per training example (default: the model's positions, at most 1024)")
    validation_split_percentage: float = arg(
        5.0, "without a validation file or split: percentage of the training blocks held out for validation"
    )
    max_train_samples: int | None = arg(None, "use only the first N training blocks")
    max_eval_samples: int | None = arg(None, "use only the first N validation blocks")
    data_cache_dir: str | None = arg(None, "where tokenized text is cached (default ~/.cache/jaxseq/text; '' disables)")
    overwrite_cache: bool = arg(False, "tokenize again even if the cache has the result")


# --------------------------------------------------------------------------- reading documents


def read_documents(path: str | os.PathLike, text_column: str = "text") -> list[str]:
    """The documents of a local file (see the module docstring for the formats)."""
    path = Path(path)
    if not path.is_file():
        raise JaxseqError(f"text file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return [path.read_text(encoding="utf-8")]
    if suffix in JSON_SUFFIXES:
        text = path.read_text(encoding="utf-8")
        try:
            records = (
                json.loads(text)
                if text.lstrip().startswith("[")
                else [json.loads(line) for line in text.splitlines() if line.strip()]
            )
        except json.JSONDecodeError as e:
            raise JaxseqError(f"{path} is not valid JSON/JSONL: {e}") from None
    elif suffix in CSV_SUFFIXES:
        with open(path, encoding="utf-8-sig", newline="") as f:
            records = list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))
    else:
        formats = ", ".join(TEXT_SUFFIXES + JSON_SUFFIXES + CSV_SUFFIXES)
        raise JaxseqError(f"{path}: unsupported file type {suffix!r}; use one of {formats}")
    return _column(records, text_column, str(path))


def _column(records, text_column: str, where: str) -> list[str]:
    documents = []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or text_column not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise JaxseqError(f"{where} record {i + 1} has no {text_column!r} field (it has {keys}); set --text_column")
        value = record[text_column]
        documents.append("" if value is None else str(value))
    return documents


def load_hub_dataset(name: str, config_name: str | None) -> dict:
    """The splits of a Hub dataset (through ``datasets``), by split name."""
    try:
        import datasets
    except ImportError:
        raise JaxseqError("reading a Hub dataset needs `pip install datasets`; or pass --train_file") from None
    try:
        return dict(datasets.load_dataset(name, config_name))
    except Exception as e:  # datasets raises many types (offline, unknown name, missing config)
        raise JaxseqError(
            f"cannot load dataset {name!r} ({config_name or 'default config'}) from the Hugging "
            f"Face Hub ({type(e).__name__}: {first_line(e, 150)}); offline? pass "
            "--train_file"
        ) from None


# --------------------------------------------------------------------------- tokenizing


def pieces(document: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """``document`` in pieces of about ``size`` characters, cut only at a line break between two non-blank
    lines (a byte-level BPE tokenizer splits there anyway, so the tokens of the pieces are those of the
    whole); a document without such a break is one piece."""
    start = 0
    while len(document) - start > size:
        cut = _CUT.search(document, start + size)
        if cut is None:
            break
        yield document[start : cut.start()]
        start = cut.start()
    yield document[start:]


def token_dtype(tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32)


def tokenize(documents: list[str], tokenizer, *, progress: bool = True, desc: str = "tokenizing") -> np.ndarray:
    """One token stream: each non-empty document's tokens followed by EOS (no other special tokens), as
    uint16 when the vocabulary fits, else int32. In a multi-host run each process encodes a contiguous
    share of the pieces and the processes exchange their streams: the same tokens, 1/N of the work each."""
    from tqdm.auto import tqdm

    eos = tokenizer.eos_token_id
    if eos is None:
        raise JaxseqError("the tokenizer has no EOS token to put between documents; pass another --tokenizer_name")
    dtype = token_dtype(tokenizer)
    parts = [
        (piece, i == len(cut) - 1)
        for cut in map(list, map(pieces, filter(None, documents)))
        for i, piece in enumerate(cut)
    ]  # (piece, whether it ends its document: then EOS follows)
    parts = _my_share(parts)
    total = sum(len(piece) for piece, _ in parts)
    bar = tqdm(total=total, desc=desc, unit="char", unit_scale=True, disable=not progress or total < PROGRESS_CHARS)
    out: list[np.ndarray] = []
    start = size = 0
    for i, (piece, _) in enumerate(parts):
        size += len(piece)
        if size >= BATCH_CHARS or i == len(parts) - 1:
            batch = parts[start : i + 1]
            encoded = tokenizer(
                [p for p, _ in batch], add_special_tokens=False, verbose=False, return_attention_mask=False
            )
            for ids, (_, end) in zip(encoded["input_ids"], batch):
                out.append(np.asarray(ids + [eos] if end else ids, dtype=dtype))
            bar.update(size)
            start, size = i + 1, 0
    bar.close()
    return _join_shares(np.concatenate(out) if out else np.zeros((0,), dtype))


def _my_share(parts: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """This process's contiguous share of ``parts``: those starting in its fraction of the characters."""
    import jax

    count = jax.process_count()
    if count == 1:
        return parts
    sizes = np.array([len(piece) for piece, _ in parts], np.int64)
    owner = (np.cumsum(sizes) - sizes) * count // max(int(sizes.sum()), 1)
    return [part for part, rank in zip(parts, owner) if rank == jax.process_index()]


def _join_shares(tokens: np.ndarray) -> np.ndarray:
    """Every process's token stream, in process order (a no-op with one process)."""
    import jax

    if jax.process_count() == 1:
        return tokens
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(tokens))))
    padded = np.zeros(int(lengths.max()), tokens.dtype)
    padded[: len(tokens)] = tokens
    streams = np.asarray(multihost_utils.process_allgather(padded))
    return np.concatenate([stream[:n] for stream, n in zip(streams, lengths)])


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides the tokens: the fast tokenizer's full JSON and its EOS."""
    spec = tokenizer.backend_tokenizer.to_str() + f"|eos={tokenizer.eos_token_id}|{type(tokenizer).__name__}"
    return hashlib.sha256(spec.encode()).hexdigest()


def file_fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- the cache


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxseq" / "text"


class TokenCache:
    """Token streams on disk as ``<key>.npy`` (read back as a memory map) plus ``<key>.json`` saying what
    they are. Writes go to a temporary file first and are renamed into place, so a reader never sees half
    a file and concurrent writers (several processes) cannot clash."""

    def __init__(self, directory: str | os.PathLike | None, overwrite: bool = False):
        self.directory = None if directory == "" else Path(directory) if directory else default_cache_dir()
        self.overwrite = overwrite

    @staticmethod
    def key(**parts) -> str:
        return hashlib.sha256(json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True).encode()).hexdigest()[:32]

    def get_or_make(self, key: str, describe: dict, make: Callable[[], np.ndarray], log: Log) -> np.ndarray:
        if self.directory is None:
            return make()
        path = self.directory / f"{key}.npy"
        if path.is_file() and not self.overwrite:
            try:
                tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError):  # damaged by hand: tokenize again
                tokens = None
            if tokens is not None:
                log(f"{describe['source']}: {len(tokens):,} tokens from the cache ({path})")
                return tokens
        tokens = make()
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.save(f, tokens, allow_pickle=False))
        meta = json.dumps({**describe, "tokens": len(tokens), "dtype": tokens.dtype.name}, indent=2) + "\n"
        atomic_write(path.with_suffix(".json"), meta)
        log(f"{describe['source']}: {len(tokens):,} tokens, cached in {path}")
        return tokens


def file_tokens(
    path: str | os.PathLike,
    tokenizer,
    cache: TokenCache,
    *,
    text_column: str = "text",
    progress: bool = True,
    log: Log = print,
) -> np.ndarray:
    """The token stream of a local file, from the cache when its bytes and the tokenizer are unchanged."""
    path = Path(path)
    if not path.is_file():
        raise JaxseqError(f"text file {path} does not exist")
    column = text_column if path.suffix.lower() not in TEXT_SUFFIXES else None
    key = cache.key(file=file_fingerprint(path), column=column, tokenizer=tokenizer_fingerprint(tokenizer))
    describe = {"source": str(path), "text_column": column, "tokenizer": tokenizer.name_or_path}
    return cache.get_or_make(
        key,
        describe,
        lambda: tokenize(
            read_documents(path, text_column), tokenizer, progress=progress, desc=f"tokenizing {path.name}"
        ),
        log,
    )


def dataset_tokens(
    split,
    name: str,
    tokenizer,
    cache: TokenCache,
    *,
    text_column: str = "text",
    progress: bool = True,
    log: Log = print,
) -> np.ndarray:
    """The token stream of a Hub dataset split, cached under the dataset's fingerprint."""
    if text_column not in split.column_names:
        raise JaxseqError(
            f"dataset {name} has no column {text_column!r} (it has {', '.join(split.column_names)}); set --text_column"
        )
    fingerprint = getattr(split, "_fingerprint", None)

    def make():
        documents = ["" if text is None else str(text) for text in split[text_column]]
        return tokenize(documents, tokenizer, progress=progress, desc=f"tokenizing {name}")

    if fingerprint is None:
        return make()
    key = cache.key(dataset=fingerprint, column=text_column, tokenizer=tokenizer_fingerprint(tokenizer))
    return cache.get_or_make(
        key, {"source": name, "text_column": text_column, "tokenizer": tokenizer.name_or_path}, make, log
    )


# --------------------------------------------------------------------------- blocks


def group_texts(tokens: np.ndarray, block_size: int, where: str = "the text") -> np.ndarray:
    """``[n, block_size]`` blocks of consecutive tokens; the tail that does not fill a block is dropped
    (a view when ``tokens`` is a memory map: nothing is copied)."""
    if block_size < 2:
        raise JaxseqError(f"--block_size must be at least 2 (a token and the next one to predict), got {block_size}")
    n = len(tokens) // block_size
    if n == 0:
        raise JaxseqError(
            f"{where} has {len(tokens)} tokens, not enough for one block of {block_size}; "
            "lower --block_size or give more text"
        )
    return tokens[: n * block_size].reshape(n, block_size)


def split_blocks(blocks: np.ndarray, percentage: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last ``percentage`` % of the blocks (at least one) are held out."""
    if not 0 < percentage < 100:
        raise JaxseqError(f"--validation_split_percentage must be between 0 and 100, got {percentage}")
    held_out = max(1, int(len(blocks) * percentage / 100))
    if held_out >= len(blocks):
        raise JaxseqError(
            f"{len(blocks)} block(s) cannot be split into training and validation; give more text, "
            "a smaller --block_size or a --validation_file"
        )
    return blocks[:-held_out], blocks[-held_out:]


def check_sources(config: TextDataConfig) -> None:
    """Fail early (before any model is loaded) when there is no training text or a file is missing."""
    if not (config.train_file or config.dataset_name):
        raise JaxseqError("no training text: pass --train_file (txt, jsonl, csv) or --dataset_name")
    if config.train_file and config.dataset_name:
        raise JaxseqError("pass --train_file or --dataset_name, not both")
    for file in (config.train_file, config.validation_file):
        if file and not Path(file).is_file():
            raise JaxseqError(f"text file {file} does not exist")


def load_blocks(
    config: TextDataConfig, tokenizer, block_size: int, *, progress: bool = True, log: Log = print
) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) blocks ``[n, block_size]`` for ``config``: local files or a Hub dataset."""
    check_sources(config)
    cache = TokenCache(config.data_cache_dir, overwrite=config.overwrite_cache)
    kw = dict(text_column=config.text_column, progress=progress, log=log)
    if config.dataset_name:
        name = config.dataset_name + (f"/{config.dataset_config_name}" if config.dataset_config_name else "")
        splits = load_hub_dataset(config.dataset_name, config.dataset_config_name)
        if "train" not in splits:
            raise JaxseqError(f"dataset {name} has no train split (it has {', '.join(splits)})")
        train = (f"{name} train", dataset_tokens(splits["train"], f"{name} train", tokenizer, cache, **kw))
        if not config.validation_file and "validation" in splits:
            valid = (
                f"{name} validation",
                dataset_tokens(splits["validation"], f"{name} validation", tokenizer, cache, **kw),
            )
        else:
            valid = None
    else:
        train = (config.train_file, file_tokens(config.train_file, tokenizer, cache, **kw))
        valid = None
    if config.validation_file:
        valid = (config.validation_file, file_tokens(config.validation_file, tokenizer, cache, **kw))
    for where, tokens in filter(None, (train, valid)):
        if not np.any(tokens != tokenizer.eos_token_id):
            raise JaxseqError(f"{where} has no text")
    blocks = group_texts(train[1], block_size, train[0])
    if valid is None:
        train_blocks, valid_blocks = split_blocks(blocks, config.validation_split_percentage)
    else:
        train_blocks, valid_blocks = blocks, group_texts(valid[1], block_size, valid[0])
    if config.max_train_samples:
        train_blocks = train_blocks[: config.max_train_samples]
    if config.max_eval_samples:
        valid_blocks = valid_blocks[: config.max_eval_samples]
    return train_blocks, valid_blocks
