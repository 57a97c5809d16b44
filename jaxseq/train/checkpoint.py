"""Checkpoints with orbax: the train state (params, optimizer state, step) plus a JSON record of where the
run is, written asynchronously and atomically (a save cut short is never restored). Restores onto the
current mesh's shardings, whatever mesh saved them."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxseq.errors import JaxseqError


class Checkpointer:
    """Keeps the last ``keep_last`` checkpoints and, if ``best_metric`` is set, the best one by it."""

    def __init__(self, directory: str | Path, *, keep_last: int = 2, best_metric: str | None = None,
                 greater_is_better: bool = True):
        self.directory = Path(directory).absolute()
        keep = [policies.LatestN(n=max(keep_last, 1))]
        if best_metric:
            keep.append(policies.BestN(get_metric_fn=lambda m: m[best_metric], reverse=not greater_is_better, n=1))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state, record: dict, metrics: dict | None = None) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
        self.manager.save(step, args=args, metrics=metrics, force=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def restore(self, step: int, abstract_state) -> tuple[object, dict]:
        """``abstract_state``: the state's tree of ``jax.ShapeDtypeStruct`` with the target shardings."""
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()),
            )
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise JaxseqError(
                f"checkpoint {self.directory / str(step)} does not fit this model/optimizer "
                f"({str(e).splitlines()[0][:200]}); use another --output_dir or the same config"
            ) from None
        return restored.state, dict(restored.record)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of ``tree`` carrying ``shardings`` (what restore needs to place arrays)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
