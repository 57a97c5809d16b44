"""The train step of a run as one pure function of its state (forward, backward, gradient accumulation, loss
scaling, the optimizer update, the moving average), and the shardings it is jitted with. The Trainer runs it;
a plan (``jaxseq.plan``) compiles the same function for a TPU topology without any weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxseq import sharding
from jaxseq.errors import JaxseqError
from jaxseq.mesh import data_parallel_size, mesh_platform
from jaxseq.models.layers import dropout_prng
from jaxseq.models.registry import family_for
from jaxseq.train.checkpoint import abstract_like
from jaxseq.train.lora import LoraConfig
from jaxseq.train.optim import OptimizerConfig, ema_update, make_optimizer, needs_value_fn
from jaxseq.train.precision import LossScale, all_finite, select
from jaxseq.train.task import Task
from jaxseq.train.training import Training, training_for


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Any  # what trains: every parameter, or with LoRA the adapters and the task head
    opt_state: Any
    loss_scale: LossScale | None = None  # float16 compute only
    ema: Any = None  # moving average of params (--ema_decay), sharded like them


def with_reference(task: Task, training: Training, frozen, batch):
    """``batch`` with the task's reference columns (``reference``) from ``training``'s reference model of the
    ``frozen`` weights (the starting weights; with LoRA the base, adapters off), when the task asks for them
    (``needs_reference``)."""
    if not task.needs_reference:
        return batch
    return {**batch, **jax.lax.stop_gradient(task.reference(training.reference_model(frozen), batch))}


def with_teacher(task: Task, training: Training, frozen) -> Task:
    """``task`` comparing against its teacher of the ``frozen`` weights, when it has one (``needs_teacher``)."""
    return task.with_teacher(training.teacher_model(frozen)) if task.needs_teacher else task


def for_mesh(task: Task, mesh: jax.sharding.Mesh) -> Task:
    """``task`` for batches split over ``mesh``'s batch axes: a task whose memory depends on the rows each
    device holds (``CausalLM``'s loss chunks) learns how many devices share the rows and what they are
    (``for_batch_shards``)."""
    return task.for_batch_shards(data_parallel_size(mesh), mesh.devices.flat[0])


def state_specs(param_specs, state: TrainState) -> TrainState:
    """The parameters' specs as given; the optimizer state and the moving average follow their parameters;
    scalars are replicated."""
    return TrainState(
        P(),
        param_specs,
        sharding.follow_params(state.params, param_specs, state.opt_state),
        jax.tree.map(lambda _: P(), state.loss_scale),
        None if state.ema is None else param_specs,
    )


def abstract_state(params, tx: optax.GradientTransformation, loss_scale: LossScale | None, ema: bool) -> TrainState:
    """The shapes and dtypes of the state that trains ``params`` (arrays or ShapeDtypeStructs)."""
    return TrainState(
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.eval_shape(lambda p: p, params),
        jax.eval_shape(tx.init, params),
        jax.eval_shape(lambda: loss_scale),
        jax.eval_shape(lambda p: p, params) if ema else None,
    )


def train_step_fn(
    training: Training,
    task: Task,
    tx: optax.GradientTransformation,
    schedule: Callable,
    *,
    seed: int,
    accumulate: int = 1,
    line_search: bool = False,
    ema_decay: float = 0.0,
    platform: str,
) -> Callable:
    """``train_step(state, frozen, batch) -> (state, metrics)`` of a program that runs on ``platform`` (its
    dropout keys' PRNG, ``dropout_prng``), whose weights train as ``training`` says (``jaxseq.train.training``):
    ``frozen`` is its frozen tree (LoRA's frozen model, a reference copy), else None. With ``accumulate`` > 1
    the batch is ``[accumulate, micro-batch, ...]`` and the losses and gradients of the micro-batches are
    averaged, each weighted by the task's ``loss_weight`` (a per-token mean counts every target of the step
    once, as on the whole batch; micro-batches padded differently do not each count half). The dropout key
    of a step is a function of the seed and the step alone (exact resume)."""
    prng = dropout_prng(platform)

    def loss_of(params, frozen, batch, key, scale=None):
        model, key = training.train_model(params, frozen, key)
        loss, metrics = with_teacher(task, training, frozen).loss_and_metrics(
            model, with_reference(task, training, frozen, batch), nnx.Rngs(dropout=key)
        )
        return (loss if scale is None else loss * scale), metrics

    def train_step(state: TrainState, frozen, batch):
        key = jax.random.fold_in(jax.random.key(seed, impl=prng), state.step)  # traced: no eager compilations
        scale = None if state.loss_scale is None else state.loss_scale.scale
        if accumulate == 1:
            (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params, frozen, batch, key, scale)
        else:
            weights = jax.vmap(task.loss_weight)(batch)
            weights = weights / jnp.maximum(weights.sum(), 1e-30)

            def body(carry, xs):
                i, mb, w = xs
                (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(
                    state.params, frozen, mb, jax.random.fold_in(key, i), scale
                )
                return jax.tree.map(lambda c, x: (c + w * x).astype(c.dtype), carry, (loss, aux, grads)), None

            first = jax.tree.map(lambda x: x[0], batch)
            _, aux_shapes = jax.eval_shape(loss_of, state.params, frozen, first, key, scale)
            zeros = (
                jnp.zeros((), jnp.float32),
                jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_shapes),
                jax.tree.map(jnp.zeros_like, state.params),
            )
            (loss, aux, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(accumulate), batch, weights))
        if scale is not None:
            loss, grads = jax.tree.map(lambda x: x / scale, (loss, grads))
        if line_search:
            updates, opt_state = tx.update(
                grads,
                state.opt_state,
                state.params,
                value=loss,
                grad=grads,
                value_fn=lambda p: loss_of(p, frozen, batch, key)[0],
            )
        else:
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ema = None if state.ema is None else ema_update(state.ema, params, ema_decay)
        metrics = {**aux, "loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state.step)}
        loss_scale = state.loss_scale
        if loss_scale is not None:  # an overflowing step changes nothing but the scale
            finite = all_finite(grads) & jnp.isfinite(loss)
            params, opt_state, ema = select(
                finite, (params, opt_state, ema), (state.params, state.opt_state, state.ema)
            )
            loss_scale = loss_scale.adjust(finite)
            metrics["skipped_updates"] = loss_scale.skipped
            if loss_scale.factor != 1.0:
                metrics["loss_scale"] = loss_scale.scale
        return TrainState(state.step + 1, params, opt_state, loss_scale, ema), metrics

    return train_step


CPU_COMPILER_OPTIONS = {"xla_cpu_prefer_vector_width": 512}
"""XLA:CPU options of the train and eval steps: 512-bit vectors where the CPU has them (AVX-512; XLA defaults
to 256 and LLVM caps the width at what the CPU has). A BERT step of MiniLM's shape on [16, 128]: 4% faster."""


def compiler_options(shardings) -> dict | None:
    """``CPU_COMPILER_OPTIONS`` when the program runs on CPU devices (the mesh of ``shardings``), else None."""
    named = next((s for s in jax.tree.leaves(shardings) if hasattr(s, "mesh")), None)
    devices = named.mesh.devices.flat if named is not None else jax.devices()
    return dict(CPU_COMPILER_OPTIONS) if next(iter(devices)).platform == "cpu" else None


def jit_train_step(train_step: Callable, state_shardings: TrainState, frozen_shardings=None):
    """The train step jitted as a run executes it: state in and out on its shardings, the state donated."""
    return jax.jit(
        train_step,
        in_shardings=(state_shardings, frozen_shardings, None),
        out_shardings=(state_shardings, None),
        donate_argnums=(0,),
        compiler_options=compiler_options(state_shardings),
    )


class TrainProgram:
    """A run's train and eval steps and everything about them that needs no weights: the task fitted to the
    mesh (``for_mesh``), how the weights train (``training``, a ``jaxseq.train.training.Training``: every
    parameter, or LoRA's adapters and head beside frozen weights) and the trained parameters' specs, the
    optimizer, the state's shapes and shardings, and the jitted steps. ``model`` is built as the run executes
    it (``jaxseq.models.execution``: with fsdp each block gathers its own weights); it may be abstract
    (``nnx.eval_shape``): a plan compiles ``step`` for a topology from ``abstract_state`` alone; the Trainer
    builds the real state with ``init_state``. ``teacher``: a teacher's model (abstract or not) for a task
    that compares against one (``Task.needs_teacher``), ``load_teacher()`` building it with its weights,
    ``teacher_quantization`` how its block kernels are stored (``WithTeacher``)."""

    def __init__(
        self,
        model: nnx.Module,
        task: Task,
        mesh: jax.sharding.Mesh,
        optimizer: OptimizerConfig,
        *,
        total_steps: int,
        seed: int,
        accumulate: int = 1,
        lora: LoraConfig | None = None,
        loss_scaling: bool = False,
        skip_nonfinite_updates: bool = False,
        teacher: nnx.Module | None = None,
        load_teacher: Callable[[], nnx.Module] | None = None,
        teacher_quantization: str = "none",
    ):
        self.mesh = mesh
        self.task = task = for_mesh(task, mesh)
        rules = family_for(model.config.model_type).partition_rules
        param_specs = sharding.match_partition_rules(rules, nnx.state(model))
        self.training = training = training_for(
            model,
            param_specs,
            mesh,
            lora,
            reference=task.needs_reference,
            seed=seed,
            teacher=teacher,
            load_teacher=load_teacher,
            teacher_quantization=teacher_quantization,
        )
        self.graphdef = training.graphdef
        self.ema_decay, self.eval_with_ema = optimizer.ema_decay, optimizer.eval_with_ema
        self.tx, self.schedule = make_optimizer(optimizer, total_steps)
        line_search = needs_value_fn(optimizer)
        if line_search and accumulate > 1:
            raise JaxseqError(
                "--optimizer lbfgs re-evaluates the loss on the whole batch; drop --gradient_accumulation_steps"
            )
        if loss_scaling:
            self.loss_scale = LossScale.create()
        elif skip_nonfinite_updates:  # float16's skip-and-count without its scaling: a scale fixed at 1
            self.loss_scale = LossScale.create(1.0, factor=1.0)
        else:
            self.loss_scale = None
        abstract = abstract_state(training.abstract_trained, self.tx, self.loss_scale, ema=bool(self.ema_decay))
        specs = state_specs(training.specs, abstract)
        sharding.check_divisible(abstract, specs, mesh)
        self.param_specs = specs.params
        self.state_shardings = sharding.make_shardings(mesh, specs)
        self.abstract_state = abstract_like(abstract, self.state_shardings)
        self.abstract_frozen = training.abstract_frozen
        self.step = jit_train_step(
            train_step_fn(
                training,
                task,
                self.tx,
                self.schedule,
                seed=seed,
                accumulate=accumulate,
                line_search=line_search,
                ema_decay=self.ema_decay,
                platform=mesh_platform(mesh),
            ),
            self.state_shardings,
            training.frozen_shardings,
        )

        def eval_step(params, frozen, batch):
            """The task's per-example outputs (``Task.predict``)."""
            batch = with_reference(task, training, frozen, batch)
            return with_teacher(task, training, frozen).predict(training.eval_model(params, frozen), batch)

        self.eval_step = jax.jit(
            eval_step,
            in_shardings=(self.state_shardings.params, training.frozen_shardings, None),
            compiler_options=compiler_options(self.state_shardings),
        )

    def init_state(self, trained) -> TrainState:
        """The first state, from the parameters that train; the moving average starts at them (a copy: the
        state is donated)."""
        return jax.jit(
            lambda p: TrainState(
                jnp.zeros((), jnp.int32),
                p,
                self.tx.init(p),
                self.loss_scale,
                jax.tree.map(jnp.copy, p) if self.ema_decay else None,
            ),
            in_shardings=(self.state_shardings.params,),
            out_shardings=self.state_shardings,
        )(trained)
