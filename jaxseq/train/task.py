"""What a job tells the trainer: ``Task``, a base class with every hook the trainer may call (the loss, the
evaluation outputs and metrics, and optional work with defaults that do nothing), and ``Policy``, the narrow
handle a task that samples in the loop (GRPO) gets instead of the trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Batch = Mapping[str, jax.Array]


class Task:
    """A job's objective. ``loss``, ``predict`` and ``metrics`` are its own; the rest have defaults:

    - ``metric_names``: the eval metrics it reports (``--metric_for_best_model`` is checked against them;
      None: whatever ``metrics`` returns);
    - ``packed_outputs``: evaluation packs several examples per row, its outputs one per example;
    - ``loss_weight``: how much a micro-batch counts when gradients are accumulated (by default, alike; a
      per-token mean weighs its number of target tokens);
    - ``loss_and_metrics``: figures logged with the loss (none by default);
    - ``needs_reference``/``reference``: columns the steps add to each batch from a frozen reference model
      (the starting weights; with LoRA the base, adapters off), without gradients; ``precomputes_reference``:
      computed once for every set before training instead;
    - ``needs_teacher``/``with_teacher``: a second model of its own beside the one that trains, frozen
      (distillation's teacher, on the same mesh), given to the task in each step as ``with_teacher(teacher)``,
      the task that compares against it;
    - ``for_batch_shards``: the task for batches split over this many devices (memory that depends on the rows
      each device holds, e.g. the loss's chunks);
    - ``samples_in_the_loop``/``rollout``: the batch a step trains on is made from the data's batch with the
      current weights (GRPO's sampled completions), through a ``Policy``."""

    metric_names: tuple[str, ...] | None = None
    packed_outputs: bool = False
    needs_reference: bool = False
    precomputes_reference: bool = False
    needs_teacher: bool = False
    samples_in_the_loop: bool = False

    def loss(self, model, batch: Batch, rngs: nnx.Rngs | None) -> jax.Array:
        raise NotImplementedError

    def predict(self, model, batch: Batch) -> dict[str, jax.Array]:
        """Per-example outputs (leading batch dimension) that ``metrics`` turns into numbers; they carry what
        the metrics compare against (labels), so the host needs no copy of the eval data."""
        raise NotImplementedError

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        raise NotImplementedError

    def loss_weight(self, batch: Batch) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def loss_and_metrics(self, model, batch: Batch, rngs: nnx.Rngs | None) -> tuple[jax.Array, dict]:
        return self.loss(model, batch, rngs), {}

    def reference(self, model, batch: Batch) -> dict[str, jax.Array]:
        return {}

    def with_teacher(self, teacher: nnx.Module) -> Task:
        """This task comparing against ``teacher`` (``needs_teacher``), inside a step's program."""
        return self

    def for_batch_shards(self, batch_shards: int, device: jax.Device | None = None) -> Task:
        return self

    def rollout(self, policy: Policy, batch: Batch, step: int) -> tuple[Batch, dict[str, float]]:
        """The batch step ``step`` trains on and the figures logged with it (``samples_in_the_loop``)."""
        return batch, {}


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a task sampling in the loop gets of the run: ``model()``, the training weights as they are now as
    a model to sample with (with QLoRA the quantised base with its adapters); the batch's layout
    (``per_device_batch`` rows a data-parallel replica, ``replicas`` of them, ``accumulate`` micro-batches a
    step); ``place(rows, stacked)``, this process's host rows onto the mesh as a global batch (``stacked``: a
    leading micro-batch axis); ``local``, the rows of each micro-batch this process holds (with several
    processes its share, which ``place`` takes; with one, all)."""

    model: Callable[[], nnx.Module]
    per_device_batch: int
    replicas: int
    accumulate: int
    place: Callable[..., dict]
    local: slice = dataclasses.field(default_factory=lambda: slice(None))
