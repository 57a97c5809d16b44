"""The training loop: one jitted, sharded train step (forward, backward, update; state donated), one
jitted eval step, logging every N steps without a host sync per step, evaluation over every example,
orbax checkpoints and exact resume (the data order is a function of seed and step)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxseq import sharding
from jaxseq.data.rows import Rows, as_rows
from jaxseq.errors import Interrupted, JaxseqError
from jaxseq.files import RunLock
from jaxseq.train.checkpoint import Checkpointer
from jaxseq.train.feeding import with_rows
from jaxseq.train.logs import Finished, RunLogger
from jaxseq.train.spec import RunSpec, attention_kernel
from jaxseq.train.step import TrainState
from jaxseq.train.task import Policy, Task
from jaxseq.train.throughput import Throughput

PREDICT = "predict"  # the feeder's names of the predict sets start with this


class Trainer:
    def __init__(
        self,
        spec: RunSpec,
        model: nnx.Module | Callable[[], nnx.Module],
        train_data: Rows | Mapping[str, np.ndarray] | None,
        eval_sets: Mapping[str, Rows | Mapping[str, np.ndarray]],
        *,
        predict_sets: Mapping[str, Rows | Mapping[str, np.ndarray]] | None = None,
        tokens_per_example: int | None = None,
        flops_per_example: float | None = None,
        peak_flops: float | None = None,
        evaluations: Callable[[nnx.Module], dict[str, float]] | None = None,
    ):
        """The run of ``spec`` (``jaxseq.train.spec``) training ``model``, built from it, or ``model()``: then
        the first step's program compiles on a background thread while the model is built (loaded from its
        checkpoint: a CPU run's first step is a compilation of seconds). ``train_data`` and
        each eval set: arrays by name, or ``jaxseq.data.rows`` that tokenize on demand (each process then
        tokenizes only the examples its devices take); ``train_data=None`` evaluates and predicts only.
        ``predict_sets``: sets ``predict`` runs through the evaluation batches (their labels may be
        placeholders). ``tokens_per_example``, ``flops_per_example`` (model FLOPs of one example's forward and
        backward) and ``peak_flops`` (FLOP/s of all devices): when given, the training log adds tokens/s,
        model FLOP/s and MFU (see ``jaxseq.train.throughput``). ``evaluations(model)``: more eval metrics of the
        evaluated weights as a plain model, at each evaluation (lm-eval's tasks: ``harness.TaskEvaluation``)."""
        config = spec.trainer
        self.spec, self.task, self.config, self.mesh = spec, spec.objective, config, spec.mesh
        self.output_dir = Path(config.output_dir)
        self.eval_names = list(eval_sets)
        self.evaluations = evaluations
        self.evaluates = bool(self.eval_names) or evaluations is not None  # whether evaluations happen at all
        predict_sets = {f"{PREDICT}{k}": v for k, v in (predict_sets or {}).items()}
        build = None if isinstance(model, nnx.Module) else model
        shaped = spec.abstract_model() if build else model
        self.attention = attention_kernel(shaped)
        self.feed = spec.feeder(train_data, {**eval_sets, **predict_sets}, self.attention)
        self.global_batch, self.steps_per_epoch = self.feed.global_batch, self.feed.steps_per_epoch
        self.throughput = Throughput(self.global_batch, tokens_per_example, flops_per_example, peak_flops)
        self.total_steps = spec.total_steps(self.steps_per_epoch, trains=train_data is not None)
        self.feed.size_packing(self.total_steps)
        self.program = program = spec.program(shaped, self.total_steps)
        self._compiling: dict[int | tuple, Future] = {}  # compiling in the background (_compile_ahead)
        if build:
            self._compiling = self._compile_first_step()
            model = build()
        self.task = program.task  # fitted to the mesh (the causal-LM loss's chunks)
        self.graphdef, self.training = program.graphdef, program.training
        self.ema_decay, self.eval_with_ema = program.ema_decay, program.eval_with_ema
        self.skips_nonfinite = program.loss_scale is not None  # else a NaN/inf loss or gradient stops the run
        params = nnx.state(model)
        self.frozen = self.training.freeze(params)  # None: nothing is frozen
        self.state = program.init_state(self.training.init(params))
        self._train_step = lambda state, batch: program.step(state, self.frozen, batch)
        self._eval_step = program.eval_step
        self.policy = Policy(  # what a task sampling in the loop gets of the run (GRPO's rollouts)
            model=lambda: self.training.eval_model(self.state.params, self.frozen),
            per_device_batch=config.per_device_train_batch_size,
            replicas=self.feed.dp,
            accumulate=config.gradient_accumulation_steps,
            place=self.feed.device_batch,
            local=self.feed.local,
        )
        self._stepped = False  # whether a train step has run (then every step's program is compiled or compiling)
        self.checkpointer = Checkpointer(
            self.output_dir / "checkpoints",
            keep_last=config.save_total_limit,
            best_metric=config.metric_for_best_model and f"eval/{config.metric_for_best_model}",
            greater_is_better=config.greater_is_better,
        )
        self._check_best_metric(self.task)
        self._check_resume_source()  # before the logger writes anything into output_dir
        self.lock = RunLock(self.output_dir)
        if jax.process_index() == 0:
            self.lock.acquire()
        self.logger = RunLogger(
            self.output_dir,
            self.total_steps,
            report_to=config.backends,
            run_name=config.run_name,
            project=config.project,
            run_config={**dataclasses.asdict(config), **dataclasses.asdict(spec.optimizer)},
        )
        self.logger.write(f"attention kernel: {self.attention}")
        if self.task.precomputes_reference:
            self._precompute_reference()

    def _precompute_reference(self) -> None:
        """Every set's reference columns (the task's ``reference``, e.g. DPO's reference log-probs), once,
        from the starting weights through the evaluation batches: they join the sets' arrays, so no
        reference weights are held while training."""
        feed, eval_model = self.feed, self.training.eval_model
        step = jax.jit(lambda params, frozen, batch: self.task.reference(eval_model(params, frozen), batch))
        for name in ([None] if feed.train_data is not None else []) + list(feed.eval_sets):
            data = feed.train_data if name is None else feed.eval_sets[name]
            key = f"reference {'train' if name is None else name or 'eval'}"
            feed.eval_sets[key], feed.eval_packed_rows[key] = data, None
            try:
                columns = self._outputs(key, bar=f"{key} log-probs", step=step)
            finally:
                del feed.eval_sets[key], feed.eval_packed_rows[key]
            arrays = as_rows({**data.take(np.arange(len(data))), **columns})
            if name is None:
                feed.train_data = arrays
            else:
                feed.eval_sets[name] = arrays

    # ------------------------------------------------------------------ loop

    def _due(self, step: int, strategy: str, every: int) -> bool:
        """Whether ``--eval_strategy``/``--save_strategy`` ``strategy`` acts at ``step`` (always at the end)."""
        if strategy == "no":
            return False
        every = self.steps_per_epoch if strategy == "epoch" else every
        return step == self.total_steps or (bool(every) and step % every == 0)

    def _pauses_after(self, step: int) -> int:
        """How many of the steps after ``step`` evaluate or save (the progress bar's ETA counts them)."""
        config = self.config
        return sum(
            1
            for s in range(step + 1, self.total_steps + 1)
            if (self.evaluates and self._due(s, config.eval_strategy, config.eval_steps))
            or self._due(s, config.save_strategy, config.save_steps)
        )

    def _check_best_metric(self, task: Task) -> None:
        """--metric_for_best_model must name an eval metric; with --load_best_model_at_end every save must
        fall on an evaluation (so that every checkpoint can compete). Checked before anything is written."""
        config = self.config
        metric = config.metric_for_best_model
        names = task.metric_names
        if metric and self.total_steps and not self.eval_names:
            raise JaxseqError(f"--metric_for_best_model {metric} needs evaluations: give the run an eval set")
        if metric and names is not None and self.total_steps:
            known = [f"{name}{suffix}" for suffix in self.eval_names for name in names]
            if metric not in known:
                raise JaxseqError(
                    f"--metric_for_best_model {metric} is not an eval metric of this run; choose one of "
                    f"{', '.join(known)} (with or without the eval_ prefix)"
                )
        if config.load_best_model_at_end:
            for step in range(1, self.total_steps + 1):
                if self._due(step, config.save_strategy, config.save_steps) and not self._due(
                    step, config.eval_strategy, config.eval_steps
                ):
                    raise JaxseqError(
                        f"--load_best_model_at_end: the checkpoint of step {step} would have no evaluation; use "
                        "the same --save_strategy as --eval_strategy, with --save_steps a multiple of --eval_steps"
                    )

    def _check_resume_source(self) -> None:
        """The checkpoint this run would resume from must hold this run's arrays: another model's (or
        optimizer's) checkpoint in the output dir is reported from its metadata, before anything is loaded."""
        checkpointer, step = self._resume_source()
        if step is not None:
            checkpointer.check_fits(step, self.program.abstract_state)

    def _resume_source(self) -> tuple[Checkpointer, int | None]:
        """Where this run resumes from: ``--resume_from_checkpoint`` (a run's ``checkpoints`` folder: its
        latest step; or one step's folder in it) or else the output dir's latest checkpoint (None: none)."""
        source = self.config.resume_from_checkpoint
        if not source or Path(source).absolute() == self.checkpointer.directory:
            return self.checkpointer, self.checkpointer.latest_step()
        path = Path(source)
        if not path.is_dir():
            raise JaxseqError(f"--resume_from_checkpoint {source} is not a folder; drop it to start afresh")
        if path.name.isdigit() and (path / "record").is_dir():  # one saved step: checkpoints/STEP
            return Checkpointer(path.parent), int(path.name)
        checkpointer = Checkpointer(path)
        return checkpointer, checkpointer.latest_step()

    def restore_if_any(self) -> int:
        """Resume from ``resume_from_checkpoint`` or the latest checkpoint in the output dir; returns the step."""
        source = self.config.resume_from_checkpoint
        checkpointer, step = self._resume_source()
        if step is None:
            if source:
                raise JaxseqError(f"no checkpoint in {source}; drop --resume_from_checkpoint to start afresh")
            return 0
        state, record = checkpointer.restore(step, self.program.abstract_state)
        self.state = state
        if self.feed.train_data is None:  # evaluation only: no data order to continue
            self.logger.write(f"loaded {checkpointer.directory / str(step)} (step {step})")
            return step
        # the data order is a function of these and the step: a resumed run must see the same ones
        now = {
            "global batch": self.global_batch,
            "seed": self.config.seed,
            "training examples": len(self.feed.train_data),
        }
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
            for ahead in self._compiling.values():  # stopped early: what has not started never will
                ahead.cancel()
            self._compiling.clear()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _compiled(self, rows: int) -> bool:
        """Whether the train step for ``rows`` packed rows is compiled: not still compiling ahead (before the
        first step nothing is: that step waits for its own program)."""
        return self._stepped and (rows not in self._compiling or self._compiling[rows].done())

    def _compile_first_step(self) -> dict[int, Future]:
        """The train step for the first step's batch shape, compiling on a background thread (keyed by its
        row count, as ``_compile_ahead``'s), while the model is built: none without training, when a task
        makes its batches itself (GRPO's rollouts), or when its reference columns join the batches later
        (``precomputes_reference``)."""
        if self.feed.train_data is None or self.task.samples_in_the_loop or self.task.precomputes_reference:
            return {}
        program, batch = self.program, self.feed.abstract_batches()[0]
        state, frozen = program.abstract_state, program.abstract_frozen
        return compile_in_background({batch["input_ids"].shape[-2]: lambda: program.step.lower(state, frozen, batch)})

    def _compile_ahead(self, batch: Mapping[str, jax.Array], step: int) -> dict[int | tuple, Future]:
        """Compile the train step for the other packed row counts of the steps from ``step`` on (keyed by row
        count), then the eval step for each batch shape of each eval set (keyed ``("eval", name, k)``: every
        length bucket's width), one after another on a background thread in order of first use, while the
        first steps train: a compilation then overlaps training instead of stopping it (on a CPU it takes the
        cores training leaves idle)."""
        specs: dict = {
            r: with_rows(batch, r) for r in self.feed.upcoming_rows(step) if r != batch["input_ids"].shape[-2]
        }
        for name in self.eval_names:
            for shape in self.feed.eval_shapes(name):
                specs["eval", name, len(specs)] = shape
        if not specs:
            return {}
        program = self.program
        state = program.abstract_state
        eval_params = self.eval_params(state)

        def lowered(key, spec):
            if isinstance(key, tuple):
                return program.eval_step.lower(eval_params, program.abstract_frozen, spec)
            return program.step.lower(state, program.abstract_frozen, spec)

        return compile_in_background({key: functools.partial(lowered, key, spec) for key, spec in specs.items()})

    def _on_signal(self, signum, frame) -> None:
        """Note the signal for the loop (which saves and stops after the current step); a second one acts
        as it would have without us."""
        self._signal = signum
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)

    def _train(self) -> dict[str, float]:
        config = self.config
        if self.feed.train_data is None:
            raise JaxseqError("this run has no training data; pass it, or only evaluate and predict")
        start = self.restore_if_any()
        batches = self.feed.batches(start, ready=self._compiled)
        pending: list[dict] = []
        eval_metrics: dict[str, float] = {}
        started = time.perf_counter()
        compile_seconds = None
        self._progress = Finished(self.logger.bar)  # the bar counts finished steps, not dispatched ones
        step = start
        while step < self.total_steps:
            t0 = time.perf_counter()
            batch = next(batches)
            if ahead := self._compiling.pop(batch["input_ids"].shape[-2], None):
                ahead.result()  # its compilation is done (or ends here, or its error is raised here)
            made = {}
            if self.task.samples_in_the_loop:  # the batch made with the current weights (GRPO)
                batch, made = self.task.rollout(self.policy, batch, step)
            self.state, metrics = self._train_step(self.state, batch)
            metrics = {**made, **metrics}
            self._progress.dispatched(metrics)
            if compile_seconds is None:
                jax.block_until_ready(metrics["loss"])
                compile_seconds = time.perf_counter() - t0
                self.logger.write(f"first step (compile included): {compile_seconds:.1f}s")
                self.throughput.start(step + 1)
                self._progress.drain()
                self.logger.restart_clock()  # rate and ETA from the compiled steps on
                self._compiling = self._compile_ahead(batch, step + 1)
                self._stepped = True
            pending.append(metrics)
            step += 1
            logged = step % config.logging_steps == 0 or step == self.total_steps
            if logged:
                self._log_train(step, pending, started)
                pending = []
            evaluate_now = self.evaluates and self._due(step, config.eval_strategy, config.eval_steps)
            save_now = self._due(step, config.save_strategy, config.save_steps)
            if evaluate_now or save_now:  # not training: keep it out of the throughput figures
                jax.block_until_ready(self.state)
                self._progress.drain()
                self._check_finite(step, sharding.gather(pending))  # never evaluate or save a NaN state
                self.throughput.pause(step)
                paused = time.perf_counter()
                if evaluate_now:
                    eval_metrics = self.evaluate()
                    self.logger.log(step, {f"eval/{k}": v for k, v in eval_metrics.items()})
                if save_now:
                    self.save(step, eval_metrics if evaluate_now else None)
                self.throughput.resume(step)
                self.logger.paused(time.perf_counter() - paused, self._pauses_after(step))
            if step < self.total_steps and self._signalled(logged):
                self._stop_for_signal(step, pending, started, saved=bool(save_now))
        runtime = time.perf_counter() - started
        self._report_tokenized()
        if not eval_metrics and self.evaluates:  # --eval_strategy no, or resumed from a finished run
            eval_metrics = self.evaluate()
            if step > start:
                self.logger.log(step, {f"eval/{k}": v for k, v in eval_metrics.items()})
        self.checkpointer.wait()
        if config.load_best_model_at_end:
            eval_metrics = self._load_best(eval_metrics)
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

    def _load_best(self, last: dict[str, float]) -> dict[str, float]:
        """Go back to the best checkpoint by --metric_for_best_model (if it is not the current state);
        returns its eval metrics, which are those of the state now held."""
        metric = self.config.metric_for_best_model
        best = self.checkpointer.best_step(f"eval/{metric}", self.config.greater_is_better)
        if best is None or (best == self.checkpointer.latest_step() and last):
            return last
        self.state, _ = self.checkpointer.restore(best, self.program.abstract_state)
        metrics = {k.removeprefix("eval/"): v for k, v in self.checkpointer.metrics(best).items()}
        self.logger.write(f"loaded the best checkpoint: step {best} ({metric} {metrics[metric]:.4g})")
        return metrics

    def _report_tokenized(self) -> None:
        counts = self.feed.tokenized_counts()
        if counts is not None:
            self.logger.write(f"training examples tokenized by each process: {counts} of {len(self.feed.train_data)}")

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
        self._progress.drain()
        host = sharding.gather(pending)
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
            "train_examples": len(self.feed.train_data),
            "epoch": step / self.steps_per_epoch,
        }
        metrics = {f"eval/{k}": v for k, v in eval_metrics.items()} if eval_metrics else None
        self.checkpointer.save(step, self.state, record, metrics)

    def evaluate(self) -> dict[str, float]:
        """Metrics over every example of every eval set (keys suffixed by set, as the task names them), and those
        of ``evaluations``."""
        results = {}
        for name in self.eval_names:
            for key, value in self.task.metrics(self._outputs(name)).items():
                results[f"{key}{name}"] = value
        if self.evaluations is not None:
            results.update(self.evaluations(self.model()))
        return results

    def predict(self, name: str = "") -> dict[str, np.ndarray]:
        """The task's per-example outputs (``prediction``, ...) over predict set ``name``, in order, through
        the evaluation batches, with a progress bar."""
        return self._outputs(f"{PREDICT}{name}", bar=f"predict{name}")

    def _outputs(self, name: str, bar: str | None = None, step=None) -> dict[str, np.ndarray]:
        """The eval step's outputs for every example of set ``name`` (padding rows dropped), in the set's input
        order whatever the batching (packed rows, length buckets). Per-token outputs of batches cut to different
        widths are right-padded with -1 to the widest. One batch stays in flight while the previous one is
        read back; the bar (``bar``, else ``eval<name>``) counts batches read back. ``step``: another function
        of ``(params, frozen, batch)`` than the eval step."""
        for key in [k for k in self._compiling if isinstance(k, tuple) and k[:2] == ("eval", name)]:
            self._compiling.pop(key).result()  # compiled in the background while training (_compile_ahead)
        params, parts, order = self.eval_params(), collections.defaultdict(list), []
        inflight: collections.deque = collections.deque()
        batches = self.feed.eval_batch_count(name)
        with self.logger.progress(batches, bar or f"eval{name}") as progress:

            def read_back():
                outputs, index, valid = inflight.popleft()
                for key, value in sharding.gather(outputs).items():
                    parts[key].append(np.asarray(value)[valid])
                order.append(index[valid])
                progress.update(1)

            for batch, index, valid in self.feed.eval_batches(name):
                inflight.append(((step or self._eval_step)(params, self.frozen, batch), index, valid))
                if len(inflight) > 1:
                    read_back()
            while inflight:
                read_back()
        if not order:
            return {}
        rows = np.concatenate(order)
        merged = {}
        for key, values in parts.items():
            stacked = _concatenate_padded(values)
            merged[key] = np.empty_like(stacked)
            merged[key][rows] = stacked
        return merged

    def describe(self) -> str:
        """Table of every trained parameter's shape, dtype, spec and bytes per device (printed at start)."""
        table = sharding.describe(self.state.params, self.program.param_specs, self.mesh)
        line = self.training.describe(self.state.params, self.frozen)
        return table if line is None else f"{table}\n{line}"

    def sizes(self) -> dict[str, int]:
        """How many parameters train, and the bytes their optimizer state takes (all devices together)."""
        return {
            "trainable_parameters": _count(self.state.params),
            "optimizer_state_bytes": sum(x.nbytes for x in jax.tree.leaves(self.state.opt_state)),
        }

    def eval_params(self, state: TrainState | None = None):
        """What evaluation and export use: the moving average with --ema_decay (unless --eval_with_ema false),
        else the trained parameters; of ``state`` if given (an abstract one too), else of the run's."""
        state = self.state if state is None else state
        return state.ema if state.ema is not None and self.eval_with_ema else state.params

    def model(self) -> nnx.Module:
        """The evaluated parameters as a plain model (LoRA adapters folded into their kernels), for export."""
        return self.training.merged_model(self.eval_params(), self.frozen)

    def close(self) -> None:
        try:
            self.checkpointer.close()
        finally:
            try:
                self.logger.close()
            finally:
                self.lock.release()


def compile_in_background(lowerings: Mapping) -> dict:
    """Each of ``lowerings`` (key -> a function giving a ``Lowered``) lowered and compiled, one after another in
    order on a background thread: a ``Future`` per key. A step's call later finds its program compiled."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="jaxseq-compile")
    try:
        return {key: pool.submit(lambda lower=lower: lower().compile()) for key, lower in lowerings.items()}
    finally:
        pool.shutdown(wait=False)


def _concatenate_padded(arrays: list[np.ndarray]) -> np.ndarray:
    """``arrays`` joined on the first axis, any shorter trailing axis right-padded with -1 to the longest."""
    widest = np.max([a.shape[1:] for a in arrays], axis=0) if arrays[0].ndim > 1 else ()
    padded = [
        np.pad(a, [(0, 0), *((0, w - d) for w, d in zip(widest, a.shape[1:]))], constant_values=-1) for a in arrays
    ]
    return np.concatenate(padded)


def _count(tree) -> int:
    return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree))
