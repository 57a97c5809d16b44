"""Gemma 3's text decoder as jaxseq knows it: Llama's family (checkpoint names, partition rules, FLOPs) under
Gemma 3's classes."""

from __future__ import annotations

from jaxseq.models.gemma3_text.modeling import (
    Gemma3ForCausalLM,
    Gemma3TextForSequenceClassification,
    Gemma3TextModel,
)
from jaxseq.models.llama.family import llama_family

FAMILY = llama_family("gemma3_text", "Gemma 3", Gemma3TextModel, Gemma3ForCausalLM, Gemma3TextForSequenceClassification)
"""Gemma 3 (``model_type`` gemma3_text, the text-only checkpoints and the text tower's config): Llama's modules
(``jaxseq.models.llama``, which reads Gemma's switches as for Gemma 2, and Gemma 3's: the (1 + w) q/k norms, the
rope of each layer kind from ``rope_parameters``) under transformers' Gemma 3 class names."""
