"""Feeding a run's batches to the mesh: the global order is a function of the seed and the step alone; each
process takes (tokenizes, packs) only the examples its devices hold, and builds global arrays from them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.data import packing
from jaxseq.data.batches import (
    MASKED_ARRAYS,
    bucket_widths,
    bucketed_eval_indices,
    ends,
    eval_indices,
    length_buckets,
    steps_per_epoch,
    train_indices,
    trim,
)
from jaxseq.data.rows import Rows, as_rows
from jaxseq.errors import JaxseqError
from jaxseq.mesh import batch_spec, data_parallel_size


class Feeder:
    """The training and evaluation batches of one run on ``mesh``. ``pack``: pack short examples into shared
    rows (``jaxseq.data.packing``), pointing at each example's ``"first"`` or ``"last"`` token, or each token
    labelled (``packing.TOKENS``). The training row counts are sized once for the whole run
    (``size_packing``): a few static shapes, one compiled program each. ``pack_eval``: evaluation and
    prediction pack too (an objective that reads its outputs at ``pool_index``, or at ``token_index`` for
    per-token outputs): every example of a set is packed at once and the rows taken
    ``per_device_eval_batch_size`` a replica at a time, one compiled program. Unpacked evaluation sorts the
    examples by length and cuts each batch to one of a few widths (``length_buckets``, multiples of
    ``bucket_multiple``): one compiled program per width. ``train_data=None``: evaluation and prediction
    only."""

    def __init__(
        self,
        mesh: jax.sharding.Mesh,
        train_data: Rows | Mapping[str, np.ndarray] | None,
        eval_sets: Mapping[str, Rows | Mapping[str, np.ndarray]],
        *,
        per_device_train_batch_size: int,
        per_device_eval_batch_size: int,
        gradient_accumulation_steps: int,
        seed: int,
        pack: str | None = None,
        pack_eval: bool = True,
        bucket_multiple: int = 8,
    ):
        self.mesh, self.seed, self.pack, self.bucket_multiple = mesh, seed, pack, bucket_multiple
        self.pack_eval = pack_eval
        self.train_data = None if train_data is None else as_rows(train_data)
        self.eval_sets = {name: as_rows(data) for name, data in eval_sets.items()}
        self.accumulate = gradient_accumulation_steps
        self.dp = data_parallel_size(mesh)
        self.micro_batch = per_device_train_batch_size * self.dp
        self.global_batch = self.micro_batch * gradient_accumulation_steps
        self.eval_batch = per_device_eval_batch_size * self.dp
        self._mine = self._local_slice(self.micro_batch)  # this process's examples of every micro-batch
        self._eval_mine = self._local_slice(self.eval_batch)
        # how many distinct slices the processes take of a batch (1 with one process)
        self._groups = self.micro_batch // (self._mine.stop - self._mine.start)
        n = 0 if train_data is None else len(self.train_data)
        self.steps_per_epoch = steps_per_epoch(n, self.global_batch)
        if self.steps_per_epoch == 0 and train_data is not None:
            raise JaxseqError(
                f"{n} training examples do not fill one global batch of {self.global_batch}; lower "
                "--per_device_train_batch_size or --gradient_accumulation_steps"
            )
        self.packed_rows: int | None = None  # the most rows a micro-batch is packed into
        self.row_buckets: list[int] = []  # every row count micro-batches are packed into
        self._step_rows = np.zeros(0, np.int64)  # the row count of each step's micro-batches
        self.eval_packed_rows: dict[str, int | None] = dict.fromkeys(self.eval_sets)  # rows a packed batch
        self._eval_layouts: dict[str, tuple] = {}  # _eval_layout's, per eval set

    @property
    def local(self) -> slice:
        """The rows of each training micro-batch this process's devices hold (what ``device_batch`` takes)."""
        return self._mine

    def size_packing(self, total_steps: int) -> None:
        """Packed rows of each step's micro-batches (one of a few counts, ``packing.row_buckets`` of what the
        steps need), and of every eval batch (``eval_batch``). Every data-parallel shard packs its own
        training examples into its own rows, so the layout depends on the mesh, not on how many processes share
        it; each process sizes only its shards (tokenizing only those) and the processes agree on the largest."""
        if not self.pack:
            return
        if self.train_data is not None:
            self._size_train_packing(total_steps)
        if not self.pack_eval:
            return
        self._eval_layouts.clear()  # worked out for unpacked sets
        self.eval_packed_rows = dict.fromkeys(self.eval_sets, self.eval_batch)

    def _size_train_packing(self, total_steps: int) -> None:
        """The row count of each step (``packing.row_buckets`` of what the steps' shards need, the processes'
        needs combined)."""
        indices = train_indices(len(self.train_data), self.global_batch, self.seed)
        needed = np.array(
            [
                packing.rows_needed(
                    shard
                    for m in next(indices).reshape(self.accumulate, -1)
                    for shard in self._shards(self.train_data.take(m[self._mine]))
                )
                for _ in range(total_steps)
            ],
            np.int32,
        )
        if jax.process_count() > 1:
            needed = np.max(np.asarray(multihost_utils.process_allgather(needed)), axis=0)
        mine = next(train_indices(len(self.train_data), self.global_batch, self.seed))[self._mine]  # tokenized above
        seq = self.train_data.take(mine[:1])["input_ids"].shape[1]
        buckets = np.array(packing.row_buckets(needed, seq))
        self.row_buckets = [self.dp * int(b) for b in buckets]
        self.packed_rows = self.row_buckets[-1]
        self._step_rows = self.dp * buckets[np.searchsorted(buckets, needed)]

    def _shards(self, local: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """This process's examples of a batch, split into its data-parallel shards."""
        shards = self.dp // self._groups
        return [{k: v[i] for k, v in local.items()} for i in np.split(np.arange(len(local["input_ids"])), shards)]

    def _local_slice(self, rows: int) -> slice:
        """The rows of a batch of ``rows`` (split over the batch axes) that this process's devices hold."""
        return local_rows(NamedSharding(self.mesh, batch_spec(1)), (rows,))

    def batches(
        self, start_step: int = 0, ready: Callable[[int], bool] | None = None
    ) -> Iterator[dict[str, jax.Array]]:
        """The training batches from ``start_step`` on, on the devices: ``[rows, ...]`` arrays, or
        ``[micro-batches, rows, ...]`` with gradient accumulation. ``ready(rows)``: whether the step for a
        packed row count is compiled; a batch whose own count is not yet takes the smallest larger count that
        is (more padding rows, the same examples), so training goes on while a compilation finishes."""
        for step, index in enumerate(self._step_indices(start_step), start_step):
            rows = self._rows_of(step)
            if ready is not None and rows is not None and not ready(rows):
                rows = next((r for r in self.row_buckets if r > rows and ready(r)), rows)
            yield self.device_batch(self._host_batch(step, index, rows), stacked=self.accumulate > 1)

    def _rows_of(self, step: int) -> int | None:
        """The packed row count of step ``step``'s micro-batches (None: unpacked)."""
        return int(self._step_rows[step]) if step < len(self._step_rows) else self.packed_rows

    def _step_indices(self, start_step: int) -> Iterator[np.ndarray]:
        return train_indices(len(self.train_data), self.global_batch, self.seed, start_step)

    def _host_batch(self, step: int, index: np.ndarray | None = None, rows: int | None = None) -> dict[str, np.ndarray]:
        """This process's arrays of training step ``step`` (whose examples are ``index``, else looked up),
        packed into its own row count or ``rows``."""
        if index is None:
            index = next(self._step_indices(step))
        rows = self._rows_of(step) if rows is None else rows
        parts = [self._local(self.train_data, m[self._mine], rows) for m in index.reshape(self.accumulate, -1)]
        return parts[0] if self.accumulate == 1 else {k: np.stack([p[k] for p in parts]) for k in parts[0]}

    def abstract_batches(self) -> list[dict[str, jax.ShapeDtypeStruct]]:
        """The shapes, dtypes and shardings of every training batch shape the run steps on: one per packed row
        count (in order of first use), else one. What a plan compiles the train step for (no device needed)."""
        stacked = self.accumulate > 1
        first = {
            name: jax.ShapeDtypeStruct(shape, value.dtype, sharding=batch_sharding(self.mesh, value.ndim, stacked))
            for name, (shape, value) in self._global(self._host_batch(0), stacked).items()
        }
        return [with_rows(first, rows) for rows in self.upcoming_rows()] or [first]

    def _global(self, local: Mapping[str, np.ndarray], stacked: bool) -> dict[str, tuple[tuple, np.ndarray]]:
        """Global shape of each of this process's arrays, with the array."""
        out = {}
        for name, value in local.items():
            lead = value.shape[:2] if stacked else value.shape[:1]
            out[name] = ((*lead[:-1], lead[-1] * self._groups, *value.shape[len(lead) :]), value)
        return out

    def upcoming_rows(self, start_step: int = 0) -> list[int]:
        """The packed row counts of the training steps from ``start_step`` on, each once, in order of first use
        (none when unpacked)."""
        return list(dict.fromkeys(int(rows) for rows in self._step_rows[start_step:]))

    def eval_batches(self, name: str) -> Iterator[tuple[dict[str, jax.Array], np.ndarray, np.ndarray]]:
        """``(batch, index, valid)`` over every example of eval set ``name``: ``index`` is the example of each
        row of the batch, or of each of its outputs when packed (padded with repeats to the same count in
        every batch), and ``valid`` marks the real ones. Packed: the examples of a run of rows. Unpacked with
        padding masks: sorted by length, each batch cut to its bucket's width. Else in input order."""
        batches = self._eval_layout(name)[0]
        for b, (index, valid) in enumerate(batches):
            yield self.device_batch(self._eval_host_batch(name, b)), index, valid

    def eval_batch_count(self, name: str) -> int:
        """How many batches ``eval_batches(name)`` yields."""
        return len(self._eval_layout(name)[0])

    def eval_shapes(self, name: str) -> list[dict[str, jax.ShapeDtypeStruct]]:
        """The shapes, dtypes and shardings of eval set ``name``'s batches, each distinct one once, in order of
        first use: what the eval step is compiled for (one program each)."""
        batches, widths, _ = self._eval_layout(name)
        firsts: dict[tuple, int] = {}
        for b in range(len(batches)):
            firsts.setdefault(tuple(widths[b].items()) if widths else (), b)
        return [
            {
                k: jax.ShapeDtypeStruct(shape, v.dtype, sharding=batch_sharding(self.mesh, v.ndim))
                for k, (shape, v) in self._global(self._eval_host_batch(name, b), False).items()
            }
            for b in firsts.values()
        ]

    def _eval_layout(self, name: str) -> tuple[list[tuple[np.ndarray, np.ndarray]], list | None, list | None]:
        """The eval batches of set ``name`` as ``(index, valid)``, each one's widths when length-bucketed, and
        each one's examples by row when packed. Worked out once per set; every process works out (tokenizes)
        the whole set, so all agree on the batches."""
        if name in self._eval_layouts:
            return self._eval_layouts[name]
        data = self.eval_sets[name]
        packed_rows = self.eval_packed_rows.get(name)
        masks = [] if packed_rows or not len(data) else [m for m in MASKED_ARRAYS if m in data.take(np.arange(1))]
        if packed_rows and len(data):
            full = data.take(np.arange(len(data)))
            packed = packing.packed_batches(packing.lengths(full), full["input_ids"].shape[1], packed_rows, self.dp)
            layout = [(index, valid) for index, valid, _ in packed], None, [rows for _, _, rows in packed]
        elif not masks:
            layout = list(eval_indices(len(data), self.eval_batch)), None, None
        else:
            # every process sorts every example (tokenizing the whole set), so all agree on the batches' shapes
            full = data.take(np.arange(len(data)))
            row_ends = np.stack([ends(full[m]) for m in masks], axis=1)
            batches = list(bucketed_eval_indices(row_ends, self.eval_batch))
            widths = {
                m: bucket_widths(
                    [row_ends[index, i].max() for index, _ in batches],
                    length_buckets(full[m].shape[1], self.bucket_multiple),
                )
                for i, m in enumerate(masks)
            }
            layout = batches, [{m: int(w[b]) for m, w in widths.items()} for b in range(len(batches))], None
        self._eval_layouts[name] = layout
        return layout

    def _eval_host_batch(self, name: str, b: int) -> dict[str, np.ndarray]:
        """This process's arrays of eval batch ``b`` of set ``name``: its rows, and when packed its share of
        the per-example arrays (``pool_index`` or ``token_index`` count from the batch's first row)."""
        batches, widths, assignments = self._eval_layout(name)
        index = batches[b][0]
        data = self.eval_sets[name]
        if assignments is not None:
            rows = self.eval_packed_rows[name]
            tokens = self.pack == packing.TOKENS
            packed = packing.pack(data.take(index), rows, self.pack, assignment=assignments[b], token_index=tokens)
            examples = self._local_slice(len(index))
            return {k: v[self._eval_mine if k in packing.ROW_ARRAYS else examples] for k, v in packed.items()}
        mine = index[self._eval_mine]
        if widths is None:
            return data.take(mine)
        return trim(data.take(mine), widths[b])

    def _local(self, data: Rows, index: np.ndarray, packed_rows: int | None) -> dict[str, np.ndarray]:
        """This process's examples ``index`` of one batch; if ``packed_rows`` is given, each data-parallel
        shard packed into its share of them."""
        local = data.take(index)
        if not packed_rows:
            return local
        per_shard = packed_rows // self.dp
        first = self._local_slice(packed_rows).start
        parts = [
            packing.pack(shard, per_shard, self.pack, first_row=first + i * per_shard)
            for i, shard in enumerate(self._shards(local))
        ]
        return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}

    def device_batch(self, local: Mapping[str, np.ndarray], stacked: bool = False) -> dict[str, jax.Array]:
        """This process's rows -> global arrays split over the batch axes. ``stacked``: arrays are
        ``[micro-batches, rows, ...]`` and each micro-batch is split on its own."""
        return {
            name: jax.make_array_from_process_local_data(batch_sharding(self.mesh, value.ndim, stacked), value, shape)
            for name, (shape, value) in self._global(local, stacked).items()
        }

    def tokenized_counts(self) -> list[int] | None:
        """Multi-host runs: how many training examples each process tokenized (each only what it took)."""
        if jax.process_count() == 1 or not hasattr(self.train_data, "encoded"):
            return None
        return np.asarray(multihost_utils.process_allgather(np.int32(self.train_data.encoded))).tolist()


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int, stacked: bool = False) -> NamedSharding:
    """How a batch array is laid out: rows split over the batch axes (each micro-batch's, when ``stacked``)."""
    return NamedSharding(mesh, P(None, *batch_spec(ndim - 1)) if stacked else batch_spec(ndim))


