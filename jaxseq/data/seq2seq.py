"""Source/target pairs for sequence-to-sequence fine-tuning (T5): read from csv/tsv/json/jsonl, tokenised
to fixed-length arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxseq.data.records import read_records, require_columns
from jaxseq.errors import JaxseqError


def load_pairs(path: str | Path, source_column: str, target_column: str) -> list[tuple[str, str]]:
    """``(source, target)`` strings of every record of a user's file."""
    records = read_records(path)
    require_columns(records, [source_column, target_column], path)
    if not records:
        raise JaxseqError(f"{path} holds no examples")
    return [(str(r[source_column]), str(r[target_column])) for r in records]


def encode_pairs(
    pairs: list[tuple[str, str]], tokenizer, max_source_length: int, max_target_length: int, source_prefix: str = ""
) -> dict[str, np.ndarray]:
    """``input_ids``/``attention_mask`` ``[n, max_source_length]`` of the prefixed sources, and ``labels``/
    ``decoder_attention_mask`` ``[n, max_target_length]`` of the targets (with the tokenizer's EOS; padding
    masked). Longer texts are truncated."""
    sources = [source_prefix + s for s, _ in pairs]
    kw = dict(padding="max_length", truncation=True, return_tensors="np")
    source = tokenizer(sources, max_length=max_source_length, **kw)
    target = tokenizer(text_target=[t for _, t in pairs], max_length=max_target_length, **kw)
    return {
        "input_ids": source["input_ids"].astype(np.int32),
        "attention_mask": source["attention_mask"].astype(np.int32),
        "labels": target["input_ids"].astype(np.int32),
        "decoder_attention_mask": target["attention_mask"].astype(np.int32),
    }
