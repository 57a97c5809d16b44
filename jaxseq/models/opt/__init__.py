"""OPT (Zhang et al. 2022): ``modeling`` holds the Flax NNX modules (parameter paths mirror transformers' PyTorch
names), ``family`` what jaxseq knows of the family (``FAMILY``: classes per task, checkpoint names, partition
rules, position limit, FLOPs), which ``jaxseq.models.registry`` lists."""

from jaxseq.models.opt.family import FAMILY
from jaxseq.models.opt.modeling import (
    OPTAttention,
    OPTDecoder,
    OPTDecoderLayer,
    OPTForCausalLM,
    OPTForSequenceClassification,
    OPTModel,
    mask_positions,
)

__all__ = [
    "FAMILY",
    "OPTAttention",
    "OPTDecoder",
    "OPTDecoderLayer",
    "OPTForCausalLM",
    "OPTForSequenceClassification",
    "OPTModel",
    "mask_positions",
]
