"""GRPO, TRL's names and formulas (trl 1.16 ``GRPOTrainer``): group-normalised advantages, the clipped surrogate
with a k3 KL to the reference, the ``dapo``/``grpo``/``bnpo``/``dr_grpo`` normalisations, and the rollout that
samples completions from the policy being trained (``jaxseq.generation``, the training weights themselves) and
scores them with the user's reward functions and reward models (``RewardModel``). The losses are pure functions
of per-token log-probs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxseq.config import arg
from jaxseq.data.batches import train_indices
from jaxseq.errors import JaxseqError
from jaxseq.generation import generate, parameter_mesh
from jaxseq.mesh import batch_sharding, data_parallel_size
from jaxseq.models.hub import position_limit
from jaxseq.sharding import gather
from jaxseq.train.objectives import AUTO_CHUNK, CausalLM
from jaxseq.train.task import Policy, Task

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str = "group"):
    """(advantages, whether each completion's std is 0) of ``rewards`` ``[prompts x num_generations]`` (each
    prompt's completions consecutive), as TRL's ``sum_then_normalize``: the reward minus its group's mean,
    divided by the group's (``group``) or the batch's (``batch``) unbiased std + 1e-4, or not (``none``).
    NaN rewards (unscorable completions) are left out of the statistics and get advantage 0."""
    rewards = np.asarray(rewards, np.float64)
    groups = rewards.reshape(-1, num_generations)
    mean = np.repeat(np.nanmean(groups, axis=1), num_generations)
    if scale_rewards == "batch":
        std = np.full_like(rewards, np.nanstd(rewards, ddof=1) if rewards.size > 1 else 0.0)
    elif num_generations > 1:
        std = np.repeat(np.nanstd(groups, axis=1, ddof=1), num_generations)
    else:
        std = np.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32), np.isclose(std, 0.0)


def grpo_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    bias_correction_kl: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of one batch of completions (TRL's ``_compute_loss``, token-level importance sampling) and TRL's
    figures. ``logps``, ``old_logps``, ``ref_logps`` and ``mask``: ``[completions, tokens]``; ``advantages``
    ``[completions]``. Per token: -min(r A, clip(r, 1-ε_low, 1+ε_high) A) + β (exp(ref-logp) - (ref-logp) - 1),
    r = exp(logp - old), the KL term x r with ``bias_correction_kl`` (TRL 1.16's default); reduced as
    ``loss_type``: ``grpo`` the mean of each completion's token mean, ``bnpo`` and ``dapo`` one mean over the
    batch's tokens (``dapo`` over the whole step's: ``GRPO.loss_weight``), ``dr_grpo`` the sum over completions
    x ``max_completion_length``."""
    mask = mask.astype(jnp.float32)
    advantages = advantages[:, None]
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
    if beta != 0.0:
        kl = jnp.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_correction_kl:  # the unbiased reverse-KL gradient (DeepSeek-V3.2), the ratio differentiated too
            kl = kl * ratio
        per_token = per_token + beta * kl
    tokens = jnp.maximum(mask.sum(), 1.0)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).mean()
    elif loss_type in ("bnpo", "dapo"):
        loss = (per_token * mask).sum() / tokens
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    else:
        raise JaxseqError(f"--loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    masked_mean = lambda x: jax.lax.stop_gradient((x * mask).sum() / tokens)
    seq_mean = lambda x: (x * mask).sum(-1) / mask.sum(-1)
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).astype(jnp.float32)
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).astype(jnp.float32)
    figures = {
        "clip_ratio/low_mean": masked_mean(low),
        "clip_ratio/high_mean": masked_mean(high),
        "clip_ratio/region_mean": masked_mean(jnp.maximum(low, high)),
        "clip_ratio/low_min": jax.lax.stop_gradient(jnp.nanmin(seq_mean(low))),
        "clip_ratio/high_max": jax.lax.stop_gradient(jnp.nanmax(seq_mean(high))),
    }
    if beta != 0.0:
        figures["kl"] = masked_mean(kl)
    return loss, figures


