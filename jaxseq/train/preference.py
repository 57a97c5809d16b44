"""Preference optimisation (DPO and its variants), TRL's names and formulas (trl 1.x ``DPOTrainer``): the
losses as pure functions of per-sequence log-probs, and the ``DPO`` objective that computes them for the
Trainer, chosen and rejected in one forward pass (concatenated on the batch axis)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.config import arg
from jaxseq.errors import JaxseqError
from jaxseq.train.objectives import AUTO_CHUNK, CausalLM

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What TRL's DPOTrainer logs besides ``loss``, by its names."""


def dpo_losses(
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array,
    ref_rejected_logps: jax.Array,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_tokens: jax.Array | None = None,
    rejected_tokens: jax.Array | None = None,
) -> jax.Array:
    """Each pair's loss (TRL's ``_compute_loss``): ``sigmoid`` -log σ(βΔ), ``hinge`` max(0, 1 - βΔ), ``ipo``
    (Δ per completion token - 1/2β)², ``robust`` (-(1-ε) log σ(βΔ) + ε log σ(-βΔ)) / (1-2ε), where Δ is the
    chosen log-ratio (policy minus reference) minus the rejected one and ε ``label_smoothing``; ``ipo`` needs
    the completions' token counts."""
    chosen = chosen_logps - ref_chosen_logps
    rejected = rejected_logps - ref_rejected_logps
    delta = chosen - rejected
    if loss_type == "sigmoid":
        return -jax.nn.log_sigmoid(beta * delta)
    if loss_type == "hinge":
        return jax.nn.relu(1 - beta * delta)
    if loss_type == "ipo":
        per_token = chosen / jnp.maximum(chosen_tokens, 1.0) - rejected / jnp.maximum(rejected_tokens, 1.0)
        return (per_token - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        clean = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * delta)
        flipped = -label_smoothing * jax.nn.log_sigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    raise JaxseqError(f"--loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")


@dataclasses.dataclass
class DPOConfig:
    beta: float = arg(0.1, "β: how far the policy may move from the reference (higher: less; TRL's default 0.1)")
    loss_type: str = arg(
        "sigmoid",
        "sigmoid (DPO), hinge (SLiC), ipo (IPO, per completion token) or robust (robust DPO, with --label_smoothing)",
        choices=LOSS_TYPES,
    )
    label_smoothing: float = arg(0.0, "robust DPO's probability that a pair's preference is flipped, in [0, 0.5)")
    precompute_ref_log_probs: bool = arg(
        False,
        "compute the reference log-probs of every pair once before training (no reference weights held while "
        "training); else a frozen copy of the starting weights, or with LoRA the base with the adapters off",
    )
    loss_chunk_tokens: int = arg(
        AUTO_CHUNK, "float32 logits of at most this many tokens per device at a time (as `jaxseq clm`; 0: all)"
    )

    def __post_init__(self):
        if not self.beta > 0:
            raise JaxseqError(f"--beta must be above 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise JaxseqError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")

    def objective(self) -> DPO:
        return DPO(
            self.loss_type,
            self.beta,
            self.label_smoothing,
            precomputed=self.precompute_ref_log_probs,
            lm=CausalLM(self.loss_chunk_tokens or None),
        )


class DPO:
    """The DPO loss of a batch of pairs: ``input_ids``, ``pair_mask`` and ``completion_mask``, each
    ``[pairs, 2, length]`` (chosen, rejected; ``jaxseq.data.preference``), and ``ref_logps`` ``[pairs, 2]``
    when the reference's log-probs are precomputed. Otherwise the step computes them from the frozen weights
    (``reference``, ``needs_reference``). No dropout, as TRL's ``disable_dropout``. ``lm``: the causal-LM
    loss whose per-token log-probs (chunked logits) it sums over each completion."""

    metric_names = ("loss", *METRICS)

    def __init__(
        self, loss_type: str, beta: float, label_smoothing: float = 0.0, *, precomputed: bool = False, lm=None
    ):
        if loss_type not in LOSS_TYPES:
            raise JaxseqError(f"--loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        self.loss_type, self.beta, self.label_smoothing = loss_type, beta, label_smoothing
        self.precomputed, self.lm = precomputed, lm if lm is not None else CausalLM(None)

    @property
    def needs_reference(self) -> bool:
        """Whether the steps compute the reference's log-probs (``reference``) from frozen weights."""
        return not self.precomputed

    @property
    def precomputes_reference(self) -> bool:
        """Whether the Trainer adds ``reference``'s columns to every set once, before training."""
        return self.precomputed

    def for_batch_shards(self, batch_shards: int, device=None) -> DPO:
        lm = self.lm.for_batch_shards(batch_shards, device)  # the 2 x pairs rows stay split as the pairs
        return DPO(self.loss_type, self.beta, self.label_smoothing, precomputed=self.precomputed, lm=lm)

    def logps(self, model, batch: Mapping[str, jax.Array]) -> jax.Array:
        """``[pairs, 2]``: each completion's summed log-probs, chosen and rejected in one forward pass."""
        ids = batch["input_ids"]
        pairs, _, length = ids.shape
        flat = lambda x: x.swapaxes(0, 1).reshape(2 * pairs, length)  # every chosen, then every rejected
        rows = {"input_ids": flat(ids), "attention_mask": flat(batch["pair_mask"])}
        rows["loss_mask"] = flat(batch["completion_mask"])
        losses, _ = self.lm._token_losses(model, rows)
        return -losses.sum(axis=-1).reshape(2, pairs).T

    def reference(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The batch's reference columns from the reference ``model``: ``ref_logps``."""
        return {"ref_logps": self.logps(model, batch)}

    def _pairs(self, model, batch) -> dict[str, jax.Array]:
        """Each pair's loss and TRL's per-pair figures."""
        logps, ref = self.logps(model, batch), batch["ref_logps"]
        tokens = batch["completion_mask"].sum(axis=-1).astype(jnp.float32)
        losses = dpo_losses(
            logps[:, 0],
            logps[:, 1],
            ref[:, 0],
            ref[:, 1],
            loss_type=self.loss_type,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            chosen_tokens=tokens[:, 0],
            rejected_tokens=tokens[:, 1],
        )
        rewards = jax.lax.stop_gradient(self.beta * (logps - ref))
        logps = jax.lax.stop_gradient(logps)
        return {
            "loss": losses,
            "rewards/chosen": rewards[:, 0],
            "rewards/rejected": rewards[:, 1],
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32),
            "rewards/margins": rewards[:, 0] - rewards[:, 1],
            "logps/chosen": logps[:, 0],
            "logps/rejected": logps[:, 1],
        }

    def loss_and_metrics(self, model, batch, rngs=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The batch's mean loss and the means of TRL's logged figures."""
        pairs = self._pairs(model, batch)
        return pairs["loss"].mean(), {k: pairs[k].mean() for k in METRICS}

    def loss(self, model, batch, rngs=None) -> jax.Array:
        return self.loss_and_metrics(model, batch, rngs)[0]

    def predict(self, model, batch) -> dict[str, jax.Array]:
        return self._pairs(model, batch)

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        return {k: float(np.mean(outputs[k])) for k in self.metric_names}
