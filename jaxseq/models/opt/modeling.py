"""OPT (Zhang et al. 2022) as Flax NNX modules whose parameter paths mirror transformers' PyTorch names
(``model/decoder/layers/0/self_attn/q_proj/kernel`` is ``model.decoder.layers.0.self_attn.q_proj.weight``).

A decoder with learned positions and LayerNorm, in both of OPT's layouts: pre-norm (125m and most sizes,
``do_layer_norm_before``, a final norm after the stack) and post-norm (350m: each sublayer's norm after its
residual sum, no final norm). Token embeddings ``word_embed_proj_dim`` wide are projected to ``hidden_size``
(``project_in``) and the last states back (``project_out``) when the two differ; the LM head is tied to the
token embeddings unless the config unties it. Positions are 0-based, counted over the attention mask's real
tokens as transformers counts them (padding at -1), and looked up 2 rows further on (OPT's offset)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseq.errors import JaxseqError
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
    embedding_lookup,
    normal,
    padded_vocab_size,
    tied_logits,
)
from jaxseq.models.outputs import BaseOutput

POSITION_OFFSET = 2  # rows of the position table below position 0 (fairseq's padding_idx + 1)


def word_width(config) -> int:
    """The width of the token embeddings and of the states the heads read."""
    return config.word_embed_proj_dim or config.hidden_size


def mask_positions(attention_mask, seq: int, index=0):
    """0-based positions of ``seq`` tokens from ``index``: each real token's count of real tokens before it in
    ``attention_mask`` (``[batch, index + seq]`` or longer: a cache's), -1 at padding (transformers' OPT)."""
    real = (attention_mask != 0).astype(jnp.int32)
    positions = jnp.cumsum(real, axis=1) * real - 1
    return jax.lax.dynamic_slice_in_dim(positions, index, seq, axis=1)


class OPTAttention(nnx.Module):
    dropout_field = "attention_dropout"  # the config's attention dropout (see attention.choose_kernel)

    def __init__(self, config, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs):
        d, heads = config.hidden_size, config.num_attention_heads
        if d % heads:
            raise JaxseqError(f"hidden_size {d} is not a multiple of num_attention_heads {heads}; fix the config")
        kw = dict(
            use_bias=config.enable_bias, kernel_init=normal(config.init_std), dtype=dtype, param_dtype=param_dtype,
            rngs=rngs,
        )  # fmt: skip
        self.q_proj = Linear(d, d, **kw)
        self.k_proj = Linear(d, d, **kw)
        self.v_proj = Linear(d, d, **kw)
        self.out_proj = Linear(d, d, **kw)
        self.num_heads, self.scale = heads, (d // heads) ** -0.5
        self.dropout_rate = config.attention_dropout
        self.dtype, self.attention = dtype, execution.attention

    def __call__(self, x, mask, *, cache: KVCache | None = None, index=0, rngs=None):
        q, k, v = (split_heads(proj(x), self.num_heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if cache is not None:
            cache = update_kv(cache, k, v, index)
            y = attend_cache(q, cache, mask, scale=self.scale)
        else:
            y = attend(
                q, k, v, mask, scale=self.scale, dropout_rate=self.dropout_rate, rngs=rngs, kernel=self.attention,
                causal=True,
            )  # fmt: skip
        return self.out_proj(merge_heads(y)), cache


class OPTDecoderLayer(nnx.Module):
    """Attention and the feed-forward (``fc2(act(fc1(x)))``), each with its residual and LayerNorm: before the
    sublayer when ``do_layer_norm_before``, else after the residual sum."""

    def __init__(self, config, *, execution: Execution = Execution(), dtype, param_dtype, rngs: nnx.Rngs):
        d, affine = config.hidden_size, config.layer_norm_elementwise_affine
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(epsilon=1e-5, use_scale=affine, use_bias=affine, **kw)  # PyTorch's LayerNorm default
        self.self_attn = OPTAttention(config, execution=execution, **kw)
        self.self_attn_layer_norm = nnx.LayerNorm(d, **norm)
        linear = dict(use_bias=config.enable_bias, kernel_init=normal(config.init_std), **kw)
        self.fc1 = Linear(d, config.ffn_dim, **linear)
        self.fc2 = Linear(config.ffn_dim, d, **linear)
        self.final_layer_norm = nnx.LayerNorm(d, **norm)
        self.act = activation(config.activation_function)
        self.pre_norm, self.dropout_rate = config.do_layer_norm_before, config.dropout

    def __call__(self, x, mask, *, cache=None, index=0, rngs=None):
        attn_norm, mlp_norm = self.self_attn_layer_norm, self.final_layer_norm
        a, cache = self.self_attn(attn_norm(x) if self.pre_norm else x, mask, cache=cache, index=index, rngs=rngs)
        x = x + dropout(a, self.dropout_rate, rngs)
        x = x if self.pre_norm else attn_norm(x)
        h = self.fc2(self.act(self.fc1(mlp_norm(x) if self.pre_norm else x)))
        x = x + dropout(h, self.dropout_rate, rngs)
        return (x if self.pre_norm else mlp_norm(x)), cache


class OPTDecoder(nnx.Module):
    """The decoder stack. ``attention_mask`` is ``[batch, seq]`` (1 = token, 0 = padding; or packed examples'
    segment ids); with a ``cache`` it covers the cache's ``max_len`` positions instead (see
    ``jaxseq.models.attention``). ``position_ids`` (0-based) default to ``mask_positions`` of the mask, or
    ``0, 1, ...`` after the cache's index without one. ``execution``: how the blocks run (``models.execution``):
    stacked and run by one scan (``layers.Stacked``) or a Python loop, their attention kernel, remat and weight
    gathering."""

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        if config.layerdrop:
            raise JaxseqError(f"OPT's layerdrop ({config.layerdrop}) is not supported; set it to 0")
        self.config, self.dtype = config, dtype
        d, width, std = config.hidden_size, word_width(config), config.init_std
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(padded_vocab_size(config.vocab_size), width, embedding_init=normal(std), **kw)
        rows = config.max_position_embeddings + POSITION_OFFSET
        self.embed_positions = nnx.Embed(rows, d, embedding_init=normal(std), **kw)
        projected = width != d
        self.project_in = Linear(width, d, use_bias=False, kernel_init=normal(std), **kw) if projected else None
        self.project_out = Linear(d, width, use_bias=False, kernel_init=normal(std), **kw) if projected else None
        affine = config.layer_norm_elementwise_affine
        final = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = (
            nnx.LayerNorm(d, epsilon=1e-5, use_scale=affine, use_bias=affine, **kw) if final else None
        )
        self.layers = blocks(
            lambda _, rngs: OPTDecoderLayer(
                config, execution=execution, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            ),
            config.num_hidden_layers,
            rngs,
            execution,
        )
        self.remat = execution.remat  # what each block keeps for the backward pass

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        seq = input_ids.shape[1]
        index = 0 if cache is None else cache.index
        if position_ids is None and attention_mask is None:
            position_ids = (index + jnp.arange(seq, dtype=jnp.int32))[None, :]
        elif position_ids is None:
            position_ids = mask_positions(attention_mask, seq, index)
        x = embedding_lookup(self.embed_tokens, input_ids, self.config.pad_token_id)
        x = x if self.project_in is None else self.project_in(x)
        x = x + self.embed_positions(position_ids + POSITION_OFFSET)
        mask = decoder_mask(attention_mask, seq, cache, index)
        x, cache = run_blocks(self.layers, self.remat, x, mask, cache=cache, rngs=rngs)
        x = x if self.final_layer_norm is None else self.final_layer_norm(x)
        return BaseOutput(x if self.project_out is None else self.project_out(x), cache)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        c = self.config
        return Cache.zeros(
            c.num_hidden_layers, batch, max_len, c.num_attention_heads, c.hidden_size // c.num_attention_heads,
            dtype or self.dtype, stacked=isinstance(self.layers, Stacked),
        )  # fmt: skip


class OPTModel(nnx.Module):
    """transformers' ``OPTModel``: the decoder under ``decoder``."""

    hf_architecture = "OPTModel"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.decoder = OPTDecoder(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        return self.decoder(input_ids, attention_mask, position_ids, cache=cache, rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        return self.decoder.init_cache(batch, max_len, dtype)


class OPTForCausalLM(DecoderLM):
    """The decoder with its language-model head (``word_embed_proj_dim`` wide; tied to the token embeddings
    unless ``tie_word_embeddings`` is false)."""

    hf_architecture = "OPTForCausalLM"
    base_name = "model"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.model = OPTModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                word_width(config),
                padded_vocab_size(config.vocab_size),
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                preferred_element_type=jnp.float32,
                kernel_init=normal(config.init_std),
                rngs=rngs,
            )

    def logits(self, h):
        """float32 logits of hidden states ``[..., word_embed_proj_dim]`` over the padded vocabulary, multiplied
        in the compute dtype and accumulated in float32."""
        if self.config.tie_word_embeddings:
            return tied_logits(h, self.model.decoder.embed_tokens.embedding[...], self.model.decoder.dtype)
        return self.lm_head(h)


class OPTForSequenceClassification(LastTokenClassifier):
    """The score of each row's last real token (``LastTokenClassifier``'s call), read from the
    ``word_embed_proj_dim``-wide states."""

    hf_architecture = "OPTForSequenceClassification"
    base_name = "model"

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        self.model = OPTModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)
        self.score = Linear(
            word_width(config),
            config.num_labels,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=normal(config.init_std),
            rngs=rngs,
        )
