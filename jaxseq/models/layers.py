"""Small pieces every family uses: activations, initialisers, dense layers (and GPT-2's Conv1D), dropout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseq.errors import JaxseqError

ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise JaxseqError(f"activation {name!r} is not supported; use one of {sorted(ACTIVATIONS)}") from None


def normal(std: float):
    return nnx.initializers.normal(stddev=std)


class Linear(nnx.Linear):
    """``nnx.Linear`` applied to its input flattened to rows, ``[..., in] -> [rows, in] @ [in, out]``: the same
    numbers, but the backward pass's weight gradient becomes a plain ``x^T dy`` product of row-major arrays.
    Given ``[batch, seq, in]`` inputs, XLA's CPU backend instead transposes ``dy`` and runs a slower dot
    (GPT-2 small's training step: about 4% faster flattened, `bench/train_vs_pytorch.py`)."""

    def __call__(self, inputs, out_sharding=None):
        if inputs.ndim <= 2:
            return super().__call__(inputs, out_sharding)
        y = super().__call__(inputs.reshape(-1, inputs.shape[-1]), out_sharding)
        return y.reshape(*inputs.shape[:-1], y.shape[-1])


class Conv1D(Linear):
    """GPT-2's Conv1D: a dense layer whose PyTorch weight is stored (in, out), so it is not transposed
    when converted (an ordinary ``nnx.Linear`` is, since PyTorch's Linear stores (out, in))."""


def dropout(x: jax.Array, rate: float, rngs: nnx.Rngs | None) -> jax.Array:
    """Inverted dropout, active only when the caller passes ``rngs`` (training); ``rngs=None`` is eval."""
    if rngs is None or rate == 0.0:
        return x
    return dropout_with_key(x, rate, rngs.dropout())


def dropout_with_key(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def call_block(block: nnx.Module, remat: bool, *args, **kwargs):
    """``block(*args, **kwargs)``; with ``remat`` the block's activations are recomputed in the backward
    pass instead of kept (memory for one more forward; see ``enable_remat``)."""
    if not remat:
        return block(*args, **kwargs)
    names = tuple(kwargs)

    def run(block, *values):
        return block(*values[: len(args)], **dict(zip(names, values[len(args) :])))

    return nnx.remat(run)(block, *args, *kwargs.values())


def enable_remat(model: nnx.Module, enabled: bool = True) -> nnx.Module:
    """Turn rematerialisation of every transformer block on (or off) in ``model``, in place."""
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "remat"):
            module.remat = enabled
    return model
