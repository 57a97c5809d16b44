"""The trainer's flags (``TrainerConfig``: batch sizes, steps, evaluation and checkpoint strategies, remat,
scanned layers, attention kernel, seed, trackers), checked as they are parsed. A run's ``train.spec.RunSpec``
holds them; ``train.trainer.Trainer`` runs them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jaxseq.config import arg
from jaxseq.errors import JaxseqError
from jaxseq.models.attention import ATTENTION_KERNELS
from jaxseq.models.execution import REMAT_POLICIES
from jaxseq.train.trackers import parse_report_to

STRATEGIES = ("no", "steps", "epoch")


@dataclasses.dataclass
class TrainerConfig:
    output_dir: str = arg("outputs", "where checkpoints, metrics, plots and the final model go")
    per_device_train_batch_size: int = arg(32, "training batch per data-parallel replica (dp x fsdp of the mesh)")
    per_device_eval_batch_size: int = arg(
        8, "evaluation batch per data-parallel replica (as in transformers); rows of packed examples where packed"
    )
    gradient_accumulation_steps: int = arg(1, "micro-batches summed into each update")
    num_train_epochs: float = arg(3.0, "epochs to train (ignored when --max_steps > 0)")
    max_steps: int = arg(-1, "total updates; > 0 overrides --num_train_epochs")
    logging_steps: int = arg(50, "log training loss/lr every N updates")
    eval_strategy: str | None = arg(
        None,
        "when to evaluate while training: steps (every --eval_steps), epoch, or no (only once training ends); "
        "default: steps if --eval_steps is set, epoch with --load_best_model_at_end, else no (as transformers)",
        choices=STRATEGIES,
        aliases=("evaluation_strategy",),
    )
    eval_steps: int = arg(0, "evaluate every N updates (0 with --eval_strategy steps: every --logging_steps)")
    save_strategy: str | None = arg(
        None,
        "when to save a checkpoint: steps (every --save_steps, and at the end), epoch (and at the end), or no "
        "(never; Ctrl-C still saves); default: steps",
        choices=STRATEGIES,
    )
    save_steps: int = arg(0, "checkpoint every N updates (0: only at the end)")
    save_total_limit: int = arg(2, "keep this many latest checkpoints (plus the best one)")
    metric_for_best_model: str | None = arg(
        None,
        "eval metric that picks the best checkpoint, e.g. accuracy or eval_accuracy (default with "
        "--load_best_model_at_end: loss)",
    )
    greater_is_better: bool | None = arg(
        None, "whether a larger --metric_for_best_model is better (default: true unless the metric is a loss)"
    )
    load_best_model_at_end: bool = arg(
        False,
        "after training, go back to the best checkpoint by --metric_for_best_model: it is what results report "
        "and what is exported (saves must fall on evaluations: the same strategy, --save_steps a multiple of "
        "--eval_steps)",
    )
    remat: str = arg(
        "none",
        "what each transformer block keeps for the backward pass: none (everything), full (only its input: one "
        "more forward per block; a bare --remat), dots (matmul outputs), offload (those in host memory)",
        choices=REMAT_POLICIES,
        const="full",
        switches={"gradient_checkpointing": "full"},
    )
    scan_layers: str = arg(
        "auto",
        "stack the transformer blocks and run them with one scan (compile time flat in depth) instead of a "
        "Python loop: true, false, or auto (scanned on CPU, where it compiles in about half the time and steps "
        "about as fast, and under --remat full, where an H100 steps as fast scanned and TPU plans hold no more "
        "memory per chip; unrolled otherwise, where the scanned step is slower; BENCHMARKS.md); checkpoints "
        "resume only into the same layout",
        choices=("auto", "true", "false"),
        const="true",
    )
    attention: str = arg(
        "auto",
        "attention kernel: auto (splash on TPU, cuDNN on GPU with bfloat16 compute, where the model allows: no "
        "attention dropout, no position bias as T5's; else XLA), splash, cudnn or xla",
        choices=ATTENTION_KERNELS,
    )
    seed: int = arg(42, "seed of initialisation, data order and dropout")
    resume_from_checkpoint: str | None = arg(
        None,
        "checkpoints to resume from: a run's checkpoints folder (its latest step) or one step's folder in it, "
        "e.g. out/checkpoints/500 (a run also resumes from --output_dir/checkpoints by itself)",
    )
    skip_nonfinite_updates: bool = arg(
        False,
        "skip an update whose loss or gradients are NaN/inf and count it (train/skipped_updates) instead "
        "of stopping the run",
    )
    report_to: str = arg(
        "tensorboard",
        "where metrics go besides metrics.jsonl, comma-separated: none, tensorboard, wandb, trackio, mlflow or "
        "all (every one installed); each reads its own settings (WANDB_MODE, TRACKIO_DIR, MLFLOW_TRACKING_URI, ...)",
    )
    run_name: str | None = arg(None, "the run's name in wandb, trackio and mlflow (default: the output folder's name)")
    project: str = arg("jaxseq", "wandb and trackio project, mlflow experiment")

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
        if self.eval_strategy is None:
            self.eval_strategy = "steps" if self.eval_steps else "epoch" if self.load_best_model_at_end else "no"
        if self.eval_strategy == "steps" and not self.eval_steps:
            self.eval_steps = self.logging_steps
        self.save_strategy = self.save_strategy or "steps"
        if self.load_best_model_at_end:
            self.metric_for_best_model = self.metric_for_best_model or "loss"
            if "no" in (self.eval_strategy, self.save_strategy):
                raise JaxseqError(
                    "--load_best_model_at_end needs checkpoints with evaluations: set --eval_strategy and "
                    "--save_strategy to steps or epoch"
                )
        if self.metric_for_best_model:  # transformers names it eval_accuracy, the checkpoints accuracy
            self.metric_for_best_model = self.metric_for_best_model.removeprefix("eval_")
            if self.greater_is_better is None:
                self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            raise JaxseqError(f"--num_train_epochs must be above 0 (or set --max_steps), got {self.num_train_epochs}")
        if self.remat not in REMAT_POLICIES:
            raise JaxseqError(f"--remat {self.remat!r} is not one of {', '.join(REMAT_POLICIES)}")
        check_writable_dir(self.output_dir, "--output_dir")
        self.backends = parse_report_to(self.report_to)


def check_writable_dir(path: str | os.PathLike, flag: str) -> None:
    """Fail now, not after hours of training, if ``path`` cannot become a folder we write into."""
    out = Path(path).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise JaxseqError(f"{flag} {path} cannot be created: {existing} is a file, not a folder; pick another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JaxseqError(f"{flag} {path} is not writable (no write permission in {existing}); pick another {flag}")
