"""Qwen3.5's text decoder (Qwen Team 2026): Gated DeltaNet linear attention (Yang et al. 2025) interleaved with
gated full attention, each layer's kind from ``layer_types`` (``linear_attention`` / ``full_attention``), as NNX
modules whose parameter paths mirror transformers' PyTorch names (``model/layers/0/linear_attn/in_proj_qkv/kernel``
is ``model.layers.0.linear_attn.in_proj_qkv.weight``).

A linear-attention layer (``Qwen3_5GatedDeltaNet``): the in-projections ``in_proj_qkv`` (queries and keys of
``linear_num_key_heads`` heads, values of ``linear_num_value_heads``), ``in_proj_z`` (the output gate),
``in_proj_a`` and ``in_proj_b`` (per value head: the decay and the write strength); a causal depthwise
convolution of ``linear_conv_kernel_dim`` taps over q/k/v, then ``hidden_act`` (SiLU); L2-normalised queries
and keys; the gated delta rule ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``,
``o_t = S_t^T q_t / sqrt(d_k)`` with ``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, run
in chunks for a sequence (``gated_delta_chunked``, transformers' ``torch_chunk_gated_delta_rule``) and a step
at a time when decoding (``gated_delta_recurrent``); an RMSNorm of each head's output gated by ``silu(z)``;
``out_proj``.

A full-attention layer (``Qwen3_5Attention``): Qwen3's grouped-query attention with q/k RMSNorms, rotary
embeddings over the first ``partial_rotary_factor`` of each head (``rope_parameters``), and an output gate:
``q_proj`` yields each head's query and gate, the attention output is multiplied by ``sigmoid(gate)`` before
``o_proj``. The RMSNorms of the blocks, q/k and the final norm are zero-centred (``x * (1 + weight)``).

Padding: as transformers, a linear layer zeroes the hidden states of padding before its projections (none of
them has a bias), so left padding leaves the convolution and the recurrent state untouched. Packed examples
(segment ids) are kept apart too: neither the convolution nor the state crosses a change of segment id
(``runs``), which is exact for unpacked rows.

Decoding keeps, for each linear layer, a ``LinearCache`` (the convolution's last inputs and the recurrent state)
beside the full layers' ``KVCache``; both are laid out ``[batch, heads, len, dim]``, so generation's beam and
sharding helpers treat them alike."""

from __future__ import annotations

import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.models.attention import (
    AttentionMask,
    Cache,
    KVCache,
    attend,
    attend_cache,
    make_mask,
    merge_heads,
    query_positions,
    run_blocks,
    self_attention_mask,
    split_heads,
    update_kv,
)
from jaxseq.models.execution import Execution
from jaxseq.models.heads import LastTokenClassifier
from jaxseq.models.layers import Linear, activation, blocks, embedding_lookup, normal, padded_vocab_size
from jaxseq.models.llama.modeling import (
    LlamaForCausalLM,
    LlamaMLP,
    OffsetRMSNorm,
    apply_rotary,
    head_dim,
    rope_attention_factor,
    rope_frequencies,
    rotary,
)
from jaxseq.models.outputs import BaseOutput

LINEAR, FULL = "linear_attention", "full_attention"
CHUNK = 64  # transformers' chunk_size of the chunked delta rule


def layer_kinds(config) -> tuple[str, ...]:
    """Each layer's kind, ``linear_attention`` or ``full_attention`` (``config.layer_types``)."""
    kinds = tuple(config.layer_types or ())[: config.num_hidden_layers]
    if len(kinds) < config.num_hidden_layers or set(kinds) - {LINEAR, FULL}:
        raise JaxseqError(
            f"layer_types must name {config.num_hidden_layers} layers, each {LINEAR!r} or {FULL!r}; got "
            f"{list(config.layer_types or ())}"
        )
    return kinds


