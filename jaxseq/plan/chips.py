"""Cloud TPU chips and slices: published figures per chip (peak bf16 FLOP/s, HBM, bandwidths) and a slice's
abstract devices from libtpu, to compile for a topology this machine does not have."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re

from jaxseq.errors import JaxseqError, first_line

GiB = 2**30

# Chips. Published figures per chip: peak bf16 FLOP/s, HBM capacity and bandwidth, bidirectional ICI bandwidth.
#   v3:  https://cloud.google.com/tpu/docs/v3   (123 TFLOP/s, 32 GiB, 900 GB/s)
#   v4:  https://cloud.google.com/tpu/docs/v4   (275 TFLOP/s, 32 GiB, 1200 GB/s)
#   v5e: https://cloud.google.com/tpu/docs/v5e  (197 TFLOP/s, 16 GiB, 819 GB/s, ICI 400 GB/s bidirectional)
#   v5p: https://cloud.google.com/tpu/docs/v5p  (459 TFLOP/s, 95 GiB, 2765 GB/s, ICI 1200 GB/s bidirectional)
#   v6e: https://cloud.google.com/tpu/docs/v6e  (918 TFLOP/s, 32 GiB, 1640 GB/s, ICI 800 GB/s bidirectional)
# Cloud's pages give no per-chip ICI for v3 and v4; those are links x bidirectional GB/s per link from
#   https://jax-ml.github.io/scaling-book/tpus/ (v3: 4 x 200 GB/s, v4: 6 x 90 GB/s).
# usable_hbm: what libtpu 0.0.42 lets one program use per device ("exceeds available HBM (15.75G)"), measured by
# compiling an over-budget program for each generation; on v3 a device is one of the chip's two TensorCores.
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation. Rates are per chip; ``usable_hbm`` is per JAX device (a v3 chip is two devices)."""

    generation: str
    peak_flops: float  # bf16 FLOP/s
    hbm: int  # bytes, published
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, both directions, all links
    usable_hbm: int  # bytes per device a program may use
    devices_per_chip: int  # 2 on v3 (TensorCores), 1 where JAX sees a chip (v5e, v6e, megacore v4/v5p)


CHIPS = {
    "v3": Chip("v3", 123e12, 32 * GiB, 900e9, 800e9, int(15.48 * GiB), 2),
    "v4": Chip("v4", 275e12, 32 * GiB, 1200e9, 540e9, int(30.75 * GiB), 1),
    "v5e": Chip("v5e", 197e12, 16 * GiB, 819e9, 400e9, int(15.75 * GiB), 1),
    "v5p": Chip("v5p", 459e12, 95 * GiB, 2765e9, 1200e9, int(95.74 * GiB), 1),
    "v6e": Chip("v6e", 918e12, 32 * GiB, 1640e9, 800e9, int(31.25 * GiB), 1),
}


@dataclasses.dataclass(frozen=True)
class _Slices:
    """How Cloud TPU names a generation's slices: ``counts`` chips or TensorCores (2 per chip), sizes from
    ``smallest`` to ``largest`` in that unit (powers of two), on a torus of rank ``dims``."""

    counts: str
    dims: int
    smallest: int
    largest: int
    example: str  # libtpu topology of the smallest multi-chip slice
    options: tuple = ()  # get_topology_desc options: megacore makes a v4 chip one device, as on a real v4-8

    @property
    def per_chip(self) -> int:
        return 2 if self.counts == "TensorCores" else 1


