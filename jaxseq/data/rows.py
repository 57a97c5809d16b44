"""Datasets as rows fetched by index. The trainer asks each process only for the rows its own devices hold,
so in a multi-host run every process reads, and with ``EncodedRows`` tokenizes, only its slice of each
global batch; the global order (``jaxseq.data.batches``) is the same whatever the process count."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np


class Rows(Protocol):
    def __len__(self) -> int: ...

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The arrays of the examples at ``index`` (in that order), each ``[len(index), ...]``."""


class ArrayRows:
    """Rows of arrays already in memory, or memory-mapped (then only the rows taken are read)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        lengths = {len(v) for v in arrays.values()}
        if len(lengths) != 1:
            raise ValueError(f"arrays of different lengths: {sorted(lengths)}")
        self.arrays = dict(arrays)

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {k: np.asarray(v[index]) for k, v in self.arrays.items()}


class EncodedRows:
    """Examples tokenized when first taken (``encode(list of examples) -> arrays``), each at most once."""

    def __init__(self, examples: Sequence, encode: Callable[[list], dict[str, np.ndarray]]):
        self.examples, self.encode = examples, encode
        self._arrays: dict[str, np.ndarray] | None = None
        self._done = np.zeros(len(examples), bool)

    def __len__(self) -> int:
        return len(self.examples)

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        index = np.asarray(index)
        todo = np.unique(index[~self._done[index]])
        if len(todo):
            encoded = self.encode([self.examples[i] for i in todo])
            if self._arrays is None:
                self._arrays = {k: np.zeros((len(self), *v.shape[1:]), v.dtype) for k, v in encoded.items()}
            for k, v in encoded.items():
                self._arrays[k][todo] = v
            self._done[todo] = True
        return {k: v[index] for k, v in self._arrays.items()}

    @property
    def encoded(self) -> int:
        """How many examples have been tokenized so far."""
        return int(self._done.sum())


def as_rows(data: Rows | Mapping[str, np.ndarray]) -> Rows:
    return ArrayRows(data) if isinstance(data, Mapping) else data
