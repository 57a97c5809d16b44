"""Knowledge distillation, TRL's names and formulas: the generalized Jensen-Shannon divergence between the
student's and a teacher's next-token distributions on the completion tokens (``GKDTrainer``,
arXiv:2306.13649), on the data's completions or, with probability ``lmbda`` a step, on completions the student
samples itself (on-policy; ``lmbda`` 1 is TRL's stable ``DistillationTrainer``).

With mixture m = (1 - β) p_student + β p_teacher, a position's divergence is β KL(p_teacher || m) + (1 - β)
KL(p_student || m); β 0 is the forward KL(p_teacher || p_student), β 1 the reverse KL(p_student || p_teacher).
The loss is its mean over the completion tokens of the step. The teacher's logits are made chunk by chunk
beside the student's, as the causal-LM loss makes its own: never a whole ``[rows, tokens, vocabulary]`` of
either."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.config import arg
from jaxseq.errors import JaxseqError
from jaxseq.generation import generate
from jaxseq.sharding import gather
from jaxseq.train.objectives import AUTO_CHUNK, CausalLM
from jaxseq.train.task import Policy, Task

GKD = {"beta": 0.5, "temperature": 0.9, "max_new_tokens": 128}
"""TRL's ``GKDConfig`` defaults (``lmbda`` below 1)."""
DISTILLATION = {"beta": 1.0, "temperature": 1.0, "max_new_tokens": 512}
"""TRL's ``DistillationConfig`` defaults (``lmbda`` 1; its ``max_completion_length``)."""


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float = 1.0) -> jax.Array:
    """Per position (the last axis the vocabulary): the generalized JSD of the two distributions of the logits
    divided by ``temperature``, as TRL's ``GKDTrainer.generalized_jsd_loss`` computes it before reducing: β 0
    the forward KL(teacher || student), β 1 the reverse KL(student || teacher), else β KL(teacher || m) +
    (1 - β) KL(student || m) with m = (1 - β) student + β teacher."""
    student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    kl = lambda target, log_q: (jnp.exp(target) * (target - log_q)).sum(-1)  # KL(target || q), log inputs
    if beta == 0:
        return kl(teacher, student)
    if beta == 1:
        return kl(student, teacher)
    mixture = jnp.logaddexp(student + jnp.log1p(-beta), teacher + jnp.log(beta))
    return beta * kl(teacher, mixture) + (1 - beta) * kl(student, mixture)


