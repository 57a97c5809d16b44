"""DeepSeek-V3 (DeepSeek-AI 2024), as Flax NNX modules whose parameter paths mirror transformers' PyTorch names
(``model/layers/3/self_attn/kv_b_proj/kernel`` is ``model.layers.3.self_attn.kv_b_proj.weight``).

Llama's pre-norm decoder with two changes. Multi-head latent attention (MLA): the queries come from
``q_proj``, or through a low-rank bottleneck (``q_a_proj``, RMSNorm ``q_a_layernorm``, ``q_b_proj``) when the
config has a ``q_lora_rank``; keys and values from one small latent per token, ``kv_a_proj_with_mqa``'s
``kv_lora_rank`` features (RMS-normalised by ``kv_a_layernorm``, then expanded to every head's key part without
position, ``qk_nope_head_dim``, and its value, ``v_head_dim``, by ``kv_b_proj``) and ``qk_rope_head_dim``
features of a key part with rotary position that every head shares. Each query and key is its part without
position followed by its rotated part; ``rope_interleave`` reads the rotated features as neighbouring pairs, as
transformers applies it. YaRN's rope scales the rotations by its attention factor and, with
``mscale_all_dim``, the softmax scale by ``mscale(factor, mscale_all_dim)**2``. The KV cache holds the latent
(normalised) and the rotated shared key part alone, one "head" of ``kv_lora_rank`` and one of
``qk_rope_head_dim`` per position; attention over it absorbs ``kv_b_proj`` into the queries and the output
(``DeepseekV3Attention.attend_latents``) instead of expanding every cached position as transformers does.

A mixture of experts after the first ``first_k_dense_replace`` layers (which keep a dense MLP of
``intermediate_size``): the router's sigmoid scores plus ``e_score_correction_bias`` choose, among the
``topk_group`` of ``n_group`` expert groups with the best sums of their two best scores, each token's
``num_experts_per_tok`` experts; their weights are the scores without the bias (renormalised with
``norm_topk_prob``) times ``routed_scaling_factor``; the routed experts (Mixtral's dropless grouped matmul,
split over ``ep``) and ``n_shared_experts`` shared experts (one SwiGLU MLP, ``n_shared_experts x
moe_intermediate_size`` wide) are summed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.models.attention import AttentionMask, Cache, KVCache, attend, merge_heads, split_heads, update_kv
from jaxseq.models.execution import Execution
from jaxseq.models.layers import (
    Linear,
    Stacked,
    Unrolled,
    activation,
    call_block,
    deinterleave,
    dot_general,
    normal,
)
from jaxseq.models.llama.modeling import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaMLP,
    LlamaModel,
    apply_rotary,
    rope_parameters,
)
from jaxseq.models.mixtral.modeling import Experts, expert_parallel, grouped_experts
from jaxseq.models.qwen3_moe.modeling import QWEN_EXPERT

LATENT_NORM_EPSILON = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with their default epsilon


def dense_layers(config) -> tuple[bool, ...]:
    """Which layers keep a dense MLP (the first ``first_k_dense_replace``; the rest are MoE)."""
    first = config.first_k_dense_replace or 0
    return tuple(i < first for i in range(config.num_hidden_layers))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' ``yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for a scaled rope with
    ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    kind, params = rope_parameters(config)
    if kind != "default" and params.get("mscale_all_dim"):
        scale = scale * yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def widened(x: jax.Array, width: int) -> jax.Array:
    """``x`` padded with zeros to ``width`` features: the attention kernels take one width for queries, keys and
    values, and zero features add nothing to the scores (queries, keys) or give outputs that are cut off
    (values)."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


