"""Token classification data (named entities, as transformers' run_ner.py): examples of words and one tag per
word, from a csv/json file or a Hub dataset; labels on each word's first sub-token (all of its sub-tokens with
``label_all_tokens``, a ``B-`` tag becoming its ``I-`` tag after the first), -100 elsewhere."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from jaxseq.data.batches import IGNORE
from jaxseq.data.records import read_records, require_columns
from jaxseq.errors import JaxseqError


def read_examples(path, text_column: str, label_column: str | None, tags_required: bool = True) -> list[dict]:
    """A csv/json(l) file's records, each with a list of words and (if ``label_column``) one tag per word; a
    csv cell holding a list is read as JSON (``["EU", "rejects"]``). Without ``tags_required`` (a test file) a
    file lacking the tag column is read without tags."""
    records = read_records(path)
    if not tags_required and records and label_column not in records[0]:
        label_column = None
    require_columns(records, [text_column] + ([label_column] if label_column else []), path)
    for i, record in enumerate(records):
        for column in (text_column, label_column):
            if column and isinstance(record.get(column), str):
                try:
                    record[column] = json.loads(record[column])
                except json.JSONDecodeError:
                    raise JaxseqError(f"{path} row {i}: column {column!r} is not a list of words or tags") from None
        check_example(record, text_column, label_column, f"{path} row {i}")
    return records


def check_example(record: dict, text_column: str, label_column: str | None, where: str) -> None:
    words = record[text_column]
    if not isinstance(words, list):
        raise JaxseqError(f"{where}: column {text_column!r} must be a list of words, got {type(words).__name__}")
    if label_column and len(record[label_column]) != len(words):
        raise JaxseqError(
            f"{where}: {len(words)} words but {len(record[label_column])} tags in {label_column!r}; give one tag a word"
        )


def label_list(examples: Sequence[dict], label_column: str) -> list[str]:
    """The tags of ``examples``, sorted (run_ner's ``get_label_list``)."""
    return sorted({str(tag) for example in examples for tag in example[label_column]})


def b_to_i(labels: Sequence[str]) -> list[int]:
    """For each label id, the id of the tag a word's later sub-tokens take with ``label_all_tokens``: its
    ``I-`` tag for a ``B-`` tag that has one, else itself (run_ner's ``b_to_i_label``)."""
    index = {name: i for i, name in enumerate(labels)}
    return [index.get("I-" + name[2:], i) if name.startswith("B-") else i for i, name in enumerate(labels)]


def encode(
    examples: Sequence[dict],
    tokenizer,
    *,
    text_column: str,
    label_column: str | None,
    label_to_id: dict,
    max_seq_length: int,
    label_all_tokens: bool = False,
) -> dict[str, np.ndarray]:
    """``input_ids``, ``attention_mask`` (``token_type_ids`` if the tokenizer makes them) and ``labels``, each
    ``[n, max_seq_length]``, words truncated past the length as run_ner's ``tokenize_and_align_labels``. Without
    tags (a test file) every word's first sub-token is labelled 0, so predictions are kept one a word."""
    words = [list(map(str, e[text_column])) for e in examples]
    enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_seq_length, padding="max_length")
    later = b_to_i(list(label_to_id)) if label_all_tokens else None
    labels = np.full((len(examples), max_seq_length), IGNORE, np.int32)
    for row, example in enumerate(examples):
        tags = example.get(label_column) if label_column else None
        previous = None
        for position, word in enumerate(enc.word_ids(row)):
            if word is not None:
                tag = 0 if tags is None else label_id(label_to_id, tags[word])
                if word != previous:
                    labels[row, position] = tag
                elif label_all_tokens:
                    labels[row, position] = later[tag]
            previous = word
    arrays = {k: np.asarray(enc[k], np.int32) for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
    return {**arrays, "labels": labels}


def label_id(label_to_id: dict, tag) -> int:
    if str(tag) not in label_to_id:
        raise JaxseqError(f"tag {tag!r} is not one of the labels {', '.join(label_to_id)}; add it to the training data")
    return label_to_id[str(tag)]
