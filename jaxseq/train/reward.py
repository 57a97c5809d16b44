"""Reward modelling, TRL's names and formulas (trl 1.x ``RewardTrainer.compute_loss``): a classifier with one
output scores the chosen and the rejected sequence of each pair (in one forward pass, stacked on the batch
axis), and the Bradley-Terry loss -log σ(r_chosen - r_rejected [- margin]) teaches it to score the chosen one
higher, plus ``center_rewards_coefficient`` x mean((r_chosen + r_rejected)²) to keep the rewards near zero."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.config import arg
from jaxseq.train.task import Task

METRICS = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin")
"""What TRL's RewardTrainer logs besides ``loss`` (and its running ``num_tokens``), by its names."""


def reward_losses(
    chosen: jax.Array,
    rejected: jax.Array,
    margin: jax.Array | None = None,
    center_rewards_coefficient: float | None = None,
) -> jax.Array:
    """Each pair's loss: -log σ(r_chosen - r_rejected - margin), plus ``center_rewards_coefficient`` x
    (r_chosen + r_rejected)², whose mean over the pairs is TRL's centring term."""
    delta = chosen - rejected
    if margin is not None:
        delta = delta - margin
    losses = -jax.nn.log_sigmoid(delta)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


@dataclasses.dataclass
class RewardConfig:
    center_rewards_coefficient: float | None = arg(
        None,
        "weight of mean((r_chosen + r_rejected)²) added to the loss, keeping the rewards near zero "
        "(arXiv:2312.09244 Eq. 2; TRL recommends 0.01; default: none)",
    )

    def objective(self) -> RewardModeling:
        return RewardModeling(self.center_rewards_coefficient)


class RewardModeling(Task):
    """The loss of a batch of pairs: ``input_ids`` and ``pair_mask``, each ``[pairs, 2, length]`` (chosen,
    rejected; ``jaxseq.data.reward``), and ``margin`` ``[pairs]`` where the data has one. The model is a
    classifier with one label (``sequence-classification``), scoring each sequence at its last non-padding
    token as transformers' ``*ForSequenceClassification`` do. No dropout, as TRL's ``disable_dropout``."""

    metric_names = ("loss", *METRICS)

    def __init__(self, center_rewards_coefficient: float | None = None):
        self.center_rewards_coefficient = center_rewards_coefficient

    def rewards(self, model, batch: Mapping[str, jax.Array]) -> jax.Array:
        """``[pairs, 2]``: the reward of each chosen and rejected sequence, from one forward pass."""
        ids = batch["input_ids"]
        pairs, _, length = ids.shape
        flat = lambda x: x.swapaxes(0, 1).reshape(2 * pairs, length)  # every chosen, then every rejected
        scores = model(flat(ids), flat(batch["pair_mask"]))[:, 0]
        return scores.reshape(2, pairs).T

    def _pairs(self, model, batch) -> dict[str, jax.Array]:
        rewards = self.rewards(model, batch)
        losses = reward_losses(rewards[:, 0], rewards[:, 1], batch.get("margin"), self.center_rewards_coefficient)
        return {"pair_loss": losses, "rewards_chosen": rewards[:, 0], "rewards_rejected": rewards[:, 1]}

    def loss_and_metrics(self, model, batch, rngs=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The batch's loss (the mean over its pairs) and TRL's figures of its rewards."""
        pairs = self._pairs(model, batch)
        chosen, rejected = jax.lax.stop_gradient((pairs["rewards_chosen"], pairs["rewards_rejected"]))
        both = jnp.concatenate([chosen, rejected])
        figures = {
            "min_reward": both.min(),
            "mean_reward": both.mean(),
            "max_reward": both.max(),
            "accuracy": (chosen > rejected).astype(jnp.float32).mean(),
            "margin": (chosen - rejected).mean(),
        }
        return pairs["pair_loss"].mean(), figures

    def loss(self, model, batch, rngs=None) -> jax.Array:
        return self.loss_and_metrics(model, batch, rngs)[0]

    def predict(self, model, batch) -> dict[str, jax.Array]:
        return self._pairs(model, batch)

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """The set's figures: means over its pairs; the least and the greatest reward of the whole set (TRL
        averages each eval batch's)."""
        chosen, rejected = (np.asarray(outputs[k], np.float64) for k in ("rewards_chosen", "rewards_rejected"))
        both = np.concatenate([chosen, rejected])
        return {
            "loss": float(np.mean(outputs["pair_loss"])),
            "min_reward": float(both.min()),
            "mean_reward": float(both.mean()),
            "max_reward": float(both.max()),
            "accuracy": float(np.mean(chosen > rejected)),
            "margin": float(np.mean(chosen - rejected)),
        }
