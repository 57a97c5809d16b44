"""Pre-training objectives: masked-LM cross-entropy on the masked tokens (``jaxseq mlm``) and T5's seq2seq loss
on span-corrupted text (``jaxseq t5-mlm``), each corrupting its training batches on the device."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxseq.data.masking import IGNORE, mask_tokens, maskable
from jaxseq.data.spans import SpanCorruption
from jaxseq.train.objectives import Seq2SeqLM, TokenLoss, cross_entropy


class MaskedLM(TokenLoss):
    """A batch with ``labels`` (evaluation: masked once, ``data.masking.mask_examples``) is scored as it is;
    a training batch without them is masked on the device with a key from the step's ``rngs`` (80/10/10,
    ``special_ids`` and padding never). Loss and perplexity are over the masked tokens."""

    def __init__(self, probability: float, mask_token_id: int, special_ids: Sequence[int], vocab_size: int):
        self.probability, self.mask_token_id = probability, mask_token_id
        self.special_ids, self.vocab_size = tuple(special_ids), vocab_size

    def mask(self, key: jax.Array, batch) -> tuple[jax.Array, jax.Array]:
        """(inputs, labels) of a batch of token ids, masked with ``key``."""
        ids = batch["input_ids"].astype(jnp.int32)
        allowed = maskable(ids, self.special_ids, batch.get("attention_mask"))
        return mask_tokens(
            key,
            ids,
            allowed,
            probability=self.probability,
            mask_token_id=self.mask_token_id,
            vocab_size=self.vocab_size,
        )

    def _token_losses(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array]:
        if "labels" in batch:
            inputs, labels = batch["input_ids"].astype(jnp.int32), batch["labels"]
        else:
            inputs, labels = self.mask(rngs.dropout(), batch)
        weights = (labels != IGNORE).astype(jnp.float32)
        if not hasattr(model, "hidden_states"):
            logits = model(inputs, batch.get("attention_mask"), rngs=rngs)
            return cross_entropy(logits, jnp.maximum(labels, 0)) * weights, weights
        h = model.hidden_states(inputs, batch.get("attention_mask"), rngs=rngs).last_hidden_state
        return masked_losses(model.logits, h, labels, masked_capacity(labels.size, self.probability)), weights

    def _weights(self, batch) -> jax.Array:
        """The masked tokens; before masking (training), their expected number."""
        if "labels" in batch:
            return (batch["labels"] != IGNORE).astype(jnp.float32)
        ids = batch["input_ids"].astype(jnp.int32)
        return maskable(ids, self.special_ids, batch.get("attention_mask")) * self.probability


def masked_capacity(tokens: int, probability: float, sigmas: float = 8.0) -> int:
    """How many of ``tokens`` positions the head scores when each is masked with ``probability``: the mean
    plus ``sigmas`` standard deviations of that binomial count, in multiples of 8 (a batch masking more is
    scored whole: ``masked_losses``); ``tokens`` when that is not fewer."""
    bound = probability * tokens + sigmas * math.sqrt(tokens * probability * (1 - probability))
    return min(tokens, 8 * math.ceil(bound / 8))


def masked_losses(logits_of: Callable, h: jax.Array, labels: jax.Array, capacity: int) -> jax.Array:
    """Per-token cross-entropy ``[batch, seq]`` at the masked tokens (``labels`` not ``IGNORE``; 0 elsewhere)
    of hidden states ``h``, the vocabulary logits (``logits_of``) computed at the masked positions alone, at
    most ``capacity`` of them (for BERT's 15%, about a fifth of the tokens: the head over a 30k vocabulary
    costs as much as MiniLM's encoder); a batch with more masked tokens than that (8 standard deviations
    past the mean: never, in practice) is scored at every position. The same losses either way."""
    targets = jnp.asarray(labels).reshape(-1)
    scored = targets != IGNORE
    flat = h.reshape(-1, h.shape[-1])

    def at_masked(flat):
        at = jnp.flatnonzero(scored, size=capacity, fill_value=0)
        losses = cross_entropy(logits_of(flat[at]), jnp.maximum(targets[at], 0))
        kept = jnp.arange(capacity) < scored.sum()  # the fill positions repeat position 0: not scored
        return jnp.zeros(targets.shape, losses.dtype).at[at].add(jnp.where(kept, losses, 0.0))

    def everywhere(flat):
        return cross_entropy(logits_of(flat), jnp.maximum(targets, 0)) * scored

    if capacity >= targets.size:
        return everywhere(flat).reshape(labels.shape)
    return jax.lax.cond(scored.sum() <= capacity, at_masked, everywhere, flat).reshape(labels.shape)


class SpanCorruptionLM(Seq2SeqLM):
    """T5's seq2seq loss on span-corrupted blocks (``data.spans.SpanCorruption``): a training batch of raw
    blocks is corrupted on the device with a key from the step's ``rngs``; a batch with ``labels``
    (evaluation: corrupted once) is scored as it is."""

    def __init__(self, corruption: SpanCorruption):
        super().__init__()
        self.corruption = corruption

    def _corrupted(self, batch, rngs):
        return batch if "labels" in batch else self.corruption.corrupt_batch(rngs.dropout(), batch["input_ids"])

    def _token_losses(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array]:
        return super()._token_losses(model, self._corrupted(batch, rngs), rngs)

    def _weights(self, batch) -> jax.Array:
        if "labels" in batch:
            return super()._weights(batch)
        return jnp.ones((batch["input_ids"].shape[0], self.corruption.lengths[1]), jnp.float32)
