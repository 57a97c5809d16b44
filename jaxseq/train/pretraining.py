"""Pre-training objectives: masked-LM cross-entropy on the masked tokens (``jaxseq mlm``) and T5's seq2seq loss
on span-corrupted text (``jaxseq t5-mlm``), each corrupting its training batches on the device."""

from __future__ import annotations

from collections.abc import Sequence

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
        logits = model(inputs, batch.get("attention_mask"), rngs=rngs)
        weights = (labels != IGNORE).astype(jnp.float32)
        return cross_entropy(logits, jnp.maximum(labels, 0)) * weights, weights

    def _weights(self, batch) -> jax.Array:
        """The masked tokens; before masking (training), their expected number."""
        if "labels" in batch:
            return (batch["labels"] != IGNORE).astype(jnp.float32)
        ids = batch["input_ids"].astype(jnp.int32)
        return maskable(ids, self.special_ids, batch.get("attention_mask")) * self.probability


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
