"""T5 (Raffel et al. 2020) and T5 v1.1 / Flan-T5: ``modeling`` holds the Flax NNX modules (parameter paths mirror
transformers' PyTorch names), ``family`` what jaxseq knows of the family (``FAMILY``: classes per task,
checkpoint names, partition rules, position limit, FLOPs), which ``jaxseq.models.registry`` lists."""

from jaxseq.models.t5.family import FAMILY
from jaxseq.models.t5.modeling import (
    Seq2SeqOutput,
    T5Attention,
    T5Block,
    T5DenseActDense,
    T5DenseGatedActDense,
    T5ForConditionalGeneration,
    T5LayerCrossAttention,
    T5LayerFF,
    T5LayerSelfAttention,
    T5Stack,
    decoder_start_id,
    feed_forward,
    position_bias,
    position_table,
    relative_position_bucket,
    shift_right,
    uses_shared_lm_head,
)

__all__ = [
    "FAMILY",
    "Seq2SeqOutput",
    "T5Attention",
    "T5Block",
    "T5DenseActDense",
    "T5DenseGatedActDense",
    "T5ForConditionalGeneration",
    "T5LayerCrossAttention",
    "T5LayerFF",
    "T5LayerSelfAttention",
    "T5Stack",
    "decoder_start_id",
    "feed_forward",
    "position_bias",
    "position_table",
    "relative_position_bucket",
    "shift_right",
    "uses_shared_lm_head",
]
