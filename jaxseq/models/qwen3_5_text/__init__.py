"""Qwen3.5's text decoder: Gated DeltaNet linear attention interleaved with gated full attention; ``FAMILY`` is
what the registry lists."""

from jaxseq.models.qwen3_5_text.family import FAMILY
from jaxseq.models.qwen3_5_text.modeling import (
    Qwen3_5ForCausalLM,
    Qwen3_5TextForSequenceClassification,
    Qwen3_5TextModel,
    gated_delta_chunked,
    gated_delta_recurrent,
)

__all__ = [
    "FAMILY",
    "Qwen3_5ForCausalLM",
    "Qwen3_5TextForSequenceClassification",
    "Qwen3_5TextModel",
    "gated_delta_chunked",
    "gated_delta_recurrent",
]
