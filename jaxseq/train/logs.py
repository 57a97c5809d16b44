"""Where a run reports: a tqdm progress bar, ``metrics.jsonl``, the ``--report_to`` trackers (TensorBoard
events by default; ``jaxseq.train.trackers``) and a loss plot. Only process 0 writes (the others get a
logger that writes nothing)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
from tqdm.auto import tqdm

from jaxseq.files import atomic_write
from jaxseq.train.trackers import open_trackers


class RunLogger:
    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        initial_step: int = 0,
        enabled: bool | None = None,
        report_to: tuple[str, ...] = ("tensorboard",),
        run_name: str | None = None,
        project: str = "jaxseq",
        run_config: dict | None = None,
    ):
        """``report_to``: the tracker backends (``jaxseq.train.trackers``); ``run_name`` (default: the output
        folder's name), ``project`` and ``run_config`` (flat hyperparameters) are what they record the run as."""
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.output_dir = Path(output_dir)
        self.records: list[dict] = []
        self.bar = tqdm(
            total=total_steps,
            initial=initial_step,
            desc="train",
            unit="step",
            disable=not self.enabled,
            dynamic_ncols=True,
        )
        self.trackers = []
        self._jsonl = None
        if self.enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            name = run_name or self.output_dir.absolute().name
            self.trackers = open_trackers(
                report_to, self.output_dir, name=name, project=project, config=run_config or {}
            )
            self._jsonl = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (open for the run)

    def log(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` at ``step`` (keys like ``train/loss``, ``eval/accuracy``)."""
        values = {k: float(v) for k, v in values.items()}
        record = {"step": step, "time": time.time(), **values}
        self.records.append(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        finite = {k: v for k, v in values.items() if math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(step, finite)
        shown = {k.split("/", 1)[1]: f"{v:.4g}" for k, v in values.items() if k.startswith("train/")}
        if shown:
            self.bar.set_postfix(shown, refresh=False)

    def resume(self, step: int) -> None:
        """Continue a run restored at ``step``: keep its records up to ``step`` (for the plot) and drop the
        later ones an interrupted run logged before it died, which the resumed run logs again (in
        ``metrics.jsonl`` and, through a purge marker, in TensorBoard; other trackers start a new run)."""
        self.bar.update(step - self.bar.n)
        if not self.enabled:
            return
        path = self.output_dir / "metrics.jsonl"
        self._jsonl.close()
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the kill
                continue
            if record.get("step", step + 1) <= step:
                kept.append(record)
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept))
        self.records = kept + self.records
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
        for tracker in self.trackers:
            tracker.resume(step)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def write(self, message: str) -> None:
        if self.enabled:
            self.bar.write(message)

    def plot(self, path: Path | None = None) -> Path | None:
        """A PNG of the training loss and every eval metric against the step."""
        if not self.enabled:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = path or self.output_dir / "training_curves.png"
        train = [(r["step"], r["train/loss"]) for r in self.records if "train/loss" in r]
        eval_keys = sorted({k for r in self.records for k in r if k.startswith("eval/")})
        fig, axes = plt.subplots(1, 1 + bool(eval_keys), figsize=(11 if eval_keys else 6, 4), squeeze=False)
        ax = axes[0][0]
        if train:
            ax.plot(*zip(*train), label="train loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("training loss")
        ax.legend()
        if eval_keys:
            ax = axes[0][1]
            for key in eval_keys:
                points = [(r["step"], r[key]) for r in self.records if key in r]
                ax.plot(*zip(*points), marker="o", label=key.split("/", 1)[1])
            ax.set_xlabel("step")
            ax.set_title("evaluation")
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        self.bar.close()
        if self.enabled:
            for tracker in self.trackers:
                tracker.close()
            self._jsonl.close()
