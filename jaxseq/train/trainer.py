"""The training loop: one jitted, sharded train step (forward, backward, update; state donated), one
jitted eval step, logging every N steps without a host sync per step, evaluation over every example,
orbax checkpoints and exact resume (the data order is a function of seed and step)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq import partition
from jaxseq.config import arg
from jaxseq.data import packing
from jaxseq.data.batches import eval_indices, steps_per_epoch, train_indices
from jaxseq.data.rows import Rows, as_rows
from jaxseq.errors import Interrupted, JaxseqError
from jaxseq.mesh import batch_spec, data_parallel_size
from jaxseq.train.checkpoint import Checkpointer, abstract_like
from jaxseq.train.logs import RunLogger
from jaxseq.train.lora import Lora, LoraConfig
from jaxseq.train.optim import OptimizerConfig, ema_update, make_optimizer, needs_value_fn
from jaxseq.train.precision import LossScale, all_finite, select
from jaxseq.train.throughput import Throughput


@dataclasses.dataclass
class TrainerConfig:
    output_dir: str = arg("outputs", "where checkpoints, metrics, plots and the final model go")
    per_device_train_batch_size: int = arg(32, "training batch per data-parallel replica (dp x fsdp of the mesh)")
    per_device_eval_batch_size: int = arg(64, "evaluation batch per data-parallel replica")
    gradient_accumulation_steps: int = arg(1, "micro-batches summed into each update")
    num_train_epochs: float = arg(3.0, "epochs to train (ignored when --max_steps > 0)")
    max_steps: int = arg(-1, "total updates; > 0 overrides --num_train_epochs")
    logging_steps: int = arg(50, "log training loss/lr every N updates")
    eval_steps: int = arg(0, "evaluate every N updates (0: at the end of every epoch)")
    save_steps: int = arg(0, "checkpoint every N updates (0: only at the end)")
    save_total_limit: int = arg(2, "keep this many latest checkpoints (plus the best one)")
    metric_for_best_model: str | None = arg(None, "eval metric that picks the best checkpoint, e.g. accuracy")
    greater_is_better: bool = arg(True, "whether a larger --metric_for_best_model is better")
    seed: int = arg(42, "seed of initialisation, data order and dropout")
    resume_from_checkpoint: str | None = arg(
        None, "checkpoint folder to resume from (a run also resumes from --output_dir/checkpoints by itself)"
    )
    skip_nonfinite_updates: bool = arg(
        False,
        "skip an update whose loss or gradients are NaN/inf and count it (train/skipped_updates) instead "
        "of stopping the run",
    )

    def __post_init__(self):
        at_least = {
            "per_device_train_batch_size": 1,
            "per_device_eval_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "logging_steps": 1,
            "save_total_limit": 1,
            "eval_steps": 0,
            "save_steps": 0,
        }
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise JaxseqError(f"--{name} must be at least {low}, got {getattr(self, name)}")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            raise JaxseqError(f"--num_train_epochs must be above 0 (or set --max_steps), got {self.num_train_epochs}")
        check_writable_dir(self.output_dir, "--output_dir")


def check_writable_dir(path: str | os.PathLike, flag: str) -> None:
    """Fail now, not after hours of training, if ``path`` cannot become a folder we write into."""
    out = Path(path).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise JaxseqError(f"{flag} {path} cannot be created: {existing} is a file, not a folder; pick another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JaxseqError(f"{flag} {path} is not writable (no write permission in {existing}); pick another {flag}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Any  # what trains: every parameter, or with LoRA the adapters and the task head
    opt_state: Any
    loss_scale: LossScale | None = None  # float16 compute only
    ema: Any = None  # moving average of params (--ema_decay), sharded like them


class Task(Protocol):
    """What a job (GLUE, causal LM, seq2seq) tells the trainer."""

    def loss(self, model, batch: Mapping[str, jax.Array], rngs: nnx.Rngs | None) -> jax.Array: ...

    def predict(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Per-example outputs (leading batch dimension) that ``metrics`` turns into numbers; they carry what
        the metrics compare against (labels), so the host needs no copy of the eval data."""

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]: ...


