"""The arithmetic of model FLOPs, shared by every family's count (``Family.flops``, declared in the family's
folder): the FLOPs a model's mathematics needs, from its config alone (no model is built), as MFU counts them
(PaLM appendix B; MaxText's ``calculate_tflops_training_per_device``). Only matrix products count: a
multiply-add is 2 FLOPs forward, and training's backward pass costs twice the forward (the gradients of both
operands), so a weight that meets a token costs 6 FLOPs in training and 2 in a forward pass. Embedding lookups,
biases, norms, activations and softmax are left out. Attention's two products (scores ``QK^T`` and mixing
``AV``) cost ``2 x width`` multiply-adds per (query, key) pair; causal attention counts the lower triangle once
(half the square), a sliding window only the keys it sees."""

from __future__ import annotations

TRAINING, FORWARD = 3.0, 1.0  # passes worth of a forward's FLOPs: forward + backward (2x), or forward only


def passes(training: bool) -> float:
    return TRAINING if training else FORWARD


def dense(weights: int, tokens: int, *, training: bool = True) -> float:
    """FLOPs of ``tokens`` tokens each multiplied by ``weights`` matrix weights (2 per multiply-add)."""
    return 2.0 * passes(training) * weights * tokens


def attention(
    layers: int,
    width: int,
    queries: int,
    keys: int,
    *,
    rows: int,
    causal: bool,
    window: int | None = None,
    training: bool = True,
) -> float:
    """FLOPs of the ``QK^T`` and ``AV`` products of ``layers`` attention layers over ``rows`` rows, each of
    ``queries`` queries over ``keys`` keys; ``width``: the queries' heads x head_dim (grouped-query attention
    shares keys, not products). ``causal`` (self-attention: ``queries == keys``): each query sees the keys up
    to its own position, the lower triangle (``keys**2 / 2`` pairs); with a ``window``, the latest ``window``
    keys (``keys * window - window**2 / 2`` pairs, the triangle again when the window covers the row)."""
    pairs = float(queries) * keys
    if causal:
        w = min(window or keys, keys)
        pairs = keys * w - w * w / 2
    return 2.0 * 2.0 * passes(training) * layers * width * pairs * rows


def head(config, task: str, hidden: int, *, rows: int, tokens: int, training: bool = True) -> float:
    """A decoder's task head: the projection onto the vocabulary at every token (``causal-lm``, tied to the
    embeddings or not: the product is the same) or a classifier over ``num_labels`` at one token per row
    (``sequence-classification``, the last token's) or at every token (``token-classification``); the bare
    model (``base``) has none."""
    if task == "causal-lm":
        return dense(hidden * config.vocab_size, tokens, training=training)
    if task == "sequence-classification":
        return dense(hidden * config.num_labels, rows, training=training)
    if task == "token-classification":
        return dense(hidden * config.num_labels, tokens, training=training)
    return 0.0
