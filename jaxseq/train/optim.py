"""Optimizer and learning-rate schedule from config, on optax: per-group learning rates (regexes on
parameter paths, through ``optax.multi_transform``) and an exponential moving average of the parameters."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import optax

from jaxseq.config import arg
from jaxseq.errors import JaxseqError
from jaxseq.sharding import STACKED, path_string

OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd", "muon", "lbfgs")
# Distributed Shampoo is left out: optax-shampoo 0.0.6 (the newest on PyPI) calls jax.tree_map, which
# current JAX removed, and no maintained successor is published.
SCHEDULES = ("linear", "cosine", "constant")
# transformers' --optim names whose update is one of ours (its 8-bit and paged variants are other math)
HF_OPTIMIZERS = {
    **dict.fromkeys(("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused", "adamw_torch_xla"), "adamw"),
    "lion_32bit": "lion",
}
# transformers' --lr_scheduler_type names of our schedules (ours warm up whenever --warmup_steps/ratio ask)
HF_SCHEDULES = {"constant_with_warmup": "constant"}


@dataclasses.dataclass
class OptimizerConfig:
    optimizer: str = arg(
        "adamw",
        "optimizer (--optim: transformers' flag)",
        choices=OPTIMIZERS,
        aliases=("optim",),
        value_aliases=HF_OPTIMIZERS,
    )
    learning_rate: float = arg(5e-5, "peak learning rate")
    weight_decay: float = arg(0.0, "decoupled weight decay (matrices only; biases and norms are not decayed)")
    adam_beta1: float = arg(0.9, "beta1 of AdamW / Lion")
    adam_beta2: float = arg(0.999, "beta2 of AdamW / Lion")
    adam_epsilon: float = arg(1e-8, "epsilon of AdamW")
    momentum: float = arg(0.9, "momentum of SGD (0 for none)")
    lr_scheduler_type: str = arg("linear", "decay after warmup", choices=SCHEDULES, value_aliases=HF_SCHEDULES)
    warmup_steps: int = arg(0, "linear warmup updates (overrides --warmup_ratio)")
    warmup_ratio: float = arg(0.0, "warmup as a fraction of all updates")
    max_grad_norm: float = arg(1.0, "clip gradients to this global norm (0: no clipping)")
    lr_groups: str | None = arg(
        None,
        "learning-rate multipliers by regex on parameter paths, comma-separated "
        "REGEX=FACTOR, first match wins, e.g. 'classifier=10,embeddings=0.1'",
    )
    ema_decay: float = arg(
        0.0,
        "keep an exponential moving average of the parameters, "
        "ema = decay * ema + (1 - decay) * params after every update (0: none)",
    )
    eval_with_ema: bool = arg(
        True,
        "with --ema_decay: evaluate, pick the best checkpoint and export with the "
        "averaged parameters (false: with the trained ones)",
    )

    def __post_init__(self):
        if not 0.0 <= self.ema_decay < 1.0:
            raise JaxseqError(f"--ema_decay must be in [0, 1), got {self.ema_decay}")
        parse_lr_groups(self.lr_groups)  # a bad spec fails before anything loads


def make_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``learning_rate``, then linear decay to 0, cosine decay to 0, or constant."""
    if config.lr_scheduler_type not in SCHEDULES:
        raise JaxseqError(f"unknown lr_scheduler_type {config.lr_scheduler_type!r}; choose {', '.join(SCHEDULES)}")
    warmup = config.warmup_steps or round(config.warmup_ratio * total_steps)
    warmup = min(warmup, total_steps)
    lr = config.learning_rate
    decay_steps = max(total_steps - warmup, 1)
    after = {
        "linear": optax.linear_schedule(lr, 0.0, decay_steps),
        "cosine": optax.cosine_decay_schedule(lr, decay_steps),
        "constant": optax.constant_schedule(lr),
    }[config.lr_scheduler_type]
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def decay_mask(params):
    """Weight decay on matrices only: biases and norm scales (1-D; stacked by a scanned stack, 2-D with their
    leading layer axis, ``STACKED``) are left alone, as transformers does."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim - (STACKED in path_string(path).split("/")) >= 2, params
    )


def needs_value_fn(config: OptimizerConfig) -> bool:
    """L-BFGS's line search re-evaluates the loss: its update takes ``value``, ``grad`` and ``value_fn``."""
    return config.optimizer.lower() == "lbfgs"


