"""Causal-LM data: documents from local files or a Hub dataset, tokenized once (cached on disk), joined
with EOS between documents and cut into blocks of ``block_size`` tokens (transformers' ``run_clm``
``group_texts``: concatenate, chunk, drop the incomplete tail; the model shifts the labels itself).

Documents: a plain-text file (``.txt``, ``.text``, ``.tokens``, ``.raw``) is one document; each record of
a ``.jsonl``/``.json`` file and each row of a ``.csv``/``.tsv`` file is one (its ``--text_column``), and
so is each row of a Hub dataset. Files are read through ``datasets``' text, json and csv builders. A long
document is tokenized in pieces cut at line breaks between two non-blank lines; for byte-level BPE
tokenizers (GPT-2, GPT-J) that gives exactly the tokens of the whole document, while the pieces are
encoded in parallel batches with a progress bar.

With ``--streaming`` nothing is ever held whole: the text is read as a stream (``datasets``' streaming
mode; a Hub dataset is not downloaded in full), a batch of pieces at a time, and its tokens are written
straight into the cache file, so host memory stays bounded whatever the corpus size. Without it the
documents are read into memory first. In a multi-host run each process tokenizes a share either way.

The cache holds the token stream of each source (``.npy``, no pickle, keyed by a hash of the file's
bytes, or the Hub dataset's fingerprint, and of the tokenizer), not the blocks: cutting blocks is a
reshape of a memory map, so a rerun with another ``--block_size`` reuses it too. Both modes write the
same tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

import numpy as np

from jaxseq.config import arg
from jaxseq.errors import JaxseqError, first_line
from jaxseq.files import atomic_write

TEXT_SUFFIXES = (".txt", ".text", ".tokens", ".raw")
JSON_SUFFIXES = (".json", ".jsonl")
CSV_SUFFIXES = (".csv", ".tsv")
CACHE_VERSION = 2  # bump when the tokenization rules change
PIECE_CHARS = 1 << 16  # a long document is encoded in pieces of about this many characters
LIMIT_PIECES = 16  # ... and of at most this many times as many, where it has no safe break
BATCH_CHARS = 1 << 18  # characters of pieces encoded per tokenizer call
PROGRESS_CHARS = 1 << 20  # show a progress bar from this much text on
_CUT = re.compile(r"(?<=\S\n)(?=\S)")  # a line break between two non-blank lines
READ_BATCH = 1000  # records (a text file's lines) read from datasets at a time
READ_CHARS = 1 << 20  # characters of a text file datasets reads at a time
NPY_HEADER = 128  # bytes of a one-dimensional .npy array's header (version 1.0, padded to 64-byte lines)

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
    streaming: bool = arg(
        False,
        "read the text as a stream (datasets' streaming mode; a Hub dataset is not downloaded in full) and write "
        "its tokens straight to the cache, so host memory stays bounded whatever the corpus size (a streamed Hub "
        "dataset has no fingerprint: it is tokenized again on each run)",
    )


# --------------------------------------------------------------------------- reading documents


def _builder(path: Path, text_column: str = "text") -> tuple[str, dict]:
    """The ``datasets`` builder that reads ``path``, and its options."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text", {"keep_linebreaks": True, "chunksize": READ_CHARS}  # its lines, joined: the text exactly
    if suffix in JSON_SUFFIXES:
        return "json", {}
    if suffix in CSV_SUFFIXES:  # the text as written ("NA" stays "NA", "007" stays "007")
        sep = "\t" if suffix == ".tsv" else ","
        return "csv", {"sep": sep, "na_filter": False, "converters": {text_column: str}, "encoding": "utf-8-sig"}
    formats = ", ".join(TEXT_SUFFIXES + JSON_SUFFIXES + CSV_SUFFIXES)
    raise JaxseqError(f"{path}: unsupported file type {suffix!r}; use one of {formats}")