# --------------------------------------------------------------------------- the gated delta rule


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (the FLA library's, as transformers')."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _heads_first(q, k, v, g, beta):
    """float32 ``[batch, value_heads, seq, dim]`` q/k (each key head repeated for its value heads, L2-normalised,
    queries scaled by ``dim ** -0.5``) and v, and ``[batch, value_heads, seq]`` g and beta."""
    groups = v.shape[2] // q.shape[2]
    q, k = (jnp.repeat(t, groups, axis=2) for t in (q, k))
    q, k, v, g, beta = (jnp.swapaxes(t, 1, 2).astype(jnp.float32) for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def gated_delta_recurrent(q, k, v, g, beta, state=None):
    """The gated delta rule a step at a time (transformers' ``torch_recurrent_gated_delta_rule``): queries and
    keys ``[batch, seq, key_heads, d_k]``, values ``[batch, seq, value_heads, d_v]``, log-decays ``g`` and write
    strengths ``beta`` ``[batch, seq, value_heads]``, the starting state ``[batch, value_heads, d_k, d_v]``
    (None: zeros). Returns the outputs ``[batch, seq, value_heads, d_v]`` (``v``'s dtype) and the float32 state."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    batch, heads, _, dk = k.shape
    state = jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32) if state is None else state.astype(jnp.float32)

    def step(s, inputs):
        q_t, k_t, v_t, g_t, beta_t = inputs
        s = s * jnp.exp(g_t)[..., None, None]
        remembered = jnp.sum(s * k_t[..., None], axis=-2)
        s = s + k_t[..., None] * ((v_t - remembered) * beta_t[..., None])[..., None, :]
        return s, jnp.sum(s * q_t[..., None], axis=-2)

    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(t, 2, 0) for t in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1).astype(dtype), state


def gated_delta_chunked(q, k, v, g, beta, state=None, runs=None, chunk: int = CHUNK):
    """The gated delta rule over chunks of ``chunk`` positions (transformers' ``torch_chunk_gated_delta_rule``,
    the same operations): within a chunk the delta rule's updates are one unit-triangular system (the UT
    transform) and a few matmuls, and a scan carries the state from chunk to chunk. Arguments and results as
    ``gated_delta_recurrent``'s; ``runs`` ``[batch, seq]`` (None: one run): positions of different runs never
    meet, neither within a chunk nor through the state, which restarts from zeros at each new run (the first
    run continues ``state``). The UT transform's triangular solve is an inverse made of matmuls
    (``unit_lower_inverse``)."""
    dtype, seq = v.dtype, v.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    batch, heads, _, dk = k.shape
    dv = v.shape[-1]
    pad = -seq % chunk
    q, k, v = (jnp.pad(t, ((0, 0), (0, 0), (0, pad), (0, 0))) for t in (q, k, v))
    g, beta = (jnp.pad(t, ((0, 0), (0, 0), (0, pad))) for t in (g, beta))
    runs = jnp.zeros((batch, seq), jnp.int32) if runs is None else runs
    runs = jnp.pad(runs, ((0, 0), (0, pad)), mode="edge")[:, None].reshape(batch, 1, -1, chunk)

    def chunks(t):
        return t.reshape(batch, heads, -1, chunk, *t.shape[3:])

    v_beta, k_beta = chunks(v * beta[..., None]), chunks(k * beta[..., None])
    q, k, g = chunks(q), chunks(k), chunks(g)
    cum = jnp.cumsum(g, axis=-1)  # the log-decay from the chunk's start
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    seen = lower & (runs[..., :, None] == runs[..., None, :])
    pairwise = jnp.exp(jnp.where(seen, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    ut_system = (k_beta @ jnp.swapaxes(k, -1, -2)) * pairwise
    intra = (q @ jnp.swapaxes(k, -1, -2)) * pairwise
    # which positions read the state the chunk starts from (its first run), and which write the one it leaves
    before = jnp.concatenate([runs[..., :1, :1], runs[..., :-1, -1:]], axis=-2)
    reads = jnp.exp(cum) * (runs == before)
    writes = jnp.exp(cum[..., -1:] - cum) * (runs == runs[..., -1:])
    inverse = unit_lower_inverse(jnp.where(jnp.tril(lower, -1), ut_system, 0.0))  # the UT transform
    new_values, k_cumdecay = inverse @ v_beta, inverse @ (k_beta * reads[..., None])
    q, k = q * reads[..., None], k * writes[..., None]
    chunk_decay = reads[..., -1]  # 0 where a new run starts in the chunk: the old state is dropped

    def step(s, inputs):
        values, k_decayed, q_i, intra_i, k_i, decay = inputs
        v_new = values - k_decayed @ s
        out = q_i @ s + intra_i @ v_new
        return s * decay[..., None, None] + jnp.swapaxes(k_i, -1, -2) @ v_new, out

    state = jnp.zeros((batch, heads, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    inputs = (new_values, k_cumdecay, q, intra, k, jnp.broadcast_to(chunk_decay, g.shape[:3]))
    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(t, 2, 0) for t in inputs))
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, -1, dv)[:, :, :seq]
    return jnp.swapaxes(out, 1, 2).astype(dtype), state


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)^-1`` of strictly lower-triangular ``a`` ``[..., n, n]`` in matmuls alone: ``a`` is nilpotent, so
    the inverse is ``(I - a)(I + a^2)(I + a^4)...`` up to the power past ``n`` (6 factors for 64 positions).
    What transformers' unit-triangular solve gives, without LAPACK's batched solver (whose CPU kernel waits on
    the thread pool that many devices' programs occupy) and in the MXU's own operation on TPUs."""
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    power = -a
    inverse = eye + power
    for _ in range(max(0, (a.shape[-1] - 1).bit_length() - 1)):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def segment_runs(segments: jax.Array) -> jax.Array:
    """``[batch, seq]`` run ids of a padding mask / segment ids: a new run wherever the id changes (padding is a
    run of its own)."""
    change = segments[:, 1:] != segments[:, :-1]
    return jnp.cumsum(jnp.pad(change, ((0, 0), (1, 0))), axis=1, dtype=jnp.int32)


