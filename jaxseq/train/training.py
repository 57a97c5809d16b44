"""How a run's weights train, one object its train program asks (``jaxseq.train.step.TrainProgram``).

``Training`` trains every parameter (full fine-tuning); for a task that compares against a reference
(``Task.needs_reference``: DPO, GRPO with a KL) a frozen copy of the starting weights is the steps' second
input. ``LoraTraining`` trains LoRA's adapters and the task head (``jaxseq.train.lora``) beside the model's own
weights, frozen (QLoRA: its blocks' kernels quantised), whose base with the adapters off is the reference.
``WithTeacher`` adds to either a teacher (``Task.needs_teacher``: distillation), another model, frozen.

Either gives: the trained tree's shapes and specs (``abstract_trained``, ``specs``); the frozen tree's
shardings and shapes (``frozen_shardings``, ``abstract_frozen``; None: nothing frozen); the first frozen and
trained trees from the loaded model's state (``freeze``, ``init``); the model a loss sees in a train step
(``train_model``); the reference model (``reference_model``) and the teacher (``teacher_model``); the plain
model of the trained weights (``merged_model``), what evaluation and sampling run (``eval_model``) and what a
finished run exports (``export``)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxseq import sharding
from jaxseq.models.hub import save_pretrained
from jaxseq.models.registry import family_for
from jaxseq.train.checkpoint import abstract_like
from jaxseq.train.lora import Lora, LoraConfig
from jaxseq.train.quantize import quantize_onto


class Training:
    """Full fine-tuning: every parameter trains; with ``reference`` a frozen copy of the starting weights is
    the reference (an input of the steps: the state's own weights are donated)."""

    def __init__(self, graphdef, params, param_specs, mesh: jax.sharding.Mesh, *, reference: bool = False):
        """``params``: the model's state (arrays or abstract), ``param_specs`` its PartitionSpecs."""
        self.graphdef = graphdef
        self.abstract_trained, self.specs = jax.eval_shape(lambda p: p, params), param_specs
        self.frozen_shardings = self.abstract_frozen = None
        if reference:
            sharding.check_divisible(params, param_specs, mesh)
            self.frozen_shardings = sharding.make_shardings(mesh, param_specs)
            self.abstract_frozen = abstract_like(params, self.frozen_shardings)

    def freeze(self, params):
        """The frozen tree of the model's state ``params``, on its shardings (None: nothing is frozen)."""
        if self.frozen_shardings is None:
            return None
        return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.frozen_shardings)(params)

    def init(self, params):
        """The first trained tree, from the model's state ``params``."""
        return params

    def train_model(self, trained, frozen, key: jax.Array) -> tuple[nnx.Module, jax.Array]:
        """``(model, key)``: the model a loss sees in a train step whose dropout key is ``key``, and the key
        left for the model's own dropout."""
        return nnx.merge(self.graphdef, trained), key

    def reference_model(self, frozen) -> nnx.Module:
        """The model of a task's reference columns (``Task.reference``): the starting weights."""
        return nnx.merge(self.graphdef, frozen)

    def teacher_model(self, frozen) -> nnx.Module:
        """The teacher a task compares against (``Task.needs_teacher``; ``WithTeacher``)."""
        raise ValueError("this run has no teacher")

    def merged_model(self, trained, frozen) -> nnx.Module:
        """The trained weights as a plain model (for export)."""
        return nnx.merge(self.graphdef, trained)

    def eval_model(self, trained, frozen) -> nnx.Module:
        """The model evaluation and GRPO's sampler run."""
        return self.merged_model(trained, frozen)

    def describe(self, trained, frozen) -> str | None:
        """A line on what trains, for the log (None: every parameter, as the table of them says)."""
        return None

    def export(self, trained, frozen, output_dir: str | os.PathLike, tokenizer=None, *, base_model=None) -> Path:
        """The trained model into ``output_dir`` as a Hugging Face folder (every process calls this)."""
        return save_pretrained(self.merged_model(trained, frozen), output_dir, tokenizer=tokenizer)


