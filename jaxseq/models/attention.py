"""What the families really share: attention masks, the attention kernels and the KV cache.

Shapes follow ``jax.nn.dot_product_attention``: queries ``[batch, q_len, heads, head_dim]``, keys and
values ``[batch, kv_len, kv_heads, head_dim]``, masks ``[batch, 1, q_len, kv_len]`` (True = attend). With
grouped-query attention (Llama, Mistral, Qwen2) ``kv_heads`` divides ``heads`` and query head ``h`` reads
key/value head ``h // (heads // kv_heads)``; the other families have ``kv_heads == heads``.

Kernels (``ATTENTION_KERNELS``, chosen per run by ``choose_kernel``; each attention layer takes
``execution.Execution.attention`` when it is built): ``xla`` (XLA's own attention: the
``[batch, heads, q, kv]`` scores in memory), ``splash`` (the Pallas TPU splash attention kernel shipped with
JAX: blockwise, the scores never stored; causal, padding and packed examples as segment ids) and ``cudnn``
(cuDNN's fused attention on NVIDIA GPUs). ``auto`` takes the fused kernel of the backend where it applies.

The KV cache is a plain pytree of fixed shapes, so it can be carried through ``lax.while_loop``:
``Cache(layers=(KVCache(k, v), ...), index)`` where ``k``/``v`` are ``[batch, kv_heads, max_len, head_dim]``
(a scanned stack's, ``layers.Stacked``: one ``KVCache`` of ``[layers, batch, kv_heads, max_len, head_dim]``; a
grouped one's, ``layers.Grouped``: one such stack for each place in its groups, then one per layer past them)
(heads before positions, so the attention dots read the whole cache without transposing it every step;
``attend_cache`` is the attention over it) and ``index`` is the int32 position the next token is written
to. With a cache, the attention mask the caller passes covers all ``max_len`` key positions (1 for real
tokens written so far or about to be). A layer with a sliding window keeps a rolling cache of its window
instead (``ring_positions``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.errors import JaxseqError
from jaxseq.mesh import BATCH_AXES, data_parallel_size, mesh_platform
from jaxseq.models.execution import AttentionKernel
from jaxseq.models.layers import DrawnMasks, Grouped, Stacked, dropout, kept

logger = logging.getLogger("jaxseq")

ATTENTION_KERNELS = ("auto", "splash", "cudnn", "xla")
SPLASH_BLOCK = 128  # splash attention's tiles are multiples of 128 positions (TPU lanes)


@struct.dataclass
class AttentionMask:
    """A self-attention mask both ways: ``dense`` ``[batch or 1, 1, q_len, kv_len]`` booleans (the XLA
    kernel's) and the ``[batch, seq]`` padding mask / segment ids it was made from (the fused kernels'),
    None where there is none or the attention is not self-attention over the same positions; ``window``: a
    causal sliding window (a query sees the ``window`` latest positions, itself included; Mistral's), which
    ``dense`` already holds and the fused kernels build themselves. ``window`` is static (part of the
    pytree's structure), so it survives ``jit`` and ``remat`` as the Python int the kernels need. ``split``
    (static): the sequence is split over the context mesh (``split_sequence``), ``segments`` in its balanced
    order and ``dense`` None; attention runs ``context_attention``."""

    dense: jax.Array | None
    segments: jax.Array | None = None
    window: int | None = struct.field(pytree_node=False, default=None)
    split: bool = struct.field(pytree_node=False, default=False)


class KVCache(NamedTuple):
    """Keys and values of one attention layer, ``[batch, kv_heads, max_len, head_dim]`` (of a scanned stack's
    layers: ``[layers, batch, ...]``)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, batch: int, max_len: int, heads: int, head_dim: int, dtype, layers: tuple[int, ...] = ()) -> KVCache:
        shape = (*layers, batch, heads, max_len, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @classmethod
    def of(cls, k: jax.Array, v: jax.Array, dtype=None) -> KVCache:
        """A cache holding keys/values given as ``[batch, len, heads, head_dim]`` (T5's cross-attention)."""
        return cls(*(jnp.swapaxes(t, 1, 2).astype(dtype or t.dtype) for t in (k, v)))

    @property
    def max_len(self) -> int:
        return self.k.shape[-2]


class Cache(NamedTuple):
    """A decoder's cache: one ``KVCache`` per self-attention layer (a scanned stack's: one, stacked), the write
    position, and for encoder-decoder models the cross-attention keys/values computed once from the encoder
    output."""

    layers: tuple[KVCache, ...] | KVCache
    index: jax.Array
    cross: tuple[KVCache, ...] | None = None

    @classmethod
    def zeros(
        cls, num_layers: int, batch: int, max_len: int, heads: int, head_dim: int, dtype, *, stacked: bool = False
    ) -> Cache:
        if stacked:
            return cls(KVCache.zeros(batch, max_len, heads, head_dim, dtype, (num_layers,)), jnp.zeros((), jnp.int32))
        layer = KVCache.zeros(batch, max_len, heads, head_dim, dtype)
        return cls(tuple(layer for _ in range(num_layers)), jnp.zeros((), jnp.int32))

    def max_len(self, layer: int = 0) -> int:
        """The key/value positions that layer ``layer`` holds (of a grouped stack, ``layers.Grouped``: a layer of
        its first group)."""
        return (self.layers if isinstance(self.layers, KVCache) else self.layers[layer]).max_len


def run_blocks(blocks, remat: str, x, mask, *args, cache: Cache | None, rngs, **kwargs):
    """Run decoder blocks in order (``layers.Unrolled``, or a scanned ``Stacked`` or ``Grouped`` one), each reading
    and writing its own layer of ``cache`` (if given) at the cache's index, and reading its own cross-attention
    keys/values (``cache.cross``, as ``cross=``); returns the output and the cache advanced past ``x``'s positions, or
    without a cache what the blocks return beside their outputs (MoE layers' router statistics), None if nothing."""
    index = 0 if cache is None else cache.index
    own = {} if cache is None else {"cache": cache.layers, "cross": cache.cross}
    own = {name: value for name, value in own.items() if value is not None}
    if isinstance(blocks, (Stacked, Grouped)):
        x, layers = blocks(remat, x, mask, *args, per_layer=own, index=index, rngs=rngs, **kwargs)
    else:
        layers = []
        for i in range(len(blocks)):
            layer = {name: value[i] for name, value in own.items()}
            x, layer = blocks.call(i, remat, x, mask, *args, index=index, rngs=rngs, **layer, **kwargs)
            layers.append(layer)
        layers = tuple(layers)
    if cache is None:
        return x, layers if jax.tree.leaves(layers) else None
    return x, cache._replace(layers=layers, index=cache.index + x.shape[1])


def update_kv(cache: KVCache, k: jax.Array, v: jax.Array, index: jax.Array) -> KVCache:
    """Write ``k``/``v`` (``[batch, t, heads, dim]``) into the cache at sequence position ``index``: one for
    every row, or ``[batch]``, each row's own (``jaxseq.engine``'s slots)."""
    new = KVCache.of(k, v, cache.k.dtype)
    if jnp.ndim(index) == 1:
        put = jax.vmap(lambda old, rows, at: jax.lax.dynamic_update_slice(old, rows, (0, at, 0)))
        return KVCache(put(cache.k, new.k, index), put(cache.v, new.v, index))
    start = (0, 0, index, 0)
    return KVCache(
        jax.lax.dynamic_update_slice(cache.k, new.k, start),
        jax.lax.dynamic_update_slice(cache.v, new.v, start),
    )


def query_positions(q_len: int, index: jax.Array | int = 0) -> jax.Array:
    """Absolute positions of the queries of this call: ``index .. index + q_len - 1`` (``[q_len]``; a
    ``[batch]`` ``index``, each row's own: ``[batch, q_len]``)."""
    return jnp.asarray(index, jnp.int32)[..., None] + jnp.arange(q_len, dtype=jnp.int32)


def make_mask(
    key_mask: jax.Array | None,
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    index: jax.Array | int = 0,
    cross: bool = False,
    window: int | None = None,
) -> jax.Array:
    """Boolean ``[batch or 1, 1, q_len, kv_len]`` mask from a ``[batch, kv_len]`` padding mask and, if
    ``causal``, the rule key position <= query position (and, with a sliding ``window``, > query position
    - ``window``, as transformers' ``sliding_window_overlay``: positions are cache slots, so left padding
    shifts queries and keys alike).

    The padding mask holds segment ids: 0 for padding, 1 for a row's tokens, and 1, 2, ... when several
    examples are packed into one row (``jaxseq.data.packing``). In self-attention without a cache
    (``q_len == kv_len``, not ``cross``) a query attends only to keys of its own segment; a padding query
    attends to every real key (its output is discarded; a fully masked row would only make NaNs). None
    means no padding. ``cross``: the keys are another sequence's (encoder-decoder attention). ``index``: the
    cache position of the first query, one for every row or ``[batch]``, each row's own."""
    mask = jnp.ones((1, 1, q_len, kv_len), dtype=bool)
    if key_mask is not None:
        keys = key_mask[:, None, None, :]
        mask = mask & (keys != 0)
        if q_len == kv_len and not cross:
            queries = key_mask[:, None, :, None]
            mask = mask & ((queries == keys) | (queries == 0))
    if causal:
        q_pos = query_positions(q_len, index)[..., None]
        k_pos = jnp.arange(kv_len, dtype=jnp.int32)
        seen = k_pos <= q_pos
        if window is not None:
            seen = seen & (k_pos > q_pos - window)
        mask = mask & (seen[None, None] if seen.ndim == 2 else seen[:, None])  # an index per row: [batch, ...]
    return mask


def self_attention_mask(key_mask: jax.Array | None, seq: int, *, causal: bool, window=None) -> AttentionMask:
    """``make_mask`` of a self-attention without a cache, keeping the padding mask / segment ids too."""
    return AttentionMask(make_mask(key_mask, seq, seq, causal=causal, window=window), key_mask, window)


def decoder_mask(key_mask: jax.Array | None, seq: int, cache: Cache | None, index) -> AttentionMask | jax.Array:
    """A causal decoder's mask for ``seq`` new positions: its self-attention mask without a cache, else the
    dense mask over the cache's ``max_len`` positions with queries from ``index``."""
    if cache is None:
        return self_attention_mask(key_mask, seq, causal=True)
    return make_mask(key_mask, seq, cache.max_len(), causal=True, index=index)


# --------------------------------------------------------------------------- the rolling cache of a sliding window
# A layer that attends over a sliding window of W positions keeps only the last W keys/values: a KVCache of length
# L = min(W, max_len) whose slot s holds the latest position p = s (mod L) written so far. A call with t new
# positions from ``index`` attends over the L slots as they were plus its own t keys (so a long prompt's early
# queries still see keys that its later positions overwrite), then writes its last min(t, L) keys into their slots.


def ring_positions(index: jax.Array | int, length: int) -> jax.Array:
    """The position each of a rolling cache's ``length`` slots holds before a write at ``index`` (negative:
    empty): ``[length]``, or ``[batch, length]`` for an index per row."""
    slots = jnp.arange(length, dtype=jnp.int32)
    last = jnp.asarray(index, jnp.int32)[..., None] - 1
    return last - jnp.mod(last - slots, length)


def ring_mask(key_mask: jax.Array | None, seq: int, length: int, index, window: int) -> AttentionMask:
    """The mask of ``seq`` queries from ``index`` over a rolling cache's ``length`` slots followed by their own
    ``seq`` keys (``attend_ring``): a key is seen if it is written, real in ``key_mask`` (which covers every
    position, as with a plain cache), and among the ``window`` latest positions up to the query's."""
    k_pos = jnp.concatenate([ring_positions(index, length), query_positions(seq, index)], axis=-1)
    q_pos = query_positions(seq, index)[..., None]
    keys = k_pos[..., None, :]
    seen = (keys >= 0) & (keys <= q_pos) & (keys > q_pos - window)
    mask = seen[None, None] if seen.ndim == 2 else seen[:, None]  # an index per row: [batch, ...]
    if key_mask is not None:
        at = jnp.clip(k_pos, 0, key_mask.shape[1] - 1)
        real = (jnp.take(key_mask, at, axis=1) if at.ndim == 1 else jnp.take_along_axis(key_mask, at, axis=1)) != 0
        mask = mask & real[:, None, None, :]
    return AttentionMask(mask, None, window)


def attend_ring(
    q: jax.Array,
    cache: KVCache,
    k: jax.Array,
    v: jax.Array,
    mask,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention (XLA, no dropout) of ``q`` over a rolling cache's slots, before this call's write, and the call's
    own keys/values ``k``/``v`` (``[batch, t, kv_heads, dim]``); ``mask`` from ``ring_mask``."""
    new = KVCache.of(k, v, q.dtype)
    k, v = (jnp.concatenate([old.astype(q.dtype), t], axis=2) for old, t in zip(cache, new))
    return _written_out(q, k, v, "bhkd", mask.dense, None, scale, 0.0, None, softcap, sinks)


def update_ring(cache: KVCache, k: jax.Array, v: jax.Array, index) -> KVCache:
    """Write the last ``min(t, length)`` of ``t`` new keys/values (``[batch, t, heads, dim]``, positions from
    ``index``, one for every row or ``[batch]``) into their slots of a rolling cache (distinct slots, so the
    scatter has no duplicates)."""
    length, t = cache.max_len, k.shape[1]
    kept = min(t, length)
    new = KVCache.of(k[:, t - kept :], v[:, t - kept :], cache.k.dtype)
    slots = jnp.mod(jnp.asarray(index, jnp.int32)[..., None] + t - kept + jnp.arange(kept, dtype=jnp.int32), length)
    if slots.ndim == 2:  # each row its own slots
        put = jax.vmap(lambda old, n, s: old.at[:, s].set(n))
        return KVCache(*(put(old, n, slots) for old, n in zip(cache, new)))
    return KVCache(*(old.at[:, :, slots].set(n) for old, n in zip(cache, new)))


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask | jax.Array | None,
    *,
    bias: jax.Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    rngs: nnx.Rngs | None = None,
    kernel: AttentionKernel = AttentionKernel(),
    causal: bool = False,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Scaled dot-product attention with ``kernel`` (``causal``: the mask is causal, which the fused
    kernels build themselves, with its sliding window if it has one). XLA: ``jax.nn.dot_product_attention``;
    with attention dropout, a ``softcap`` (scores ``softcap * tanh(scores / softcap)`` before the mask,
    Gemma 2's) or ``sinks`` (``[heads]`` logits in each softmax's denominator, gpt-oss's; both XLA only, see
    ``choose_kernel``), the same math written out."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if isinstance(mask, AttentionMask) and mask.split:
        if bias is not None or (rngs is not None and dropout_rate > 0.0):
            raise JaxseqError("a sequence split over cp attends without attention dropout or biases; use cp=1")
        return context_attention(q, k, v, mask, scale=scale, causal=causal, softcap=softcap, sinks=sinks, kernel=kernel)
    segments = mask.segments if isinstance(mask, AttentionMask) else None
    window = mask.window if isinstance(mask, AttentionMask) else None
    mask = mask.dense if isinstance(mask, AttentionMask) else mask
    plain = softcap is None and sinks is None
    fused = kernel.name != "xla" and bias is None and plain and (rngs is None or dropout_rate == 0.0)
    if fused and kernel.name == "splash" and _splash_fits(q, k, kernel):
        return splash_attention(q, k, v, segments, scale=scale, causal=causal, window=window, kernel=kernel)
    if fused and kernel.name == "cudnn":  # right-padded rows (choose_kernel refuses packed ones): key lengths
        lengths = None if segments is None else jnp.sum(segments != 0, axis=-1).astype(jnp.int32)
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, key_value_seq_lengths=lengths,
            local_window_size=None if window is None else (window - 1, 0), implementation="cudnn",
        )  # fmt: skip
    # XLA:CPU has no float16 x float16 -> float32 dot, which jax.nn.dot_product_attention asks for
    cpu_half = q.dtype == jnp.float16 and jax.default_backend() == "cpu"
    if (rngs is None or dropout_rate == 0.0) and not cpu_half and plain:
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale)
    return _written_out(q, k, v, "bkhd", mask, bias, scale, dropout_rate, rngs, softcap, sinks)


def take_positions(x: jax.Array, positions: jax.Array) -> jax.Array:
    """The rows ``[len(positions), d]`` of ``x`` ``[batch, seq, d]`` at flat positions ``row * seq + column``."""
    return x.reshape(-1, x.shape[-1])[positions]


def attend_at(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask | jax.Array | None,
    positions: jax.Array,
    *,
    dropout_rate: float = 0.0,
    rngs: nnx.Rngs | None = None,
) -> jax.Array:
    """``attend`` for the queries at flat ``positions`` alone (``row * seq + column``): ``q`` ``[n, heads, dim]``
    (theirs), ``k``/``v`` ``[batch, seq, heads, dim]`` (all), the mask as ``attend`` takes it; returns
    ``[n, heads, dim]``, what ``attend`` gives at those positions. With XLA: one query per example."""
    seq = k.shape[1]
    rows, columns = positions // seq, positions % seq
    dense = mask.dense if isinstance(mask, AttentionMask) else mask
    if dense is not None:  # [batch or 1, 1, q_len, kv_len] -> each query's own row of it, [n, 1, 1, kv_len]
        dense = dense[rows if dense.shape[0] > 1 else jnp.zeros_like(rows), :, columns][:, :, None, :]
    y = attend(q[:, None], k[rows], v[rows], dense, dropout_rate=dropout_rate, rngs=rngs)
    return y[:, 0]


def attend_cache(
    q: jax.Array,
    cache: KVCache,
    mask: jax.Array | None,
    *,
    bias: jax.Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``attend`` (without dropout: caches serve inference) over the keys/values of ``cache``, with XLA."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = mask.dense if isinstance(mask, AttentionMask) else mask
    k, v = cache.k.astype(q.dtype), cache.v.astype(q.dtype)
    return _written_out(q, k, v, "bhkd", mask, bias, scale, 0.0, None, softcap, sinks)


def _written_out(q, k, v, kv_layout: str, mask, bias, scale, dropout_rate, rngs, softcap=None, sinks=None) -> jax.Array:
    """Attention as plain einsums, float32 scores: queries ``[batch, q_len, heads, dim]``, keys/values in
    ``kv_layout`` (``bkhd``: ``[batch, kv_len, kv_heads, dim]``; ``bhkd``: a cache's). Query heads are grouped
    by the key/value head they read, so grouped-query keys are never repeated in memory; without groups the
    dots give the ``[batch, heads, q, kv]`` scores directly and the output ``[batch, heads, q, dim]`` (the
    grouped form's reshape, and an output with its heads in place, made XLA:CPU transpose the scores or run
    the product in the slow order: QA's MiniLM step about 20% more work). ``sinks``: see ``_sink_softmax``."""
    shape = _Shape(q.shape, k.shape[kv_layout.index("h")], kv_layout, scale, softcap)
    if isinstance(rngs, DrawnMasks) and dropout_rate > 0.0 and sinks is None:
        keep = rngs.take(shape.scores(k.shape[kv_layout.index("k")]), dropout_rate)
        return _attention_drawn(shape, dropout_rate, q, k, v, bias, mask, keep)
    chunks = q.shape[1] // QUERY_CHUNK
    if chunks > 1 and q.shape[1] % QUERY_CHUNK == 0 and bias is None and (rngs is None or dropout_rate == 0.0):
        return _in_query_chunks(q, k, v, kv_layout, mask, scale, softcap, sinks, chunks)
    logits = _scores(shape, q, k, bias, mask)
    if sinks is None:
        probs = _softmax_dropout(logits, dropout_rate, rngs).astype(v.dtype)
    else:
        probs = dropout(_sink_softmax(logits, sinks), dropout_rate, rngs).astype(v.dtype)
    return shape.output(jnp.einsum(shape.product, shape.group(probs), v))


QUERY_CHUNK = 1024
"""``_written_out`` attends with the queries of a longer row (no dropout, no bias) this many at a time, each chunk's
scores recomputed in the backward pass: ``[batch, heads, QUERY_CHUNK, kv]`` float32 scores live at once instead of
``[batch, heads, q, kv]`` (gpt-oss-20B's 64 heads at 4096 tokens: 1 GiB instead of 4), the same numbers."""


def _in_query_chunks(q, k, v, kv_layout: str, mask, scale, softcap, sinks, chunks: int) -> jax.Array:
    """``_written_out`` of ``chunks`` equal runs of queries one after another (``lax.map``), each rematerialised."""

    def split(x, axis):  # the query axis cut into [chunks, ...] in front
        x = x.reshape(*x.shape[:axis], chunks, x.shape[axis] // chunks, *x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    whole = mask is None or mask.shape[2] == 1  # one mask row for every query: every chunk reads it whole

    @jax.checkpoint
    def one(part):
        q, mask_part = part
        return _written_out(q, k, v, kv_layout, mask if whole else mask_part, None, scale, 0.0, None, softcap, sinks)

    out = jax.lax.map(one, (split(q, 1), None if whole else split(mask, 2)))
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The static layout of one ``_written_out`` attention (hashable: ``_attention_drawn``'s static argument)."""

    q: tuple[int, ...]  # [batch, q_len, heads, dim]
    kv_heads: int
    kv_layout: str
    scale: float
    softcap: float | None

    @property
    def grouped(self) -> bool:
        return self.kv_heads != self.q[2]

    @property
    def product(self) -> str:
        """The einsum of the (grouped) probabilities with the values."""
        return f"bhgqk,{self.kv_layout}->bhgqd" if self.grouped else f"bhqk,{self.kv_layout}->bhqd"

    def scores(self, kv_len: int) -> tuple[int, ...]:
        return (self.q[0], self.q[2], self.q[1], kv_len)

    def group(self, x: jax.Array) -> jax.Array:
        """``[batch, heads, q, kv]`` -> grouped by key/value head, as ``product`` reads them."""
        batch, heads, q_len, kv_len = x.shape
        return x.reshape(batch, self.kv_heads, heads // self.kv_heads, q_len, kv_len) if self.grouped else x

    def output(self, out: jax.Array) -> jax.Array:
        """``product``'s result -> ``[batch, q_len, heads, dim]``."""
        return jnp.moveaxis(out, -2, 1).reshape(self.q)


def _scores(shape: _Shape, q, k, bias, mask) -> jax.Array:
    """The float32 ``[batch, heads, q, kv]`` attention logits: scaled, soft-capped, biased, masked."""
    batch, q_len, heads, dim = shape.q
    if shape.grouped:
        q = q.reshape(batch, q_len, shape.kv_heads, heads // shape.kv_heads, dim)
    spec = f"bqhgd,{shape.kv_layout}->bhgqk" if shape.grouped else f"bqhd,{shape.kv_layout}->bhqk"
    logits = jnp.einsum(spec, q, k, preferred_element_type=jnp.float32) * shape.scale
    logits = logits.reshape(batch, heads, q_len, -1)
    if shape.softcap is not None:
        logits = jnp.tanh(logits / shape.softcap) * shape.softcap
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return logits


def _sink_softmax(logits: jax.Array, sinks: jax.Array) -> jax.Array:
    """The float32 softmax of ``[batch, heads, q, kv]`` logits with each head's sink logit (``sinks``
    ``[heads]``, gpt-oss's) as one more key in the denominator, which takes its share of the probability and
    then is dropped (transformers' ``eager_attention_forward``): a query may attend to almost nothing."""
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (*logits.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]


def _softmax_dropout(logits: jax.Array, rate: float, rngs: nnx.Rngs | None) -> jax.Array:
    """``dropout(softmax(logits))`` (float32), the bits drawn here (in the loop of a scanned stack: TPU, GPU):
    the dropped scores are zeroed before they are normalised, the same numbers in the form XLA:TPU keeps in
    one fusion with the random bits. Dropping the probabilities after the softmax made it materialise every
    broadcast constant of the Threefry hash at the scores' full size (about 30 of them: 12.6 GiB per chip for
    one GPT-2 XL layer at 4 x 1024 tokens on v5e-8), and with a softmax whose derivative was written out
    libtpu's compiler overflowed its stack pricing the fusions."""
    if rngs is None or rate == 0.0:
        return jax.nn.softmax(logits, axis=-1)
    scores = _exponentials(logits)
    total = jnp.sum(scores, axis=-1, keepdims=True)
    dropped = dropout(scores, rate, rngs)  # inverted: kept scores already divided by 1 - rate
    return dropped / total


def _exponentials(logits: jax.Array) -> jax.Array:
    """``exp(logits - max)`` over the last axis: a softmax's numerators, the max held constant."""
    return jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention_drawn(shape: _Shape, rate: float, q, k, v, bias, mask, keep) -> jax.Array:
    """``_written_out`` with dropout's ``keep`` mask drawn ahead (``DrawnMasks``: CPU programs), whose backward
    pass keeps nothing of the scores' size (as FlashAttention's): it recomputes the probabilities from the
    queries, keys and each query's log-sum-exp, the dropped ones from them and the masks (which it holds
    anyway: the scan's inputs). A scanned stack otherwise stacks every layer's probabilities, zeroing and
    filling an array of their size for all layers at every step (QA's MiniLM step at 23 x 384 tokens: 2.6
    GiB of temporaries instead of 4.5)."""
    return _attention_drawn_fwd(shape, rate, q, k, v, bias, mask, keep)[0]


def _attention_drawn_fwd(shape, rate, q, k, v, bias, mask, keep):
    logits = _scores(shape, q, k, bias, mask)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    scores = jnp.exp(logits - top)
    total = jnp.sum(scores, axis=-1, keepdims=True)
    dropped = kept(scores / total, keep, rate).astype(v.dtype)
    out = shape.output(jnp.einsum(shape.product, shape.group(dropped), v))
    return out, (q, k, v, bias, mask, keep, out, top + jnp.log(total))


def _attention_drawn_bwd(shape, rate, residuals, dout):
    q, k, v, bias, mask, keep, out, log_total = residuals
    logits, scores_vjp = jax.vjp(lambda q, k, bias: _scores(shape, q, k, bias, mask), q, k, bias)
    probs = jnp.exp(logits - log_total)
    dropped = shape.group(kept(probs, keep, rate).astype(v.dtype))
    _, product_vjp = jax.vjp(lambda p, v: shape.output(jnp.einsum(shape.product, p, v)), dropped, v)
    ddropped, dv = product_vjp(dout)
    dprobs = kept(ddropped.reshape(probs.shape).astype(jnp.float32), keep, rate)
    # sum_k probs * dprobs = dout . out per query (the dropped probabilities weigh the values alike)
    row = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))[..., None]
    dq, dk, dbias = scores_vjp(probs * (dprobs - row))
    return dq, dk, dv, dbias, None, None


_attention_drawn.defvjp(_attention_drawn_fwd, _attention_drawn_bwd)


def split_heads(x: jax.Array, heads: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def merge_heads(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


# --------------------------------------------------------------------------- context parallelism
# A mesh whose cp axis is more than 1 splits each row's tokens over the cp devices. A causal query's work grows with
# its position, so a row is cut into 2 x cp equal chunks and device i holds chunks i and 2cp-1-i (``balanced_order``):
# every device has the same work. A model permutes its token arrays into that order and splits them
# (``split_sequence``); the position-wise layers run on each device's share; each attention gathers the keys and
# values of the whole row from the cp group (``context_attention``; grouped-query keys and values are a small share
# of the activations); the model's output is put back in order (``merge_sequence``). Exact: the same numbers as a
# whole row on one device.


def balanced_order(seq: int, parts: int) -> np.ndarray:
    """The positions of a ``seq``-token row in the order ``parts`` cp devices hold them: cut into ``2 * parts``
    equal chunks, device ``i`` holding chunks ``i`` and ``2 * parts - 1 - i``."""
    chunks = np.arange(seq, dtype=np.int32).reshape(2 * parts, -1)
    return np.stack([chunks[:parts], chunks[parts:][::-1]], axis=1).reshape(-1)


def _balanced(x: jax.Array, parts: int) -> jax.Array:
    """``x`` ``[batch, seq, ...]`` in ``balanced_order`` along its sequence (reshapes, no gather)."""
    chunks = x.reshape(x.shape[0], 2 * parts, -1, *x.shape[2:])
    return jnp.stack([chunks[:, :parts], jnp.flip(chunks[:, parts:], 1)], axis=2).reshape(x.shape)


def _natural(x: jax.Array, parts: int) -> jax.Array:
    """``_balanced``'s inverse: a sequence in ``balanced_order`` back in order."""
    pairs = x.reshape(x.shape[0], parts, 2, -1, *x.shape[2:])
    return jnp.concatenate([pairs[:, :, 0], jnp.flip(pairs[:, :, 1], 1)], axis=1).reshape(x.shape)


def _split_spec(mesh: Mesh, x: jax.Array) -> NamedSharding:
    """``[batch, seq, ...]`` split over the batch axes (when the rows divide) and the sequence over cp."""
    rows = BATCH_AXES if x.shape[0] % data_parallel_size(mesh) == 0 else None
    return NamedSharding(mesh, P(rows, "cp", *(None,) * (x.ndim - 2)))


def split_sequence(mesh: Mesh, *arrays: jax.Array | None) -> tuple[jax.Array | None, ...]:
    """Each ``[batch, seq, ...]`` array of ``arrays`` (None stays None) in ``balanced_order`` and split over the
    mesh's cp axis: what a model does with its token ids, segment ids and positions before its blocks. A row
    that does not cut into ``2 x cp`` equal chunks is padded at its end with zeros (padding, segment 0: no real
    query sees it); ``merge_sequence`` drops it."""
    parts = mesh.shape["cp"]
    pad = -next(a for a in arrays if a is not None).shape[1] % (2 * parts)

    def split(a):
        a = jnp.pad(a, ((0, 0), (0, pad), *((0, 0),) * (a.ndim - 2)))
        return jax.lax.with_sharding_constraint(_balanced(a, parts), _split_spec(mesh, a))

    return tuple(None if a is None else split(a) for a in arrays)


def merge_sequence(mesh: Mesh, x: jax.Array, seq: int) -> jax.Array:
    """``x`` ``[batch, ...]``, split by ``split_sequence`` from ``seq`` positions, back in order (still split over
    cp)."""
    return jax.lax.with_sharding_constraint(_natural(x, mesh.shape["cp"])[:, :seq], _split_spec(mesh, x))


def split_mask(segments: jax.Array | None, window: int | None = None) -> AttentionMask:
    """The mask of a causal self-attention over a sequence split by ``split_sequence`` (``segments``: its
    padding mask or segment ids, split with it)."""
    return AttentionMask(None, segments, window, split=True)


def context_attention(
    q, k, v, mask: AttentionMask, *, scale: float, causal: bool, softcap=None, sinks=None, kernel: AttentionKernel
) -> jax.Array:
    """``attend`` over a sequence split by ``split_sequence`` (queries, keys, values and ``mask.segments`` in
    balanced order, split over ``kernel.context``'s cp axis): under ``shard_map`` each device all-gathers the
    keys, values and segment ids of its cp group, puts them back in order and attends its own queries over
    them, masked by the queries' positions in the row: splash (a causal mask over those positions,
    ``q_seq_shards`` = cp), cuDNN or XLA (a dense mask of the device's queries)."""
    mesh, window, segments = kernel.context, mask.window, mask.segments
    parts, mp = mesh.shape["cp"], mesh.shape["mp"]
    seq = q.shape[1]
    heads = "mp" if q.shape[2] % mp == 0 else None
    if heads and k.shape[2] % mp:  # key/value heads that do not divide over mp: one per query head
        k, v = (jnp.repeat(t, q.shape[2] // t.shape[2], axis=2) for t in (k, v))
    rows = BATCH_AXES if q.shape[0] % data_parallel_size(mesh) == 0 else None
    qkv, tokens = P(rows, "cp", heads, None), P(rows, "cp")
    order = balanced_order(seq, parts)
    splash = kernel.name == "splash" and sinks is None and softcap is None and causal
    if splash and (seq // parts) % SPLASH_BLOCK:
        splash = False
        message = f"splash attention under cp={parts} needs {SPLASH_BLOCK * parts}-token multiples, got {seq}"
        if kernel.required:
            raise JaxseqError(f"{message}; pad --max_seq_length / --block_size or use --attention xla")
        logger.warning("%s: this attention runs on XLA", message)
    mha = _split_splash(seq, parts, window, q.shape[2] // (mp if heads else 1), kernel.interpret) if splash else None

    def gathered(x):
        return _natural(jax.lax.all_gather(x, "cp", axis=1, tiled=True), parts)

    def local(q, k, v, segments, positions, sinks, mha):
        k, v = gathered(k), gathered(v)
        keys = None if segments is None else gathered(segments)
        if mha is not None:
            q, k, v = (jnp.swapaxes(t, 1, 2) for t in ((q * scale).astype(q.dtype), k, v))
            if segments is None:
                return jnp.swapaxes(jax.vmap(mha)(q, k, v), 1, 2)
            ids = _splash_module().SegmentIds(q=segments.astype(jnp.int32), kv=keys.astype(jnp.int32))
            return jnp.swapaxes(jax.vmap(mha)(q, k, v, segment_ids=ids), 1, 2)
        k_pos = jnp.arange(seq, dtype=jnp.int32)[None, :]
        seen = jnp.ones((positions.shape[0], seq), bool)
        if causal:
            seen = k_pos <= positions[:, None]
            if window is not None:
                seen = seen & (k_pos > positions[:, None] - window)
        dense = seen[None, None]
        if segments is not None:  # as make_mask: a query sees real keys of its segment; padding sees every real key
            queries, keys = segments[:, None, :, None], keys[:, None, None, :]
            dense = dense & (keys != 0) & ((queries == keys) | (queries == 0))
        if kernel.name == "cudnn" and sinks is None and softcap is None:
            return jax.nn.dot_product_attention(q, k, v, mask=dense, scale=scale, implementation="cudnn")
        return _written_out(q, k, v, "bkhd", dense, None, scale, 0.0, None, softcap, sinks)

    specs = (
        qkv, qkv, qkv, None if segments is None else tokens, P("cp"), None if sinks is None else P(heads),
        None if mha is None else mha.manual_sharding_spec(NamedSharding(mesh, P(None, "cp"))),
    )  # fmt: skip
    run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=qkv, check_vma=mha is None)  # Pallas: no vma
    return run(q, k, v, segments, jnp.asarray(order), sinks, mha)


def _splash_module():
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


@functools.lru_cache(maxsize=8)
def _split_splash(seq: int, parts: int, window: int | None, heads: int, interpret: bool):
    """The splash kernel of ``heads`` query heads over a ``seq``-token row whose queries are in ``balanced_order``
    and split ``parts`` ways (``q_seq_shards``): a causal mask (within ``window``) over the queries' positions."""
    splash = _splash_module()
    shape = (seq, seq)
    mask = splash.LocalMask(shape, (window - 1, 0), offset=0) if window is not None else splash.CausalMask(shape)
    mask.q_sequence = balanced_order(seq, parts)
    return splash.make_splash_mha(
        splash.MultiHeadMask([mask] * heads),
        head_shards=1,
        q_seq_shards=parts,
        block_sizes=_splash_blocks(seq // parts, seq),
        interpret=interpret,
    )


# --------------------------------------------------------------------------- fused kernels


def _splash_fits(q: jax.Array, k: jax.Array, kernel: AttentionKernel) -> bool:
    """Whether splash takes these lengths (whole 128-position tiles); if not, an error when it was asked for
    by name, else XLA (said once in the log)."""
    lengths = (q.shape[1], k.shape[1])
    if all(n % SPLASH_BLOCK == 0 for n in lengths):
        return True
    message = (
        f"splash attention needs sequence lengths that are multiples of {SPLASH_BLOCK}, got {lengths[0]}; pad "
        f"--block_size / --max_seq_length to a multiple of {SPLASH_BLOCK} or use --attention xla"
    )
    if kernel.required:
        raise JaxseqError(message)
    logger.warning("%s: this attention runs on XLA", message)
    return False


def _splash_blocks(q_len: int, kv_len: int):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    def block(n):  # the largest of 512, 256, 128 that divides the length
        return next(b for b in (512, 256, SPLASH_BLOCK) if n % b == 0)

    bq, bkv = block(q_len), block(kv_len)
    return splash.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv,
    )  # fmt: skip


def splash_attention(
    q, k, v, segments, *, scale: float, causal: bool, window: int | None = None, kernel: AttentionKernel
) -> jax.Array:
    """``attend`` with the Pallas TPU splash attention kernel (``[batch, len, heads, head_dim]`` in and out):
    causal (within a sliding ``window`` if given) or full, grouped-query keys/values as the kernel takes
    them, padding and packed examples as segment ids (a query sees only keys of its own segment; padding,
    segment 0, sees only padding, and its output is discarded). Run per device under ``shard_map`` when the
    kernel has a mesh: each device takes its rows (dp, fsdp) and its heads (mp); key/value heads that do not
    divide over mp are repeated to one per query head first."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    q = (q * scale).astype(q.dtype)  # splash does not scale
    mesh = kernel.mesh
    if mesh is not None and k.shape[2] % mesh.shape["mp"]:
        k, v = (jnp.repeat(t, q.shape[2] // t.shape[2], axis=2) for t in (k, v))
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # [batch, heads, len, dim]
    heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    local_heads = heads if mesh is None else heads // mesh.shape["mp"]

    def local(q, k, v, segments):
        shape = (q_len, kv_len)
        if window is not None:
            mask = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
        else:
            mask = splash.CausalMask(shape) if causal else splash.FullMask(shape)
        mha = splash.make_splash_mha(
            splash.MultiHeadMask([mask] * local_heads),
            head_shards=1,
            q_seq_shards=1,
            block_sizes=_splash_blocks(q_len, kv_len),
            interpret=kernel.interpret,
        )
        if segments is None:
            return jax.vmap(mha)(q, k, v)
        ids = splash.SegmentIds(q=segments, kv=segments)
        return jax.vmap(mha)(q, k, v, segment_ids=ids)

    segments = None if segments is None else segments.astype(jnp.int32)
    if mesh is None:
        out = local(q, k, v, segments)
    else:
        qkv = P(BATCH_AXES, "mp", None, None)
        specs = (qkv, qkv, qkv, None if segments is None else P(BATCH_AXES, None))
        run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=qkv, check_vma=False)
        out = run(q, k, v, segments)
    return jnp.swapaxes(out, 1, 2)


def choose_kernel(
    choice: str,
    mesh: Mesh | None,
    model: Callable[[], nnx.Module],
    *,
    packed: bool = False,
    interpret: bool = False,
    say: Callable[[str], None] | None = None,
) -> AttentionKernel:
    """The attention kernel (``ATTENTION_KERNELS``) that the attention layers of ``model()`` (the model, abstract,
    built with XLA's attention: called only when a fused kernel is considered) run for runs on ``mesh`` (whose
    devices say the backend; None: the default backend). ``auto``: splash on TPU, cuDNN on GPU
    (bfloat16/float16 compute), where every layer can take it (no attention dropout, no additive bias as T5's),
    else XLA, saying why through ``say`` (default: a logged warning). A kernel named explicitly that cannot apply
    stops with one line saying why and what to do. ``packed``: the batches pack several examples per row (cuDNN
    cannot keep them apart). ``interpret``: splash anywhere, in Pallas interpret mode (numerics tests on CPU)."""
    if choice not in ATTENTION_KERNELS:
        raise JaxseqError(f"unknown attention kernel {choice!r}; choose one of {', '.join(ATTENTION_KERNELS)}")
    where = mesh_platform(mesh)
    name = choice
    if choice == "auto":
        name = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(where, "xla")
    why_not = None if name == "xla" else _why_not(name, model(), where, interpret)
    if name == "cudnn" and packed and not why_not:
        why_not = "cuDNN attention cannot keep packed examples apart; add --no_pack_sequences or use --attention xla"
    if why_not and choice != "auto":
        raise JaxseqError(why_not)
    if why_not:
        (say or logger.warning)(f"attention: XLA ({why_not})")
        name = "xla"
    return AttentionKernel(name, mesh if name == "splash" else None, required=choice != "auto", interpret=interpret)


def attention_layers(model: nnx.Module) -> list[nnx.Module]:
    """The attention layers of ``model``: its modules that run an ``AttentionKernel`` (``attention``)."""
    return [m for _, m in nnx.iter_modules(model) if isinstance(getattr(m, "attention", None), AttentionKernel)]


def splits_sequence(model: nnx.Module) -> bool:
    """Whether ``model`` runs under a cp mesh: its stack splits the sequence (``split_sequence``; a module that
    sets ``splits_sequence``) and every attention layer attends over a split one (sets it too)."""
    layers = attention_layers(model)
    stacks = [m for _, m in nnx.iter_modules(model) if not any(m is layer for layer in layers)]
    return (
        bool(layers)
        and any(getattr(m, "splits_sequence", False) for m in stacks)
        and all(getattr(layer, "splits_sequence", False) for layer in layers)
    )


def _why_not(name: str, model: nnx.Module, platform: str, interpret: bool) -> str | None:
    """Why fused kernel ``name`` cannot run the attention layers of ``model`` here (None: it can)."""
    layers = attention_layers(model)
    label = {"splash": "splash attention", "cudnn": "cuDNN attention"}[name]
    if not layers:
        return f"{label} is not available for {type(model).__name__}; use --attention xla"
    if any(not getattr(layer, "fused_kernels", True) for layer in layers):
        return f"{label} cannot add {type(model).__name__}'s relative position bias; use --attention xla"
    if any(getattr(layer, "softcap", None) for layer in layers):
        return f"{label} does not soft-cap attention logits (attn_logit_softcapping); use --attention xla"
    if any(getattr(layer, "sinks", None) is not None for layer in layers):
        return f"{label} has no attention sinks (the sinks of {type(model).__name__}); use --attention xla"
    if name == "splash" and platform != "tpu" and not interpret:
        return f"splash attention runs on TPUs (here: {platform}); use --attention auto or xla"
    if name == "cudnn" and platform not in ("gpu", "cuda"):
        return f"cuDNN attention runs on NVIDIA GPUs (here: {platform}); use --attention auto or xla"
    dropping = [layer for layer in layers if layer.dropout_rate > 0]
    if dropping:
        field = dropping[0].dropout_field
        return f"{label} has no attention dropout: set it to 0 with --config_overrides {field}=0"
    if name == "cudnn" and not any(layer.dtype in (jnp.bfloat16, jnp.float16) for layer in layers):
        return "cuDNN attention needs bfloat16 or float16 compute; add --dtype bfloat16"
    return None
