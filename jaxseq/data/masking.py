"""Masked-LM corruption (transformers' ``DataCollatorForLanguageModeling``): each maskable token is chosen
with ``probability``; a chosen token becomes the mask token 80% of the time, a random token of the vocabulary
10%, and stays itself 10%. Drawn with ``jax.random`` from a key, so the train step draws a fresh mask on the
device each step (from the step's key: the same mask after a resume) and evaluation a fixed one per example."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.data.batches import IGNORE


def maskable(ids: jax.Array, special_ids: Sequence[int], attention_mask: jax.Array | None = None) -> jax.Array:
    """True where a token may be masked: not a special token ([CLS], [SEP], padding, ...) nor padding."""
    allowed = ~jnp.isin(ids, jnp.asarray(list(special_ids), ids.dtype))
    return allowed if attention_mask is None else allowed & (attention_mask != 0)


def generator_key(key: jax.Array) -> jax.Array:
    """``key``'s bits as a key of XLA's own generator (``rbg``): one op, where threefry's cipher is a loop that
    makes the CPU train step compile about half again as long (BERT, 2 layers: 25 s -> 40 s under load)."""
    data = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    return jax.random.wrap_key_data(jnp.resize(data, 4), impl="rbg")


def mask_tokens(
    key: jax.Array, ids: jax.Array, allowed: jax.Array, *, probability: float, mask_token_id: int, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """(inputs, labels) of ``ids`` (int32): 80/10/10 masking of the ``allowed`` tokens chosen with
    ``probability``; ``labels`` are the original ids where chosen, else ``IGNORE``."""
    draw_key, word_key = jax.random.split(generator_key(key))
    choose, replace = jax.random.uniform(draw_key, (2, *ids.shape))  # one draw: fewer random programs to compile
    chosen = (choose < probability) & allowed
    replaced = chosen & (replace < 0.8)
    randomized = chosen & (replace >= 0.9)  # half of the other 20%
    words = jax.random.randint(word_key, ids.shape, 0, vocab_size, ids.dtype)
    inputs = jnp.where(replaced, mask_token_id, jnp.where(randomized, words, ids))
    return inputs, jnp.where(chosen, ids, IGNORE)


def mask_examples(
    arrays: dict[str, np.ndarray], seed: int, special_ids: Sequence[int], **masking
) -> dict[str, np.ndarray]:
    """``arrays`` (``input_ids`` and maybe ``attention_mask``, ``[n, seq]``) with ``input_ids`` corrupted and
    ``labels`` added, example ``i`` masked with ``fold_in(key(seed), i)``: the same mask whatever the batching
    (an evaluation set, masked once)."""

    @jax.jit
    def one(i, ids, mask):
        return mask_tokens(
            jax.random.fold_in(jax.random.key(seed), i), ids, maskable(ids, special_ids, mask), **masking
        )

    ids = np.asarray(arrays["input_ids"], np.int32)
    mask = arrays.get("attention_mask")
    mask = np.ones_like(ids) if mask is None else np.asarray(mask)
    inputs, labels = jax.vmap(one)(np.arange(len(ids)), ids, mask)
    return {**arrays, "input_ids": np.array(inputs), "labels": np.array(labels)}
