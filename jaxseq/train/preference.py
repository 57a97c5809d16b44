"""Preference optimisation, TRL's names and formulas: DPO and its variants against a reference (trl 1.x
``DPOTrainer``), and the reference-free SimPO (``CPOTrainer``'s ``simpo``) and ORPO (``ORPOTrainer``), both in
``trl.experimental``. The losses are pure functions of per-sequence log-probs; the ``DPO`` objective
computes them for the Trainer, chosen and rejected in one forward pass (concatenated on the batch axis)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.config import arg
from jaxseq.errors import JaxseqError
from jaxseq.train.objectives import AUTO_CHUNK, CausalLM
from jaxseq.train.task import Task

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
"""The losses against a reference model (DPOTrainer's)."""
REFERENCE_FREE = ("simpo", "orpo")
"""The losses of the policy alone, on each completion's log-probs per token (CPOTrainer's, ORPOTrainer's)."""
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


def simpo_losses(
    chosen_logps: jax.Array, rejected_logps: jax.Array, *, beta: float, gamma: float, label_smoothing: float = 0.0
) -> jax.Array:
    """SimPO's loss of each pair from its mean log-prob per completion token (TRL's ``CPOTrainer.cpo_loss``
    with ``loss_type="simpo"``): -(1-ε) log σ(β(Δ - γ/β)) - ε log σ(-β(Δ - γ/β)); TRL adds ``cpo_alpha`` x
    the chosen completions' NLL."""
    logits = chosen_logps - rejected_logps - gamma / beta
    return -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * logits) - label_smoothing * jax.nn.log_sigmoid(
        -beta * logits
    )


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, without cancellation (branching at -log 2, as TRL's)."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo_log_odds(chosen_logps: jax.Array, rejected_logps: jax.Array) -> jax.Array:
    """ORPO's log odds ratio of each pair from its mean log-prob per completion token (TRL's
    ``ORPOTrainer.odds_ratio_loss``); the loss is the chosen NLL - β mean log σ(log odds)."""
    return (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))


@dataclasses.dataclass
class DPOConfig:
    beta: float = arg(0.1, "β: how far the policy may move from the reference (higher: less; TRL's default 0.1)")
    loss_type: str = arg(
        "sigmoid",
        "against the reference: sigmoid (DPO), hinge (SLiC), ipo (IPO, per completion token), robust (robust "
        "DPO, with --label_smoothing); reference-free, on log-probs per completion token: simpo (SimPO, TRL's "
        "CPOTrainer, with --simpo_gamma and --cpo_alpha) or orpo (ORPO, TRL's ORPOTrainer)",
        choices=LOSS_TYPES + REFERENCE_FREE,
    )
    label_smoothing: float = arg(
        0.0, "the probability that a pair's preference is flipped (robust and simpo), in [0, 0.5)"
    )
    simpo_gamma: float = arg(0.5, "SimPO's target reward margin γ (TRL's CPOConfig default 0.5)")
    cpo_alpha: float = arg(
        1.0,
        "simpo: weight of the chosen completions' NLL added to the loss (TRL's CPOConfig default 1.0; 0: pure SimPO)",
    )
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
            simpo_gamma=self.simpo_gamma,
            cpo_alpha=self.cpo_alpha,
            lm=CausalLM(self.loss_chunk_tokens or None),
        )


