"""A run's spec: everything about a training run that is neither data nor weights, decided once from its
parsed config (mesh, model config and task, compute dtype, how the blocks run, packing, objective, optimizer,
LoRA). The model is built from it (``build_model``, ``abstract_model``), and both the Trainer and a plan
(``jaxseq.cli``) make their programs and batches from it (``program``, ``feeder``): a plan compiles the
run's own train step."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxseq.mesh import mesh_platform
from jaxseq.models.attention import AttentionKernel
from jaxseq.models.execution import Execution
from jaxseq.models.hub import abstract_model, from_config, load_pretrained
from jaxseq.models.registry import family_for
from jaxseq.train.feeding import Feeder
from jaxseq.train.lora import LoraConfig, quantized_kernels
from jaxseq.train.optim import OptimizerConfig
from jaxseq.train.step import TrainProgram
from jaxseq.train.task import Task


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """``config``: the model's transformers config (overrides applied); ``task``: the model's task
    (``models.registry.TASKS``); ``objective``: the loss and evaluation (``train.objectives``); ``pack``: pack
    short examples into shared rows, pooling each one's ``"first"`` or ``"last"`` token; ``packed_rows``: the
    data's rows already hold several examples (segment ids in ``attention_mask``)."""

    mesh: Mesh
    config: Any
    task: str
    objective: Task
    trainer: Any  # the run's train.trainer.TrainerConfig (the trainer's flags; the trainer imports this module)
    optimizer: OptimizerConfig
    lora: LoraConfig | None = None
    dtype: str = "float32"
    pack: str | None = None
    packed_rows: bool = False

    @property
    def scan_layers(self) -> bool:
        """``--scan_layers`` (``TrainerConfig.scans``), where auto unrolls a config whose blocks cannot scan
        (``Family.scans``: Gemma's sliding and full layers)."""
        scans = self.trainer.scans(mesh_platform(self.mesh))
        if self.trainer.scan_layers == "auto" and scans:
            family_scans = family_for(self.config.model_type).scans
            return family_scans is None or family_scans(self.config)
        return scans

    @property
    def loss_scaling(self) -> bool:
        return self.dtype == "float16"

    @functools.cached_property
    def execution(self) -> Execution:
        """How the model's blocks run: the attention kernel, remat and per-block gathering of this run."""
        packed = self.pack is not None or self.packed_rows
        return Execution(self.trainer.attention, self.trainer.remat, self.mesh, packed=packed)

    def _building(self) -> dict:
        return {"dtype": jnp.dtype(self.dtype), "scan_layers": self.scan_layers, "execution": self.execution}

    def abstract_model(self, say: Callable[[str], None] | None = None) -> nnx.Module:
        """The run's model with shapes and dtypes only (a plan's); ``say``: why attention falls back to XLA."""
        model = abstract_model(self.config, self.task, dtype=jnp.dtype(self.dtype), scan_layers=self.scan_layers)
        self.execution.apply(model, say=say)
        return model

    def build_model(self, checkpoint=None, overrides: Mapping | None = None) -> nnx.Module:
        """The run's model on its mesh: the pretrained ``checkpoint`` folder with ``overrides``, or (None) a
        fresh one from the config, initialised from the run's seed."""
        common = {"mesh": self.mesh, "seed": self.trainer.seed, **self._building()}
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
            bucket_multiple=128 if attention == "splash" else 8,
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
        )


def attention_kernel(model: nnx.Module) -> str:
    """The attention kernel ``model`` was built with (``xla`` for a model without attention layers)."""
    kernels = (getattr(m, "attention", None) for _, m in nnx.iter_modules(model))
    return next((k.name for k in kernels if isinstance(k, AttentionKernel)), "xla")
