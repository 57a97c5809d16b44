"""Text generation: prefill a KV cache once, then a ``lax.while_loop`` that writes one position per step.

``generate(model, input_ids, attention_mask, max_new_tokens=...)`` works for every family's decoder-only
language model (``causal-lm``) and encoder-decoder (``seq2seq-lm``, T5's; ``models.registry.family_names``
lists them):

- Decoder-only: each prompt row is left-aligned (padding first, wherever the caller put it), its
  position ids come from the mask's cumulative sum as in transformers, and one forward pass fills the
  cache with all prompt tokens but the last. Every loop step then feeds one token (the last prompt token
  first), reads the next token's logits and writes its keys/values at the next cache position.
- T5: the encoder runs once, ``init_cache`` computes every decoder layer's cross-attention keys/values,
  and the loop starts from ``decoder_start_token_id``.

The loop stops when every row has produced EOS (rows that finished emit padding) or after
``max_new_tokens``. With ``num_beams`` > 1 it is transformers' beam search (``beam_loop``): every prompt row
becomes ``num_beams`` rows of the batch, and after each step the self-attention cache is gathered to
follow the beams kept. Sampling ``num_return_sequences`` > 1 completions of a prompt prefills it once and
copies its cache to each of them (``fan_out``). The whole call is one compiled program. Prompts are padded on
the left up to a multiple of ``bucket`` tokens, so prompts of similar lengths share it; a program is compiled once per
(model structure, batch size, prompt bucket, ``max_new_tokens``, greedy/sampling/``num_beams``, ``top_k``,
EOS/pad ids) and reused: temperature, top-p, the seed, ``min_new_tokens``, ``length_penalty`` and
``early_stopping`` are inputs, not constants.

On a mesh (a model loaded with ``load_pretrained(..., mesh=mesh)``) the parameters stay on their
shardings, the batch is split over ``dp``/``fsdp`` (padded to a multiple of their size) and the cache over
the batch and, where the heads divide, ``mp``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.errors import JaxseqError
from jaxseq.mesh import BATCH_AXES, batch_sharding, data_parallel_size
from jaxseq.models.hub import position_limit

PROMPT_BUCKET = 32


class GenerationOutput(NamedTuple):
    """``sequences``: the new tokens only, int32 ``[batch, max_new_tokens]`` (beam search: ``[batch *
    num_return_sequences, max_new_tokens]``, each prompt's best first, as transformers orders them); a row
    that produced EOS keeps it and is padded after it. ``logprobs`` (with ``return_logprobs=True``, else
    None): float32, same shape, the log-probability of each new token under the model's own distribution
    (log-softmax of its logits, before temperature, top-k/top-p and ``min_new_tokens``); 0 on padding.
    ``sequences_scores`` (beam search only, else None): float32 ``[batch * num_return_sequences]``, each
    sequence's summed log-probabilities divided by its new-token count ** ``length_penalty``
    (transformers' ``sequences_scores``)."""

    sequences: jax.Array
    logprobs: jax.Array | None = None
    sequences_scores: jax.Array | None = None


# --------------------------------------------------------------------------- choosing the next token


def filter_logits(logits: jax.Array, *, temperature=1.0, top_k: int = 0, top_p=1.0) -> jax.Array:
    """The logits of the sampling distribution, as transformers' warpers build it: divided by
    ``temperature``; then all but the ``top_k`` largest set to -inf (0 = off); then, of the tokens sorted
    by probability, all after the smallest prefix holding at least ``top_p`` of the mass set to -inf
    (nucleus sampling; 1.0 = off). Ties at either threshold are kept. ``temperature`` and ``top_p`` may
    be traced values; a Python 1.0 leaves the step out."""
    if not (isinstance(temperature, (int, float)) and temperature == 1.0):
        logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if not (isinstance(top_p, (int, float)) and top_p >= 1.0):
        logits = jnp.where(logits >= nucleus_threshold(logits, top_p), logits, -jnp.inf)
    return logits


NUCLEUS_CANDIDATES = 1024
"""The most likely tokens ``nucleus_threshold`` looks among first: a full sort of a 50k vocabulary costs 230 ms
for 16 rows on a CPU, the 1024 largest 12 ms."""


def nucleus_threshold(logits: jax.Array, top_p) -> jax.Array:
    """``[..., 1]``: the smallest logit of the nucleus, the tokens whose more likely tokens hold less than
    ``top_p`` of the mass (so the most likely always stays). Found among the ``NUCLEUS_CANDIDATES`` most likely
    tokens when they hold ``top_p`` in every row, else by sorting them all: the same tokens either way."""

    def among(ordered, log_z):
        probs = jnp.exp(ordered - log_z)
        before = jnp.cumsum(probs, axis=-1) - probs
        threshold = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        return threshold, (before[..., -1:] + probs[..., -1:]) >= top_p

    log_z = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    candidates = jax.lax.top_k(logits, min(NUCLEUS_CANDIDATES, logits.shape[-1]))[0]
    threshold, held = among(candidates, log_z)
    return jax.lax.cond(
        jnp.all(held),
        lambda: threshold,
        lambda: among(jnp.sort(logits, axis=-1)[..., ::-1], log_z)[0],
    )


def choose_tokens(
    logits: jax.Array, key: jax.Array | None, *, do_sample: bool, temperature=1.0, top_k: int = 0, top_p=1.0
) -> jax.Array:
    """int32 ``[batch]``: the most likely token of each row (greedy), or one drawn from
    ``filter_logits(logits, ...)`` with ``key``."""
    if not do_sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------- the compiled program


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the compiled program depends on besides input shapes (everything else is an input)."""

    max_new_tokens: int
    do_sample: bool
    top_k: int
    use_top_p: bool
    eos: tuple[int, ...]
    pad: int
    return_logprobs: bool
    decoder_start: int | None  # T5's first decoder token; None for decoder-only models
    mesh: Mesh | None
    num_beams: int = 1
    samples: int = 1  # sampled completions of each prompt, its prefill shared (``fan_out``)
    rows: int | None = None  # the decoding rows kept of prompts x copies (None: all)

    @property
    def copies(self) -> int:
        """Rows each prompt becomes after its prefill: its beams, or its sampled completions."""
        return self.num_beams if self.num_beams > 1 else self.samples


class BeamInputs(NamedTuple):
    """Beam search's inputs of the compiled program (changing them compiles nothing): ``length_scale``
    float32 ``[max_new_tokens]``, entry ``i`` = (i + 1) ** length_penalty, computed in float64 and rounded
    as transformers' Python scalar is; ``stop_when_full``: ``early_stopping=True``; ``never_long``:
    ``early_stopping="never"`` with a positive ``length_penalty``, whose running beams are judged at
    ``max_new_tokens``."""

    length_scale: jax.Array
    stop_when_full: jax.Array
    never_long: jax.Array

    @classmethod
    def of(cls, max_new_tokens: int, length_penalty: float, early_stopping: bool | str) -> BeamInputs:
        scale = np.arange(1, max_new_tokens + 1, dtype=np.float64) ** float(length_penalty)
        return cls(
            jnp.asarray(scale.astype(np.float32)),
            jnp.asarray(early_stopping is True),
            jnp.asarray(early_stopping == "never" and length_penalty > 0),
        )


def no_early_eos(scores: jax.Array, eos: tuple[int, ...], t, min_new_tokens) -> jax.Array:
    """``scores`` ``[rows, vocab]`` with the EOS ids at -inf while ``t < min_new_tokens`` (transformers'
    ``MinNewTokensLengthLogitsProcessor``)."""
    if not eos:
        return scores
    is_eos = (jnp.arange(scores.shape[-1]) == jnp.asarray(eos, jnp.int32)[:, None]).any(0)
    return jnp.where(is_eos & (t < min_new_tokens), -jnp.inf, scores)


def decode_loop(step, cache, first_token, settings: Settings, key, temperature, top_p, min_new_tokens):
    """Run ``step(cache, token, t) -> (logits [batch, vocab], cache)`` from ``first_token`` until every
    row has produced EOS or ``max_new_tokens`` tokens exist; returns ``(tokens, logprobs or None, None)``."""
    n, pad = settings.max_new_tokens, settings.pad
    batch = first_token.shape[0]
    eos = jnp.asarray(settings.eos, jnp.int32)

    def cond(carry):
        t, _, _, done, _, _ = carry
        return (t < n) & ~jnp.all(done)

    def body(carry):
        t, cache, token, done, tokens, logprobs = carry
        logits, cache = step(cache, token, t)
        new = choose_tokens(
            no_early_eos(logits, settings.eos, t, min_new_tokens),
            jax.random.fold_in(key, t),
            do_sample=settings.do_sample,
            temperature=temperature,
            top_k=settings.top_k,
            top_p=top_p if settings.use_top_p else 1.0,
        )
        new = jnp.where(done, pad, new)
        tokens = jax.lax.dynamic_update_slice(tokens, new[:, None], (0, t))
        if logprobs is not None:
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), new[:, None], axis=-1)[:, 0]
            logprobs = jax.lax.dynamic_update_slice(logprobs, jnp.where(done, 0.0, lp)[:, None], (0, t))
        if settings.eos:
            done = done | (new[:, None] == eos).any(-1)
        return t + 1, cache, new, done, tokens, logprobs

    logprobs = jnp.zeros((batch, n), jnp.float32) if settings.return_logprobs else None
    init = (jnp.int32(0), cache, first_token, jnp.zeros((batch,), bool), jnp.full((batch, n), pad, jnp.int32), logprobs)
    _, _, _, _, tokens, logprobs = jax.lax.while_loop(cond, body, init)
    return tokens, logprobs, None


NEG = -1.0e9  # transformers' penalty for beams that cannot be chosen (added, as there, so scores match)


def gather_beams(tree, index: jax.Array):
    """Each ``[batch, beams, ...]`` leaf of ``tree`` with the beams ``index`` (``[batch, k]``) picks."""
    return jax.tree.map(lambda x: jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), 1), tree)


def fan_out(cache, rows: jax.Array, settings: Settings):
    """A prefilled ``cache`` (``[..., batch, heads, len, dim]`` leaves; the write index kept) and ``rows`` (a
    tuple of ``[batch, ...]`` arrays) with each prompt's row ``settings.copies`` times, the first
    ``settings.rows`` of them kept: one prefill serves a prompt's beams or samples."""
    copies, keep = settings.copies, settings.rows
    if copies == 1 and keep is None:
        return cache, rows
    repeat = lambda x, axis: jax.lax.slice_in_dim(jnp.repeat(x, copies, axis=axis), 0, keep, axis=axis)
    cache = jax.tree.map(lambda x: repeat(x, x.ndim - 4) if x.ndim >= 4 else x, cache)
    return shard_cache(cache, settings.mesh), tuple(repeat(x, 0) for x in rows)


def reorder_cache(cache, index: jax.Array):
    """The self-attention keys/values of row ``b * beams + k`` taken from row ``b * beams + index[b, k]``;
    the gather stays within each prompt's beams, so a batch split over devices gathers locally.
    Cross-attention keys/values (T5's) are the same for all beams of a prompt and stay as they are."""
    batch, beams = index.shape

    def take(x):
        if x.ndim < 4:
            return x
        axis = x.ndim - 4
        x = x.reshape(x.shape[:axis] + (batch, beams) + x.shape[axis + 1 :])
        picked = jnp.take_along_axis(x, index.reshape((1,) * axis + (batch, beams) + (1,) * 3), axis + 1)
        return picked.reshape(picked.shape[:axis] + (batch * beams,) + picked.shape[axis + 2 :])

    return cache._replace(layers=jax.tree.map(take, cache.layers))


def beam_loop(step, cache, first_token, settings: Settings, beam: BeamInputs, min_new_tokens):
    """Transformers' beam search (``GenerationMixin._beam_search``, vectorised as there) over ``step`` (as in
    ``decode_loop``), whose cache and ``first_token`` hold ``num_beams`` rows per prompt. Each step keeps the
    ``(1 + EOS ids, at least 2) * num_beams`` best continuations of all beams by summed log-probability;
    those of the top ``num_beams`` that end (EOS, or the last step) join the prompt's finished hypotheses,
    scored by their sum / new tokens ** length_penalty, and the best ``num_beams`` that do not end run on.
    A prompt stops taking hypotheses once its running beams cannot beat its worst finished one (judged at
    their current length, or at ``max_new_tokens`` for ``early_stopping="never"`` with a positive length
    penalty) or, with ``early_stopping=True``, once it holds ``num_beams``. Returns the finished
    hypotheses, best first: ``(tokens [batch, beams, n], logprobs or None, scores [batch, beams])``."""
    n, pad, beams = settings.max_new_tokens, settings.pad, settings.num_beams
    batch = first_token.shape[0] // beams
    keep = max(2, 1 + len(settings.eos)) * beams
    eos = jnp.asarray(settings.eos, jnp.int32)

    def body(carry):
        t, cache, token, running, running_scores, finished, finished_scores, done, improvable, _ = carry
        logits, cache = step(cache, token, t)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        vocab = logprobs.shape[-1]
        summed = no_early_eos(logprobs, settings.eos, t, min_new_tokens).reshape(batch, beams, vocab)
        summed = (summed + running_scores[:, :, None]).reshape(batch, beams * vocab)
        scores, flat = jax.lax.top_k(summed, keep)  # [batch, keep]: the best continuations of all beams
        source, new = flat // vocab, (flat % vocab).astype(jnp.int32)
        candidates = gather_beams(running, source)
        candidates["tokens"] = jax.lax.dynamic_update_slice(candidates["tokens"], new[:, :, None], (0, 0, t))
        if "logprobs" in candidates:
            picked = jnp.take_along_axis(logprobs.reshape(batch, beams * vocab), flat, axis=1)
            candidates["logprobs"] = jax.lax.dynamic_update_slice(candidates["logprobs"], picked[:, :, None], (0, 0, t))
        ends = jnp.broadcast_to(t + 1 >= n, new.shape)  # the last step ends every hypothesis
        if settings.eos:
            ends = ends | (new[:, :, None] == eos).any(-1)

        # the best num_beams continuations that do not end run on
        open_scores = scores + ends.astype(jnp.float32) * NEG
        chosen = jax.lax.top_k(open_scores, beams)[1]
        running, running_scores = gather_beams((candidates, open_scores), chosen)

        # those of the top num_beams that end join the finished hypotheses, which keep the best num_beams
        ended = ends & (jnp.arange(keep) < beams)
        final = scores / beam.length_scale[t]
        final += (done.all(-1, keepdims=True) & beam.stop_when_full).astype(jnp.float32) * NEG
        final += (~improvable)[:, None].astype(jnp.float32) * NEG
        final += (~ended).astype(jnp.float32) * NEG
        merged = jax.tree.map(
            lambda a, b: jnp.concatenate([a, b], 1), (finished, finished_scores, done), (candidates, final, ended)
        )
        finished, finished_scores, done = gather_beams(merged, jax.lax.top_k(merged[1], beams)[1])

        cache = reorder_cache(cache, jnp.take_along_axis(source, chosen, axis=1))
        token = running["tokens"][:, :, t].reshape(-1)
        length = jnp.where(beam.never_long, beam.length_scale[n - 1], beam.length_scale[t])
        best_open = running_scores[:, :1] / length
        worst_done = jnp.where(done, finished_scores.min(-1, keepdims=True), NEG)
        improvable = improvable & (best_open > worst_done).any(-1)
        going = improvable.any() & ~(done.all() & beam.stop_when_full) & ~ends.all()
        return t + 1, cache, token, running, running_scores, finished, finished_scores, done, improvable, going

    running = {"tokens": jnp.full((batch, beams, n), pad, jnp.int32)}
    if settings.return_logprobs:
        running["logprobs"] = jnp.zeros((batch, beams, n), jnp.float32)
    running_scores = jnp.zeros((batch, beams), jnp.float32).at[:, 1:].set(NEG)  # the beams start identical
    init = (
        jnp.int32(0),
        cache,
        first_token,
        running,
        running_scores,
        running,
        jnp.full((batch, beams), NEG, jnp.float32),
        jnp.zeros((batch, beams), bool),
        jnp.ones((batch,), bool),
        jnp.bool_(True),
    )
    out = jax.lax.while_loop(lambda carry: carry[-1], body, init)
    finished, scores = out[5], out[6]
    return finished["tokens"], finished.get("logprobs"), scores


def left_align(ids, mask):
    """Each row's tokens moved to the right end, in order, padding first (a stable sort on the mask)."""
    order = jnp.argsort(mask, axis=1, stable=True)
    return jnp.take_along_axis(ids, order, axis=1), jnp.take_along_axis(mask, order, axis=1)


def shard_cache(cache, mesh: Mesh | None):
    """Keys/values (``[batch, heads, len, dim]``, a scanned stack's with a leading layer axis) split over the batch
    axes and, when the heads divide, over ``mp``."""
    if mesh is None:
        return cache

    def spec(x):
        if x.ndim < 4:
            return NamedSharding(mesh, P())
        heads = "mp" if x.shape[-3] % mesh.shape["mp"] == 0 else None
        return NamedSharding(mesh, P(*(None,) * (x.ndim - 4), BATCH_AXES, heads, None, None))

    return jax.lax.with_sharding_constraint(cache, jax.tree.map(spec, cache))


def program(graphdef, settings: Settings):
    """The jitted generation function for one model structure and ``settings``:
    ``(state, ids, mask, key, temperature, top_p, min_new_tokens, beam) -> (tokens, logprobs, scores)``,
    ``beam`` a ``BeamInputs`` with ``num_beams`` > 1 (``beam_loop``'s outputs), else None (``decode_loop``'s)."""
    n, beams = settings.max_new_tokens, settings.num_beams

    def search(step, cache, first, key, temperature, top_p, min_new_tokens, beam):
        if beams == 1:
            return decode_loop(step, cache, first, settings, key, temperature, top_p, min_new_tokens)
        return beam_loop(step, cache, first, settings, beam, min_new_tokens)

    def decoder_only(state, ids, mask, key, temperature, top_p, min_new_tokens, beam):
        model = nnx.merge(graphdef, state)
        ids, mask = left_align(ids, mask)
        batch, width = ids.shape
        cache = shard_cache(model.init_cache(batch, width + n - 1), settings.mesh)
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        # keys of all cache positions; the model adds causality, so later positions are not seen early
        full_mask = jnp.concatenate([mask, jnp.ones((batch, n - 1), mask.dtype)], axis=1)
        if width > 1:  # the prefill's logits are unused, so XLA drops its vocabulary projection
            cache = model(ids[:, :-1], full_mask, positions[:, :-1], cache=cache).cache
        cache, (full_mask, last, first) = fan_out(cache, (full_mask, positions[:, -1], ids[:, -1]), settings)

        def step(cache, token, t):
            out = model(token[:, None], full_mask, (last + t)[:, None], cache=cache)
            return out.logits[:, 0], out.cache

        return search(step, cache, first, key, temperature, top_p, min_new_tokens, beam)

    def encoder_decoder(state, ids, mask, key, temperature, top_p, min_new_tokens, beam):
        model = nnx.merge(graphdef, state)
        encoded = model.encode(ids, mask)
        cache = shard_cache(model.init_cache(encoded, mask, n), settings.mesh)
        first = jnp.full((ids.shape[0],), settings.decoder_start, jnp.int32)
        cache, (mask, first) = fan_out(cache, (mask, first), settings)

        def step(cache, token, t):
            out = model.decode(token[:, None], None, mask, cache=cache)
            return out.logits[:, 0], out.cache

        return search(step, cache, first, key, temperature, top_p, min_new_tokens, beam)

    return jax.jit(decoder_only if settings.decoder_start is None else encoder_decoder)


class ProgramKey:
    """Cache key of a compiled program. A GraphDef holds the model's config, which transformers makes
    unhashable, so the hash uses the settings and the graph's size and equality compares the graphs."""

    def __init__(self, graphdef, settings: Settings):
        self.graphdef, self.settings = graphdef, settings

    def __hash__(self):
        return hash((self.settings, len(self.graphdef.nodes)))

    def __eq__(self, other):
        return self.settings == other.settings and self.graphdef == other.graphdef


@functools.lru_cache(maxsize=16)
def cached_program(key: ProgramKey):
    return program(key.graphdef, key.settings)


# --------------------------------------------------------------------------- the public call


def parameter_mesh(state) -> Mesh | None:
    """The mesh the parameters are sharded over, or None if they live on single devices."""
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _check(model, ids, mask, max_new_tokens, do_sample, temperature, top_k, top_p, min_new_tokens):
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise JaxseqError(f"input_ids {ids.shape} and attention_mask {mask.shape} must both be [batch, prompt_length]")
    check_sampling(max_new_tokens, do_sample, temperature, top_k, top_p, min_new_tokens)
    lengths = mask.sum(axis=1)
    if ids.shape[0] == 0 or not lengths.all():
        empty = [int(i) for i in np.flatnonzero(lengths == 0)]
        raise JaxseqError(f"prompt row(s) {empty or 'all'} have no tokens; every prompt needs at least one")
    switch = getattr(model, "rope_switch", None)  # longrope: cached keys would keep their short-factor rotation
    if switch is not None and lengths.min() <= switch and lengths.max() + max_new_tokens >= switch + 2:
        raise JaxseqError(
            f"generation would cross this model's longrope switch at {switch} positions (short to long factors), "
            "where transformers re-encodes the whole sequence and jaxseq does not; keep prompt + max_new_tokens "
            f"within {switch + 1} tokens, or give prompts longer than {switch}"
        )
    limit = position_limit(model.config)
    if not hasattr(model, "encode") and limit and lengths.max() + max_new_tokens > limit:
        raise JaxseqError(
            f"a prompt of {lengths.max()} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
            f"{limit} positions; shorten the prompt or generate fewer tokens"
        )


def check_sampling(max_new_tokens, do_sample, temperature, top_k, top_p, min_new_tokens=0):
    """One-line errors for lengths and sampling settings no generation can take."""
    if max_new_tokens < 1:
        raise JaxseqError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise JaxseqError(f"min_new_tokens must be between 0 and max_new_tokens, got {min_new_tokens}")
    if do_sample and not temperature > 0:
        raise JaxseqError(f"temperature must be positive, got {temperature}")
    if top_k < 0 or not 0 < top_p <= 1:
        raise JaxseqError(f"top_k must be >= 0 and top_p in (0, 1], got top_k={top_k}, top_p={top_p}")


def check_beams(num_beams, num_return_sequences, early_stopping, do_sample=False):
    """One-line errors for beam-search settings ``generate`` cannot take (a command checks them before loading)."""
    if num_beams < 1:
        raise JaxseqError(f"num_beams must be at least 1, got {num_beams}")
    if do_sample and num_return_sequences < 1:
        raise JaxseqError(f"num_return_sequences must be at least 1, got {num_return_sequences}")
    if not do_sample and not 1 <= num_return_sequences <= num_beams:
        raise JaxseqError(
            f"num_return_sequences must be between 1 and num_beams ({num_beams}), got {num_return_sequences}; "
            "raise num_beams to return more sequences, or sample them (do_sample)"
        )
    if early_stopping not in (True, False, "never"):
        raise JaxseqError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if do_sample and num_beams > 1:
        raise JaxseqError("beam search does not sample: pass do_sample=False with num_beams > 1")


def generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    seed: int = 0,
    min_new_tokens: int = 0,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    return_logprobs: bool = False,
    bucket: int = PROMPT_BUCKET,
) -> GenerationOutput:
    """Continue each prompt of the batch by up to ``max_new_tokens`` tokens.

    ``model``: a ``causal-lm`` or ``seq2seq-lm`` model (of the families
    ``registry.family_names("causal-lm", "seq2seq-lm")`` lists). ``input_ids`` and ``attention_mask`` (1 = token,
    0 = padding; default all ones): ``[batch, prompt_length]`` host or device arrays; either padding side works
    (decoder prompts are left-aligned internally).

    Greedy (the most likely token) unless ``do_sample``, which draws from the logits divided by
    ``temperature`` and restricted to the ``top_k`` most likely tokens and the ``top_p`` nucleus (see
    ``filter_logits``); draws use ``jax.random.key(seed)`` folded with the step, so a seed repeats its
    output. ``num_beams`` > 1: transformers' beam search (``beam_loop``) with its ``length_penalty``,
    ``early_stopping`` (True, False or "never") and ``num_return_sequences`` (the best of each prompt's
    beams, best first). Sampling, ``num_return_sequences`` completions of each prompt (its rows in turn,
    as transformers orders them) are drawn from one prefill of it. A row stops at any of ``eos_token_id``
    (None: never; transformers would use
    ``model.config.eos_token_id``), which cannot come before ``min_new_tokens`` tokens; afterwards it
    emits ``pad_token_id`` (default: the first EOS id, else 0). Returns a ``GenerationOutput``.
    """
    ids = np.asarray(input_ids, np.int32)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
    _check(model, ids, mask, max_new_tokens, do_sample, temperature, top_k, top_p, min_new_tokens)
    check_beams(num_beams, num_return_sequences, early_stopping, do_sample)
    eos = () if eos_token_id is None else tuple(int(e) for e in np.atleast_1d(eos_token_id))
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    decoder_start = None
    if hasattr(model, "encode"):
        decoder_start = model.decoder_start_id()
        if decoder_start is None:
            raise JaxseqError("the model's config has no decoder_start_token_id; set it (T5 uses the pad id, 0)")

    graphdef, state = nnx.split(model)
    mesh = parameter_mesh(state)
    batch, dp = ids.shape[0], 1 if mesh is None else data_parallel_size(mesh)
    rows = math.ceil(batch / dp) * dp
    samples = num_return_sequences if do_sample else 1
    width = math.ceil(ids.shape[1] / bucket) * bucket
    # padding on the left up to the bucket, and whole copies of the last row up to the dp multiple
    ids = np.pad(ids, ((0, rows - batch), (width - ids.shape[1], 0)), mode="edge")
    mask = np.pad(mask, ((0, rows - batch), (0, 0)), mode="edge")
    mask = np.pad(mask, ((0, 0), (width - mask.shape[1], 0)))
    if mesh is not None:
        ids, mask = (jax.device_put(a, batch_sharding(mesh)) for a in (ids, mask))

    settings = Settings(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        top_k=top_k if do_sample else 0,
        use_top_p=do_sample and top_p < 1.0,
        eos=eos,
        pad=int(pad),
        return_logprobs=return_logprobs,
        decoder_start=decoder_start,
        mesh=mesh,
        num_beams=num_beams,
        samples=samples,
        rows=math.ceil(batch * samples / dp) * dp if samples > 1 else None,  # as many as unshared prompts'
    )
    beam = BeamInputs.of(max_new_tokens, length_penalty, early_stopping) if num_beams > 1 else None
    run = cached_program(ProgramKey(graphdef, settings))
    tokens, logprobs, scores = run(
        state,
        ids,
        mask,
        jax.random.key(seed),
        jnp.float32(temperature),
        jnp.float32(top_p),
        jnp.int32(min_new_tokens),
        beam,
    )
    if scores is None:
        kept = batch * samples
        return GenerationOutput(tokens[:kept], None if logprobs is None else logprobs[:kept])
    best = lambda x: x[:batch, :num_return_sequences].reshape(batch * num_return_sequences, *x.shape[2:])
    return GenerationOutput(best(tokens), None if logprobs is None else best(logprobs), best(scores))


def search_tokens(
    model,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> jax.Array:
    """Greedy ``sequences`` of ``generate`` (with ``num_beams`` > 1: beam search's best) as plain traced JAX,
    for use inside another jitted function (an evaluation step): no host-side checks, bucketing or program
    cache; the caller's jit compiles it."""
    graphdef, state = nnx.split(model)
    decoder_start = model.decoder_start_id() if hasattr(model, "encode") else None
    settings = Settings(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        top_k=0,
        use_top_p=False,
        eos=(int(eos_token_id),),
        pad=int(pad_token_id),
        return_logprobs=False,
        decoder_start=decoder_start,
        mesh=None,
        num_beams=num_beams,
    )
    beam = BeamInputs.of(max_new_tokens, length_penalty, early_stopping) if num_beams > 1 else None
    tokens, _, _ = program(graphdef, settings)(
        state,
        input_ids.astype(jnp.int32),
        attention_mask.astype(jnp.int32),
        jax.random.key(0),
        jnp.float32(1.0),
        jnp.float32(1.0),
        jnp.int32(0),
        beam,
    )
    return tokens if num_beams == 1 else tokens[:, 0]
