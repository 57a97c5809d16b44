"""How fast training runs: the machine's peak FLOP/s (published, or a matmul measured), and a meter of tokens/s
and model FLOPs utilisation (MFU) that leaves out compilation, evaluation and checkpointing. Model FLOPs are
each family's count (``models.registry.model_flops``, ``Family.model_flops``)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.config import arg
from jaxseq.models.registry import family_for, model_flops, task_of
from jaxseq.plan import CHIPS


@dataclasses.dataclass
class SpeedConfig:
    peak_flops: float = arg(
        0.0,
        "peak FLOP/s of all devices together, for model FLOPs utilisation (MFU) "
        "in the log; 0: the chips' published bf16 peak on TPU and GPU, a jitted matmul measured at start on CPU "
        "(the log then says 'of measured matmul')",
    )


LM_TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")
"""Tasks whose model ends in a projection onto the vocabulary (``jaxseq.models.registry.TASKS``)."""


def matmul_parameters(model: nnx.Module) -> int:
    """Parameters a token meets in matrix products: all but the embedding tables (a lookup costs nothing),
    plus the output projection when it reuses the token embedding (``tie_word_embeddings``), as nanoGPT's
    ``estimate_mfu`` counts them. A model's own ``tied`` (T5: transformers 5 reads v1.1's untied head as
    ``tie_word_embeddings=True, scale_decoder_outputs=False``) says whether it reuses the table. Models without
    a language-model head (classifiers, the base model) meet no vocabulary projection, tied or not.
    Deprecated with ``plan.model_flops_per_step``, which it feeds: ``models.registry.model_flops`` counts a step."""
    config = model.config
    family = family_for(config.model_type)
    count = _dense_parameters(model, family, config.vocab_size)
    has_lm_head = any(type(model) is family.tasks.get(task) for task in LM_TASKS)
    if has_lm_head and getattr(model, "tied", getattr(config, "tie_word_embeddings", False)):
        count += config.vocab_size * config.hidden_size
    return count


def _dense_parameters(module: nnx.Module, family=None, vocab_size: int = 0) -> int:
    """Parameters of ``module`` outside its embedding tables; with its ``family``, an LM head over the padded
    vocabulary (``models.layers.padded_vocab_size``) counts only its ``vocab_size`` real entries."""
    tables = {path for path, m in nnx.iter_modules(module) if isinstance(m, nnx.Embed)}
    count = 0
    for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        if tuple(path[:-1]) in tables:
            continue
        shape = list(v.get_value().shape)
        axis = family.vocab_axis(path) if family is not None else None
        if axis is not None:
            shape[axis] = vocab_size
        count += int(np.prod(shape))
    return count


def seq2seq_model_flops(model: nnx.Module, rows: int, source_len: int, target_len: int) -> float:
    """Training FLOPs of one step of an encoder-decoder on ``rows`` pairs. Deprecated: the family's count,
    ``models.registry.model_flops(config, "seq2seq-lm", rows, source_len, target_len)``."""
    return model_flops(model.config, "seq2seq-lm", rows, source_len, target_len)


def flops_per_token(model: nnx.Module, seq_len: int) -> float:
    """Training FLOPs per token of ``model`` on rows of ``seq_len`` tokens. Deprecated: the family's count of a
    step, ``models.registry.model_flops(config, task, rows, seq_len)``, divided by its ``rows * seq_len``."""
    return model_flops(model.config, task_of(model), 1, seq_len) / seq_len


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
