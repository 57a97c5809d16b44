"""EleutherAI's lm-evaluation-harness with a jaxseq model as its backend: ``JaxseqLM`` answers lm-eval's three
requests the way its Hugging Face backend (``lm_eval.models.huggingface.HFLM``) does, token for token, and
``evaluate_tasks`` runs tasks through it as ``lm_eval.simple_evaluate`` does, into lm-eval's own results.

- ``loglikelihood``: each (context, continuation) pair is tokenized as HFLM tokenizes it
  (``TemplateLM._encode_pair``, HFLM's BOS handling), cut from the left to ``max_length`` + 1 tokens, and
  scored by one forward pass: the log-probabilities of the continuation's tokens summed, and whether each
  is the most likely token. Requests whose inputs are the same tokens (multiple choice with one-token
  answers: the same context, a different last token) share one pass, as HFLM's logits cache shares them.
  Answers of several tokens to the same context share its pass too (``score_shared``): the context runs
  once into a KV cache and each answer over it. The other passes are packed: several short sequences share
  a row (segment ids, positions restarting at 0, so each sees only itself), rows come in a few widths, and
  each width's batches hold the same number of tokens, so a whole evaluation compiles a few programs and
  computes on text, not padding. Only the scored positions (the continuations') go through the vocabulary
  projection.
- ``loglikelihood_rolling``: a document's tokens cut into lm-eval's rolling windows
  (``get_rolling_token_windows``, ``make_disjoint_window``, as HFLM cuts them), scored like the pairs above
  and summed: documents longer than the model's context are scored whole.
- ``generate_until``: greedy (or sampled, if the task asks) completion by ``jaxseq.generation.generate`` of
  the contexts cut from the left to ``max_length - max_gen_toks`` tokens, batched by length, each cut at
  the first stop string (``until``) as HFLM cuts it; a row stops at the model's EOS tokens (its generation
  config's, as transformers' ``generate`` stops) or after ``max_gen_toks`` tokens.

lm-eval is the optional ``eval`` extra: without it this module imports, and ``require_lm_eval`` says how to
install it in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from itertools import chain
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxseq.config import arg
from jaxseq.data.batches import length_buckets
from jaxseq.errors import JaxseqError
from jaxseq.files import atomic_write
from jaxseq.generation import generate
from jaxseq.mesh import batch_sharding, data_parallel_size
from jaxseq.models.hub import position_limit
from jaxseq.models.layers import padded_vocab_size
from jaxseq.sharding import gather

try:  # the `eval` extra
    from lm_eval.api.model import TemplateLM
except ImportError:  # jaxseq eval says how to install it (require_lm_eval)
    TemplateLM = object

logger = logging.getLogger("jaxseq")

DEFAULT_MAX_GEN_TOKS = 256  # HFLM.max_gen_toks
SHARED_CONTEXT = 8  # a context shorter than this is not worth a pass of its own: its sequences are packed whole
LOGITS_BYTES = 1 << 28  # float32 logits a device holds at a time while scoring: positions are chunked to fit


def require_lm_eval() -> None:
    """Stop in one line when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None or TemplateLM is object:
        raise JaxseqError("jaxseq eval needs lm-evaluation-harness: pip install 'jaxseq[eval]'")


# --------------------------------------------------------------------------- scoring packed rows on devices


def token_scores(head, h, targets, vocab: int, chunk: int):
    """For hidden states ``h`` ``[rows, n, hidden]`` and the tokens ``targets`` ``[rows, n]`` scored there: each
    token's log-probability and the most likely token, float32 over the ``vocab`` real tokens (a padded
    vocabulary's padding gets no probability), computed ``chunk`` positions of every row at a time."""

    def scores(h, targets):
        logits = head(h).astype(jnp.float32)
        if logits.shape[-1] != vocab:
            logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, -jnp.inf)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    rows, n = targets.shape
    if n <= chunk:
        return scores(h, targets)
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(rows, chunks, chunk, -1).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(rows, chunks, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: scores(*xs), (h, targets))
    return tuple(x.swapaxes(0, 1).reshape(rows, chunks * chunk)[:, :n] for x in out)


def score_slots(graphdef, vocab: int, chunk: int, state, ids, segments, positions, slot_at, slot_tokens):
    """One packed batch (``[rows, width]`` tokens, segment ids, positions): for each slot, a position of its row
    (``slot_at`` ``[rows, slots]``) and a token (``slot_tokens``), the token's log-probability there and the
    most likely token there. Only the slots' hidden states go through the vocabulary projection (a context's
    positions are never scored)."""
    model = nnx.merge(graphdef, state)
    h = model.hidden_states(ids, segments, positions).last_hidden_state
    h = jnp.take_along_axis(h, slot_at[..., None], axis=1)
    return token_scores(model.logits, h, slot_tokens, vocab, chunk)