def records(path: str | os.PathLike, text_column: str = "text") -> Iterator[str]:
    """The ``text_column`` of a local file's records in order, read by ``datasets`` (streaming) a batch at a
    time; a text file's records are its lines, line breaks kept."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise JaxseqError(f"text file {path} does not exist")
    builder, options = _builder(path, text_column)
    column = "text" if builder == "text" else text_column
    stream = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
    try:
        yield from _column(stream.iter(batch_size=READ_BATCH), column, str(path), field="field")
    except JaxseqError:
        raise
    except Exception as e:  # datasets and pyarrow raise many types for a malformed file
        raise JaxseqError(
            f"cannot read {path} with datasets' {builder} builder ({type(e).__name__}: {first_line(e, 150)})"
        ) from None


def read_documents(path: str | os.PathLike, text_column: str = "text") -> Iterator[str]:
    """The documents of a local file (see the module docstring for the formats)."""
    lines = records(path, text_column)
    if _builder(Path(path))[0] != "text":
        yield from lines
        return
    whole = io.StringIO()
    for line in lines:
        whole.write(line)
    yield whole.getvalue()


def _column(batches: Iterable[dict], column: str, where: str, field: str = "column") -> Iterator[str]:
    for batch in batches:
        if column not in batch:
            raise JaxseqError(f"{where} has no {column!r} {field} (it has {', '.join(batch)}); set --text_column")
        for value in batch[column]:
            yield "" if value is None else str(value)


def document_parts(documents: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """``(piece, whether it ends its document)`` for every non-empty document, cut by ``pieces``."""
    for document in documents:
        if document:
            cut = list(pieces(document))
            yield from ((piece, i == len(cut) - 1) for i, piece in enumerate(cut))


def file_parts(path: str | os.PathLike, text_column: str = "text") -> Iterator[tuple[str, bool]]:
    """``document_parts`` of a local file, read as a stream: a text file's lines are gathered into pieces
    cut where ``pieces`` cuts, so no more than about two pieces' limit of it is ever held."""
    if _builder(Path(path))[0] != "text":
        yield from document_parts(records(path, text_column))
        return
    held, size = [], 0
    for line in records(path):
        held.append(line)
        size += len(line)
        if size > 2 * LIMIT_PIECES * PIECE_CHARS:  # more than the longest piece: the cuts are the whole's
            *done, rest = pieces("".join(held))
            yield from ((piece, False) for piece in done)
            held, size = [rest], len(rest)
    if size:
        yield "".join(held), True


def load_hub_dataset(name: str, config_name: str | None, streaming: bool = False) -> dict:
    """The splits of a Hub dataset (through ``datasets``), by split name; streamed ones with ``streaming``."""
    try:
        import datasets
    except ImportError:
        raise JaxseqError("reading a Hub dataset needs `pip install datasets`; or pass --train_file") from None
    try:
        return dict(datasets.load_dataset(name, config_name, streaming=streaming))
    except Exception as e:  # datasets raises many types (offline, unknown name, missing config)
        raise JaxseqError(
            f"cannot load dataset {name!r} ({config_name or 'default config'}) from the Hugging "
            f"Face Hub ({type(e).__name__}: {first_line(e, 150)}); offline? pass "
            "--train_file"
        ) from None


# --------------------------------------------------------------------------- tokenizing


