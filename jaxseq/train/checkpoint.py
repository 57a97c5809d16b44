"""Checkpoints with orbax: the train state (params, optimizer state, step) plus a JSON record of where the
run is, written asynchronously and atomically (a save cut short, or failing for a full disk, is never
restored: the previous checkpoint stays usable). Restores onto the current mesh's shardings, whatever mesh
saved them."""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxseq.errors import JaxseqError, first_line
from jaxseq.sharding import STACKED


class Checkpointer:
    """Keeps the last ``keep_last`` checkpoints and, if ``best_metric`` is set, the best one by it."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int = 2,
        best_metric: str | None = None,
        greater_is_better: bool = True,
    ):
        self.directory = Path(directory).absolute()
        keep = [policies.LatestN(n=max(keep_last, 1))]
        best = {}
        if best_metric:
            keep.append(policies.BestN(get_metric_fn=lambda m: m[best_metric], reverse=not greater_is_better, n=1))
            # also writes each checkpoint's metrics beside it, so a resumed run still knows the best
            best = dict(best_fn=lambda m: m[best_metric], best_mode="max" if greater_is_better else "min")
        options = ocp.CheckpointManagerOptions(
            **best,
            preservation_policy=policies.AnyPreservationPolicy(keep),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "record": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._saving: int | None = None  # the step of the save in flight
        self._failed: JaxseqError | None = None
        _quiet_orbax_errors()

    def save(self, step: int, state, record: dict, metrics: dict | None = None) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
        self.wait()  # the previous save must have been written (orbax would wait for it here anyway)
        try:
            self.manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as e:
            raise self._failure(step, e) from e
        self._saving = step

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def metrics(self, step: int) -> dict[str, float]:
        """The metrics saved with the checkpoint of ``step`` (empty if none were)."""
        return dict(self.manager.metrics(step) or {})

    def best_step(self, metric: str, greater_is_better: bool = True) -> int | None:
        """The step of the kept checkpoint with the best ``metric`` (the earliest of equals), or None."""
        scored = [(s, m[metric]) for s in self.manager.all_steps() if metric in (m := self.metrics(s))]
        if not scored:
            return None
        sign = 1 if greater_is_better else -1
        return max(scored, key=lambda sv: (sign * sv[1], -sv[0]))[0]

    def restore(self, step: int, abstract_state) -> tuple[object, dict]:
        """``abstract_state``: the state's tree of ``jax.ShapeDtypeStruct`` with the target shardings."""
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()),
            )
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise JaxseqError(
                f"the checkpoint in {self.directory / str(step)} was written for a different model or optimizer "
                f"({first_line(e)}); use a fresh --output_dir, or the settings that wrote it"
            ) from None
        return restored.state, dict(restored.record)

    def check_fits(self, step: int, abstract_state) -> None:
        """A one-line error if the checkpoint at ``step`` holds other arrays or shapes than
        ``abstract_state`` (another model's checkpoint in this output dir), read from its metadata only."""
        try:
            saved = self.manager.item_metadata(step).state
        except Exception:  # unreadable metadata: restoring will say what is wrong
            return
        if saved is None:
            return
        theirs, ours = _shapes(getattr(saved, "tree", saved)), _shapes(abstract_state)
        if theirs == ours:
            return
        changed = [f"{k} is {theirs[k]} there, {ours[k]} here" for k in ours if k in theirs and theirs[k] != ours[k]]
        missing = [f"{k} is missing" for k in ours if k not in theirs]
        extra = [f"{k} is not in this model" for k in theirs if k not in ours]
        differences = changed + missing + extra
        more = f" and {len(differences) - 1} more difference(s)" if len(differences) > 1 else ""
        stacked = [any(f"/{STACKED}/" in k for k in side) for side in (theirs, ours)]
        if stacked[0] != stacked[1]:  # the same model, its blocks stacked on one side only
            layout = "true" if stacked[0] else "false"
            raise JaxseqError(
                f"the checkpoint in {self.directory / str(step)} holds the model's blocks "
                f"{'scanned' if stacked[0] else 'unrolled'}; resume with --scan_layers {layout}"
            )
        raise JaxseqError(
            f"the checkpoint in {self.directory / str(step)} was written for a different model or optimizer "
            f"({differences[0]}{more}); use a fresh --output_dir, or the settings that wrote it"
        )

    def wait(self) -> None:
        """Block until the save in flight is written (a one-line error if it could not be)."""
        if self._failed is not None:
            raise self._failed
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._failure(self._saving, e) from e
        self._saving = None

    def close(self) -> None:
        try:
            if self._failed is None:  # a failed save has been reported already
                self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:
                if self._failed is None:
                    raise

    def _failure(self, step: int | None, e: Exception) -> JaxseqError:
        """The one line for a save that could not be written; the previous checkpoint is untouched."""
        if self._failed is None:
            code = re.search(r"os_error_code='?(\d+)", str(e))
            first = first_line(e)
            why = os.strerror(int(code.group(1))) if code else first
            last = max((s for s in self.manager.all_steps() if step is None or s < step), default=None)
            kept = (
                f"the previous checkpoint (step {last}) is intact and a rerun resumes from it"
                if last is not None
                else "no earlier checkpoint exists"
            )
            self._failed = JaxseqError(
                f"cannot write the checkpoint of step {step} in {self.directory} ({why}); "
                f"{kept}; free disk space or pick another --output_dir"
            )
        return self._failed


def _shapes(tree) -> dict[str, tuple]:
    """``"params/transformer/wte/embedding/value" -> shape`` for every array of a state or its metadata."""

    def name(key) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return {
        "/".join(map(name, path)): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


_NO_METRICS = "Requested `tracked_metric`; did not provide metrics"


class _DropOrbaxErrors(logging.Filter):
    """Orbax logs a failed background save with tracebacks before raising it where we wait for the save;
    that raise becomes the one line (and, with --debug, shows the same traceback as its cause). Also dropped:
    the warning that a save carries no metrics while the best checkpoint is tracked, which every save
    between evaluations does by design (the best is chosen among evaluated steps)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return not (_from_orbax(record.pathname) and record.getMessage().startswith(_NO_METRICS))
        if _from_orbax(record.pathname):
            return False
        # asyncio's "Task/_GatheringFuture exception was never retrieved" for one of the failed save's writes:
        # the task's repr names orbax's code, a gathering future's only its error's traceback does
        error = record.exc_info[1] if record.exc_info else None
        frames = traceback.extract_tb(error.__traceback__) if error is not None else []
        return not (_from_orbax(record.getMessage()) or any(_from_orbax(frame.filename) for frame in frames))


def _from_orbax(text: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in text


def _quiet_orbax_errors() -> None:
    """Once per process. Besides the logged errors (orbax's own, and asyncio's report of a write task whose
    error nobody retrieved): after a failed save, the save's other writes still finish
    in tensorstore's threads and report to the event loop orbax has closed, each printed as an unraisable
    'Event loop is closed' traceback; those (and only those) are dropped."""
    loggers = [logging.getLogger("absl"), logging.getLogger("asyncio")]
    if any(isinstance(f, _DropOrbaxErrors) for f in loggers[0].filters):
        return
    for logger in loggers:
        logger.addFilter(_DropOrbaxErrors())
    previous = sys.unraisablehook

    def hook(unraisable):
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = hook


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of ``tree`` carrying ``shardings`` (what restore needs to place arrays)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
