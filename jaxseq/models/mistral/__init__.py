"""Mistral (Jiang et al. 2023): Llama's architecture with Mistral's switches; ``FAMILY`` is what the registry lists."""

from jaxseq.models.mistral.family import FAMILY
from jaxseq.models.mistral.modeling import MistralForCausalLM, MistralForSequenceClassification, MistralModel

__all__ = ["FAMILY", "MistralForCausalLM", "MistralForSequenceClassification", "MistralModel"]
