"""Gemma 4's text decoder (Gemma Team 2026) as Flax NNX modules whose parameter paths mirror transformers'
PyTorch names (``model/layers/0/self_attn/q_proj/kernel`` is ``model.layers.0.self_attn.q_proj.weight``).

Gemma 3's decoder (Llama's attention and MLP with Gemma's norms around both, the embedding scale, GeGLU) with
Gemma 4's changes, each read from the config as transformers reads it:

- RMSNorm scaled by ``weight`` itself (not ``1 + weight``); the queries and keys normalised per head, the
  values too (without a scale); attention unscaled (``scaling`` 1).
- Each layer kind (``layer_types``) its own head size and key/value heads (``config.per_layer_config``: the
  full layers' ``global_head_dim``, ``num_global_key_value_heads``) and rope (``rope_parameters[kind]``,
  ``proportional`` rotating only ``partial_rotary_factor`` of the features).
- ``attention_k_eq_v``: the full layers have no ``v_proj``; their values are the keys' projection.
- ``num_kv_shared_layers``: the last layers compute no keys/values; each attends over those of the last
  earlier layer of its kind (``kv_sharing_modes``' "store" layer), in training and from that layer's cache when
  decoding (their own cache entries are None); ``use_double_wide_mlp`` doubles their MLP.
- Per-layer inputs (``hidden_size_per_layer_input``): a second token embedding (``embed_tokens_per_layer``,
  ``vocab_size_per_layer_input`` rows of one ``hidden_size_per_layer_input`` slice per layer) and a projection
  of the embeddings, mixed, give every layer its own input, gated into its output.
- ``enable_moe_block``: beside the dense MLP, a router (its own norm, scale and per-expert scales) and experts
  (``experts.gate_up_proj`` ``[experts, 2 x moe_intermediate_size, hidden]`` and ``experts.down_proj`` kept
  whole in PyTorch's layout) over the attention's output, their two results normalised and summed.
- Each layer's output times its ``layer_scalar`` (a checkpoint buffer: loaded, never trained).
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxseq.errors import JaxseqError, first_line
from jaxseq.models.attention import (
    AttentionMask,
    Cache,
    KVCache,
    attend,
    attend_cache,
    attend_ring,
    make_mask,
    merge_heads,
    ring_mask,
    self_attention_mask,
    split_heads,
    update_kv,
    update_ring,
)
from jaxseq.models.execution import Execution
from jaxseq.models.family import readable
from jaxseq.models.layers import (
    Linear,
    NamedAsIs,
    Stacked,
    Unrolled,
    WholeExperts,
    activation,
    blocks,
    embedding_lookup,
    normal,
    padded_vocab_size,
    repeating_period,
)
from jaxseq.models.llama.modeling import ROPE_TYPES, LlamaForCausalLM, apply_rotary, rope_attention_factor, rotary
from jaxseq.models.llama.modeling import rope_frequencies as llama_rope_frequencies
from jaxseq.models.mixtral.modeling import expert_parallel, grouped_experts
from jaxseq.models.outputs import BaseOutput

SLIDING = "sliding_attention"


def layer_shape(config, layer: int) -> tuple[int, int]:
    """``(head_dim, num_key_value_heads)`` of layer ``layer`` (its kind's, ``config.per_layer_config``)."""
    own = config.per_layer_config[layer]
    return own.head_dim, own.num_key_value_heads


def sharing(config) -> tuple[str | None, ...]:
    """Each layer's part in KV sharing, as transformers' ``kv_sharing_modes``: None (its own keys and values),
    "store" (the last of its kind before the shared layers: they read its keys and values) or "reuse"."""
    try:
        return tuple(config.kv_sharing_modes)
    except ValueError as e:  # a shared layer's kind that no earlier layer has
        raise JaxseqError(f"num_kv_shared_layers={config.num_kv_shared_layers}: {first_line(e)}") from None


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention)."""
    return tuple(config.sliding_window if kind == SLIDING else None for kind in config.layer_types)


def scannable(config) -> str | None:
    """Why ``config``'s layers cannot scan (None: they can, in groups of their kinds' pattern, ``layers.Grouped``):
    KV-shared layers (they read an earlier layer's keys and values, which a scan over groups does not pass on) or
    layer kinds that do not repeat a pattern."""
    if config.num_kv_shared_layers:
        return f"its last {config.num_kv_shared_layers} layers share earlier layers' keys and values"
    if repeating_period(config.layer_types[: config.num_hidden_layers]) is None:
        return "its layer kinds do not repeat a pattern"
    return None


def double_wide(config, layer: int) -> bool:
    """Whether layer ``layer``'s MLP is twice ``intermediate_size`` wide (a KV-shared layer's, with
    ``use_double_wide_mlp``)."""
    return bool(config.use_double_wide_mlp) and sharing(config)[layer] == "reuse"


def rope_of(config, kind: str) -> SimpleNamespace:
    """The rope fields of the layers of ``kind`` as Llama's functions read a config: their
    ``rope_parameters[kind]`` and their own ``head_dim``. YaRN's ``truncate`` is the one field transformers
    reads from the top of ``rope_parameters``, which per layer kind has none: its ramp is always truncated."""
    dim = config.per_layer_config[kind].head_dim
    params = {**config.rope_parameters[kind], "truncate": config.rope_parameters.get("truncate", True)}
    return SimpleNamespace(rope_parameters=params, head_dim=dim, max_position_embeddings=config.max_position_embeddings)


def rope_frequencies(config, kind: str) -> np.ndarray:
    """float32 inverse frequencies of the layers of ``kind``, over their own ``head_dim``: transformers'
    ``proportional`` rope (the first ``partial_rotary_factor`` of the angles turn, the rest stay) or Llama's
    types (``llama.rope_frequencies``: default, linear, llama3, yarn)."""
    fields = rope_of(config, kind)
    params, dim = fields.rope_parameters, fields.head_dim
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("proportional", *ROPE_TYPES):
        raise JaxseqError(
            f"rope type {rope_type!r} of the {kind} layers is not supported; jaxseq's Gemma 4 supports "
            f"proportional, {', '.join(ROPE_TYPES)}"
        )
    if rope_type != "proportional":
        return llama_rope_frequencies(fields, None)
    base = np.float32(params["rope_theta"])
    angles = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
    turned = np.float32(1.0) / base ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = np.concatenate([turned, np.zeros(dim // 2 - angles, np.float32)])
    return (inv_freq / np.float32(params.get("factor", 1.0))).astype(np.float32)


def rope(config, kind: str, position_ids) -> tuple[jax.Array, jax.Array]:
    """``(sin, cos)`` of ``position_ids`` for the layers of ``kind`` (YaRN's scaled by its attention factor)."""
    sin, cos = rotary(position_ids, rope_frequencies(config, kind))
    scale = rope_attention_factor(rope_of(config, kind), None)
    return (sin, cos) if scale == 1.0 else (sin * scale, cos * scale)


class RMSNorm(nnx.Module):
    """Gemma 4's RMSNorm: ``x * (mean(x^2) + eps) ** -0.5`` in float32, times ``scale`` (none without
    ``with_scale``: the values' and the router's norm), cast back."""

    def __init__(self, dim: int, *, epsilon: float, with_scale: bool = True, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype)) if with_scale else None
        self.epsilon = epsilon

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.pow(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon, -0.5)
        if self.scale is not None:
            y = y * self.scale[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Gemma4TextAttention(nnx.Module):
    """Grouped-query attention over ``window`` (None: every earlier position), unscaled, with q/k/v norms; a
    KV-shared layer ("reuse") has only ``q_proj``, ``q_norm`` and ``o_proj`` and attends over the keys/values
    its kind's "store" layer passes on (``shared``)."""

    dropout_field = "attention_dropout"  # the config's attention dropout (see attention.choose_kernel)

    def __init__(self, config, layer: int, *, execution: Execution = Execution(), dtype, param_dtype, rngs):
        d, heads = config.hidden_size, config.num_attention_heads
        dim, kv_heads = layer_shape(config, layer)
        self.window = layer_windows(config)[layer]
        mode = sharing(config)[layer]
        self.reuses, self.stores = mode == "reuse", mode == "store"
        bias = bool(config.attention_bias)
        kw = dict(kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(epsilon=config.rms_norm_eps, param_dtype=param_dtype)
        self.q_proj = Linear(d, heads * dim, use_bias=bias, **kw)
        self.q_norm = RMSNorm(dim, **norm)
        own = not self.reuses  # a KV-shared layer has no key/value weights
        own_values = own and not (config.attention_k_eq_v and self.window is None)
        self.k_proj = Linear(d, kv_heads * dim, use_bias=bias, **kw) if own else None
        self.v_proj = Linear(d, kv_heads * dim, use_bias=bias, **kw) if own_values else None
        self.k_norm = RMSNorm(dim, **norm) if own else None
        self.v_norm = RMSNorm(dim, with_scale=False, **norm) if own else None
        self.o_proj = Linear(heads * dim, d, use_bias=bias, **kw)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.dropout_rate, self.attention = config.attention_dropout, execution.attention

    def __call__(self, x, mask, rope, *, shared=None, cache: KVCache | None = None, index=0, rngs=None):
        """Output, the layer's cache (None: it keeps none) and, from a "store" layer, what the layers sharing its
        keys/values attend over: ``(k, v)``, a sliding window's ``(rolling cache before the write, k, v)`` or
        ``(cache,)``."""
        q = apply_rotary(self.q_norm(split_heads(self.q_proj(x), self.num_heads)), *rope)
        if self.reuses:
            kv = shared
        else:
            keys = split_heads(self.k_proj(x), self.num_kv_heads)
            v = self.v_norm(keys if self.v_proj is None else split_heads(self.v_proj(x), self.num_kv_heads))
            k = apply_rotary(self.k_norm(keys), *rope)
            if cache is None:
                kv = (k, v)
            elif self.window is not None:
                kv, cache = (cache, k, v), update_ring(cache, k, v, index)
            else:
                cache = update_kv(cache, k, v, index)
                kv = (cache,)
        if len(kv) == 2:
            y = attend(
                q, *kv, mask, scale=1.0, dropout_rate=self.dropout_rate, rngs=rngs, kernel=self.attention, causal=True
            )
        elif len(kv) == 3:
            y = attend_ring(q, *kv, mask, scale=1.0)
        else:
            y = attend_cache(q, kv[0], mask, scale=1.0)
        return self.o_proj(merge_heads(y)), cache, kv if self.stores else None


class Gemma4TextMLP(nnx.Module):
    def __init__(self, config, inner: int, *, dtype, param_dtype, rngs):
        d = config.hidden_size
        kw = dict(use_bias=False, kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(d, inner, rngs=rngs, **kw)
        self.up_proj = Linear(d, inner, rngs=rngs, **kw)
        self.down_proj = Linear(inner, d, rngs=rngs, **kw)
        self.act = activation(config.hidden_activation)

    def __call__(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4TextRouter(nnx.Module):
    """Each token's ``top_k_experts`` experts: the softmax of ``proj`` over the token normalised (no scale),
    times ``scale`` and ``hidden_size ** -0.5``; the top-k probabilities renormalised, then times their experts'
    ``per_expert_scale``."""

    def __init__(self, config, *, dtype, param_dtype, rngs):
        d, count = config.hidden_size, config.num_experts
        self.norm = RMSNorm(d, epsilon=config.rms_norm_eps, with_scale=False)
        self.proj = Linear(
            d, count, use_bias=False, kernel_init=normal(config.initializer_range), dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.scale = NamedAsIs(jnp.ones((d,), param_dtype))  # PyTorch's router.scale, no norm's weight
        self.per_expert_scale = nnx.Param(jnp.ones((count,), param_dtype))
        self.top_k, self.root = config.top_k_experts, d**-0.5

    def __call__(self, x):
        h = self.norm(x) * self.scale[...].astype(x.dtype) * jnp.asarray(self.root, x.dtype)
        probs = jax.nn.softmax(self.proj(h).astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights * self.per_expert_scale[...].astype(jnp.float32)[experts], experts


class Gemma4TextExperts(nnx.Module):
    """``num_experts`` GeGLU experts held as PyTorch holds them (``WholeExperts``): ``gate_up_proj``
    ``[experts, 2 x inner, hidden]`` (gate rows first), ``down_proj`` ``[experts, hidden, inner]``, run by
    Mixtral's grouped matmul (``grouped_experts``; over ``ep``: ``expert_parallel``). ``grouped``: LoRA
    refuses them."""

    grouped = True
    names = ("gate_up_proj", "down_proj")

    def __init__(self, config, *, expert_mesh=None, dtype, param_dtype, rngs):
        count, d, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = normal(config.initializer_range)
        self.gate_up_proj = WholeExperts(init(rngs.params(), (count, 2 * inner, d), param_dtype))
        self.down_proj = WholeExperts(init(rngs.params(), (count, d, inner), param_dtype))
        self.act, self.dtype, self.expert_mesh = activation(config.hidden_activation), dtype, expert_mesh

    def __call__(self, x, weights, experts):
        gate_up = self.gate_up_proj[...].astype(self.dtype or x.dtype)
        inner = gate_up.shape[1] // 2
        kernels = (
            jnp.swapaxes(gate_up[:, :inner], 1, 2),
            jnp.swapaxes(gate_up[:, inner:], 1, 2),
            jnp.swapaxes(self.down_proj[...].astype(gate_up.dtype), 1, 2),
        )
        if self.expert_mesh is None:
            return grouped_experts(kernels, self.act, x, weights, experts)
        return expert_parallel(self.expert_mesh, kernels, self.act, x, weights, experts)


class Gemma4TextDecoderLayer(nnx.Module):
    """Attention and the MLP (beside it the experts, with ``enable_moe_block``), each between its own norms;
    then the layer's own input gated in (``hidden_size_per_layer_input``); the output times ``layer_scalar``."""

    def __init__(self, config, layer: int, *, execution: Execution = Execution(), dtype, param_dtype, rngs):
        d, kw = config.hidden_size, dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.kind = config.layer_types[layer]
        norm = lambda: RMSNorm(d, epsilon=config.rms_norm_eps, param_dtype=param_dtype)
        self.input_layernorm = norm()
        self.self_attn = Gemma4TextAttention(config, layer, execution=execution, **kw)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        inner = config.intermediate_size * (2 if double_wide(config, layer) else 1)
        self.mlp = Gemma4TextMLP(config, inner, **kw)
        self.post_feedforward_layernorm = norm()
        self.layer_scalar = nnx.Param(jnp.ones((1,), param_dtype))
        moe = bool(config.enable_moe_block)
        self.router = Gemma4TextRouter(config, **kw) if moe else None
        self.experts = Gemma4TextExperts(config, expert_mesh=execution.experts, **kw) if moe else None
        if moe:
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
            self.pre_feedforward_layernorm_2 = norm()
        width, init = config.hidden_size_per_layer_input or 0, normal(config.initializer_range)
        self.per_layer_input_gate = Linear(d, width, use_bias=False, kernel_init=init, **kw) if width else None
        if width:
            self.per_layer_projection = Linear(width, d, use_bias=False, kernel_init=init, **kw)
            self.post_per_layer_input_norm = norm()
        self.act = activation(config.hidden_activation)

    def __call__(self, x, masks, ropes, *, per_layer_input=None, shared=None, cache=None, index=0, rngs=None):
        """The output and ``(cache, kv)``: the layer's cache and what a "store" layer passes on (see
        ``Gemma4TextAttention``); ``masks`` and ``ropes`` by layer kind, this layer reads its own."""
        a, cache, kv = self.self_attn(
            self.input_layernorm(x), masks[self.kind], ropes[self.kind], shared=shared, cache=cache, index=index,
            rngs=rngs,
        )  # fmt: skip
        x = x + self.post_attention_layernorm(a)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            flat = x.reshape(-1, x.shape[-1])
            weights, experts = self.router(flat)
            routed = self.experts(self.pre_feedforward_layernorm_2(flat), weights, experts).astype(x.dtype)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed.reshape(x.shape))
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_input_gate is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        scalar = jax.lax.stop_gradient(self.layer_scalar[...])  # a buffer in transformers: never trained
        return x * scalar.astype(x.dtype), (cache, kv)


class Gemma4TextModel(nnx.Module):
    """The decoder stack, each layer run under ``execution.remat`` with its weight gather: unrolled, or scanned
    (``execution.scan_layers``) in groups of its layer kinds' repeating pattern (``layers.Grouped``; every layer
    alike: ``layers.Stacked``), each place's caches and per-layer inputs stacked over the groups. Layers that
    share keys and values (``num_kv_shared_layers``) stay unrolled (see ``scannable``). ``attention_mask``
    ``[batch, seq]`` (with a cache: over its ``max_len`` positions) and ``position_ids`` as Llama's
    (``llama.modeling.LlamaModel``)."""

    hf_architecture = "Gemma4TextModel"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        if config.use_bidirectional_attention == "all":
            raise JaxseqError("use_bidirectional_attention='all' is not supported; jaxseq's Gemma 4 is causal")
        if execution.scan_layers and config.num_kv_shared_layers:
            raise JaxseqError(f"scan_layers cannot scan this Gemma 4: {scannable(config)}; leave scan_layers off")
        readable(config)  # jax compares two models' configs field by field, per-layer fields included
        self.config, self.dtype = config, dtype
        self.kinds = tuple(config.layer_types[: config.num_hidden_layers])
        self.windows, self.sharing = layer_windows(config), sharing(config)
        for kind in set(self.kinds):
            rope_frequencies(config, kind)  # an unsupported rope type stops here, in one line
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        init = normal(config.initializer_range)
        d = config.hidden_size
        self.embed_tokens = nnx.Embed(padded_vocab_size(config.vocab_size), d, embedding_init=init, **kw)
        self.layers = blocks(
            lambda i, rngs: Gemma4TextDecoderLayer(
                config, i, execution=execution, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            ),
            config.num_hidden_layers,
            rngs,
            execution,
            kinds=self.kinds,  # scanned, in groups of their pattern (layers.Grouped)
        )
        self.norm = RMSNorm(d, epsilon=config.rms_norm_eps, param_dtype=param_dtype)
        self.per_layer_width = config.hidden_size_per_layer_input or 0
        if self.per_layer_width:
            total = config.num_hidden_layers * self.per_layer_width
            self.embed_tokens_per_layer = nnx.Embed(config.vocab_size_per_layer_input, total, embedding_init=init, **kw)
            self.per_layer_model_projection = Linear(d, total, use_bias=False, kernel_init=init, **kw)
            self.per_layer_projection_norm = RMSNorm(
                self.per_layer_width, epsilon=config.rms_norm_eps, param_dtype=param_dtype
            )
        self.remat = execution.remat

    def per_layer_inputs(self, input_ids, x):
        """``[batch, seq, layers, hidden_size_per_layer_input]``: each layer's slice of the per-layer token
        embedding (times ``sqrt(width)``) and of the projected embeddings ``x`` (times ``hidden_size ** -0.5``,
        normalised), summed and times ``2 ** -0.5``."""
        shape = (*input_ids.shape, self.config.num_hidden_layers, self.per_layer_width)
        tokens = embedding_lookup(self.embed_tokens_per_layer, input_ids, self.config.pad_token_id)
        tokens = (tokens * jnp.asarray(self.per_layer_width**0.5, tokens.dtype)).reshape(shape)
        projected = self.per_layer_model_projection(x) * jnp.asarray(self.config.hidden_size**-0.5, x.dtype)
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + tokens) * jnp.asarray(2.0**-0.5, x.dtype)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        seq = input_ids.shape[1]
        index = 0 if cache is None else cache.index
        if position_ids is None:
            position_ids = (index + jnp.arange(seq, dtype=jnp.int32))[None, :]
        kinds = tuple(dict.fromkeys(self.kinds))
        ropes = {kind: rope(self.config, kind, position_ids) for kind in kinds}
        masks = {kind: self.mask(attention_mask, seq, cache, index, kind) for kind in kinds}
        x = embedding_lookup(self.embed_tokens, input_ids, self.config.pad_token_id)
        x = x * jnp.asarray(self.config.hidden_size**0.5, x.dtype)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_width else None
        if isinstance(self.layers, Unrolled):
            x, layer_caches = self.unrolled(x, per_layer, masks, ropes, cache, index, rngs)
        else:
            own = {} if cache is None else {"cache": cache.layers}
            if per_layer is not None:  # each layer's slice, laid out as the stack takes it
                own["per_layer_input"] = self.layers.arrange([per_layer[:, :, i] for i in range(len(self.kinds))])
            x, outs = self.layers(self.remat, x, masks, ropes, per_layer=own, index=index, rngs=rngs)
            layer_caches = outs[0] if isinstance(self.layers, Stacked) else tuple(out[0] for out in outs)
        if cache is not None:
            cache = cache._replace(layers=layer_caches, index=cache.index + seq)
        return BaseOutput(self.norm(x), cache)

    def unrolled(self, x, per_layer, masks, ropes, cache, index, rngs):
        """``x`` through the unrolled layers in order, each KV-shared layer given what its kind's "store" layer
        passed on; returns the output and each layer's cache."""
        shared, layer_caches = {}, []
        for i, kind in enumerate(self.kinds):
            x, (layer_cache, kv) = self.layers.call(
                i, self.remat, x, masks, ropes, per_layer_input=None if per_layer is None else per_layer[:, :, i],
                shared=shared.get(kind) if self.sharing[i] == "reuse" else None,
                cache=None if cache is None else cache.layers[i], index=index, rngs=rngs,
            )  # fmt: skip
            if kv is not None:
                shared[kind] = kv
            layer_caches.append(layer_cache)
        return x, tuple(layer_caches)

    def mask(self, attention_mask, seq: int, cache: Cache | None, index, kind: str) -> AttentionMask:
        """The causal mask of the layers of ``kind``: over this call's positions, the cache's positions, or a
        sliding window's rolling cache and this call's positions."""
        window = self.config.sliding_window if kind == SLIDING else None
        if cache is None:
            return self_attention_mask(attention_mask, seq, causal=True, window=window)
        # the first layer of its kind that keeps a cache: scanned, one of the first group (Cache.max_len)
        layer = next(i for i, k in enumerate(self.kinds) if k == kind and self.sharing[i] != "reuse")
        length = cache.max_len(layer)
        if window is None:
            return AttentionMask(make_mask(attention_mask, seq, length, causal=True, index=index))
        return ring_mask(attention_mask, seq, length, index, window)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        """Zero keys/values of each layer that computes its own (a KV-shared layer's entry is None), its
        kind's key/value heads and head size, for ``max_len`` positions or a sliding layer's window."""
        dtype = dtype or self.dtype
        layers = tuple(
            None
            if mode == "reuse"
            else KVCache.zeros(batch, min(window or max_len, max_len), *reversed(layer_shape(self.config, i)), dtype)
            for i, (window, mode) in enumerate(zip(self.windows, self.sharing))
        )
        return Cache(self.layers.arrange(layers), jnp.zeros((), jnp.int32))  # as the stack takes them


class Gemma4ForCausalLM(LlamaForCausalLM):
    """The decoder with its language-model head (tied unless ``tie_word_embeddings`` is false), the logits
    soft-capped by ``final_logit_softcapping``."""

    hf_architecture = "Gemma4ForCausalLM"
    base = Gemma4TextModel
