"""GPT-2 (Radford et al. 2019) as Flax NNX modules whose parameter paths mirror transformers' PyTorch names."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxseq.models.attention import (
    Cache,
    KVCache,
    attend,
    attend_cache,
    decoder_mask,
    merge_heads,
    run_blocks,
    split_heads,
    update_kv,
)
from jaxseq.models.execution import Execution
from jaxseq.models.heads import DecoderLM, LastTokenClassifier
from jaxseq.models.layers import (
    Conv1D,
    Linear,
    Stacked,
    activation,
    blocks,
    dropout,
    normal,
    padded_vocab_size,
    tied_logits,
)
from jaxseq.models.outputs import BaseOutput


class GPT2Attention(nnx.Module):
    """Causal self-attention. ``layer_idx`` matters to configs with ``scale_attn_by_inverse_layer_idx``
    (scores further divided by ``layer_idx + 1``; a scanned stack passes ``layer`` when called instead);
    ``reorder_and_upcast_attn`` computes the attention of a lower-precision compute dtype in float32 (as
    transformers does; the same numbers in float32)."""

    dropout_field = "attn_pdrop"  # the config's attention dropout (see attention.choose_kernel)

    def __init__(
        self, config, layer_idx: int = 0, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs
    ):
        d, std = config.n_embd, config.initializer_range
        out_std = std / (2 * config.n_layer) ** 0.5
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.c_attn = Conv1D(d, 3 * d, kernel_init=normal(std), **kw)
        self.c_proj = Conv1D(d, d, kernel_init=normal(out_std), **kw)
        self.num_heads = config.n_head
        self.scale = (d // config.n_head) ** -0.5 if config.scale_attn_weights else 1.0
        self.layer_idx, self.by_layer = layer_idx, bool(config.scale_attn_by_inverse_layer_idx)
        self.upcast = bool(config.reorder_and_upcast_attn)
        self.dropout_rate, self.resid_pdrop = config.attn_pdrop, config.resid_pdrop
        self.dtype, self.attention = dtype, execution.attention

    def __call__(self, x, mask, *, cache: KVCache | None = None, index=0, rngs=None, layer=None):
        q, k, v = (split_heads(t, self.num_heads) for t in jnp.split(self.c_attn(x), 3, axis=-1))
        if self.upcast:
            q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
        scale = self.scale / ((self.layer_idx if layer is None else layer) + 1) if self.by_layer else self.scale
        if cache is not None:
            cache = update_kv(cache, k, v, index)
            y = attend_cache(q, cache, mask, scale=scale)
        else:
            y = attend(
                q, k, v, mask, scale=scale, dropout_rate=self.dropout_rate, rngs=rngs, kernel=self.attention,
                causal=True,
            )  # fmt: skip
        return dropout(self.c_proj(merge_heads(y.astype(x.dtype))), self.resid_pdrop, rngs), cache


class GPT2MLP(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, inner, std = config.n_embd, config.n_inner or 4 * config.n_embd, config.initializer_range
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.c_fc = Conv1D(d, inner, kernel_init=normal(std), **kw)
        self.c_proj = Conv1D(inner, d, kernel_init=normal(std / (2 * config.n_layer) ** 0.5), **kw)
        self.act = activation(config.activation_function)
        self.resid_pdrop = config.resid_pdrop

    def __call__(self, x, rngs=None):
        return dropout(self.c_proj(self.act(self.c_fc(x))), self.resid_pdrop, rngs)


class GPT2Block(nnx.Module):
    uses_layer_index = True  # scanned, it is called with its layer (see layers.Stacked)

    def __init__(
        self, config, layer_idx: int = 0, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln_1 = nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, **kw)
        self.attn = GPT2Attention(config, layer_idx, execution=execution, **kw)
        self.ln_2 = nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, **kw)
        self.mlp = GPT2MLP(config, **kw)

    def __call__(self, x, mask, *, cache=None, index=0, rngs=None, layer=None):
        a, cache = self.attn(self.ln_1(x), mask, cache=cache, index=index, rngs=rngs, layer=layer)
        x = x + a
        return x + self.mlp(self.ln_2(x), rngs), cache


class GPT2Model(nnx.Module):
    """The transformer stack. ``attention_mask`` is ``[batch, seq]`` (1 = token, 0 = padding); with a
    ``cache`` it covers the cache's ``max_len`` positions instead (see ``jaxseq.models.attention``).
    ``execution``: how the blocks run (``models.execution``): stacked and run by one scan (``layers.Stacked``)
    or a Python loop, their attention kernel, remat and weight gathering."""

    hf_architecture = "GPT2Model"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        std = config.initializer_range
        self.wte = nnx.Embed(padded_vocab_size(config.vocab_size), config.n_embd, embedding_init=normal(std), **kw)
        self.wpe = nnx.Embed(config.n_positions, config.n_embd, embedding_init=normal(std), **kw)
        self.h = blocks(
            lambda i, rngs: GPT2Block(config, i, execution=execution, dtype=dtype, param_dtype=param_dtype, rngs=rngs),
            config.n_layer,
            rngs,
            execution,
        )
        self.ln_f = nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, **kw)
        self.remat = execution.remat  # what each block keeps for the backward pass

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        seq = input_ids.shape[1]
        index = 0 if cache is None else cache.index
        if position_ids is None:
            position_ids = (index + jnp.arange(seq, dtype=jnp.int32))[None, :]
        x = self.wte(input_ids) + self.wpe(position_ids)
        x = dropout(x, self.config.embd_pdrop, rngs)
        mask = decoder_mask(attention_mask, seq, cache, index)
        x, cache = run_blocks(self.h, self.remat, x, mask, cache=cache, rngs=rngs)
        return BaseOutput(self.ln_f(x), cache)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        c = self.config
        return Cache.zeros(
            c.n_layer, batch, max_len, c.n_head, c.n_embd // c.n_head, dtype or self.dtype,
            stacked=isinstance(self.h, Stacked),
        )  # fmt: skip


class GPT2LMHeadModel(DecoderLM):
    """GPT-2 with its language-model head (tied to the token embeddings unless the config unties it)."""

    hf_architecture = "GPT2LMHeadModel"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.transformer = GPT2Model(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                config.n_embd,
                padded_vocab_size(config.vocab_size),
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                preferred_element_type=jnp.float32,
                kernel_init=normal(config.initializer_range),
                rngs=rngs,
            )

    def logits(self, h):
        """float32 logits of hidden states ``[..., n_embd]`` over the padded vocabulary, multiplied in the
        compute dtype and accumulated in float32."""
        if self.config.tie_word_embeddings:
            return tied_logits(h, self.transformer.wte.embedding[...], self.transformer.dtype)
        return self.lm_head(h)


class GPT2ForSequenceClassification(LastTokenClassifier):
    hf_architecture = "GPT2ForSequenceClassification"
    base = GPT2Model


class GPT2ForTokenClassification(nnx.Module):
    """GPT-2 scoring every token: logits ``[batch, seq, num_labels]`` (named entities), as transformers': the
    hidden states through dropout (``classifier_dropout``, else ``hidden_dropout``, else 0.1) and
    ``classifier`` (with a bias)."""

    hf_architecture = "GPT2ForTokenClassification"
    task_head = r"^classifier/"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.transformer = GPT2Model(config, execution=execution, **kw)
        init = normal(config.initializer_range)
        self.classifier = Linear(config.hidden_size, config.num_labels, kernel_init=init, **kw)
        rates = (getattr(config, "classifier_dropout", None), getattr(config, "hidden_dropout", None), 0.1)
        self.classifier_dropout = next(rate for rate in rates if rate is not None)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, rngs=None):
        h = self.transformer(input_ids, attention_mask, position_ids, rngs=rngs).last_hidden_state
        return self.classifier(dropout(h, self.classifier_dropout, rngs)).astype(jnp.float32)