def pieces(document: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """``document`` in pieces of about ``size`` characters, cut at a line break between two non-blank lines
    (a byte-level BPE tokenizer splits there anyway, so the tokens of the pieces are those of the whole).
    Where no such break comes within ``LIMIT_PIECES`` x ``size`` characters (double-spaced text), the piece
    ends at the last line break before that, where a run of blank lines may tokenize differently; where
    there is no line break at all, at that length. Each cut depends only on the text from the piece's start
    to that limit, so a stream cuts where the whole document does."""
    limit = LIMIT_PIECES * size
    start = 0
    while len(document) - start > size:
        cut = _CUT.search(document, start + size, start + limit)
        if cut is not None:
            end = cut.start()
        elif len(document) - start <= limit:
            break
        else:
            end = document.rfind("\n", start + size, start + limit) + 1 or start + limit
        yield document[start:end]
        start = end
    yield document[start:]


def token_dtype(vocab_size: int) -> np.dtype:
    """How token ids of a vocabulary of ``vocab_size`` are stored and fed: uint16 when they fit, else int32."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)


def _eos(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise JaxseqError("the tokenizer has no EOS token to put between documents; pass another --tokenizer_name")
    return tokenizer.eos_token_id


def _encoded(parts: Iterable[tuple[str, bool]], tokenizer, bar, *, share: bool = False) -> Iterator[np.ndarray]:
    """The tokens of ``parts`` in order, one array per tokenizer call of about ``BATCH_CHARS`` characters of
    pieces, EOS after each piece that ends its document. ``share``: in a multi-host run process ``p`` encodes
    every batch ``i`` with ``i % processes == p``, and each round of batches is exchanged: every process
    gets every array, having encoded 1/N of them (and held one round at a time)."""
    import jax

    eos, dtype = _eos(tokenizer), token_dtype(len(tokenizer))
    count, index = (jax.process_count(), jax.process_index()) if share else (1, 0)
    mine, batch, size, i = None, [], 0, 0
    for part in itertools.chain(parts, [None]):  # None: the end, which flushes the last batch and round
        if part is not None:
            batch.append(part)
            size += len(part[0])
        if batch and (part is None or size >= BATCH_CHARS):
            if i % count == index:
                mine = _encode(batch, tokenizer, eos, dtype)
            bar.update(size)
            batch, size, i = [], 0, i + 1
            if i % count == 0:
                yield from _exchange(mine, dtype, count)
                mine = None
    if i % count:
        yield from _exchange(mine, dtype, count)


def _exchange(mine: np.ndarray | None, dtype, count: int) -> list[np.ndarray]:
    """Every process's array of one round, in process order (``mine`` with one process)."""
    mine = np.zeros((0,), dtype) if mine is None else mine
    if count == 1:
        return [mine]
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(mine))))
    padded = np.zeros(max(int(lengths.max()), 1), dtype)
    padded[: len(mine)] = mine
    arrays = np.asarray(multihost_utils.process_allgather(padded))
    return [array[:n] for array, n in zip(arrays, lengths)]


def _encode(batch: list[tuple[str, bool]], tokenizer, eos: int, dtype) -> np.ndarray:
    encoded = tokenizer([p for p, _ in batch], add_special_tokens=False, verbose=False, return_attention_mask=False)
    out = [np.asarray(ids + [eos] if end else ids, dtype=dtype) for ids, (_, end) in zip(encoded["input_ids"], batch)]
    return np.concatenate(out) if out else np.zeros((0,), dtype)


def tokenize(documents: list[str], tokenizer, *, progress: bool = True, desc: str = "tokenizing") -> np.ndarray:
    """One token stream: each non-empty document's tokens followed by EOS (no other special tokens), as
    uint16 when the vocabulary fits, else int32. In a multi-host run each process encodes a contiguous
    share of the pieces and the processes exchange their streams: the same tokens, 1/N of the work each."""
    from tqdm.auto import tqdm

    _eos(tokenizer)
    parts = _my_share(list(document_parts(documents)))
    total = sum(len(piece) for piece, _ in parts)
    bar = tqdm(total=total, desc=desc, unit="char", unit_scale=True, disable=not progress or total < PROGRESS_CHARS)
    out = list(_encoded(parts, tokenizer, bar))
    bar.close()
    return _join_shares(np.concatenate(out) if out else np.zeros((0,), token_dtype(len(tokenizer))))


