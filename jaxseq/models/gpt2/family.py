"""GPT-2 as jaxseq knows it: its classes per task, checkpoint names, partition rules, size and FLOPs."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.family import Family
from jaxseq.models.gpt2.modeling import (
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
)


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Per layer: q/k/v (``c_attn``, d x 3d), the attention output (d x d) and the MLP (d x inner, inner x d),
    causal attention over ``seq_len``; then the task head."""
    d, inner, layers = config.n_embd, config.n_inner or 4 * config.n_embd, config.n_layer
    tokens = rows * seq_len
    return (
        flops.dense(layers * (3 * d * d + d * d + 2 * d * inner), tokens, training=training)
        + flops.attention(layers, d, seq_len, seq_len, rows=rows, causal=True, training=training)
        + flops.head(config, task, d, rows=rows, tokens=tokens, training=training)
    )


FAMILY = Family(
    model_type="gpt2",
    name="GPT-2",
    tasks={
        "base": GPT2Model,
        "causal-lm": GPT2LMHeadModel,
        "sequence-classification": GPT2ForSequenceClassification,
        "token-classification": GPT2ForTokenClassification,
    },
    base_prefix="transformer",
    heads=(r"^lm_head\.", r"^score\.", r"^classifier\."),
    lora_targets=r"/c_attn/kernel$",
    vocab_params=((r"wte/embedding$", 0), (r"lm_head/kernel$", 1)),
    aliases={"lm_head.weight": "transformer.wte.weight"},
    ignore=(r"\.attn\.bias$", r"\.attn\.masked_bias$"),
    # Megatron-style: q/k/v and MLP-in split by output column over mp, attention-out and MLP-out by input
    # row; the other kernel dimension over fsdp; embeddings split by vocabulary.
    partition_rules=(
        (r"wte/embedding$", P("mp", "fsdp")),
        (r"wpe/embedding$", P(None, "fsdp")),
        (r"(c_attn|c_fc)/kernel$", P("fsdp", "mp")),
        (r"(c_attn|c_fc)/bias$", P("mp")),
        (r"c_proj/kernel$", P("mp", "fsdp")),
        (r"c_proj/bias$", P()),
        (r"(ln_\d|ln_f)/(scale|bias)$", P()),
        (r"lm_head/kernel$", P("fsdp", "mp")),
        (r"(score|classifier)/kernel$", P("fsdp", None)),
        (r"classifier/bias$", P()),
    ),
    positions="n_positions",
    flops=model_flops,
)
