"""BERT (Devlin et al. 2019) as Flax NNX modules whose parameter paths mirror transformers' PyTorch names."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.models.attention import (
    attend,
    attend_at,
    merge_heads,
    self_attention_mask,
    split_heads,
    take_positions,
)
from jaxseq.models.execution import Execution
from jaxseq.models.layers import (
    Linear,
    Stacked,
    activation,
    blocks,
    dropout,
    embedding_lookup,
    normal,
    one_hot_lookup,
    padded_vocab_size,
    tied_logits,
)
from jaxseq.models.outputs import BaseOutput


class BertEmbeddings(nnx.Module):
    """Token, token-type and position embeddings, summed and normalised. ``position_offset``: what is added to
    ``position_ids`` to look them up (RoBERTa's ``padding_idx + 1``; 0 here)."""

    position_offset = 0
    position_padding_idx = None  # the position row that never trains (RoBERTa's padding_idx)

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, std = config.hidden_size, config.initializer_range
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.word_embeddings = nnx.Embed(padded_vocab_size(config.vocab_size), d, embedding_init=normal(std), **kw)
        self.position_embeddings = nnx.Embed(config.max_position_embeddings, d, embedding_init=normal(std), **kw)
        self.token_type_embeddings = nnx.Embed(config.type_vocab_size, d, embedding_init=normal(std), **kw)
        self.LayerNorm = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, **kw)
        self.hidden_dropout = config.hidden_dropout_prob
        self.pad_token_id = config.pad_token_id

    def __call__(self, input_ids, token_type_ids, position_ids, rngs=None):
        x = embedding_lookup(self.word_embeddings, input_ids, self.pad_token_id)
        x = x + one_hot_lookup(self.token_type_embeddings, token_type_ids)
        positions = position_ids + self.position_offset if self.position_offset else position_ids
        x = x + embedding_lookup(self.position_embeddings, positions, self.position_padding_idx)
        return dropout(self.LayerNorm(x), self.hidden_dropout, rngs)

    def default_positions(self, input_ids):
        """The positions of rows given without ``position_ids``: ``0 .. seq - 1``."""
        return jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None, :]


class BertSelfAttention(nnx.Module):
    dropout_field = "attention_probs_dropout_prob"  # the config's attention dropout (attention.choose_kernel)

    def __init__(self, config, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs):
        d, std = config.hidden_size, config.initializer_range
        if d % config.num_attention_heads:
            raise JaxseqError(
                f"hidden_size {d} is not a multiple of num_attention_heads {config.num_attention_heads}; fix the config"
            )
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=normal(std), rngs=rngs)
        self.query = Linear(d, d, **kw)
        self.key = Linear(d, d, **kw)
        self.value = Linear(d, d, **kw)
        self.num_heads = config.num_attention_heads
        self.dropout_rate, self.causal = config.attention_probs_dropout_prob, bool(config.is_decoder)
        self.dtype, self.attention = dtype, execution.attention

    def __call__(self, x, mask, rngs=None, positions=None):
        """``positions``: flat positions (``row * seq + column``) of the only queries wanted (``attend_at``)."""
        k, v = (split_heads(proj(x), self.num_heads) for proj in (self.key, self.value))
        if positions is not None:
            q = split_heads(self.query(take_positions(x, positions)), self.num_heads)
            return merge_heads(attend_at(q, k, v, mask, positions, dropout_rate=self.dropout_rate, rngs=rngs))
        q = split_heads(self.query(x), self.num_heads)
        y = attend(q, k, v, mask, dropout_rate=self.dropout_rate, rngs=rngs, kernel=self.attention, causal=self.causal)
        return merge_heads(y)


class BertSelfOutput(nnx.Module):
    """Projection, dropout, then the post-norm residual ``LayerNorm(h + input)`` (used after attention)."""

    def __init__(self, config, d_in: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dense = Linear(d_in, config.hidden_size, kernel_init=normal(config.initializer_range), **kw)
        self.LayerNorm = nnx.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps, **kw)
        self.hidden_dropout = config.hidden_dropout_prob

    def __call__(self, h, residual, rngs=None):
        return self.LayerNorm(dropout(self.dense(h), self.hidden_dropout, rngs) + residual)


