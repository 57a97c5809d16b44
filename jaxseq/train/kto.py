"""Kahneman-Tversky optimisation, TRL's names and formulas (trl 1.x ``KTOTrainer``, arXiv:2402.01306): each
row is a prompt and one completion labelled desirable or undesirable; the policy's log-ratio against a
reference r = log π(y|x) - log π_ref(y|x) is pushed up for desirable completions, 1 - σ(β(r - z)), and down
for undesirable ones, 1 - σ(β(z - r)), weighted by --desirable_weight and --undesirable_weight, where the
reference point z is the batch's KL estimate: the mean of log π(y'|x) - log π_ref(y'|x) over mismatched
pairs, each prompt with the completion of the row before it in its device's batch (the first with the last),
as TRL pairs them, clamped at 0 and without gradient. ``apo_zero_unpaired`` (arXiv:2408.06266) needs no KL:
1 - σ(βr) and σ(βr)."""

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

LOSS_TYPES = ("kto", "apo_zero_unpaired")
METRICS = (
    "kl",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "rewards/chosen",
    "logps/chosen",
    "rewards/rejected",
    "logps/rejected",
    "rewards/margins",
)
"""What TRL's KTOTrainer logs besides ``loss`` (and its running ``num_tokens``), by its names."""


def kto_losses(
    logps: jax.Array,
    ref_logps: jax.Array,
    kl: jax.Array,
    label: jax.Array,
    *,
    loss_type: str = "kto",
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> jax.Array:
    """Each row's weighted loss (TRL's ``_compute_loss``) from its completion's log-probs under the policy
    and the reference, the KL estimate ``kl`` and its ``label`` (true: desirable)."""
    ratio = logps - ref_logps
    if loss_type == "kto":
        chosen, rejected = 1 - jax.nn.sigmoid(beta * (ratio - kl)), 1 - jax.nn.sigmoid(beta * (kl - ratio))
    elif loss_type == "apo_zero_unpaired":
        chosen, rejected = 1 - jax.nn.sigmoid(beta * ratio), jax.nn.sigmoid(beta * ratio)
    else:
        raise JaxseqError(f"--loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    return jnp.where(label != 0, desirable_weight * chosen, undesirable_weight * rejected)


def join(input_ids, prompt_length, source_ids, completion_start, completion_length, width: int):
    """``[rows, width]`` sequences of each row's prompt (the first ``prompt_length`` tokens of ``input_ids``)
    followed by a completion (``completion_length`` tokens of ``source_ids`` from ``completion_start``: the
    row's own, or another's), right-padded and cut to ``width`` as TRL's collator cuts them: ``input_ids``,
    ``attention_mask`` and ``completion_mask``."""
    t = jnp.arange(width)[None]
    last = input_ids.shape[1] - 1
    in_prompt = t < prompt_length[:, None]
    at = t - prompt_length[:, None]
    in_completion = (at >= 0) & (at < completion_length[:, None])
    prompt = jnp.take_along_axis(input_ids, jnp.minimum(t, last), axis=1)
    completion = jnp.take_along_axis(source_ids, jnp.clip(completion_start[:, None] + at, 0, last), axis=1)
    ids = jnp.where(in_prompt, prompt, jnp.where(in_completion, completion, 0))
    return ids.astype(jnp.int32), (in_prompt | in_completion).astype(jnp.int32), in_completion.astype(jnp.int32)


def _token_stats(logits, targets, classes: int | None, figures: bool):
    """Per position: the target's log-prob, and with ``figures`` the entropy and the mean logit of the
    next-token distribution (TRL's ``entropy`` and ``mean_logits``, without gradient)."""
    logits = logits[..., :classes] if classes is not None else logits
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if not figures:
        return (picked,)
    entropy = -(jnp.exp(logp) * logp).sum(-1)
    return picked, jax.lax.stop_gradient(entropy), jax.lax.stop_gradient(logits.astype(jnp.float32).mean(-1))


def _chunked_stats(head, h, targets, chunk_size: int, classes: int | None, figures: bool):
    """``_token_stats(head(h), ...)`` ``chunk_size`` positions at a time, each chunk a ``jax.checkpoint`` (as
    ``objectives.chunked_cross_entropy``): at most one chunk of float32 logits at a time."""
    batch, seq = targets.shape

    @jax.checkpoint
    def chunk(h, targets):
        return _token_stats(head(h), targets, classes, figures)

    if seq <= chunk_size:
        return chunk(h, targets)
    chunks = -(-seq // chunk_size)
    pad = chunks * chunk_size - seq
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(batch, chunks, chunk_size, -1).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(batch, chunks, chunk_size).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: chunk(*xs), (h, targets))
    return tuple(x.swapaxes(0, 1).reshape(batch, chunks * chunk_size)[:, :seq] for x in out)


@dataclasses.dataclass
class KTOConfig:
    beta: float = arg(0.1, "β: how far the policy may move from the reference (higher: less; TRL's default 0.1)")
    loss_type: str = arg(
        "kto",
        "kto (the KTO paper's, with the batch's KL estimate as reference point) or apo_zero_unpaired (APO-zero's "
        "unpaired variant, no KL term)",
        choices=LOSS_TYPES,
    )
    desirable_weight: float = arg(1.0, "weight of the desirable rows' losses (TRL's default 1.0)")
    undesirable_weight: float = arg(1.0, "weight of the undesirable rows' losses (TRL's default 1.0)")
    precompute_ref_log_probs: bool = arg(
        False,
        "compute the reference log-probs of every row once before training (no reference weights held while "
        "training; apo_zero_unpaired only: kto's KL pairs are made in each batch); else a frozen copy of the "
        "starting weights, or with LoRA the base with the adapters off",
    )
    loss_chunk_tokens: int = arg(
        AUTO_CHUNK, "float32 logits of at most this many tokens per device at a time (as `jaxseq clm`; 0: all)"
    )

    def __post_init__(self):
        if not self.beta > 0:
            raise JaxseqError(f"--beta must be above 0, got {self.beta}")
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) < 0:
                raise JaxseqError(f"--{name} must be at least 0, got {getattr(self, name)}")
        if self.precompute_ref_log_probs and self.loss_type == "kto":
            raise JaxseqError(
                "--precompute_ref_log_probs needs --loss_type apo_zero_unpaired: kto's KL term pairs each prompt "
                "with another row's completion of the same batch, so its reference log-probs are made each step"
            )

    def objective(self, max_length: int | None = None) -> KTO:
        return KTO(
            self.loss_type,
            self.beta,
            self.desirable_weight,
            self.undesirable_weight,
            max_length=max_length,
            precomputed=self.precompute_ref_log_probs,
            lm=CausalLM(self.loss_chunk_tokens or None),
        )


class KTO(Task):
    """The KTO loss of a batch of rows: ``input_ids`` (each prompt and its completion) with the parts' lengths
    ``prompt_length`` and ``completion_length``, and ``label`` (1: desirable) (``jaxseq.data.kto``), and
    ``ref_logps`` when the reference's log-probs are precomputed. The step joins each prompt with its own
    completion, and (``kto``) with the completion of the row before it among its device's rows (the KL
    sequences; ``batch_shards`` devices share the batch), each cut to ``max_length`` tokens. The reference's
    log-probs of both come from the frozen weights (``reference``, ``needs_reference``). No dropout, as TRL's
    ``disable_dropout``. ``lm``: the causal-LM loss whose chunk sizes it follows."""

    metric_names = ("loss", *METRICS)

    def __init__(
        self,
        loss_type: str = "kto",
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        *,
        max_length: int | None = None,
        precomputed: bool = False,
        lm=None,
        batch_shards: int = 1,
    ):
        if loss_type not in LOSS_TYPES:
            raise JaxseqError(f"--loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        self.loss_type, self.beta = loss_type, beta
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight
        self.max_length, self.batch_shards = max_length, batch_shards
        self.calculate_kl = loss_type != "apo_zero_unpaired"
        if precomputed and self.calculate_kl:
            raise JaxseqError("precomputed reference log-probs need --loss_type apo_zero_unpaired")
        self.precomputed, self.lm = precomputed, lm if lm is not None else CausalLM(None)

    @property
    def needs_reference(self) -> bool:
        return not self.precomputed

    @property
    def precomputes_reference(self) -> bool:
        return self.precomputed

    def for_batch_shards(self, batch_shards: int, device=None) -> KTO:
        return KTO(
            self.loss_type,
            self.beta,
            self.desirable_weight,
            self.undesirable_weight,
            max_length=self.max_length,
            precomputed=self.precomputed,
            lm=self.lm.for_batch_shards(batch_shards, device),
            batch_shards=batch_shards,
        )

    def _rotate(self, x: jax.Array) -> jax.Array:
        """Each device's rows moved down by one (its last row first): the row before each one's (a device's
        only row is its own: the job asks for 2 or more a device to train)."""
        rows = x.shape[0]
        if rows % self.batch_shards:
            raise JaxseqError(f"{rows} rows do not split over {self.batch_shards} devices")
        split = x.reshape(self.batch_shards, rows // self.batch_shards, *x.shape[1:])
        return jnp.roll(split, 1, axis=1).reshape(x.shape)

    def _sequences(self, batch: Mapping[str, jax.Array], kl: bool = False):
        """The rows' sequences (``join``), or with ``kl`` each prompt with the row before's completion."""
        ids, prompts, completions = batch["input_ids"], batch["prompt_length"], batch["completion_length"]
        width = ids.shape[1] if self.max_length is None else min(ids.shape[1], self.max_length)
        source, start = ids, prompts
        if kl:
            source, start, completions = self._rotate(ids), self._rotate(prompts), self._rotate(completions)
        return join(ids, prompts, source, start, completions, width)

    def _scored(self, model, ids, mask, completion_mask, figures: bool):
        """Per position (the next token's): its log-prob, 1 where it is a completion token, and with
        ``figures`` the entropy and mean logit of the model's distribution there."""
        weights = self.lm._weights({"input_ids": ids, "attention_mask": mask, "loss_mask": completion_mask})
        targets = jnp.roll(ids, -1, axis=1)
        vocab = model.config.vocab_size
        chunk_tokens = self.lm._chunk_tokens(*ids.shape, vocab)
        if chunk_tokens and hasattr(model, "hidden_states"):
            hidden = model.hidden_states(ids, mask, None).last_hidden_state
            chunk = self.lm.chunk_positions(*ids.shape, chunk_tokens)
            stats = _chunked_stats(model.logits, hidden, targets, chunk, vocab, figures)
        else:
            stats = _token_stats(model(ids, mask, None).logits, targets, vocab, figures)
        return tuple(s * weights for s in stats), weights

    def _logps(self, model, batch, kl: bool = False) -> jax.Array:
        """``[rows]``: each completion's summed log-probs (``kl``: of the KL sequences)."""
        (logps,), _ = self._scored(model, *self._sequences(batch, kl), figures=False)
        return logps.sum(-1)

    def reference(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The batch's reference columns from the reference ``model``: ``ref_logps`` and, for the KL term,
        ``ref_KL_logps``."""
        out = {"ref_logps": self._logps(model, batch)}
        if self.calculate_kl and not self.precomputed:
            out["ref_KL_logps"] = self._logps(model, batch, kl=True)
        return out

    def _rows(self, model, batch) -> dict[str, jax.Array]:
        """Each row's loss (with its batch's KL estimate) and what TRL's figures are made of."""
        (logps, entropy, mean_logits), weights = self._scored(model, *self._sequences(batch), figures=True)
        logps = logps.sum(-1)
        if self.calculate_kl:
            kl_logps = jax.lax.stop_gradient(self._logps(model, batch, kl=True))
            kl = jnp.maximum(jnp.mean(kl_logps - batch["ref_KL_logps"]), 0.0)
        else:
            kl = jnp.zeros((), jnp.float32)
        label = batch["label"]
        losses = kto_losses(
            logps,
            batch["ref_logps"],
            kl,
            label,
            loss_type=self.loss_type,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        logps = jax.lax.stop_gradient(logps)
        return {
            "row_loss": losses,
            "kl": jnp.broadcast_to(kl, logps.shape),
            "label": label,
            "logps": logps,
            "rewards": self.beta * (logps - batch["ref_logps"]),
            "entropy_sum": entropy.sum(-1),
            "logits_sum": mean_logits.sum(-1),
            "tokens": weights.sum(-1),
        }

    def loss_and_metrics(self, model, batch, rngs=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The batch's loss (the mean of its rows' weighted losses) and TRL's figures of it; a figure of the
        desirable (undesirable) rows is NaN in a batch without any."""
        rows = self._rows(model, batch)
        return rows["row_loss"].mean(), _figures(jnp, rows)

    def loss(self, model, batch, rngs=None) -> jax.Array:
        return self.loss_and_metrics(model, batch, rngs)[0]

    def predict(self, model, batch) -> dict[str, jax.Array]:
        return self._rows(model, batch)

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """The set's figures: each row's loss with its batch's KL estimate, averaged; the KL estimate averaged
        over the rows; the rest pooled over the set's desirable and undesirable rows (TRL averages each eval
        batch's figures)."""
        rows = {k: np.asarray(v, np.float64) for k, v in outputs.items()}
        return {k: float(v) for k, v in _figures(np, rows).items()} | {"loss": float(rows["row_loss"].mean())}


def _figures(xp, rows) -> dict:
    """TRL's figures of ``rows`` (``KTO._rows``'s outputs), with ``xp`` jax.numpy or numpy."""
    chosen = rows["label"] != 0
    rejected = ~chosen
    tokens = rows["tokens"]

    def over(values, which, count):
        total = xp.where(which, values, 0.0).sum()
        return xp.where(count > 0, total / xp.maximum(count, 1.0), xp.nan)

    n_chosen, n_rejected = chosen.sum().astype(xp.float32), rejected.sum().astype(xp.float32)
    all_tokens = tokens.sum()
    out = {
        "kl": rows["kl"].mean(),
        "entropy": xp.where(all_tokens > 0, rows["entropy_sum"].sum() / xp.maximum(all_tokens, 1.0), 0.0),
        "logits/chosen": over(rows["logits_sum"], chosen, xp.where(chosen, tokens, 0.0).sum()),
        "logits/rejected": over(rows["logits_sum"], rejected, xp.where(rejected, tokens, 0.0).sum()),
        "rewards/chosen": over(rows["rewards"], chosen, n_chosen),
        "logps/chosen": over(rows["logps"], chosen, n_chosen),
        "rewards/rejected": over(rows["rewards"], rejected, n_rejected),
        "logps/rejected": over(rows["logps"], rejected, n_rejected),
    }
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
