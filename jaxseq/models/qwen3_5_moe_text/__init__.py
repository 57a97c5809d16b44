"""Qwen3.5-MoE's text decoder: Qwen3.5's hybrid layers with a sparse mixture of experts and a shared expert;
``FAMILY`` is what the registry lists."""

from jaxseq.models.qwen3_5_moe_text.family import FAMILY
from jaxseq.models.qwen3_5_moe_text.modeling import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextModel

__all__ = ["FAMILY", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel"]
