"""What the families really share: attention masks, the attention kernel and the KV cache.

Shapes follow ``jax.nn.dot_product_attention``: queries ``[batch, q_len, heads, head_dim]``, keys and
values ``[batch, kv_len, heads, head_dim]``, masks ``[batch, 1, q_len, kv_len]`` (True = attend).

The KV cache is a plain pytree of fixed shapes, so it can be carried through ``lax.while_loop``:
``Cache(layers=(KVCache(k, v), ...), index)`` where ``k``/``v`` are ``[batch, heads, max_len, head_dim]``
(heads before positions, so the attention dots read the whole cache without transposing it every step;
``attend_cache`` is the attention over it) and ``index`` is the int32 position the next token is written
to. With a cache, the attention mask the caller passes covers all ``max_len`` key positions (1 for real
tokens written so far or about to be).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseq.models.layers import call_block, dropout


class KVCache(NamedTuple):
    """Keys and values of one attention layer, ``[batch, heads, max_len, head_dim]``."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, batch: int, max_len: int, heads: int, head_dim: int, dtype) -> KVCache:
        shape = (batch, heads, max_len, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @classmethod
    def of(cls, k: jax.Array, v: jax.Array, dtype=None) -> KVCache:
        """A cache holding keys/values given as ``[batch, len, heads, head_dim]`` (T5's cross-attention)."""
        return cls(*(jnp.swapaxes(t, 1, 2).astype(dtype or t.dtype) for t in (k, v)))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


class Cache(NamedTuple):
    """A decoder's cache: one ``KVCache`` per self-attention layer, the write position, and for
    encoder-decoder models the cross-attention keys/values computed once from the encoder output."""

    layers: tuple[KVCache, ...]
    index: jax.Array
    cross: tuple[KVCache, ...] | None = None

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, heads: int, head_dim: int, dtype) -> Cache:
        layer = KVCache.zeros(batch, max_len, heads, head_dim, dtype)
        return cls(tuple(layer for _ in range(num_layers)), jnp.zeros((), jnp.int32))


def run_blocks(blocks, remat: str, x, mask, *args, cache: Cache | None, rngs):
    """Run decoder blocks in order, each reading and writing its own layer of ``cache`` (if given) at the
    cache's index; returns the output and the cache advanced past ``x``'s positions."""
    index = 0 if cache is None else cache.index
    layers = []
    for i, block in enumerate(blocks):
        x, layer = call_block(
            block, remat, x, mask, *args, cache=None if cache is None else cache.layers[i], index=index, rngs=rngs
        )
        layers.append(layer)
    if cache is not None:
        cache = cache._replace(layers=tuple(layers), index=cache.index + x.shape[1])
    return x, cache


def update_kv(cache: KVCache, k: jax.Array, v: jax.Array, index: jax.Array) -> KVCache:
    """Write ``k``/``v`` (``[batch, t, heads, dim]``) into the cache at sequence position ``index``."""
    new = KVCache.of(k, v, cache.k.dtype)
    start = (0, 0, index, 0)
    return KVCache(
        jax.lax.dynamic_update_slice(cache.k, new.k, start),
        jax.lax.dynamic_update_slice(cache.v, new.v, start),
    )


def query_positions(q_len: int, index: jax.Array | int = 0) -> jax.Array:
    """Absolute positions of the queries of this call: ``index .. index + q_len - 1``."""
    return index + jnp.arange(q_len, dtype=jnp.int32)


def make_mask(
    key_mask: jax.Array | None,
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    index: jax.Array | int = 0,
    cross: bool = False,
) -> jax.Array:
    """Boolean ``[batch or 1, 1, q_len, kv_len]`` mask from a ``[batch, kv_len]`` padding mask and, if
    ``causal``, the rule key position <= query position.

    The padding mask holds segment ids: 0 for padding, 1 for a row's tokens, and 1, 2, ... when several
    examples are packed into one row (``jaxseq.data.packing``). In self-attention without a cache
    (``q_len == kv_len``, not ``cross``) a query attends only to keys of its own segment; a padding query
    attends to every real key (its output is discarded; a fully masked row would only make NaNs). None
    means no padding. ``cross``: the keys are another sequence's (encoder-decoder attention)."""
    mask = jnp.ones((1, 1, q_len, kv_len), dtype=bool)
    if key_mask is not None:
        keys = key_mask[:, None, None, :]
        mask = mask & (keys != 0)
        if q_len == kv_len and not cross:
            queries = key_mask[:, None, :, None]
            mask = mask & ((queries == keys) | (queries == 0))
    if causal:
        q_pos = query_positions(q_len, index)
        k_pos = jnp.arange(kv_len, dtype=jnp.int32)
        mask = mask & (k_pos[None, :] <= q_pos[:, None])[None, None]
    return mask


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    *,
    bias: jax.Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    rngs: nnx.Rngs | None = None,
) -> jax.Array:
    """Scaled dot-product attention. Without attention dropout this is ``jax.nn.dot_product_attention``
    (cuDNN flash attention on GPUs); with it, the same math written out so the probabilities can drop."""
    # XLA:CPU has no float16 x float16 -> float32 dot, which jax.nn.dot_product_attention asks for
    cpu_half = q.dtype == jnp.float16 and jax.default_backend() == "cpu"
    if (rngs is None or dropout_rate == 0.0) and not cpu_half:
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    probs = dropout(probs, dropout_rate, rngs)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def attend_cache(
    q: jax.Array, cache: KVCache, mask: jax.Array | None, *, bias: jax.Array | None = None, scale: float | None = None
) -> jax.Array:
    """``attend`` (without dropout: caches serve inference) over the keys/values of ``cache``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = cache.k.astype(q.dtype), cache.v.astype(q.dtype)
    logits = jnp.einsum("bqhd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bhkd->bqhd", probs, v)


def split_heads(x: jax.Array, heads: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def merge_heads(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