def parse_lr_groups(text: str | None) -> list[tuple[str, float]]:
    """``"classifier=10,pooler=2"`` -> ``[("classifier", 10.0), ("pooler", 2.0)]`` (regexes checked)."""
    groups = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        pattern, _, factor = (part.strip() for part in item.rpartition("="))
        try:
            value = float(factor)
            re.compile(pattern)
        except (ValueError, re.error):
            value = None
        if not pattern or value is None or value < 0:
            raise JaxseqError(
                f"bad --lr_groups entry {item!r}: write REGEX=FACTOR pairs (factor >= 0), "
                "comma-separated, e.g. 'classifier=10,embeddings=0.1'"
            )
        groups.append((pattern, value))
    return groups


def lr_group_labels(groups: list[tuple[str, float]], params):
    """Each parameter's group: the index of the first regex its path matches, or ``"rest"``. A regex that
    matches nothing is an error (a typo would otherwise silently train at the base rate)."""
    compiled = [re.compile(pattern) for pattern, _ in groups]
    used = set()

    def label(path, _):
        name = path_string(path)
        index = next((i for i, pattern in enumerate(compiled) if pattern.search(name)), None)
        used.add(index)
        return "rest" if index is None else str(index)

    labels = jax.tree_util.tree_map_with_path(label, params)
    unused = [groups[i][0] for i in range(len(groups)) if i not in used]
    if unused:
        raise JaxseqError(
            f"--lr_groups regex(es) {', '.join(map(repr, unused))} match no trained parameter path "
            "(paths look like bert/encoder/layer/0/attention/self/query/kernel)"
        )
    return labels


def ema_update(ema, params, decay: float):
    """One step of the exponential moving average: ``decay * ema + (1 - decay) * params``."""
    return jax.tree.map(lambda e, p: (decay * e + (1.0 - decay) * p).astype(e.dtype), ema, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale the gradients by ``min(1, max_norm / (global norm + 1e-6))``, torch.nn.utils.clip_grad_norm_'s rule.
    A product, unlike optax.clip_by_global_norm's division: XLA duplicates it into each of AdamW's fused loops
    instead of writing the clipped gradients out first (MiniLM's AdamW step on CPU: 28 ms instead of 49)."""

    def update(updates, state, params=None):
        del params
        coefficient = jnp.minimum(1.0, max_norm / (optax.tree.norm(updates) + 1e-6))
        return jax.tree.map(lambda g: g * coefficient.astype(g.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(config: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer (with global-norm clipping) and its schedule over ``total_steps`` updates. With
    ``lr_groups``, each group runs the same optimizer on the schedule times its factor (``multi_transform``;
    the clipping stays global)."""
    schedule = make_schedule(config, total_steps)
    groups = parse_lr_groups(config.lr_groups)
    if groups and needs_value_fn(config):
        raise JaxseqError("--lr_groups needs an optimizer with a learning rate; --optimizer lbfgs picks its own steps")
    if groups:
        transforms = {"rest": _optimizer(config, schedule)}
        for i, (_, factor) in enumerate(groups):
            transforms[str(i)] = _optimizer(config, lambda step, f=factor: f * schedule(step))
        tx = optax.multi_transform(transforms, lambda params: lr_group_labels(groups, params))
    else:
        tx = _optimizer(config, schedule)
    if config.max_grad_norm:
        tx = optax.chain(clip_by_global_norm(config.max_grad_norm), tx)
    return tx, schedule


def _optimizer(config: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    name = config.optimizer.lower()
    if name == "adamw":
        tx = optax.adamw(
            schedule,
            config.adam_beta1,
            config.adam_beta2,
            config.adam_epsilon,
            weight_decay=config.weight_decay,
            mask=decay_mask,
        )
    elif name == "adafactor":
        tx = optax.adafactor(schedule, weight_decay_rate=config.weight_decay or None, weight_decay_mask=decay_mask)
    elif name == "lion":
        tx = optax.lion(
            schedule, config.adam_beta1, config.adam_beta2, weight_decay=config.weight_decay, mask=decay_mask
        )
    elif name == "muon":  # orthogonalised momentum on matrices, AdamW on the rest (optax.contrib)
        tx = optax.contrib.muon(
            schedule,
            weight_decay=config.weight_decay,
            weight_decay_mask=decay_mask,
            adam_b1=config.adam_beta1,
            adam_b2=config.adam_beta2,
        )
    elif name == "lbfgs":  # full-batch style: its zoom line search picks the step; the schedule scales it
        tx = optax.lbfgs(learning_rate=None)
    elif name == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(config.weight_decay, decay_mask),
            optax.sgd(schedule, momentum=config.momentum or None),
        )
    else:
        raise JaxseqError(f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    return tx