def state_specs(param_specs, state: TrainState) -> TrainState:
    """The parameters' specs as given; the optimizer state and the moving average follow their parameters;
    scalars are replicated."""
    return TrainState(
        P(),
        param_specs,
        partition.follow_params(state.params, param_specs, state.opt_state),
        jax.tree.map(lambda _: P(), state.loss_scale),
        None if state.ema is None else param_specs,
    )


class Trainer:
    def __init__(
        self,
        model: nnx.Module,
        task: Task,
        config: TrainerConfig,
        optimizer: OptimizerConfig,
        train_data: Rows | Mapping[str, np.ndarray],
        eval_sets: Mapping[str, Rows | Mapping[str, np.ndarray]],
        mesh: jax.sharding.Mesh,
        rules=None,
        logger: RunLogger | None = None,
        loss_scaling: bool = False,
        pack: str | None = None,
        tokens_per_example: int | None = None,
        flops_per_example: float | None = None,
        peak_flops: float | None = None,
        lora: LoraConfig | None = None,
    ):
        """``train_data`` and each eval set: arrays by name, or ``jaxseq.data.rows`` that tokenize on demand
        (each process then tokenizes only the examples its devices take). ``lora``: train LoRA adapters
        (``jaxseq.train.lora``) instead of every weight; the model's own weights stay frozen, bit for bit.
        ``loss_scaling``: dynamic loss scaling, for models computing in float16. ``pack``: pack short
        examples into shared rows (``jaxseq.data.packing``), pooling each example's ``"first"`` or
        ``"last"`` token; the row counts are sized once for the whole run, so shapes stay static.
        ``tokens_per_example``, ``flops_per_example`` (model FLOPs of one example's forward and backward) and
        ``peak_flops`` (FLOP/s of all devices): when given, the training log adds tokens/s, model FLOP/s and
        MFU (see ``jaxseq.train.throughput``)."""
        self.task, self.config, self.mesh = task, config, mesh
        self.train_data = as_rows(train_data)
        self.eval_sets = {name: as_rows(data) for name, data in eval_sets.items()}
        self.output_dir = Path(config.output_dir)
        dp = data_parallel_size(mesh)
        self.micro_batch = config.per_device_train_batch_size * dp
        self.global_batch = self.micro_batch * config.gradient_accumulation_steps
        self.eval_batch = config.per_device_eval_batch_size * dp
        self.throughput = Throughput(self.global_batch, tokens_per_example, flops_per_example, peak_flops)
        self._mine = self._local_slice(self.micro_batch)  # this process's examples of every micro-batch
        self._eval_mine = self._local_slice(self.eval_batch)
        # how many distinct slices the processes take of a batch (1 with one process)
        self._groups = self.micro_batch // (self._mine.stop - self._mine.start)
        n = len(self.train_data)
        self.steps_per_epoch = steps_per_epoch(n, self.global_batch)
        if self.steps_per_epoch == 0:
            raise JaxseqError(
                f"{n} training examples do not fill one global batch of {self.global_batch}; lower "
                "--per_device_train_batch_size or --gradient_accumulation_steps"
            )
        if config.max_steps > 0:
            self.total_steps = config.max_steps
        else:
            self.total_steps = max(1, math.ceil(config.num_train_epochs * self.steps_per_epoch))

        self.pack = pack
        if pack:
            self._size_packed_batches(dp)
        self.graphdef, params = nnx.split(model)
        rules = rules if rules is not None else partition.get_partition_rules(model.config.model_type)
        param_specs = partition.match_partition_rules(rules, params)
        self.lora = Lora(lora, model, param_specs) if lora is not None and lora.enabled else None
        self.frozen = self._frozen_shardings = None
        if self.lora:  # the model's weights become a frozen input of the steps; the adapters train
            partition.check_divisible(params, param_specs, mesh)
            self._frozen_shardings = partition.make_shardings(mesh, param_specs)
            self.frozen = partition.shard(params, self._frozen_shardings)
            params = jax.jit(
                lambda p: self.lora.init(p, config.seed),
                in_shardings=(self._frozen_shardings,),
                out_shardings=partition.make_shardings(mesh, self.lora.specs),
            )(self.frozen)
            param_specs = self.lora.specs
        self.ema_decay, self.eval_with_ema = optimizer.ema_decay, optimizer.eval_with_ema
        self.tx, self.schedule = make_optimizer(optimizer, self.total_steps)
        self.line_search = needs_value_fn(optimizer)
        if self.line_search and config.gradient_accumulation_steps > 1:
            raise JaxseqError(
                "--optimizer lbfgs re-evaluates the loss on the whole batch; drop --gradient_accumulation_steps"
            )
        if loss_scaling:
            loss_scale = LossScale.create()
        elif config.skip_nonfinite_updates:  # float16's skip-and-count without its scaling: a scale fixed at 1
            loss_scale = LossScale.create(1.0, factor=1.0)
        else:
            loss_scale = None
        self.skips_nonfinite = loss_scale is not None  # else a NaN/inf loss or gradient stops the run
        abstract = TrainState(
            jax.ShapeDtypeStruct((), jnp.int32),
            params,
            jax.eval_shape(self.tx.init, params),
            jax.eval_shape(lambda: loss_scale),
            params if self.ema_decay else None,
        )
        specs = state_specs(param_specs, abstract)
        partition.check_divisible(abstract, specs, mesh)
        self._param_specs = specs.params
        self.state_shardings = partition.make_shardings(mesh, specs)
        self._abstract_state = abstract_like(abstract, self.state_shardings)
        self.state = jax.jit(  # the average starts at the initial parameters (a copy: the state is donated)
            lambda p: TrainState(
                jnp.zeros((), jnp.int32),
                p,
                self.tx.init(p),
                loss_scale,
                jax.tree.map(jnp.copy, p) if self.ema_decay else None,
            ),
            in_shardings=(self.state_shardings.params,),
            out_shardings=self.state_shardings,
        )(params)
        self._train_step = self._compile_train_step()
        self._eval_step = jax.jit(
            self._predict, in_shardings=(self.state_shardings.params, self._frozen_shardings, None)
        )
        self.checkpointer = Checkpointer(
            self.output_dir / "checkpoints",
            keep_last=config.save_total_limit,
            best_metric=config.metric_for_best_model and f"eval/{config.metric_for_best_model}",
            greater_is_better=config.greater_is_better,
        )
        self._check_resume_source()  # before the logger writes anything into output_dir
        self.logger = logger or RunLogger(self.output_dir, self.total_steps)

    # ------------------------------------------------------------------ steps

    def _compile_train_step(self):
        accumulate = self.config.gradient_accumulation_steps
        base_key = jax.random.key(self.config.seed)

        def loss_of(params, frozen, batch, key, scale=None):
            if self.lora is None:
                model = nnx.merge(self.graphdef, params)
            else:
                key, adapter_key = jax.random.split(key)
                model = self.lora.training_model(self.graphdef, params, frozen, adapter_key)
            loss = self.task.loss(model, batch, nnx.Rngs(dropout=key))
            return loss if scale is None else loss * scale

        def train_step(state: TrainState, frozen, batch):
            key = jax.random.fold_in(base_key, state.step)
            scale = None if state.loss_scale is None else state.loss_scale.scale
            if accumulate == 1:
                loss, grads = jax.value_and_grad(loss_of)(state.params, frozen, batch, key, scale)
            else:
                micro = batch  # [accumulate, micro-batch, ...]: see _device_batch

                def body(carry, xs):
                    i, mb = xs
                    loss, grads = jax.value_and_grad(loss_of)(
                        state.params, frozen, mb, jax.random.fold_in(key, i), scale
                    )
                    return jax.tree.map(jnp.add, carry, (loss, grads)), None

                zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
                (loss, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(accumulate), micro))
                loss, grads = jax.tree.map(lambda x: x / accumulate, (loss, grads))
            if scale is not None:
                loss, grads = jax.tree.map(lambda x: x / scale, (loss, grads))
            if self.line_search:
                updates, opt_state = self.tx.update(
                    grads,
                    state.opt_state,
                    state.params,
                    value=loss,
                    grad=grads,
                    value_fn=lambda p: loss_of(p, frozen, batch, key),
                )
            else:
                updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            ema = None if state.ema is None else ema_update(state.ema, params, self.ema_decay)
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": self.schedule(state.step)}
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

        step = jax.jit(
            train_step,
            in_shardings=(self.state_shardings, self._frozen_shardings, None),
            out_shardings=(self.state_shardings, None),
            donate_argnums=(0,),
        )
        return lambda state, batch: step(state, self.frozen, batch)

    def _size_packed_batches(self, dp: int) -> None:
        """Packed rows per micro-batch (the most any micro-batch of the run needs) and per eval batch. Every
        data-parallel shard packs its own examples into its own rows, so the layout depends on the mesh,
        not on how many processes share it; each process sizes only its shards (tokenizing only those)
        and the processes agree on the largest."""
        micro = self.config.gradient_accumulation_steps
        indices = train_indices(len(self.train_data), self.global_batch, self.config.seed)
        run = (next(indices).reshape(micro, -1)[:, self._mine] for _ in range(self.total_steps))
        self.packed_rows = self._rows_for((self.train_data.take(m) for b in run for m in b), dp)
        self.eval_packed_rows = {
            name: self._rows_for(
                (data.take(index[self._eval_mine]) for index, _ in eval_indices(len(data), self.eval_batch)), dp
            )
            for name, data in self.eval_sets.items()
        }

    def _rows_for(self, batches, dp: int) -> int:
        """Packed rows of a whole batch: ``dp`` times the most any shard of this process's ``batches`` (or of
        any other process's) needs."""
        needed = packing.rows_needed(shard for batch in batches for shard in self._shards(batch))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            needed = int(np.max(multihost_utils.process_allgather(np.int32(needed))))
        return dp * needed

    def _shards(self, local: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """This process's examples of a batch, split into its data-parallel shards."""
        shards = data_parallel_size(self.mesh) // self._groups
        return [{k: v[i] for k, v in local.items()} for i in np.split(np.arange(len(local["input_ids"])), shards)]

    def _local_slice(self, rows: int) -> slice:
        """The rows of a batch of ``rows`` (split over the batch axes) that this process's devices hold."""
        return local_rows(NamedSharding(self.mesh, batch_spec(1)), (rows,))

    def batches(self, start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
        """The training batches from ``start_step`` on, on the devices. The global order is a function of
        the seed and the step alone; this process takes (tokenizes, packs) only its own examples of each."""
        micro = self.config.gradient_accumulation_steps
        for index in train_indices(len(self.train_data), self.global_batch, self.config.seed, start_step):
            parts = [
                self._local(self.train_data, m[self._mine], self.pack and self.packed_rows)
                for m in index.reshape(micro, -1)
            ]
            yield self._device_batch(
                parts[0] if micro == 1 else {k: np.stack([p[k] for p in parts]) for k in parts[0]}, stacked=micro > 1
            )

    def _local(self, data: Rows, index: np.ndarray, packed_rows: int | None) -> dict[str, np.ndarray]:
        """This process's examples ``index`` of one batch; if ``packed_rows`` is given, each data-parallel
        shard packed into its share of them."""
        local = data.take(index)
        if not packed_rows:
            return local
        per_shard = packed_rows // data_parallel_size(self.mesh)
        first = self._local_slice(packed_rows).start
        parts = [
            packing.pack(shard, per_shard, self.pack, first_row=first + i * per_shard)
            for i, shard in enumerate(self._shards(local))
        ]
        return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}

    def _device_batch(self, local: Mapping[str, np.ndarray], stacked: bool = False) -> dict[str, jax.Array]:
        """This process's rows -> global arrays split over the batch axes. ``stacked``: arrays are
        ``[micro-batches, rows, ...]`` and each micro-batch is split on its own."""
        out = {}
        for name, value in local.items():
            lead = value.shape[:2] if stacked else value.shape[:1]
            spec = P(None, *batch_spec(value.ndim - 1)) if stacked else batch_spec(value.ndim)
            shape = (*lead[:-1], lead[-1] * self._groups, *value.shape[len(lead) :])
            out[name] = jax.make_array_from_process_local_data(NamedSharding(self.mesh, spec), value, shape)
        return out

    def _predict(self, params, frozen, batch):
        return self.task.predict(self._model(params, frozen), batch)

    def _model(self, params, frozen) -> nnx.Module:
        """The model of ``params`` (with LoRA: the frozen weights, adapters folded in, the trained head)."""
        return nnx.merge(self.graphdef, params if self.lora is None else self.lora.merged(params, frozen))

    # ------------------------------------------------------------------ loop

    def _check_resume_source(self) -> None:
        """The checkpoint this run would resume from must hold this run's arrays: another model's (or
        optimizer's) checkpoint in the output dir is reported from its metadata, before anything is loaded."""
        source = self.config.resume_from_checkpoint
        checkpointer = self.checkpointer
        if source and Path(source).absolute() != checkpointer.directory:
            if not Path(source).is_dir():
                raise JaxseqError(f"--resume_from_checkpoint {source} is not a folder; drop it to start afresh")
            checkpointer = Checkpointer(source)
        step = checkpointer.latest_step()
        if step is not None:
            checkpointer.check_fits(step, self._abstract_state)

    def restore_if_any(self) -> int:
        """Resume from ``resume_from_checkpoint`` or the latest checkpoint in the output dir; returns the step."""
        source = self.config.resume_from_checkpoint
        checkpointer = self.checkpointer
        if source and Path(source).absolute() != checkpointer.directory:
            checkpointer = Checkpointer(source)
        step = checkpointer.latest_step()
        if step is None:
            if source:
                raise JaxseqError(f"no checkpoint in {source}; drop --resume_from_checkpoint to start afresh")
            return 0
        state, record = checkpointer.restore(step, self._abstract_state)
        # the data order is a function of these and the step: a resumed run must see the same ones
        now = {"global batch": self.global_batch, "seed": self.config.seed, "training examples": len(self.train_data)}
        saved = {
            "global batch": record.get("global_batch"),
            "seed": record.get("seed"),
            "training examples": record.get("train_examples"),
        }
        changed = [name for name in now if saved[name] not in (None, now[name])]
        if changed:
            raise JaxseqError(
                f"checkpoint in {checkpointer.directory} was made with "
                f"{', '.join(f'{name} {saved[name]}' for name in changed)} (this run: "
                f"{', '.join(f'{name} {now[name]}' for name in changed)}); resume with the same settings and data "
                "or use a fresh --output_dir"
            )
        self.state = state
        self.logger.resume(step)
        self.logger.write(f"resumed from {checkpointer.directory / str(step)} (step {step})")
        return step

    def train(self) -> dict[str, float]:
        """Train to ``total_steps`` (resuming from a checkpoint if there is one) and return the results.
        A NaN/inf loss or gradient stops it with a JaxseqError naming the step (nothing non-finite is ever
        saved), unless such updates are skipped; SIGINT/SIGTERM save a checkpoint at the current step and
        end it with ``Interrupted``."""
        self._signal = None
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, self._on_signal)
        self._previous_handlers = previous
        try:
            return self._train()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum, frame) -> None:
        """Note the signal for the loop (which saves and stops after the current step); a second one acts
        as it would have without us."""
        self._signal = signum
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)

    def _train(self) -> dict[str, float]:
        config = self.config
        start = self.restore_if_any()
        eval_every = config.eval_steps or self.steps_per_epoch
        batches = self.batches(start)
        pending: list[dict] = []
        eval_metrics: dict[str, float] = {}
        started = time.perf_counter()
        compile_seconds = None
        step = start
        while step < self.total_steps:
            t0 = time.perf_counter()
            self.state, metrics = self._train_step(self.state, next(batches))
            if compile_seconds is None:
                jax.block_until_ready(metrics["loss"])
                compile_seconds = time.perf_counter() - t0
                self.logger.write(f"first step (compile included): {compile_seconds:.1f}s")
                self.throughput.start(step + 1)
            pending.append(metrics)
            step += 1
            self.logger.advance()
            logged = step % config.logging_steps == 0 or step == self.total_steps
            if logged:
                self._log_train(step, pending, started)
                pending = []
            evaluate_now = step % eval_every == 0 or step == self.total_steps
            save_now = (config.save_steps and step % config.save_steps == 0) or step == self.total_steps
            if evaluate_now or save_now:  # not training: keep it out of the throughput figures
                jax.block_until_ready(self.state)
                self._check_finite(step, partition.gather(pending))  # never evaluate or save a NaN state
                self.throughput.pause(step)
                if evaluate_now:
                    eval_metrics = self.evaluate()
                    self.logger.log(step, {f"eval/{k}": v for k, v in eval_metrics.items()})
                if save_now:
                    self.save(step, eval_metrics if evaluate_now else None)
                self.throughput.resume(step)
            if step < self.total_steps and self._signalled(logged):
                self._stop_for_signal(step, pending, started, saved=bool(save_now))
        runtime = time.perf_counter() - started
        self._report_tokenized()
        if not eval_metrics:  # resumed from a finished run: nothing trained, still report where it stands
            eval_metrics = self.evaluate()
        self.checkpointer.wait()
        trained = max(self.total_steps - start, 0)
        return {
            "train_runtime": runtime,
            "train_samples_per_second": trained * self.global_batch / runtime if runtime else 0.0,
            "train_steps_per_second": trained / runtime if runtime else 0.0,
            "train_compile_seconds": compile_seconds or 0.0,
            "epoch": self.total_steps / self.steps_per_epoch,
            **self.sizes(),
            **{f"train_{k}": v for k, v in self.throughput.summary().items()},
            **{f"eval_{k}": v for k, v in eval_metrics.items()},
        }

    def _report_tokenized(self) -> None:
        """Multi-host runs: how many training examples each process tokenized (each only what it took)."""
        if jax.process_count() == 1 or not hasattr(self.train_data, "encoded"):
            return
        from jax.experimental import multihost_utils

        counts = multihost_utils.process_allgather(np.int32(self.train_data.encoded))
        self.logger.write(
            f"training examples tokenized by each process: {np.asarray(counts).tolist()} of {len(self.train_data)}"
        )

    def _check_finite(self, step: int, host: list[dict]) -> None:
        """Stop at the first of the steps ending at ``step`` (their metrics ``host``) whose loss or gradient
        is NaN/inf, before anything logs, evaluates or saves what it produced. Skipped updates are fine."""
        if self.skips_nonfinite:
            return
        for i, metrics in enumerate(host):
            bad = next((k for k in ("loss", "grad_norm") if not np.isfinite(metrics[k])), None)
            if bad is None:
                continue
            self.checkpointer.wait()
            last = self.checkpointer.latest_step()
            kept = (
                f"the last good checkpoint is step {last} in {self.checkpointer.directory} (a rerun resumes from it)"
                if last is not None
                else "no checkpoint had been saved"
            )
            raise JaxseqError(
                f"the training {'loss' if bad == 'loss' else 'gradient norm'} became {float(metrics[bad])} at step "
                f"{step - len(host) + 1 + i}; {kept}; lower --learning_rate (or add --warmup_steps), or pass "
                "--skip_nonfinite_updates to skip such updates"
            )

    def _signalled(self, logged: bool) -> int | None:
        """The signal to stop for, if any. With several processes they must agree on the step: they compare
        notes at logging steps only (where metrics sync anyway), never forcing a sync per step."""
        if jax.process_count() == 1:
            return self._signal
        if not logged:
            return None
        from jax.experimental import multihost_utils

        return int(np.max(multihost_utils.process_allgather(np.int32(self._signal or 0)))) or None

    def _stop_for_signal(self, step: int, pending: list[dict], started: float, saved: bool) -> None:
        """Log what is pending, save a checkpoint at ``step`` (unless just saved), wait for it, stop."""
        signum = self._signal or signal.SIGTERM
        if pending:
            self._log_train(step, pending, started)
        if not saved:
            jax.block_until_ready(self.state)
            self.save(step, None)
        self.checkpointer.wait()
        name = signal.Signals(signum).name
        raise Interrupted(
            f"{name} at step {step}: saved a checkpoint in {self.checkpointer.directory / str(step)}; "
            "rerun the same command to resume from it",
            signum,
        )

    def _log_train(self, step: int, pending: list[dict], started: float) -> None:
        host = partition.gather(pending)
        self._check_finite(step, host)
        latest = ("learning_rate", "loss_scale", "skipped_updates")  # states, not per-step amounts
        values = {f"train/{k}": float(host[-1][k] if k in latest else np.mean([m[k] for m in host])) for k in host[0]}
        values.update({f"train/{k}": v for k, v in self.throughput.report(step).items()})  # synced just above
        if not all(math.isfinite(v) for v in values.values()):
            self.logger.write(f"warning: non-finite training metrics at step {step}: {values}")
        self.logger.log(step, values)

    def save(self, step: int, eval_metrics: dict | None) -> None:
        record = {
            "step": step,
            "global_batch": self.global_batch,
            "seed": self.config.seed,
            "train_examples": len(self.train_data),
            "epoch": step / self.steps_per_epoch,
        }
        metrics = {f"eval/{k}": v for k, v in eval_metrics.items()} if eval_metrics else None
        self.checkpointer.save(step, self.state, record, metrics)

    def evaluate(self) -> dict[str, float]:
        """Metrics over every example of every eval set (keys suffixed by set, as the task names them)."""
        results = {}
        for name, data in self.eval_sets.items():
            outputs: dict[str, list] = {}
            packed_rows = self.pack and self.eval_packed_rows[name]
            for index, valid in eval_indices(len(data), self.eval_batch):
                batch = self._device_batch(self._local(data, index[self._eval_mine], packed_rows))
                predicted = partition.gather(self._eval_step(self.eval_params(), self.frozen, batch))
                for key, value in predicted.items():
                    outputs.setdefault(key, []).append(np.asarray(value)[valid])
            merged = {k: np.concatenate(v) for k, v in outputs.items()}
            for key, value in self.task.metrics(merged).items():
                results[f"{key}{name}"] = value
        return results

    def describe(self) -> str:
        """Table of every trained parameter's shape, dtype, spec and bytes per device (printed at start)."""
        table = partition.describe(self.state.params, self._param_specs, self.mesh)
        if self.lora is None:
            return table
        return f"{table}\n{self.lora.describe(_count(self.frozen), _count(self.state.params))}"

    def sizes(self) -> dict[str, int]:
        """How many parameters train, and the bytes their optimizer state takes (all devices together)."""
        return {
            "trainable_parameters": _count(self.state.params),
            "optimizer_state_bytes": sum(x.nbytes for x in jax.tree.leaves(self.state.opt_state)),
        }

    def eval_params(self):
        """What evaluation and export use: the moving average with --ema_decay (unless --eval_with_ema false),
        else the trained parameters."""
        return self.state.ema if self.state.ema is not None and self.eval_with_ema else self.state.params

    def model(self) -> nnx.Module:
        """The evaluated parameters as a plain model (LoRA adapters folded into their kernels), for export."""
        return self._model(self.eval_params(), self.frozen)

    def close(self) -> None:
        try:
            self.checkpointer.close()
        finally:
            self.logger.close()


