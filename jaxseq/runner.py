"""The one runner of every training job. A job (``jaxseq/commands/<job>.py``) is a declaration: its config
sections by name, the model task, and ``prepare``, which reads its data; ``run`` does the rest the same way
for every job: parse, start (the mesh), the model's start every job shares (``Setup``: config, checkpoint,
tokenizer), the job's ``prepare``, the run's spec (``train.spec``), then either a plan of the run's own train
step for a TPU slice (``--compile_topology``) or the run itself (train, evaluate, predict, results, export,
Hub push)."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxseq.cli import PlanConfig, RuntimeConfig, finish, parse, start
from jaxseq.config import save_config, stage_flags
from jaxseq.distributed import DistributedConfig
from jaxseq.errors import JaxseqError
from jaxseq.harness import TaskEvaluation, save_results
from jaxseq.hub_push import HubConfig
from jaxseq.mesh import data_parallel_size, make_mesh, mesh_sizes
from jaxseq.models.hub import apply_overrides
from jaxseq.models.registry import model_flops
from jaxseq.models.source import check, check_vocabulary, load_tokenizer, model_config
from jaxseq.plan import compile_plan, format_table, refusal, topology, write_plan
from jaxseq.plan import search as plan_search
from jaxseq.train.feeding import abstract_batch
from jaxseq.train.lora import LoraConfig
from jaxseq.train.optim import OptimizerConfig
from jaxseq.train.results import export_model, write_results
from jaxseq.train.spec import RunSpec, Teacher, attention_kernel
from jaxseq.train.throughput import peak_flops
from jaxseq.train.trainer import Trainer
from jaxseq.train.trainer_config import TrainerConfig

SHARED = {
    "runtime": RuntimeConfig,
    "plan": PlanConfig,
    "trainer": TrainerConfig,
    "optimizer": OptimizerConfig,
    "lora": LoraConfig,
    "hub": HubConfig,
    "distributed": DistributedConfig,
}
"""Config sections every training job has, by the name ``prepare`` reads them (``args.trainer``, ...)."""

ONLY_PREDICT_ALONE = "train and evaluate; --do_predict alone only predicts (transformers' run_glue, run_ner, run_qa)"
"""What a predicting job's run does without --do_train and --do_eval (``Stages.stages``' defaults)."""
STAGE_OF_SPLIT = {
    "train": "training (--do_train)",
    "validation": "evaluation (--do_eval)",
    "test": "prediction (--do_predict)",
}
"""The stage that reads each split, for errors naming the data a stage lacks."""

NOT_SAVED = ("plan", "hub", "distributed")
"""Sections left out of a run's config.yaml: how it was launched, not what it trains."""


