"""Llama (Touvron et al. 2023) and the families that reuse its architecture with a few switches, Mistral
(Jiang et al. 2023), Qwen2 (Yang et al. 2024), Qwen3 (Yang et al. 2025), Gemma 2 (Gemma Team 2024) and Gemma 3's
text decoder (Gemma Team 2025), as Flax NNX modules whose parameter
paths mirror transformers' PyTorch names (``model/layers/0/self_attn/q_proj/kernel`` is
``model.layers.0.self_attn.q_proj.weight``).

A pre-norm decoder: RMSNorm; rotary embeddings over whole heads (transformers' "rotate half", not GPT-J's
neighbouring pairs) with ``rope_theta`` and the scalings of ``rope_parameters`` (``ROPE_TYPES``);
grouped-query attention (``num_key_value_heads`` key/value heads, each read by ``num_attention_heads /
num_key_value_heads`` query heads; the KV cache holds the key/value heads only, and a sliding-window layer's
holds only its window: ``attention.ring_positions``); a SwiGLU MLP
(``down(silu(gate(x)) * up(x))``); an LM head tied to the token embeddings or not. What differs between the
families is read from the config as transformers reads it: the biases (``attention_biases``), the
sliding windows (``layer_windows``), Qwen3's and Gemma 3's RMSNorm of each query and key head before the
rotation (``qk_norms``), and Gemma's changes (``gemma``): RMSNorm scaled by ``1 + weight`` (``OffsetRMSNorm``),
embeddings times ``sqrt(hidden_size)``, GeGLU (``hidden_activation``), norms before and after attention and the
MLP, ``query_pre_attn_scalar``, tanh soft-capping of the attention and final logits, and Gemma 3's rope per
layer kind (``rope_parameters["sliding_attention"]`` for sliding layers).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.models.attention import (
    AttentionMask,
    Cache,
    KVCache,
    attend,
    attend_cache,
    attend_ring,
    make_mask,
    merge_heads,
    merge_sequence,
    ring_mask,
    run_blocks,
    self_attention_mask,
    split_heads,
    split_mask,
    split_sequence,
    update_kv,
    update_ring,
)
from jaxseq.models.execution import Execution
from jaxseq.models.heads import DecoderLM, LastTokenClassifier
from jaxseq.models.layers import (
    Linear,
    activation,
    blocks,
    embedding_lookup,
    normal,
    padded_vocab_size,
    tied_logits,
)
from jaxseq.models.outputs import BaseOutput

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GEMMA = ("gemma2", "gemma3_text")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_biases(config) -> tuple[bool, bool]:
    """Whether q/k/v and o_proj have biases: Qwen2's q/k/v always and its o_proj never; Llama's and Qwen3's all
    four if ``attention_bias``; Mistral's none."""
    if config.model_type == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def qk_norms(config) -> bool:
    """Whether each query and key head is RMS-normalised (over ``head_dim``, own weights ``q_norm``, ``k_norm``)
    before the rotation: Qwen3's (and Qwen3-MoE's) and Gemma 3's."""
    return config.model_type in ("qwen3", "qwen3_moe", "gemma3_text")


def gemma(config) -> bool:
    """Whether the config is a Gemma decoder's (``GEMMA``): its norms, embedding scale, GeGLU and soft-caps."""
    return config.model_type in GEMMA


