"""Qwen2 as jaxseq knows it: Llama's family (checkpoint names, partition rules, FLOPs) under Qwen2's classes."""

from __future__ import annotations

from jaxseq.models.llama.family import llama_family
from jaxseq.models.qwen2.modeling import Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2Model

FAMILY = llama_family("qwen2", "Qwen2", Qwen2Model, Qwen2ForCausalLM, Qwen2ForSequenceClassification)
