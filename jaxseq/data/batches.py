"""Fixed-shape batches: the same shapes every step (one compilation), a data order fixed by seed and epoch
(so a resumed run sees the same batches), and evaluation that keeps every example (the last batch is
padded and its padding masked out)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

IGNORE = -100  # the label of a position no loss reads (transformers' ignore index)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of ``n`` examples in ``epoch``: a pure function of (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Full batches per epoch (training drops the incomplete last batch, keeping shapes static)."""
    return n // batch_size


def train_indices(n: int, batch_size: int, seed: int, start_step: int = 0) -> Iterator[np.ndarray]:
    """Endless global training batches as example indices, starting at ``start_step`` (epoch = step //
    steps_per_epoch)."""
    per_epoch = steps_per_epoch(n, batch_size)
    if per_epoch == 0:
        raise ValueError(f"{n} training examples do not fill one batch of {batch_size}")
    step = start_step
    while True:
        epoch, offset = divmod(step, per_epoch)
        order = epoch_order(n, seed, epoch)
        for i in range(offset, per_epoch):
            yield order[i * batch_size : (i + 1) * batch_size]
        step = (epoch + 1) * per_epoch


def eval_indices(n: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(index, valid)`` in order over every example; the last batch is padded by repeating example 0 and
    ``valid`` marks the real rows."""
    for start in range(0, n, batch_size):
        index = np.arange(start, start + batch_size)
        valid = index < n
        yield np.where(valid, index, 0), valid


# which arrays a padding mask governs: trimming a batch to a bucket cuts them all to the same width. An array
# two masks name follows the later one the batch has: labels are the decoder's (seq2seq) where there is one,
# else a token's of the input (masked LM, tagging), as chat's loss_mask is
MASKED_ARRAYS = {
    "attention_mask": ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels", "loss_mask"),
    "decoder_attention_mask": ("labels", "decoder_attention_mask", "decoder_input_ids"),
}


def length_buckets(max_len: int, multiple: int = 8, halvings: int = 3) -> list[int]:
    """The few widths a batch is trimmed to: ``max_len`` and its halves (``halvings`` of them), each rounded
    up to a ``multiple`` (128 for splash attention's tiles); at most ``halvings + 1`` compiled programs."""
    widths = {max_len}
    for k in range(1, halvings + 1):
        width = -(-(max_len >> k) // multiple) * multiple
        if multiple <= width < max_len:
            widths.add(width)
    return sorted(widths)


def ends(mask: np.ndarray) -> np.ndarray:
    """One past the last real (non-zero mask) column of each row: a row keeps every token when cut there,
    whatever side it is padded on (left padding ends at the full width, so it is never cut)."""
    real = np.asarray(mask) != 0
    return np.where(real.any(axis=1), real.shape[1] - np.argmax(real[:, ::-1], axis=1), 0)


BUCKET_BATCHES = 4  # a width compiles its own program only for at least this many batches of an evaluation


def bucket_widths(batch_ends: np.ndarray, buckets: list[int]) -> np.ndarray:
    """The width of each batch (``batch_ends``: its longest row's end): the smallest bucket that holds it,
    among the widest one any batch needs and those at least ``BUCKET_BATCHES`` batches take; a bucket fewer
    batches take is merged into the next wider one, so a small eval set compiles one or two programs."""
    fits = np.array([next(w for w in buckets if w >= end) for end in batch_ends])
    for width in sorted(set(fits.tolist()))[:-1]:
        if (fits == width).sum() < BUCKET_BATCHES:
            fits[fits == width] = min(w for w in fits.tolist() if w > width)
    return fits


def bucketed_eval_indices(row_ends: np.ndarray, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(index, valid)`` as ``eval_indices`` gives them, over the examples sorted by ``row_ends`` (``[n]``, or
    ``[n, k]`` for k masks, sorted by the first, then the next): each batch holds examples of like length.
    The last batch is padded by repeating its own first example, which widens nothing."""
    row_ends = np.asarray(row_ends).reshape(len(row_ends), -1)
    order = np.lexsort(row_ends.T[::-1])
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        valid = np.arange(batch_size) < len(index)
        yield np.concatenate([index, np.full(batch_size - len(index), index[0])]), valid


def trim(arrays: dict[str, np.ndarray], widths: dict[str, int]) -> dict[str, np.ndarray]:
    """``arrays`` cut to ``widths`` (mask name -> width): every 2-D array a mask governs keeps its first
    ``width`` columns (``MASKED_ARRAYS``: the later of the batch's masks that names it)."""
    out = dict(arrays)
    for name, array in arrays.items():
        masks = [m for m, names in MASKED_ARRAYS.items() if name in names and m in arrays]
        if masks and masks[-1] in widths and array.ndim == 2 and array.shape[1] == arrays[masks[-1]].shape[1]:
            out[name] = array[:, : widths[masks[-1]]]
    return out
