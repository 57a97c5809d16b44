"""Mixtral (Jiang et al. 2024): Llama's decoder with sparse mixture-of-experts MLPs; ``FAMILY`` is what the
registry lists."""

from jaxseq.models.mixtral.family import FAMILY
from jaxseq.models.mixtral.modeling import MixtralForCausalLM, MixtralForSequenceClassification, MixtralModel

__all__ = ["FAMILY", "MixtralForCausalLM", "MixtralForSequenceClassification", "MixtralModel"]
