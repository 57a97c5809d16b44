"""Training objectives: the loss, the per-example eval outputs and the metrics of each kind of job."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxseq.data.glue import GlueTask, compute_metrics
from jaxseq.errors import JaxseqError
from jaxseq.generation import greedy_tokens
from jaxseq.metrics import perplexity
from jaxseq.models.t5 import decoder_start_id, shift_right


class SequenceClassification:
    """Cross-entropy over classes, or mean squared error when the task is a regression (STS-B)."""

    def __init__(self, task: GlueTask):
        self.task = task

    def _logits(self, model, batch, rngs=None):
        extra = {k: batch[k] for k in ("token_type_ids", "position_ids", "pool_index") if k in batch}
        return model(batch["input_ids"], batch["attention_mask"], **extra, rngs=rngs)

    def _losses(self, logits, labels):
        if self.task.is_regression:
            return (logits[:, 0] - labels) ** 2
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    def loss(self, model, batch: Mapping[str, jax.Array], rngs) -> jax.Array:
        return self._losses(self._logits(model, batch, rngs), batch["labels"]).mean()

    def predict(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        logits = self._logits(model, batch)
        prediction = logits[:, 0] if self.task.is_regression else jnp.argmax(logits, axis=-1)
        return {"prediction": prediction, "labels": batch["labels"], "loss": self._losses(logits, batch["labels"])}

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        return {
            "loss": float(outputs["loss"].mean()),
            **compute_metrics(self.task, outputs["prediction"], outputs["labels"]),
        }


class TokenLoss:
    """Cross-entropy over weighted target tokens (``_token_losses``, defined by each job). The loss is the
    mean over every target token of the batch; ``predict`` keeps each example's summed loss and token
    count, so the eval loss and perplexity are exact over all tokens of the eval set, whatever the batching."""

    def _token_losses(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array]:
        """Per-token losses and weights (0 = not a target), both ``[batch, seq]``."""
        raise NotImplementedError

    def _weights(self, batch) -> jax.Array:
        """The target weights of ``batch`` (``[batch, seq]``), from the batch alone."""
        raise NotImplementedError

    def loss(self, model, batch: Mapping[str, jax.Array], rngs) -> jax.Array:
        losses, weights = self._token_losses(model, batch, rngs)
        return losses.sum() / jnp.maximum(weights.sum(), 1.0)

    def loss_weight(self, batch: Mapping[str, jax.Array]) -> jax.Array:
        """How much ``batch``'s loss counts when micro-batches are accumulated: its number of target tokens,
        so that accumulating is one per-token mean over every target of the step, as the doubled batch."""
        return self._weights(batch).sum()

    def predict(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        losses, weights = self._token_losses(model, batch)
        return {"loss_sum": losses.sum(axis=-1), "tokens": weights.sum(axis=-1)}

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        loss = float(outputs["loss_sum"].astype(np.float64).sum() / max(outputs["tokens"].sum(), 1.0))
        return {"loss": loss, "perplexity": perplexity(loss)}


class CausalLM(TokenLoss):
    """Next-token cross-entropy: position t predicts token t+1 of ``input_ids`` (a target whose
    ``attention_mask`` is 0, if the batch has one, is left out).

    With ``chunk_size`` (and a model that has ``hidden_states`` and ``logits``: GPT-2, GPT-J) the loss is
    computed ``chunk_size`` positions at a time from the final hidden states, each chunk's logits made and
    dropped inside a ``jax.checkpoint``: neither the forward nor the backward pass (nor evaluation) holds the
    float32 ``[tokens, vocab]`` logits of the whole batch at once. ``None``: the plain full-logits loss."""

    def __init__(self, chunk_size: int | None = 512):
        if chunk_size is not None and chunk_size < 1:
            raise JaxseqError(f"the loss chunk size must be at least 1 position, got {chunk_size}")
        self.chunk_size = chunk_size

    def _token_losses(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array]:
        ids = batch["input_ids"].astype(jnp.int32)  # the data may be stored as uint16
        mask = batch.get("attention_mask")
        targets = jnp.roll(ids, -1, axis=1)
        weights = self._weights(batch)
        if self.chunk_size and hasattr(model, "hidden_states"):
            h = model.hidden_states(ids, mask, rngs=rngs).last_hidden_state
            losses = chunked_cross_entropy(model.logits, h, targets, self.chunk_size)
        else:
            logits = model(ids, mask, rngs=rngs).logits
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return losses * weights, weights

    def _weights(self, batch) -> jax.Array:
        # the last position has no next token: it is scored against a wrapped-around target with weight 0,
        # which spares slicing the logits (a copy of the step's largest array, and a pad in the backward)
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        weights = jnp.ones(ids.shape, jnp.float32) if mask is None else jnp.roll(mask, -1, axis=1).astype(jnp.float32)
        return weights.at[:, -1].set(0.0)


def chunked_cross_entropy(head, h: jax.Array, targets: jax.Array, chunk_size: int) -> jax.Array:
    """``softmax_cross_entropy_with_integer_labels(head(h), targets)``, ``[batch, seq]``, computed
    ``chunk_size`` positions at a time (the sequence padded up to whole chunks): ``head`` maps hidden states
    ``[batch, chunk, hidden]`` to float32 logits. Each chunk is a ``jax.checkpoint``, so the backward pass
    recomputes one chunk's logits at a time instead of keeping them all."""
    batch, seq = targets.shape

    @jax.checkpoint
    def chunk_losses(h, targets):
        return optax.softmax_cross_entropy_with_integer_labels(head(h), targets)

    if seq <= chunk_size:
        return chunk_losses(h, targets)
    chunks = -(-seq // chunk_size)
    pad = chunks * chunk_size - seq
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [chunks, batch, chunk_size, ...]: every chunk keeps the whole batch (and its sharding over devices)
    h = h.reshape(batch, chunks, chunk_size, h.shape[-1]).swapaxes(0, 1)
    targets = targets.reshape(batch, chunks, chunk_size).swapaxes(0, 1)
    losses = jax.lax.map(lambda xs: chunk_losses(*xs), (h, targets))
    return losses.swapaxes(0, 1).reshape(batch, chunks * chunk_size)[:, :seq]


class Seq2SeqLM(TokenLoss):
    """Teacher-forced cross-entropy of an encoder-decoder (T5) on ``labels`` (``decoder_attention_mask``
    marks the real target tokens); eval loss and perplexity exact over all target tokens. With a
    ``tokenizer`` and ``max_new_tokens`` > 0, evaluation also decodes greedily and scores the text:
    exact match (stripped strings equal)."""

    def __init__(self, tokenizer=None, max_new_tokens: int = 0):
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens

    def _token_losses(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array]:
        config, labels = model.config, batch["labels"]
        decoder_input_ids = shift_right(labels, decoder_start_id(config), config.pad_token_id)
        logits = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids, rngs=rngs).logits
        weights = self._weights(batch)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels) * weights, weights

    def _weights(self, batch) -> jax.Array:
        return batch["decoder_attention_mask"].astype(jnp.float32)

    def predict(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        outputs = super().predict(model, batch)
        if self.tokenizer is not None and self.max_new_tokens > 0:
            outputs["generated"] = greedy_tokens(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                max_new_tokens=self.max_new_tokens,
                eos_token_id=model.config.eos_token_id,
                pad_token_id=model.config.pad_token_id,
            )
            outputs["references"] = jnp.where(
                batch["decoder_attention_mask"] > 0, batch["labels"], model.config.pad_token_id
            )
        return outputs

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        results = super().metrics(outputs)
        if "generated" in outputs:
            predictions = self.decode(outputs["generated"])
            references = self.decode(outputs["references"])
            results["exact_match"] = float(np.mean([p == r for p, r in zip(predictions, references)]))
        return results

    def decode(self, ids: np.ndarray) -> list[str]:
        return [text.strip() for text in self.tokenizer.batch_decode(ids, skip_special_tokens=True)]