class DPO(Task):
    """The preference loss of a batch of pairs: ``input_ids``, ``pair_mask`` and ``completion_mask``, each
    ``[pairs, 2, length]`` (chosen, rejected; ``jaxseq.data.preference``), and ``ref_logps`` ``[pairs, 2]``
    when the reference's log-probs are precomputed. Otherwise the step computes them from the frozen weights
    (``reference``, ``needs_reference``); simpo and orpo need none. No dropout, as TRL's ``disable_dropout``.
    ``lm``: the causal-LM loss whose per-token log-probs (chunked logits) it sums over each completion."""

    def __init__(
        self,
        loss_type: str,
        beta: float,
        label_smoothing: float = 0.0,
        *,
        precomputed: bool = False,
        simpo_gamma: float = 0.5,
        cpo_alpha: float = 1.0,
        lm=None,
    ):
        if loss_type not in LOSS_TYPES + REFERENCE_FREE:
            raise JaxseqError(f"--loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES + REFERENCE_FREE)}")
        self.loss_type, self.beta, self.label_smoothing = loss_type, beta, label_smoothing
        self.simpo_gamma, self.cpo_alpha = simpo_gamma, cpo_alpha
        self.precomputed, self.lm = precomputed and loss_type in LOSS_TYPES, lm if lm is not None else CausalLM(None)
        # the chosen completions' NLL joins the loss with this weight (a token mean over the batch, as TRL's)
        self.nll_weight = {"simpo": cpo_alpha, "orpo": 1.0}.get(loss_type, 0.0)
        extra = {"orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen"), "simpo": ("nll_loss",)}
        self.metric_names = ("loss", *METRICS, *extra.get(loss_type, ()))

    def _settings(self) -> dict:
        return {"precomputed": self.precomputed, "simpo_gamma": self.simpo_gamma, "cpo_alpha": self.cpo_alpha}

    @property
    def needs_reference(self) -> bool:
        """Whether the steps compute the reference's log-probs (``reference``) from frozen weights."""
        return self.loss_type in LOSS_TYPES and not self.precomputed

    @property
    def precomputes_reference(self) -> bool:
        """Whether the Trainer adds ``reference``'s columns to every set once, before training."""
        return self.precomputed

    def for_batch_shards(self, batch_shards: int, device=None) -> DPO:
        lm = self.lm.for_batch_shards(batch_shards, device)  # the 2 x pairs rows stay split as the pairs
        return DPO(self.loss_type, self.beta, self.label_smoothing, **self._settings(), lm=lm)

    def _completions(self, model, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """``[pairs, 2]`` each: the completions' summed log-probs and their scored tokens, chosen and rejected
        in one forward pass."""
        ids = batch["input_ids"]
        pairs, _, length = ids.shape
        flat = lambda x: x.swapaxes(0, 1).reshape(2 * pairs, length)  # every chosen, then every rejected
        rows = {"input_ids": flat(ids), "attention_mask": flat(batch["pair_mask"])}
        rows["loss_mask"] = flat(batch["completion_mask"])
        losses, weights = self.lm._token_losses(model, rows)
        pair = lambda x: x.sum(axis=-1).reshape(2, pairs).T
        return -pair(losses), pair(weights)

    def logps(self, model, batch: Mapping[str, jax.Array]) -> jax.Array:
        """``[pairs, 2]``: each completion's summed log-probs."""
        return self._completions(model, batch)[0]

    def reference(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The batch's reference columns from the reference ``model``: ``ref_logps``."""
        return {"ref_logps": self.logps(model, batch)}

    def _pairs(self, model, batch) -> dict[str, jax.Array]:
        """Each pair's loss (without the NLL term), the NLL's parts, and TRL's per-pair figures."""
        logps, scored = self._completions(model, batch)
        out = {"nll_sum": -logps[:, 0], "nll_tokens": scored[:, 0]}
        if self.loss_type in REFERENCE_FREE:
            logps = logps / jnp.maximum(scored, 1.0)  # per completion token, as TRL's average_log_prob
            rewards = self.beta * logps
            if self.loss_type == "simpo":
                losses = simpo_losses(
                    logps[:, 0],
                    logps[:, 1],
                    beta=self.beta,
                    gamma=self.simpo_gamma,
                    label_smoothing=self.label_smoothing,
                )
            else:
                log_odds = orpo_log_odds(logps[:, 0], logps[:, 1])
                ratio = jax.nn.log_sigmoid(log_odds)
                losses = -self.beta * ratio
                out.update({"log_odds_ratio": ratio, "log_odds_chosen": log_odds})
        else:
            ref = batch["ref_logps"]
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
            rewards = self.beta * (logps - ref)
        rewards, logps = jax.lax.stop_gradient((rewards, logps))
        out.update(
            {
                "preference_loss": losses,
                "rewards/chosen": rewards[:, 0],
                "rewards/rejected": rewards[:, 1],
                "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32),
                "rewards/margins": rewards[:, 0] - rewards[:, 1],
                "logps/chosen": logps[:, 0],
                "logps/rejected": logps[:, 1],
            }
        )
        return out

    def loss_and_metrics(self, model, batch, rngs=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The batch's loss (the pairs' mean, plus the weighted NLL of the chosen completions' tokens) and
        the means of TRL's logged figures."""
        pairs = self._pairs(model, batch)
        nll = pairs["nll_sum"].sum() / jnp.maximum(pairs["nll_tokens"].sum(), 1.0)
        loss = pairs["preference_loss"].mean() + self.nll_weight * nll
        figures = {k: pairs[k].mean() for k in self.metric_names if k in pairs}
        if "nll_loss" in self.metric_names:
            figures["nll_loss"] = jax.lax.stop_gradient(nll)
        return loss, figures

    def loss(self, model, batch, rngs=None) -> jax.Array:
        return self.loss_and_metrics(model, batch, rngs)[0]

    def predict(self, model, batch) -> dict[str, jax.Array]:
        return self._pairs(model, batch)

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """The set's figures: means over its pairs, the NLL a mean over all its chosen completion tokens."""
        nll = float(outputs["nll_sum"].astype(np.float64).sum() / max(outputs["nll_tokens"].sum(), 1.0))
        out = {k: float(np.mean(outputs[k])) for k in self.metric_names if k in outputs}
        out["loss"] = float(np.mean(outputs["preference_loss"])) + self.nll_weight * nll
        if "nll_loss" in self.metric_names:
            out["nll_loss"] = nll
        return out