class OffsetRMSNorm(nnx.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + scale)`` in float32 (``scale`` starts at zero), cast back."""

    def __init__(self, dim: int, *, epsilon: float, dtype, param_dtype, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.epsilon, self.dtype = epsilon, dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def rms_norm(config, dim: int, **kw) -> nnx.Module:
    """The family's RMSNorm over ``dim`` features: Gemma's ``OffsetRMSNorm``, else ``nnx.RMSNorm``."""
    return (OffsetRMSNorm if gemma(config) else nnx.RMSNorm)(dim, epsilon=config.rms_norm_eps, **kw)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma's logit soft-capping); ``x`` itself without a cap."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full causal attention), as transformers applies the config:
    Mistral and Phi-3 slide every layer over ``sliding_window`` (if set); Qwen2, Qwen3, gpt-oss and Gemma the layers
    their ``layer_types`` call ``sliding_attention`` (Qwen's by default those from ``max_window_layers`` on, and only
    with ``use_sliding_window``, without which transformers sets ``sliding_window`` to None); Llama none."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    if config.model_type in ("mistral", "phi3"):
        return (window,) * layers
    if config.model_type in ("qwen2", "qwen3", "gpt_oss", *GEMMA) and window is not None:
        kinds = list(config.layer_types or ())
        if len(kinds) < layers:
            raise JaxseqError(
                f"the config's layer_types names {len(kinds)} layers but num_hidden_layers is {layers}; "
                "give layer_types one entry per layer (or leave it out)"
            )
        return tuple(window if kind == "sliding_attention" else None for kind in kinds[:layers])
    return (None,) * layers


# --------------------------------------------------------------------------- rotary embeddings


def rope_parameters(config, window: int | None = None) -> tuple[str, dict]:
    """The rope type and ``rope_parameters`` of the layers of ``window`` (None: full attention; Gemma 3's
    parameters per layer kind)."""
    params = getattr(config, "rope_parameters", None) or {}
    kind = "full_attention" if window is None else "sliding_attention"
    if isinstance(params.get(kind), dict):
        params = params[kind]
    return params.get("rope_type", params.get("type", "default")), params


def yarn_factor(config, params: dict) -> float:
    """YaRN's context extension factor: ``factor``, else the ratio of the positions to the original ones."""
    return params.get("factor") or config.max_position_embeddings / params["original_max_position_embeddings"]


def rope_attention_factor(config, window: int | None = None) -> float:
    """What transformers multiplies the rotary cos and sin by (its ``attention_scaling``): YaRN's
    ``attention_factor``, else ``0.1 * ln(factor) + 1`` (with ``mscale``/``mscale_all_dim``, their ratio); 1
    for the other rope types."""
    kind, params = rope_parameters(config, window)
    if kind != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = yarn_factor(config, params)

    def scale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    return float(scale(mscale) / scale(mscale_all_dim)) if mscale and mscale_all_dim else scale()


