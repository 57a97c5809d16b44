"""Training objectives: the loss, the per-example eval outputs and the metrics of each kind of job."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxseq.config import arg
from jaxseq.errors import JaxseqError
from jaxseq.generation import search_tokens
from jaxseq.metrics import ROUGE_KEYS, perplexity, rouge, seqeval
from jaxseq.models.layers import padded_vocab_size
from jaxseq.train.task import Task


class ClassificationTask(Protocol):
    """What ``SequenceClassification`` reads of its task (``jaxseq.data.glue.GlueTask`` is one)."""

    metric_names: tuple[str, ...]

    @property
    def is_regression(self) -> bool: ...

    def metrics(self, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]: ...


class SequenceClassification(Task):
    """Cross-entropy over classes, or mean squared error when the task is a regression (STS-B)."""

    packed_outputs = True  # its outputs are one per example (pool_index): evaluation packs too

    def __init__(self, task: ClassificationTask):
        self.task = task

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The keys ``metrics`` returns."""
        names = self.task.metric_names
        return ("loss", *names, *(("combined_score",) if len(names) > 1 else ()))

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
        losses = self._losses(logits, batch["labels"])
        return {"logits": logits, "prediction": prediction, "labels": batch["labels"], "loss": losses}

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        return {
            "loss": float(outputs["loss"].mean()),
            **self.task.metrics(outputs["prediction"], outputs["labels"]),
        }


class TokenLoss(Task):
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

    metric_names = ("loss", "perplexity")

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        loss = float(outputs["loss_sum"].astype(np.float64).sum() / max(outputs["tokens"].sum(), 1.0))
        return {"loss": loss, "perplexity": perplexity(loss)}


