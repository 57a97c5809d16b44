"""Optimizer and learning-rate schedule from config, on optax."""

from __future__ import annotations

import dataclasses

import jax
import optax

from jaxseq.config import arg
from jaxseq.errors import JaxseqError


OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd", "muon", "lbfgs")
# Distributed Shampoo is left out: optax-shampoo 0.0.6 (the newest on PyPI) calls jax.tree_map, which
# current JAX removed, and no maintained successor is published.
SCHEDULES = ("linear", "cosine", "constant")


@dataclasses.dataclass
class OptimizerConfig:
    optimizer: str = arg("adamw", "optimizer", choices=OPTIMIZERS)
    learning_rate: float = arg(5e-5, "peak learning rate")
    weight_decay: float = arg(0.0, "decoupled weight decay (matrices only; biases and norms are not decayed)")
    adam_beta1: float = arg(0.9, "beta1 of AdamW / Lion")
    adam_beta2: float = arg(0.999, "beta2 of AdamW / Lion")
    adam_epsilon: float = arg(1e-8, "epsilon of AdamW")
    momentum: float = arg(0.9, "momentum of SGD (0 for none)")
    lr_scheduler_type: str = arg("linear", "decay after warmup", choices=SCHEDULES)
    warmup_steps: int = arg(0, "linear warmup updates (overrides --warmup_ratio)")
    warmup_ratio: float = arg(0.0, "warmup as a fraction of all updates")
    max_grad_norm: float = arg(1.0, "clip gradients to this global norm (0: no clipping)")


def make_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``learning_rate``, then linear decay to 0, cosine decay to 0, or constant."""
    if config.lr_scheduler_type not in SCHEDULES:
        raise JaxseqError(f"unknown lr_scheduler_type {config.lr_scheduler_type!r}; choose {', '.join(SCHEDULES)}")
    warmup = config.warmup_steps or int(round(config.warmup_ratio * total_steps))
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
    """Weight decay on matrices only: biases and norm scales (1-D) are left alone, as transformers does."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def needs_value_fn(config: OptimizerConfig) -> bool:
    """L-BFGS's line search re-evaluates the loss: its update takes ``value``, ``grad`` and ``value_fn``."""
    return config.optimizer.lower() == "lbfgs"


def make_optimizer(config: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer (with global-norm clipping) and its schedule over ``total_steps`` updates."""
    schedule = make_schedule(config, total_steps)
    name = config.optimizer.lower()
    if name == "adamw":
        tx = optax.adamw(schedule, config.adam_beta1, config.adam_beta2, config.adam_epsilon,
                         weight_decay=config.weight_decay, mask=decay_mask)
    elif name == "adafactor":
        tx = optax.adafactor(schedule, weight_decay_rate=config.weight_decay or None, weight_decay_mask=decay_mask)
    elif name == "lion":
        tx = optax.lion(schedule, config.adam_beta1, config.adam_beta2, weight_decay=config.weight_decay,
                        mask=decay_mask)
    elif name == "muon":  # orthogonalised momentum on matrices, AdamW on the rest (optax.contrib)
        tx = optax.contrib.muon(schedule, weight_decay=config.weight_decay, weight_decay_mask=decay_mask,
                                adam_b1=config.adam_beta1, adam_b2=config.adam_beta2)
    elif name == "lbfgs":  # full-batch style: its zoom line search picks the step; the schedule scales it
        tx = optax.lbfgs(learning_rate=None)
    elif name == "sgd":
        tx = optax.chain(optax.add_decayed_weights(config.weight_decay, decay_mask),
                         optax.sgd(schedule, momentum=config.momentum or None))
    else:
        raise JaxseqError(f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if config.max_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), tx)
    return tx, schedule
