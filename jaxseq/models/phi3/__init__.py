"""Phi-3 (Abdin et al. 2024): Llama's architecture with fused projections, partial and LongRoPE rotary
embeddings; ``FAMILY`` is what the registry lists."""

from jaxseq.models.phi3.family import FAMILY
from jaxseq.models.phi3.modeling import Phi3ForCausalLM, Phi3ForSequenceClassification, Phi3Model

__all__ = ["FAMILY", "Phi3ForCausalLM", "Phi3ForSequenceClassification", "Phi3Model"]
