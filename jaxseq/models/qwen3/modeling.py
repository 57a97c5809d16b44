"""Qwen3: Llama's modules (``jaxseq.models.llama``, which reads Qwen3's switches from its config: the q/k norms,
``attention_bias``, ``head_dim``, the sliding layers) under transformers' Qwen3 class names, what an export's
config names."""

from __future__ import annotations

from jaxseq.models.llama.modeling import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel


class Qwen3Model(LlamaModel):
    hf_architecture = "Qwen3Model"


class Qwen3ForCausalLM(LlamaForCausalLM):
    hf_architecture = "Qwen3ForCausalLM"


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    hf_architecture = "Qwen3ForSequenceClassification"