class BertOutput(BertSelfOutput):
    """The same computation after the feed-forward (``intermediate_size`` -> ``hidden_size``)."""


class BertAttention(nnx.Module):
    def __init__(self, config, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.self = BertSelfAttention(config, execution=execution, **kw)
        self.output = BertSelfOutput(config, config.hidden_size, **kw)

    def __call__(self, x, mask, rngs=None, positions=None):
        residual = x if positions is None else take_positions(x, positions)
        return self.output(self.self(x, mask, rngs, positions), residual, rngs)


class BertIntermediate(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dense = Linear(
            config.hidden_size,
            config.intermediate_size,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=normal(config.initializer_range),
            rngs=rngs,
        )
        self.act = activation(config.hidden_act)

    def __call__(self, x):
        return self.act(self.dense(x))


class BertLayer(nnx.Module):
    def __init__(self, config, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attention = BertAttention(config, execution=execution, **kw)
        self.intermediate = BertIntermediate(config, **kw)
        self.output = BertOutput(config, config.intermediate_size, **kw)

    def __call__(self, x, mask, rngs=None, positions=None):
        """``[batch, seq, d]`` states, or with ``positions`` (flat) only theirs, ``[len(positions), d]``."""
        x = self.attention(x, mask, rngs, positions)
        return self.output(self.intermediate(x), x, rngs)


class BertEncoder(nnx.Module):
    """The layers, as ``execution`` runs them (``models.execution``): a list, or stacked and scanned
    (``layers.Stacked``); their attention kernel, remat and weight gathering."""

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs, execution: Execution = Execution()):
        make = lambda i, rngs: BertLayer(config, execution=execution, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layer = blocks(make, config.num_hidden_layers, rngs, execution)
        self.remat = execution.remat  # what each block keeps for the backward pass

    def __call__(self, x, mask, rngs=None, positions=None):
        """The last layer's states, ``[batch, seq, d]``; with ``positions`` (flat), only theirs: the last layer
        then computes its queries, feed-forward and norms there alone (a classifier reads nothing else); a
        scanned stack runs it apart from the scan, from its slice of the stacked parameters."""
        n = len(self.layer)
        if positions is not None and not n:
            return take_positions(x, positions)
        whole = n if positions is None else n - 1  # the layers over every token
        if isinstance(self.layer, Stacked):
            x, _ = self.layer(self.remat, x, mask, layers=slice(whole), rngs=rngs)
        else:
            for i in range(whole):
                x = self.layer.call(i, self.remat, x, mask, rngs)
        if positions is not None:
            x = self.layer.call(n - 1, self.remat, x, mask, rngs, positions=positions)
        return x


class BertPooler(nnx.Module):
    """``tanh(dense(h))`` of the pooled tokens' states ``[n, d]`` (each example's [CLS])."""

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dense = Linear(
            config.hidden_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=normal(config.initializer_range),
            rngs=rngs,
        )

    def __call__(self, first):
        return jnp.tanh(self.dense(first))


class BertModel(nnx.Module):
    """The encoder, and the pooler unless ``add_pooling_layer=False`` (as in ``BertForMaskedLM``).
    ``attention_mask`` is ``[batch, seq]`` (1 = token, 0 = padding, or packed segment ids, see
    ``jaxseq.data.packing``); ``token_type_ids`` default to 0 (segment A) and ``position_ids`` to the
    embeddings' ``default_positions`` (``0 .. seq - 1``). Attention is bidirectional unless
    ``config.is_decoder``. ``execution``: how the encoder's layers run (``BertEncoder``).
    ``embeddings_class``: RoBERTa's counts positions its own way."""

    hf_architecture = "BertModel"
    embeddings_class = BertEmbeddings

    def __init__(
        self,
        config,
        *,
        add_pooling_layer: bool = True,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        execution: Execution = Execution(),
    ):
        position_type = getattr(config, "position_embedding_type", None) or "absolute"
        if position_type != "absolute":
            raise JaxseqError(f"BERT position_embedding_type {position_type!r} is not supported; only 'absolute' is")
        if getattr(config, "add_cross_attention", False):
            raise JaxseqError("BERT configs with add_cross_attention are not supported; set it to false")
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embeddings = self.embeddings_class(config, **kw)
        self.encoder = BertEncoder(config, execution=execution, **kw)
        self.pooler = BertPooler(config, **kw) if add_pooling_layer else None

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        *,
        pool_index=None,
        pooled_only: bool = False,
        rngs=None,
    ):
        """``pool_index``: the flat positions (``row * seq + column``) the pooler reads, when rows hold several
        packed examples (else each row's first). ``pooled_only``: compute only what ``pooler_output`` needs
        (the last layer at the pooled positions alone); ``last_hidden_state`` is then theirs, ``[n, d]``."""
        batch, seq = input_ids.shape
        if position_ids is None:
            limit = self.config.max_position_embeddings - self.embeddings.position_offset
            if seq > limit:
                raise JaxseqError(
                    f"sequence length {seq} exceeds the model's {limit} positions (max_position_embeddings "
                    f"{self.config.max_position_embeddings}); truncate the inputs"
                )
            position_ids = self.embeddings.default_positions(input_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids, position_ids, rngs)
        mask = self_attention_mask(attention_mask, seq, causal=bool(self.config.is_decoder))
        if pooled_only:
            first = jnp.arange(batch, dtype=jnp.int32) * seq  # each row's first token
            h = pooled = self.encoder(x, mask, rngs, positions=first if pool_index is None else pool_index)
        else:
            h = self.encoder(x, mask, rngs)
            pooled = h[:, 0] if pool_index is None else take_positions(h, pool_index)
        return BaseOutput(h, pooler_output=None if self.pooler is None else self.pooler(pooled))


class BertForSequenceClassification(nnx.Module):
    """BERT scoring the pooled [CLS] state; ``num_labels=1`` is regression (logits ``[batch, 1]``)."""

    hf_architecture = "BertForSequenceClassification"
    pooled_token = "first"  # which token of a packed example pool_index points at
    task_head = r"^classifier/"  # what fine-tuning adds to the pretrained model (trained in full beside LoRA)

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.bert = BertModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)
        self.classifier = Linear(
            config.hidden_size,
            config.num_labels,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=normal(config.initializer_range),
            rngs=rngs,
        )
        self.classifier_dropout = classifier_dropout(config)

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, pool_index=None, rngs=None
    ):
        """Logits ``[batch, num_labels]``, or ``[len(pool_index), num_labels]`` for packed rows."""
        out = self.bert(
            input_ids, attention_mask, token_type_ids, position_ids, pool_index=pool_index, pooled_only=True, rngs=rngs
        )
        pooled = out.pooler_output
        return self.classifier(dropout(pooled, self.classifier_dropout, rngs)).astype(jnp.float32)


