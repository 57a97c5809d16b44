"""GPT-2 (Radford et al. 2019): ``modeling`` holds the Flax NNX modules (parameter paths mirror transformers' PyTorch
names), ``family`` what jaxseq knows of the family (``FAMILY``: classes per task, checkpoint names, partition
rules, position limit, FLOPs), which ``jaxseq.models.registry`` lists."""

from jaxseq.models.gpt2.family import FAMILY
from jaxseq.models.gpt2.modeling import (
    GPT2MLP,
    GPT2Attention,
    GPT2Block,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
)

__all__ = [
    "FAMILY",
    "GPT2MLP",
    "GPT2Attention",
    "GPT2Block",
    "GPT2ForSequenceClassification",
    "GPT2LMHeadModel",
    "GPT2Model",
]