@dataclasses.dataclass
class Prepared:
    """What a job's ``prepare`` gives the runner besides what its ``Setup`` holds (the model's config,
        checkpoint and tokenizer). ``objective``: the loss and evaluation (``train.objectives``). ``train`` (None:
        no training), ``evals`` and ``predicts`` (sets to predict, by suffix): arrays by name or ``data.rows``. A
        plan reads only what its batches' shapes depend on: packed data; otherwise ``row``, one example's arrays
        (name -> (shape, dtype)). ``seq_len`` (and an encoder-decoder's ``target_len``): tokens per example, for
        FLOPs. ``summary(trainer)``: the job's line in the log; ``extra_eval(results)``: results under other names
        (run_clm's ``perplexity``); ``write_predictions(output_dir, suffix, predictions)``: where predictions go
        (returns the path); ``teacher``: the model the objective compares against (distillation's). ``plans``: other
    programs of the run that a plan compiles beside its train step, by name (GRPO's sampler): each ``(program, topo)
    -> plan`` (``program``: the run's ``TrainProgram``), written under its name in plan.json; the run fits only if
    each of them does."""

    objective: Any
    train: Any = None
    evals: Mapping = dataclasses.field(default_factory=dict)
    predicts: Mapping = dataclasses.field(default_factory=dict)
    pack: str | None = None
    packed_rows: bool = False
    row: Mapping[str, tuple[tuple[int, ...], Any]] | None = None
    seq_len: int = 0
    target_len: int = 0
    summary: Callable[[Trainer], str] | None = None
    extra_eval: Callable[[dict], dict] | None = None
    write_predictions: Callable[[Path, str, np.ndarray], Path] | None = None
    teacher: Teacher | None = None
    plans: Mapping[str, Callable[..., dict]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Job:
    """A training job: ``doc`` (its --help), the model ``task``, its own ``sections`` (by name: ``source``, a
    ``models.source.ModelSource``, and its data's; optionally ``speed``, a ``throughput.SpeedConfig`` for MFU
    in the log), ``prepare(setup) -> Prepared`` (``Setup``), and the ``default_model`` when none is named. Its
    stage flags (``args.stages``, ``config.stage_flags``) say in their help what a run does without
    --do_train and --do_eval (``default_stages``), what --do_predict does (``predicts``; None: no such flag),
    and for a job without evaluation why --do_eval is an error (``no_eval``). ``fast_tokenizer``: whether its
    tokenizer must be a fast (Rust) one (offsets, word ids; run_glue's slow ones do for GLUE)."""

    doc: str
    task: str
    sections: Mapping[str, type]
    prepare: Callable[[Setup], Prepared]
    default_model: str | None = None
    default_stages: str = "train and evaluate"
    predicts: str | None = None
    no_eval: str | None = None
    fast_tokenizer: bool = True


class Setup:
    """What the runner gives a job's ``prepare``: the parsed ``args`` (its sections by name), whether it is
    ``planning`` (a plan: no weights are read, data only where the batches' shapes depend on it), the run's
    ``mesh`` (None: --mesh over this process's devices, as ``cli.start`` makes it), and the model's start every
    job shares, each made when the job first asks for it (so that it checks its own flags and data first):
    ``config``, the model's transformers config with --config_overrides and the job's own ``override``s;
    ``checkpoint``, the folder whose weights the run starts from (None: fresh weights from ``config``), loaded
    with ``overrides``; ``folder``, where the config came from; ``tokenizer`` (--tokenizer_name, else the
    model's), checked against the model's vocabulary. A job may replace the tokenizer (``tokenizer = ...``);
    the run exports the one it holds."""

    def __init__(self, job: Job, args: types.SimpleNamespace, *, planning: bool = False, mesh=None):
        self.job, self.args, self.planning = job, args, planning
        self.mesh = make_mesh(args.runtime.mesh or None) if mesh is None else mesh
        self._start = None  # (config, folder, overrides) of --model_name_or_path/--config_name/--model_type
        self._own: dict = {}  # the job's overrides
        self._config = None
        self._tokenizer = None

    def _model(self) -> tuple[Any, Path | None, dict]:
        if self._start is None:
            self._start = model_config(self.args.source, self.job.task, weights=not self.planning)
        return self._start

    @property
    def config(self):
        if self._config is None:
            config = self._model()[0]
            self._config = apply_overrides(config, **self.overrides) if self._own else config
        return self._config

    @property
    def folder(self) -> Path | None:
        return self._model()[1]

    @property
    def checkpoint(self) -> Path | None:
        return self.folder if self.args.source.model_name_or_path else None

    @property
    def overrides(self) -> dict:
        return {**self._model()[2], **self._own}

    def override(self, **fields) -> None:
        """Config fields the job decides (a classifier's labels, from its data): in ``config`` and in the
        ``overrides`` the checkpoint loads with."""
        self._own.update(fields)
        self._config = None

    @property
    def tokenizer_name(self) -> str | Path | None:
        """Where the tokenizer comes from: --tokenizer_name, else the model's folder (None: neither)."""
        return self.args.source.tokenizer_name or self.folder

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            tokenizer = load_tokenizer(self.tokenizer_name, fast=self.job.fast_tokenizer)
            check_vocabulary(tokenizer, self.config)
            self._tokenizer = tokenizer
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    @property
    def loaded_tokenizer(self):
        """The tokenizer if the job asked for one, else None (the runner never loads one itself)."""
        return self._tokenizer


def parse_job(job: Job, argv) -> types.SimpleNamespace:
    """``job``'s config sections by name (``args.source``, ``args.trainer``, ...) from YAML and ``argv``."""
    sections = {**job.sections, "stages": stage_flags(job.default_stages, job.predicts, job.no_eval), **SHARED}
    args = types.SimpleNamespace(**dict(zip(sections, parse(job.doc, tuple(sections.values()), argv))))
    check(args.source, default_model=job.default_model)
    return args


def run(job: Job, argv) -> int:
    """Run ``job`` with command-line ``argv``: plan it (``--compile_topology``) or train it."""
    args = parse_job(job, argv)
    if args.plan.plan_search and not args.plan.compile_topology:
        raise JaxseqError("--plan_search searches the plans of a TPU slice: add --compile_topology (e.g. v5e-8)")
    if args.plan.compile_topology:
        jax.config.update("jax_platforms", "cpu")  # compiling for the slice needs no accelerator of this machine
        topo = topology(args.plan.compile_topology)
        mesh = make_mesh(args.runtime.mesh or None, devices=topo.devices)
        setup = Setup(job, args, planning=True, mesh=mesh)
        prepared = job.prepare(setup)
        spec = spec_of(setup, prepared)
        if args.plan.plan_search:
            search_plans(job, argv, args, spec, prepared, topo)
        else:
            plan(spec, prepared, topo)
        return 0
    if job.no_eval and args.stages.do_eval:
        raise JaxseqError(f"--do_eval: {job.no_eval}; drop --do_eval")
    mesh = start(args.runtime, args.distributed)
    setup = Setup(job, args, mesh=mesh)
    prepared = job.prepare(setup)
    check_stages(args.stages, prepared, tasks=bool(getattr(getattr(args, "eval_tasks", None), "eval_tasks", None)))
    spec = spec_of(setup, prepared)
    speed = {}
    if "speed" in job.sections:
        peak, peak_source = peak_flops(mesh.devices.flat, spec.dtype, args.speed.peak_flops)
        speed = {
            "tokens_per_example": prepared.seq_len,
            "flops_per_example": model_flops(spec.config, spec.task, 1, prepared.seq_len, prepared.target_len),
            "peak_flops": peak,
        }
    evaluations = task_evaluation(args, setup, mesh)  # --eval_tasks: loaded (and checked) before training
    build = functools.partial(spec.build_model, setup.checkpoint, setup.overrides)
    trainer = Trainer(
        spec, build, prepared.train, prepared.evals, predict_sets=prepared.predicts, evaluations=evaluations, **speed
    )  # checks any checkpoint already in output_dir before anything is written there
    if jax.process_index() == 0:
        save_config(trainer.output_dir / "config.yaml", *saved_sections(args).values())
    log = trainer.logger.write
    log(trainer.describe())
    feed = trainer.feed
    line = (
        f"{spec.config.model_type}: {trainer.total_steps} steps of global batch {trainer.global_batch} on "
        f"{jax.device_count()} devices (mesh {mesh_sizes(mesh)})"
    )
    if speed:
        per_token = speed["flops_per_example"] / prepared.seq_len
        line += f"; {per_token / 1e9:.3g} GFLOP per token, peak {peak / 1e9:.4g} GFLOP/s: MFU is of {peak_source}"
    log(line)
    if prepared.summary is not None:
        log(prepared.summary(trainer))
    if feed.row_buckets:
        log(
            f"packing {feed.micro_batch} examples into {' or '.join(map(str, feed.row_buckets))} rows per "
            f"micro-batch (of {prepared.seq_len} tokens)"
        )
    for name, rows in feed.eval_packed_rows.items():
        if rows and len(feed.eval_sets[name]):
            examples, batches = len(feed.eval_sets[name]), feed.eval_batch_count(name)
            log(f"packing {examples} {name.lstrip('_') or 'eval'} examples into {batches} batches of {rows} rows")
    trains = prepared.train is not None
    restored = not trains and args.trainer.resume_from_checkpoint is not None
    try:
        if trains:
            results = trainer.train()
        else:
            if restored:
                trainer.restore_if_any()
            results = {f"eval_{k}": v for k, v in trainer.evaluate().items()} if trainer.evaluates else {}
        predictions = {suffix: trainer.predict(suffix)["prediction"] for suffix in prepared.predicts}
    finally:
        trainer.close()
    if jax.process_index() == 0:
        for suffix, predicted in predictions.items():
            log(f"wrote {prepared.write_predictions(trainer.output_dir, suffix, predicted)}")
    eval_samples = len(feed.eval_sets[next(iter(prepared.evals))]) if prepared.evals else 0
    extra_eval = prepared.extra_eval(results) if prepared.extra_eval and prepared.evals else None
    if trains:
        finish(
            trainer,
            results,
            tokenizer=setup.loaded_tokenizer,
            base_model=args.source.model_name_or_path,
            hub=args.hub,
            train_samples=len(feed.train_data),
            eval_samples=eval_samples,
            extra_eval=extra_eval,
        )
    elif trainer.evaluates:
        write_results(trainer.output_dir, results, train_samples=0, eval_samples=eval_samples, extra_eval=extra_eval)
    if evaluations is not None and evaluations.last is not None and jax.process_index() == 0:
        log(f"wrote {save_results(*evaluations.last, trainer.output_dir / 'lm_eval')[0]}")
    if restored:  # a saved step, exported: any checkpoint becomes a Hugging Face folder
        export_model(trainer, trainer.output_dir, setup.loaded_tokenizer, base_model=args.source.model_name_or_path)
    if speed and jax.process_index() == 0:
        print(" ".join(f"{k}={results[k]:.4g}" for k in ("train_tokens_per_second", "train_mfu") if k in results))
    return 0


def task_evaluation(args, setup: Setup, mesh) -> TaskEvaluation | None:
    """--eval_tasks' evaluation (a job with the ``eval_tasks`` section), its tasks loaded, or None."""
    config = getattr(args, "eval_tasks", None)
    if config is None or not config.eval_tasks:
        return None
    if setup.job.task != "causal-lm":
        raise JaxseqError("--eval_tasks runs lm-eval's tasks on causal language models only")
    return TaskEvaluation(
        config,
        setup.tokenizer,
        model_config=setup.config,
        folder=setup.folder,
        batch_size=args.trainer.per_device_eval_batch_size,
        mesh=mesh,
        name=args.source.model_name_or_path or args.trainer.output_dir,
    )


def check_stages(stages, prepared: Prepared, tasks: bool = False) -> None:
    """Every stage flag given finds its data in what ``prepare`` made (evaluation: or lm-eval's ``tasks``), and
    the run has something to do."""
    found = {
        "train": prepared.train is not None,
        "eval": bool(prepared.evals) or tasks,
        "predict": bool(prepared.predicts),
    }
    for stage, data in (("train", "training"), ("eval", "validation"), ("predict", "test")):
        if getattr(stages, f"do_{stage}", None) and not found[stage]:
            raise JaxseqError(f"--do_{stage} needs {data} data and this run has none; see --help for how to give it")
    if not any(found.values()):
        raise JaxseqError("nothing to do: no training, validation or test data; see --help for how to give them")


def saved_sections(args) -> dict:
    """The sections of a run's config.yaml (and a plan search's best_plan.yaml), by name."""
    return {name: section for name, section in vars(args).items() if name not in NOT_SAVED}


def search_plans(job: Job, argv, args, spec: RunSpec, prepared: Prepared, topo) -> dict:
    """``--plan_search``: the fastest layout of this run that fits ``topo`` (``jaxseq.plan.search``)."""
    trainer = args.trainer
    rows = trainer.per_device_train_batch_size * data_parallel_size(spec.mesh) * trainer.gradient_accumulation_steps
    sections = saved_sections(args)
    chunked = any("loss_chunk_tokens" in {f.name for f in dataclasses.fields(s)} for s in sections.values())
    return plan_search.search(
        job.prepare.__module__,
        list(argv),
        sections,
        plan_search.shape_of(spec, prepared, rows),
        topo,
        Path(trainer.output_dir),
        chunked=chunked,
        compiles=args.plan.plan_search_compiles,
        timeout=args.plan.plan_search_timeout,
    )


def spec_of(setup: Setup, prepared: Prepared) -> RunSpec:
    """The run's spec, from its ``setup`` and what ``prepare`` found."""
    args = setup.args
    return RunSpec(
        setup.mesh,
        setup.config,
        setup.job.task,
        prepared.objective,
        args.trainer,
        args.optimizer,
        lora=args.lora,
        dtype=args.runtime.dtype,
        pack=prepared.pack,
        packed_rows=prepared.packed_rows,
        teacher=prepared.teacher,
    )


def plan_batches(spec: RunSpec, prepared: Prepared, attention: str) -> tuple[list[dict], int]:
    """The abstract batches of every train step shape the run would compile, and its number of steps: from
    the run's own feeder over its data where the shapes depend on it (packing), else from ``row``."""
    trainer = spec.trainer
    if prepared.train is not None:
        feed = spec.feeder(prepared.train, {}, attention)
        total = spec.total_steps(feed.steps_per_epoch)
        feed.size_packing(total)
        return feed.abstract_batches(), total
    if prepared.row is None:
        raise JaxseqError("this job cannot be planned without its training data")
    rows = trainer.per_device_train_batch_size * data_parallel_size(spec.mesh)
    batch = abstract_batch(spec.mesh, rows, prepared.row, trainer.gradient_accumulation_steps)
    return [batch], max(trainer.max_steps, 1)


def plan_programs(spec: RunSpec, prepared: Prepared, say=None):
    """(the run's TrainProgram on the abstract model, the batches of its train steps)."""
    model = spec.abstract_model(say=say)
    batches, total = plan_batches(spec, prepared, attention_kernel(model))
    return spec.program(model, total), batches


def plan(spec: RunSpec, prepared: Prepared, topo) -> dict:
    """Compile the run's train step for each batch shape it would step on, for the slice ``topo``, with
    abstract weights; print the plan of the one that needs the most memory and write it to
    ``output_dir/plan.json`` (``inputs``: its batch's arrays; ``packing``: the packed row counts compiled).
    A run that does not fit ends in one line (a JaxseqError) naming what to change."""
    program, batches = plan_programs(spec, prepared, say=print)  # beside the plan; stderr keeps errors
    state = program.abstract_state
    plans = []
    for batch in batches:
        rows = math.prod(batch["input_ids"].shape[:-1])  # sequences a step computes (DPO: 2 a pair), micro-batches too
        result = compile_plan(
            program.step.lower(state, program.abstract_frozen, batch),
            topo,
            parameters=(state.params, program.abstract_frozen, state.ema),
            optimizer_state=state.opt_state,
            batch=batch,
            model_flops=model_flops(spec.config, spec.task, rows, prepared.seq_len, prepared.target_len),
        )
        result["inputs"] = {name: {"shape": list(a.shape), "dtype": str(a.dtype)} for name, a in batch.items()}
        plans.append(result)
    result = max(plans, key=lambda p: (not p["fits"], p["bytes_per_device"]["total"]))
    if spec.pack or spec.packed_rows:
        result["packing"] = {
            "row_counts": [b["input_ids"].shape[-2] for b in batches],  # every one compiled; the plan is the largest
            "segment_ids": "attention_mask",  # 1, 2, ... per example of a row, 0 for padding
        }
    result["layers"] = "scanned" if spec.scan_layers else "unrolled"
    others = {name: other(program, topo) for name, other in prepared.plans.items()}
    step_fits = result["fits"]
    for name, other in others.items():
        result[name] = other
        result["fits"] = result["fits"] and other["fits"]
    output_dir = Path(spec.trainer.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_plan(output_dir / "plan.json", result)
    print(format_table(result))
    for name, other in others.items():
        print(f"{name}: {format_table(other)}")
    lora = spec.lora is not None and spec.lora.enabled
    if not step_fits:
        raise JaxseqError(refusal(result, remat=spec.trainer.remat, lora=lora))
    for name, other in others.items():
        if not other["fits"]:
            raise JaxseqError(f"the {name}: {refusal(other, remat=spec.trainer.remat, lora=lora)}")
    return result
