"""Gemma 4's text decoder as jaxseq knows it: its classes, checkpoint names, partition rules and FLOPs."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.family import Family
from jaxseq.models.gemma4_text.modeling import (
    Gemma4ForCausalLM,
    Gemma4TextModel,
    double_wide,
    layer_shape,
    layer_windows,
    scannable,
    sharing,
)

# Llama's layout (jaxseq.models.llama.family); the per-layer inputs' table (its vocabulary unpadded) split by
# feature over fsdp and mp, so each device looks up its own slice; their projection from the embeddings and
# their gate as q (by output column over mp), their projection into the layer as o (by input row); the experts'
# whole stacks, in PyTorch's [experts, out, in], split by expert over ep, each expert as the dense MLP (gate-up
# by output row over mp, down by input column); the router's kernel over fsdp.
PARTITION_RULES = (
    (r"embed_tokens/embedding$", P("mp", "fsdp")),
    (r"embed_tokens_per_layer/embedding$", P(None, ("fsdp", "mp"))),
    (r"experts/gate_up_proj$", P("ep", "mp", "fsdp")),
    (r"experts/down_proj$", P("ep", "fsdp", "mp")),
    (r"router/proj/kernel$", P("fsdp", None)),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj|per_layer_(input_gate|model_projection))/kernel$", P("fsdp", "mp")),
    (r"(q_proj|k_proj|v_proj)/bias$", P("mp")),
    (r"(o_proj|down_proj|per_layer_projection)/kernel$", P("mp", "fsdp")),
    (r"o_proj/bias$", P()),
    (r"norm(_\d)?/scale$", P()),
    (r"(router/scale|router/per_expert_scale|layer_scalar)$", P()),
    (r"lm_head/kernel$", P("fsdp", "mp")),
)


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Per layer, at its kind's head size and key/value heads: q and o, k unless the layer shares another's
    keys/values, v unless it does or its values are its keys (``attention_k_eq_v`` on a full layer); the GeGLU
    MLP (three matrices, twice as wide on a double-wide layer); with experts, the router (hidden x experts) and
    the ``top_k_experts`` experts each token goes to (three hidden x ``moe_intermediate_size`` each); with
    per-layer inputs, their gate and projection (hidden x width each). Causal attention of every query head over
    ``seq_len``, a sliding layer's over its window. Once per token: the per-layer inputs' projection (hidden x
    layers x width; their table is a lookup); then the task head. Norms, scalars and soft-caps count nothing."""
    d, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    width = config.hidden_size_per_layer_input or 0
    tokens, weights, attention = rows * seq_len, layers * d * width, 0.0
    windows = layer_windows(config)
    for layer, mode in enumerate(sharing(config)):
        dim, kv_heads = layer_shape(config, layer)
        own_values = not (config.attention_k_eq_v and windows[layer] is None)
        kv = 0 if mode == "reuse" else (1 + own_values) * d * kv_heads * dim
        inner = config.intermediate_size * (2 if double_wide(config, layer) else 1)
        weights += 2 * d * heads * dim + kv + 3 * d * inner + 2 * d * width
        if config.enable_moe_block:
            weights += d * config.num_experts + config.top_k_experts * 3 * d * config.moe_intermediate_size
        attention += flops.attention(
            1, heads * dim, seq_len, seq_len, rows=rows, causal=True, window=windows[layer], training=training
        )
    return (
        flops.dense(weights, tokens, training=training)
        + attention
        + flops.head(config, task, d, rows=rows, tokens=tokens, training=training)
    )


FAMILY = Family(
    model_type="gemma4_text",
    name="Gemma 4",
    tasks={"base": Gemma4TextModel, "causal-lm": Gemma4ForCausalLM},
    base_prefix="model",
    heads=(r"^lm_head\.",),
    lora_targets=r"/(q_proj|v_proj)/kernel$",
    vocab_params=((r"embed_tokens/embedding$", 0), (r"lm_head/kernel$", 1)),
    aliases={"lm_head.weight": "model.embed_tokens.weight"},
    ignore=(r"\.rotary_emb\.",),
    partition_rules=PARTITION_RULES,
    flops=model_flops,
    scans=lambda config: scannable(config) is None,  # in groups of its pattern, unless KV-shared (unrolled)
)
"""Gemma 4's text decoder (``model_type`` gemma4_text, Gemma 4's text tower): the modules of ``modeling``
(Gemma 3's decoder with per-layer inputs, KV sharing, head sizes and rope per layer kind, keys as values, and
an optional mixture of experts beside the MLP) under transformers' class names."""
