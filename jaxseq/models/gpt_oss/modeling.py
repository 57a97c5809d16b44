"""gpt-oss (OpenAI 2025): Mixtral's decoder (``jaxseq.models.mixtral``, itself Llama's) with attention sinks, a
router with a bias, and experts of a clamped SwiGLU with biases, parameters named as transformers names them
(``mlp.router``, ``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 x intermediate]``, its gate and up columns
interleaved, ``gate_up_proj_bias``, ``down_proj`` ``[experts, intermediate, hidden]``, ``down_proj_bias``: whole
stacks, ``layers.WholeExperts``; ``self_attn.sinks``).

Each attention head has a learned sink logit, one more entry of its softmax's denominator that attends to nothing
(``attention._sink_softmax``; XLA only, the fused kernels have none); layers alternate between a sliding window and
full attention (``layer_types``), q/k/v/o carry biases, the rope is YaRN's (``llama.rope_frequencies``). The router
picks each token's ``num_experts_per_tok`` experts by logit and weighs them by the softmax of their logits (the
full softmax's top-k renormalised: ``mixtral.route``); an expert computes ``down((clamp(up) + 1) * glu)`` with
``glu = g * sigmoid(alpha * g)``, ``g = min(gate, limit)``, ``up`` clamped to ``[-limit, limit]``. Checkpoints whose
experts are MXFP4-quantised (the Hub's) are refused: transformers dequantises them on load and saves the float
layout jaxseq reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxseq.errors import JaxseqError
from jaxseq.models.execution import Execution
from jaxseq.models.layers import Linear, WholeExperts, deinterleave, normal
from jaxseq.models.llama.modeling import LlamaAttention
from jaxseq.models.mixtral.modeling import (
    MixtralDecoderLayer,
    MixtralForCausalLM,
    MixtralForSequenceClassification,
    MixtralModel,
    SparseMoeBlock,
    expert_parallel,
    grouped_experts,
    route,
)


class GptOssAttention(LlamaAttention):
    """Llama's attention (with q/k/v/o biases) whose softmax has a learned sink logit per head (``sinks``) in its
    denominator, in training, prefill and every cached step alike."""

    def __init__(self, config, window=None, *, param_dtype, **kw):
        super().__init__(config, window, param_dtype=param_dtype, **kw)
        rngs = kw["rngs"]
        self.sinks = nnx.Param(normal(config.initializer_range)(rngs.params(), (self.num_heads,), param_dtype))

    def sink_logits(self) -> jax.Array:
        return self.sinks[...]


class GptOssExperts(nnx.Module):
    """``count`` experts of the clamped SwiGLU as whole stacks (``WholeExperts``, transformers' layout):
    ``gate_up_proj`` ``[experts, hidden, 2 x inner]`` (gate the even columns, up the odd ones) and its bias,
    ``down_proj`` ``[experts, inner, hidden]`` and its bias. ``grouped``: LoRA refuses their kernels (``names``)."""

    grouped = True
    names = ("gate_up_proj", "down_proj")

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, inner, count = config.hidden_size, config.intermediate_size, config.num_local_experts
        init = normal(config.initializer_range)
        self.gate_up_proj = WholeExperts(init(rngs.params(), (count, d, 2 * inner), param_dtype))
        self.gate_up_proj_bias = WholeExperts(jnp.zeros((count, 2 * inner), param_dtype))
        self.down_proj = WholeExperts(init(rngs.params(), (count, inner, d), param_dtype))
        self.down_proj_bias = WholeExperts(jnp.zeros((count, d), param_dtype))
        self.alpha, self.limit, self.dtype = config.swiglu_alpha, config.swiglu_limit, dtype

    def kernels(self, dtype) -> tuple[jax.Array, ...]:
        """The stacks in ``dtype``, the fused gate/up kernel's and bias's columns reordered from interleaved
        (gate, up, gate, ...) to ``[gate | up]``: the same numbers, but the activation then splits its input in
        halves. Strided slices of the activations (``[..., ::2]``) made libtpu's compile of a 20B-parameter step
        take over 20 GB of host memory (a one-layer step: over 8 GB, against 1.6 GB reordered)."""
        gate_up, gate_up_bias, down, down_bias = (
            getattr(self, name)[...].astype(dtype)
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        )
        return deinterleave(gate_up), deinterleave(gate_up_bias), down, down_bias

    def act(self, gate_up: jax.Array) -> jax.Array:
        """The clamped SwiGLU of gate/up columns ``[..., gate | up]`` (``kernels``): ``(up + 1) * glu``."""
        gate, up = jnp.split(gate_up, 2, axis=-1)
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def biased_experts(kernels, act, h, grouped, experts):
    """gpt-oss's experts of sorted rows ``h`` (``mixtral.grouped_experts``' ``expert``): the fused gate/up
    projection and the down projection, each with its expert's bias, around ``act`` (``GptOssExperts.act``)."""
    gate_up, gate_up_bias, down, down_bias = kernels
    h = act(grouped(h, gate_up) + gate_up_bias[experts])
    return grouped(h, down) + down_bias[experts]


