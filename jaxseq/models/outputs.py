"""What the models return: NamedTuples, so they are pytrees that jit and while_loop carry as is."""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxseq.models.attention import Cache


class LMOutput(NamedTuple):
    """Language-model logits (float32, ``[batch, seq, vocab]``) and the updated cache, if one was given."""

    logits: jax.Array
    cache: Cache | None = None


class BaseOutput(NamedTuple):
    """Final hidden states of a base model; ``pooler_output`` for BERT, ``cache`` for decoders."""

    last_hidden_state: jax.Array
    cache: Cache | None = None
    pooler_output: jax.Array | None = None
