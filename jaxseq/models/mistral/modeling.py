"""Mistral: Llama's modules (``jaxseq.models.llama``, which reads Mistral's switches from its config) under
transformers' Mistral class names, what an export's config names."""

from __future__ import annotations

from jaxseq.models.llama.modeling import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel


class MistralModel(LlamaModel):
    hf_architecture = "MistralModel"


class MistralForCausalLM(LlamaForCausalLM):
    hf_architecture = "MistralForCausalLM"


class MistralForSequenceClassification(LlamaForSequenceClassification):
    hf_architecture = "MistralForSequenceClassification"
