"""Llama as jaxseq knows it: its classes per task, checkpoint names, partition rules, size and FLOPs; Mistral,
Qwen2, Qwen3, Gemma 2 and Gemma 3 (``jaxseq/models/mistral``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3_text``)
declare themselves with ``llama_family``."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.family import Family
from jaxseq.models.layers import repeating_period
from jaxseq.models.llama.modeling import (
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    head_dim,
    layer_windows,
)

# Megatron-style, as GPT-2: q/k/v, gate and up split by output column over mp, o and down by input row; the
# other kernel dimension over fsdp; embeddings and the head by vocabulary. k/v's columns are kv_heads x head_dim:
# whole key/value heads per device when mp divides num_key_value_heads, else each head's features split over mp
# (mp divides kv_heads * head_dim), which GSPMD gathers where attention needs them: the same numbers either way
# (tests/test_llama.py runs one key/value head on mp=2).
PARTITION_RULES = (
    (r"embed_tokens/embedding$", P("mp", "fsdp")),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P("fsdp", "mp")),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/bias$", P("mp")),
    (r"(o_proj|down_proj)/kernel$", P("mp", "fsdp")),
    (r"(o_proj|down_proj)/bias$", P()),
    (r"(input_layernorm|post_attention_layernorm|(pre|post)_feedforward_layernorm|q_norm|k_norm|norm)/scale$", P()),
    (r"lm_head/kernel$", P("fsdp", "mp")),
    (r"score/kernel$", P("fsdp", None)),
)


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Per layer: q and o (d x heads x head_dim each), k and v (d x kv_heads x head_dim each: grouped-query
    attention shares them) and the SwiGLU MLP (gate, up: d x I; down: I x d); causal attention of every query
    head over ``seq_len``, a sliding-window layer's over its window (``layer_windows``); then the task head.
    Qwen3's q/k norms and Gemma's extra norms, embedding scale and soft-caps are no matrix products: they count
    nothing (Gemma's GeGLU has SwiGLU's three matrices)."""
    d, dim, inner = config.hidden_size, head_dim(config), config.intermediate_size
    heads, kv_heads, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    tokens = rows * seq_len
    layer = 2 * d * heads * dim + 2 * d * kv_heads * dim + 3 * d * inner
    attention = sum(
        flops.attention(1, heads * dim, seq_len, seq_len, rows=rows, causal=True, window=window, training=training)
        for window in layer_windows(config)
    )
    return (
        flops.dense(layers * layer, tokens, training=training)
        + attention
        + flops.head(config, task, d, rows=rows, tokens=tokens, training=training)
    )


def llama_family(model_type: str, name: str, base: type, causal_lm: type, classifier: type) -> Family:
    """The family of ``model_type``: Llama's architecture under its own classes (what an export names)."""
    return Family(
        model_type=model_type,
        name=name,
        tasks={"base": base, "causal-lm": causal_lm, "sequence-classification": classifier},
        base_prefix="model",
        heads=(r"^lm_head\.", r"^score\."),
        lora_targets=r"/(q_proj|v_proj)/kernel$",
        vocab_params=((r"embed_tokens/embedding$", 0), (r"lm_head/kernel$", 1)),
        aliases={"lm_head.weight": "model.embed_tokens.weight"},
        ignore=(r"\.rotary_emb\.inv_freq$",),
        partition_rules=PARTITION_RULES,
        flops=model_flops,
        scans=lambda config: repeating_period(layer_windows(config)) is not None,  # windows in a pattern (Grouped)
    )


FAMILY = llama_family("llama", "Llama", LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification)
