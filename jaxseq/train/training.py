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
from jaxseq.errors import JaxseqError
from jaxseq.models.hub import save_pretrained
from jaxseq.models.registry import family_for
from jaxseq.train.checkpoint import abstract_like
from jaxseq.train.lora import Lora, LoraConfig
from jaxseq.train.quantize import QUANTIZE, quantize_onto


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
        if not self.lora.quantized:
            return sharding.shard(params, self.frozen_shardings)
        return frozen_quantized(self.lora, params, self._param_shardings, self.frozen_shardings)

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
    teacher's weights come from ``load()`` (a model built on the mesh) when the run starts. ``quantization``
    (``int8``, ``nf4``; ``jaxseq.train.quantize``): the dense kernels of the teacher's blocks are stored
    quantised, as QLoRA's base (``Lora``, no adapters): the teacher's tree holds their codes and scales, and
    each layer dequantises its own kernel where it is used, inside the step."""

    def __init__(
        self,
        inner: Training,
        teacher: nnx.Module,
        mesh: jax.sharding.Mesh,
        load: Callable[[], nnx.Module],
        quantization: str = "none",
    ):
        """``teacher``: the teacher's model, abstract or not (its shapes and family)."""
        self.inner, self.load = inner, load
        self.graphdef, self.abstract_trained, self.specs = inner.graphdef, inner.abstract_trained, inner.specs
        self.teacher_graphdef, params = nnx.split(teacher)
        self.teacher_parameters = _count(params)
        specs = sharding.match_partition_rules(family_for(teacher.config.model_type).partition_rules, params)
        sharding.check_divisible(params, specs, mesh)
        self.quantizer = teacher_quantizer(teacher, specs, quantization)
        self._param_shardings = sharding.make_shardings(mesh, specs)
        if self.quantizer is not None:
            self.quantizer.fit_scales(mesh)
            params, specs = jax.eval_shape(self.quantizer.freeze, params), self.quantizer.frozen_specs
            sharding.check_divisible(params, specs, mesh)
        shardings = sharding.make_shardings(mesh, specs)
        self.frozen_shardings = (inner.frozen_shardings, shardings)
        self.abstract_frozen = (inner.abstract_frozen, abstract_like(params, shardings))

    def freeze(self, params):
        teacher = nnx.state(self.load())
        if self.quantizer is None:
            return self.inner.freeze(params), sharding.shard(teacher, self.frozen_shardings[1])
        frozen = frozen_quantized(self.quantizer, teacher, self._param_shardings, self.frozen_shardings[1])
        return self.inner.freeze(params), frozen

    def init(self, params):
        return self.inner.init(params)

    def train_model(self, trained, frozen, key: jax.Array) -> tuple[nnx.Module, jax.Array]:
        return self.inner.train_model(trained, frozen[0], key)

    def reference_model(self, frozen) -> nnx.Module:
        return self.inner.reference_model(frozen[0])

    def teacher_model(self, frozen) -> nnx.Module:
        if self.quantizer is not None:  # each quantised layer dequantises its kernel where it is used
            return self.quantizer.training_model(self.teacher_graphdef, None, frozen[1])
        return nnx.merge(self.teacher_graphdef, frozen[1])

    def merged_model(self, trained, frozen) -> nnx.Module:
        return self.inner.merged_model(trained, frozen[0])

    def eval_model(self, trained, frozen) -> nnx.Module:
        return self.inner.eval_model(trained, frozen[0])

    def describe(self, trained, frozen) -> str | None:
        line = self.inner.describe(trained, frozen[0])
        stored = "" if self.quantizer is None else f", its blocks' kernels {self.quantizer.kind}"
        teacher = f"the teacher ({self.teacher_parameters:,} parameters{stored}) frozen"
        return teacher if line is None else f"{line}; {teacher}"

    def export(self, trained, frozen, output_dir: str | os.PathLike, tokenizer=None, *, base_model=None) -> Path:
        return self.inner.export(trained, frozen[0], output_dir, tokenizer, base_model=base_model)


def teacher_quantizer(teacher: nnx.Module, specs, quantization: str) -> Lora | None:
    """QLoRA's quantisation of a teacher's block kernels (``quantization`` ``int8`` or ``nf4``), a ``Lora`` whose
    adapters are never made: it quantises (``freeze``), shards (``frozen_specs``) and dequantises where used
    (``training_model(graphdef, None, frozen)``). None: ``none``."""
    if quantization == "none":
        return None
    try:
        return Lora(teacher_lora_config(quantization), teacher, specs)
    except JaxseqError as e:  # QLoRA's words for the teacher's flag
        raise JaxseqError(f"the teacher: {e}".replace("--quantize", "--teacher_quantization")) from None


def teacher_lora_config(quantization: str) -> LoraConfig:
    """QLoRA's settings that quantise a teacher's block kernels as ``quantization`` (``quantized_kernels``: every
    dense kernel inside its blocks; nothing kept whole, no adapter ever made)."""
    if quantization not in QUANTIZE:
        raise JaxseqError(f"--teacher_quantization must be one of {', '.join(QUANTIZE)}, got {quantization!r}")
    return LoraConfig(lora_rank=1, lora_trainable="", quantize=quantization)


def frozen_quantized(lora: Lora, params, param_shardings, frozen_shardings) -> dict:
    """A model's state ``params`` as ``lora``'s frozen tree on ``frozen_shardings``: each of ``lora.quantized``'s
    kernels quantised on the devices, one at a time (``quantize_onto``: a kernel on the host, as QLoRA loads
    them, one layer at a time), so that they never hold the full-precision model; ``param_shardings``: the
    state's own shardings, where a kernel goes to be quantised."""
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(params)}
    placed = dict(nnx.to_flat_state(param_shardings))
    frozen_shardings = traverse_util.flatten_dict(frozen_shardings)
    out = {}
    for path in lora.quantized:
        kernel = (*path, "kernel")
        parts = {part: frozen_shardings[(*kernel, part)] for part in ("codes", "scales")}
        quantized = quantize_onto(flat.pop(kernel), lora.kind, placed[kernel].get_value(), parts)
        out.update({(*kernel, part): array for part, array in quantized.items()})
    out.update({path: jax.device_put(value, frozen_shardings[path]) for path, value in flat.items()})
    return traverse_util.unflatten_dict(out)


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
    teacher_quantization: str = "none",
) -> Training:
    """How ``model`` (``param_specs``: its parameters' PartitionSpecs) trains: LoRA's adapters when ``lora`` is
    on, else every weight; ``reference``: the task needs a reference model (``Task.needs_reference``);
    ``teacher`` (and ``load_teacher``, which builds it with its weights): a teacher beside it (``WithTeacher``),
    its block kernels stored as ``teacher_quantization`` says."""
    graphdef, params = nnx.split(model)
    if lora is not None and lora.enabled:
        training = LoraTraining(Lora(lora, model, param_specs), graphdef, params, param_specs, mesh, seed=seed)
    else:
        training = Training(graphdef, params, param_specs, mesh, reference=reference)
    return training if teacher is None else WithTeacher(training, teacher, mesh, load_teacher, teacher_quantization)


def _count(tree) -> int:
    return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree))
