"""Mixtral as jaxseq knows it: Llama's family under Mixtral's classes, with the experts' partition rules and
FLOPs."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.llama.family import PARTITION_RULES, llama_family
from jaxseq.models.llama.family import model_flops as llama_flops
from jaxseq.models.mixtral.modeling import (
    MixtralForCausalLM,
    MixtralForSequenceClassification,
    MixtralModel,
    moe_layers,
)

# the experts' stacked kernels [experts, in, out] split by expert over ep, and each expert as the dense MLP:
# gate and up (Mixtral's w1, w3; Qwen3-MoE's gate_proj, up_proj) by output column over mp, down (w2,
# down_proj) by input row; the other dimension over fsdp. The router's small [hidden, experts] kernel over fsdp.
MOE_RULES = (
    (r"experts/(w1|w3|gate_proj|up_proj)$", P("ep", "fsdp", "mp")),
    (r"experts/(w2|down_proj)$", P("ep", "mp", "fsdp")),
    (r"(block_sparse_moe|mlp)/gate/kernel$", P("fsdp", None)),
)


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Llama's count with each layer's MLP replaced by the router (hidden x experts) and the
    ``num_experts_per_tok`` experts each token goes to (3 x hidden x intermediate each): never all experts;
    Qwen3-MoE's dense layers (``moe_layers``) keep Llama's MLP."""
    d, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    tokens = rows * seq_len
    expert = getattr(config, "moe_intermediate_size", None) or inner  # Qwen3-MoE's experts are narrower
    moe = d * config.num_local_experts + config.num_experts_per_tok * 3 * d * expert
    mlps = sum(moe if sparse else 3 * d * inner for sparse in moe_layers(config))
    return (
        llama_flops(config, task, rows, seq_len, target_len, training)
        - flops.dense(layers * 3 * d * inner, tokens, training=training)
        + flops.dense(mlps, tokens, training=training)
    )


FAMILY = dataclasses.replace(
    llama_family("mixtral", "Mixtral", MixtralModel, MixtralForCausalLM, MixtralForSequenceClassification),
    partition_rules=MOE_RULES + PARTITION_RULES,
    flops=model_flops,
)
