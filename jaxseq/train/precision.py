"""Dynamic loss scaling for float16 compute: scale the loss up so small gradients survive float16, skip
the update and halve the scale when gradients overflow, double it after a run of finite steps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LossScale:
    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # finite steps since the last change
    skipped: jax.Array  # updates skipped for overflow, in all

    period: int = dataclasses.field(default=2000, metadata={"static": True})
    factor: float = dataclasses.field(default=2.0, metadata={"static": True})

    @classmethod
    def create(cls, initial: float = 2.0**15, period: int = 2000, factor: float = 2.0) -> LossScale:
        return cls(jnp.float32(initial), jnp.int32(0), jnp.int32(0), period, factor)

    def adjust(self, finite: jax.Array) -> LossScale:
        grow = finite & (self.good_steps + 1 >= self.period)
        scale = jnp.where(
            finite, jnp.where(grow, self.scale * self.factor, self.scale), jnp.maximum(self.scale / self.factor, 1.0)
        )
        good_steps = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return LossScale(scale, good_steps, self.skipped + (~finite).astype(jnp.int32), self.period, self.factor)


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def select(condition: jax.Array, on_true, on_false):
    """``on_true`` where ``condition`` holds, else ``on_false`` (whole pytrees, one scalar condition)."""
    return jax.tree.map(lambda a, b: jnp.where(condition, a, b), on_true, on_false)