_SLICES = {
    "v3": _Slices("TensorCores", 2, 8, 2048, "v3:2x2"),
    "v4": _Slices("TensorCores", 3, 8, 8192, "v4:2x2x1", (("chip_config_name", "megacore"),)),
    "v5e": _Slices("chips", 2, 1, 256, "v5e:2x4"),
    "v5p": _Slices("TensorCores", 3, 8, 8192, "v5p:2x2x1", (("chip_config_name", "megacore"),)),
    "v6e": _Slices("chips", 2, 1, 256, "v6e:2x4"),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v5": "v5p", "v6": "v6e"}
_EXAMPLES = "v5e-8, v5litepod-16, v6e-8, v4-8, v5p-8, v3-8 or a libtpu topology like v5e:2x4"


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice to compile for: ``accelerator`` as Cloud TPU names it, ``name`` as libtpu does."""

    accelerator: str  # "v5e-8"
    name: str  # "v5e:2x4"
    chips: int
    devices: tuple  # abstract devices: jax.jit(...).lower(...).compile() targets them
    chip: Chip

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.chip.usable_hbm


def topology(name: str) -> Topology:
    """``"v5e-8"``, ``"v5litepod-8"``, ``"v4-8"`` (TensorCores: 4 chips), ``"v3-8"`` or a raw ``"v5e:2x4"``."""
    found = re.fullmatch(r"([a-z0-9]+)(?:-(\d+)|:(\d+(?:x\d+){1,2}))", name.strip().lower())
    generation = _ALIASES.get(found.group(1), found.group(1)) if found else None
    if generation not in _SLICES:
        raise JaxseqError(f"unknown TPU topology {name!r}; use an accelerator type such as {_EXAMPLES}")
    slices, count, raw = _SLICES[generation], found.group(2), found.group(3)
    if raw:
        shape = [int(n) for n in raw.split("x")]
        if len(shape) != slices.dims or 0 in shape:
            raise JaxseqError(f"topology {name!r}: {generation} slices are {slices.dims}-D, like {slices.example}")
        chips = math.prod(shape)
    else:
        count = int(count)
        chips = count // slices.per_chip
        shape = _slice_shape(chips, slices.dims)
        if shape is None or count % slices.per_chip or chips == 2 or not slices.smallest <= count <= slices.largest:
            raise JaxseqError(
                f"no {generation} slice of {count} {slices.counts} here: use a power of two from "
                f"{generation}-{slices.smallest} to {generation}-{slices.largest}, or a libtpu topology like "
                f"{slices.example}"
            )
    libtpu_name = f"{generation}:{'x'.join(map(str, shape))}"
    devices = _abstract_devices(libtpu_name, shape, dict(slices.options))
    chip = CHIPS[generation]
    if len(devices) != chips * chip.devices_per_chip:
        raise JaxseqError(f"libtpu made {len(devices)} devices for {libtpu_name}, not {chips} chips' worth")
    return Topology(f"{generation}-{chips * slices.per_chip}", libtpu_name, chips, tuple(devices), chip)


def _slice_shape(chips: int, dims: int) -> list[int] | None:
    """Cloud TPU's shape of a power-of-two slice: 2-D 8 -> 2x4, 16 -> 4x4; 3-D from 2x2x1 (16 -> 2x2x4)."""
    shape = [1] * dims if dims == 2 else [2, 2, 1]
    if chips < math.prod(shape) or chips & (chips - 1):
        return None
    while math.prod(shape) < chips:
        smallest = min(shape)
        shape[max(i for i, n in enumerate(shape) if n == smallest)] *= 2
    return shape


LIBTPU_ENVIRONMENT = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-8",
    "TPU_WORKER_HOSTNAMES": "localhost",
}
"""What libtpu is given while it makes a topology, where the environment does not say: compile-only use, so a
training job holding this machine's TPU must not block planning; on a machine without a TPU, naming one keeps
libtpu's start-up from printing warnings about the TPU it cannot find."""


def _abstract_devices(libtpu_name: str, shape: list[int], options: dict) -> list:
    """The compile-only devices of libtpu's topology ``libtpu_name``, ``LIBTPU_ENVIRONMENT`` set only meanwhile."""
    if importlib.util.find_spec("libtpu") is None:
        raise JaxseqError("compiling for a TPU topology needs libtpu: pip install 'jaxseq[tpu]'")
    from jax.experimental import topologies

    if math.prod(shape) < 4:  # smaller than libtpu's default host of 2x2x1 chips
        options = {**options, "chips_per_host_bounds": (*shape, 1)[:3]}
    added = [name for name in LIBTPU_ENVIRONMENT if name not in os.environ]
    os.environ.update({name: LIBTPU_ENVIRONMENT[name] for name in added})
    try:  # libtpu reads them as it loads and starts, here; the user's process and its children never see them
        return list(topologies.get_topology_desc(topology_name=libtpu_name, platform="tpu", **options).devices)
    except Exception as error:  # libtpu's own message (e.g. a shape it does not support), as one line
        raise JaxseqError(f"libtpu cannot make topology {libtpu_name}: {first_line(error)}") from error
    finally:
        for name in added:
            os.environ.pop(name, None)
