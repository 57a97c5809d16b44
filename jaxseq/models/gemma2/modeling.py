"""Gemma 2's classes: Llama's modules, which read Gemma's switches from the config (``llama.modeling.gemma``)."""

from __future__ import annotations

from jaxseq.models.llama.modeling import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel


class Gemma2Model(LlamaModel):
    hf_architecture = "Gemma2Model"


class Gemma2ForCausalLM(LlamaForCausalLM):
    hf_architecture = "Gemma2ForCausalLM"


class Gemma2ForSequenceClassification(LlamaForSequenceClassification):
    hf_architecture = "Gemma2ForSequenceClassification"
