"""A run's spec: everything about a training run that is neither data nor weights, decided once from its
parsed config (mesh, model config and task, compute dtype, how the blocks run, packing, objective, optimizer,
LoRA). The model is built from it (``build_model``, ``abstract_model``), and both the Trainer and a plan
(``jaxseq.cli``) make their programs and batches from it (``program``, ``feeder``): a plan compiles the
run's own train step."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxseq.mesh import context_size
from jaxseq.models.attention import AttentionKernel
from jaxseq.models.decide import decide_execution
from jaxseq.models.execution import Execution
from jaxseq.models.hub import abstract_model, from_config, load_pretrained
from jaxseq.train.feeding import Feeder
from jaxseq.train.lora import LoraConfig, quantized_kernels
from jaxseq.train.optim import OptimizerConfig
from jaxseq.train.step import TrainProgram
from jaxseq.train.task import Task
from jaxseq.train.trainer_config import TrainerConfig
from jaxseq.train.training import teacher_lora_config


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A causal language model a run's objective compares against (distillation's teacher): its transformers
    ``config`` and the ``folder`` its weights come from. It is frozen, its weights stored in the run's compute
    dtype and sharded on the run's mesh by its family's rules; ``quantization`` (``int8``, ``nf4``): its
    blocks' dense kernels stored quantised instead, as QLoRA's base (``jaxseq.train.training.WithTeacher``)."""

    config: Any
    folder: Path
    quantization: str = "none"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """``config``: the model's transformers config (overrides applied); ``task``: the model's task
    (``models.registry.TASKS``); ``objective``: the loss and evaluation (``train.objectives``); ``pack``: pack
    short examples into shared rows, pooling each one's ``"first"`` or ``"last"`` token; ``packed_rows``: the
    data's rows already hold several examples (segment ids in ``attention_mask``); ``teacher``: a ``Teacher``
    the objective compares against (``Task.needs_teacher``)."""

    mesh: Mesh
    config: Any
    task: str
    objective: Task
    trainer: TrainerConfig
    optimizer: OptimizerConfig
    lora: LoraConfig | None = None
    dtype: str = "float32"
    pack: str | None = None
    packed_rows: bool = False
    teacher: Teacher | None = None

    @property
    def scan_layers(self) -> bool:
        """Whether the run's blocks are stacked and scanned (``--scan_layers``: ``Execution.scan_layers``)."""
        return self.execution.scan_layers

    @property
    def loss_scaling(self) -> bool:
        return self.dtype == "float16"

    @property
    def execution(self) -> Execution:
        """How the model's blocks run (``models.execution``): scanned or not, the attention kernel, remat, per-block
        gathering, the experts' mesh, where dropout masks are drawn; decided once, on first use, from the run's
        flags and mesh (``models.decide.decide_execution``), and given to the model's constructor."""
        return self.decided()

    def decided(self, say: Callable[[str], None] | None = None) -> Execution:
        """``execution``, decided here if this is its first use: then ``say`` (default: a logged warning) says
        why attention falls back to XLA, if it does."""
        if "_execution" not in vars(self):
            execution = self._decide(self.config, self.task, say)
            object.__setattr__(self, "_execution", execution)  # frozen: a cache, not a field
        return vars(self)["_execution"]

    def _decide(self, config, task: str, say: Callable[[str], None] | None) -> Execution:
        trainer = self.trainer
        return decide_execution(
            config,
            task,
            mesh=self.mesh,
            dtype=jnp.dtype(self.dtype),
            scan_layers=trainer.scan_layers,
            attention=trainer.attention,
            remat=trainer.remat,
            packed=self.pack is not None or self.packed_rows,
            say=say,
        )

    @property
    def teacher_execution(self) -> Execution:
        """How the teacher's blocks run: as the run's flags decide for its own config (``decided``)."""
        if "_teacher_execution" not in vars(self):
            object.__setattr__(self, "_teacher_execution", self._decide(self.teacher.config, "causal-lm", None))
        return vars(self)["_teacher_execution"]

    def abstract_teacher(self) -> nnx.Module | None:
        """The teacher's model with shapes and dtypes only (None: the run has no teacher)."""
        if self.teacher is None:
            return None
        dtype = jnp.dtype(self.dtype)
        return abstract_model(
            self.teacher.config, "causal-lm", dtype=dtype, param_dtype=dtype, execution=self.teacher_execution
        )

    def build_teacher(self) -> nnx.Module:
        """The teacher on the run's mesh, its weights read from its folder in the compute dtype; the kernels it
        stores quantised stay on the host until quantised (the devices never hold them in full precision)."""
        dtype = jnp.dtype(self.dtype)
        quantization = self.teacher.quantization
        on_host = quantized_kernels(self.abstract_teacher(), teacher_lora_config(quantization))
        return load_pretrained(
            self.teacher.folder,
            "causal-lm",
            mesh=self.mesh,
            dtype=dtype,
            param_dtype=dtype,
            execution=self.teacher_execution,
            on_host=set(on_host),
        )

    @property
    def param_dtype(self) -> jnp.dtype:
        """The dtype the model's weights are stored in: float32, except LoRA's frozen base in a half-precision
        run, stored in the compute dtype (as PEFT users load a bf16 base). LoRA's adapters and what it trains
        in full stay float32 (``Lora.init``)."""
        half = self.dtype in ("bfloat16", "float16")
        return jnp.dtype(self.dtype) if half and self.lora is not None and self.lora.enabled else jnp.dtype("float32")

    def abstract_model(self, say: Callable[[str], None] | None = None) -> nnx.Module:
        """The run's model with shapes and dtypes only (a plan's); ``say``: why attention falls back to XLA, when
        the run's execution is decided here (``decided``)."""
        return abstract_model(
            self.config,
            self.task,
            dtype=jnp.dtype(self.dtype),
            param_dtype=self.param_dtype,
            execution=self.decided(say),
        )

    def build_model(self, checkpoint=None, overrides: Mapping | None = None) -> nnx.Module:
        """The run's model on its mesh: the pretrained ``checkpoint`` folder with ``overrides``, or (None) a
        fresh one from the config, initialised from the run's seed."""
        common = {"mesh": self.mesh, "seed": self.trainer.seed, "dtype": jnp.dtype(self.dtype)}
        common["param_dtype"] = self.param_dtype
        common["execution"] = self.execution
        if checkpoint is not None:
            # QLoRA's kernels stay on the host until quantised: the devices never hold them in full precision
            on_host = quantized_kernels(self.abstract_model(), self.lora) if self.lora and self.lora.enabled else ()
            return load_pretrained(checkpoint, self.task, **common, on_host=set(on_host), **(overrides or {}))
        return from_config(self.config, self.task, **common)

    def total_steps(self, steps_per_epoch: int, trains: bool = True) -> int:
        """Updates of the run: ``--max_steps``, else its epochs of ``steps_per_epoch`` (0 without training)."""
        if not trains:
            return 0
        if self.trainer.max_steps > 0:
            return self.trainer.max_steps
        return max(1, math.ceil(self.trainer.num_train_epochs * steps_per_epoch))

    def feeder(self, train_data, eval_sets: Mapping, attention: str) -> Feeder:
        """The run's batches of ``train_data`` (None: no training) and ``eval_sets``; ``attention``: the
        model's kernel (splash takes whole tiles of 128 tokens)."""
        config = self.trainer
        return Feeder(
            self.mesh,
            train_data,
            eval_sets,
            per_device_train_batch_size=config.per_device_train_batch_size,
            per_device_eval_batch_size=config.per_device_eval_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            seed=config.seed,
            pack=self.pack,
            pack_eval=getattr(self.objective, "packed_outputs", False),
            bucket_multiple=bucket_multiple(attention, context_size(self.mesh)),
        )

    def program(self, model: nnx.Module, total_steps: int) -> TrainProgram:
        """The run's train and eval steps for ``model`` (built from this spec; abstract for a plan)."""
        config = self.trainer
        return TrainProgram(
            model,
            self.objective,
            self.mesh,
            self.optimizer,
            total_steps=max(total_steps, 1),
            seed=config.seed,
            accumulate=config.gradient_accumulation_steps,
            lora=self.lora,
            loss_scaling=self.loss_scaling,
            skip_nonfinite_updates=config.skip_nonfinite_updates,
            teacher=self.abstract_teacher(),
            load_teacher=self.build_teacher,
            teacher_quantization="none" if self.teacher is None else self.teacher.quantization,
        )


def bucket_multiple(attention: str, parts: int = 1) -> int:
    """What evaluation's length buckets are multiples of: splash's tiles of 128 tokens (each device's share of
    a row under cp), and a row that ``parts`` cp devices cut into ``2 * parts`` equal chunks."""
    tile = 128 * parts if attention == "splash" else 8
    return math.lcm(tile, 2 * parts)


def attention_kernel(model: nnx.Module) -> str:
    """The attention kernel ``model`` was built with (``xla`` for a model without attention layers)."""
    kernels = (getattr(m, "attention", None) for _, m in nnx.iter_modules(model))
    return next((k.name for k in kernels if isinstance(k, AttentionKernel)), "xla")