class TokenClassification(TokenLoss):
    """Cross-entropy of every labelled token (``labels`` not negative: a word's first sub-token, as run_ner.py);
    the loss is the mean over them. ``predict`` gives each token's predicted label id where it is labelled (-100
    elsewhere); ``metrics`` the eval loss and seqeval's entity ``precision``, ``recall``, ``f1`` and token
    ``accuracy`` over the tag names ``labels`` (per entity type too with ``entity_level``)."""

    metric_names = ("loss", "precision", "recall", "f1", "accuracy")
    packed_outputs = True  # evaluation packs too: each example's logits gathered at its token_index

    def __init__(self, labels, entity_level: bool = False):
        self.labels, self.entity_level = list(labels), entity_level

    def _logits(self, model, batch, rngs=None):
        """``[batch, seq, labels]``; for packed evaluation rows, each example's ``[seq, labels]`` gathered at its
        ``token_index``, as its unpacked row would give them (padding columns: anything, never labelled)."""
        extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
        logits = model(batch["input_ids"], batch["attention_mask"], **extra, rngs=rngs)
        if "token_index" in batch:
            return logits.reshape(-1, logits.shape[-1])[batch["token_index"]]
        return logits

    def _scored(self, logits, batch):
        """(per-token losses, weights, labels), the labels cut to the logits' width (an evaluation batch
        trimmed to its length bucket: the positions cut are padding, never labelled)."""
        labels = batch["labels"][:, : logits.shape[1]]
        weights = (labels >= 0).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
        return losses * weights, weights, labels

    def _token_losses(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array]:
        losses, weights, _ = self._scored(self._logits(model, batch, rngs), batch)
        return losses, weights

    def _weights(self, batch) -> jax.Array:
        return (batch["labels"] >= 0).astype(jnp.float32)

    def predict(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        logits = self._logits(model, batch)
        losses, weights, labels = self._scored(logits, batch)
        prediction = jnp.where(labels >= 0, jnp.argmax(logits, axis=-1), -100)
        return {"loss_sum": losses.sum(-1), "tokens": weights.sum(-1), "prediction": prediction, "labels": labels}

    def tags(self, ids: np.ndarray, where: np.ndarray) -> list[list[str]]:
        """Each row's tag names at its positions ``where`` is true."""
        return [[self.labels[i] for i in row[keep]] for row, keep in zip(np.asarray(ids), np.asarray(where))]

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        loss = super().metrics(outputs)["loss"]
        scored = outputs["labels"] >= 0  # -100: not scored; -1: width padding between length buckets
        gold, predicted = self.tags(outputs["labels"], scored), self.tags(outputs["prediction"], scored)
        return {"loss": loss, **seqeval(gold, predicted, self.entity_level)}


class SpanExtraction(Task):
    """Extractive question answering: the mean of the start and end cross-entropies of each window (its
    ``start_positions`` and ``end_positions``, the [CLS] token where it holds no answer), as transformers'
    ``BertForQuestionAnswering``. ``predict`` gives each window's ``[seq, 2]`` start and end logits;
    ``metrics`` the eval loss and ``score(logits)``: the job's figures over the answers those logits give.
    Windows packed several to a row (training: ``pool_index`` at each one's first token) are each scored
    over their own tokens, positions counted from their first."""

    def __init__(self, score, metric_names: tuple[str, ...]):
        self.score, self.metric_names = score, ("loss", *metric_names)

    def _losses(self, model, batch, rngs=None):
        extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
        start, end = model(batch["input_ids"], batch["attention_mask"], **extra, rngs=rngs)
        starts, ends = batch["start_positions"], batch["end_positions"]
        if "pool_index" in batch:
            (start, end), starts, ends = _own_windows(
                (start, end), batch["attention_mask"], batch["pool_index"], starts, ends
            )
        ce = optax.softmax_cross_entropy_with_integer_labels
        losses = (ce(start, starts) + ce(end, ends)) / 2
        return losses, jnp.stack([start, end], axis=-1)

    def loss(self, model, batch: Mapping[str, jax.Array], rngs) -> jax.Array:
        return self._losses(model, batch, rngs)[0].mean()

    def predict(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        losses, logits = self._losses(model, batch)
        return {"prediction": logits, "loss": losses}

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        return {"loss": float(outputs["loss"].mean()), **self.score(outputs["prediction"])}


def _own_windows(logits, segments, pool_index, *positions):
    """Each packed window's ``[seq]`` logits (of each array of ``logits``, ``[rows, seq]``): its row's, with
    every position outside its own tokens at -inf (so a softmax is over its tokens alone; an unpacked row's
    also counts its padding, as transformers' does), and ``positions`` counted from its row's start."""
    row, first = jnp.divmod(pool_index, segments.shape[-1])
    own = segments[row] == segments[row, first][:, None]
    return tuple(jnp.where(own, x[row], -jnp.inf) for x in logits), *(first + p for p in positions)


AUTO_CHUNK = -1
"""``CausalLM(chunk_tokens=AUTO_CHUNK)``: chunks sized for the devices (``CausalLM.for_batch_shards``)."""
DEFAULT_CHUNK_TOKENS = 512
GPU_LOGITS_SHARE = 16
"""On a GPU the automatic loss keeps a device's float32 logits within 1/16 of its memory (5 GB of an H100's
80), whole when they fit: chunking costs time there (GPT-2 small, 16 x 1024 tokens on an H100: 44.5 ms a
step with whole logits, 49.1 in one checkpointed chunk, 54.0 in chunks of 4096 tokens, 67.2 of 512;
``bench/gpu.py``). TPUs and CPUs keep chunks of ``DEFAULT_CHUNK_TOKENS`` (the v5e plans' memory)."""


@dataclasses.dataclass
class CausalLMConfig:
    loss_chunk_tokens: int = arg(
        AUTO_CHUNK,
        "the causal-LM loss (training, evaluation, perplexity) makes the float32 logits of at most this many "
        "tokens per device at a time (rows per device x positions; at least one position): 512 is 103 MB per "
        "device for GPT-2's and GPT-J's ~50k-token vocabularies; 0: the whole batch's logits at once; -1 "
        "(auto): 512 on TPUs and CPUs, on GPUs whole when they take at most 1/16 of a device's memory, else "
        "chunks that do",
    )

    def __post_init__(self):
        if self.loss_chunk_tokens < AUTO_CHUNK:
            raise JaxseqError(f"--loss_chunk_tokens must be -1 (auto) or at least 0, got {self.loss_chunk_tokens}")

    def objective(self) -> CausalLM:
        return CausalLM(self.loss_chunk_tokens or None)


class CausalLM(TokenLoss):
    """Next-token cross-entropy: position t predicts token t+1 of ``input_ids`` (a target whose
    ``attention_mask`` is 0, if the batch has one, is left out).

    With ``chunk_tokens`` (and a model that has ``hidden_states`` and ``logits``: the decoders) the loss is
    computed from the final hidden states a chunk of positions at a time, each chunk's float32 logits made and
    dropped inside a ``jax.checkpoint``: neither the forward nor the backward pass (nor evaluation and
    perplexity, which share this path) holds the ``[tokens, vocab]`` logits of the whole batch at once. Each
    chunk keeps every row of the batch (and so its sharding over the devices) and as many positions as keep
    a device's part of it within ``chunk_tokens`` tokens (rows per device x positions; at least one
    position): a device holds at most ``chunk_tokens x vocab x 4`` bytes of logits at a time, whatever the
    batch size. The default, 512 tokens, is 103 MB of logits per device for GPT-2's 50257 tokens as for
    GPT-J's 50400 (0.8 GB for eight CPU devices sharing a host; the backward pass holds about two such
    arrays); a chunk of one 512-token row is also what the TPU plans in BENCHMARKS.md were compiled with.
    ``batch_shards``: how many devices the batch's rows are split over (the mesh's ``dp x fsdp``);
    ``TrainProgram`` sets it (``for_batch_shards``). Left at 1 the chunks are sized as if one device held
    the whole batch: smaller than needed, never larger. ``chunk_tokens=None``: the plain full-logits loss."""

    def __init__(
        self, chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, batch_shards: int = 1, logits_bytes: int | None = None
    ):
        if chunk_tokens is not None and chunk_tokens < 1 and chunk_tokens != AUTO_CHUNK:
            raise JaxseqError(f"the loss chunk must be at least 1 token per device, got {chunk_tokens}")
        if batch_shards < 1:
            raise JaxseqError(f"the batch must be split over at least 1 device, got {batch_shards}")
        self.chunk_tokens, self.batch_shards, self.logits_bytes = chunk_tokens, batch_shards, logits_bytes

    def for_batch_shards(self, batch_shards: int, device: jax.Device | None = None) -> CausalLM:
        """This loss for batches whose rows are split over ``batch_shards`` devices like ``device``; automatic
        chunks (``AUTO_CHUNK``) become a GPU's share of memory for logits (``GPU_LOGITS_SHARE``), elsewhere
        ``DEFAULT_CHUNK_TOKENS``."""
        if self.chunk_tokens != AUTO_CHUNK:
            return CausalLM(self.chunk_tokens, batch_shards)
        stats = (device.memory_stats() or {}) if device is not None and device.platform == "gpu" else {}
        if "bytes_limit" not in stats:
            return CausalLM(DEFAULT_CHUNK_TOKENS, batch_shards)
        return CausalLM(AUTO_CHUNK, batch_shards, logits_bytes=stats["bytes_limit"] // GPU_LOGITS_SHARE)

    def chunk_positions(self, rows: int, seq: int, chunk_tokens: int | None = None) -> int:
        """Positions per chunk of a ``[rows, seq]`` batch: the fewest equal chunks whose logits stay within
        ``chunk_tokens`` (default: this loss's) tokens per device (``rows / batch_shards`` rows each, rounded
        up), at least one position each; ``seq`` when one chunk does."""
        rows_per_device = -(-rows // self.batch_shards)
        widest = max(1, (chunk_tokens or self.chunk_tokens) // rows_per_device)
        chunks = -(-seq // widest)
        return -(-seq // chunks)

    def _chunk_tokens(self, rows: int, seq: int, vocab_size: int) -> int | None:
        """Tokens per device of a loss chunk for a ``[rows, seq]`` batch, or None for the whole logits."""
        if self.chunk_tokens != AUTO_CHUNK:
            return self.chunk_tokens
        if self.logits_bytes is None:  # never fitted to devices
            return DEFAULT_CHUNK_TOKENS
        fits = max(1, self.logits_bytes // (4 * padded_vocab_size(vocab_size)))
        return None if -(-rows // self.batch_shards) * seq <= fits else fits

    def loss(self, model, batch: Mapping[str, jax.Array], rngs) -> jax.Array:
        """The mean token loss plus the model's auxiliary loss, if it returns one (``LMOutput.aux_loss``)."""
        losses, weights, aux = self._scored(model, batch, rngs)
        return losses.sum() / jnp.maximum(weights.sum(), 1.0) + (0.0 if aux is None else aux)

    def _token_losses(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array]:
        return self._scored(model, batch, rngs)[:2]

    def _scored(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Per-token losses, weights and the model's auxiliary loss (None without one)."""
        ids = batch["input_ids"].astype(jnp.int32)  # the data may be stored as uint16
        mask, positions = batch.get("attention_mask"), batch.get("position_ids")
        targets = jnp.roll(ids, -1, axis=1)
        weights = self._weights(batch)
        chunk_tokens = self._chunk_tokens(*ids.shape, model.config.vocab_size)
        if chunk_tokens and hasattr(model, "hidden_states"):
            out = model.hidden_states(ids, mask, positions, rngs=rngs)
            shards = getattr(model, "sequence_shards", 1)  # each device's positions, with a cp mesh
            shards = 1 if ids.shape[1] % shards else shards  # a row padded to split evenly: chunks of the whole
            chunk = self.chunk_positions(ids.shape[0], ids.shape[1] // shards, chunk_tokens)
            losses = chunked_cross_entropy(
                model.logits, out.last_hidden_state, targets, chunk, model.config.vocab_size, shards=shards
            )
        else:
            out = model(ids, mask, positions, rngs=rngs)
            losses = optax.softmax_cross_entropy_with_integer_labels(out.logits, targets)
        return losses * weights, weights, getattr(out, "aux_loss", None)

    def _weights(self, batch) -> jax.Array:
        """1 where position t's next token is a target: a real token (``attention_mask`` not 0, as
        transformers' labels) and, with a ``loss_mask`` (chat: the assistant's tokens), one to learn; never
        the first token of the next example of a packed row (``attention_mask``: segment ids 1, 2, ...). The
        last position has no next token: it is scored against a wrapped-around target with weight 0, which
        spares slicing the logits (a copy of the step's largest array, and a pad in the backward)."""
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        learn = batch.get("loss_mask", mask)
        weights = jnp.ones(ids.shape, bool) if learn is None else (jnp.roll(learn, -1, axis=1) != 0)
        if mask is not None:
            weights = weights & ((mask == 0) | (jnp.roll(mask, -1, axis=1) == mask))
        return weights.astype(jnp.float32).at[:, -1].set(0.0)


def cross_entropy(logits: jax.Array, targets: jax.Array, classes: int | None = None) -> jax.Array:
    """``optax.softmax_cross_entropy_with_integer_labels`` over the first ``classes`` entries of the last
    axis (all of them if None): the padding of a padded vocabulary (``models.layers.padded_vocab_size``)
    gets no probability and no gradient. The masked logits cost one more chunk of logits in the compiled
    step (measured: 8 x 64 x 50304 float32, 103 MB per device; folding the mask into the reductions by hand
    cost more)."""
    if classes is not None and classes != logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < classes, logits, -jnp.inf)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def chunked_cross_entropy(
    head, h: jax.Array, targets: jax.Array, chunk_size: int, classes: int | None = None, shards: int = 1
) -> jax.Array:
    """``cross_entropy(head(h), targets, classes)``, ``[batch, seq]``, computed ``chunk_size`` positions (of
    every row) at a time, the sequence padded up to whole chunks: ``head`` maps hidden states
    ``[batch, chunk, hidden]`` to float32 logits. Each chunk is a ``jax.checkpoint``, so the backward pass
    recomputes one chunk's logits at a time instead of keeping them all. ``shards``: the sequence is split
    over that many devices (cp); a chunk takes ``chunk_size`` positions of each device's share."""
    batch, seq = targets.shape

    @jax.checkpoint
    def chunk_losses(h, targets):
        return cross_entropy(head(h), targets, classes)

    if seq <= chunk_size * shards:
        return chunk_losses(h, targets)
    if shards > 1:  # [chunks, batch, shards, chunk_size, ...]: every chunk keeps every row and every shard
        width = seq // shards
        chunks = -(-width // chunk_size)
        pad = chunks * chunk_size - width

        def chunked(x):
            x = x.reshape(batch, shards, width, *x.shape[2:])
            x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), *((0, 0),) * (x.ndim - 3)))
            return jnp.moveaxis(x.reshape(batch, shards, chunks, chunk_size, *x.shape[3:]), 2, 0)

        losses = jax.lax.map(lambda xs: chunk_losses(*xs), (chunked(h), chunked(targets)))
        return jnp.moveaxis(losses, 0, 2).reshape(batch, shards, -1)[:, :, :width].reshape(batch, seq)
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
    ``tokenizer`` and ``max_new_tokens`` > 0, evaluation also generates (greedy, or beam search with
    ``num_beams`` > 1) and scores the text (``text_metrics``)."""

    def __init__(
        self,
        tokenizer=None,
        max_new_tokens: int = 0,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ):
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        self.search = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping)
        if tokenizer is not None and max_new_tokens > 0:
            self.metric_names = (*TokenLoss.metric_names, "exact_match", *ROUGE_KEYS, "gen_len")

    def _token_losses(self, model, batch, rngs=None) -> tuple[jax.Array, jax.Array]:
        labels = batch["labels"]
        logits = model(batch["input_ids"], batch["attention_mask"], model.decoder_inputs(labels), rngs=rngs).logits
        weights = self._weights(batch)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels) * weights, weights

    def _weights(self, batch) -> jax.Array:
        return batch["decoder_attention_mask"].astype(jnp.float32)

    def predict(self, model, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        outputs = super().predict(model, batch)
        if self.tokenizer is not None and self.max_new_tokens > 0:
            outputs["prediction"] = search_tokens(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                max_new_tokens=self.max_new_tokens,
                eos_token_id=model.config.eos_token_id,
                pad_token_id=model.config.pad_token_id,
                **self.search,
            )
            outputs["references"] = jnp.where(batch["decoder_attention_mask"] > 0, batch["labels"], -1)
        return outputs

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        results = super().metrics(outputs)
        if "prediction" in outputs:
            results.update(self.text_metrics(outputs["prediction"], outputs["references"]))
        return results

    def text_metrics(self, generated: np.ndarray, references: np.ndarray) -> dict[str, float]:
        """``exact_match`` (stripped texts equal), ROUGE (``metrics.rouge``) and ``gen_len`` (tokens generated
        that are not padding, EOS included, as run_summarization counts them) of token rows (negative: none)."""
        predictions, truths = self.decode(generated), self.decode(references)
        lengths = np.sum((generated >= 0) & (generated != self.tokenizer.pad_token_id), axis=1)
        return {
            "exact_match": float(np.mean([p == r for p, r in zip(predictions, truths)])),
            **rouge(predictions, truths),
            "gen_len": float(np.mean(lengths)),
        }

    def decode(self, ids: np.ndarray) -> list[str]:
        """Texts of token rows; negative ids (no token: masked or bucket padding) are dropped."""
        rows = [[int(t) for t in row if t >= 0] for row in np.asarray(ids)]
        return [text.strip() for text in self.tokenizer.batch_decode(rows, skip_special_tokens=True)]
