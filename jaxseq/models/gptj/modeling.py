"""GPT-J (Wang & Komatsuzaki 2021) as Flax NNX modules whose parameter paths mirror transformers' PyTorch names.

Unlike GPT-2 it has no position embeddings: rotary embeddings turn the first ``rotary_dim`` features of every
query and key head (pairs of neighbouring features, "rotate every two"), and each block adds attention and
MLP in parallel, both reading the same ``ln_1`` output.
"""

from __future__ import annotations

import jax
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


def rotary_dim(config) -> int:
    """Features of each head that rotate (all of them if the config leaves ``rotary_dim`` unset)."""
    return config.rotary_dim or config.n_embd // config.n_head


def sincos(position_ids: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """float32 ``(sin, cos)`` of shape ``[batch, seq, 1, dim]`` for ``[batch, seq]`` positions, each angle
    repeated for the two features of its pair (transformers' ``create_sinusoidal_positions``)."""
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = position_ids.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.repeat(angles, 2, axis=-1)[:, :, None, :]
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate the first ``sin.shape[-1]`` features of ``x`` (``[batch, seq, heads, head_dim]``) in float32;
    feature pairs (2i, 2i+1) turn by the same angle, the remaining features pass through."""
    dim = sin.shape[-1]
    rot, rest = x[..., :dim].astype(jnp.float32), x[..., dim:]
    turned = jnp.stack((-rot[..., 1::2], rot[..., ::2]), axis=-1).reshape(rot.shape)
    rot = (rot * cos + turned * sin).astype(x.dtype)
    return jnp.concatenate([rot, rest], axis=-1)


class GPTJAttention(nnx.Module):
    dropout_field = "attn_pdrop"  # the config's attention dropout (see attention.choose_kernel)

    def __init__(self, config, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs):
        d = config.n_embd
        kw = dict(
            use_bias=False,
            kernel_init=normal(config.initializer_range),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.q_proj = Linear(d, d, **kw)
        self.k_proj = Linear(d, d, **kw)
        self.v_proj = Linear(d, d, **kw)
        self.out_proj = Linear(d, d, **kw)
        self.num_heads = config.n_head
        self.scale = (d // config.n_head) ** -0.5
        self.dropout_rate, self.resid_pdrop = config.attn_pdrop, config.resid_pdrop
        self.dtype, self.attention = dtype, execution.attention

    def __call__(self, x, mask, rope, *, cache: KVCache | None = None, index=0, rngs=None):
        q, k, v = (split_heads(proj(x), self.num_heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            cache = update_kv(cache, k, v, index)
            y = attend_cache(q, cache, mask, scale=self.scale)
        else:
            y = attend(
                q, k, v, mask, scale=self.scale, dropout_rate=self.dropout_rate, rngs=rngs, kernel=self.attention,
                causal=True,
            )  # fmt: skip
        return dropout(self.out_proj(merge_heads(y)), self.resid_pdrop, rngs), cache


class GPTJMLP(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, inner = config.n_embd, config.n_inner or 4 * config.n_embd
        kw = dict(kernel_init=normal(config.initializer_range), dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc_in = Linear(d, inner, **kw)
        self.fc_out = Linear(inner, d, **kw)
        self.act = activation(config.activation_function)
        self.resid_pdrop = config.resid_pdrop

    def __call__(self, x, rngs=None):
        return dropout(self.fc_out(self.act(self.fc_in(x))), self.resid_pdrop, rngs)


class GPTJBlock(nnx.Module):
    def __init__(self, config, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln_1 = nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, **kw)
        self.attn = GPTJAttention(config, execution=execution, **kw)
        self.mlp = GPTJMLP(config, **kw)

    def __call__(self, x, mask, rope, *, cache=None, index=0, rngs=None):
        h = self.ln_1(x)
        a, cache = self.attn(h, mask, rope, cache=cache, index=index, rngs=rngs)
        return x + a + self.mlp(h, rngs), cache


class GPTJModel(nnx.Module):
    """The transformer stack. ``attention_mask`` is ``[batch, seq]`` (1 = token, 0 = padding); with a
    ``cache`` it covers the cache's ``max_len`` positions instead (see ``jaxseq.models.attention``).
    ``position_ids`` default to ``0, 1, ...`` after the cache's index; pass them for left padding.
    ``execution``: how the blocks run (``models.execution``): stacked and run by one scan (``layers.Stacked``)
    or a Python loop, their attention kernel, remat and weight gathering."""

    hf_architecture = "GPTJModel"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wte = nnx.Embed(
            padded_vocab_size(config.vocab_size), config.n_embd, embedding_init=normal(config.initializer_range), **kw
        )
        self.h = blocks(
            lambda _, rngs: GPTJBlock(config, execution=execution, dtype=dtype, param_dtype=param_dtype, rngs=rngs),
            config.n_layer,
            rngs,
            execution,
        )
        self.remat = execution.remat  # what each block keeps for the backward pass
        self.ln_f = nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, **kw)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        seq = input_ids.shape[1]
        index = 0 if cache is None else cache.index
        if position_ids is None:
            position_ids = (index + jnp.arange(seq, dtype=jnp.int32))[None, :]
        rope = sincos(position_ids, rotary_dim(self.config))
        x = dropout(self.wte(input_ids), self.config.embd_pdrop, rngs)
        mask = decoder_mask(attention_mask, seq, cache, index)
        x, cache = run_blocks(self.h, self.remat, x, mask, rope, cache=cache, rngs=rngs)
        return BaseOutput(self.ln_f(x), cache)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        c = self.config
        return Cache.zeros(
            c.n_layer, batch, max_len, c.n_head, c.n_embd // c.n_head, dtype or self.dtype,
            stacked=isinstance(self.h, Stacked),
        )  # fmt: skip


class TiedHeadBias(nnx.Module):
    """The bias of GPT-J's ``lm_head`` when its weight is tied to the token embeddings."""

    def __init__(self, features: int, *, param_dtype):
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype))


class GPTJForCausalLM(DecoderLM):
    """GPT-J with its language-model head, which (unlike GPT-2's) has a bias; its weight is a separate
    parameter unless the config ties it to the token embeddings."""

    hf_architecture = "GPTJForCausalLM"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.transformer = GPTJModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)
        if config.tie_word_embeddings:
            self.lm_head = TiedHeadBias(padded_vocab_size(config.vocab_size), param_dtype=param_dtype)
        else:
            self.lm_head = Linear(
                config.n_embd,
                padded_vocab_size(config.vocab_size),
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
            logits = tied_logits(h, self.transformer.wte.embedding[...], self.transformer.dtype)
            return logits + self.lm_head.bias[...].astype(jnp.float32)
        return self.lm_head(h)


class GPTJForSequenceClassification(LastTokenClassifier):
    hf_architecture = "GPTJForSequenceClassification"
    base = GPTJModel
