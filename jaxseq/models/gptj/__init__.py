"""GPT-J (Wang & Komatsuzaki 2021): ``modeling`` holds the Flax NNX modules (parameter paths mirror
transformers' PyTorch names), ``family`` what jaxseq knows of the family (``FAMILY``: classes per task,
checkpoint names, partition rules, position limit, FLOPs), which ``jaxseq.models.registry`` lists."""

from jaxseq.models.gptj.family import FAMILY
from jaxseq.models.gptj.modeling import (
    GPTJMLP,
    GPTJAttention,
    GPTJBlock,
    GPTJForCausalLM,
    GPTJForSequenceClassification,
    GPTJModel,
    TiedHeadBias,
    apply_rotary,
    rotary_dim,
    sincos,
)

__all__ = [
    "FAMILY",
    "GPTJMLP",
    "GPTJAttention",
    "GPTJBlock",
    "GPTJForCausalLM",
    "GPTJForSequenceClassification",
    "GPTJModel",
    "TiedHeadBias",
    "apply_rotary",
    "rotary_dim",
    "sincos",
]