class LoraTraining(Training):
    """LoRA (``jaxseq.train.lora``): the adapters and the task head train; the model's weights are frozen (QLoRA:
    each of ``lora.quantized``'s kernels as codes and scales), and their base, adapters off, is the reference."""

    def __init__(self, lora: Lora, graphdef, params, param_specs, mesh: jax.sharding.Mesh, *, seed: int):
        self.lora, self.graphdef = lora, graphdef
        sharding.check_divisible(params, param_specs, mesh)
        frozen = jax.eval_shape(lora.freeze, params)
        lora.fit_scales(mesh)
        sharding.check_divisible(frozen, lora.frozen_specs, mesh)
        self.frozen_shardings = sharding.make_shardings(mesh, lora.frozen_specs)
        self.abstract_frozen = abstract_like(frozen, self.frozen_shardings)
        self._param_shardings = sharding.make_shardings(mesh, param_specs)
        self._fresh = jax.jit(
            lambda heads: lora.init(heads, seed),
            in_shardings=(self._heads(self._param_shardings),),
            out_shardings=sharding.make_shardings(mesh, lora.specs),
        )
        self.abstract_trained, self.specs = jax.eval_shape(self._fresh, self._heads(params)), lora.specs

    def _heads(self, tree) -> dict:
        """What ``tree`` (shaped like the model's state) holds of the parameters trained in full."""
        flat = traverse_util.flatten_dict(tree if isinstance(tree, dict) else nnx.to_pure_dict(tree))
        return traverse_util.unflatten_dict({path: flat[path] for path in self.lora.full})

    def freeze(self, params):
        """The model's state ``params`` on the frozen tree's shardings. QLoRA: each kernel quantised on the
        devices, one at a time (``quantize_onto``: a kernel on the host, as QLoRA loads them, one layer at a
        time), so that they never hold the full-precision model."""
        lora = self.lora
        if not lora.quantized:
            return sharding.shard(params, self.frozen_shardings)
        flat = {path: v.get_value() for path, v in nnx.to_flat_state(params)}
        placed = dict(nnx.to_flat_state(self._param_shardings))
        frozen_shardings = traverse_util.flatten_dict(self.frozen_shardings)
        out = {}
        for path in lora.quantized:
            kernel = (*path, "kernel")
            parts = {part: frozen_shardings[(*kernel, part)] for part in ("codes", "scales")}
            quantized = quantize_onto(flat.pop(kernel), lora.kind, placed[kernel].get_value(), parts)
            out.update({(*kernel, part): array for part, array in quantized.items()})
        out.update({path: jax.device_put(value, frozen_shardings[path]) for path, value in flat.items()})
        return traverse_util.unflatten_dict(out)

    def init(self, params):
        """Fresh adapters (``Lora.init``: B at zero) and the task head from the model's state ``params``; with
        ``--lora_adapter`` the adapter's weights."""
        trained = self._fresh(self._heads(params))
        if self.lora.adapter is not None:  # --lora_adapter: go on from its weights
            trained = sharding.shard(self.lora.adapter_weights(), jax.tree.map(lambda x: x.sharding, trained))
        return trained

    def train_model(self, trained, frozen, key: jax.Array) -> tuple[nnx.Module, jax.Array]:
        """The frozen model with each adapter's branch beside its kernel (``Lora.training_model``), its dropout
        drawn from a key split off ``key``."""
        key, adapter_key = jax.random.split(key)
        return self.lora.training_model(self.graphdef, trained, frozen, adapter_key), key

    def reference_model(self, frozen) -> nnx.Module:
        """The base: the frozen weights, adapters off."""
        return self.lora.training_model(self.graphdef, None, frozen)

    def merged_model(self, trained, frozen) -> nnx.Module:
        """The frozen weights (dequantised), adapters folded in, the trained head."""
        return nnx.merge(self.graphdef, self.lora.merged(trained, frozen))

    def eval_model(self, trained, frozen) -> nnx.Module:
        """``merged_model``, but with QLoRA the training model without dropout (each layer dequantised where
        used, inside the program, its adapter beside it), so no full-precision copy of the quantised kernels is
        ever made."""
        if self.lora.quantized:
            return self.lora.training_model(self.graphdef, trained, frozen)
        return self.merged_model(trained, frozen)

    def describe(self, trained, frozen) -> str:
        return self.lora.describe(_count(frozen), _count(trained))

    def export(self, trained, frozen, output_dir: str | os.PathLike, tokenizer=None, *, base_model=None) -> Path:
        """The merged model, or with ``--lora_export adapter`` the adapter alone in PEFT's format."""
        if self.lora.config.lora_export == "adapter":
            return self.lora.save_adapter(trained, output_dir, base_model=base_model, tokenizer=tokenizer)
        return super().export(trained, frozen, output_dir, tokenizer, base_model=base_model)