def causal_conv(x, kernel, history, runs=None, act=jax.nn.silu):
    """``act`` (SiLU) of the causal depthwise convolution of ``x`` ``[batch, seq, channels]`` with ``kernel``
    ``[channels, 1, taps]`` (PyTorch's ``Conv1d`` weight), continuing the ``taps - 1`` inputs ``history``
    ``[batch, taps - 1, channels]`` (zeros: none); a tap never reads another run (``runs``, ``segment_runs``;
    the history continues the first). Returns the output and the new history, the last ``taps - 1`` inputs."""
    taps, seq = kernel.shape[-1], x.shape[1]
    inputs = jnp.concatenate([history.astype(x.dtype), x], axis=1)
    weights = kernel[:, 0, :].astype(x.dtype)
    if runs is not None:
        runs = jnp.concatenate([jnp.repeat(runs[:, :1], taps - 1, axis=1), runs], axis=1)
    out = jnp.zeros_like(x)
    for tap in range(taps):
        window = inputs[:, tap : tap + seq]
        if runs is not None:
            window = jnp.where((runs[:, tap : tap + seq] == runs[:, taps - 1 :])[..., None], window, 0)
        out = out + window * weights[:, tap]
    return act(out), inputs[:, seq:]


class LinearCache(NamedTuple):
    """A linear-attention layer's decoding state: ``conv`` ``[batch, 1, taps - 1, channels]``, the convolution's
    last inputs, and ``state`` float32 ``[batch, value_heads, d_k, d_v]``, the delta rule's memory. Laid out as a
    ``KVCache``'s ``[batch, heads, len, dim]``, so beams repeat and reorder it and the mesh shards it alike."""

    conv: jax.Array
    state: jax.Array

    @classmethod
    def zeros(cls, config, batch: int, dtype) -> LinearCache:
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        channels = 2 * config.linear_num_key_heads * dk + config.linear_num_value_heads * dv
        return cls(
            jnp.zeros((batch, 1, config.linear_conv_kernel_dim - 1, channels), dtype),
            jnp.zeros((batch, config.linear_num_value_heads, dk, dv), jnp.float32),
        )


# --------------------------------------------------------------------------- modules


