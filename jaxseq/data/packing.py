"""Sequence packing for classification and tagging: several short examples share one row of the fixed
length, so the model computes on real tokens instead of padding (SST-2 averages 13 real tokens of 64, CoNLL-2003
sentences 21 of 128).

A packed batch of ``n`` examples in ``rows`` rows of length ``seq`` holds:

- ``input_ids``, ``token_type_ids`` ``[rows, seq]``: the examples' tokens side by side;
- ``attention_mask`` ``[rows, seq]``: segment ids, 1, 2, ... for the examples of a row and 0 for padding.
  Attention stays inside a segment (``jaxseq.models.attention.make_mask``); a 0/1 padding mask is the
  one-segment case, so unpacked batches need nothing special;
- ``position_ids`` ``[rows, seq]``: restarting at 0 in every segment;
- ``pool_index`` ``[n]``: the flat position (``row * seq + column``) of each example's pooled token
  (its first token for BERT's [CLS], its last for GPT-style classifiers), in the original order, so
  ``labels`` and every other per-example array stay as they are;
- or, packed for token classification (``TOKENS``: no pooled token), ``labels`` ``[rows, seq]``: each token's
  own label beside it, ``IGNORE`` on padding; or, for evaluation (``token_index``), the labels left one row
  an example and ``token_index`` ``[n, seq]``: the flat position of each of an example's columns, so that
  per-token outputs gathered there are laid out as the unpacked example's.

Per example the math is the same as unpacked; only the layout changes. Rows are filled first-fit
decreasing; the row counts are fixed for a whole run: a few of them (``row_buckets``), each batch taking the
smallest that holds it, one compilation each.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

import numpy as np

from jaxseq.data.batches import IGNORE

TOKEN_ARRAYS = ("input_ids", "token_type_ids")
ROW_ARRAYS = (*TOKEN_ARRAYS, "attention_mask", "position_ids")  # one a packed row (``pack``'s others: an example)
TOKENS = "tokens"  # pack for token classification: every token keeps its label, nothing is pooled


def first_fit_decreasing(lengths: np.ndarray, seq: int) -> list[list[int]]:
    """First-fit decreasing: example indices per row, each row holding at most ``seq`` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(seq - lengths[i])
    return rows


def lengths(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """Real tokens of each example."""
    return (np.asarray(arrays["attention_mask"]) != 0).sum(axis=1)


def rows_needed(batches: Iterable[Mapping[str, np.ndarray]]) -> int:
    """Rows enough to pack every batch (given as its arrays)."""
    return max(len(first_fit_decreasing(lengths(b), b["input_ids"].shape[1])) for b in batches)


def packed_batches(lengths: np.ndarray, seq: int, rows: int, multiple: int = 1) -> list[tuple]:
    """Examples of ``lengths`` tokens packed all at once (first-fit decreasing) into rows of ``seq``, the rows
    taken ``rows`` at a time (evaluation): per batch ``(index, valid, assignment)``, ``index`` its examples,
    as many in every batch (a multiple of ``multiple``: the last ones repeat its first and are not ``valid``),
    ``assignment`` the positions in ``index`` of each row's examples (``pack``'s)."""
    filled = first_fit_decreasing(lengths, seq)
    groups = [filled[start : start + rows] for start in range(0, len(filled), rows)]
    if not groups:
        return []
    width = -(-max(sum(map(len, group)) for group in groups) // multiple) * multiple
    out = []
    for group in groups:
        members = [i for row in group for i in row]
        ends = np.cumsum([0, *map(len, group)])
        index = np.array(members + members[:1] * (width - len(members)))
        assignment = [list(range(a, b)) for a, b in itertools.pairwise(ends)]
        out.append((index, np.arange(width) < len(members), assignment))
    return out


COMPILE_TOKENS = 8192
"""A compilation costs about as much as training this many tokens: MiniLM's scanned train step compiles in
about 4.5 s on two CPU cores, which train 0.55 ms a token at 128 tokens a row (NER), 0.75 at 384 (QA)."""


def row_buckets(needed: np.ndarray, seq: int, most: int = 3, gain: float = 0.05) -> list[int]:
    """A few row counts (of ``seq`` tokens) for batches that need ``needed`` rows each (each batch takes the
    smallest count that holds it): the largest, plus smaller ones (at most ``most`` in all) while each saves
    at least ``gain`` of the rows computed and more tokens than its compilation costs (``COMPILE_TOKENS``)."""
    needed = np.asarray(needed)

    def rows(counts):
        counts = np.sort(counts)
        return int(counts[np.searchsorted(counts, needed)].sum())

    buckets = [int(needed.max())]
    while len(buckets) < most:
        options = [(rows([*buckets, c]), int(c)) for c in np.unique(needed) if c not in buckets]
        saving = rows(buckets) - min(options)[0] if options else 0
        if saving <= 0 or saving < max(gain * rows(buckets), COMPILE_TOKENS / seq):
            break
        buckets.append(min(options)[1])
    return sorted(buckets)


def pack(
    batch: Mapping[str, np.ndarray],
    rows: int,
    pool: str = "first",
    first_row: int = 0,
    assignment: list[list[int]] | None = None,
    token_index: bool = False,
) -> dict[str, np.ndarray]:
    """Pack the examples of ``batch`` (rows of one example each, any padding side) into ``rows`` rows.
    ``pool`` is ``"first"`` or ``"last"``: which token of each example ``pool_index`` points at; ``TOKENS``:
    the per-token ``labels`` are packed beside their tokens, and there is no ``pool_index``; with
    ``token_index`` they stay one row an example and ``token_index`` gives each column's flat position (its
    example's first token where the example has no token).
    ``first_row``: where these rows start in the whole batch (a process packs its own slice of a
    multi-host batch; ``pool_index`` counts from the whole batch's first row). ``assignment``: the examples of
    each row (default: ``first_fit_decreasing``)."""
    ids = np.asarray(batch["input_ids"])
    n, seq = ids.shape
    real = np.asarray(batch["attention_mask"]) != 0
    lengths = real.sum(axis=1)
    assignment = first_fit_decreasing(lengths, seq) if assignment is None else assignment
    if len(assignment) > rows:
        raise ValueError(f"{n} examples need {len(assignment)} packed rows, more than the {rows} allowed")
    packs_labels = pool == TOKENS and not token_index
    names = (*TOKEN_ARRAYS, *(("labels",) if packs_labels else ()))
    columns = {name: np.asarray(batch[name]) for name in names if name in batch}
    out = {name: np.zeros((rows, seq), np.int32) for name in (*columns, "attention_mask", "position_ids")}
    if packs_labels:
        out["labels"] = np.full((rows, seq), IGNORE, columns["labels"].dtype)
    pool_index = np.zeros(n, np.int32)
    positions = np.zeros((n, seq), np.int32)
    for r, members in enumerate(assignment):
        start = 0
        for segment, i in enumerate(members, 1):
            length = lengths[i]
            span = slice(start, start + length)
            for name, values in columns.items():
                out[name][r, span] = values[i][real[i]]
            out["attention_mask"][r, span] = segment
            out["position_ids"][r, span] = np.arange(length)
            first = (first_row + r) * seq + start
            pool_index[i] = first + (length - 1 if pool == "last" else 0)
            positions[i] = first
            positions[i, real[i]] += np.arange(length, dtype=np.int32)
            start += length
    passthrough = {k: v for k, v in batch.items() if k not in (*columns, "attention_mask")}
    index = {"token_index": positions} if token_index else {} if pool == TOKENS else {"pool_index": pool_index}
    return {**out, **index, **passthrough}
