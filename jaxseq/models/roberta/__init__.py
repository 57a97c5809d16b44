"""RoBERTa (Liu et al. 2019): ``modeling`` holds the Flax NNX modules (BERT's, with RoBERTa's positions and heads;
parameter paths mirror transformers' PyTorch names), ``family`` what jaxseq knows of the family (``FAMILY``:
classes per task, checkpoint names, partition rules, position limit, FLOPs), which ``jaxseq.models.registry``
lists."""

from jaxseq.models.roberta.family import FAMILY
from jaxseq.models.roberta.modeling import (
    RobertaClassificationHead,
    RobertaEmbeddings,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
    RobertaLMHead,
    RobertaModel,
)

__all__ = [
    "FAMILY",
    "RobertaClassificationHead",
    "RobertaEmbeddings",
    "RobertaForMaskedLM",
    "RobertaForSequenceClassification",
    "RobertaLMHead",
    "RobertaModel",
]
