"""T5 (Raffel et al. 2020) and T5 v1.1 / Flan-T5 as Flax NNX modules whose parameter paths mirror
transformers' PyTorch names (``encoder.block.0.layer.0.SelfAttention.q.weight``, ...).

One class covers both generations, as in transformers: the original T5 (ReLU feed-forward, LM head tied
to the shared embeddings with the decoder output scaled by ``d_model**-0.5``) and T5 v1.1 (gated GELU,
``feed_forward_proj="gated-gelu"``, and a separate unscaled ``lm_head``); see ``feed_forward`` and
``uses_shared_lm_head``.

Encoder and decoder can run apart: ``encode`` once, then ``decode`` as often as needed. For generation,
``init_cache`` computes every decoder layer's cross-attention keys/values from the encoder output once
(``Cache.cross``) and preallocates the self-attention cache that ``decode`` fills position by position.

``Execution(scan_layers=True)`` stacks each stack's blocks and runs them by one scan (``layers.Stacked``); the
relative position bias table of the unrolled first block then lives beside the stack (``Stacked.first_only``),
and each stack computes its bias once, before its blocks, as the unrolled model does. Its attention always runs on
XLA: the fused kernels cannot add the position bias (``attention.choose_kernel`` never gives T5 one).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.models.attention import (
    AttentionKernel,
    Cache,
    KVCache,
    attend,
    attend_cache,
    make_mask,
    merge_heads,
    query_positions,
    run_blocks,
    split_heads,
    update_kv,
)
from jaxseq.models.execution import Execution
from jaxseq.models.layers import (
    Linear,
    Stacked,
    activation,
    blocks,
    dropout,
    nested,
    normal,
    one_hot_lookup,
    padded_vocab_size,
    tied_logits,
)
from jaxseq.models.outputs import BaseOutput, LMOutput


class Seq2SeqOutput(NamedTuple):
    """Decoder logits (float32, ``[batch, target_len, vocab]``), the updated cache if one was given, and
    the encoder output (pass it back as ``encoder_outputs`` to skip the encoder next time)."""

    logits: jax.Array
    cache: Cache | None = None
    encoder_last_hidden_state: jax.Array | None = None


def uses_shared_lm_head(config) -> bool:
    """Whether the LM head is the shared embedding matrix applied to the decoder output scaled by
    ``d_model**-0.5`` (original T5) rather than a separate, unscaled ``lm_head`` (T5 v1.1, Flan-T5).

    transformers 5 keeps the checkpoint's ``tie_word_embeddings: false`` of v1.1 models as
    ``config.scale_decoder_outputs = False`` (and forces ``tie_word_embeddings`` to True, untying the
    weights only when the checkpoint holds a distinct ``lm_head.weight``); older versions keep it as is.
    A ``tie_word_embeddings=false`` set on a built config (``--config_overrides``) unties it too.
    """
    return bool(config.tie_word_embeddings) and bool(getattr(config, "scale_decoder_outputs", True))


def feed_forward(config) -> tuple[bool, str]:
    """(gated, activation) of the feed-forward from ``config.feed_forward_proj``, derived as T5Config does
    (``is_gated_act``, ``dense_act_fn``; ``"gated-gelu"`` is ``gelu_new``), here rather than read from those
    fields, which keep their first values when ``--config_overrides`` sets ``feed_forward_proj`` afterwards."""
    proj = config.feed_forward_proj
    parts = proj.split("-")
    return parts[0] == "gated", "gelu_new" if proj == "gated-gelu" else parts[-1]


def relative_position_bucket(relative_position, *, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's bucket of each relative position ``key - query`` (int32): exact buckets for small distances,
    logarithmically wider ones up to ``max_distance``; the encoder also tells left from right. The
    float32 arithmetic follows transformers step by step, so bucket boundaries round the same way."""
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = (relative_position > 0).astype(relative_position.dtype) * num_buckets
        distance = jnp.abs(relative_position)
    else:
        distance = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    scaled = (
        jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    )
    large = jnp.minimum(max_exact + scaled.astype(distance.dtype), num_buckets - 1)
    return buckets + jnp.where(distance < max_exact, distance, large)


