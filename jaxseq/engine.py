"""A generation engine with continuous batching: a fixed set of slots, each a row of one key/value cache with
its own write position, decoded together one token a step by one compiled program. A request joins a free
slot as soon as there is one (its prompt prefilled by a program per prompt-length bucket and copied into the
slot's row), and leaves it at EOS, a stop string or its token budget, while the others go on: nothing is
recompiled and no request waits for another's end. A request whose prompt a running one already has (the
``n`` choices of one API request, GRPO's group) is not prefilled again: the running slot's prompt rows and
its prompt's last logits are copied into the new slot (``fork``).

``Engine(model, tokenizer, max_batch_size=16)``; ``add(prompt_ids, SamplingParams(...))`` queues a request;
``step()`` admits queued requests into free slots, decodes one token in every busy slot and returns the
requests that changed; ``generate(prompts, params)`` runs requests to their end. Greedy decoding
(``temperature`` 0) picks what transformers' ``generate`` picks; sampling draws from the distribution of
``jaxseq.generation.filter_logits`` with a key of the request's seed and its token count alone, so a request
samples the same tokens whatever runs beside it. Decoder-only families, sliding-window layers keeping their
rolling caches of the window's length; one process."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.errors import JaxseqError
from jaxseq.generation import filter_logits, no_early_eos, parameter_mesh, shard_cache
from jaxseq.models.attention import Cache, KVCache
from jaxseq.models.hub import position_limit
from jaxseq.models.source import stop_token_ids

SMALLEST_BUCKET = 16
"""Prompts are left-padded to a power of two tokens, at least this many: one prefill program per bucket."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request is continued: up to ``max_tokens`` new tokens; greedy at ``temperature`` 0, else drawn at
    ``temperature`` from the ``top_p`` nucleus (and the engine's ``top_k``); ``seed`` (None: the request's
    number) fixes the draws; it ends at any of the engine's EOS ids (kept in its tokens; not before
    ``min_tokens`` tokens) or at the first of the ``stop`` strings (left out of its text, as OpenAI's API
    does)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0  # EOS cannot come before this many tokens (vLLM's min_tokens)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise JaxseqError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise JaxseqError(f"min_tokens must be from 0 to max_tokens, got {self.min_tokens}")
        if self.temperature < 0:
            raise JaxseqError(f"temperature must be at least 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise JaxseqError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(eq=False)
class Request:
    """A request and what it has made: ``tokens`` (new token ids), ``text`` (their text, cut before a stop
    string), ``finish_reason`` (None while running; ``stop``: EOS or a stop string, ``length``: its budget)."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    slot: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def bucket(length: int, limit: int) -> int:
    """The prompt width ``length`` tokens are padded to: a power of two (at least ``SMALLEST_BUCKET``), at most
    ``limit``."""
    return min(max(SMALLEST_BUCKET, 1 << math.ceil(math.log2(max(length, 1)))), limit)


def _copy_row(cache: Cache, source, row) -> Cache:
    """``cache`` with row ``row`` of every layer's keys/values a copy of row ``source``."""

    def copy(big: jax.Array) -> jax.Array:
        axis = big.ndim - 4  # past a scanned stack's layer axis
        one = jax.lax.dynamic_slice_in_dim(big, source, 1, axis=axis)
        return jax.lax.dynamic_update_slice_in_dim(big, one, row, axis=axis)

    return cache._replace(layers=jax.tree.map(copy, cache.layers))


def _insert(cache: Cache, small: Cache, row) -> Cache:
    """``cache`` with row ``row`` of every layer's keys/values replaced, from position 0, by ``small``'s one
    row."""

    def put(big: jax.Array, one: jax.Array) -> jax.Array:
        lead = big.ndim - 4  # a scanned stack's layer axis
        return jax.lax.dynamic_update_slice(big, one.astype(big.dtype), (0,) * lead + (row, 0, 0, 0))

    return cache._replace(layers=jax.tree.map(put, cache.layers, small.layers))


class Draws(NamedTuple):
    """How a program picks each row's next token: ``[rows]`` arrays (a prefill's or a fork's one row: scalars)
    of the request's seed, its tokens so far, its temperature, top-p and min_tokens."""

    seed: Any
    count: Any
    temperature: Any
    top_p: Any
    min_tokens: Any

    @classmethod
    def of(cls, request: Request) -> Draws:
        p = request.params
        seed = request.id if p.seed is None else p.seed
        return cls(np.int32(seed % (2**31)), np.int32(len(request.tokens)), np.float32(p.temperature),
                   np.float32(p.top_p), np.int32(p.min_tokens))  # fmt: skip


IDLE = Draws(np.int32(0), np.int32(0), np.float32(0), np.float32(1), np.int32(0))
"""A free slot's draws: greedy, nothing held back."""


def _choose(logits, draws: Draws, top_k: int, eos: tuple[int, ...]):
    """int32 ``[rows]``: each row's next token (EOS held back before its ``min_tokens``), the argmax where its
    temperature is 0, else a draw from ``filter_logits``' distribution by inverse transform sampling with one
    uniform number of the key of its seed folded with its token count (a row's draws depend on nothing else).
    The nucleus's sort runs only when a row asks for one, and nothing is drawn in a step of greedy rows alone."""
    seeds, counts, temperature, top_p, min_tokens = draws
    logits = no_early_eos(logits.astype(jnp.float32), eos, counts[:, None], min_tokens[:, None])
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled = filter_logits(logits / jnp.where(temperature > 0, temperature, 1.0)[:, None], top_k=top_k)
        scaled = jax.lax.cond(
            jnp.any(top_p < 1.0), lambda x: filter_logits(x, top_p=top_p[:, None]), lambda x: x, scaled
        )
        cdf = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)
        u = jax.vmap(lambda s, c: jax.random.uniform(jax.random.fold_in(jax.random.key(s), c)))(seeds, counts)
        drawn = jnp.minimum(jnp.sum(cdf < u[:, None] * cdf[:, -1:], axis=-1), logits.shape[-1] - 1)
        return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)


