"""Qwen2: Llama's modules (``jaxseq.models.llama``, which reads Qwen2's switches from its config) under
transformers' Qwen2 class names, what an export's config names."""

from __future__ import annotations

from jaxseq.models.llama.modeling import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel


class Qwen2Model(LlamaModel):
    hf_architecture = "Qwen2Model"


class Qwen2ForCausalLM(LlamaForCausalLM):
    hf_architecture = "Qwen2ForCausalLM"


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    hf_architecture = "Qwen2ForSequenceClassification"