def score_shared(
    graphdef, vocab: int, chunk: int, max_position, state, ctx_ids, ctx_mask, cont_ids, owner, slot_at, slot_tokens
):
    """Continuations of shared contexts: the contexts ``[groups, width]`` (left-padded, ``ctx_mask``) run once
    into a KV cache, then each continuation ``[rows, cont_width]`` (right-padded) runs over its context's cache
    (``owner``: the context row of each continuation row). A row's hidden states are its context's last one
    and its own; the slots (``slot_at`` into those, ``slot_tokens``) are scored as ``score_slots`` scores them."""
    model = nnx.merge(graphdef, state)
    groups, width = ctx_ids.shape
    cont_width = cont_ids.shape[1]
    positions = jnp.maximum(jnp.cumsum(ctx_mask, axis=1) - 1, 0)
    keys = jnp.concatenate([ctx_mask, jnp.ones((groups, cont_width), ctx_mask.dtype)], axis=1)
    out = model.hidden_states(ctx_ids, keys, positions, cache=model.init_cache(groups, width + cont_width))
    cache = jax.tree.map(lambda x: jnp.take(x, owner, axis=x.ndim - 4) if x.ndim >= 4 else x, out.cache)
    after = positions[owner, -1:] + 1 + jnp.arange(cont_width, dtype=positions.dtype)
    if max_position is not None:  # a padded continuation's positions past the model's last: never scored
        after = jnp.minimum(after, max_position)
    h = model.hidden_states(cont_ids, keys[owner], after, cache=cache).last_hidden_state
    h = jnp.concatenate([out.last_hidden_state[owner, -1:], h], axis=1)
    h = jnp.take_along_axis(h, slot_at[..., None], axis=1)
    return token_scores(model.logits, h, slot_tokens, vocab, chunk)


@dataclasses.dataclass
class Sequence:
    """The tokens of one forward pass and the requests it answers: those whose model input (context and
    continuation, cut to ``max_length`` + 1 tokens, less the last token) is ``tokens``. ``targets``: the
    next token at each position, the last one ``members[0]``'s; ``members``: (request, continuation length,
    its last token)."""

    tokens: list[int]
    targets: list[int]
    members: list[tuple[int, int, int]]


@dataclasses.dataclass
class Batch:
    """Packed rows: ``[rows, width]`` tokens, segment ids and positions (shared contexts: the contexts' tokens and
    mask, the continuations' tokens), the ``[rows, slots]`` slots scored, and where each request's answer lies:
    (request, row, its first slot, how many slots before its last token's, its last token's slot)."""

    ids: np.ndarray
    segments: np.ndarray
    positions: np.ndarray
    slot_at: np.ndarray
    slot_tokens: np.ndarray
    answers: list[tuple[int, int, int, int, int]]
    owner: np.ndarray | None = None  # shared contexts: the context row of each continuation row


def slots_needed(seq: Sequence) -> int:
    """Slots a sequence takes: its positions that some request scores, and one more for each request whose
    last token is not the sequence's own."""
    span = max(length for _, length, _ in seq.members)
    return span + sum(last != seq.targets[-1] for _, _, last in seq.members)


def place_slots(seq: Sequence, slot_at, slot_tokens, row: int, offset: int, first: int = 0) -> list[tuple]:
    """Write ``seq``'s slots into a row's ``slot_at``/``slot_tokens`` from slot ``first`` (position ``p`` of the
    sequence at index ``p - offset`` of the row's hidden states) and return its requests' answers."""
    n = len(seq.tokens)
    span = max(length for _, length, _ in seq.members)
    slot_at[first : first + span] = np.arange(n - span, n) - offset
    slot_tokens[first : first + span] = seq.targets[n - span :]
    answers, end = [], first + span
    for i, length, last in seq.members:
        if last == seq.targets[-1]:
            answers.append((i, row, first + span - length, length - 1, first + span - 1))
        else:  # the same position scored for this request's own last token
            slot_at[end], slot_tokens[end] = n - 1 - offset, last
            answers.append((i, row, first + span - length, length - 1, end))
            end += 1
    return answers


def context_length(group: list[Sequence]) -> int:
    """The tokens a group's sequences share: up to the position before the first one any request scores."""
    return len(group[0].tokens) - max(length for _, length, _ in group[0].members) + 1


def split_shared(sequences: list[Sequence]) -> tuple[list[Sequence], list[list[Sequence]]]:
    """Sequences scored alone, and groups (of two or more) whose scored positions follow the same context: a
    question's several multi-token answers run their context once (``score_shared``)."""
    groups: dict[tuple[int, ...], list[Sequence]] = defaultdict(list)
    for seq in sequences:
        groups[tuple(seq.tokens[: context_length([seq])])].append(seq)
    shared = [group for context, group in groups.items() if len(group) > 1 and len(context) >= SHARED_CONTEXT]
    return [seq for group in groups.values() if group not in shared for seq in group], shared


def merge_sparse(by_width: dict[int, list], rows_of: dict[int, int]) -> None:
    """A width with less than half a batch of rows joins the next wider one (one program fewer)."""
    for width in sorted(by_width)[:-1]:
        if len(by_width[width]) < rows_of[width] / 2:
            wider = min(w for w in by_width if w > width)
            by_width[wider].extend(by_width.pop(width))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pipelined(batches):
    """``(batch, its host outputs)`` for ``(batch, dispatch)`` pairs, the next batch dispatched before this
    one's outputs are fetched."""
    pending = []
    for batch, dispatch in batches:
        pending.append((batch, dispatch()))
        if len(pending) > 1:
            batch, outputs = pending.pop(0)
            yield batch, gather(outputs)
    for batch, outputs in pending:
        yield batch, gather(outputs)