def write_tokens(f: IO[bytes], parts: Iterable[tuple[str, bool]], tokenizer, *, progress: bool, desc: str) -> int:
    """``tokenize``'s stream for ``parts`` written to ``f`` as a ``.npy`` file a batch at a time (the header,
    which holds the length, last): nothing but a round of batches is ever in memory. In a multi-host run each
    process encodes a share of the batches and writes all of them. Returns the number of tokens."""
    from tqdm.auto import tqdm

    _eos(tokenizer)
    dtype = token_dtype(len(tokenizer))
    f.write(b"\0" * NPY_HEADER)
    count = 0
    with tqdm(desc=desc, unit="char", unit_scale=True, disable=not progress) as bar:
        for tokens in _encoded(parts, tokenizer, bar, share=True):
            f.write(tokens.tobytes())
            count += len(tokens)
    header = io.BytesIO()
    info = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)}
    np.lib.format.write_array_header_1_0(header, info)
    assert len(header.getvalue()) == NPY_HEADER, "a 1-D .npy header is 128 bytes"
    f.seek(0)
    f.write(header.getvalue())
    return count


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
        for chunk in iter(lambda: f.read(1 << 20), b""):
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

    def get_or_make(self, key: str, describe: dict, make: Callable, log: Log, *, streamed: bool = False) -> np.ndarray:
        """The cached tokens under ``key``, or ``make()``'s (cached). ``streamed``: ``make(f)`` writes them to
        ``f`` as a ``.npy`` file instead (``write_tokens``), straight into the cache; they are read back as a
        memory map."""
        if self.directory is None:
            return _temporary_npy(make) if streamed else make()
        path = self.directory / f"{key}.npy"
        if path.is_file() and not self.overwrite:
            try:
                tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError):  # damaged by hand: tokenize again
                tokens = None
            if tokens is not None:
                log(f"{describe['source']}: {len(tokens):,} tokens from the cache ({path})")
                return tokens
        self.directory.mkdir(parents=True, exist_ok=True)
        if streamed:
            atomic_write(path, make)
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            tokens = make()
            atomic_write(path, lambda f: np.save(f, tokens, allow_pickle=False))
        meta = json.dumps({**describe, "tokens": len(tokens), "dtype": tokens.dtype.name}, indent=2) + "\n"
        atomic_write(path.with_suffix(".json"), meta)
        log(f"{describe['source']}: {len(tokens):,} tokens, cached in {path}")
        return tokens


def _temporary_npy(write: Callable[[IO[bytes]], object]) -> np.ndarray:
    """What ``write`` writes as a ``.npy`` file, in a temporary file read back as a memory map (which outlives
    the file's name)."""
    with tempfile.NamedTemporaryFile(prefix="jaxseq-tokens-", suffix=".npy") as f:
        write(f)
        f.flush()
        return np.load(f.name, mmap_mode="r", allow_pickle=False)