def classifier_dropout(config) -> float:
    """The classifier's dropout rate: ``classifier_dropout``, else ``hidden_dropout_prob``."""
    return config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout


class BertPredictionHeadTransform(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        d = config.hidden_size
        self.dense = Linear(d, d, kernel_init=normal(config.initializer_range), **kw)
        self.act = activation(config.hidden_act)
        self.LayerNorm = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, **kw)

    def __call__(self, h):
        return self.LayerNorm(self.act(self.dense(h)))


class BertLMPredictionHead(nnx.Module):
    """The transform and the output bias. The decoder is the token embeddings (``decoder.weight`` and
    ``decoder.bias`` are checkpoint aliases) unless the config unties them: then ``decoder`` is its own
    layer with its own bias, and ``bias`` is kept (unused, as in transformers) so checkpoints round-trip."""

    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.transform = BertPredictionHeadTransform(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((padded_vocab_size(config.vocab_size),), param_dtype))
        if not config.tie_word_embeddings:
            self.decoder = Linear(
                config.hidden_size,
                padded_vocab_size(config.vocab_size),
                dtype=dtype,
                param_dtype=param_dtype,
                preferred_element_type=jnp.float32,
                kernel_init=normal(config.initializer_range),
                rngs=rngs,
            )


class BertOnlyMLMHead(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.predictions = BertLMPredictionHead(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class BertForMaskedLM(nnx.Module):
    """BERT (without pooler) predicting every position's token: logits ``[batch, seq, vocab]``."""

    hf_architecture = "BertForMaskedLM"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.bert = BertModel(config, add_pooling_layer=False, execution=execution, **kw)
        self.cls = BertOnlyMLMHead(config, **kw)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, rngs=None):
        out = self.hidden_states(input_ids, attention_mask, token_type_ids, position_ids, rngs=rngs)
        return self.logits(out.last_hidden_state)

    def hidden_states(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, rngs=None):
        """The encoder's output (``last_hidden_state`` ``[batch, seq, hidden]``), before the head."""
        return self.bert(input_ids, attention_mask, token_type_ids, position_ids, rngs=rngs)

    def logits(self, h):
        """The head's float32 vocabulary logits of hidden states ``h`` (``[..., hidden]``: any positions)."""
        head = self.cls.predictions
        return vocabulary_logits(head.transform(h), self.bert.embeddings, head, self.config)


def vocabulary_logits(h, embeddings: BertEmbeddings, head, config):
    """float32 logits ``[..., vocab_size]`` of a masked-LM head's transformed states ``h``: the token embeddings
    plus ``head.bias`` if the config ties them, else ``head.decoder`` (its own bias)."""
    if config.tie_word_embeddings:
        words = embeddings.word_embeddings.embedding[...]
        logits = tied_logits(h, words, h.dtype) + head.bias[...].astype(jnp.float32)
    else:
        logits = head.decoder(h)
    return logits[..., : config.vocab_size].astype(jnp.float32)  # accumulated in float32


class BertForTokenClassification(nnx.Module):
    """BERT (without pooler) scoring every token: logits ``[batch, seq, num_labels]`` (named entities)."""

    hf_architecture = "BertForTokenClassification"
    task_head = r"^classifier/"
    base = "bert"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        setattr(self, self.base, self.model_class(config, add_pooling_layer=False, execution=execution, **kw))
        self.classifier = Linear(
            config.hidden_size, config.num_labels, kernel_init=normal(config.initializer_range), **kw
        )
        self.classifier_dropout = classifier_dropout(config)

    model_class = BertModel

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, rngs=None):
        h = getattr(self, self.base)(input_ids, attention_mask, token_type_ids, position_ids, rngs=rngs)
        return self.classifier(dropout(h.last_hidden_state, self.classifier_dropout, rngs)).astype(jnp.float32)


class BertForQuestionAnswering(nnx.Module):
    """BERT (without pooler) with ``qa_outputs``: start and end logits of each token, ``[batch, seq]`` each
    (extractive question answering, SQuAD)."""

    hf_architecture = "BertForQuestionAnswering"
    task_head = r"^qa_outputs/"
    base = "bert"
    model_class = BertModel

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        setattr(self, self.base, self.model_class(config, add_pooling_layer=False, execution=execution, **kw))
        self.qa_outputs = Linear(config.hidden_size, 2, kernel_init=normal(config.initializer_range), **kw)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, rngs=None):
        """``(start_logits, end_logits)``, float32 ``[batch, seq]`` each."""
        h = getattr(self, self.base)(input_ids, attention_mask, token_type_ids, position_ids, rngs=rngs)
        logits = self.qa_outputs(h.last_hidden_state).astype(jnp.float32)
        return logits[..., 0], logits[..., 1]
