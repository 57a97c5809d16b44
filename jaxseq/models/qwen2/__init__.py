"""Qwen2 (Yang et al. 2024): Llama's architecture with Qwen2's switches; ``FAMILY`` is what the registry lists."""

from jaxseq.models.qwen2.family import FAMILY
from jaxseq.models.qwen2.modeling import Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2Model

__all__ = ["FAMILY", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "Qwen2Model"]
