"""Where a run's numbers go besides ``metrics.jsonl`` (``--report_to``): TensorBoard (tensorboardX, the
default), Weights & Biases, Trackio and MLflow, each through its own library and its own settings
(``WANDB_MODE``, ``WANDB_DIR``, ``TRACKIO_DIR``, ``MLFLOW_TRACKING_URI``, ...). ``all`` is every one of
them that is installed, as in transformers; naming one whose library is missing stops in one line."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

from jaxseq.errors import JaxseqError, first_line

BACKENDS = ("tensorboard", "wandb", "trackio", "mlflow")
CHOICES = ("none", *BACKENDS, "all")
_LIBRARIES = {"tensorboard": "tensorboardX", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


def installed(backend: str) -> bool:
    return importlib.util.find_spec(_LIBRARIES[backend]) is not None


def parse_report_to(value: str | list | tuple | None) -> tuple[str, ...]:
    """The backends ``--report_to`` names: a comma-separated list (or a YAML list) of ``CHOICES``."""
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value or ["none"]) if n.strip()]
    for name in names:
        if name not in CHOICES:
            raise JaxseqError(f"--report_to {name!r} is not one of {', '.join(CHOICES)}")
    if "all" in names:
        return tuple(b for b in BACKENDS if installed(b))
    chosen = tuple(b for b in BACKENDS if b in names)
    for backend in chosen:
        if not installed(backend):
            raise JaxseqError(
                f"--report_to {backend} needs the {_LIBRARIES[backend]} library: pip install 'jaxseq[{backend}]'"
            )
    return chosen


def _summary_writer():
    from tensorboardX import SummaryWriter

    return SummaryWriter


class TensorBoard:
    def __init__(self, output_dir: Path, name: str, project: str, config: dict):
        self.directory = str(output_dir / "tensorboard")
        self.writer = _summary_writer()(self.directory)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def resume(self, step: int) -> None:
        """Events after ``step`` (logged by an interrupted run) are dropped: the resumed run logs them again."""
        self.writer.close()
        self.writer = _summary_writer()(self.directory, purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run in ``WANDB_DIR`` (default: the output dir); ``WANDB_MODE=offline`` keeps it on disk."""

    def __init__(self, output_dir: Path, name: str, project: str, config: dict):
        import wandb

        self.run = wandb.init(
            project=project, name=name, config=config, dir=os.environ.get("WANDB_DIR") or str(output_dir)
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def resume(self, step: int) -> None:
        pass  # a resumed run is a new W&B run starting at ``step``

    def close(self) -> None:
        self.run.finish()


class Trackio:
    """A Trackio run, stored locally (``TRACKIO_DIR``) unless trackio is told of a Space."""

    def __init__(self, output_dir: Path, name: str, project: str, config: dict):
        import trackio

        self.run = trackio.init(project=project, name=name, config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def resume(self, step: int) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in experiment ``project`` at mlflow's tracking URI (``MLFLOW_TRACKING_URI``); the
    run's config goes in as parameters."""

    def __init__(self, output_dir: Path, name: str, project: str, config: dict):
        import mlflow

        try:
            self.client = mlflow.MlflowClient()
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        except Exception as e:  # no backend for the URI, a refused server, ...: one line
            raise JaxseqError(
                f"--report_to mlflow cannot start a run at {mlflow.get_tracking_uri()} ({type(e).__name__}: "
                f"{first_line(e, 200)}); set MLFLOW_TRACKING_URI to your server, or install mlflow's server "
                "with pip install 'jaxseq[mlflow]'"
            ) from None
        from mlflow.entities import Param

        params = [Param(k, _param(v)) for k, v in config.items()]
        for i in range(0, len(params), 100):  # mlflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(k, v, stamp, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def resume(self, step: int) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _param(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio, "mlflow": MLflow}


def open_trackers(backends: tuple[str, ...], output_dir: Path, *, name: str, project: str, config: dict) -> list:
    """One open tracker per backend (call ``log``, ``resume`` and ``close`` on each)."""
    opened = []
    try:
        for backend in backends:
            opened.append(TRACKERS[backend](output_dir, name, project, config))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened
