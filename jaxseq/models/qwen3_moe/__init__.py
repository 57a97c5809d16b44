"""Qwen3-MoE (Yang et al. 2025): Qwen3's decoder with Mixtral's sparse MoE block; ``FAMILY`` is what the registry
lists."""

from jaxseq.models.qwen3_moe.family import FAMILY
from jaxseq.models.qwen3_moe.modeling import Qwen3MoeForCausalLM, Qwen3MoeForSequenceClassification, Qwen3MoeModel

__all__ = ["FAMILY", "Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification", "Qwen3MoeModel"]