class DeepseekV3Attention(nnx.Module):
    """Multi-head latent attention, causal over every earlier position; its cache is a ``KVCache`` whose ``k``
    holds the normalised latents ``[batch, 1, max_len, kv_lora_rank]`` and ``v`` the rotated shared key parts
    ``[batch, 1, max_len, qk_rope_head_dim]``."""

    dropout_field = "attention_dropout"  # the config's attention dropout (see attention.choose_kernel)

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
        d, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank, q_rank = config.kv_lora_rank, config.q_lora_rank
        qk = self.nope + self.rope_dim
        bias = bool(config.attention_bias)
        kw = dict(kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(epsilon=LATENT_NORM_EPSILON, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if q_rank is None:
            self.q_proj = Linear(d, heads * qk, use_bias=False, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(d, q_rank, use_bias=bias, **kw)
            self.q_a_layernorm = nnx.RMSNorm(q_rank, **norm)
            self.q_b_proj = Linear(q_rank, heads * qk, use_bias=False, **kw)
        self.kv_a_proj_with_mqa = Linear(d, self.rank + self.rope_dim, use_bias=bias, **kw)
        self.kv_a_layernorm = nnx.RMSNorm(self.rank, **norm)
        self.kv_b_proj = Linear(self.rank, heads * (self.nope + self.v_dim), use_bias=False, **kw)
        self.o_proj = Linear(heads * self.v_dim, d, use_bias=bias, **kw)
        self.num_heads, self.interleave = heads, bool(config.rope_interleave)
        self.width = max(qk, self.v_dim)
        self.scale, self.softcap = softmax_scale(config), None
        self.window, self.dropout_rate = window, config.attention_dropout
        self.dtype, self.attention = dtype, execution.attention

    def __call__(self, x, masks, ropes, *, cache: KVCache | None = None, index=0, rngs=None):
        mask, rope = masks[0], ropes[0]
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = split_heads(q, self.num_heads)
        q = jnp.concatenate([q[..., : self.nope], self.rotate(q[..., self.nope :], rope)], axis=-1)
        latent, k_rot = jnp.split(self.kv_a_proj_with_mqa(x), [self.rank], axis=-1)
        latent, k_rot = self.kv_a_layernorm(latent), self.rotate(k_rot[:, :, None, :], rope)  # [b, s, 1, rope]
        if cache is not None:
            cache = update_kv(cache, latent[:, :, None, :], k_rot, index)
            y = self.attend_latents(q, *(t[:, 0].astype(q.dtype) for t in cache), mask)
        else:
            k, v = self.expand(latent, k_rot)
            y = attend(
                widened(q, self.width), k, v, mask, scale=self.scale, dropout_rate=self.dropout_rate, rngs=rngs,
                kernel=self.attention, causal=True,
            )[..., : self.v_dim]  # fmt: skip
        return self.o_proj(merge_heads(y)), cache

    def attend_latents(self, q, latents, k_rots, mask):
        """Attention of ``q`` over the cache's latents ``[batch, len, kv_lora_rank]`` and rotated shared key parts
        ``[batch, len, rope]``, ``kv_b_proj`` absorbed rather than applied to every cached position: each head's
        query without position is taken into the latent space (``q_nope W_k^T``) and scores the latents
        directly, and the softmax-weighted latents are expanded to the head's values once (``W_v``). The same
        products in another order: a step reads ``kv_lora_rank + qk_rope_head_dim`` numbers per position and
        layer, and computes no per-head keys or values of the cached positions."""
        kernel = self.kv_b_kernel(q.dtype).reshape(self.rank, self.num_heads, self.nope + self.v_dim)
        q_latent = jnp.einsum("bqhd,rhd->bqhr", q[..., : self.nope], kernel[..., : self.nope])
        scores = jnp.einsum("bqhr,bkr->bhqk", q_latent, latents, preferred_element_type=jnp.float32)
        scores += jnp.einsum("bqhe,bke->bhqk", q[..., self.nope :], k_rots, preferred_element_type=jnp.float32)
        dense = mask.dense if isinstance(mask, AttentionMask) else mask
        scores = jnp.where(dense, scores * self.scale, jnp.finfo(jnp.float32).min)
        context = jnp.einsum("bhqk,bkr->bqhr", jax.nn.softmax(scores, axis=-1).astype(latents.dtype), latents)
        return jnp.einsum("bqhr,rhv->bqhv", context, kernel[..., self.nope :])

    def kv_b_kernel(self, dtype) -> jax.Array:
        """``kv_b_proj``'s ``[kv_lora_rank, heads x (nope + v)]`` kernel as its product applies it: read directly,
        or where LoRA or QLoRA replaced the product (``dot_general``), the product of the identity."""
        proj = self.kv_b_proj
        if proj.dot_general is dot_general:
            return proj.kernel[...].astype(dtype)
        return proj(jnp.eye(self.rank, dtype=dtype))

    def rotate(self, x, rope):
        """``x``'s rotary features turned by ``rope``: with ``rope_interleave``, feature pairs ``(2i, 2i + 1)``,
        laid out as transformers returns them (the even features first, then the odd)."""
        if self.interleave:
            x = deinterleave(x)
        return apply_rotary(x, *rope)

    def expand(self, latent, k_rot):
        """Every head's keys (the part without position from the latent, then the shared rotated part) and
        values from the latents ``[batch, len, kv_lora_rank]`` and rotated parts ``[batch, len, 1, rope]``, both
        padded with zeros to ``width`` (``widened``)."""
        kv = split_heads(self.kv_b_proj(latent), self.num_heads)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k_rot = jnp.broadcast_to(k_rot.astype(k_nope.dtype), (*k_nope.shape[:-1], self.rope_dim))
        return widened(jnp.concatenate([k_nope, k_rot], axis=-1), self.width), widened(v, self.width)


class DeepseekV3MLP(LlamaMLP):
    """A SwiGLU MLP ``inner`` wide (``intermediate_size`` by default; the shared experts' is
    ``n_shared_experts x moe_intermediate_size``), without biases."""

    def __init__(self, config, inner: int | None = None, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, inner = config.hidden_size, config.intermediate_size if inner is None else inner
        kw = dict(use_bias=False, kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(d, inner, rngs=rngs, **kw)
        self.up_proj = Linear(d, inner, rngs=rngs, **kw)
        self.down_proj = Linear(inner, d, rngs=rngs, **kw)
        self.act = activation(config.hidden_act)


class DeepseekV3TopkRouter(Linear):
    """The router: a ``[hidden, experts]`` kernel (``gate.weight``) applied in float32, and the correction
    bias added to its sigmoid scores when choosing experts (``gate.e_score_correction_bias``, float32; it never
    changes a weight, so its gradient is zero)."""

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        count = config.num_local_experts
        init = normal(config.initializer_range)
        super().__init__(
            config.hidden_size,
            count,
            use_bias=False,
            kernel_init=init,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.e_score_correction_bias = nnx.Param(jnp.zeros((count,), jnp.float32))
        self.top_k, self.normalise = config.num_experts_per_tok, bool(config.norm_topk_prob)
        self.groups, self.top_groups = config.n_group or 1, config.topk_group or 1
        self.scaling = config.routed_scaling_factor

    def route(self, x) -> tuple[jax.Array, jax.Array]:
        """Each token's (``x``: ``[tokens, hidden]``) expert weights and ids ``[tokens, top_k]``."""
        scores = jax.nn.sigmoid(self.kernel_product(x))
        choice = scores + self.e_score_correction_bias[...].astype(jnp.float32)
        tokens, experts = choice.shape
        grouped = choice.reshape(tokens, self.groups, experts // self.groups)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        kept = jax.nn.one_hot(jax.lax.top_k(group_scores, self.top_groups)[1], self.groups).sum(axis=1) > 0
        kept = jnp.repeat(kept, experts // self.groups, axis=-1)
        ids = jax.lax.top_k(jnp.where(kept, choice, -jnp.inf), self.top_k)[1]
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if self.normalise:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return weights * self.scaling, ids

    def kernel_product(self, x):
        """float32 router logits (the module's ``dot_general``, so an adapter or quantised kernel applies)."""
        kernel = self.kernel[...].astype(jnp.float32)
        return self.dot_general(x.astype(jnp.float32), kernel, (((1,), (0,)), ((), ())))


class DeepseekV3MoE(nnx.Module):
    """The router (``gate``), the routed ``experts`` (Mixtral's grouped matmul, split over ``expert_mesh``'s
    ``ep``) and the ``shared_experts`` every token goes through."""

    def __init__(self, config, *, expert_mesh=None, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        inner = config.moe_intermediate_size
        self.gate = DeepseekV3TopkRouter(config, **kw)
        self.experts = Experts(config, config.num_local_experts, inner, QWEN_EXPERT, **kw)
        self.shared_experts = DeepseekV3MLP(config, inner * config.n_shared_experts, **kw)
        self.shared = config.n_shared_experts > 0  # none: zero-width weights, as transformers keeps them
        self.act, self.dtype, self.expert_mesh = activation(config.hidden_act), dtype, expert_mesh

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate.route(flat)
        kernels = self.experts.kernels(self.dtype or x.dtype)
        if self.expert_mesh is None:
            y = grouped_experts(kernels, self.act, flat, weights, ids)
        else:
            y = expert_parallel(self.expert_mesh, kernels, self.act, flat, weights, ids)
        y = y.astype(x.dtype).reshape(x.shape)
        return y + self.shared_experts(x) if self.shared else y


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer with latent attention and the mixture of experts."""

    attention_class = DeepseekV3Attention

    def feed_forward(self, config, execution: Execution, **kw) -> nnx.Module:
        return DeepseekV3MoE(config, expert_mesh=execution.experts, **kw)


class DeepseekV3DenseLayer(DeepseekV3DecoderLayer):
    """One of the first ``first_k_dense_replace`` layers: a dense MLP of ``intermediate_size``."""

    def feed_forward(self, config, execution: Execution, **kw) -> nnx.Module:
        return DeepseekV3MLP(config, **kw)


class DenseThenStacked(nnx.List):
    """A stack whose first ``first`` blocks differ from the rest: those one by one (each with its weight gather,
    as ``layers.Unrolled``), then the rest as one scanned ``layers.Stacked``, the last item, whose parameters
    unroll to layers ``first``, ``first + 1``, ... (``sharding.unstacked_path``). ``attention.run_blocks`` runs
    it as an unrolled stack of ``first + 1`` items; the last takes and returns its layers' caches stacked."""

    def __init__(self, blocks: Unrolled, first: int, execution: Execution):
        rest = iter(list(blocks)[first:])
        stacked = Stacked(lambda rngs: next(rest), len(blocks) - first, None, execution)  # the blocks as built
        super().__init__([*list(blocks)[:first], stacked])
        self.weight_gathers = blocks.weight_gathers[:first]

    def call(self, layer: int, remat: str, *args, cache=None, index=0, rngs=None, **kwargs):
        if layer < len(self.weight_gathers):
            gather = self.weight_gathers[layer]
            return call_block(self[layer], remat, *args, gather=gather, cache=cache, index=index, rngs=rngs, **kwargs)
        own = {} if cache is None else {"cache": cache}
        return self[layer](remat, *args, per_layer=own, index=index, rngs=rngs, **kwargs)


class DeepseekV3Model(LlamaModel):
    """The decoder stack: its first ``first_k_dense_replace`` layers dense, the rest MoE; scanned, the MoE layers
    are one scan after the dense ones (``DenseThenStacked``). The cache holds each layer's latents and rotated
    shared key parts."""

    hf_architecture = "DeepseekV3Model"
    layer_class = DeepseekV3DecoderLayer

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.dense = dense_layers(config)
        experts, groups = config.num_local_experts, config.n_group or 1
        if not all(self.dense) and (experts % groups or experts // groups < 2 or (config.topk_group or 1) > groups):
            raise JaxseqError(
                f"n_group={groups} must split the {experts} routed experts into groups of at least 2, and "
                f"topk_group={config.topk_group} be at most n_group"
            )
        first = sum(self.dense)
        mixed = execution.scan_layers and 0 < first < config.num_hidden_layers
        built = dataclasses.replace(execution, scan_layers=False) if mixed else execution
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=built)
        if mixed:
            self.layers = DenseThenStacked(self.layers, first, execution)

    def layer_class_of(self, layer: int) -> type:
        return DeepseekV3DenseLayer if self.dense[layer] else self.layer_class

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        """Zero latents and rotated shared key parts of every layer for ``max_len`` positions (a scanned stack's
        stacked)."""
        c, dtype = self.config, dtype or self.dtype

        def zeros(*layers):
            shape = (*layers, batch, 1, max_len)
            return KVCache(jnp.zeros((*shape, c.kv_lora_rank), dtype), jnp.zeros((*shape, c.qk_rope_head_dim), dtype))

        if isinstance(self.layers, Stacked):
            layers = zeros(len(self.dense))
        elif isinstance(self.layers, DenseThenStacked):
            first = len(self.layers.weight_gathers)
            layers = (*(zeros() for _ in range(first)), zeros(len(self.dense) - first))
        else:
            layers = tuple(zeros() for _ in self.dense)
        return Cache(layers, jnp.zeros((), jnp.int32))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    hf_architecture = "DeepseekV3ForCausalLM"
    base = DeepseekV3Model


class DeepseekV3ForSequenceClassification(LlamaForSequenceClassification):
    hf_architecture = "DeepseekV3ForSequenceClassification"
    base = DeepseekV3Model
