"""Gemma 3's text classes: Llama's modules, which read Gemma's switches from the config (``llama.modeling.gemma``)."""

from __future__ import annotations

from jaxseq.models.llama.modeling import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel


class Gemma3TextModel(LlamaModel):
    hf_architecture = "Gemma3TextModel"


class Gemma3ForCausalLM(LlamaForCausalLM):
    hf_architecture = "Gemma3ForCausalLM"


class Gemma3TextForSequenceClassification(LlamaForSequenceClassification):
    hf_architecture = "Gemma3TextForSequenceClassification"
