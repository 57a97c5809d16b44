"""BERT as jaxseq knows it: its classes per task, checkpoint names, partition rules, size and FLOPs."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models import flops
from jaxseq.models.bert.modeling import (
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)
from jaxseq.models.family import Family


def model_flops(config, task: str, rows: int, seq_len: int, target_len: int = 0, training: bool = True) -> float:
    """Per layer: query, key, value and the attention output (d x d each) and the feed-forward (d x I, I x d),
    attention bidirectional over ``seq_len`` (causal if ``is_decoder``). The classifier's encoder computes its
    last layer's keys and values at every token but the rest of that layer at the [CLS] token of each row
    alone (``BertEncoder``'s ``positions``), then the pooler (d x d) and the classifier (d x num_labels) there;
    the masked LM adds the head's transform (d x d) and the projection onto the vocabulary at every token; token
    classification its classifier (d x num_labels) and question answering ``qa_outputs`` (d x 2) at every token;
    the bare model its pooler at each row's first token."""
    d, inner, layers, causal = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.is_decoder
    tokens, layer = rows * seq_len, 4 * d * d + 2 * d * inner
    dense = lambda weights, n: flops.dense(weights, n, training=training)
    full = layers - 1 if task == "sequence-classification" else layers  # the layers over every token
    count = dense(full * layer, tokens)
    count += flops.attention(full, d, seq_len, seq_len, rows=rows, causal=bool(causal), training=training)
    if task == "sequence-classification":
        count += dense(2 * d * d, tokens) + dense(layer - 2 * d * d, rows)  # last layer: k, v; q, o and the MLP
        count += flops.attention(1, d, 1, seq_len, rows=rows, causal=False, training=training)
        return count + dense(d * d + d * config.num_labels, rows)
    if task == "masked-lm":
        return count + dense(d * d + d * config.vocab_size, tokens)
    if task in ("token-classification", "question-answering"):
        return count + dense(d * (config.num_labels if task == "token-classification" else 2), tokens)
    return count + dense(d * d, rows)


# Megatron-style: q/k/v and the feed-forward input split by output column over mp, the attention and
# feed-forward outputs by input row; the other kernel dimension over fsdp. Token embeddings and the
# MLM head are split by (padded) vocabulary over mp; position and token-type embeddings by hidden size.
PARTITION_RULES = (
    (r"word_embeddings/embedding$", P("mp", "fsdp")),
    (r"_embeddings/embedding$", P(None, "fsdp")),
    (r"(query|key|value)/kernel$", P("fsdp", "mp")),
    (r"(query|key|value)/bias$", P("mp")),
    (r"intermediate/dense/kernel$", P("fsdp", "mp")),
    (r"intermediate/dense/bias$", P("mp")),
    (r"output/dense/kernel$", P("mp", "fsdp")),
    (r"output/dense/bias$", P()),
    (r"LayerNorm/(scale|bias)$", P()),
    (r"(pooler|transform)/dense/kernel$", P("fsdp", None)),
    (r"(pooler|transform)/dense/bias$", P()),
    (r"classifier/kernel$", P("fsdp", None)),
    (r"classifier/bias$", P()),
    (r"qa_outputs/kernel$", P("fsdp", None)),
    (r"qa_outputs/bias$", P()),
    (r"decoder/kernel$", P("fsdp", "mp")),
    (r"(decoder|predictions)/bias$", P("mp")),
)


FAMILY = Family(
    model_type="bert",
    name="BERT",
    tasks={
        "base": BertModel,
        "sequence-classification": BertForSequenceClassification,
        "masked-lm": BertForMaskedLM,
        "token-classification": BertForTokenClassification,
        "question-answering": BertForQuestionAnswering,
    },
    base_prefix="bert",
    heads=(r"^classifier\.", r"^cls\.", r"(^|\.)pooler\.", r"^qa_outputs\."),
    aliases={
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    },
    ignore=(r"(^|\.)position_ids$",),
    lora_targets=r"/(query|value)/kernel$",
    vocab_params=((r"word_embeddings/embedding$", 0), (r"decoder/kernel$", 1), (r"(decoder|predictions)/bias$", 0)),
    partition_rules=PARTITION_RULES,
    flops=model_flops,
)
