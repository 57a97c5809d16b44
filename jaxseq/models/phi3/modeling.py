"""Phi-3 (Abdin et al. 2024; Phi-3.5, Phi-4-mini) as Llama's modules with Phi-3's changes, parameter paths
mirroring transformers' PyTorch names (``model/layers/0/self_attn/qkv_proj/kernel`` is
``model.layers.0.self_attn.qkv_proj.weight``).

What differs from Llama (``jaxseq.models.llama``):

- fused projections: ``self_attn.qkv_proj`` is one kernel whose output columns are the query heads, then the
  key heads, then the value heads, split inside the layer; ``mlp.gate_up_proj`` holds the gate's columns, then
  the up projection's (``down(silu(gate) * up)``). The parameters are the fused kernels themselves, so loading
  and export are Llama's 1:1 renames and an exported folder is a Phi-3 checkpoint; no biases;
- rotary embeddings over the first ``partial_rotary_factor`` of each head's features (Phi-4-mini's 0.75); the
  rest pass through;
- ``rope_parameters`` of type ``longrope`` (Phi-3-mini-128k, Phi-3.5): each frequency divided by its
  ``short_factor``, or its ``long_factor`` once the longest position (``max(position_ids) + 1``) passes
  ``original_max_position_embeddings``, as transformers picks them per forward pass; sin and cos scaled by the
  attention factor ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (``factor``:
  ``max_position_embeddings / original_max_position_embeddings`` unless given). With a KV cache, keys keep the
  rotation of the pass that cached them: decoding past ``original_max_position_embeddings`` from a shorter
  prompt would rotate the new positions with the long factors and leave the cached ones as they were, where
  transformers' ``generate`` recomputes the whole prefix once at the crossing, so ``generate`` refuses it in
  one line (``rope_switch``);
- a ``sliding_window``, if set, on every layer (as Mistral's);
- dropout ``resid_pdrop`` on the attention's and the MLP's outputs in training.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.models.attention import split_heads
from jaxseq.models.execution import Execution
from jaxseq.models.layers import Linear, activation, dropout, normal
from jaxseq.models.llama.modeling import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaMLP,
    LlamaModel,
    apply_rotary,
    head_dim,
    rms_norm,
    rotary,
)

ROPE_TYPES = ("default", "longrope")


def rope_parameters(config) -> dict:
    """The config's rope parameters (transformers 5's ``rope_parameters``), checked: one line naming a rope type
    Phi-3 does not have."""
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise JaxseqError(
            f"rope_scaling type {kind!r} is not supported for phi3; jaxseq supports {' and '.join(ROPE_TYPES)}, "
            "the types transformers' Phi3Config allows"
        )
    return params


def rotary_dim(config) -> int:
    """How many of each head's features turn: ``head_dim x partial_rotary_factor``, as transformers rounds it."""
    params = rope_parameters(config)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim(config) * factor)


