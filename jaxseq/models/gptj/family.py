"""GPT-J as jaxseq knows it: its classes per task, checkpoint names, partition rules, size and FLOPs."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.family import Family
from jaxseq.models.gptj.modeling import GPTJForCausalLM, GPTJForSequenceClassification, GPTJModel


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Per layer: q, k, v and out_proj (d x d each) and the MLP (d x inner, inner x d), causal attention over
    ``seq_len`` (rotary embeddings are elementwise); then the task head."""
    d, inner, layers = config.n_embd, config.n_inner or 4 * config.n_embd, config.n_layer
    tokens = rows * seq_len
    return (
        flops.dense(layers * (4 * d * d + 2 * d * inner), tokens, training=training)
        + flops.attention(layers, d, seq_len, seq_len, rows=rows, causal=True, training=training)
        + flops.head(config, task, d, rows=rows, tokens=tokens, training=training)
    )


FAMILY = Family(
    model_type="gptj",
    name="GPT-J",
    tasks={
        "base": GPTJModel,
        "causal-lm": GPTJForCausalLM,
        "sequence-classification": GPTJForSequenceClassification,
    },
    base_prefix="transformer",
    heads=(r"^lm_head\.", r"^score\."),
    lora_targets=r"/(q_proj|v_proj)/kernel$",
    vocab_params=((r"wte/embedding$", 0), (r"lm_head/kernel$", 1), (r"lm_head/bias$", 0)),
    aliases={"lm_head.weight": "transformer.wte.weight"},
    ignore=(r"\.attn\.bias$", r"\.attn\.masked_bias$"),
    # Megatron-style, as GPT-2: q/k/v and fc_in split by output column (whole heads) over mp, out_proj and
    # fc_out by input row; the other kernel dimension over fsdp; embeddings and the head by vocabulary.
    partition_rules=(
        (r"wte/embedding$", P("mp", "fsdp")),
        (r"(q_proj|k_proj|v_proj|fc_in)/kernel$", P("fsdp", "mp")),
        (r"fc_in/bias$", P("mp")),
        (r"(out_proj|fc_out)/kernel$", P("mp", "fsdp")),
        (r"fc_out/bias$", P()),
        (r"(ln_1|ln_f)/(scale|bias)$", P()),
        (r"lm_head/kernel$", P("fsdp", "mp")),
        (r"lm_head/bias$", P("mp")),
        (r"score/kernel$", P("fsdp", None)),
    ),
    positions="n_positions",
    flops=model_flops,
)