class GptOssMLP(SparseMoeBlock):
    """The ``router`` (with a bias) and the ``experts``; returns the output and the router statistics
    (``SparseMoeBlock``)."""

    def __init__(self, config, *, expert_mesh: Mesh | None = None, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        init = normal(config.initializer_range)
        self.router = Linear(config.hidden_size, config.num_local_experts, kernel_init=init, bias_init=init, **kw)
        self.experts = GptOssExperts(config, **kw)
        self.top_k, self.dtype, self.expert_mesh = config.num_experts_per_tok, dtype, expert_mesh

    def __call__(self, x, key_mask=None):
        flat = x.reshape(-1, x.shape[-1])
        probs, weights, experts = route(self.router(flat), self.top_k, True)
        real = jnp.ones(flat.shape[:1], jnp.float32) if key_mask is None else (key_mask.reshape(-1) != 0)
        real = real.astype(jnp.float32)
        picks = jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32).sum(axis=1)
        stats = jnp.stack([real @ picks, real @ probs])
        kernels, act = self.experts.kernels(self.dtype or x.dtype), self.experts.act
        if self.expert_mesh is None:
            y = grouped_experts(kernels, act, flat, weights, experts, expert=biased_experts)
        else:
            y = expert_parallel(self.expert_mesh, kernels, act, flat, weights, experts, expert=biased_experts)
        return y.astype(x.dtype).reshape(x.shape), stats


class GptOssDecoderLayer(MixtralDecoderLayer):
    """Mixtral's layer with gpt-oss's attention and MoE block (``mlp``)."""

    mlp_class = GptOssMLP
    attention_class = GptOssAttention
    moe_name = "mlp"

    def feed_forward(self, config, execution: Execution, **kw):
        """The MoE block, its experts split over ``execution.experts`` (ep > 1); on a fully sharded mesh without
        ep, each device routes its own rows' tokens through every expert (``expert_parallel`` with ep = 1: the
        experts' stacks whole on each device, as the block's weight gather has them) instead of sorting the
        whole batch's token-expert pairs on every device."""
        mesh = execution.experts or (execution.gather.mesh if execution.gather is not None else None)
        return self.mlp_class(config, expert_mesh=mesh, **kw)


def check_config(config) -> None:
    """One line for what jaxseq does not read: MXFP4-quantised experts (the Hub's checkpoints)."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    method = method or getattr(quantization, "quant_method", None)
    if method is not None:
        raise JaxseqError(
            f"gpt-oss checkpoints quantised with {method} are not supported; load it in transformers with "
            "Mxfp4Config(dequantize=True), save_pretrained it, and load that folder"
        )


class GptOssModel(MixtralModel):
    hf_architecture = "GptOssModel"
    layer_class = GptOssDecoderLayer

    def __init__(self, config, **kw):
        check_config(config)
        super().__init__(config, **kw)


class GptOssForCausalLM(MixtralForCausalLM):
    hf_architecture = "GptOssForCausalLM"
    base = GptOssModel


class GptOssForSequenceClassification(MixtralForSequenceClassification):
    hf_architecture = "GptOssForSequenceClassification"
    base = GptOssModel