def rope_frequencies(config, window: int | None = None) -> np.ndarray:
    """float32 inverse frequencies ``[head_dim / 2]`` of the rotary embeddings, computed as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them from ``config.rope_parameters`` (``rope_type``, ``rope_theta``,
    ``factor``, llama3's ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``, and
    YaRN's ``beta_fast``, ``beta_slow``, ``truncate``); parameters per layer kind (Gemma 3's) are read for the
    layers of ``window`` (None: full attention)."""
    kind, params = rope_parameters(config, window)
    if kind not in ROPE_TYPES:
        raise JaxseqError(f"rope type {kind!r} is not supported; jaxseq supports {', '.join(ROPE_TYPES)}")
    dim = head_dim(config)
    base = np.float32(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    inv_freq = np.float32(1.0) / base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if kind == "linear":
        return inv_freq / np.float32(params["factor"])
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        wavelen = np.float32(2 * math.pi) / inv_freq
        # long wavelengths slow down by factor, short ones stay, those between blend the two smoothly
        scaled = np.where(wavelen > old_context / low, inv_freq / np.float32(factor), inv_freq)
        smooth = (np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)
        blended = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    if kind == "yarn":
        return yarn_frequencies(config, params, inv_freq)
    return inv_freq


def yarn_frequencies(config, params: dict, inv_freq: np.ndarray) -> np.ndarray:
    """YaRN (Peng et al. 2023): the frequencies that turn fewer than ``beta_slow`` times over the original
    context slowed down by the factor, those that turn more than ``beta_fast`` times kept, a linear ramp
    between."""
    dim, base = head_dim(config), params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    old_context = params["original_max_position_embeddings"]

    def dimension(rotations):  # the feature pair that turns ``rotations`` times over the original context
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(params.get("beta_fast") or 32), dimension(params.get("beta_slow") or 1)
    # transformers reads ``truncate`` from the top of rope_parameters: per layer kind (Gemma 3) it has none
    if (getattr(config, "rope_parameters", None) or params).get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = np.float32(1) - ramp  # 1: the original frequency, 0: slowed down
    periods = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    slowed = np.float32(1) / (np.float32(yarn_factor(config, params)) * periods)
    return (slowed * (1 - kept) + inv_freq * kept).astype(np.float32)


def rotary(position_ids: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """float32 ``(sin, cos)`` ``[batch, seq, 1, head_dim]`` for ``[batch, seq]`` positions: each frequency's
    angle for the first half of the features and again for the second (transformers' ``cat((freqs, freqs))``)."""
    angles = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` in float32 for ``[batch, seq, heads, head_dim]``: feature ``i`` of
    the first half turns with feature ``i`` of the second."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    return (x32 * cos + jnp.concatenate([-second, first], axis=-1) * sin).astype(x.dtype)


# --------------------------------------------------------------------------- modules


class LlamaAttention(nnx.Module):
    """Grouped-query causal self-attention over ``window`` (None: every earlier position); with a ``cache``, a
    sliding window's is a rolling one of ``window`` positions."""

    dropout_field = "attention_dropout"  # the config's attention dropout (see attention.choose_kernel)
    splits_sequence = True  # attends over a sequence split over cp (attention.context_attention)

    def __init__(
        self,
        config,
        window: int | None = None,
        *,
        execution: Execution = Execution(),
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        d, dim = config.hidden_size, head_dim(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        qkv_bias, o_bias = attention_biases(config)
        kw = dict(kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(d, heads * dim, use_bias=qkv_bias, **kw)
        self.k_proj = Linear(d, kv_heads * dim, use_bias=qkv_bias, **kw)
        self.v_proj = Linear(d, kv_heads * dim, use_bias=qkv_bias, **kw)
        self.o_proj = Linear(heads * dim, d, use_bias=o_bias, **kw)
        norm = lambda: rms_norm(config, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_norm, self.k_norm = (norm(), norm()) if qk_norms(config) else (None, None)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or dim) ** -0.5
        # Gemma 2's: XLA only (choose_kernel); transformers' Gemma 3 keeps the config field but never applies it
        self.softcap = getattr(config, "attn_logit_softcapping", None) if config.model_type == "gemma2" else None
        self.window, self.dropout_rate = window, config.attention_dropout
        self.dtype, self.attention = dtype, execution.attention

    def __call__(self, x, masks, ropes, *, cache: KVCache | None = None, index=0, rngs=None):
        """``masks``, ``ropes``: the model's masks and rotary ``(sin, cos)``, one per window; this layer reads its
        own."""
        mask, rope = next((m, r) for m, r in zip(masks, ropes) if m.window == self.window)
        q, k, v = self.heads(x, rope)
        sinks = self.sink_logits()
        if cache is not None and self.window is not None:
            y = attend_ring(q, cache, k, v, mask, scale=self.scale, softcap=self.softcap, sinks=sinks)
            cache = update_ring(cache, k, v, index)
        elif cache is not None:
            cache = update_kv(cache, k, v, index)
            y = attend_cache(q, cache, mask, scale=self.scale, softcap=self.softcap, sinks=sinks)
        else:
            y = attend(
                q, k, v, mask, scale=self.scale, dropout_rate=self.dropout_rate, rngs=rngs, kernel=self.attention,
                causal=True, softcap=self.softcap, sinks=sinks,
            )  # fmt: skip
        return self.o_proj(merge_heads(y)), cache

    def sink_logits(self) -> jax.Array | None:
        """Each head's attention sink logit (gpt-oss's), None: no sinks."""
        return None

    def heads(self, x, rope):
        """The queries and keys (rotated by ``rope``) and the values of ``x``, split into heads."""
        q = split_heads(self.q_proj(x), self.num_heads)
        k, v = (split_heads(proj(x), self.num_kv_heads) for proj in (self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v


class LlamaMLP(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, inner, bias = config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        kw = dict(
            use_bias=bias, kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.gate_proj = Linear(d, inner, **kw)
        self.up_proj = Linear(d, inner, **kw)
        self.down_proj = Linear(inner, d, **kw)
        self.act = activation(config.hidden_activation if gemma(config) else config.hidden_act)

    def __call__(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm attention and MLP; Gemma's also normalise each one's output (``post_attention_layernorm`` is
    then the attention's output norm, ``pre_feedforward_layernorm`` the MLP's input norm)."""

    mlp_class = LlamaMLP  # Mixtral's: its sparse MoE block
    attention_class = LlamaAttention  # gpt-oss's: with attention sinks

    def __init__(
        self,
        config,
        window: int | None = None,
        *,
        execution: Execution = Execution(),
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = rms_norm(config, config.hidden_size, **kw)
        self.self_attn = self.attention_class(config, window, execution=execution, **kw)
        self.post_attention_layernorm = rms_norm(config, config.hidden_size, **kw)
        if gemma(config):
            self.pre_feedforward_layernorm = rms_norm(config, config.hidden_size, **kw)
            self.post_feedforward_layernorm = rms_norm(config, config.hidden_size, **kw)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        self.mlp = self.feed_forward(config, execution, **kw)

    def feed_forward(self, config, execution: Execution, **kw) -> nnx.Module:
        """The layer's MLP, a ``mlp_class`` (Mixtral's: a sparse mixture of experts, split as ``execution`` says)."""
        return self.mlp_class(config, **kw)

    def __call__(self, x, masks, ropes, *, cache=None, index=0, rngs=None):
        a, cache = self.self_attn(self.input_layernorm(x), masks, ropes, cache=cache, index=index, rngs=rngs)
        if self.post_feedforward_layernorm is None:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), cache
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), cache


class LlamaModel(nnx.Module):
    """The decoder stack. ``attention_mask`` is ``[batch, seq]`` (1 = token, 0 = padding; or packed
    examples' segment ids); with a ``cache`` it covers the cache's ``max_len`` positions instead (see
    ``jaxseq.models.attention``). ``position_ids`` default to ``0, 1, ...`` after the cache's index; pass
    them for left padding. ``execution``: how the layers run (``models.execution``): stacked and run by one scan
    (``layers.Stacked``; layers whose windows differ in a repeating pattern, ``layers.Grouped``) or a Python
    loop, their attention kernel, remat and weight gathering."""

    hf_architecture = "LlamaModel"
    layer_class = LlamaDecoderLayer
    splits_sequence = True  # runs under a cp mesh (attention.split_sequence)

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.windows = layer_windows(config)
        self.config, self.dtype = config, dtype
        for window in set(self.windows):
            self.rope_frequencies(window)  # an unsupported rope type stops here, in one line
        if getattr(config, "use_bidirectional_attention", False):
            raise JaxseqError("use_bidirectional_attention (EmbeddingGemma's) is not supported; jaxseq is causal")
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(
            padded_vocab_size(config.vocab_size),
            config.hidden_size,
            embedding_init=normal(config.initializer_range),
            **kw,
        )
        self.embed_scale = config.hidden_size**0.5 if gemma(config) else None
        self.layers = blocks(
            lambda i, rngs: self.layer_class_of(i)(
                config, self.windows[i], execution=execution, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            ),
            config.num_hidden_layers,
            rngs,
            execution,
            kinds=self.windows,  # scanned, sliding and full layers in groups of their pattern (layers.Grouped)
        )
        self.norm = rms_norm(config, config.hidden_size, **kw)
        self.remat = execution.remat  # what each block keeps for the backward pass
        self.context = execution.attention.context  # the mesh whose cp axis splits each row's tokens

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        seq = input_ids.shape[1]
        index = 0 if cache is None else cache.index
        if position_ids is None:
            position_ids = (index + jnp.arange(seq, dtype=jnp.int32))[None, :]
        split = self.context if cache is None else None
        if split is not None:  # each device of a cp group its share of every row's tokens
            position_ids = jnp.broadcast_to(position_ids, input_ids.shape)
            input_ids, attention_mask, position_ids = split_sequence(split, input_ids, attention_mask, position_ids)
        windows = tuple(dict.fromkeys(self.windows))
        ropes = tuple(self.rope(position_ids, window) for window in windows)
        if split is None:
            masks = tuple(self.mask(attention_mask, seq, cache, index, window) for window in windows)
        else:
            masks = tuple(split_mask(attention_mask, window) for window in windows)
        x = embedding_lookup(self.embed_tokens, input_ids, self.config.pad_token_id)
        if self.embed_scale is not None:  # Gemma's, in the compute dtype as transformers rounds it
            x = x * jnp.asarray(self.embed_scale, x.dtype)
        x, cache = run_blocks(self.layers, self.remat, x, masks, ropes, cache=cache, rngs=rngs)
        x = self.norm(x)
        return BaseOutput(x if split is None else merge_sequence(split, x, seq), cache)

    def layer_class_of(self, layer: int) -> type:
        """The class of layer ``layer`` (``layer_class``; Qwen3-MoE's dense layers differ)."""
        return self.layer_class

    def rope_frequencies(self, window: int | None):
        """The rotary frequencies of the layers that attend over ``window`` (a family with its own rope
        overrides this and ``rope``)."""
        return rope_frequencies(self.config, window)

    def rope(self, position_ids, window: int | None) -> tuple[jax.Array, jax.Array]:
        """``(sin, cos)`` of ``position_ids`` for the layers that attend over ``window`` (YaRN's scaled by its
        attention factor)."""
        sin, cos = rotary(position_ids, self.rope_frequencies(window))
        scale = rope_attention_factor(self.config, window)
        return (sin, cos) if scale == 1.0 else (sin * scale, cos * scale)

    def mask(self, attention_mask, seq: int, cache: Cache | None, index, window: int | None) -> AttentionMask:
        """The causal mask of the layers that attend over ``window``: over this call's positions, the cache's
        ``max_len`` positions, or a sliding window's rolling cache and this call's positions."""
        if cache is None:
            return self_attention_mask(attention_mask, seq, causal=True, window=window)
        length = cache.max_len(self.windows.index(window))
        if window is None:
            return AttentionMask(make_mask(attention_mask, seq, length, causal=True, index=index))
        return ring_mask(attention_mask, seq, length, index, window)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        """Zero keys/values of the ``num_key_value_heads`` key/value heads of every layer, for ``max_len``
        positions, or the ``sliding_window`` latest of them in a sliding layer's rolling cache."""
        c, dtype = self.config, dtype or self.dtype
        layers = tuple(
            KVCache.zeros(batch, min(window or max_len, max_len), c.num_key_value_heads, head_dim(c), dtype)
            for window in self.windows
        )
        return Cache(self.layers.arrange(layers), jnp.zeros((), jnp.int32))  # as the stack takes them


class LlamaForCausalLM(DecoderLM):
    """The decoder with its language-model head (a separate weight unless ``tie_word_embeddings``)."""

    hf_architecture = "LlamaForCausalLM"
    base_name = "model"
    base = LlamaModel

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.model = self.base(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                config.hidden_size,
                padded_vocab_size(config.vocab_size),
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                preferred_element_type=jnp.float32,
                kernel_init=normal(config.initializer_range),
                rngs=rngs,
            )

    def logits(self, h):
        """float32 logits of hidden states ``[..., hidden_size]`` over the padded vocabulary, multiplied in
        the compute dtype and accumulated in float32; Gemma's soft-capped (``final_logit_softcapping``)."""
        if self.config.tie_word_embeddings:
            logits = tied_logits(h, self.model.embed_tokens.embedding[...], self.model.dtype)
        else:
            logits = self.lm_head(h)
        return softcap(logits, getattr(self.config, "final_logit_softcapping", None))


class LlamaForSequenceClassification(LastTokenClassifier):
    hf_architecture = "LlamaForSequenceClassification"
    base = LlamaModel
    base_name = "model"
