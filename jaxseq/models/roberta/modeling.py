"""RoBERTa (Liu et al. 2019): BERT's modules (``jaxseq.models.bert``) with RoBERTa's positions and heads, as
Flax NNX modules whose parameter paths mirror transformers' PyTorch names (``roberta/encoder/layer/0/...``).

Positions count real tokens only, from ``padding_idx + 1`` (fairseq's ``make_positions``, transformers'
``create_position_ids_from_input_ids``). ``position_ids`` given to these models are 0-based, as packing writes
them (``jaxseq.data.packing``: restarting at 0 in every example) and as OPT's are in transformers: the
embeddings add ``padding_idx + 1`` (``RobertaEmbeddings.position_offset``), and padding, at -1, lands on
``padding_idx``, as in transformers."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxseq.models.bert.modeling import (
    BertEmbeddings,
    BertForQuestionAnswering,
    BertForTokenClassification,
    BertModel,
    classifier_dropout,
    vocabulary_logits,
)
from jaxseq.models.execution import Execution
from jaxseq.models.layers import Linear, dropout, gelu_exact, normal, padded_vocab_size


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.padding_idx = self.position_padding_idx = config.pad_token_id
        self.position_offset = config.pad_token_id + 1

    def default_positions(self, input_ids):
        """Each real token's place among the row's real tokens (0-based), -1 at padding."""
        real = input_ids != self.padding_idx
        return jnp.where(real, jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, -1)


class RobertaModel(BertModel):
    """BERT's encoder and pooler over RoBERTa's embeddings (``token_type_ids`` default to 0, its one type)."""

    hf_architecture = "RobertaModel"
    embeddings_class = RobertaEmbeddings


def _linear(config, d_in, d_out, *, dtype, param_dtype, rngs, **kw):
    return Linear(
        d_in, d_out, dtype=dtype, param_dtype=param_dtype, kernel_init=normal(config.initializer_range), rngs=rngs, **kw
    )


class RobertaClassificationHead(nnx.Module):
    """``out_proj(tanh(dense(h)))`` of the pooled tokens' states ``[n, d]`` (each example's ``<s>``), dropout
    before each projection."""

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dense = _linear(config, config.hidden_size, config.hidden_size, **kw)
        self.out_proj = _linear(config, config.hidden_size, config.num_labels, **kw)
        self.dropout_rate = classifier_dropout(config)

    def __call__(self, first, rngs=None):
        x = jnp.tanh(self.dense(dropout(first, self.dropout_rate, rngs)))
        return self.out_proj(dropout(x, self.dropout_rate, rngs))


class RobertaForSequenceClassification(nnx.Module):
    """RoBERTa (without pooler) scoring each example's ``<s>`` state; ``num_labels=1`` is regression. The
    encoder's last layer runs at the ``<s>`` tokens alone (``BertModel``'s ``pooled_only``)."""

    hf_architecture = "RobertaForSequenceClassification"
    pooled_token = "first"  # which token of a packed example pool_index points at
    task_head = r"^classifier/"  # what fine-tuning adds to the pretrained model (trained in full beside LoRA)

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.roberta = RobertaModel(config, add_pooling_layer=False, execution=execution, **kw)
        self.classifier = RobertaClassificationHead(config, **kw)

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, pool_index=None, rngs=None
    ):
        """Logits ``[batch, num_labels]``, or ``[len(pool_index), num_labels]`` for packed rows."""
        first = self.roberta(
            input_ids, attention_mask, token_type_ids, position_ids, pool_index=pool_index, pooled_only=True, rngs=rngs
        ).last_hidden_state
        return self.classifier(first, rngs).astype(jnp.float32)


class RobertaLMHead(nnx.Module):
    """``layer_norm(gelu(dense(h)))``, then the vocabulary: the token embeddings and ``bias`` when the config
    ties them (``decoder.weight`` and ``decoder.bias`` are checkpoint aliases), else ``decoder``, its own layer
    with its own bias (``bias`` kept, unused, as in transformers, so checkpoints round-trip)."""

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        d, vocab = config.hidden_size, padded_vocab_size(config.vocab_size)
        self.dense = _linear(config, d, d, **kw)
        self.layer_norm = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, **kw)
        self.bias = nnx.Param(jnp.zeros((vocab,), param_dtype))
        if not config.tie_word_embeddings:
            self.decoder = _linear(config, d, vocab, preferred_element_type=jnp.float32, **kw)

    def transform(self, h):
        return self.layer_norm(gelu_exact(self.dense(h)))  # transformers' gelu, whatever hidden_act says


class RobertaForMaskedLM(nnx.Module):
    """RoBERTa (without pooler) predicting every position's token: logits ``[batch, seq, vocab]``."""

    hf_architecture = "RobertaForMaskedLM"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.roberta = RobertaModel(config, add_pooling_layer=False, execution=execution, **kw)
        self.lm_head = RobertaLMHead(config, **kw)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, rngs=None):
        out = self.hidden_states(input_ids, attention_mask, token_type_ids, position_ids, rngs=rngs)
        return self.logits(out.last_hidden_state)

    def hidden_states(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, rngs=None):
        """The encoder's output (``last_hidden_state`` ``[batch, seq, hidden]``), before the head."""
        return self.roberta(input_ids, attention_mask, token_type_ids, position_ids, rngs=rngs)

    def logits(self, h):
        """The head's float32 vocabulary logits of hidden states ``h`` (``[..., hidden]``: any positions)."""
        return vocabulary_logits(self.lm_head.transform(h), self.roberta.embeddings, self.lm_head, self.config)


class RobertaForTokenClassification(BertForTokenClassification):
    """RoBERTa (without pooler) scoring every token: logits ``[batch, seq, num_labels]``."""

    hf_architecture = "RobertaForTokenClassification"
    base = "roberta"
    model_class = RobertaModel


class RobertaForQuestionAnswering(BertForQuestionAnswering):
    """RoBERTa (without pooler) with ``qa_outputs``: start and end logits of each token."""

    hf_architecture = "RobertaForQuestionAnswering"
    base = "roberta"
    model_class = RobertaModel
