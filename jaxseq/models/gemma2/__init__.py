"""Gemma 2 (Gemma Team 2024): Llama's architecture with Gemma's switches; ``FAMILY`` is what the registry lists."""

from jaxseq.models.gemma2.family import FAMILY
from jaxseq.models.gemma2.modeling import Gemma2ForCausalLM, Gemma2ForSequenceClassification, Gemma2Model

__all__ = ["FAMILY", "Gemma2ForCausalLM", "Gemma2ForSequenceClassification", "Gemma2Model"]