def abstract_batch(
    mesh: jax.sharding.Mesh, rows: int, arrays: Mapping[str, tuple[tuple[int, ...], np.dtype]], accumulate: int = 1
) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes, dtypes and shardings of a training batch of ``rows`` rows per micro-batch, as ``batches``
    yields it: ``arrays`` maps a name to the shape of one row and its dtype."""
    stacked = accumulate > 1
    lead = (accumulate, rows) if stacked else (rows,)
    return {
        name: jax.ShapeDtypeStruct(
            (*lead, *shape), dtype, sharding=batch_sharding(mesh, len(lead) + len(shape), stacked)
        )
        for name, (shape, dtype) in arrays.items()
    }


def with_rows(batch: Mapping[str, jax.Array], rows: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes, dtypes and shardings of ``batch``, a packed training batch as ``Feeder.batches`` yields it,
    with ``rows`` rows (per micro-batch) instead: the arrays of a row per token (shaped as ``input_ids``) take
    the new count; those of a row per example (sequence labels, ``pool_index``) stay."""
    ids = batch["input_ids"].shape
    axis = len(ids) - 2  # 1 when micro-batches are stacked

    def shape(array):
        return (*ids[:axis], rows, *ids[axis + 1 :]) if array.shape == ids else array.shape

    return {name: jax.ShapeDtypeStruct(shape(a), a.dtype, sharding=a.sharding) for name, a in batch.items()}


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows of a global array of ``shape`` that this process's devices hold under ``sharding``."""
    if jax.process_count() == 1:
        return slice(0, shape[0])
    spans = [index[0] for index in sharding.addressable_devices_indices_map(shape).values()]
    return slice(min(s.start or 0 for s in spans), max(shape[0] if s.stop is None else s.stop for s in spans))
