"""Where a run reports: tqdm progress bars that count finished work, ``metrics.jsonl``, the ``--report_to``
trackers (TensorBoard events by default; ``jaxseq.train.trackers``) and a loss plot. Only process 0 writes
(the others get a logger that writes nothing)."""

from __future__ import annotations

import collections
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
        self.bar = StepBar(
            total=total_steps,
            initial=initial_step,
            desc="train",
            unit="step",
            disable=not self.enabled,
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{left}, {rate_fmt}{postfix}]",
        )
        self.trackers = []
        self._pauses: list[float] = []
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

    def restart_clock(self) -> None:
        """Time the bar's rate and ETA from now and its current count on (after the first step's compilation)."""
        if not self.bar.disable:
            self.bar.initial, self.bar.start_t, self.bar.paused = self.bar.n, self.bar._time(), 0.0

    def paused(self, seconds: float, pauses_left: int) -> None:
        """Note ``seconds`` spent outside training steps (evaluating, saving), with ``pauses_left`` such pauses
        to come: the bar's rate leaves them out and its ETA adds their expected time (the mean so far)."""
        self._pauses.append(seconds)
        self.bar.paused += seconds
        self.bar.ahead = sum(self._pauses) / len(self._pauses) * pauses_left

    def progress(self, total: int, desc: str, unit: str = "batch") -> tqdm:
        """A transient bar under the training bar (evaluation, prediction), shown on process 0 only."""
        return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=not self.enabled, dynamic_ncols=True)

    def write(self, message: str) -> None:
        if self.enabled:
            self.bar.write(message)

    def plot(self, path: Path | None = None) -> Path | None:
        """A PNG of the training loss and every eval metric against the step."""
        if not self.enabled:
            return None
        # matplotlib's object-oriented API: a Figure on its own Agg canvas, leaving pyplot and the backend alone
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = path or self.output_dir / "training_curves.png"
        train = [(r["step"], r["train/loss"]) for r in self.records if "train/loss" in r]
        eval_keys = sorted({k for r in self.records for k in r if k.startswith("eval/")})
        fig = Figure(figsize=(11 if eval_keys else 6, 4))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 1 + bool(eval_keys), squeeze=False)
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
        return path

    def close(self) -> None:
        self.bar.close()
        if self.enabled:
            for tracker in self.trackers:
                tracker.close()
            self._jsonl.close()


class StepBar(tqdm):
    """The training bar: its rate is steps per second of time spent in steps (``paused`` seconds of
    evaluations and checkpoints left out) and its ETA (``{left}`` in ``bar_format``) is the steps left at that
    rate plus ``ahead``, the time the pauses still to come are expected to take."""

    paused = ahead = 0.0

    @property
    def format_dict(self):
        d = super().format_dict
        done, busy = d["n"] - d["initial"], d["elapsed"] - self.paused
        d["rate"] = done / busy if done > 0 and busy > 0 else None
        d["left"] = self.format_interval((d["total"] - d["n"]) / d["rate"] + self.ahead) if d["rate"] else "?"
        return d


class Finished:
    """Advances ``bar`` as dispatched work finishes on the devices, not when the host dispatches it (JAX
    returns at once and runs steps in the background): a step counts once every array of its outputs is
    ready. At most ``lag`` steps stay in flight (the oldest is waited for), enough to keep the devices busy."""

    def __init__(self, bar: tqdm, lag: int = 2):
        self.bar, self.lag = bar, lag
        self._inflight: collections.deque = collections.deque()

    def dispatched(self, outputs) -> None:
        """Note one more dispatched step whose outputs are ``outputs`` (a pytree of arrays)."""
        self._inflight.append(outputs)
        while self._inflight and (len(self._inflight) > self.lag or _ready(self._inflight[0])):
            jax.block_until_ready(self._inflight.popleft())
            self.bar.update(1)

    def drain(self) -> None:
        """Wait for every step in flight, counting each."""
        while self._inflight:
            jax.block_until_ready(self._inflight.popleft())
            self.bar.update(1)


def _ready(tree) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