def _count(tree) -> int:
    return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree))


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows of a global array of ``shape`` that this process's devices hold under ``sharding``."""
    if jax.process_count() == 1:
        return slice(0, shape[0])
    spans = [index[0] for index in sharding.addressable_devices_indices_map(shape).values()]
    return slice(min(s.start or 0 for s in spans), max(shape[0] if s.stop is None else s.stop for s in spans))


def write_results(
    output_dir: Path, results: dict, *, train_samples: int, eval_samples: int, extra_eval: dict | None = None
) -> dict:
    """``eval_results.json`` (the ``eval_*`` entries of ``Trainer.train``'s results, plus ``extra_eval``)
    and ``all_results.json`` (everything), as transformers' scripts write them; the eval figures are
    printed on one line. Returns the eval entries."""
    eval_results = {
        **{k: v for k, v in results.items() if k.startswith("eval_")},
        **(extra_eval or {}),
        "eval_samples": eval_samples,
    }
    write_json(output_dir / "eval_results.json", eval_results)
    write_json(output_dir / "all_results.json", {**results, **eval_results, "train_samples": train_samples})
    if jax.process_index() == 0:
        print(" ".join(f"{k}={v:.4g}" for k, v in sorted(eval_results.items()) if isinstance(v, float)))
    return eval_results


def write_json(path: Path, values: dict) -> None:
    if jax.process_index() != 0:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
