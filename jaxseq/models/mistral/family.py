"""Mistral as jaxseq knows it: Llama's family (checkpoint names, partition rules, FLOPs) under Mistral's classes."""

from __future__ import annotations

from jaxseq.models.llama.family import llama_family
from jaxseq.models.mistral.modeling import MistralForCausalLM, MistralForSequenceClassification, MistralModel

FAMILY = llama_family("mistral", "Mistral", MistralModel, MistralForCausalLM, MistralForSequenceClassification)
