"""OPT as jaxseq knows it: its classes per task, checkpoint names, partition rules, size and FLOPs."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.family import Family
from jaxseq.models.opt.modeling import OPTForCausalLM, OPTForSequenceClassification, OPTModel, word_width


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Per layer: q, k, v and out_proj (d x d each) and the feed-forward (d x ffn_dim, ffn_dim x d), causal
    attention over ``seq_len``; ``project_in`` and ``project_out`` (word_embed_proj_dim x d each) where the
    widths differ; then the task head over the ``word_embed_proj_dim``-wide states."""
    d, width, layers = config.hidden_size, word_width(config), config.num_hidden_layers
    tokens = rows * seq_len
    projections = 2 * width * d if width != d else 0
    return (
        flops.dense(layers * (4 * d * d + 2 * d * config.ffn_dim) + projections, tokens, training=training)
        + flops.attention(layers, d, seq_len, seq_len, rows=rows, causal=True, training=training)
        + flops.head(config, task, width, rows=rows, tokens=tokens, training=training)
    )


FAMILY = Family(
    model_type="opt",
    name="OPT",
    tasks={"base": OPTModel, "causal-lm": OPTForCausalLM, "sequence-classification": OPTForSequenceClassification},
    base_prefix="model",
    heads=(r"^lm_head\.", r"^score\."),
    lora_targets=r"/(q_proj|v_proj)/kernel$",
    vocab_params=((r"embed_tokens/embedding$", 0), (r"lm_head/kernel$", 1)),
    aliases={"lm_head.weight": "model.decoder.embed_tokens.weight"},
    # Megatron-style, as GPT-2: q/k/v and fc1 split by output column over mp, out_proj and fc2 by input row;
    # the other kernel dimension over fsdp; token embeddings and the LM head by vocabulary.
    partition_rules=(
        (r"embed_tokens/embedding$", P("mp", "fsdp")),
        (r"embed_positions/embedding$", P(None, "fsdp")),
        (r"(q_proj|k_proj|v_proj|fc1)/kernel$", P("fsdp", "mp")),
        (r"(q_proj|k_proj|v_proj|fc1)/bias$", P("mp")),
        (r"(out_proj|fc2)/kernel$", P("mp", "fsdp")),
        (r"(out_proj|fc2)/bias$", P()),
        (r"layer_norm/(scale|bias)$", P()),
        (r"project_(in|out)/kernel$", P("fsdp", None)),
        (r"lm_head/kernel$", P("fsdp", "mp")),
        (r"score/kernel$", P("fsdp", None)),
    ),
    flops=model_flops,
)
