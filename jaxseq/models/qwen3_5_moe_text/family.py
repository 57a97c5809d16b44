"""Qwen3.5-MoE as jaxseq knows it: Qwen3.5's family with the experts' partition rules (split over ``ep``) and
FLOPs that count the routed experts each token goes to and the shared expert."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models.mixtral.family import MOE_RULES
from jaxseq.models.qwen3_5_moe_text.modeling import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextModel
from jaxseq.models.qwen3_5_text.family import qwen3_5_family


def moe_weights(config) -> int:
    """Per token: the router (hidden x experts), ``num_experts_per_tok`` experts and the shared expert (3 x hidden x
    their widths), and the shared expert's gate (hidden x 1)."""
    d = config.hidden_size
    routed = config.num_experts_per_tok * 3 * d * config.moe_intermediate_size
    return d * config.num_experts + routed + 3 * d * config.shared_expert_intermediate_size + d


FAMILY = qwen3_5_family(
    "qwen3_5_moe_text",
    "Qwen3.5-MoE",
    {"base": Qwen3_5MoeTextModel, "causal-lm": Qwen3_5MoeForCausalLM},
    moe_weights,
    rules=((r"shared_expert_gate/kernel$", P("fsdp", None)), *MOE_RULES),
)