def pack_rows(lengths: list[int], widths: list[int]) -> list[tuple[int, list[int]]]:
    """Sequences of ``lengths`` into rows, first-fit decreasing: each sequence goes into the first row with
    room left, else opens a row of the narrowest of ``widths`` that holds it. ``(width, sequence indices)``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    room = np.zeros(max(1, len(lengths)), np.int64)
    rows: list[tuple[int, list[int]]] = []
    for i in order:
        n = lengths[i]
        fits = room[: len(rows)] >= n
        if fits.any():
            r = int(fits.argmax())
            rows[r][1].append(i)
            room[r] -= n
        else:
            width = next(w for w in widths if w >= n)
            rows.append((width, [i]))
            room[len(rows) - 1] = width - n
    return rows


class JaxseqLM(TemplateLM):
    """lm-eval's model interface (``TemplateLM``) on a jaxseq causal LM, answering as ``HFLM`` does.

    ``model``: a ``causal-lm`` model (``jaxseq.models.load_pretrained``), sharded over ``mesh`` or not;
    ``tokenizer``: its transformers tokenizer; ``batch_size``: rows of ``max_length`` tokens per device in a
    scoring batch (narrower rows come more to a batch, as many tokens), prompts per device in a generation
    batch; ``max_length``: HFLM's ``max_length`` (default: the model's positions, as HFLM reads them);
    ``eos_token_ids``: where generation stops (default: the model config's EOS); ``name``: the model's
    folder or Hub id (results' ``model_name``)."""

    backend = "causal"

    def __init__(
        self,
        model,
        tokenizer,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        mesh=None,
        eos_token_ids=None,
        name: str = "jaxseq",
        add_bos_token: bool | None = None,
        seed: int = 0,
    ):
        require_lm_eval()
        from lm_eval.models.utils import configure_pad_token, resolve_max_length

        super().__init__()
        if hasattr(model, "encode"):
            raise JaxseqError("jaxseq eval scores causal language models; encoder-decoders (T5) are not supported")
        if batch_size < 1:
            raise JaxseqError(f"the batch size must be at least 1, got {batch_size}")
        self.model, self.config, self.mesh = model, model.config, mesh
        self.tokenizer = configure_pad_token(tokenizer, model_config=model.config)
        self.batch_size_per_device = batch_size
        self._max_length = max_length or resolve_max_length(model.config, tokenizer)
        self.add_bos_token = add_bos_token
        self.name, self.seed, self.generated = name, seed, 0
        eos = model.config.eos_token_id if eos_token_ids is None else eos_token_ids
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_token_ids = [] if eos is None else [int(e) for e in np.atleast_1d(eos)]
        self.graphdef, self.state = nnx.split(model)
        self.replicas = data_parallel_size(mesh) if mesh is not None else 1
        vocab = model.config.vocab_size
        limit = position_limit(model.config)
        last = None if limit is None else limit - 1
        self._score = jax.jit(
            lambda state, *arrays, chunk: score_slots(self.graphdef, vocab, chunk, state, *arrays),
            static_argnames="chunk",
        )
        self._score_shared = jax.jit(
            lambda state, *arrays, chunk: score_shared(self.graphdef, vocab, chunk, last, state, *arrays),
            static_argnames="chunk",
        )
        self.batch_sizes = {}  # results' config lists HFLM's detected batch sizes; there are none to detect

    # ----------------------------------------------------------------------- what lm-eval asks of a model

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token a continuation without context follows (HFLM's: BOS, else EOS)."""
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_MAX_GEN_TOKS

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_device * self.replicas

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs):
        """HFLM's: the tokenizer's special tokens unless told otherwise, none when the text already starts
        with the prefix (BOS) token's text."""
        from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_prompt(self, string: str) -> list[int]:
        """A generation prompt's tokens, as HFLM's ``tok_batch_encode`` makes them (a text that starts with
        the BOS token's text gets no special tokens)."""
        from lm_eval.models.utils import has_bos_prefix

        special = {}
        if has_bos_prefix(string, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        return self.tokenizer(string, **special)["input_ids"]

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat as the tokenizer's template writes it (HFLM's; a template that refuses a system turn gets
        the chat without it)."""
        import jinja2

        kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
        kwargs["continue_final_message"] = not add_generation_prompt
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except jinja2.exceptions.TemplateError:
            chat_history = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)

    def get_model_info(self) -> dict:
        """HFLM's model fields of the results' config: parameter count and dtype."""
        leaves = [x for x in jax.tree.leaves(self.state) if hasattr(x, "dtype")]
        return {"model_num_parameters": int(sum(x.size for x in leaves)), "model_dtype": str(leaves[0].dtype)}

    # ----------------------------------------------------------------------- loglikelihood

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, whether every token of it is the most likely one)
        for each ``(request text or None, context tokens, continuation tokens)``, in their order."""
        limit = self.max_length
        sequences: dict[tuple[int, ...], Sequence] = {}
        truncated = 0
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise JaxseqError(f"request {i} has an empty context or continuation after tokenization")
            if len(continuation) > limit:
                raise JaxseqError(
                    f"a continuation of {len(continuation)} tokens is longer than --max_length {limit}; raise it"
                )
            whole = (context + continuation)[-(limit + 1) :]
            truncated += len(context) + len(continuation) > limit + 1
            tokens = tuple(whole[:-1])
            seq = sequences.get(tokens)
            if seq is None:
                seq = sequences[tokens] = Sequence(list(tokens), whole[1:], [])
            seq.members.append((i, len(continuation), whole[-1]))
        if truncated:
            logger.warning(
                "%d request(s) longer than --max_length %d tokens were cut from the left, as lm-eval's hf model "
                "cuts them",
                truncated,
                limit,
            )
        bar = tqdm(
            total=len(requests),
            desc="Running loglikelihood requests",
            disable=disable_tqdm or jax.process_index() != 0,
        )
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        alone, shared = split_shared(list(sequences.values()))
        for batch, (logprobs, best) in pipelined(chain(self._packed_batches(alone), self._shared_batches(shared))):
            for i, row, start, body, last in batch.answers:
                tokens = batch.slot_tokens[row]
                total = logprobs[row, start : start + body].astype(np.float64).sum() + logprobs[row, last]
                greedy = (best[row, start : start + body] == tokens[start : start + body]).all()
                results[i] = (float(total), bool(greedy and best[row, last] == tokens[last]))
                text = requests[i][0]
                if text is not None:
                    self.cache_hook.add_partial("loglikelihood", text, results[i])
            bar.update(len(batch.answers))
        bar.close()
        return results

    def _rows_per_batch(self, widths: list[int], extra: int = 0) -> dict[int, int]:
        """Rows of each width in a batch: as many tokens in each (``batch_size`` rows of the widest), a multiple
        of the data-parallel devices; ``extra``: tokens every row adds besides its width."""
        tokens = self.batch_size * (widths[-1] + extra)
        return {w: max(self.replicas, tokens // (w + extra) // self.replicas * self.replicas) for w in widths}

    def _packed_batches(self, sequences: list[Sequence]):
        """``(batch, dispatch)`` for ``sequences`` packed into rows of a few widths (``pack_rows``)."""
        if not sequences:
            return
        lengths = [len(s.tokens) for s in sequences]
        widths = length_buckets(-(-max(lengths) // 8) * 8, multiple=8, halvings=3)
        rows_of = self._rows_per_batch(widths)
        by_width: dict[int, list[list[int]]] = defaultdict(list)
        for width, members in pack_rows(lengths, widths):
            by_width[width].append(members)
        merge_sparse(by_width, rows_of)
        needed = [slots_needed(s) for s in sequences]
        for width in sorted(by_width, reverse=True):
            rows = by_width[width]
            slots = round_up(max(sum(needed[i] for i in members) for members in rows), 8)  # one size a width
            for start in range(0, len(rows), rows_of[width]):
                batch = self._assemble(width, rows_of[width], slots, rows[start : start + rows_of[width]], sequences)
                yield batch, functools.partial(self._dispatch, batch)

    def _shared_batches(self, groups: list[list[Sequence]]):
        """``(batch, dispatch)`` for groups of sequences with a common context (``split_shared``): the contexts
        of a batch padded to one of a few widths, each sequence's continuation one row of its own."""
        if not groups:
            return
        contexts = [context_length(group) for group in groups]
        widths = length_buckets(round_up(max(contexts), 8), multiple=8, halvings=3)
        variants = max(map(len, groups))
        cont_width = round_up(max(len(s.tokens) - n for g, n in zip(groups, contexts) for s in g), 8)
        rows_of = self._rows_per_batch(widths, extra=variants * cont_width)
        by_width: dict[int, list[list[int]]] = defaultdict(list)
        for k in sorted(range(len(groups)), key=lambda k: -contexts[k]):
            by_width[next(w for w in widths if w >= contexts[k])].append([k])
        merge_sparse(by_width, rows_of)
        slots = round_up(max(slots_needed(s) for group in groups for s in group), 8)
        for width in sorted(by_width, reverse=True):
            members = [k for (k,) in by_width[width]]
            for start in range(0, len(members), rows_of[width]):
                chosen = [(groups[k], contexts[k]) for k in members[start : start + rows_of[width]]]
                batch = self._assemble_shared(width, rows_of[width], variants, cont_width, slots, chosen)
                yield batch, functools.partial(self._dispatch_shared, batch)

    @staticmethod
    def _assemble(width: int, rows: int, slots: int, batch_rows, sequences: list[Sequence]) -> Batch:
        ids = np.zeros((rows, width), np.int32)
        segments = np.zeros((rows, width), np.int32)
        positions = np.zeros((rows, width), np.int32)
        slot_at = np.zeros((rows, slots), np.int32)
        slot_tokens = np.zeros((rows, slots), np.int32)
        answers = []
        for r, members in enumerate(batch_rows):
            col, k = 0, 0
            for segment, index in enumerate(members, 1):
                seq = sequences[index]
                n = len(seq.tokens)
                ids[r, col : col + n] = seq.tokens
                segments[r, col : col + n] = segment
                positions[r, col : col + n] = np.arange(n)
                answers += place_slots(seq, slot_at[r], slot_tokens[r], r, offset=-col, first=k)
                col, k = col + n, k + slots_needed(seq)
        return Batch(ids, segments, positions, slot_at, slot_tokens, answers)

    def _dispatch(self, batch: Batch):
        arrays = [batch.ids, batch.segments, batch.positions, batch.slot_at, batch.slot_tokens]
        if self.mesh is not None:
            arrays = [jax.device_put(a, batch_sharding(self.mesh)) for a in arrays]
        return self._score(self.state, *arrays, chunk=self._chunk(batch.ids.shape[0]))

    def _chunk(self, rows: int) -> int:
        """Positions of every row whose logits a device holds at a time (``LOGITS_BYTES``)."""
        vocab = padded_vocab_size(self.config.vocab_size)
        return max(8, LOGITS_BYTES // (4 * vocab * max(1, rows // self.replicas)))

    @staticmethod
    def _assemble_shared(width: int, groups: int, variants: int, cont_width: int, slots: int, chosen) -> Batch:
        rows = groups * variants
        ctx_ids = np.zeros((groups, width), np.int32)
        ctx_mask = np.zeros((groups, width), np.int32)
        cont_ids = np.zeros((rows, cont_width), np.int32)
        owner = np.repeat(np.arange(groups, dtype=np.int32), variants)
        slot_at = np.zeros((rows, slots), np.int32)
        slot_tokens = np.zeros((rows, slots), np.int32)
        ctx_mask[:, -1] = 1  # a context row left empty still holds a token: no row attends to nothing
        answers = []
        for g, (group, n) in enumerate(chosen):
            ctx_ids[g, width - n :] = group[0].tokens[:n]
            ctx_mask[g, width - n :] = 1
            for v, seq in enumerate(group):
                r = g * variants + v
                cont_ids[r, : len(seq.tokens) - n] = seq.tokens[n:]
                # hidden state j of the row: position n - 1 + j of the sequence
                answers += place_slots(seq, slot_at[r], slot_tokens[r], r, offset=n - 1)
        return Batch(ctx_ids, ctx_mask, cont_ids, slot_at, slot_tokens, answers, owner)

    def _dispatch_shared(self, batch: Batch):
        arrays = [batch.ids, batch.segments, batch.positions, batch.owner, batch.slot_at, batch.slot_tokens]
        if self.mesh is not None:
            shardings = (
                [batch_sharding(self.mesh)] * 3 + [NamedSharding(self.mesh, P())] + [batch_sharding(self.mesh)] * 2
            )
            arrays = [jax.device_put(a, sharding) for a, sharding in zip(arrays, shardings)]
        return self._score_shared(self.state, *arrays, chunk=self._chunk(batch.slot_at.shape[0]))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each document, scored in lm-eval's rolling windows of ``max_length`` tokens
        (HFLM's windows, each predicted token conditioned on as many before it as fit)."""
        from lm_eval import utils

        windows, owner = [], []
        for k, (text,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm or jax.process_index() != 0)):
            pairs = utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owner.append(k)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, scores):
            totals[k] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ----------------------------------------------------------------------- generate_until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's completion up to the first of its stop strings (``until``, and the EOS token's
        text), at most ``max_gen_toks`` tokens: HFLM's answer. Requests with the same generation settings
        are batched by prompt length."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        groups: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(i)
        eos_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        plans = []
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = kwargs.pop("max_gen_toks")
            room = self.max_length - max_gen_toks
            if room <= 0:
                raise JaxseqError(
                    f"a task generates up to {max_gen_toks} tokens, which leaves no room for its prompt in "
                    f"--max_length {self.max_length}; raise --max_length"
                )
            plans.append((indices, until, max_gen_toks, sampling_settings(kwargs), room))
        bar = tqdm(
            total=len(requests),
            desc="Running generate_until requests",
            disable=disable_tqdm or jax.process_index() != 0,
        )
        out: list[str | None] = [None] * len(requests)
        for indices, until, max_gen_toks, sampling, room in plans:
            prompts = {i: self.tok_prompt(requests[i].args[0])[-room:] for i in indices}
            for batch in self._generate(prompts, max_gen_toks, sampling):
                for i, text in batch:
                    context, gen_kwargs = requests[i].args
                    out[i] = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), out[i])
                bar.update(len(batch))
        bar.close()
        return out

    def _generate(self, prompts: dict[int, list[int]], max_new_tokens: int, sampling: dict):
        """Completions of ``prompts`` (request -> tokens), a batch at a time: ``[(request, text decoded as HFLM
        decodes it)]`` for batches of ``batch_size`` prompts of like length, left-padded to one of a few
        widths."""
        order = sorted(prompts, key=lambda i: -len(prompts[i]))
        widths = length_buckets(-(-len(prompts[order[0]]) // 32) * 32, multiple=32, halvings=1)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        size = self.batch_size
        for k in range(0, len(order), size):
            batch = order[k : k + size]
            rows = [prompts[i] for i in batch]
            rows += [rows[-1]] * (size - len(rows))  # every batch the same size: one program per width
            width = next(w for w in widths if w >= max(map(len, rows)))
            ids = np.array([[pad] * (width - len(r)) + r for r in rows], np.int32)
            mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int32)
            seed = int(np.random.SeedSequence([self.seed, k]).generate_state(1)[0])
            result = generate(
                self.model,
                ids,
                mask,
                max_new_tokens=max_new_tokens,
                eos_token_id=self.eos_token_ids or None,
                pad_token_id=pad,
                bucket=width,
                seed=seed,
                **sampling,
            )
            texts = []
            for i, tokens in zip(batch, gather(result.sequences)):
                tokens = tokens.tolist()
                ends = [tokens.index(e) for e in self.eos_token_ids if e in tokens]
                tokens = tokens[: min(ends) + 1] if ends else tokens  # the EOS kept: decoding drops a special one
                self.generated += len(tokens)
                texts.append((i, self.tok_decode(tokens)))
            yield texts


SAMPLING = ("do_sample", "temperature", "top_k", "top_p")


def sampling_settings(kwargs: dict) -> dict:
    """``generate``'s sampling arguments from a task's normalised generation settings (greedy unless
    ``do_sample``); a setting jaxseq does not have stops in one line."""
    unknown = sorted(set(kwargs) - set(SAMPLING))
    if unknown:
        raise JaxseqError(
            f"generation setting(s) {', '.join(unknown)} of a task are not supported by jaxseq eval "
            f"(it takes until, max_gen_toks, {', '.join(SAMPLING)})"
        )
    if not kwargs.get("do_sample"):
        return {}
    settings = {"do_sample": True, "temperature": float(kwargs.get("temperature") or 1.0)}
    if kwargs.get("top_k") is not None:
        settings["top_k"] = int(kwargs["top_k"])
    if kwargs.get("top_p") is not None:
        settings["top_p"] = float(kwargs["top_p"])
    return settings


# --------------------------------------------------------------------------- tasks and results


def load_tasks(names: list[str], include_path: str | None, metadata: dict):
    """``TaskManager.load(names)``: lm-eval's tasks and groups of those names. With ``include_path`` only that
    folder is indexed first (lm-eval's thousands of built-in task files take seconds to index): when it holds
    every task named, they load from it, as they would with the built-in tasks beside them (an
    ``include_path`` task overrides a built-in one of its name); otherwise, and for built-in tasks, the whole
    index. An unknown name stops in one line."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise JaxseqError(f"--include_path {include_path} is not a folder of task YAML files")
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata)
        if all(local.match_tasks([name]) for name in names):
            try:
                return local.load(expand(local, names))
            except (KeyError, ValueError, FileNotFoundError):
                pass  # it names a built-in task somewhere: the whole index below
    manager = TaskManager(include_path=include_path, metadata=metadata)
    missing = [name for name in names if not manager.match_tasks([name])]
    if missing:
        where = f" (lm-eval's tasks and those in {include_path})" if include_path else ""
        raise JaxseqError(
            f"no lm-eval task named {', '.join(missing)}{where}; `lm-eval ls tasks` lists them, "
            "--include_path adds a folder of your own"
        )
    return manager.load(expand(manager, names))


def expand(manager, names: list[str]) -> list[str]:
    """The task names matched (a pattern such as ``mmlu_*`` matches several), each once, in order."""
    out = []
    for name in names:
        out += [m for m in manager.match_tasks([name]) if m not in out]
    return out


@dataclasses.dataclass
class Settings:
    """How tasks are run: lm-eval's ``simple_evaluate`` arguments that jaxseq eval takes."""

    num_fewshot: int | None = None
    limit: float | None = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool | None = None
    system_instruction: str | None = None
    log_samples: bool = False
    bootstrap_iters: int = 100000
    random_seed: int = 0
    numpy_random_seed: int = 1234
    fewshot_random_seed: int = 1234


def prepare_tasks(names: list[str], settings: Settings, *, include_path=None, metadata=None, max_gen_toks=None):
    """The tasks ``names`` loaded (``load_tasks``), set up as ``lm_eval.simple_evaluate`` sets them up: Python's
    and NumPy's generators seeded first, ``num_fewshot`` (a task that sets 0 keeps it; one that sets none gets
    0), the few-shot sampler's seed; a task's generation settings that jaxseq does not have stop in one line
    (before any model is loaded)."""
    import random

    random.seed(settings.random_seed)
    np.random.seed(settings.numpy_random_seed)
    if settings.fewshot_as_multiturn and not settings.apply_chat_template:
        raise JaxseqError("--fewshot_as_multiturn needs --apply_chat_template")
    loaded = load_tasks(names, include_path, metadata or {})
    for task in loaded["tasks"].values():
        if task.get_config("output_type") == "generate_until":
            sampling_settings(
                normalize(task.get_config("generation_kwargs") or {}, max_gen_toks or DEFAULT_MAX_GEN_TOKS)
            )
        if settings.num_fewshot is not None:
            if task.get_config("num_fewshot") != 0:
                task.set_config(key="num_fewshot", value=settings.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=settings.fewshot_random_seed)
    return loaded


def evaluate_tasks(lm: JaxseqLM, loaded: dict, settings: Settings, *, model_args: dict | None = None):
    """lm-eval's results of the tasks ``loaded`` (``prepare_tasks``) with ``lm``: what
    ``lm_eval.simple_evaluate(lm, ...)`` returns (results, groups, configs, versions, n-shot, higher_is_better,
    n-samples, samples with ``log_samples``, config, git_hash, date, the environment and tokenizer), and
    lm-eval's ``GeneralConfigTracker`` (model and chat template, timing) that its ``EvaluationTracker`` saves
    beside them. The same steps as ``simple_evaluate``, but the environment recorded is JAX's, not PyTorch's.
    Bootstrapped standard errors run in lm-eval's forked pool (``quiet_forks``)."""
    from lm_eval import evaluator
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lm_eval.loggers.utils import add_tokenizer_info

    tracker = GeneralConfigTracker()
    start_date = time.time()
    model_args = model_args or {"pretrained": lm.name}
    multiturn = settings.fewshot_as_multiturn
    if multiturn is None:
        multiturn = settings.apply_chat_template
    chat_template = lm.chat_template(True) if settings.apply_chat_template else None
    if settings.apply_chat_template and not chat_template:
        raise JaxseqError("--apply_chat_template: the tokenizer has no chat template")
    tracker.log_experiment_args(
        model_source="jaxseq",
        model_args=model_args,
        system_instruction=settings.system_instruction,
        chat_template=chat_template,
        fewshot_as_multiturn=multiturn,
    )
    with quiet_forks():
        results = evaluator.evaluate(
            lm=lm,
            task_dict=loaded,
            limit=settings.limit,
            bootstrap_iters=settings.bootstrap_iters,
            log_samples=settings.log_samples,
            system_instruction=settings.system_instruction,
            apply_chat_template=settings.apply_chat_template,
            fewshot_as_multiturn=multiturn,
        )
    results["config"] = {"model": "jaxseq", "model_args": model_args, **lm.get_model_info()}
    results["config"].update(
        {
            "batch_size": lm.batch_size,
            "batch_sizes": [],
            "device": describe_devices(lm.mesh),
            "use_cache": None,
            "limit": settings.limit,
            "bootstrap_iters": settings.bootstrap_iters,
            "gen_kwargs": None,
            "random_seed": settings.random_seed,
            "numpy_seed": settings.numpy_random_seed,
            "torch_seed": None,
            "fewshot_seed": settings.fewshot_random_seed,
        }
    )
    results["git_hash"] = git_hash()
    results["date"] = start_date
    add_environment(results)
    add_tokenizer_info(results, lm)
    tracker.log_end_time()
    return results, tracker


def generation_eos(folder, config) -> list[int] | None:
    """The EOS tokens transformers' ``generate`` stops at for this checkpoint: its generation config's (its
    ``generation_config.json``, else the one transformers makes from ``config.json``)."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(folder) if folder is not None else None
    except OSError:
        generation = None
    generation = generation or GenerationConfig.from_model_config(config)
    eos = generation.eos_token_id
    return None if eos is None else [int(e) for e in ([eos] if isinstance(eos, int) else eos)]


@dataclasses.dataclass
class EvalTasksConfig:
    """lm-evaluation-harness tasks run at each evaluation of a training run (as ``jaxseq eval`` runs them)."""

    eval_tasks: str | None = arg(
        None,
        "lm-eval tasks, comma-separated, run with the weights being trained at each evaluation (--eval_strategy; "
        "at least once, at the end): their figures join the eval metrics (eval_<task>_<metric>), lm-eval's "
        "results of the last go to OUTPUT_DIR/lm_eval/results.json",
    )
    eval_tasks_include_path: str | None = arg(None, "a folder of your own task YAML files for --eval_tasks")
    eval_tasks_num_fewshot: int | None = arg(None, "few-shot examples of --eval_tasks (default: each task's own)")
    eval_tasks_limit: float | None = arg(
        None, "examples per task of --eval_tasks at most (below 1: that fraction of each task)"
    )


class TaskEvaluation:
    """``evaluation(model) -> {"<task>_<metric>": value}``: lm-eval's tasks of an ``EvalTasksConfig`` run on
    ``model`` (the weights of the moment; a training run's ``Trainer`` calls it at each evaluation). The tasks
    load once, when it is made (an unknown name or an unsupported task stops in one line before training);
    every call starts from the same seeds, so evaluations at different steps see the same prompts.
    ``last``: lm-eval's results of the latest call and its tracker (``save_results`` writes them)."""

    def __init__(self, config: EvalTasksConfig, tokenizer, *, model_config, folder=None, batch_size: int = 8,
                 mesh=None, name: str = "jaxseq"):  # fmt: skip
        require_lm_eval()
        names = [n.strip() for n in (config.eval_tasks or "").split(",") if n.strip()]
        if not names:
            raise JaxseqError("--eval_tasks names no task; give lm-eval task names, comma-separated")
        if config.eval_tasks_limit is not None and config.eval_tasks_limit <= 0:
            raise JaxseqError(f"--eval_tasks_limit must be positive, got {config.eval_tasks_limit}")
        if config.eval_tasks_num_fewshot is not None and config.eval_tasks_num_fewshot < 0:
            raise JaxseqError(f"--eval_tasks_num_fewshot must be at least 0, got {config.eval_tasks_num_fewshot}")
        self.settings = Settings(num_fewshot=config.eval_tasks_num_fewshot, limit=config.eval_tasks_limit)
        self.model_args = {"pretrained": name}
        self.loaded = prepare_tasks(
            names, self.settings, include_path=config.eval_tasks_include_path, metadata=dict(self.model_args)
        )
        self.tokenizer, self.batch_size, self.mesh, self.name = tokenizer, batch_size, mesh, name
        self.eos = generation_eos(folder, model_config)
        self.last = None

    def __call__(self, model) -> dict[str, float]:
        import random

        random.seed(self.settings.random_seed)
        np.random.seed(self.settings.numpy_random_seed)
        for task in self.loaded["tasks"].values():
            task.set_fewshot_seed(seed=self.settings.fewshot_random_seed)
        lm = JaxseqLM(model, self.tokenizer, batch_size=self.batch_size, mesh=self.mesh, eos_token_ids=self.eos,
                      name=self.name)  # fmt: skip
        results, tracker = evaluate_tasks(lm, self.loaded, self.settings, model_args=self.model_args)
        self.last = results, tracker
        return flat_metrics(results)


def flat_metrics(results: dict) -> dict[str, float]:
    """lm-eval's numeric figures of each task and group, stderrs left out: ``{"<task>_<metric>": value}``, the
    filter named after the metric unless it is ``none`` (``hellaswag_acc_norm``, ``gsm8k_exact_match_strict``)."""
    out = {}
    for section in ("results", "groups"):
        for task, figures in (results.get(section) or {}).items():
            for key, value in figures.items():
                metric, _, kept = key.partition(",")
                if not kept or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                out[f"{task}_{metric}" + ("" if kept == "none" else f"_{kept}")] = float(value)
    return out


def normalize(gen_kwargs: dict, default_max_gen_toks: int) -> dict:
    from lm_eval.models.utils import normalize_gen_kwargs

    kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks))
    kwargs.pop("until", None)
    kwargs.pop("max_gen_toks", None)
    return kwargs


def describe_devices(mesh) -> str:
    devices = mesh.devices.flatten().tolist() if mesh is not None else jax.devices()[:1]
    return f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})"


def add_environment(results: dict) -> None:
    """lm-eval's environment fields, describing the JAX that ran the model (``pretty_env_info``: JAX's
    environment report instead of PyTorch's)."""
    from importlib.metadata import version

    import transformers
    from lm_eval.loggers.utils import get_commit_from_path

    results.update(
        {
            "pretty_env_info": jax.print_environment_info(return_string=True),
            "transformers_version": transformers.__version__,
            "lm_eval_version": version("lm_eval"),
            "upper_git_hash": get_commit_from_path(Path(os.getcwd(), "..")),
            "jaxseq_version": version("jaxseq"),
        }
    )


def save_results(results: dict, tracker, output_dir: str | os.PathLike) -> list[Path]:
    """``results.json`` (the results as lm-eval's ``EvaluationTracker.save_results_aggregated`` writes them:
    with each task's samples' hash and the tracker's fields) and, when the results hold samples,
    ``samples_<task>.jsonl`` (as its ``save_results_samples`` writes them) in ``output_dir``; the paths."""
    from lm_eval.utils import handle_non_serializable, hash_string, sanitize_list

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", None)
    hashes = {}
    for task, rows in (samples or {}).items():
        hashes[task] = hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in rows))
    results["task_hashes"] = hashes
    results.update(dataclasses.asdict(tracker))
    dump = lambda x: json.dumps(x, default=handle_non_serializable, ensure_ascii=False)
    written = [atomic_write(out / "results.json", json.dumps(results, indent=2, default=handle_non_serializable,
                                                               ensure_ascii=False))]  # fmt: skip
    for task in results["configs"] if samples else ():
        lines = []
        for sample in samples.get(task, []):
            arguments = {
                f"gen_args_{i}": {f"arg_{j}": value for j, value in enumerate(arg)}
                for i, arg in enumerate(sample["arguments"])
            }
            sample = {
                **sample,
                "resps": sanitize_list(sample["resps"]),
                "filtered_resps": sanitize_list(sample["filtered_resps"]),
                "arguments": arguments,
                "target": str(sample["target"]),
            }
            lines.append(dump(sample) + "\n")
        written.append(atomic_write(out / f"samples_{task}.jsonl", "".join(lines)))
    return written


def print_table(results: dict, file=None) -> None:
    """lm-eval's tables of the results (``lm_eval.utils.make_table``): tasks, and groups if any."""
    from lm_eval.utils import make_table

    file = file or sys.stdout
    print(make_table(results), file=file)
    if results.get("groups"):
        print(make_table(results, "groups"), file=file)


@contextlib.contextmanager
def quiet_forks():
    """lm-eval's bootstrapped standard errors (median, F1, MCC, perplexity, BLEU, ...) run in a forked
    ``multiprocessing.Pool``, as with its own backends. JAX warns of any fork once its threads run; the pool's
    workers run only Python statistics over the per-sample scores and touch no JAX state, so that one warning
    is left out here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        yield


def git_hash() -> str | None:
    """The commit of the git repository around the working directory (lm-eval's ``git_hash``), quietly."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        found = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
        return found.stdout.strip()
    except (subprocess.CalledProcessError, OSError):
        return get_commit_from_path(os.getcwd())
