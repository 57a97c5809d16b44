"""What the models return: NamedTuples, so they are pytrees that jit and while_loop carry as is."""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxseq.models.attention import Cache


class LMOutput(NamedTuple):
    """Language-model logits (float32, ``[batch, seq, vocab]``), the updated cache, if one was given, and the
    model's auxiliary loss, if it has one (a MoE's router load balancing, which training adds to its loss)."""

    logits: jax.Array
    cache: Cache | None = None
    aux_loss: jax.Array | None = None


class BaseOutput(NamedTuple):
    """Final hidden states of a base model; ``pooler_output`` for BERT, ``cache`` for decoders, ``aux_loss`` as
    ``LMOutput``'s."""

    last_hidden_state: jax.Array
    cache: Cache | None = None
    pooler_output: jax.Array | None = None
    aux_loss: jax.Array | None = None