class WithTeacher(Training):
    """``inner``'s way of training beside a teacher (distillation): another model, frozen, each weight sharded
    on the same mesh by its family's partition rules. The frozen tree is ``(inner's, the teacher's)``; the
    teacher's weights come from ``load()`` (a model built on the mesh) when the run starts."""

    def __init__(self, inner: Training, teacher: nnx.Module, mesh: jax.sharding.Mesh, load: Callable[[], nnx.Module]):
        """``teacher``: the teacher's model, abstract or not (its shapes and family)."""
        self.inner, self.load = inner, load
        self.graphdef, self.abstract_trained, self.specs = inner.graphdef, inner.abstract_trained, inner.specs
        self.teacher_graphdef, params = nnx.split(teacher)
        specs = sharding.match_partition_rules(family_for(teacher.config.model_type).partition_rules, params)
        sharding.check_divisible(params, specs, mesh)
        shardings = sharding.make_shardings(mesh, specs)
        self.frozen_shardings = (inner.frozen_shardings, shardings)
        self.abstract_frozen = (inner.abstract_frozen, abstract_like(params, shardings))

    def freeze(self, params):
        return self.inner.freeze(params), sharding.shard(nnx.state(self.load()), self.frozen_shardings[1])

    def init(self, params):
        return self.inner.init(params)

    def train_model(self, trained, frozen, key: jax.Array) -> tuple[nnx.Module, jax.Array]:
        return self.inner.train_model(trained, frozen[0], key)

    def reference_model(self, frozen) -> nnx.Module:
        return self.inner.reference_model(frozen[0])

    def teacher_model(self, frozen) -> nnx.Module:
        return nnx.merge(self.teacher_graphdef, frozen[1])

    def merged_model(self, trained, frozen) -> nnx.Module:
        return self.inner.merged_model(trained, frozen[0])

    def eval_model(self, trained, frozen) -> nnx.Module:
        return self.inner.eval_model(trained, frozen[0])

    def describe(self, trained, frozen) -> str | None:
        line = self.inner.describe(trained, frozen[0])
        teacher = f"the teacher ({_count(frozen[1]):,} parameters) frozen"
        return teacher if line is None else f"{line}; {teacher}"

    def export(self, trained, frozen, output_dir: str | os.PathLike, tokenizer=None, *, base_model=None) -> Path:
        return self.inner.export(trained, frozen[0], output_dir, tokenizer, base_model=base_model)


def training_for(
    model: nnx.Module,
    param_specs,
    mesh: jax.sharding.Mesh,
    lora: LoraConfig | None,
    *,
    reference: bool,
    seed: int,
    teacher: nnx.Module | None = None,
    load_teacher: Callable[[], nnx.Module] | None = None,
) -> Training:
    """How ``model`` (``param_specs``: its parameters' PartitionSpecs) trains: LoRA's adapters when ``lora`` is
    on, else every weight; ``reference``: the task needs a reference model (``Task.needs_reference``);
    ``teacher`` (and ``load_teacher``, which builds it with its weights): a teacher beside it (``WithTeacher``)."""
    graphdef, params = nnx.split(model)
    if lora is not None and lora.enabled:
        training = LoraTraining(Lora(lora, model, param_specs), graphdef, params, param_specs, mesh, seed=seed)
    else:
        training = Training(graphdef, params, param_specs, mesh, reference=reference)
    return training if teacher is None else WithTeacher(training, teacher, mesh, load_teacher)


def _count(tree) -> int:
    return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree))
