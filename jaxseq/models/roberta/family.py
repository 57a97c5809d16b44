"""RoBERTa as jaxseq knows it: BERT's partition rules and FLOP count (its classification head, dense and
out_proj at ``<s>``, costs what BERT's pooler and classifier do) with RoBERTa's classes, heads and names."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jaxseq.models.bert.family import PARTITION_RULES, model_flops
from jaxseq.models.family import Family
from jaxseq.models.roberta.modeling import (
    RobertaForMaskedLM,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
    RobertaModel,
)


@dataclasses.dataclass(frozen=True)
class RobertaFamily(Family):
    def position_limit(self, config) -> int | None:
        """``max_position_embeddings`` less the ``padding_idx + 1`` rows below the first position (512 of 514)."""
        return config.max_position_embeddings - config.pad_token_id - 1


FAMILY = RobertaFamily(
    model_type="roberta",
    name="RoBERTa",
    tasks={
        "base": RobertaModel,
        "sequence-classification": RobertaForSequenceClassification,
        "masked-lm": RobertaForMaskedLM,
        "token-classification": RobertaForTokenClassification,
        "question-answering": RobertaForQuestionAnswering,
    },
    base_prefix="roberta",
    heads=(r"^classifier\.", r"^lm_head\.", r"(^|\.)pooler\.", r"^qa_outputs\."),
    aliases={
        "lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    },
    ignore=(r"(^|\.)position_ids$", r"(^|\.)token_type_ids$"),  # buffers some checkpoints hold
    lora_targets=r"/(query|value)/kernel$",
    vocab_params=((r"word_embeddings/embedding$", 0), (r"decoder/kernel$", 1), (r"(decoder|lm_head)/bias$", 0)),
    partition_rules=(
        *PARTITION_RULES,
        (r"(classifier|lm_head)/dense/kernel$", P("fsdp", None)),
        (r"(classifier|lm_head)/dense/bias$", P()),
        (r"classifier/out_proj/kernel$", P("fsdp", None)),
        (r"classifier/out_proj/bias$", P()),
        (r"lm_head/layer_norm/(scale|bias)$", P()),
        (r"lm_head/bias$", P("mp")),
    ),
    flops=model_flops,
)
