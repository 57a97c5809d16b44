"""Fixed-shape batches: the same shapes every step (one compilation), a data order fixed by seed and epoch
(so a resumed run sees the same batches), and evaluation that keeps every example (the last batch is
padded and its padding masked out)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


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
