"""BERT (Devlin et al. 2019): ``modeling`` holds the Flax NNX modules (parameter paths mirror transformers' PyTorch
names), ``family`` what jaxseq knows of the family (``FAMILY``: classes per task, checkpoint names, partition
rules, position limit, FLOPs), which ``jaxseq.models.registry`` lists."""

from jaxseq.models.bert.family import FAMILY
from jaxseq.models.bert.modeling import (
    BertAttention,
    BertEmbeddings,
    BertEncoder,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertIntermediate,
    BertLayer,
    BertLMPredictionHead,
    BertModel,
    BertOnlyMLMHead,
    BertOutput,
    BertPooler,
    BertPredictionHeadTransform,
    BertSelfAttention,
    BertSelfOutput,
)

__all__ = [
    "FAMILY",
    "BertAttention",
    "BertEmbeddings",
    "BertEncoder",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertIntermediate",
    "BertLMPredictionHead",
    "BertLayer",
    "BertModel",
    "BertOnlyMLMHead",
    "BertOutput",
    "BertPooler",
    "BertPredictionHeadTransform",
    "BertSelfAttention",
    "BertSelfOutput",
]
