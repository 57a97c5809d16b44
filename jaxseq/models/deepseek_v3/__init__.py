"""DeepSeek-V3 (DeepSeek-AI 2024): Llama's decoder with multi-head latent attention and a mixture of shared and
routed experts; ``FAMILY`` is what the registry lists."""

from jaxseq.models.deepseek_v3.family import FAMILY
from jaxseq.models.deepseek_v3.modeling import (
    DeepseekV3ForCausalLM,
    DeepseekV3ForSequenceClassification,
    DeepseekV3Model,
)

__all__ = ["FAMILY", "DeepseekV3ForCausalLM", "DeepseekV3ForSequenceClassification", "DeepseekV3Model"]
