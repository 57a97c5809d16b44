"""Qwen3.5-MoE's text decoder: Qwen3.5's layers (``jaxseq.models.qwen3_5_text``) with every MLP a sparse mixture of
experts (Qwen3-MoE's, ``jaxseq.models.mixtral``'s block: ``mlp.gate`` the router, ``mlp.experts.N.gate_proj/up_proj/
down_proj`` the experts, ``moe_intermediate_size`` wide, their top-k weights always renormalised) beside a shared
expert (``mlp.shared_expert``, ``shared_expert_intermediate_size`` wide) that every token goes through, scaled by
``sigmoid(mlp.shared_expert_gate(x))``."""

from __future__ import annotations

import jax
from flax import nnx

from jaxseq.models.execution import Execution
from jaxseq.models.layers import Linear, activation, normal
from jaxseq.models.llama.modeling import LlamaForCausalLM
from jaxseq.models.mixtral.modeling import Experts, SparseMoeBlock, layer_stats, load_balancing_loss
from jaxseq.models.outputs import BaseOutput
from jaxseq.models.qwen3_5_text.modeling import Qwen3_5DecoderLayer, Qwen3_5TextModel
from jaxseq.models.qwen3_moe.modeling import QWEN_EXPERT


class SharedExpert(nnx.Module):
    """A SwiGLU MLP ``inner`` wide: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config, inner: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        d = config.hidden_size
        kw = dict(use_bias=False, kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype,
                  rngs=rngs)  # fmt: skip
        self.gate_proj, self.up_proj, self.down_proj = (
            Linear(d, inner, **kw),
            Linear(d, inner, **kw),
            Linear(inner, d, **kw),
        )
        self.act = activation(config.hidden_act)

    def __call__(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen3_5MoeSparseMoeBlock(SparseMoeBlock):
    """Mixtral's sparse block over ``num_experts`` experts, plus the gated shared expert."""

    def __init__(self, config, *, expert_mesh=None, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        d, count, init = config.hidden_size, config.num_experts, normal(config.initializer_range)
        self.gate = Linear(d, count, use_bias=False, kernel_init=init, **kw)
        self.experts = Experts(config, count, config.moe_intermediate_size, QWEN_EXPERT, **kw)
        self.top_k, self.normalise = config.num_experts_per_tok, True
        self.act, self.dtype, self.expert_mesh = activation(config.hidden_act), dtype, expert_mesh
        self.shared_expert = SharedExpert(config, config.shared_expert_intermediate_size, **kw)
        self.shared_expert_gate = Linear(d, 1, use_bias=False, kernel_init=init, **kw)
        self.shared = config.shared_expert_intermediate_size > 0  # 0 wide: zero-width weights, adding nothing

    def __call__(self, x, key_mask=None):
        y, stats = super().__call__(x, key_mask)
        if self.shared:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y, stats


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    def feed_forward(self, config, execution: Execution, **kw):
        """The sparse MoE block, its experts split as ``execution`` says (``ep``)."""
        return Qwen3_5MoeSparseMoeBlock(config, expert_mesh=execution.experts, **kw)

    def mix(self, x, tokens):
        return self.mlp(x, tokens)


class Qwen3_5MoeTextModel(Qwen3_5TextModel):
    """Qwen3.5's stack with MoE layers; without a cache and with ``output_router_logits``, its output carries the
    router's load balancing loss times ``router_aux_loss_coef`` (``aux_loss``), as Mixtral's."""

    hf_architecture = "Qwen3_5MoeTextModel"
    layer_class = Qwen3_5MoeDecoderLayer

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        out, stats = self.run(input_ids, attention_mask, position_ids, cache=cache, rngs=rngs)
        if cache is not None or not getattr(self.config, "output_router_logits", False):
            return out
        aux = self.config.router_aux_loss_coef * load_balancing_loss(layer_stats(stats))
        return BaseOutput(out.last_hidden_state, aux_loss=aux)


class Qwen3_5MoeForCausalLM(LlamaForCausalLM):
    hf_architecture = "Qwen3_5MoeForCausalLM"
    base = Qwen3_5MoeTextModel
