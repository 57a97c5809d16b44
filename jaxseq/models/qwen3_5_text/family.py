"""Qwen3.5 as jaxseq knows it: its classes per task, checkpoint names, partition rules of the linear attention
beside Llama's, and FLOPs with the chunked delta rule's own arithmetic."""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.family import Family
from jaxseq.models.layers import repeating_period
from jaxseq.models.llama.family import PARTITION_RULES
from jaxseq.models.llama.modeling import head_dim
from jaxseq.models.qwen3_5_text.modeling import (
    CHUNK,
    LINEAR,
    Qwen3_5ForCausalLM,
    Qwen3_5TextForSequenceClassification,
    Qwen3_5TextModel,
    layer_kinds,
)

# the linear attention's in-projections split by output column over mp (as q/k/v), the convolution's channels
# with them, out_proj by input row; the other kernel dimension over fsdp. The per-head a/b projections, decay
# and bias are small: replicated over mp. Llama's rules take the full-attention layers, the MLPs and the norms
# (the gated norm's ``linear_attn/norm/scale`` among them).
LINEAR_RULES = (
    (r"linear_attn/(in_proj_qkv|in_proj_z)/kernel$", P("fsdp", "mp")),
    (r"linear_attn/(in_proj_a|in_proj_b)/kernel$", P("fsdp", None)),
    (r"linear_attn/out_proj/kernel$", P("mp", "fsdp")),
    (r"linear_attn/conv1d/kernel$", P("mp", None, None)),
    (r"linear_attn/(A_log|dt_bias)$", P()),
)


def delta_rule_flops(config, rows: int, seq_len: int, training: bool = True) -> float:
    """The chunked delta rule of one linear layer (``gated_delta_chunked``), per chunk of C positions and value
    head: ``k_beta K^T`` and ``Q K^T`` (C x C x d_k each), the UT transform's inverse (``unit_lower_inverse``:
    two C x C x C products per squaring) and its products with the values and the keys (C x C x (d_v + d_k)),
    the intra-chunk ``A V`` (C x C x d_v) and the state's three products (read by the keys and the queries,
    written by the keys: C x d_k x d_v each). Linear in the sequence: the chunks, not its square."""
    c, dk, dv = CHUNK, config.linear_key_head_dim, config.linear_value_head_dim
    squarings = max(0, (c - 1).bit_length() - 1)
    macs = 2 * c * c * dk + 2 * squarings * c**3 + c * c * (dk + dv) + c * c * dv + 3 * c * dk * dv
    chunks = math.ceil(seq_len / c)
    return 2.0 * flops.passes(training) * macs * chunks * rows * config.linear_num_value_heads


def layer_weights(config, kind: str) -> int:
    """Matrix weights of one layer's token mixer: a linear layer's in- and out-projections, or a full layer's
    q (with its gate: twice the heads), k, v and o."""
    d = config.hidden_size
    if kind == LINEAR:
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        return d * (2 * key_dim + value_dim) + 2 * d * value_dim + 2 * d * config.linear_num_value_heads
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, head_dim(config)
    return 3 * d * heads * dim + 2 * d * kv_heads * dim


def hybrid_flops(mlp_weights):
    """The FLOP count of a Qwen3.5 stack whose MLP multiplies ``mlp_weights(config)`` weights per token: each
    layer's mixer weights and MLP, causal attention over the sequence on the full layers, the chunked delta
    rule on the linear ones (its depthwise convolution, norms and gates are no matrix products), the head."""

    def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True):
        kinds, tokens = layer_kinds(config), rows * seq_len
        weights = sum(layer_weights(config, kind) for kind in kinds) + len(kinds) * mlp_weights(config)
        full = sum(kind != LINEAR for kind in kinds)
        width = config.num_attention_heads * head_dim(config)
        return (
            flops.dense(weights, tokens, training=training)
            + flops.attention(full, width, seq_len, seq_len, rows=rows, causal=True, training=training)
            + (len(kinds) - full) * delta_rule_flops(config, rows, seq_len, training)
            + flops.head(config, task, config.hidden_size, rows=rows, tokens=tokens, training=training)
        )

    return model_flops


def qwen3_5_family(model_type: str, name: str, tasks: dict, mlp_weights, rules=()) -> Family:
    """The family of ``model_type``: Qwen3.5's checkpoint names and rules (``rules`` first), its FLOPs."""
    return Family(
        model_type=model_type,
        name=name,
        tasks=tasks,
        base_prefix="model",
        heads=(r"^lm_head\.", r"^score\."),
        # PEFT has no default for Qwen3.5: Qwen3's q/v, and the linear layers' q/k/v projection
        lora_targets=r"/(q_proj|v_proj|in_proj_qkv)/kernel$",
        vocab_params=((r"embed_tokens/embedding$", 0), (r"lm_head/kernel$", 1)),
        aliases={"lm_head.weight": "model.embed_tokens.weight"},
        ignore=(r"\.rotary_emb\.inv_freq$", r"^mtp\."),  # the multi-token prediction head transformers skips
        partition_rules=rules + LINEAR_RULES + PARTITION_RULES,
        flops=hybrid_flops(mlp_weights),
        scans=lambda config: repeating_period(layer_kinds(config)) is not None,  # in groups (layers.Grouped)
    )


FAMILY = qwen3_5_family(
    "qwen3_5_text",
    "Qwen3.5",
    {
        "base": Qwen3_5TextModel,
        "causal-lm": Qwen3_5ForCausalLM,
        "sequence-classification": Qwen3_5TextForSequenceClassification,
    },
    lambda config: 3 * config.hidden_size * config.intermediate_size,
)