@dataclasses.dataclass
class DistillConfig:
    lmbda: float = arg(
        0.5,
        "the share of steps trained on completions the student samples itself (on-policy) instead of the data's "
        "(TRL GKD's default 0.5; 1: TRL's DistillationTrainer, its defaults for --beta, --temperature and "
        "--max_new_tokens)",
    )
    beta: float | None = arg(
        None,
        "the divergence: 0 the forward KL(teacher || student), 1 the reverse KL, between them the generalized "
        "JSD (default: TRL's, 0.5 with GKD and 1.0 at --lmbda 1)",
    )
    temperature: float | None = arg(
        None,
        "temperature of the on-policy samples (default: TRL's, 0.9 with GKD and 1.0 at --lmbda 1); at --lmbda 1, "
        "as TRL's DistillationTrainer, it also divides both models' logits in the loss (GKD's loss is at 1)",
    )
    max_new_tokens: int | None = arg(
        None,
        "tokens sampled per on-policy completion at most (default: TRL's, 128 with GKD and 512 at --lmbda 1)",
        aliases=("max_completion_length",),
    )
    loss_chunk_tokens: int = arg(
        AUTO_CHUNK,
        "float32 logits of each model of at most this many tokens per device at a time (as `jaxseq clm`; 0: all)",
    )

    def __post_init__(self):
        defaults = DISTILLATION if self.lmbda == 1 else GKD
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if not 0 <= self.lmbda <= 1:
            raise JaxseqError(f"--lmbda must be between 0 and 1, got {self.lmbda}")
        if not 0 <= self.beta <= 1:
            raise JaxseqError(f"--beta must be between 0 and 1, got {self.beta}")
        if not self.temperature > 0:
            raise JaxseqError(f"--temperature must be above 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise JaxseqError(f"--max_new_tokens must be at least 1, got {self.max_new_tokens}")

    @property
    def loss_temperature(self) -> float:
        """The temperature of the loss: TRL's DistillationTrainer's (``lmbda`` 1), else GKD's, 1."""
        return self.temperature if self.lmbda == 1 else 1.0


class Distill(Task):
    """The distillation loss of a batch of rows ``input_ids``, ``attention_mask`` (1 on tokens) and
    ``loss_mask`` (1 on the completion tokens), with ``prompt_length`` (the tokens before the completion),
    against the teacher the step gives it (``with_teacher``). A ``rollout`` replaces a step's batch, with
    probability ``config.lmbda``, by the student's own completions of its prompts (``OnPolicy``). No dropout
    (TRL's ``disable_dropout``, GKD's default). ``lm``: the causal-LM loss whose target weights and chunk sizes
    it follows."""

    metric_names = ("loss",)
    needs_teacher = True

    def __init__(self, config: DistillConfig, *, lm: CausalLM | None = None, teacher=None, sampler=None):
        self.config, self.teacher, self.sampler = config, teacher, sampler
        self.lm = lm if lm is not None else CausalLM(config.loss_chunk_tokens or None)
        self.samples_in_the_loop = sampler is not None

    def _with(self, **changes) -> Distill:
        fields = {"lm": self.lm, "teacher": self.teacher, "sampler": self.sampler, **changes}
        return Distill(self.config, **fields)

    def with_teacher(self, teacher) -> Distill:
        return self._with(teacher=teacher)

    def for_batch_shards(self, batch_shards: int, device=None) -> Distill:
        return self._with(lm=self.lm.for_batch_shards(batch_shards, device))

    def loss_weight(self, batch) -> jax.Array:
        return self._weights(batch).sum()

    def _weights(self, batch) -> jax.Array:
        """1 where position t's next token is a completion token (TRL's shifted labels)."""
        return self.lm._weights({"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"]})

    def divergences(self, model, batch) -> tuple[jax.Array, jax.Array]:
        """``[rows, tokens]`` per-position divergences (0 where nothing is learned) and their weights."""
        if self.teacher is None:
            raise JaxseqError("distillation needs its teacher: the step gives it (Task.with_teacher)")
        ids, mask = batch["input_ids"].astype(jnp.int32), batch["attention_mask"]
        positions = jnp.maximum(jnp.cumsum(mask != 0, axis=1) - 1, 0)  # a left-padded prompt starts at 0
        weights = self._weights(batch)
        vocab, teacher = model.config.vocab_size, self.teacher
        beta, temperature = self.config.beta, self.config.loss_temperature

        def divergence(student_logits, teacher_logits):
            return generalized_jsd(student_logits[..., :vocab], teacher_logits[..., :vocab], beta, temperature)

        chunk_tokens = self.lm._chunk_tokens(*ids.shape, vocab)
        chunked = chunk_tokens and hasattr(model, "hidden_states") and hasattr(teacher, "hidden_states")
        if not chunked:
            teacher_logits = jax.lax.stop_gradient(teacher(ids, mask, positions).logits)
            return divergence(model(ids, mask, positions).logits, teacher_logits) * weights, weights
        h = model.hidden_states(ids, mask, positions).last_hidden_state
        h_teacher = jax.lax.stop_gradient(teacher.hidden_states(ids, mask, positions).last_hidden_state)

        @jax.checkpoint
        def chunk(h, h_teacher):
            return divergence(model.logits(h), jax.lax.stop_gradient(teacher.logits(h_teacher)))

        rows, seq = ids.shape
        width = self.lm.chunk_positions(rows, seq, chunk_tokens)
        if width >= seq:
            return chunk(h, h_teacher) * weights, weights
        chunks = -(-seq // width)
        split = lambda x: (
            jnp.pad(x, ((0, 0), (0, chunks * width - seq), (0, 0))).reshape(rows, chunks, width, -1).swapaxes(0, 1)
        )
        out = jax.lax.map(lambda xs: chunk(*xs), (split(h), split(h_teacher)))
        return out.swapaxes(0, 1).reshape(rows, chunks * width)[:, :seq] * weights, weights

    def loss(self, model, batch, rngs=None) -> jax.Array:
        divergences, weights = self.divergences(model, batch)
        return divergences.sum() / jnp.maximum(weights.sum(), 1.0)

    def predict(self, model, batch) -> dict[str, jax.Array]:
        divergences, weights = self.divergences(model, batch)
        return {"loss_sum": divergences.sum(-1), "tokens": weights.sum(-1)}

    def metrics(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        return {"loss": float(outputs["loss_sum"].astype(np.float64).sum() / max(outputs["tokens"].sum(), 1.0))}

    def rollout(self, policy: Policy, batch, step: int):
        return self.sampler(policy, batch, step), {}


class OnPolicy:
    """GKD's on-policy steps: with probability ``lmbda`` (a draw that is a function of the seed and the step
    alone), a step's batch is replaced by the student's own completions of its prompts, sampled at
    ``temperature`` from all of the vocabulary (TRL's ``top_k`` 0, ``top_p`` 1) up to ``max_new_tokens``
    tokens, each ending at its first EOS (``eos_token_ids``); the prompts are left-padded to ``prompt_width``
    tokens, so that every on-policy batch has one shape. Any number of processes (``__call__``)."""

    def __init__(self, config: DistillConfig, prompt_width: int, eos_token_ids: Sequence[int], pad_id: int, seed: int):
        self.config, self.prompt_width, self.seed = config, prompt_width, seed
        self.eos, self.pad = [int(e) for e in eos_token_ids], int(pad_id)

    def on_policy(self, step: int) -> bool:
        return bool(np.random.default_rng((self.seed, step)).random() < self.config.lmbda)

    def __call__(self, policy: Policy, batch: Mapping[str, jax.Array], step: int):
        """The batch of step ``step``: ``batch`` itself, or the student's completions of its prompts.

        Several processes: each holds only its share of ``batch``'s rows, so its prompts (``input_ids`` and
        ``prompt_length``, a few integers a row) are gathered first; every process then calls the sampler with
        every prompt, one program over the whole mesh in which each device samples its own rows (the draws are
        keyed by the seed, the step and each row's place in the batch, not by the process layout), and places
        the rows of each micro-batch it holds (``policy.local``)."""
        if not self.on_policy(step):
            return batch
        host = gather({k: batch[k] for k in ("input_ids", "prompt_length")})  # every process's rows
        stacked = host["input_ids"].ndim == 3
        ids = host["input_ids"].reshape(-1, host["input_ids"].shape[-1])
        rows = self.sample(policy.model(), ids, host["prompt_length"].reshape(-1), seed=self.seed * 1_000_003 + step)
        micro = {k: v.reshape(policy.accumulate if stacked else 1, -1, *v.shape[1:]) for k, v in rows.items()}
        mine = {k: v[:, policy.local] for k, v in micro.items()}  # this process's rows of each micro-batch
        return policy.place(mine if stacked else {k: v[0] for k, v in mine.items()}, stacked=stacked)

    def sample(self, model, ids: np.ndarray, prompt_length: np.ndarray, *, seed: int) -> dict[str, np.ndarray]:
        """Rows of each prompt (the first ``prompt_length`` tokens of each row of ``ids``) with a completion
        sampled from ``model``, as TRL's ``generate_on_policy_outputs`` makes them."""
        width, c = self.prompt_width, self.config
        prompts = np.full((len(ids), width), self.pad, np.int32)
        prompt_mask = np.zeros((len(ids), width), np.int32)
        for row, n in enumerate(prompt_length):
            prompts[row, width - n :], prompt_mask[row, width - n :] = ids[row, :n], 1
        out = generate(
            model,
            prompts,
            prompt_mask,
            max_new_tokens=c.max_new_tokens,
            do_sample=True,
            temperature=c.temperature,
            top_k=0,
            top_p=1.0,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            seed=seed,
        )
        completion = gather(out.sequences)  # with several processes: every process's rows
        is_eos = np.isin(completion, self.eos)
        length = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, completion.shape[1])
        completion_mask = (np.arange(completion.shape[1])[None] < length[:, None]).astype(np.int32)
        return {
            "input_ids": np.concatenate([prompts, completion], axis=1).astype(np.int32),
            "attention_mask": np.concatenate([prompt_mask, completion_mask], axis=1),
            "loss_mask": np.concatenate([np.zeros_like(prompt_mask), completion_mask], axis=1),
            "prompt_length": np.asarray(prompt_length, np.int32),
        }