def rope_frequencies(config) -> tuple[np.ndarray, np.ndarray | None, int | None, float]:
    """``(short, long, original_max_position_embeddings, attention_factor)``: float32 inverse frequencies
    ``[rotary_dim / 2]`` as transformers' ``_compute_default_rope_parameters`` and
    ``_compute_longrope_parameters`` compute them; ``long`` and the original length are None without longrope."""
    params, dim = rope_parameters(config), rotary_dim(config)
    base = np.float32(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    powers = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if params.get("rope_type", params.get("type", "default")) == "default":
        return np.float32(1.0) / powers, None, None, 1.0
    original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = params.get("factor") or config.max_position_embeddings / original
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (
        np.float32(1.0) / (np.asarray(params[f], np.float32) * powers) for f in ("short_factor", "long_factor")
    )
    return short, long, int(original), float(scale)


def rotary_embedding(config, position_ids):
    """float32 ``(sin, cos)`` ``[batch, seq, 1, rotary_dim]`` for ``[batch, seq]`` positions: longrope's long
    frequencies when the largest position passes the original length (one choice for the whole batch, as
    transformers'), scaled by the attention factor."""
    short, long, original, scale = rope_frequencies(config)
    inv_freq = short if long is None else jnp.where(jnp.max(position_ids) + 1 > original, long, short)
    sin, cos = rotary(position_ids, inv_freq)
    return sin * scale, cos * scale


def apply_partial_rotary(x, sin, cos):
    """Llama's rotation (``apply_rotary``) of the first ``sin.shape[-1]`` features of each head; the rest pass."""
    turned = sin.shape[-1]
    if turned == x.shape[-1]:
        return apply_rotary(x, sin, cos)
    return jnp.concatenate([apply_rotary(x[..., :turned], sin, cos), x[..., turned:]], axis=-1)


class Phi3Attention(LlamaAttention):
    """Llama's grouped-query attention with the fused ``qkv_proj`` and the partial rotation."""

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
        kw = dict(
            use_bias=False,
            kernel_init=normal(config.initializer_range),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.qkv_proj = Linear(d, (heads + 2 * kv_heads) * dim, **kw)
        self.o_proj = Linear(heads * dim, d, **kw)
        self.splits = (heads * dim, (heads + kv_heads) * dim)  # where the key and the value columns start
        self.q_norm = self.k_norm = self.softcap = None
        self.num_heads, self.num_kv_heads, self.scale = heads, kv_heads, dim**-0.5
        self.window, self.dropout_rate = window, config.attention_dropout
        self.dtype, self.attention = dtype, execution.attention

    def heads(self, x, rope):
        """The queries and keys (their first dimensions rotated) and the values, from the fused projection."""
        q, k, v = jnp.split(self.qkv_proj(x), self.splits, axis=-1)
        q, k, v = split_heads(q, self.num_heads), split_heads(k, self.num_kv_heads), split_heads(v, self.num_kv_heads)
        return apply_partial_rotary(q, *rope), apply_partial_rotary(k, *rope), v


class Phi3MLP(LlamaMLP):
    """Llama's SwiGLU with the gate and up projections fused in ``gate_up_proj`` (the gate's columns first)."""

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, inner = config.hidden_size, config.intermediate_size
        kw = dict(
            use_bias=False,
            kernel_init=normal(config.initializer_range),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.gate_up_proj = Linear(d, 2 * inner, **kw)
        self.down_proj = Linear(inner, d, **kw)
        self.act = activation(config.hidden_act)

    def __call__(self, x):
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(self.act(gate) * up)


class Phi3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer of Phi-3's attention and MLP, each output through ``resid_pdrop`` dropout."""

    mlp_class = Phi3MLP

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
        self.self_attn = Phi3Attention(config, window, execution=execution, **kw)
        self.post_attention_layernorm = rms_norm(config, config.hidden_size, **kw)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        self.mlp = self.feed_forward(config, execution, **kw)
        self.resid_pdrop = float(getattr(config, "resid_pdrop", 0.0) or 0.0)

    def __call__(self, x, masks, ropes, *, cache=None, index=0, rngs=None):
        a, cache = self.self_attn(self.input_layernorm(x), masks, ropes, cache=cache, index=index, rngs=rngs)
        x = x + dropout(a, self.resid_pdrop, rngs)
        return x + dropout(self.mlp(self.post_attention_layernorm(x)), self.resid_pdrop, rngs), cache


class Phi3Model(LlamaModel):
    """Llama's decoder stack (its masks, KV cache and windows: every layer sliding over ``sliding_window`` if
    the config sets one) of Phi-3's layers, with Phi-3's rotary embeddings."""

    hf_architecture = "Phi3Model"
    layer_class = Phi3DecoderLayer

    def rope_frequencies(self, window):
        return rope_frequencies(self.config)

    def rope(self, position_ids, window):
        return rotary_embedding(self.config, position_ids)


class Phi3ForCausalLM(LlamaForCausalLM):
    hf_architecture = "Phi3ForCausalLM"
    base = Phi3Model

    @property
    def rope_switch(self) -> int | None:
        """The length past which longrope rotates with its long factors (None without longrope), which
        ``generation.generate`` does not cross from a shorter sequence (the cached keys keep their rotation)."""
        return rope_frequencies(self.config)[2]


class Phi3ForSequenceClassification(LlamaForSequenceClassification):
    hf_architecture = "Phi3ForSequenceClassification"
    base = Phi3Model
