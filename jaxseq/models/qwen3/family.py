"""Qwen3 as jaxseq knows it: Llama's family (checkpoint names, partition rules, FLOPs) under Qwen3's classes."""

from __future__ import annotations

from jaxseq.models.llama.family import llama_family
from jaxseq.models.qwen3.modeling import Qwen3ForCausalLM, Qwen3ForSequenceClassification, Qwen3Model

FAMILY = llama_family("qwen3", "Qwen3", Qwen3Model, Qwen3ForCausalLM, Qwen3ForSequenceClassification)