def file_tokens(
    path: str | os.PathLike,
    tokenizer,
    cache: TokenCache,
    *,
    text_column: str = "text",
    streaming: bool = False,
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
    desc = f"tokenizing {path.name}"
    if streaming:
        write = lambda f: write_tokens(f, file_parts(path, text_column), tokenizer, progress=progress, desc=desc)
        return cache.get_or_make(key, describe, write, log, streamed=True)
    make = lambda: tokenize(list(read_documents(path, text_column)), tokenizer, progress=progress, desc=desc)
    return cache.get_or_make(key, describe, make, log)


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
    """The token stream of a Hub dataset split, cached under the dataset's fingerprint; a streamed split
    (``datasets.IterableDataset``) is read a batch at a time and its tokens written to disk as they come."""
    columns = split.column_names
    if columns is not None and text_column not in columns:
        raise JaxseqError(
            f"dataset {name} has no column {text_column!r} (it has {', '.join(columns)}); set --text_column"
        )
    desc = f"tokenizing {name}"
    if isinstance(split, _iterable_dataset()):
        documents = _column(split.iter(batch_size=READ_BATCH), text_column, f"dataset {name}")
        write = lambda f: write_tokens(f, document_parts(documents), tokenizer, progress=progress, desc=desc)
        return _temporary_npy(write)
    fingerprint = getattr(split, "_fingerprint", None)

    def make():
        documents = ["" if text is None else str(text) for text in split[text_column]]
        return tokenize(documents, tokenizer, progress=progress, desc=desc)

    if fingerprint is None:
        return make()
    key = cache.key(dataset=fingerprint, column=text_column, tokenizer=tokenizer_fingerprint(tokenizer))
    return cache.get_or_make(
        key, {"source": name, "text_column": text_column, "tokenizer": tokenizer.name_or_path}, make, log
    )


def _iterable_dataset() -> type:
    import datasets

    return datasets.IterableDataset


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


def count(rows) -> int:
    """How many rows (blocks, examples) ``rows`` has: 0 for None, a stage's data not read."""
    return 0 if rows is None else len(rows)


def check_sources(config: TextDataConfig, *, train: bool = True, evaluate: bool = True) -> None:
    """Fail early (before any model is loaded) when a stage asked for (``train``, ``evaluate``) has no text
    or a file is missing. Evaluation alone reads the validation text, else holds it out of the training text."""
    if train and not (config.train_file or config.dataset_name):
        raise JaxseqError("no training text: pass --train_file (txt, jsonl, csv) or --dataset_name")
    if evaluate and not (config.validation_file or config.train_file or config.dataset_name):
        raise JaxseqError(
            "no validation text for --do_eval: pass --validation_file (or --train_file or --dataset_name, to hold "
            "out --validation_split_percentage of it)"
        )
    if config.train_file and config.dataset_name:
        raise JaxseqError("pass --train_file or --dataset_name, not both")
    for file in (config.train_file, config.validation_file):
        if file and not Path(file).is_file():
            raise JaxseqError(f"text file {file} does not exist")


def _has_text(tokens: np.ndarray, eos: int, chunk: int = 1 << 20) -> bool:
    """Whether any token is not EOS, reading a memory map a chunk at a time (usually only the first)."""
    return any(np.any(tokens[i : i + chunk] != eos) for i in range(0, len(tokens), chunk))


def load_blocks(
    config: TextDataConfig,
    tokenizer,
    block_size: int,
    *,
    progress: bool = True,
    log: Log = print,
    train: bool = True,
    evaluate: bool = True,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(train, validation) blocks ``[n, block_size]`` for ``config``: local files or a Hub dataset; None for a
    stage not asked for (``train``, ``evaluate``). Without a validation file or split, the validation blocks
    are the last --validation_split_percentage of the training text's, held out whichever stages run."""
    check_sources(config, train=train, evaluate=evaluate)
    cache = TokenCache(config.data_cache_dir, overwrite=config.overwrite_cache)
    kw = dict(text_column=config.text_column, progress=progress, log=log)
    files = dict(kw, streaming=config.streaming)
    splits, name = None, config.dataset_name
    if config.dataset_name:
        name += f"/{config.dataset_config_name}" if config.dataset_config_name else ""
        splits = load_hub_dataset(config.dataset_name, config.dataset_config_name, config.streaming)
    held_out = not config.validation_file and not (splits and "validation" in splits)
    text, valid = None, None
    if train or held_out:
        if splits is None:
            text = (config.train_file, file_tokens(config.train_file, tokenizer, cache, **files))
        elif "train" not in splits:
            raise JaxseqError(f"dataset {name} has no train split (it has {', '.join(splits)})")
        else:
            text = (f"{name} train", dataset_tokens(splits["train"], f"{name} train", tokenizer, cache, **kw))
    if evaluate and config.validation_file:
        valid = (config.validation_file, file_tokens(config.validation_file, tokenizer, cache, **files))
    elif evaluate and not held_out:
        valid = (
            f"{name} validation",
            dataset_tokens(splits["validation"], f"{name} validation", tokenizer, cache, **kw),
        )
    for where, tokens in filter(None, (text, valid)):
        if not _has_text(tokens, tokenizer.eos_token_id):
            raise JaxseqError(f"{where} has no text")
    train_blocks = valid_blocks = None
    if text is not None:
        train_blocks = group_texts(text[1], block_size, text[0])
        if held_out:
            train_blocks, valid_blocks = split_blocks(train_blocks, config.validation_split_percentage)
    if valid is not None:
        valid_blocks = group_texts(valid[1], block_size, valid[0])
    if not train:
        train_blocks = None
    elif config.max_train_samples:
        train_blocks = train_blocks[: config.max_train_samples]
    if not evaluate:
        valid_blocks = None
    elif config.max_eval_samples:
        valid_blocks = valid_blocks[: config.max_eval_samples]
    return train_blocks, valid_blocks
