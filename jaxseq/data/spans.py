"""T5 span corruption (transformers' run_t5_mlm_flax.py, after the T5 paper): a block of raw tokens loses
``noise_density`` of them in ``mean_noise_span_length``-long spans on average; the input keeps the other tokens,
each dropped span replaced by one sentinel (the first ``vocab - 1``, the next ``vocab - 2``, ...: the top of the
vocabulary, T5's <extra_id_0>, <extra_id_1>, ...), then EOS; the target is each sentinel followed by its span,
then EOS. Every length is fixed by the block's, so it runs on the device with ``jax.random``: the train step
corrupts each block afresh from its step's key."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.data.masking import generator_key


def input_and_target_lengths(tokens: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(input, target) lengths, EOS included, of a block of ``tokens`` raw tokens."""
    noise = round(tokens * noise_density)
    spans = round(noise / mean_noise_span_length)
    return tokens - noise + spans + 1, noise + spans + 1


def compute_input_and_target_lengths(
    inputs_length: int, noise_density: float, mean_noise_span_length: float
) -> tuple[int, int]:
    """(raw tokens, target length) for inputs of ``inputs_length``: the most raw tokens whose corrupted input
    still fits (run_t5_mlm_flax's function of that name: 568 raw tokens and 114 targets for 512 inputs)."""
    tokens = inputs_length
    while input_and_target_lengths(tokens + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
        tokens += 1
    _, targets = input_and_target_lengths(tokens, noise_density, mean_noise_span_length)
    if noise_density == 0.5 and targets > inputs_length:  # the script's hack: targets as long as the inputs
        tokens, targets = tokens - 1, targets - 1
    return tokens, targets


@dataclasses.dataclass(frozen=True)
class SpanCorruption:
    """Corrupts blocks of ``tokens`` raw tokens (``vocab_size``: the tokenizer's length; sentinels below it)."""

    tokens: int
    noise_density: float
    mean_noise_span_length: float
    vocab_size: int
    eos_token_id: int

    @property
    def counts(self) -> tuple[int, int]:
        """(noise tokens, noise spans) of a block, as random_spans_noise_mask draws them."""
        noise = min(max(int(np.round(self.tokens * self.noise_density)), 1), self.tokens - 1)
        spans = int(np.round(min(noise, self.tokens - noise) / self.mean_noise_span_length))
        return noise, max(spans, 1)

    @property
    def lengths(self) -> tuple[int, int]:
        """(input, target) lengths, EOS included."""
        noise, spans = self.counts
        return self.tokens - noise + spans + 1, noise + spans + 1

    def noise_mask(self, key: jax.Array) -> jax.Array:
        """``[tokens]`` bool: which tokens are noise, spans of random lengths alternating with kept ones (the
        first span kept), as random_spans_noise_mask."""
        noise, spans = self.counts

        def segment_lengths(key, items):  # ``items`` cut at ``spans - 1`` random places into ``spans`` parts
            cuts = jax.random.permutation(key, jnp.arange(items - 1) < spans - 1)
            segment = jnp.cumsum(jnp.pad(cuts, (1, 0)))
            return jnp.bincount(segment, length=spans)

        noise_key, kept_key = jax.random.split(generator_key(key))
        interleaved = jnp.stack([segment_lengths(kept_key, self.tokens - noise), segment_lengths(noise_key, noise)], 1)
        starts = jnp.cumsum(interleaved.reshape(-1))[:-1]
        span_number = jnp.cumsum(jnp.zeros(self.tokens, jnp.int32).at[starts].set(1))
        return span_number % 2 == 1

    def sentinel_ids(self, mask: jax.Array) -> jax.Array:
        """create_sentinel_ids: the sentinel at the first token of each span of ``mask``, -1 at the others, 0
        outside the spans."""
        mask = mask.astype(jnp.int32)
        starts = mask - jnp.roll(mask, 1) * mask
        starts = starts.at[0].set(mask[0])
        ids = jnp.where(starts != 0, self.vocab_size - jnp.cumsum(starts), 0)
        return ids - (mask - starts)

    def filter_ids(self, ids: jax.Array, sentinels: jax.Array, length: int) -> jax.Array:
        """filter_input_ids: ``ids`` with each span replaced by its sentinel, then EOS (``length`` in all)."""
        full = jnp.where(sentinels != 0, sentinels, ids)
        keep = full >= 0
        where = jnp.where(keep, jnp.cumsum(keep) - 1, length)
        out = jnp.full(length, self.eos_token_id, ids.dtype)
        return out.at[where].set(full, mode="drop")

    def corrupt(self, key: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
        """A seq2seq example of one block ``[tokens]``: ``input_ids`` and ``labels`` (with their masks, all 1)."""
        mask = self.noise_mask(key)
        inputs, targets = self.lengths
        ids = ids.astype(jnp.int32)
        input_ids = self.filter_ids(ids, self.sentinel_ids(mask), inputs)
        labels = self.filter_ids(ids, self.sentinel_ids(~mask), targets)
        return {
            "input_ids": input_ids,
            "attention_mask": jnp.ones_like(input_ids),
            "labels": labels,
            "decoder_attention_mask": jnp.ones_like(labels),
        }

    def corrupt_batch(self, key: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
        """``corrupt`` on each row of ``[batch, tokens]``, each with its own key."""
        return jax.vmap(self.corrupt)(jax.random.split(key, ids.shape[0]), ids)

    def corrupt_examples(self, blocks: np.ndarray, seed: int) -> dict[str, np.ndarray]:
        """Every block corrupted once, block ``i`` with ``fold_in(key(seed), i)`` (an evaluation set)."""
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(len(blocks)))
        out = jax.jit(jax.vmap(self.corrupt))(keys, jnp.asarray(np.asarray(blocks), jnp.int32))
        return {k: np.asarray(v) for k, v in out.items()}
