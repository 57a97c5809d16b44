"""Qwen3 (Yang et al. 2025): Llama's architecture with Qwen3's switches; ``FAMILY`` is what the registry lists."""

from jaxseq.models.qwen3.family import FAMILY
from jaxseq.models.qwen3.modeling import Qwen3ForCausalLM, Qwen3ForSequenceClassification, Qwen3Model

__all__ = ["FAMILY", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "Qwen3Model"]
