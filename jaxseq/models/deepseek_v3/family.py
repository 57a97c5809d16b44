"""DeepSeek-V3 as jaxseq knows it: Llama's family under DeepSeek-V3's classes, with the latent attention's and the
experts' partition rules, LoRA targets, scanning and FLOPs."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.deepseek_v3.modeling import (
    DeepseekV3ForCausalLM,
    DeepseekV3ForSequenceClassification,
    DeepseekV3Model,
    dense_layers,
)
from jaxseq.models.llama.family import PARTITION_RULES, llama_family
from jaxseq.models.mixtral.family import MOE_RULES

# the down-projections into the latents (q_a_proj, kv_a_proj_with_mqa: a few hundred features, read whole by
# every head) split over fsdp alone; the up-projections out of them (q_b_proj, kv_b_proj) by output column,
# which runs head by head, over mp, as q_proj; the router's correction bias whole. Then Mixtral's experts
# (shared experts and dense MLPs as Llama's MLP) and Llama's rules.
MLA_RULES = (
    (r"(q_a_proj|kv_a_proj_with_mqa)/kernel$", P("fsdp", None)),
    (r"(q_a_proj|kv_a_proj_with_mqa)/bias$", P()),
    (r"(q_b_proj|kv_b_proj)/kernel$", P("fsdp", "mp")),
    (r"(q_a_layernorm|kv_a_layernorm)/scale$", P()),
    (r"gate/e_score_correction_bias$", P()),
)


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Per layer: the queries (``q_proj``, or ``q_a_proj`` and ``q_b_proj``), the latent and shared rotary key
    (``kv_a_proj_with_mqa``), every head's keys and values out of the latent (``kv_b_proj``) and ``o_proj``;
    causal attention whose scores run over ``qk_nope_head_dim + qk_rope_head_dim`` features a head and whose
    mixing over ``v_head_dim``; a dense layer's SwiGLU MLP (3 x hidden x intermediate), a MoE layer's router
    (hidden x experts), the ``num_experts_per_tok`` routed experts each token goes to and the shared experts
    (3 x hidden x moe_intermediate each); then the task head."""
    d, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    nope, rope, v_dim, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
    qk, tokens = nope + rope, rows * seq_len
    q_rank = config.q_lora_rank
    queries = d * heads * qk if q_rank is None else d * q_rank + q_rank * heads * qk
    attention = queries + d * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * d
    expert = 3 * d * config.moe_intermediate_size
    moe = d * config.num_local_experts + (config.num_experts_per_tok + config.n_shared_experts) * expert
    mlps = sum(3 * d * config.intermediate_size if dense else moe for dense in dense_layers(config))
    # flops.attention counts two products of one width: the scores' (heads x qk) and the mixing's (heads x v)
    width = heads * (qk + v_dim) / 2
    return (
        flops.dense(layers * attention + mlps, tokens, training=training)
        + flops.attention(layers, width, seq_len, seq_len, rows=rows, causal=True, training=training)
        + flops.head(config, task, d, rows=rows, tokens=tokens, training=training)
    )


FAMILY = dataclasses.replace(
    llama_family(
        "deepseek_v3", "DeepSeek-V3", DeepseekV3Model, DeepseekV3ForCausalLM, DeepseekV3ForSequenceClassification
    ),
    partition_rules=MLA_RULES + MOE_RULES + PARTITION_RULES,
    # PEFT has no default for DeepSeek-V3: the queries and the keys/values out of the latent, as Llama's q/v
    lora_targets=r"/(q_proj|q_b_proj|kv_b_proj)/kernel$",
    # the multi-token prediction module that DeepSeek-V3's checkpoints keep after the last layer (transformers
    # skips it too)
    ignore=(r"\.rotary_emb\.inv_freq$", r"^model\.layers\.61\."),
    flops=model_flops,
    scans=None,  # dense layers first, then the MoE ones as one scan (DenseThenStacked)
)
