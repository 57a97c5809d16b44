"""T5 as jaxseq knows it: its class, checkpoint names, partition rules, size and FLOPs."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.family import Family
from jaxseq.models.t5.modeling import T5ForConditionalGeneration, feed_forward


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """``seq_len`` source tokens through the encoder, ``target_len`` target tokens through the decoder. Per
    layer: q, k, v and o of each attention (d x inner each, inner = heads x d_kv) and the feed-forward (d x d_ff
    and d_ff x d, gated: two inputs). Encoder self-attention is bidirectional over the source, decoder
    self-attention causal over the target, cross-attention from every target token to every source token,
    whose keys and values are projected from the source tokens. The LM head projects every target token onto
    the vocabulary (shared with the embeddings or not: the same product)."""
    d, inner, d_ff = config.d_model, config.num_heads * config.d_kv, config.d_ff
    encoder_layers, decoder_layers = config.num_layers, config.num_decoder_layers
    ff = (3 if feed_forward(config)[0] else 2) * d * d_ff
    source, target = rows * seq_len, rows * target_len
    dense = lambda weights, n: flops.dense(weights, n, training=training)
    attention = lambda layers, queries, keys, causal: flops.attention(
        layers, inner, queries, keys, rows=rows, causal=causal, training=training
    )
    return (
        dense(encoder_layers * (4 * d * inner + ff), source)
        + attention(encoder_layers, seq_len, seq_len, False)
        + dense(decoder_layers * (4 * d * inner + 2 * d * inner + ff) + d * config.vocab_size, target)
        + dense(decoder_layers * 2 * d * inner, source)  # cross-attention keys and values
        + attention(decoder_layers, target_len, target_len, True)
        + attention(decoder_layers, target_len, seq_len, False)
    )


FAMILY = Family(
    model_type="t5",
    name="T5",
    tasks={"seq2seq-lm": T5ForConditionalGeneration},
    base_prefix=None,
    heads=(r"^lm_head\.",),
    lora_targets=r"Attention/(q|v)/kernel$",
    vocab_params=((r"shared/embedding$", 0), (r"lm_head/kernel$", 1)),
    aliases={
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    },
    fallbacks={"lm_head.weight": "shared.weight"},
    # Old checkpoints carry a relative bias for the first cross-attention that T5 never uses.
    ignore=(r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",),
    # Megatron-style, as GPT-2: q/k/v and wi* split by output column (heads, d_ff) over mp, o and wo by
    # input row; the other kernel dimension over fsdp; embeddings split by vocabulary. The relative
    # position tables (buckets x heads) are tiny and replicated.
    partition_rules=(
        (r"shared/embedding$", P("mp", "fsdp")),
        (r"relative_attention_bias/embedding$", P()),
        (r"(SelfAttention|EncDecAttention)/(q|k|v)/kernel$", P("fsdp", "mp")),
        (r"(SelfAttention|EncDecAttention)/o/kernel$", P("mp", "fsdp")),
        (r"DenseReluDense/(wi|wi_0|wi_1)/kernel$", P("fsdp", "mp")),
        (r"DenseReluDense/wo/kernel$", P("mp", "fsdp")),
        (r"layer_norm/scale$", P()),
        (r"lm_head/kernel$", P("fsdp", "mp")),
    ),
    positions=None,
    flops=model_flops,
)
