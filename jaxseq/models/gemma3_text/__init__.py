"""Gemma 3's text decoder (Gemma Team 2025): Llama's architecture with Gemma's switches; ``FAMILY`` is what the
registry lists."""

from jaxseq.models.gemma3_text.family import FAMILY
from jaxseq.models.gemma3_text.modeling import (
    Gemma3ForCausalLM,
    Gemma3TextForSequenceClassification,
    Gemma3TextModel,
)

__all__ = ["FAMILY", "Gemma3ForCausalLM", "Gemma3TextForSequenceClassification", "Gemma3TextModel"]
