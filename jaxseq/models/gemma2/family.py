"""Gemma 2 as jaxseq knows it: Llama's family (checkpoint names, partition rules, FLOPs) under Gemma 2's classes."""

from __future__ import annotations

from jaxseq.models.gemma2.modeling import Gemma2ForCausalLM, Gemma2ForSequenceClassification, Gemma2Model
from jaxseq.models.llama.family import llama_family

FAMILY = llama_family("gemma2", "Gemma 2", Gemma2Model, Gemma2ForCausalLM, Gemma2ForSequenceClassification)
"""Gemma 2: Llama's modules (``jaxseq.models.llama``, which reads Gemma's switches from its config: the (1 + w)
norms around attention and the MLP, the embedding scale, GeGLU, ``query_pre_attn_scalar``, the soft-caps, the
sliding layers of ``layer_types``) under transformers' Gemma 2 class names, what an export's config names."""