class Engine:
    """Continuous batching of ``max_batch_size`` slots over ``model`` (a causal LM; its weights where they are,
    sharded or not), ``tokenizer`` decoding the tokens; every slot holds up to ``max_len`` tokens (default: the
    model's positions, at most 4096), prompt and completion; ``eos_token_ids`` (default: the tokenizer's and
    the model config's); ``top_k`` for every sampled request (0: off)."""

    def __init__(
        self,
        model: nnx.Module,
        tokenizer,
        *,
        max_batch_size: int = 16,
        max_len: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        top_k: int = 0,
    ):
        if hasattr(model, "encode"):
            raise JaxseqError("the engine serves decoder-only models; use jaxseq generate for encoder-decoder ones")
        limit = position_limit(model.config) or 4096
        self.max_len = min(limit, 4096) if max_len is None else max_len
        if self.max_len > limit:
            raise JaxseqError(f"max_len {self.max_len} exceeds the model's {limit} positions")
        self.slots, self.tokenizer, self.top_k = max_batch_size, tokenizer, top_k
        if eos_token_ids is None:
            eos_token_ids = stop_token_ids(tokenizer, model.config)
        self.eos = sorted({int(e) for e in eos_token_ids})
        self.pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos or [0])[0])
        self.graphdef, self.state = nnx.split(model)
        self.mesh = parameter_mesh(self.state)
        # a buffer per layer (donated), laid out on the weights' mesh as every program keeps it
        self.cache = jax.jit(lambda: shard_cache(model.init_cache(self.slots, self.max_len), self.mesh))()
        # a slot's first decoded token changes what a copy of its prompt needs: a sliding window's rolling cache
        # overwrites its oldest keys, a recurrent layer's state moves on
        layers = self.cache.layers if isinstance(self.cache.layers, tuple) else (self.cache.layers,)
        self.rolling = any(not isinstance(c, KVCache) or c.max_len != self.max_len for c in layers)
        self.cache = self.cache._replace(index=jnp.zeros((self.slots,), jnp.int32))
        self.start = np.zeros(self.slots, np.int32)  # a slot's first real position (its prompt is right-aligned)
        self.positions = np.zeros(self.slots, np.int32)  # the next token's position id
        self.last = np.zeros(self.slots, np.int32)  # the token each slot feeds next
        self.running: dict[int, Request] = {}  # slot -> request
        logits = np.zeros((self.slots, model.config.vocab_size), np.float32)  # each slot's prompt's last
        self.prompt_logits = jax.device_put(logits, None if self.mesh is None else NamedSharding(self.mesh, P()))
        self.stats = collections.Counter()  # prompts prefilled ("prefills") and copied from a slot ("forks")
        self.waiting: collections.deque[Request] = collections.deque()
        self._ids = itertools.count()
        self._prefills: dict[int, object] = {}
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        self._fork = jax.jit(self._fork_fn, donate_argnums=(0, 1))

    # ------------------------------------------------------------------ programs

    def _model(self, state):
        return nnx.merge(self.graphdef, state)

    def _everywhere(self, x: jax.Array) -> jax.Array:
        """``x`` whole on every device of the mesh, so every process reads it (the host loop runs on each)."""
        return x if self.mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P()))

    def _prefill_fn(self, state, cache, prompt_logits, ids, mask, row, draws: Draws):
        """One prompt (``[1, width]``, left-padded) through the model into a fresh cache of ``width``
        positions, copied into slot ``row`` (and its last logits into ``prompt_logits``); its first new token."""
        model = self._model(state)
        small = model.init_cache(1, ids.shape[1])
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        out = model(ids, mask, positions, cache=small)
        last = out.logits[0, -1, : prompt_logits.shape[1]].astype(jnp.float32)
        cache = shard_cache(_insert(cache, out.cache, row), self.mesh)
        cache = cache._replace(index=cache.index.at[row].set(ids.shape[1]))
        return cache, prompt_logits.at[row].set(last), self._first(last, draws)

    def _fork_fn(self, cache, prompt_logits, source, row, width, draws: Draws):
        """Slot ``row`` given slot ``source``'s prompt (its first ``width`` cache positions, the later ones
        masked until overwritten) and last logits; its first new token."""
        cache = _copy_row(cache, source, row)
        cache = cache._replace(index=cache.index.at[row].set(width))
        last = prompt_logits[source]
        return cache, prompt_logits.at[row].set(last), self._first(last, draws)

    def _first(self, logits, draws: Draws):
        """A request's first token from its prompt's last ``logits``."""
        one = lambda x: jnp.asarray(x)[None]
        return self._everywhere(_choose(one(logits), jax.tree.map(one, draws), self.top_k, tuple(self.eos))[0])

    def _prefill(self, width: int):
        if width not in self._prefills:
            self._prefills[width] = jax.jit(self._prefill_fn, donate_argnums=(1, 2))
        return self._prefills[width]

    def _decode_fn(self, state, cache, tokens, start, positions, busy, draws: Draws):
        """One token in every slot: each busy slot's ``tokens`` written at its own position, attending to its
        own keys from ``start``; idle slots compute and keep nothing."""
        model = self._model(state)
        keys = (jnp.arange(self.max_len)[None] >= start[:, None]).astype(jnp.int32)
        out = model(tokens[:, None], keys, positions[:, None], cache=cache)
        new = self._everywhere(_choose(out.logits[:, 0], draws, self.top_k, tuple(self.eos)))
        index = jnp.where(busy, out.cache.index, 0)
        return shard_cache(out.cache, self.mesh)._replace(index=index), new

    def warm_up(self) -> None:
        """Compile what requests run before the first one comes: the decode step, the fork and the prefill of
        every power-of-two prompt bucket, each run once on an idle slot (the next request overwrites it)."""
        idle = np.zeros(self.slots, np.int32)
        draws = Draws(*(np.full(self.slots, x) for x in IDLE._replace(temperature=np.float32(1))))
        self.cache, _ = self._decode(self.state, self.cache, self.last, idle, idle, np.zeros(self.slots, bool), draws)
        sampling = IDLE._replace(temperature=np.float32(1))
        self.cache, self.prompt_logits, _ = self._fork(
            self.cache, self.prompt_logits, np.int32(0), np.int32(0), np.int32(0), sampling
        )
        width = SMALLEST_BUCKET
        while width <= self.max_len:
            ids = np.full((1, width), self.pad, np.int32)
            mask = np.ones((1, width), np.int32)
            self.cache, self.prompt_logits, _ = self._prefill(width)(
                self.state, self.cache, self.prompt_logits, ids, mask, np.int32(0), sampling
            )
            width *= 2
        self.cache = self.cache._replace(index=jnp.zeros((self.slots,), jnp.int32))

    # ------------------------------------------------------------------ requests

    def add(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue a request: ``prompt_ids`` continued as ``params`` say."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise JaxseqError("a prompt needs at least one token")
        if len(prompt) + params.max_tokens > self.max_len:
            raise JaxseqError(
                f"a prompt of {len(prompt)} tokens plus max_tokens {params.max_tokens} exceeds the engine's "
                f"{self.max_len} positions; shorten the prompt or lower max_tokens"
            )
        request = Request(next(self._ids), prompt, params)
        self.waiting.append(request)
        return request

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[Request]:
        """Admit waiting requests into free slots (each prefilled: its first token), then decode one token in
        every busy slot; the requests that changed (finished ones leave their slots)."""
        changed = []
        free = [s for s in range(self.slots) if s not in self.running]
        while free and self.waiting:
            request = self.waiting.popleft()
            self._admit(request, free.pop(0))
            changed.append(request)
        if any(not r.finished for r in self.running.values()):
            changed += self._decode_step()
        for slot, request in list(self.running.items()):
            if request.finished:  # the slot is free: it computes on, attending to its own first position
                del self.running[slot]
                self.start[slot] = self.positions[slot] = self.last[slot] = 0
        return list(dict.fromkeys(changed))

    def _admit(self, request: Request, slot: int) -> None:
        """``request`` into free ``slot``: a copy of a running slot holding its prompt with room for its budget
        (with rolling caches, one that has decoded nothing yet), else its prompt prefilled."""
        n, budget = len(request.prompt_ids), request.params.max_tokens
        source = next(
            (s for s, r in self.running.items() if r.prompt_ids == request.prompt_ids and self.start[s] + n + budget
             <= self.max_len and not (self.rolling and self.positions[s] > n)),
            None,
        )  # fmt: skip
        if source is not None:
            width = int(self.start[source]) + n
            self.cache, self.prompt_logits, token = self._fork(
                self.cache, self.prompt_logits, np.int32(source), np.int32(slot), np.int32(width), Draws.of(request),
            )  # fmt: skip
            self.stats["forks"] += 1
        else:
            width = max(bucket(n, self.max_len - budget), n)
            ids = np.full((1, width), self.pad, np.int32)
            mask = np.zeros((1, width), np.int32)
            ids[0, width - n :], mask[0, width - n :] = request.prompt_ids, 1
            self.cache, self.prompt_logits, token = self._prefill(width)(
                self.state, self.cache, self.prompt_logits, ids, mask, np.int32(slot), Draws.of(request)
            )
            self.stats["prefills"] += 1
        request.slot = slot
        self.running[slot] = request
        self.start[slot], self.positions[slot] = width - n, n
        self._emit(request, int(token))
        self.last[slot] = int(token)

    def _decode_step(self) -> list[Request]:
        busy = np.zeros(self.slots, bool)
        rows = [IDLE] * self.slots
        for slot, request in self.running.items():
            if not request.finished:
                busy[slot], rows[slot] = True, Draws.of(request)
        draws = Draws(*(np.array(column) for column in zip(*rows)))
        self.cache, new = self._decode(self.state, self.cache, self.last, self.start, self.positions, busy, draws)
        new = np.asarray(new)
        changed = []
        for slot in np.flatnonzero(busy):
            request = self.running[int(slot)]
            self.positions[slot] += 1
            self.last[slot] = new[slot]
            self._emit(request, int(new[slot]))
            changed.append(request)
        return changed

    def _emit(self, request: Request, token: int) -> None:
        """``token`` appended to ``request``, and whether it ends there."""
        request.tokens.append(token)
        text = self.tokenizer.decode(request.tokens, skip_special_tokens=True)
        for stop in request.params.stop:
            at = text.find(stop)
            if stop and at >= 0:
                request.text, request.finish_reason = text[:at], "stop"
                return
        request.text = text
        if token in self.eos:
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.params.max_tokens:
            request.finish_reason = "length"

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None) -> list[Request]:
        """Every prompt continued to its end, as many at a time as there are slots."""
        requests = [self.add(p, params) for p in prompts]
        while self.busy:
            self.step()
        return requests
