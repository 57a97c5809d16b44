"""Llama (Touvron et al. 2023): ``modeling`` holds the Flax NNX modules (parameter paths mirror transformers' PyTorch
names), ``family`` what jaxseq knows of the family (``FAMILY``: classes per task, checkpoint names, partition
rules, position limit, FLOPs), which ``jaxseq.models.registry`` lists."""

from jaxseq.models.llama.family import FAMILY, PARTITION_RULES, llama_family
from jaxseq.models.llama.modeling import (
    ROPE_TYPES,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaMLP,
    LlamaModel,
    apply_rotary,
    attention_biases,
    head_dim,
    layer_windows,
    rope_frequencies,
    rotary,
)

__all__ = [
    "FAMILY",
    "PARTITION_RULES",
    "ROPE_TYPES",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaMLP",
    "LlamaModel",
    "apply_rotary",
    "attention_biases",
    "head_dim",
    "layer_windows",
    "llama_family",
    "rope_frequencies",
    "rotary",
]
