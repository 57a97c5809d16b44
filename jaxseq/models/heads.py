"""The heads decoder families share: a language-model head over a decoder (``DecoderLM``) and a classifier
of each row's last token (``LastTokenClassifier``), each holding its family's base model."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxseq.models.attention import Cache, take_positions
from jaxseq.models.execution import Execution
from jaxseq.models.layers import Linear, normal
from jaxseq.models.outputs import LMOutput


class DecoderLM(nnx.Module):
    """What a decoder with a language-model head does with its ``transformer`` and ``logits``: the forward
    pass, its final hidden states (the chunked loss feeds them to ``logits`` a chunk of positions at a time,
    ``jaxseq.train.objectives.CausalLM``) and its KV cache. ``logits`` runs over the padded vocabulary
    (``layers.padded_vocab_size``, which shards on any mesh); the loss leaves the padding out
    (``objectives.cross_entropy``) and ``__call__`` returns the ``config.vocab_size`` real entries.
    ``base_name``: the attribute holding the base model (``transformer``; Llama's is ``model``)."""

    base_name = "transformer"

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        """Logits over the ``config.vocab_size`` tokens, as transformers returns them."""
        out = self.hidden_states(input_ids, attention_mask, position_ids, cache=cache, rngs=rngs)
        return LMOutput(self.logits(out.last_hidden_state)[..., : self.config.vocab_size], out.cache, out.aux_loss)

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        """The final hidden states (``BaseOutput``), before the head."""
        return getattr(self, self.base_name)(input_ids, attention_mask, position_ids, cache=cache, rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        return getattr(self, self.base_name).init_cache(batch, max_len, dtype)

    @property
    def sequence_shards(self) -> int:
        """How many devices share each row's positions (a cp mesh's: ``attention.split_sequence``); the hidden
        states come back in order, split so."""
        context = getattr(getattr(self, self.base_name), "context", None)
        return 1 if context is None else context.shape["cp"]


def last_token_index(input_ids, pad_token_id):
    """Index of the last non-padding token of each row, as transformers picks it for classification."""
    if pad_token_id is None:
        return jnp.full((input_ids.shape[0],), input_ids.shape[1] - 1)
    positions = jnp.arange(input_ids.shape[1])
    return jnp.argmax(jnp.where(input_ids != pad_token_id, positions, -1), axis=-1)


class LastTokenClassifier(nnx.Module):
    """A decoder (``base``) scoring the hidden state of each row's last non-padding token
    (``config.pad_token_id``), as transformers' GPT-style classifiers do; or, for rows of packed
    examples (``jaxseq.data.packing``), the hidden states at the flat positions ``pool_index``. ``base`` is
    held in the attribute ``base_name`` (as in ``DecoderLM``)."""

    base: type
    base_name = "transformer"
    pooled_token = "last"  # which token of a packed example pool_index points at
    task_head = r"^score/"  # what fine-tuning adds to the pretrained model (trained in full beside LoRA)

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        self.config = config
        base = self.base(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)
        setattr(self, self.base_name, base)
        self.score = Linear(
            config.hidden_size,
            config.num_labels,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=normal(config.initializer_range),
            rngs=rngs,
        )

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, pool_index=None, rngs=None):
        h = getattr(self, self.base_name)(input_ids, attention_mask, position_ids, rngs=rngs).last_hidden_state
        if pool_index is None:
            last = last_token_index(input_ids, self.config.pad_token_id)
            pooled = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        else:
            pooled = take_positions(h, pool_index)
        return self.score(pooled).astype(jnp.float32)
