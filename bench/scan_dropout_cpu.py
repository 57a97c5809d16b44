"""Where a scanned stack's dropout masks are drawn, on XLA:CPU: compile time and step time of one forward and
backward pass through 6 attention-like layers (25 rows of 384 tokens, 384 wide, 12 heads; the attention
probabilities and the output dropped at 0.1, Threefry-4x32 keys as jaxseq's CPU programs use):

- ``unrolled``: a Python loop over the layers, each drawing its masks (the unrolled model);
- ``in_loop``: one ``lax.scan`` whose body draws each layer's masks (``Stacked`` off CPU);
- ``ahead``: each site's masks drawn for every layer before the scan, which takes them as inputs
  (``Stacked.draws_ahead``, from ``Execution.draws_ahead``: jaxseq's CPU default since 36341a9, 2026-11-27).

    python bench/scan_dropout_cpu.py            # writes bench/results/scan_dropout_cpu.json
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

LAYERS, ROWS, LENGTH, WIDTH, HEADS, KEEP = 6, 25, 384, 384, 12, 0.9
PROBS, HIDDEN = (ROWS, HEADS, LENGTH, LENGTH), (ROWS, LENGTH, WIDTH)
MODES = ("unrolled", "in_loop", "ahead")
OUT = Path(__file__).resolve().parent / "results" / "scan_dropout_cpu.json"


def layer(h, w, keep_probs, keep_hidden):
    q = (h @ w).reshape(ROWS, LENGTH, HEADS, WIDTH // HEADS).transpose(0, 2, 1, 3)
    probs = jax.nn.softmax(q @ q.transpose(0, 1, 3, 2) / 8.0, axis=-1)
    probs = jnp.where(keep_probs, probs / KEEP, 0)
    out = (probs @ q).transpose(0, 2, 1, 3).reshape(ROWS, LENGTH, WIDTH)
    return jnp.tanh(jnp.where(keep_hidden, (out @ w) / KEEP, 0)) + h


def loss(mode, weights, x, key):
    if mode == "ahead":
        k_probs, k_hidden = jax.random.split(key)
        masks = (
            jax.random.bernoulli(k_probs, KEEP, (LAYERS, *PROBS)),
            jax.random.bernoulli(k_hidden, KEEP, (LAYERS, *HIDDEN)),
        )
        h, _ = lax.scan(lambda h, xs: (layer(h, *xs), None), x, (weights, *masks))
    elif mode == "in_loop":

        def body(h, xs):
            w, k = xs
            k_probs, k_hidden = jax.random.split(k)
            keep = jax.random.bernoulli(k_probs, KEEP, PROBS), jax.random.bernoulli(k_hidden, KEEP, HIDDEN)
            return layer(h, w, *keep), None

        h, _ = lax.scan(body, x, (weights, jax.random.split(key, LAYERS)))
    else:
        h = x
        for w, k in zip(weights, jax.random.split(key, LAYERS)):
            k_probs, k_hidden = jax.random.split(k)
            h = layer(h, w, jax.random.bernoulli(k_probs, KEEP, PROBS), jax.random.bernoulli(k_hidden, KEEP, HIDDEN))
    return (h * h).mean()


def measure(mode: str, steps: int = 3) -> dict:
    weights = jnp.stack([jnp.eye(WIDTH) * 0.5] * LAYERS)
    x, key = jnp.full(HIDDEN, 0.1), jax.random.key(0, impl="threefry4x32")
    start = time.perf_counter()
    step = jax.jit(jax.value_and_grad(lambda w, x, k: loss(mode, w, x, k))).lower(weights, x, key).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(step(weights, x, key))
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(step(weights, x, key))
    return {"compile_s": round(compile_s, 2), "step_s": round((time.perf_counter() - start) / steps, 3)}


def main() -> None:
    rows = {}
    for mode in MODES:
        rows[mode] = measure(mode)
        print(mode, rows[mode], flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {jax.local_devices()[0].device_kind}",
        "jax": jax.__version__,
        "shape": {"layers": LAYERS, "rows": ROWS, "length": LENGTH, "width": WIDTH, "heads": HEADS},
        "rows": rows,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
