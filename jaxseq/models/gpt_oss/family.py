"""gpt-oss as jaxseq knows it: Mixtral's family under gpt-oss's classes, with its experts' and sinks' partition
rules and FLOPs (LoRA's default targets Mixtral's, q_proj and v_proj: PEFT has none for gpt-oss)."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.gpt_oss.modeling import GptOssForCausalLM, GptOssForSequenceClassification, GptOssModel
from jaxseq.models.llama.family import PARTITION_RULES
from jaxseq.models.llama.family import model_flops as llama_flops
from jaxseq.models.mixtral.family import FAMILY as MIXTRAL

# the experts' whole stacks split by expert over ep, and each expert as the dense MLP: the fused gate/up by
# output column over mp (an interleaved gate and up column pair stays on one device when mp divides the
# intermediate size), down by input row; the other dimension over fsdp. The router's [hidden, experts] kernel
# over fsdp; each head's sink logit whole.
MOE_RULES = (
    (r"experts/gate_up_proj$", P("ep", "fsdp", "mp")),
    (r"experts/gate_up_proj_bias$", P("ep", "mp")),
    (r"experts/down_proj$", P("ep", "mp", "fsdp")),
    (r"experts/down_proj_bias$", P("ep", None)),
    (r"mlp/router/kernel$", P("fsdp", None)),
    (r"mlp/router/bias$", P()),
    (r"self_attn/sinks$", P()),
)


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Llama's count (q/k/v/o, attention over each layer's window, the head) with each layer's MLP replaced by the
    router (hidden x experts) and the ``num_experts_per_tok`` experts each token goes to (gate/up: hidden x 2
    intermediate, down: intermediate x hidden): never all experts. Biases, sinks and the clamped SwiGLU are no
    matrix products: they count nothing."""
    d, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    tokens = rows * seq_len
    moe = d * config.num_local_experts + config.num_experts_per_tok * 3 * d * inner
    return llama_flops(config, task, rows, seq_len, target_len, training) + flops.dense(
        layers * (moe - 3 * d * inner), tokens, training=training
    )


FAMILY = dataclasses.replace(
    MIXTRAL,
    model_type="gpt_oss",
    name="gpt-oss",
    tasks={
        "base": GptOssModel,
        "causal-lm": GptOssForCausalLM,
        "sequence-classification": GptOssForSequenceClassification,
    },
    partition_rules=MOE_RULES + PARTITION_RULES,
    flops=model_flops,
)