def completion_logps(model, batch: Mapping[str, jax.Array], temperature: float = 1.0, lm: CausalLM | None = None):
    """(log-probs, entropies), ``[completions, tokens]`` each, of the completion tokens of ``batch`` (``input_ids``
    and ``attention_mask`` ``[rows, prompt + completion]``, the completions the last ``completion_mask.shape[1]``
    positions) from the logits divided by ``temperature``, as TRL scores them. Positions count real tokens (a
    left-padded prompt starts at 0), as the sampler placed them. ``lm``: a causal-LM loss fitted to the mesh
    (``CausalLM.for_batch_shards``) whose chunks these follow: the float32 logits of a chunk of completion
    positions at a time, each made and dropped inside a ``jax.checkpoint`` (the ``[rows, tokens, vocab]``
    logits of a 1024-token completion and a 150k vocabulary are 4.6 GB for 8 rows); None: all at once."""
    ids, mask = batch["input_ids"].astype(jnp.int32), batch["attention_mask"]
    width = batch["completion_mask"].shape[-1]
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    vocab = model.config.vocab_size
    targets = ids[:, -width:]

    def scores(logits, targets):
        logp = jax.nn.log_softmax(logits[..., :vocab].astype(jnp.float32) / temperature, axis=-1)
        chosen = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return chosen, -(jnp.exp(logp) * logp).sum(-1)

    if not hasattr(model, "hidden_states"):
        return scores(model(ids, mask, positions).logits[:, -width - 1 : -1], targets)
    h = model.hidden_states(ids, mask, positions).last_hidden_state[:, -width - 1 : -1]
    tokens = None if lm is None else lm._chunk_tokens(ids.shape[0], width, vocab)
    if not tokens:  # the vocabulary projection of the completion positions only
        return scores(model.logits(h), targets)
    chunk = lm.chunk_positions(ids.shape[0], width, tokens)
    one = jax.checkpoint(lambda h, t: scores(model.logits(h), t))
    if width <= chunk:
        return one(h, targets)
    rows, chunks = ids.shape[0], -(-width // chunk)
    pad = chunks * chunk - width
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(rows, chunks, chunk, h.shape[-1]).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(rows, chunks, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: one(*xs), (h, targets))  # every chunk keeps every row (and its sharding)
    return tuple(x.swapaxes(0, 1).reshape(rows, chunks * chunk)[:, :width] for x in out)


@dataclasses.dataclass
class GRPOConfig:
    reward_funcs: list[str] | None = arg(
        None,
        "reward functions, path/to/file.py:function each (several as TRL's list, --reward_funcs a.py:f b.py:g, "
        "or the flag repeated): called as TRL calls them, f(prompts=..., completions=..., completion_ids=..., "
        "**other_columns) -> list of floats (None: unscored); or reward models, a folder or Hub id of a sequence "
        "classifier with one label (what jaxseq reward writes), scoring prompt + completion as TRL's",
    )
    reward_weights: list[float] | None = arg(
        None,
        "the weight of each --reward_funcs, in order, as TRL's list (--reward_weights 1.0 0.5, or the flag "
        "repeated; default: 1 each)",
    )
    num_generations: int = arg(8, "completions sampled per prompt, a group (TRL's default 8)")
    max_completion_length: int = arg(512, "tokens generated per completion at most (TRL's default 512)")
    temperature: float = arg(1.0, "sampling temperature; the loss's log-probs use it too, as TRL's")
    top_p: float = arg(1.0, "nucleus sampling: keep the most likely tokens holding this much mass (1: all)")
    top_k: int = arg(0, "sample among the k most likely tokens only (0: all)")
    beta: float = arg(
        0.0,
        "weight of the KL to the reference (k3 estimator); 0 (TRL's default): no reference model. The "
        "reference: a frozen copy of the starting weights, or with --lora_rank the base weights, adapters off",
    )
    use_bias_correction_kl: bool = arg(
        True, "multiply the KL term by the probability ratio: the unbiased reverse-KL gradient (TRL 1.16's default)"
    )
    epsilon: float = arg(0.2, "lower clipping bound ε of the probability ratio (1 - ε)")
    epsilon_high: float | None = arg(None, "upper clipping bound (1 + ε_high; default --epsilon; DAPO: 0.28)")
    num_iterations: int = arg(
        1, "updates per generated batch (μ): the first samples, the next reuse it against its old log-probs"
    )
    loss_type: str = arg(
        "dapo",
        "how per-token losses are reduced (TRL's): dapo (default: over the step's tokens), grpo (each "
        "completion's mean, then the mean), bnpo (over each micro-batch's tokens), dr_grpo (sum / completions x "
        "--max_completion_length)",
        choices=LOSS_TYPES,
    )
    scale_rewards: str = arg(
        "group",
        "divide advantages by each group's reward std (group, TRL's default), the batch's (batch) or not (none)",
        choices=SCALE_REWARDS,
    )
    mask_truncated_completions: bool = arg(
        False, "leave completions that reached --max_completion_length without EOS out of the loss"
    )

    def __post_init__(self):
        if self.num_generations < 2:
            raise JaxseqError(f"--num_generations must be at least 2 (a group), got {self.num_generations}")
        for name in ("max_completion_length", "num_iterations"):
            if getattr(self, name) < 1:
                raise JaxseqError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise JaxseqError(f"--temperature must be above 0, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise JaxseqError(f"--top_k must be >= 0 and --top_p in (0, 1], got {self.top_k} and {self.top_p}")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        funcs = self.reward_funcs or []
        if self.reward_weights is not None and len(self.reward_weights) != len(funcs):
            raise JaxseqError(
                f"--reward_weights gives {len(self.reward_weights)} weights for {len(funcs)} --reward_funcs; "
                "give one per function"
            )


def prompts_per_step(per_device: int, devices: int, accumulate: int, num_generations: int) -> int:
    """Prompts sampled for a step, as TRL's: ``--per_device_train_batch_size`` counts completions, a step trains
    on ``per_device x devices`` (data-parallel) ``x accumulate`` of them (TRL's ``generation_batch_size``, one
    generation per step), whole groups of ``num_generations`` completions of a prompt: that / num_generations
    prompts. Not divisible: a one-line error naming the batch size that would be (TRL's ValueError)."""
    completions = per_device * devices * accumulate
    if completions % num_generations:
        step = num_generations // math.gcd(num_generations, devices * accumulate)
        fit = -(-per_device // step) * step
        raise JaxseqError(
            f"--per_device_train_batch_size {per_device} x {devices} device(s) x --gradient_accumulation_steps "
            f"{accumulate} = {completions} completions a step, which must be divisible by --num_generations "
            f"{num_generations} (whole groups, as TRL's generation_batch_size); use e.g. "
            f"--per_device_train_batch_size {fit}"
        )
    return completions // num_generations


class GRPO(Task):
    """The GRPO loss of a batch of sampled completions: ``input_ids``/``attention_mask`` ``[rows, prompt +
    completion]``, ``completion_mask`` ``[rows, completion]``, ``advantages`` ``[rows]``, and ``old_logps``
    when a batch is reused (``--num_iterations`` > 1; else the ratio is 1 with the gradient of the log-probs).
    With ``beta`` the steps add ``ref_logps`` from the frozen reference (``reference``). ``rollout`` makes
    those batches from batches of prompts, in the Trainer's loop."""

    metric_names = ("loss",)

    def __init__(self, config: GRPOConfig, rollout: Rollout | None = None, lm: CausalLM | None = None):
        self.config, self.rollout_source = config, rollout
        self.lm = CausalLM(AUTO_CHUNK) if lm is None else lm  # how the log-probs' logits are chunked
        self.needs_reference = config.beta != 0.0
        self.samples_in_the_loop = rollout is not None

    def for_batch_shards(self, batch_shards: int, device: jax.Device | None = None) -> GRPO:
        """This loss for batches split over ``batch_shards`` devices: its log-probs' logits in the causal-LM
        loss's chunks for them (``CausalLM.for_batch_shards``)."""
        return GRPO(self.config, self.rollout_source, self.lm.for_batch_shards(batch_shards, device))

    def per_token(self, model, batch):
        return completion_logps(model, batch, self.config.temperature, self.lm)

    def reference(self, model, batch) -> dict[str, jax.Array]:
        return {"ref_logps": self.per_token(model, batch)[0]}

    def loss_weight(self, batch) -> jax.Array:
        """A micro-batch's share of an accumulated step: its completion tokens for ``dapo`` (one mean over the
        step's tokens, TRL's ``num_items_in_batch``), else 1 (TRL averages the micro-batches' losses)."""
        if self.config.loss_type == "dapo":
            return batch["completion_mask"].astype(jnp.float32).sum()
        return jnp.float32(1.0)

    def loss_and_metrics(self, model, batch, rngs=None):
        c = self.config
        logps, entropy = self.per_token(model, batch)
        old = batch.get("old_logps")
        mask = batch["completion_mask"]
        loss, figures = grpo_loss(
            logps,
            jax.lax.stop_gradient(logps) if old is None else old,
            batch.get("ref_logps"),
            batch["advantages"],
            mask,
            loss_type=c.loss_type,
            epsilon_low=c.epsilon,
            epsilon_high=c.epsilon_high,
            beta=c.beta,
            max_completion_length=c.max_completion_length,
            bias_correction_kl=c.use_bias_correction_kl,
        )
        m = mask.astype(jnp.float32)
        figures["entropy"] = jax.lax.stop_gradient((entropy * m).sum() / jnp.maximum(m.sum(), 1.0))
        return loss, figures

    def loss(self, model, batch, rngs=None):
        return self.loss_and_metrics(model, batch, rngs)[0]

    def predict(self, model, batch):
        raise JaxseqError("GRPO has no evaluation set; its figures are logged every step")

    def metrics(self, outputs):
        return {}

    def rollout(self, policy: Policy, batch, step: int):
        """The batch step ``step`` trains on, from a batch of prompts."""
        return self.rollout_source(policy, batch, step, lm=self.lm)


RewardFunc = Callable[..., Sequence[float | None]]


class Rollout:
    """Sample ``num_generations`` completions of each prompt of a batch from the current weights, score them with
    the reward functions and make GRPO's training batch; a batch serves ``num_iterations`` steps. ``records``:
    each row's prompt as the data gave it (string or conversation) and its other columns, by ``prompt_index``;
    ``prompts``: the prompt rows (``input_ids``, ``attention_mask``, ``prompt_index``) each step draws from."""

    def __init__(
        self,
        config: GRPOConfig,
        tokenizer,
        records: Sequence[dict],
        funcs: Sequence[tuple[str, RewardFunc]],
        *,
        seed: int = 0,
        eos_token_ids: Sequence[int] = (),
        prompts: Mapping[str, np.ndarray] | None = None,
    ):
        self.config, self.tokenizer, self.records, self.funcs, self.seed = config, tokenizer, records, funcs, seed
        self.prompts = prompts
        self.weights = np.asarray(config.reward_weights or [1.0] * len(funcs), np.float32)
        self.eos = [int(e) for e in eos_token_ids] or [tokenizer.eos_token_id]
        pad = tokenizer.pad_token_id
        self.pad = int(pad if pad is not None else self.eos[0])
        self._logps = None
        self._cached: tuple[int, dict, dict] | None = None

    def __call__(self, policy: Policy, batch, step: int, lm: CausalLM | None = None):
        """The batch of step ``step``: the run's global batch counts completions (TRL's), and ``batch``, the
        feeder's completion slots, only paces the run; the step's prompts are drawn here (``step_prompts``).

        Several processes: every process draws the same prompts and calls the sampler with all of them, one
        program over the whole mesh in which each device samples only its own rows (the draws are keyed by the
        seed, the step and each row's place in the step's batch, so they do not depend on how many processes
        share the mesh); the completions' tokens are gathered (a few integers a row), each process scores the
        completions it trains on (``mine``), the rewards are gathered so that every group is normalised whole
        wherever its rows were scored, and each process places its own rows (``policy.local``). ``lm``: the
        chunks of the old log-probs' logits (``completion_logps``)."""
        c = self.config
        sampled = step // c.num_iterations  # steps μk .. μk+μ-1 train on the completions of prompt batch k
        if self._cached is not None and self._cached[0] == sampled:
            return self._cached[1], self._cached[2]  # a reused batch, logged again as TRL averages it in
        accumulate = policy.accumulate
        count = prompts_per_step(policy.per_device_batch, policy.replicas, accumulate, c.num_generations)
        micro = count * c.num_generations // accumulate
        mine = np.concatenate([np.arange(a * micro, (a + 1) * micro)[policy.local] for a in range(accumulate)])
        model = policy.model()  # QLoRA: the quantised base with its adapters, dequantised inside the sampler
        rows, figures = self.sample(
            model, self.step_prompts(sampled, count), seed=self.seed * 1_000_003 + sampled, mine=mine
        )
        rows = {k: v[mine] for k, v in rows.items()}
        if accumulate > 1:
            rows = {k: v.reshape(accumulate, -1, *v.shape[1:]) for k, v in rows.items()}
        device = policy.place(rows, stacked=accumulate > 1)
        if c.num_iterations > 1:  # the old policy's log-probs, before this batch's first update
            device["old_logps"] = self.old_logps(model, device, stacked=accumulate > 1, lm=lm)
        self._cached = (sampled, device, figures)
        return device, figures

    def old_logps(self, model, batch: Mapping[str, jax.Array], *, stacked: bool, lm: CausalLM | None = None):
        """The completion tokens' log-probs of the placed ``batch`` (``[micro-batches, rows, tokens]`` when
        ``stacked``, each micro-batch in turn) under ``model``, laid out as the batch's ``completion_mask``."""
        if self._logps is None:
            temperature = self.config.temperature
            one = lambda m, b: completion_logps(m, b, temperature, lm)[0]
            each = (lambda m, b: jax.lax.map(lambda x: one(m, x), b)) if stacked else one
            layout = getattr(batch["completion_mask"], "sharding", None)
            self._logps = jax.jit(each, out_shardings=layout if isinstance(layout, NamedSharding) else None)
        names = ("input_ids", "attention_mask", "completion_mask")
        return self._logps(model, {k: batch[k] for k in names})

    def step_prompts(self, sampled: int, count: int) -> dict[str, np.ndarray]:
        """The ``count`` prompt rows of prompt batch ``sampled``: an order that is a function of the seed and the
        batch's index alone, each prompt once an epoch (as the feeder's batches)."""
        index = next(train_indices(len(self.prompts["input_ids"]), count, self.seed, sampled))
        return {name: rows[index] for name, rows in self.prompts.items()}

    def sample(self, model, prompts: Mapping[str, np.ndarray], *, seed: int, mine: np.ndarray | None = None):
        """(GRPO's rows, TRL's rollout figures) for host prompt rows ``input_ids``/``attention_mask`` (left-padded)
        and ``prompt_index``, sampled from ``model``: every completion's row, the same on every process.
        ``mine``: the completions this process scores with the reward functions (``rewards``; None: all)."""
        c, g = self.config, self.config.num_generations
        out = generate(  # each prompt prefilled once for its num_generations completions
            model,
            prompts["input_ids"],
            prompts["attention_mask"],
            max_new_tokens=c.max_completion_length,
            do_sample=True,
            num_return_sequences=g,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            seed=seed,
        )
        completion = gather(out.sequences)  # with several processes: every process's rows
        ids = np.repeat(prompts["input_ids"], g, axis=0)
        mask = np.repeat(prompts["attention_mask"], g, axis=0)
        is_eos = np.isin(completion, self.eos)
        ended = is_eos.any(axis=1)
        length = np.where(ended, is_eos.argmax(axis=1) + 1, completion.shape[1])
        completion_mask = (np.arange(completion.shape[1])[None] < length[:, None]).astype(np.int32)
        records = [self.records[i] for i in np.repeat(prompts["prompt_index"], g)]
        rewards = self.rewards(records, [row[:n].tolist() for row, n in zip(completion, length)], mine)
        total = np.nansum(rewards * self.weights, axis=1)
        total[np.isnan(rewards).all(axis=1)] = np.nan
        advantages, zero_std = group_advantages(total, g, c.scale_rewards)
        if c.mask_truncated_completions:
            completion_mask = completion_mask * ended[:, None].astype(np.int32)
        rows = {
            "input_ids": np.concatenate([ids, completion], axis=1).astype(np.int32),
            "attention_mask": np.concatenate([mask, completion_mask], axis=1).astype(np.int32),
            "completion_mask": completion_mask,
            "advantages": advantages,
        }
        terminated = length[ended]
        figures = {
            "reward": np.nanmean(total),
            "reward_std": np.nanstd(total, ddof=1),
            "frac_reward_zero_std": zero_std.mean(),
            "completions/mean_length": length.mean(),
            "completions/min_length": length.min(),
            "completions/max_length": length.max(),
            "completions/clipped_ratio": 1.0 - ended.mean(),
            "completions/mean_terminated_length": terminated.mean() if terminated.size else 0.0,
            "completions/min_terminated_length": terminated.min() if terminated.size else 0.0,
            "completions/max_terminated_length": terminated.max() if terminated.size else 0.0,
        }
        for (name, _), column in zip(self.funcs, rewards.T):
            figures[f"rewards/{name}/mean"] = np.nanmean(column)
            figures[f"rewards/{name}/std"] = np.nanstd(column, ddof=1)
        return rows, {k: np.float32(v) for k, v in figures.items()}

    def rewards(
        self, records: Sequence[dict], completion_ids: list[list[int]], mine: np.ndarray | None = None
    ) -> np.ndarray:
        """``[completions, functions]``: each function called as TRL's ``_calculate_rewards`` calls it (None: NaN);
        a ``RewardModel`` is called the same way and scores as TRL scores with a reward model.

        ``mine``: with several processes, the completions this process scores with the reward functions, as
        TRL's processes each score their own; the processes' scores are then gathered (TRL's ``gather``), so
        every process holds every completion's. A reward model scores every completion on every process: it is
        one program over the whole mesh, which each device runs on its own rows, so every process must call it
        with the same texts."""
        shared = mine is None or jax.process_count() == 1
        mine = np.arange(len(records)) if shared else np.asarray(mine)
        out = np.full((len(records), len(self.funcs)), np.nan, np.float32)
        local = [j for j, (_, func) in enumerate(self.funcs) if not isinstance(func, RewardModel)]
        for j, (name, func) in enumerate(self.funcs):
            rows = mine if j in local else np.arange(len(records))
            out[rows, j] = self._score(name, func, [records[i] for i in rows], [completion_ids[i] for i in rows])
        if not shared and local:  # every process's scores of its own completions, gathered
            scores = np.asarray(multihost_utils.process_allgather(out[mine][:, local]))
            where = np.asarray(multihost_utils.process_allgather(mine.astype(np.int32)))
            out[where.reshape(-1)[:, None], np.asarray(local)[None]] = scores.reshape(-1, len(local))
        return out

    def _score(self, name: str, func: RewardFunc, records: Sequence[dict], completion_ids: list[list[int]]):
        """One function's rewards of ``records``' completions, called as TRL calls it (None: NaN)."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [r["prompt"] for r in records]
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {
            k: [r[k] for r in records] for k in records[0] if k not in ("prompt", "completion", "completion_ids")
        }
        values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        if len(values) != len(records):
            raise JaxseqError(
                f"reward function {name} returned {len(values)} rewards for {len(records)} completions; "
                "return one per completion"
            )
        return [np.nan if v is None else float(v) for v in values]


class RewardModel:
    """A reward model, a sequence classifier with one label (what ``jaxseq reward`` writes), scoring completions
    as TRL 1.16's ``GRPOTrainer._calculate_rewards`` scores with one: the texts are prompt + completion
    (conversations: the messages of both through the reward tokenizer's chat template, no generation prompt, no
    tools), tokenised without special tokens and right-padded with its pad token, and a completion's reward is
    ``logits[:, 0]`` at the last token that is not padding (transformers' rule, ``config.pad_token_id`` the
    tokenizer's). Called as a reward function is (``prompts``, ``completions``; the rest ignored).

    ``model``: the classifier, on the run's mesh (its batch is split over the data-parallel axes); ``tokenizer``
    its own, with a pad token. One jitted program scores ``rows`` texts of ``width`` tokens at a time
    (``size``: the rows of a step's micro-batch and the longest prompt's tokens + the completion's budget), the
    texts of a call in slices of ``rows``; a text longer than ``width`` widens it (a second program, said)."""

    def __init__(self, model, tokenizer, name: str, *, rows: int | None = None, width: int | None = None):
        if tokenizer.pad_token_id is None:
            raise JaxseqError(f"reward model {name}: its tokenizer has no pad token")
        self.tokenizer, self.name = tokenizer, name
        self.limit = position_limit(model.config)
        graphdef, self.state = nnx.split(model)
        mesh = parameter_mesh(self.state)
        self.sharding = None if mesh is None else batch_sharding(mesh)
        self.replicas = 1 if mesh is None else data_parallel_size(mesh)
        self.rows, self.width = None, width
        if rows is not None:
            self.size(rows)
        self.program = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask)[:, 0])

    def size(self, rows: int, prompts: Sequence | None = None, max_completion_length: int = 0) -> None:
        """Fix the scoring program's shape: ``rows`` texts at a time (rounded up to the data-parallel devices);
        the width from ``prompts`` (each rendered with an empty completion) + ``max_completion_length``."""
        self.rows = -(-rows // self.replicas) * self.replicas
        if prompts:
            empty = lambda p: [{"role": "assistant", "content": ""}] if isinstance(p, list) else ""
            longest = max(map(len, self.encode([self.texts([p], [empty(p)])[0] for p in prompts])))
            self.width = self._fit(longest + max_completion_length)

    def _fit(self, tokens: int) -> int:
        """A width for ``tokens``: a multiple of 8 at most the model's positions."""
        width = -(-tokens // 8) * 8
        return width if self.limit is None else min(width, self.limit)

    def texts(self, prompts: Sequence, completions: Sequence) -> list[str]:
        """TRL's texts: conversations rendered by the chat template, strings concatenated."""
        if prompts and isinstance(prompts[0], list):
            if not getattr(self.tokenizer, "chat_template", None):
                raise JaxseqError(
                    f"reward model {self.name}: its tokenizer has no chat template for conversational prompts; "
                    "save one with its tokenizer (TRL renders prompt + completion with the reward model's own)"
                )
            render = self.tokenizer.apply_chat_template
            return [render(p + c, tools=None, tokenize=False) for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """``[texts]`` float32: each text's score."""
        encoded = self.encode(texts)
        longest = max(map(len, encoded))
        if self.limit is not None and longest > self.limit:
            raise JaxseqError(
                f"reward model {self.name}: a prompt + completion of {longest} tokens exceeds its {self.limit} "
                "positions (it scores whole prompts, as TRL's); lower --max_completion_length or shorten the prompts"
            )
        if self.width is None:
            self.width = self._fit(longest)
        elif longest > self.width:  # rare: re-tokenised completions longer than their budget
            self.width = self._fit(-(-longest // 64) * 64)
            print(f"reward model {self.name}: a text of {longest} tokens widens its scoring to {self.width}")
        rows = self.rows or -(-len(encoded) // self.replicas) * self.replicas
        count = -(-len(encoded) // rows) * rows
        ids = np.full((count, self.width), self.tokenizer.pad_token_id, np.int32)
        mask = np.zeros((count, self.width), np.int32)
        for i in range(count):
            row = encoded[min(i, len(encoded) - 1)]  # the slices' last rows: copies of the last text
            ids[i, : len(row)], mask[i, : len(row)] = row, 1
        out = []
        for start in range(0, count, rows):
            chunk = [a[start : start + rows] for a in (ids, mask)]
            if self.sharding is not None:
                chunk = [jax.device_put(a, self.sharding) for a in chunk]
            out.append(gather(self.program(self.state, *chunk)).astype(np.float32))
        return np.concatenate(out)[: len(encoded)]

    def __call__(self, prompts: Sequence, completions: Sequence, **_) -> list[float]:
        return self.scores(self.texts(prompts, completions)).tolist()
