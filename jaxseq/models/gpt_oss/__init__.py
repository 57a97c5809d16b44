"""gpt-oss (OpenAI 2025): Mixtral's decoder with attention sinks, alternating sliding-window layers, YaRN rope and
experts of a clamped SwiGLU with biases; ``FAMILY`` is what the registry lists."""

from jaxseq.models.gpt_oss.family import FAMILY
from jaxseq.models.gpt_oss.modeling import GptOssForCausalLM, GptOssForSequenceClassification, GptOssModel

__all__ = ["FAMILY", "GptOssForCausalLM", "GptOssForSequenceClassification", "GptOssModel"]