class GatedRMSNorm(nnx.Module):
    """RMSNorm of each head's output (weight from ones) times ``silu(gate)``, in float32 (``Qwen3_5RMSNormGated``)."""

    def __init__(self, dim: int, *, epsilon: float, dtype, param_dtype, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.epsilon = epsilon

    def __call__(self, x, gate):
        x32 = x.astype(jnp.float32)
        y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)).astype(x.dtype)
        y = self.scale[...].astype(jnp.float32) * y.astype(jnp.float32)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class DepthwiseConv(nnx.Module):
    """The depthwise convolution's weight ``[channels, 1, taps]`` (PyTorch's ``conv1d.weight``), without bias."""

    def __init__(self, channels: int, taps: int, *, init, param_dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(init(rngs.params(), (channels, 1, taps), param_dtype))


class Qwen3_5GatedDeltaNet(nnx.Module):
    """Gated DeltaNet linear attention (see the module's docstring)."""

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d = config.hidden_size
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        if self.value_heads % self.key_heads:
            raise JaxseqError(
                f"linear_num_value_heads ({self.value_heads}) must be a multiple of linear_num_key_heads "
                f"({self.key_heads})"
            )
        key_dim, value_dim = self.key_heads * self.dk, self.value_heads * self.dv
        init = normal(config.initializer_range)
        kw = dict(use_bias=False, kernel_init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.in_proj_qkv = Linear(d, 2 * key_dim + value_dim, **kw)
        self.in_proj_z = Linear(d, value_dim, **kw)
        self.in_proj_b = Linear(d, self.value_heads, **kw)
        self.in_proj_a = Linear(d, self.value_heads, **kw)
        self.conv1d = DepthwiseConv(2 * key_dim + value_dim, config.linear_conv_kernel_dim, init=init,
                                    param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        self.dt_bias = nnx.Param(jnp.ones((self.value_heads,), param_dtype))
        decay = jax.random.uniform(rngs.params(), (self.value_heads,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(decay).astype(param_dtype))
        self.norm = GatedRMSNorm(self.dv, epsilon=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.out_proj = Linear(value_dim, d, **kw)
        self.act = activation(config.hidden_act)  # the convolution's (the gated norm's is SiLU)

    def __call__(self, x, tokens, *, cache: LinearCache | None = None):
        """``x`` ``[batch, seq, hidden]``; ``tokens``: its positions' padding mask / segment ids (None: all real)."""
        batch, seq, _ = x.shape
        runs = None
        if tokens is not None:
            x = x * (tokens != 0)[..., None].astype(x.dtype)
            runs = segment_runs(tokens)
        z = self.in_proj_z(x).reshape(batch, seq, self.value_heads, self.dv)
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        qkv = self.in_proj_qkv(x)
        history = (
            jnp.zeros((batch, self.conv1d.kernel.shape[-1] - 1, qkv.shape[-1]), qkv.dtype)
            if cache is None
            else cache.conv[:, 0]
        )
        qkv, history = causal_conv(qkv, self.conv1d.kernel[...], history, runs, self.act)
        key_dim = self.key_heads * self.dk
        q = qkv[..., :key_dim].reshape(batch, seq, self.key_heads, self.dk)
        k = qkv[..., key_dim : 2 * key_dim].reshape(batch, seq, self.key_heads, self.dk)
        v = qkv[..., 2 * key_dim :].reshape(batch, seq, self.value_heads, self.dv)
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        state = None if cache is None else cache.state
        if cache is not None and seq == 1:
            out, state = gated_delta_recurrent(q, k, v, g, beta, state)
        else:
            out, state = gated_delta_chunked(q, k, v, g, beta, state, runs)
        out = self.out_proj(self.norm(out, z).reshape(batch, seq, -1))
        if cache is not None:
            cache = LinearCache(history[:, None].astype(cache.conv.dtype), state)
        return out, cache


def rotary_dim(config) -> int:
    """How many features of each head turn: ``head_dim x partial_rotary_factor`` (``rope_parameters``')."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim(config) * factor)


def rope_inverse_frequencies(config):
    """The inverse frequencies of the turned features (``rotary_dim``), transformers' rope types as Llama's."""
    shim = types.SimpleNamespace(
        rope_parameters=getattr(config, "rope_parameters", None),
        rope_theta=getattr(config, "rope_theta", 10000.0),
        head_dim=rotary_dim(config),
    )
    return rope_frequencies(shim)


def apply_partial_rotary(x, sin, cos):
    """``apply_rotary`` on the first ``sin.shape[-1]`` features of each head; the rest pass as they are."""
    turned = sin.shape[-1]
    return jnp.concatenate([apply_rotary(x[..., :turned], sin, cos), x[..., turned:]], axis=-1)


class Qwen3_5Attention(nnx.Module):
    """Grouped-query causal attention with q/k norms, partial rotary embeddings and an output gate."""

    dropout_field = "attention_dropout"

    def __init__(self, config, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs):
        d, dim = config.hidden_size, head_dim(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        kw = dict(use_bias=bias, kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype,
                  rngs=rngs)  # fmt: skip
        self.q_proj = Linear(d, heads * dim * 2, **kw)  # each head's query, then its gate
        self.k_proj = Linear(d, kv_heads * dim, **kw)
        self.v_proj = Linear(d, kv_heads * dim, **kw)
        self.o_proj = Linear(heads * dim, d, **kw)
        norm = dict(epsilon=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_norm, self.k_norm = OffsetRMSNorm(dim, **norm), OffsetRMSNorm(dim, **norm)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, dim
        self.scale, self.softcap, self.window = dim**-0.5, None, None
        self.dropout_rate, self.dtype, self.attention = config.attention_dropout, dtype, execution.attention

    def __call__(self, x, mask, rope, *, cache: KVCache | None = None, index=0, rngs=None):
        batch, seq, _ = x.shape
        query_gate = self.q_proj(x).reshape(batch, seq, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate[..., : self.head_dim], query_gate[..., self.head_dim :]
        q = apply_partial_rotary(self.q_norm(q), *rope)
        k = apply_partial_rotary(self.k_norm(split_heads(self.k_proj(x), self.num_kv_heads)), *rope)
        v = split_heads(self.v_proj(x), self.num_kv_heads)
        if cache is not None:
            cache = update_kv(cache, k, v, index)
            y = attend_cache(q, cache, mask, scale=self.scale)
        else:
            y = attend(q, k, v, mask, scale=self.scale, dropout_rate=self.dropout_rate, rngs=rngs,
                       kernel=self.attention, causal=True)  # fmt: skip
        y = merge_heads(y) * jax.nn.sigmoid(merge_heads(gate))
        return self.o_proj(y), cache


class Qwen3_5DecoderLayer(nnx.Module):
    """Pre-norm token mixer (``linear_attn`` or ``self_attn``, as ``layer_types`` says) and MLP. Beside its output
    it returns its cache, or without one what its MLP reports (a MoE's router statistics; None for a dense MLP)."""

    def __init__(self, config, kind: str, *, execution: Execution = Execution(), dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(epsilon=config.rms_norm_eps, **kw)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, **norm)
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = Qwen3_5GatedDeltaNet(config, **kw)
        else:
            self.self_attn = Qwen3_5Attention(config, execution=execution, **kw)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, **norm)
        self.mlp = self.feed_forward(config, execution, **kw)

    def feed_forward(self, config, execution: Execution, **kw) -> nnx.Module:
        """The layer's MLP (the MoE family's: a sparse mixture of experts)."""
        return LlamaMLP(config, **kw)

    def mix(self, x, tokens):
        """The MLP of ``x`` and what it reports (``tokens``: the padding mask, None with a cache)."""
        return self.mlp(x), None

    def __call__(self, x, mask, rope, tokens, *, cache=None, index=0, rngs=None):
        h = self.input_layernorm(x)
        if self.kind == LINEAR:
            a, cache = self.linear_attn(h, tokens, cache=cache)
        else:
            a, cache = self.self_attn(h, mask, rope, cache=cache, index=index, rngs=rngs)
        x = x + a
        y, report = self.mix(self.post_attention_layernorm(x), tokens if cache is None else None)
        return x + y, report if cache is None else cache


class Qwen3_5TextModel(nnx.Module):
    """The decoder stack. ``attention_mask`` ``[batch, seq]`` (1 = token, 0 = padding; or packed examples'
    segment ids); with a ``cache`` it covers the cache's ``max_len`` positions (``jaxseq.models.attention``).
    ``position_ids`` default to ``0, 1, ...`` after the cache's index; pass them for left padding. Scanned, the
    linear and full layers run in groups of their repeating pattern (``layers.Grouped``: three linear and a full
    layer, groups of 4)."""

    hf_architecture = "Qwen3_5TextModel"
    layer_class = Qwen3_5DecoderLayer

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.kinds = layer_kinds(config)
        self.config, self.dtype = config, dtype
        rope_inverse_frequencies(config)  # an unsupported rope type stops here, in one line
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(
            padded_vocab_size(config.vocab_size), config.hidden_size, embedding_init=normal(config.initializer_range),
            **kw,
        )  # fmt: skip
        self.layers = blocks(
            lambda i, rngs: self.layer_class(config, self.kinds[i], execution=execution, dtype=dtype,
                                             param_dtype=param_dtype, rngs=rngs),
            config.num_hidden_layers,
            rngs,
            execution,
            kinds=self.kinds,  # scanned, linear and full layers in groups of their pattern (layers.Grouped)
        )  # fmt: skip
        self.norm = OffsetRMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, **kw)
        self.remat = execution.remat

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        return self.run(input_ids, attention_mask, position_ids, cache=cache, rngs=rngs)[0]

    def run(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        """The output and, without a cache, what the layers report (``Qwen3_5DecoderLayer``)."""
        seq = input_ids.shape[1]
        index = 0 if cache is None else cache.index
        if position_ids is None:
            position_ids = (index + jnp.arange(seq, dtype=jnp.int32))[None, :]
        rope = rotary(position_ids, rope_inverse_frequencies(self.config))
        scale = rope_attention_factor(self.config)  # YaRN's attention factor, as Llama's
        rope = rope if scale == 1.0 else tuple(t * scale for t in rope)
        if cache is None:
            mask, tokens = self_attention_mask(attention_mask, seq, causal=True), attention_mask
        else:
            full = [i for i, kind in enumerate(self.kinds) if kind == FULL]
            mask = None  # without a full layer, no layer reads a mask
            if full:
                mask = AttentionMask(make_mask(attention_mask, seq, cache.max_len(full[0]), causal=True, index=index))
            at = jnp.broadcast_to(query_positions(seq, index), (input_ids.shape[0], seq))  # an index per row too
            tokens = None if attention_mask is None else jnp.take_along_axis(attention_mask, at, axis=1)
        x = embedding_lookup(self.embed_tokens, input_ids, self.config.pad_token_id)
        x, after = run_blocks(self.layers, self.remat, x, mask, rope, tokens, cache=cache, rngs=rngs)
        if cache is not None:
            return BaseOutput(self.norm(x), after), None
        return BaseOutput(self.norm(x)), after

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        """Zero keys/values of every full layer for ``max_len`` positions, zero states of every linear layer."""
        c, dtype = self.config, dtype or self.dtype
        layers = tuple(
            LinearCache.zeros(c, batch, dtype)
            if kind == LINEAR
            else KVCache.zeros(batch, max_len, c.num_key_value_heads, head_dim(c), dtype)
            for kind in self.kinds
        )
        return Cache(self.layers.arrange(layers), jnp.zeros((), jnp.int32))  # as the stack takes them


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """The decoder with its language-model head (a separate weight unless ``tie_word_embeddings``)."""

    hf_architecture = "Qwen3_5ForCausalLM"
    base = Qwen3_5TextModel


class Qwen3_5TextForSequenceClassification(LastTokenClassifier):
    hf_architecture = "Qwen3_5TextForSequenceClassification"
    base = Qwen3_5TextModel
    base_name = "model"
