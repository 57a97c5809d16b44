"""QLoRA's frozen kernels (Dettmers et al. 2023), quantised by qwix: ``nf4`` codes with an absmax scale per
block of 64 inputs of one output (bitsandbytes' ``blocksize=64`` over the torch weight's ``[out, in]`` rows),
or ``int8`` with one scale per output channel (``round(w / s)``, ``s = absmax / 127.5``). Scales are float32.

qwix keeps an nf4 code in a ``uint4`` per element, which jaxseq's byte counts (``itemsize``) and non-TPU
backends take as a byte; the codes are stored two to a ``uint8`` along the input axis instead. They are
dequantised by 16 selects on qwix's NF4 values, elementwise work that fuses into its consumer, where qwix's
``dequantize`` gathers from the table, one lookup per weight (slow on TPUs); the numbers are the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

QUANTIZE = ("none", "int8", "nf4")
BLOCK = 64  # nf4's block of inputs sharing a scale
_QTYPES = {"int8": jnp.int8, "nf4": "nf4"}


def quantize(kernel: jax.Array, kind: str) -> dict[str, jax.Array]:
    """``{"codes", "scales"}`` of a kernel ``[..., in, out]``; leading axes (a stacked kernel's layers) are
    quantised one slice at a time, so only one layer's temporaries are live."""
    if kernel.ndim > 2:
        return jax.lax.map(lambda k: quantize(k, kind), kernel)
    tiles = {0: BLOCK} if kind == "nf4" else {}
    q = qwix.quantize(
        kernel.astype(jnp.float32), _QTYPES[kind], channelwise_axes=(1,), tiled_axes=tiles, scale_dtype=jnp.float32
    )
    codes = q.qvalue
    if kind == "nf4":  # two codes a byte: even inputs in the low nibble, odd in the high
        codes = codes.astype(jnp.uint8)
        codes = codes[0::2] | (codes[1::2] << 4)
    return {"codes": codes, "scales": q.scale}


def dequantize(codes: jax.Array, scales: jax.Array, kind: str, dtype) -> jax.Array:
    """The kernel ``[..., in, out]`` in ``dtype`` from ``quantize``'s codes and scales."""
    if codes.ndim > 2:
        return jax.vmap(lambda c, s: dequantize(c, s, kind, dtype))(codes, scales)
    if kind == "int8":
        return qwix.dequantize(qwix.QArray(codes, scales, qtype=jnp.int8)).astype(dtype)
    codes = jnp.stack([codes & 15, codes >> 4], axis=1)  # [in / 2, 2, out]: the inputs in order
    table = qwix.dequantize(qwix.QArray(jnp.arange(16, dtype=jnp.uint4), jnp.ones(1), qtype="nf4"))
    values = jnp.zeros(codes.shape, jnp.float32)
    for code in range(16):
        values = jnp.where(codes == code, table[code], values)
    blocks = values.reshape(scales.shape[0], BLOCK, -1) * scales[:, None]
    return blocks.reshape(-1, codes.shape[-1]).astype(dtype)


def quantize_onto(kernel, kind: str, kernel_sharding: NamedSharding, shardings: dict) -> dict[str, jax.Array]:
    """``quantize(kernel, kind)`` placed on ``shardings`` (``{"codes", "scales"}``). A kernel on the host (a
    NumPy array, as QLoRA loads them) goes to its devices one layer at a time, each layer quantised there: the
    devices hold one layer of it in full precision at most, never the whole model."""
    if isinstance(kernel, np.ndarray) and kernel.ndim > 2:  # a stacked kernel: its layers one by one
        layer = lambda s: NamedSharding(s.mesh, P(*s.spec[1:]))
        inner = {name: layer(s) for name, s in shardings.items()}
        layers = [quantize_onto(k, kind, layer(kernel_sharding), inner) for k in kernel]
        return {n: jax.jit(_stack, out_shardings=s)(*(q[n] for q in layers)) for n, s in shardings.items()}
    quantized = jax.jit(functools.partial(quantize, kind=kind), out_shardings=shardings)
    return quantized(jax.device_put(kernel, kernel_sharding))


def _stack(*layers):
    return jnp.stack(layers)
