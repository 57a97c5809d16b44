"""How fast training runs: the machine's peak FLOP/s (published, or a matmul measured), and a meter of tokens/s
and model FLOPs utilisation (MFU) that leaves out compilation, evaluation and checkpointing. Model FLOPs are
each family's count (``models.registry.model_flops``, ``Family.model_flops``)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.config import arg
from jaxseq.plan import CHIPS


@dataclasses.dataclass
class SpeedConfig:
    peak_flops: float = arg(
        0.0,
        "peak FLOP/s of all devices together, for model FLOPs utilisation (MFU) "
        "in the log; 0: the chips' published bf16 peak on TPU and GPU, a jitted matmul measured at start on CPU "
        "(the log then says 'of measured matmul')",
    )


# Published dense bf16 peaks of one JAX device, by ``device_kind`` (TPU figures from ``jaxseq.plan.CHIPS``;
# NVIDIA's H100/H200 SXM datasheets give 989 TFLOP/s dense bf16, A100 312).
_TPU_KINDS = {
    "TPU v3": "v3",
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5p": "v5p",
    "TPU v5": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
}
_GPU_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def published_peak_flops(devices) -> float | None:
    """The chips' published bf16 peak FLOP/s, all ``devices`` together, or None where jaxseq knows none (CPU)."""
    total = 0.0
    for device in devices:
        kind = getattr(device, "device_kind", "")
        if kind in _TPU_KINDS:
            chip = CHIPS[_TPU_KINDS[kind]]
            total += chip.peak_flops / chip.devices_per_chip
        elif (gpu := next((p for name, p in _GPU_PEAKS.items() if name in kind), None)) is not None:
            total += gpu
        else:
            return None
    return total


def peak_flops(devices, dtype, given: float = 0.0) -> tuple[float, str]:
    """What MFU is measured against, and a label saying which: ``given`` (--peak_flops), else the chips'
    published bf16 peak (TPU, GPU), else a jitted matmul measured here (CPU: "of measured matmul") on all of
    ``devices`` (any iterable, such as a mesh's ``devices.flat``: it is read once)."""
    devices = list(devices)
    if given:
        return given, "given --peak_flops"
    published = published_peak_flops(devices)
    if published:
        return published, "published bf16 peak"
    return measure_peak_flops(devices, dtype), "measured matmul"


def measure_peak_flops(devices=None, dtype=jnp.float32, size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of ``devices`` (default: all) together, each multiplying two ``size`` x ``size`` matrices of
    ``dtype`` at once: the best of ``repeats`` timed runs after a warm-up (about a second on a laptop CPU)."""
    devices = list(jax.devices() if devices is None else devices)
    sharding = NamedSharding(Mesh(np.asarray(devices), ("d",)), P("d"))
    shape = (len(devices), size, size)
    make = jax.jit(lambda key: jax.random.normal(key, shape, dtype), out_shardings=sharding)
    a, b = make(jax.random.key(0)), make(jax.random.key(1))
    matmul = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), out_shardings=sharding)
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 * len(devices) / best


class Throughput:
    """Examples, tokens and model FLOPs per second over the steps since the last report, and over the run.

    The caller marks the clock at points where the device is idle (after a host sync): ``start`` after the
    compiling first step, ``pause``/``resume`` around evaluation and checkpoints, ``report`` at each log
    (which restarts the window). ``tokens_per_example``/``flops_per_example``/``peak_flops`` are optional;
    only what they allow is reported."""

    def __init__(
        self,
        examples_per_step: int,
        tokens_per_example: int | None = None,
        flops_per_example: float | None = None,
        peak_flops: float | None = None,
    ):
        self.examples_per_step = examples_per_step
        self.tokens_per_example, self.flops_per_example = tokens_per_example, flops_per_example
        self.peak_flops = peak_flops
        self.enabled = bool(tokens_per_example or flops_per_example)
        self._since: tuple[int, float] | None = None  # (step, time) the clock runs from, None when stopped
        self._window = [0, 0.0]  # steps and seconds since the last report
        self._total = [0, 0.0]

    def start(self, step: int) -> None:
        self._since = (step, time.perf_counter())

    def pause(self, step: int) -> None:
        if self._since is not None:
            first, since = self._since
            for acc in (self._window, self._total):
                acc[0] += step - first
                acc[1] += time.perf_counter() - since
            self._since = None

    resume = start

    def report(self, step: int) -> dict[str, float]:
        """Rates since the last report (restarting the window), keyed like ``tokens_per_second``."""
        self.pause(step)
        steps, seconds = self._window
        self._window = [0, 0.0]
        self.start(step)
        return self._rates(steps, seconds)

    def summary(self) -> dict[str, float]:
        """Rates over every step timed so far."""
        return self._rates(*self._total)

    def _rates(self, steps: int, seconds: float) -> dict[str, float]:
        if not self.enabled or steps == 0 or seconds <= 0:
            return {}
        examples = steps * self.examples_per_step / seconds
        rates = {}
        if self.tokens_per_example:
            rates["tokens_per_second"] = examples * self.tokens_per_example
        if self.flops_per_example:
            rates["model_flops_per_second"] = examples * self.flops_per_example
            if self.peak_flops:
                rates["mfu"] = rates["model_flops_per_second"] / self.peak_flops
        return rates