def decoder_start_id(config) -> int | None:
    """The token a T5 decoder starts from: the config's ``decoder_start_token_id``, else the pad id (T5's
    convention; transformers' default ``T5Config`` leaves the field unset)."""
    start = getattr(config, "decoder_start_token_id", None)
    return config.pad_token_id if start is None else start


def shift_right(labels, decoder_start_token_id: int, pad_token_id: int):
    """Decoder inputs for teacher forcing, as transformers builds them from ``labels``: shifted one to
    the right behind ``decoder_start_token_id``, with the ignored label ``-100`` replaced by padding."""
    if decoder_start_token_id is None or pad_token_id is None:
        raise JaxseqError("shift_right needs decoder_start_token_id and pad_token_id (T5 uses the pad id for both)")
    labels = jnp.asarray(labels)
    start = jnp.full((*labels.shape[:-1], 1), decoder_start_token_id, labels.dtype)
    shifted = jnp.concatenate([start, labels[..., :-1]], axis=-1)
    return jnp.where(shifted == -100, jnp.asarray(pad_token_id, labels.dtype), shifted)


def position_table(config, *, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Embed:
    """A stack's relative position bias, ``[buckets, heads]``: what its first self-attention layer holds."""
    return nnx.Embed(
        config.relative_attention_num_buckets,
        config.num_heads,
        embedding_init=normal(config.initializer_factor * config.d_model**-0.5),
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


def position_bias(table: nnx.Embed, config, q_len: int, kv_len: int, index=0, *, is_decoder: bool):
    """``[1, heads, q_len, kv_len]`` bias of ``table`` (``position_table``) for queries at ``index ..`` and keys
    at ``0 .. kv_len - 1`` (causal buckets in the decoder, bidirectional in the encoder)."""
    relative = jnp.arange(kv_len, dtype=jnp.int32)[None, :] - query_positions(q_len, index)[:, None]
    buckets = relative_position_bucket(
        relative,
        bidirectional=not is_decoder,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )
    return jnp.transpose(one_hot_lookup(table, buckets), (2, 0, 1))[None]


class T5Attention(nnx.Module):
    """Unscaled multi-head attention; the first self-attention layer of each stack also owns the
    relative position bias that every layer of the stack adds to its scores."""

    def __init__(self, config, *, has_relative_attention_bias=False, dtype, param_dtype, rngs: nnx.Rngs):
        d, heads, d_kv, f = config.d_model, config.num_heads, config.d_kv, config.initializer_factor
        inner = heads * d_kv
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = Linear(d, inner, kernel_init=normal(f * (d * d_kv) ** -0.5), **kw)
        self.k = Linear(d, inner, kernel_init=normal(f * d**-0.5), **kw)
        self.v = Linear(d, inner, kernel_init=normal(f * d**-0.5), **kw)
        self.o = Linear(inner, d, kernel_init=normal(f * inner**-0.5), **kw)
        if has_relative_attention_bias:
            self.relative_attention_bias = position_table(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.num_heads = heads
        self.dropout_rate = config.dropout_rate
        self.attention = AttentionKernel()  # always XLA: the fused kernels cannot add the position bias

    fused_kernels = False
    dropout_field = "dropout_rate"

    def key_values(self, states) -> tuple[jax.Array, jax.Array]:
        """Keys and values of ``states``, ``[batch, len, heads, d_kv]``."""
        return split_heads(self.k(states), self.num_heads), split_heads(self.v(states), self.num_heads)

    def __call__(
        self,
        x,
        mask,
        bias=None,
        *,
        kv_states=None,
        kv: KVCache | None = None,
        cache: KVCache | None = None,
        index=0,
        rngs=None,
    ):
        """Self-attention over ``x``, or cross-attention over ``kv_states`` (or their precomputed ``kv``).
        With a self-attention ``cache`` the new keys/values are written at ``index`` first."""
        q = split_heads(self.q(x), self.num_heads)
        if kv is not None:  # cross-attention keys/values from init_cache
            y = attend_cache(q, kv, mask, bias=bias, scale=1.0)
        else:
            k, v = self.key_values(x if kv_states is None else kv_states)
            if cache is not None:
                cache = update_kv(cache, k, v, index)
                y = attend_cache(q, cache, mask, bias=bias, scale=1.0)
            else:
                y = attend(
                    q,
                    k.astype(q.dtype),
                    v.astype(q.dtype),
                    mask,
                    bias=bias,
                    scale=1.0,
                    dropout_rate=self.dropout_rate,
                    rngs=rngs,
                )
        return self.o(merge_heads(y)), cache


class T5LayerSelfAttention(nnx.Module):
    def __init__(self, config, *, has_relative_attention_bias, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.SelfAttention = T5Attention(config, has_relative_attention_bias=has_relative_attention_bias, **kw)
        self.layer_norm = nnx.RMSNorm(config.d_model, epsilon=config.layer_norm_epsilon, **kw)
        self.dropout_rate = config.dropout_rate

    def __call__(self, x, mask, bias, *, cache=None, index=0, rngs=None):
        a, cache = self.SelfAttention(self.layer_norm(x), mask, bias, cache=cache, index=index, rngs=rngs)
        return x + dropout(a, self.dropout_rate, rngs), cache


class T5LayerCrossAttention(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.EncDecAttention = T5Attention(config, **kw)
        self.layer_norm = nnx.RMSNorm(config.d_model, epsilon=config.layer_norm_epsilon, **kw)
        self.dropout_rate = config.dropout_rate

    def __call__(self, x, mask, *, kv_states=None, kv=None, rngs=None):
        a, _ = self.EncDecAttention(self.layer_norm(x), mask, kv_states=kv_states, kv=kv, rngs=rngs)
        return x + dropout(a, self.dropout_rate, rngs)


class T5DenseActDense(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, f = config.d_model, config.initializer_factor
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wi = Linear(d, config.d_ff, kernel_init=normal(f * d**-0.5), **kw)
        self.wo = Linear(config.d_ff, d, kernel_init=normal(f * config.d_ff**-0.5), **kw)
        self.act = activation(feed_forward(config)[1])
        self.dropout_rate = config.dropout_rate

    def __call__(self, x, rngs=None):
        return self.wo(dropout(self.act(self.wi(x)), self.dropout_rate, rngs))


class T5DenseGatedActDense(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, f = config.d_model, config.initializer_factor
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wi_0 = Linear(d, config.d_ff, kernel_init=normal(f * d**-0.5), **kw)
        self.wi_1 = Linear(d, config.d_ff, kernel_init=normal(f * d**-0.5), **kw)
        self.wo = Linear(config.d_ff, d, kernel_init=normal(f * config.d_ff**-0.5), **kw)
        self.act = activation(feed_forward(config)[1])
        self.dropout_rate = config.dropout_rate

    def __call__(self, x, rngs=None):
        return self.wo(dropout(self.act(self.wi_0(x)) * self.wi_1(x), self.dropout_rate, rngs))


class T5LayerFF(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        gated, _ = feed_forward(config)
        self.DenseReluDense = (T5DenseGatedActDense if gated else T5DenseActDense)(config, **kw)
        self.layer_norm = nnx.RMSNorm(config.d_model, epsilon=config.layer_norm_epsilon, **kw)
        self.dropout_rate = config.dropout_rate

    def __call__(self, x, rngs=None):
        return x + dropout(self.DenseReluDense(self.layer_norm(x), rngs), self.dropout_rate, rngs)


class T5Block(nnx.Module):
    """``layer``: self-attention, then (decoder only) cross-attention, then the feed-forward layer."""

    def __init__(self, config, *, has_relative_attention_bias, is_decoder, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        layers = [T5LayerSelfAttention(config, has_relative_attention_bias=has_relative_attention_bias, **kw)]
        if is_decoder:
            layers.append(T5LayerCrossAttention(config, **kw))
        layers.append(T5LayerFF(config, **kw))
        self.layer = nnx.List(layers)
        self.is_decoder = is_decoder

    def __call__(
        self, x, mask, bias, *, encoder_hidden=None, encoder_mask=None, cross=None, cache=None, index=0, rngs=None
    ):
        x, cache = self.layer[0](x, mask, bias, cache=cache, index=index, rngs=rngs)
        if self.is_decoder:
            x = self.layer[1](x, encoder_mask, kv_states=encoder_hidden, kv=cross, rngs=rngs)
        return self.layer[-1](x, rngs), cache


class T5Stack(nnx.Module):
    """The encoder or the decoder: blocks and a final RMS norm, fed embeddings of the shared table;
    ``execution``: how the blocks run (``models.execution``): a list, or stacked and scanned (``layers.Stacked``),
    their remat and weight gathering."""

    def __init__(
        self, config, *, is_decoder: bool, dtype, param_dtype, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.block = blocks(
            lambda i, rngs: T5Block(
                config,
                has_relative_attention_bias=i == 0 and not execution.scan_layers,
                is_decoder=is_decoder,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            ),
            config.num_decoder_layers if is_decoder else config.num_layers,
            rngs,
            execution,
            first_only=lambda rngs: nested(
                "layer/0/SelfAttention/relative_attention_bias",
                position_table(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs),
            ),
        )
        self.final_layer_norm = nnx.RMSNorm(config.d_model, epsilon=config.layer_norm_epsilon, **kw)
        self.config = config
        self.is_decoder = is_decoder
        self.dropout_rate = config.dropout_rate
        self.remat = execution.remat  # what each block keeps for the backward pass

    @property
    def bias_table(self) -> nnx.Embed:
        """The relative position bias of every layer: the unrolled first block's (``position_table``)."""
        first = self.block.first_only if isinstance(self.block, Stacked) else self.block[0]
        return first.layer[0].SelfAttention.relative_attention_bias

    def __call__(
        self,
        embeds,
        attention_mask=None,
        *,
        encoder_hidden=None,
        encoder_mask=None,
        cache: Cache | None = None,
        rngs=None,
    ) -> BaseOutput:
        """``attention_mask`` is ``[batch, seq]`` (1 = token), or, with a decoder ``cache``, covers its
        ``max_len`` positions. The decoder attends to ``encoder_hidden`` or to ``cache.cross``."""
        seq = embeds.shape[1]
        index = 0 if cache is None else cache.index
        kv_len = seq if cache is None else cache.max_len()
        mask = make_mask(attention_mask, seq, kv_len, causal=self.is_decoder, index=index)
        bias = position_bias(self.bias_table, self.config, seq, kv_len, index, is_decoder=self.is_decoder)
        cross_mask = None
        if self.is_decoder:
            if cache is None and encoder_hidden is None:
                raise JaxseqError("the T5 decoder needs encoder_hidden (or a cache from init_cache)")
            enc_len = encoder_hidden.shape[1] if cache is None else jax.tree.leaves(cache.cross)[0].shape[-2]
            cross_mask = make_mask(encoder_mask, seq, enc_len, causal=False, cross=True)
        x = dropout(embeds, self.dropout_rate, rngs)
        x, cache = run_blocks(
            self.block,
            self.remat,
            x,
            mask,
            bias.astype(embeds.dtype),
            cache=cache,
            rngs=rngs,
            encoder_hidden=encoder_hidden,
            encoder_mask=cross_mask,
        )
        return BaseOutput(dropout(self.final_layer_norm(x), self.dropout_rate, rngs), cache)


class T5ForConditionalGeneration(nnx.Module):
    """T5 encoder-decoder with its language-model head (the shared embeddings for original T5, a
    separate ``lm_head`` for v1.1; see ``uses_shared_lm_head``)."""

    hf_architecture = "T5ForConditionalGeneration"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        f = config.initializer_factor
        self.shared = nnx.Embed(padded_vocab_size(config.vocab_size), config.d_model, embedding_init=normal(f), **kw)
        self.encoder = T5Stack(config, is_decoder=False, execution=execution, **kw)
        self.decoder = T5Stack(config, is_decoder=True, execution=execution, **kw)
        self.tied = uses_shared_lm_head(config)
        if not self.tied:
            self.lm_head = Linear(
                config.d_model,
                padded_vocab_size(config.vocab_size),
                use_bias=False,
                kernel_init=normal(f),
                preferred_element_type=jnp.float32,
                **kw,
            )

    def decoder_start_id(self) -> int | None:
        """The token the decoder starts from (``decoder_start_id`` of the config)."""
        return decoder_start_id(self.config)

    def decoder_inputs(self, labels):
        """Teacher-forcing decoder inputs of ``labels``: shifted right behind the start token (``shift_right``)."""
        return shift_right(labels, decoder_start_id(self.config), self.config.pad_token_id)

    def encode(self, input_ids, attention_mask=None, *, rngs=None):
        """Encoder output ``[batch, source_len, d_model]`` (``attention_mask``: 1 = token, 0 = padding)."""
        return self.encoder(self.shared(input_ids), attention_mask, rngs=rngs).last_hidden_state

    def decode(
        self,
        decoder_input_ids,
        encoder_hidden,
        encoder_attention_mask=None,
        decoder_attention_mask=None,
        *,
        cache: Cache | None = None,
        rngs=None,
    ) -> LMOutput:
        """Logits of the decoder over the encoder output. Without a cache this is the teacher-forced
        pass over all of ``decoder_input_ids``. With one (``init_cache``) the tokens are written at
        ``cache.index``, cross-attention uses ``cache.cross`` (``encoder_hidden`` may then be None), and
        ``decoder_attention_mask``, if given, covers the cache's ``max_len`` positions."""
        out = self.decoder(
            self.shared(decoder_input_ids),
            decoder_attention_mask,
            encoder_hidden=encoder_hidden,
            encoder_mask=encoder_attention_mask,
            cache=cache,
            rngs=rngs,
        )
        h = out.last_hidden_state
        if self.tied:
            logits = tied_logits(h * self.config.d_model**-0.5, self.shared.embedding[...], self.dtype)
        else:
            logits = self.lm_head(h)
        return LMOutput(logits[..., : self.config.vocab_size].astype(jnp.float32), out.cache)

    def __call__(
        self,
        input_ids,
        attention_mask,
        decoder_input_ids,
        decoder_attention_mask=None,
        *,
        encoder_outputs=None,
        cache: Cache | None = None,
        rngs=None,
    ) -> Seq2SeqOutput:
        """Encode (unless ``encoder_outputs``, a previous ``encode`` result, is given) and decode."""
        if encoder_outputs is None:
            encoder_outputs = self.encode(input_ids, attention_mask, rngs=rngs)
        out = self.decode(
            decoder_input_ids, encoder_outputs, attention_mask, decoder_attention_mask, cache=cache, rngs=rngs
        )
        return Seq2SeqOutput(out.logits, out.cache, encoder_outputs)

    def init_cache(self, encoder_hidden, encoder_attention_mask, max_len: int, dtype=None) -> Cache:
        """An empty decoder self-attention cache of ``max_len`` positions, plus every decoder layer's
        cross-attention keys/values computed here, once, from ``encoder_hidden``. The encoder mask (or
        None) is not stored: pass it to each ``decode`` call; it is only checked against the output."""
        batch, enc_len = encoder_hidden.shape[:2]
        if encoder_attention_mask is not None and tuple(encoder_attention_mask.shape) != (batch, enc_len):
            raise JaxseqError(
                f"encoder_attention_mask has shape {tuple(encoder_attention_mask.shape)} but the encoder "
                f"output is {(batch, enc_len)}; pass the mask given to encode"
            )
        c, dtype, stack = self.config, dtype or self.dtype, self.decoder.block
        cross = lambda block: KVCache.of(*block.layer[1].EncDecAttention.key_values(encoder_hidden), dtype)
        stacked = isinstance(stack, Stacked)
        layers = Cache.zeros(len(stack), batch, max_len, c.num_heads, c.d_kv, dtype, stacked=stacked)
        return layers._replace(cross=stack.each(cross) if stacked else tuple(map(cross, stack)))
