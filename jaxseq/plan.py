"""Ahead-of-time plans: compile a step for a Cloud TPU slice you do not have, and say whether it fits and how fast.

    topo = topology("v5e-8")                                  # abstract devices + chip specs
    mesh = make_mesh("fsdp=8", devices=topo.devices)
    lowered = jax.jit(step, in_shardings=..., out_shardings=..., donate_argnums=...).lower(*abstract_args)
    plan = compile_plan(lowered, topo, parameters=p, optimizer_state=o, batch=b, model_flops=flops)
    print(format_table(plan)); write_plan("plan.json", plan)
    if not plan["fits"]: raise JaxseqError(refusal(plan))

Memory comes from the compiler (what libtpu itself checks), the step time from a roofline over the compiled HLO.
Needs libtpu (``pip install 'jaxseq[tpu]'``); nothing runs on a TPU.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxseq.errors import JaxseqError, first_line
from jaxseq.files import atomic_write
from jaxseq.mesh import mesh_sizes

GiB = 2**30

# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# Compiled HLO: FLOPs, HBM traffic and collective traffic per device, with loops counted by their trip counts
# ----------------------------------------------------------------------------------------------------------------

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64}
_BITS |= {"u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_COLLECTIVES = {
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
}
_NO_TRAFFIC = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
}  # fmt: skip


@dataclasses.dataclass
class HloCost:
    """Per-device work in one run of a compiled program, loops unrolled by their trip counts."""

    flops: float = 0.0  # dot and convolution FLOPs (2 x multiply-adds)
    hbm_bytes: float = 0.0  # bytes read and written in HBM by the top-level instructions (fusions, not their insides)
    collective_bytes: float = 0.0  # bytes each device receives in all-gather/reduce-scatter/all-reduce/...
    custom_kernels: int = 0  # Mosaic kernels (Pallas, or XLA:TPU's own online softmax): FLOPs the HLO does not show
    unknown_loops: int = 0  # while loops whose trip count could not be read (counted once)
    attention_kernel: str = "xla"

    def add(self, other: HloCost, times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.hbm_bytes += times * other.hbm_bytes
        self.collective_bytes += times * other.collective_bytes
        self.custom_kernels += other.custom_kernels
        self.unknown_loops += other.unknown_loops


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    args: str  # the text inside the parentheses: operand names, or a constant's value
    attrs: str


def hlo_cost(hlo_text: str, num_devices: int) -> HloCost:
    """Roofline inputs from ``compiled.as_text()`` (optimized HLO of one device's program)."""
    module = _parse_module(hlo_text)
    cost = HloCost(attention_kernel=attention_kernel(hlo_text))
    entry = module.pop("__entry__")
    cost.add(_walk(module, entry, num_devices, seen=set()))
    return cost


def _parse_module(text: str) -> dict:
    """{computation: {instruction name: _Instr}}, ROOT last, plus ``"__entry__"``; an instruction may span lines."""
    text = re.sub(r"/\*.*?\*/", "", text)
    computations: dict[str, dict[str, _Instr]] = {}
    roots: dict[int, _Instr] = {}
    current: dict[str, _Instr] | None = None
    lines: list[str] = []
    entry = None

    def flush():
        if current is not None and lines:
            instr = _parse_instr(" ".join(lines))
            if instr:
                current[instr.name] = instr
                if lines[0].startswith("ROOT"):
                    roots[id(current)] = instr
        lines.clear()

    for line in text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if header and not line.startswith(" "):
            flush()
            current = computations.setdefault(header.group(2), {})
            entry = header.group(2) if header.group(1) else entry
        elif line.rstrip() == "}" and current is not None:
            flush()
            current = None
        elif current is not None:
            if re.match(r"^\s+(ROOT\s+)?%?[\w.\-]+\s*=", line):
                flush()
            lines.append(line.strip())
    for instrs in computations.values():  # the ROOT last, wherever the text put it
        root = roots.get(id(instrs))
        if root is not None:
            instrs[root.name] = instrs.pop(root.name)
    computations["__entry__"] = entry
    return computations


def _parse_instr(line: str) -> _Instr | None:
    match = re.match(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
    if not match:
        return None
    name, rest = match.groups()
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :]
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"\s*([\w\-]+)\(", rest)
    if not op:
        return None
    start = op.end() - 1
    end = _closing(rest, start)
    args = rest[start + 1 : end]
    return _Instr(name, shape, op.group(1), re.findall(r"%([\w.\-]+)", args), args, rest[end + 1 :])


def _closing(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text) - 1


def _arrays(shape: str) -> list[tuple[float, int]]:
    """(bytes, memory space) of each array in a shape; space 0 is HBM, S(1) is VMEM on TPU."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        bits = _BITS.get(dtype, 8 if dtype.startswith("f8") else None)
        if bits is None:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append((math.prod(int(d) for d in dims.split(",") if d) * bits / 8, int(space.group(1)) if space else 0))
    return out


def _bytes(shape: str, hbm_only: bool = False) -> float:
    return sum(b for b, space in _arrays(shape) if space == 0 or not hbm_only)


def _called(instr: _Instr, key: str) -> list[str]:
    found = re.search(rf"\b{key}=\{{([^}}]*)\}}", instr.attrs) or re.search(rf"\b{key}=%?([\w.\-]+)", instr.attrs)
    return re.findall(r"[\w.\-]+", found.group(1).replace("%", " ")) if found else []


def _walk(module: dict, computation: str, num_devices: int, seen: set) -> HloCost:
    """Cost of one execution of a (non-fused) computation: HBM traffic here, FLOPs and collectives below.

    ``seen``: channel ids already counted. An async collective shows up in its start, update and done fusions
    (and may start before the loop that waits for it); each channel is one collective, counted where first met.
    """
    cost = HloCost()
    instrs = module.get(computation, {})
    for instr in instrs.values():
        op = instr.opcode
        if op == "while":
            trips = _trip_count(module, instr, instrs)
            cost.unknown_loops += trips is None
            cost.add(_walk(module, _called(instr, "body")[0], num_devices, seen), trips or 1)
        elif op == "conditional":
            branches = _called(instr, "branch_computations") or [
                *_called(instr, "true_computation"),
                *_called(instr, "false_computation"),
            ]
            costs = [_walk(module, b, num_devices, seen) for b in branches]
            if costs:
                cost.add(max(costs, key=lambda c: (c.flops, c.hbm_bytes + c.collective_bytes)))
        elif op in ("call", "async-start"):
            cost.add(_walk(module, (_called(instr, "to_apply") or _called(instr, "calls"))[0], num_devices, seen))
        else:
            cost.hbm_bytes += _traffic(module, instr, instrs)
            _compute(module, instr, instrs, num_devices, cost, seen)
    return cost


def _compute(module: dict, instr: _Instr, instrs: dict, num_devices: int, cost: HloCost, seen: set) -> None:
    """FLOPs, collectives and kernels of one instruction, looking inside fusions (whose traffic stays on chip)."""
    op = instr.opcode
    if op == "fusion":
        inner = module.get(_called(instr, "calls")[0], {})
        for sub in inner.values():
            _compute(module, sub, inner, num_devices, cost, seen)
    elif op in ("dot", "convolution"):
        cost.flops += _dot_flops(instr, instrs)
    elif op == "custom-call" and 'custom_call_target="tpu_custom_call"' in instr.attrs:
        cost.custom_kernels += 1
    elif op.removesuffix("-start") in _COLLECTIVES and not op.endswith("-done"):
        channel = re.search(r"channel_id=(\d+)", instr.attrs)
        if channel and channel.group(1) in seen:
            return
        if channel:
            seen.add(channel.group(1))
        cost.collective_bytes += _collective_bytes(instr, instrs, num_devices)


def _traffic(module: dict, instr: _Instr, instrs: dict) -> float:
    """HBM bytes an instruction reads and writes (arrays in memory space 0); slices move only the slice."""
    op = instr.opcode
    target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
    if op in _NO_TRAFFIC or op.endswith("-done") or (target and target.group(1) in ("AllocateBuffer", "ConcatBitcast")):
        return 0.0
    operands = [instrs[o].shape for o in instr.operands if o in instrs]
    if op == "copy-start":  # (destination, source, context)
        destination, source = (_elements(instr.shape) + ["", ""])[:2]
        return _bytes(destination, hbm_only=True) + _bytes(source, hbm_only=True)
    if op.endswith("-start") or op in ("dynamic-slice", "slice"):  # async ops: ((operands), result, context)
        result = _elements(instr.shape)[1] if op.endswith("-start") else instr.shape
        size = _bytes(result)
        return sum(min(_bytes(shape, hbm_only=True), size) for shape in operands) + _bytes(result, hbm_only=True)
    if op == "dynamic-update-slice":  # in place: reads the update and writes it into the buffer
        update = operands[1] if len(operands) > 1 else ""
        return _bytes(update, hbm_only=True) + (_bytes(update) if _bytes(instr.shape, hbm_only=True) else 0.0)
    if op == "fusion":
        return _fusion_traffic(module, instr, instrs)
    return sum(_bytes(shape, hbm_only=True) for shape in operands) + _bytes(instr.shape, hbm_only=True)


def _fusion_traffic(module: dict, instr: _Instr, instrs: dict) -> float:
    """A fusion reads its operands and writes its outputs, except: a stacked buffer it only slices (a scan's
    per-layer weights) or updates in place (a scan's stacked outputs) costs the slice; buffers it hands through
    untouched, or that belong to an async collective (its ICI time is counted apart), cost nothing."""
    inner = module.get((_called(instr, "calls") or [""])[0], {})
    root = list(inner.values())[-1] if inner else None
    parameters = {int(i.args): i.name for i in inner.values() if i.opcode == "parameter" and i.args.isdigit()}
    uses: dict[str, list[tuple[_Instr, int]]] = {}
    for sub in inner.values():
        if sub is not root or sub.opcode != "tuple":  # handing a buffer to the output is not a read
            for position, name in enumerate(sub.operands):
                uses.setdefault(name, []).append((sub, position))
    total = 0.0
    for k, name in enumerate(instr.operands):
        full = _bytes(instrs[name].shape, hbm_only=True) if name in instrs else 0.0
        users = [(sub, pos) for sub, pos in uses.get(parameters.get(k, ""), []) if not _collective_part(sub)]
        sliced = all(
            pos == 0 and sub.opcode in ("dynamic-slice", "slice", "dynamic-update-slice") for sub, pos in users
        )
        read = sum(_bytes(sub.shape) for sub, _ in users if sub.opcode != "dynamic-update-slice")
        total += min(full, read) if sliced else full
    results = root.operands if root is not None and root.opcode == "tuple" else [root.name] if root else []
    for j, element in enumerate(_elements(instr.shape)):
        produced = _source(inner, results[j]) if j < len(results) else None
        if produced is not None and (produced.opcode == "parameter" or _collective_part(produced)):
            continue
        in_place = produced is not None and produced.opcode == "dynamic-update-slice" and len(produced.operands) > 1
        written = _bytes(inner[produced.operands[1]].shape) if in_place and produced.operands[1] in inner else None
        hbm = _bytes(element, hbm_only=True)
        total += min(hbm, written) if written is not None else hbm
    return total


def _collective_part(instr: _Instr) -> bool:
    """A collective or the custom call that starts or finishes one asynchronously (XLA:TPU)."""
    target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
    return instr.opcode.removesuffix("-start").removesuffix("-done") in _COLLECTIVES or bool(
        target and target.group(1).startswith("AsyncCollective")
    )


def _elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape (the shape itself when it is not a tuple)."""
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(shape):
        depth += (char in "([{") - (char in ")]}")
        if (char == "," and depth == 1) or (depth == 0 and i > 0):
            elements.append(shape[start:i].strip())
            start = i + 1
        if depth == 0 and i > 0:
            break
    return [e for e in elements if e]


def _dot_flops(instr: _Instr, instrs: dict) -> float:
    """2 x multiply-adds. A convolution counts only the window taps that land on real (undilated, unpadded)
    input: XLA:TPU writes batched matmuls as convolutions whose batch dims are dilated spatial dims."""
    shapes = [_dims(instrs[o].shape) for o in instr.operands[:2] if o in instrs]
    if len(shapes) < 2:
        return 0.0
    out = _dims(instr.shape)
    if instr.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
        dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
        return 2.0 * math.prod(out) * math.prod(shapes[0][d] for d in dims)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
    if not labels:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = dict(re.findall(r"(\w+)=([\d_x-]+)", (re.search(r"window=\{([^}]*)\}", instr.attrs) or [""])[0]))
    macs = math.prod(out) * shapes[1][rhs_labels.index("i")]
    for d in range(sum(c.isdigit() for c in rhs_labels)):
        size, outputs = shapes[0][lhs_labels.index(str(d))], out[out_labels.index(str(d))]
        taps = shapes[1][rhs_labels.index(str(d))]
        stride, lhs_dilate, rhs_dilate = (_window(window, key, d, 1) for key in ("stride", "lhs_dilate", "rhs_dilate"))
        low = int(_window(window, "pad", d, "0_0").split("_")[0])
        position = np.arange(outputs)[:, None] * stride + np.arange(taps)[None, :] * rhs_dilate - low
        valid = (position >= 0) & (position <= (size - 1) * lhs_dilate) & (position % lhs_dilate == 0)
        macs *= int(valid.sum()) / outputs
    return 2.0 * macs


def _window(window: dict, key: str, d: int, default):
    if key not in window:
        return default
    value = window[key].split("x")[d]
    return value if key == "pad" else int(value)


def _dims(shape: str) -> list[int]:
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _collective_bytes(instr: _Instr, instrs: dict, num_devices: int) -> float:
    """Bytes one device receives (ring algorithms): all-gather and reduce-scatter move (n-1)/n of the full
    array, all-reduce twice that, all-to-all (n-1)/n of its buffer, a permute the whole buffer."""
    kind = instr.opcode.removesuffix("-start")
    arrays = [b for b, _ in _arrays(instr.shape)]
    if not arrays:
        return 0.0
    size = max(arrays) if kind == "all-gather" else arrays[0] if instr.opcode.endswith("-start") else sum(arrays)
    if kind in ("collective-permute", "collective-broadcast"):
        return size
    n = _group_size(instr.attrs, num_devices)
    if n <= 1:
        return 0.0
    scattered = any(
        user.opcode == "dynamic-slice" and user.operands[:1] == [instr.name] and _bytes(user.shape) * n == size
        for user in instrs.values()
    )  # XLA:TPU writes a reduce-scatter as all-reduce + dynamic-slice inside one fusion
    if kind == "reduce-scatter":
        return size * (n - 1)
    if kind == "all-reduce" and not scattered:
        return 2 * size * (n - 1) / n
    return size * (n - 1) / n


def _group_size(attrs: str, num_devices: int) -> int:
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes.get(axis, 1)) for axis in re.findall(r"'([^']+)'", mesh.group(2)))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if listed:
        return len(listed.group(1).split(","))
    return num_devices


def _trip_count(module: dict, loop: _Instr, instrs: dict) -> int | None:
    """XLA's ``known_trip_count`` when written, else read off ``i < N`` in the condition and ``i = c`` at entry."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if known:
        return int(known.group(1))
    condition = module.get((_called(loop, "condition") or [""])[0], {})
    root = list(condition.values())[-1] if condition else None
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.attrs)
    left, right = (_source(condition, o) for o in root.operands)
    if left.opcode == "constant" and right.opcode == "get-tuple-element":
        left, right = right, left
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction.group(1) if direction else "", "")
    else:
        direction = direction.group(1) if direction else ""
    limit = _constant(right)
    index = re.search(r"index=(\d+)", left.attrs) if left.opcode == "get-tuple-element" else None
    init_tuple = instrs.get(loop.operands[0]) if loop.operands else None
    if limit is None or index is None or init_tuple is None or init_tuple.opcode != "tuple":
        return None
    k = int(index.group(1))
    start = _constant(_source(instrs, init_tuple.operands[k])) if k < len(init_tuple.operands) else None
    step = _loop_step(module, _called(loop, "body")[0], k)
    if start is None or not step:
        return None
    span = {"LT": limit - start, "LE": limit - start + step, "GT": start - limit, "GE": start - limit - step}
    if direction not in span:
        return None
    return max(0, math.ceil(span[direction] / abs(step)))


def _source(instrs: dict, name: str) -> _Instr:
    """The instruction behind ``name``, looking through copies and bitcasts."""
    instr = instrs.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and instr.operands[:1]:
        if instr.operands[0] not in instrs:
            break
        instr = instrs[instr.operands[0]]
    return instr or _Instr(name, "", "", [], "", "")


def _constant(instr: _Instr) -> int | None:
    return int(instr.args) if instr.opcode == "constant" and re.fullmatch(r"-?\d+", instr.args.strip()) else None


def _loop_step(module: dict, body: str, k: int) -> int | None:
    instrs = module.get(body, {})
    root = list(instrs.values())[-1] if instrs else None
    if root is None or root.opcode != "tuple" or k >= len(root.operands):
        return None
    update = _source(instrs, root.operands[k])
    if update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None
    values = [_constant(_source(instrs, o)) for o in update.operands]
    value = next((v for v in values if v is not None), None)
    return None if value is None else (value if update.opcode == "add" else -value)


def attention_kernel(program_text: str) -> str:
    """``"splash"`` for a Pallas TPU splash/flash attention kernel, ``"cudnn"`` for cuDNN fused attention, else
    ``"xla"``; from compiled HLO (kernel names become instruction names) or lowered StableHLO (``kernel_name``)."""
    if "__cudnn$fmha" in program_text:
        return "cudnn"
    names = re.findall(r'kernel_name = "([^"]+)"', program_text)
    for line in program_text.splitlines():
        if "tpu_custom_call" in line:
            names += re.findall(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
            names += re.findall(r'op_name="([^"]+)"', line)
    return "splash" if any(re.search(r"splash|flash", n, re.IGNORECASE) for n in names) else "xla"


# ----------------------------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------------------------


def with_shardings(shapes, shardings):
    """A pytree of ``ShapeDtypeStruct`` carrying the matching ``shardings`` pytree."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of a pytree of arrays/ShapeDtypeStructs (leaves without a sharding are replicated)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(tuple(leaf.shape)) if sharding is not None else leaf.shape
        total += math.prod(shape) * jax.numpy.dtype(leaf.dtype).itemsize
    return total


_RUNTIME_ERRORS = tuple(
    getattr(jax.errors, n) for n in ("JaxRuntimeError", "XlaRuntimeError") if hasattr(jax.errors, n)
)


def compile_plan(
    lowered,
    topo: Topology,
    *,
    parameters,
    optimizer_state=None,
    batch=None,
    model_flops: float | None = None,
    argument_kinds: dict | None = None,
) -> dict:
    """Compile ``lowered`` (``jax.jit(...).lower(...)`` over ``topo.devices``) and :func:`analyze` it, with
    what a device holds at its memory peak (``peak_buffers``; ``argument_kinds``: the step's argument names,
    jaxseq's train step's by default).

    A program that does not fit in HBM comes back as a plan with ``fits=False`` and the compiler's figures; any
    other compile error propagates.
    """
    start = time.perf_counter()
    argument_kinds = ARGUMENT_KINDS if argument_kinds is None else argument_kinds
    with tempfile.TemporaryDirectory(prefix="jaxseq-plan-") as dump:
        try:
            compiled = lowered.compile(compiler_options=_dump_options(dump))
        except _RUNTIME_ERRORS as error:
            needed = _out_of_memory(str(error))
            if needed is None:
                raise
            roles = _roles(parameters, optimizer_state, batch)
            arguments = sum(roles.values())
            memory = {**roles, "temporaries": max(needed - arguments, 0), "total": needed}
            plan = _plan(topo, _mesh_of(parameters, optimizer_state, batch), memory, model_flops, None)
            plan.update(
                attention_kernel=attention_kernel(lowered.as_text()),
                compile_seconds=time.perf_counter() - start,
                peak_buffers=peak_buffers(dump, argument_kinds=argument_kinds),
            )
            return plan
        plan = analyze(
            compiled,
            topo,
            parameters=parameters,
            optimizer_state=optimizer_state,
            batch=batch,
            model_flops=model_flops,
            compile_seconds=time.perf_counter() - start,
        )
        plan["peak_buffers"] = peak_buffers(dump, compiled.as_text(), argument_kinds)
    return plan


def analyze(
    compiled,
    topo: Topology,
    *,
    parameters,
    optimizer_state=None,
    batch=None,
    model_flops: float | None = None,
    compile_seconds: float | None = None,
) -> dict:
    """The plan of a compiled step. Roles are pytrees of sharded ShapeDtypeStructs (see :func:`with_shardings`).

    Bytes per device: the roles from their shard shapes; ``total`` is the compiler's peak (what libtpu checks
    against the usable HBM; it is below arguments + outputs - aliased + temp, which counts donated buffers
    twice); ``temporaries`` is ``total`` less the arguments (activations, gradients, scratch).
    """
    stats = compiled.memory_analysis()
    roles = _roles(parameters, optimizer_state, batch)
    arguments = sum(roles.values())
    total = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if total <= 0:
        total = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
        total += stats.temp_size_in_bytes
    memory = {**roles, "temporaries": max(total - arguments, 0), "total": total}
    cost = hlo_cost(compiled.as_text(), len(topo.devices))
    plan = _plan(topo, _mesh_of(parameters, optimizer_state, batch), memory, model_flops, cost)
    plan["compile_seconds"] = compile_seconds
    return plan


def _roles(parameters, optimizer_state, batch) -> dict:
    return {
        "parameters": bytes_per_device(parameters),
        "optimizer_state": bytes_per_device(optimizer_state),
        "batch": bytes_per_device(batch),
    }


def _mesh_of(*trees) -> dict:
    for leaf in jax.tree.leaves(trees):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None and hasattr(mesh, "shape"):
            return mesh_sizes(mesh)
    return {}


def _plan(topo: Topology, mesh: dict, memory: dict, model_flops: float | None, cost: HloCost | None) -> dict:
    chip, devices = topo.chip, len(topo.devices)
    plan = {
        "topology": topo.name,
        "accelerator": topo.accelerator,
        "devices": devices,
        "mesh": mesh,
        "hbm_bytes_per_device": topo.hbm_bytes_per_device,
        "bytes_per_device": {k: int(v) for k, v in memory.items()},
        "fits": memory["total"] <= topo.hbm_bytes_per_device,
        "model_flops_per_step": float(model_flops) if model_flops else None,
        "compiled_flops_per_device": None,
        "estimated_step_seconds": None,
        "estimated_mfu": None,
        "estimate_method": "none: the program does not fit, so it was not compiled",
        "attention_kernel": None,
        "compile_seconds": None,
        "jax_version": _version("jax"),
        "libtpu_version": _version("libtpu"),
    }
    if cost is None:
        return plan
    share = chip.devices_per_chip  # a v3 device is half a chip
    flops = max(cost.flops, (model_flops or 0) / devices)
    compute = flops / (chip.peak_flops / share)
    hbm = cost.hbm_bytes / (chip.hbm_bandwidth / share)
    ici = cost.collective_bytes / (chip.ici_bandwidth / 2 / share)  # one direction: what a chip can receive
    step = max(compute, hbm) + ici
    notes = [f"{cost.custom_kernels} custom kernels' FLOPs unseen"] if cost.custom_kernels else []
    notes += [f"{cost.unknown_loops} loops of unknown trip count counted once"] if cost.unknown_loops else []
    plan.update(
        compiled_flops_per_device=cost.flops,
        estimated_step_seconds=step,
        estimated_mfu=(model_flops / (step * topo.chips * chip.peak_flops)) if model_flops and step > 0 else None,
        estimate_method=(
            f"roofline from compiled HLO: max(compute {compute * 1e3:.3g} ms, HBM {hbm * 1e3:.3g} ms)"
            f" + ICI {ici * 1e3:.3g} ms, loops x trip count"
            + (f", FLOPs at least model FLOPs / {devices}" if model_flops else "")
            + (f" ({'; '.join(notes)})" if notes else "")
        ),
        attention_kernel=cost.attention_kernel,
    )
    return plan


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _out_of_memory(message: str) -> int | None:
    """Bytes needed per device from libtpu's RESOURCE_EXHAUSTED message, or None for any other error."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    units = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    for pattern in (
        r"required for HLO temporaries \(([\d.]+)([KMGT]?)",
        r"Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm",
    ):
        found = re.search(pattern, message)
        if found:
            return int(float(found.group(1)) * units[found.group(2)])
    return None


# ----------------------------------------------------------------------------------------------------------------
# Memory at the peak: which buffers the compiler's buffer assignment holds when a device's memory peaks
# ----------------------------------------------------------------------------------------------------------------

PEAK_BUFFERS = 12  # the largest buffers live at the peak that plan.json names
PEAK_SHOWN = 5  # and that the printout shows
# an argument's role from its name in the step's signature (jaxseq's train_step(state, frozen, batch))
ARGUMENT_KINDS = {
    "state.params": "parameters",
    "state.opt_state": "optimizer state",
    "state.ema": "EMA weights",
    "frozen": "frozen weights",
    "batch": "batch",
    "state": "training state",
}


def _dump_options(directory: str) -> dict:
    """Compiler options that write the optimized program's buffer live ranges (``peak_buffers``) to ``directory``."""
    return {"xla_dump_to": directory, "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "^$"}


def peak_buffers(dump_dir: str, program_text: str | None = None, argument_kinds: dict = ARGUMENT_KINDS) -> dict | None:
    """What one device holds when its memory peaks, from the compiler's buffer live ranges in ``dump_dir``
    (``-live-range.txt``, written with :func:`_dump_options`) and the optimized HLO (``program_text``, else the
    dump's): ``{"live_bytes", "by_kind": {kind: bytes}, "largest": [{"bytes", "shape", "kind", "holds"}]}``;
    ``live_bytes`` sums the values the live ranges list at the peak: it differs from the compiler's total by
    the allocator's fragmentation (added there) and by values listed apart that share a buffer (a donated
    weight and its update).
    Kinds: the step's arguments by ``argument_kinds`` (their name's prefix in the step's signature -> kind:
    parameters, optimizer state, batch, ...), copies of arguments (casts, slices), gathered weights (fsdp
    all-gathers), forward activations, backward (gradients and what the backward pass recomputes), dropout
    bits, loop state, other. None when the compiler wrote no live ranges."""
    ranges = sorted(glob.glob(os.path.join(dump_dir, "*-live-range.txt")), key=os.path.getsize)
    if not ranges:
        return None
    with open(ranges[-1]) as f:  # the step's module (the largest; a compile may add tiny helper modules)
        text = f.read()
    found = re.search(r"Live ranges at \d+ \(peak\):\n((?:\s+\S+: \d+ bytes.*\n)+)", text)
    if not found:
        return None
    if program_text is None:
        program = ranges[-1].replace("-live-range.txt", ".txt")
        program_text = Path(program).read_text() if os.path.exists(program) else ""
    module = _parse_module(program_text)
    entry = module.pop("__entry__", None)
    instrs = {name: instr for comp in module.values() for name, instr in comp.items()}
    buffers = []
    for line in found.group(1).splitlines():
        value, size = re.match(r"\s+(\S+): (\d+) bytes", line).groups()
        instr, op_name, own = _origin(instrs, re.sub(r"\{[\d,]*\}$", "", value))
        loop_state = instr is not None and instr.opcode == "parameter" and instr.name not in module.get(entry, {})
        kind = "loop state" if loop_state and not op_name else _buffer_kind(instr, op_name, own, argument_kinds)
        shape = _array_of(instrs[re.sub(r"\{[\d,]*\}$", "", value)].shape, value) if instr else ""
        holds = _holds(op_name, instr, value, argument_kinds)
        buffers.append({"bytes": int(size), "shape": shape, "kind": kind, "holds": holds})
    by_kind: dict[str, int] = {}
    for buffer in buffers:
        by_kind[buffer["kind"]] = by_kind.get(buffer["kind"], 0) + buffer["bytes"]
    largest = sorted(buffers, key=lambda b: -b["bytes"])[:PEAK_BUFFERS]
    return {
        "live_bytes": sum(b["bytes"] for b in buffers),  # not the allocator's total (see the docstring)
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "largest": largest,
    }


_MOVES = {"copy", "copy-start", "copy-done", "bitcast", "get-tuple-element", "reshape", "async-start", "async-done"}


def _origin(instrs: dict, name: str) -> tuple[_Instr | None, str, bool]:
    """The instruction ``name``, the JAX operation it comes from (its ``op_name``) and whether the buffer holds
    that operation's own value: copies, bitcasts and other compiler-made moves carry no ``op_name``, so follow
    their first operand to one that does (through other operations, a buffer made from it: a cast, a slice)."""
    instr, own = instrs.get(name), True
    for _ in range(16):
        if instr is None:
            return None, "", own
        found = re.search(r'op_name="([^"]*)"', instr.attrs)
        if found:
            return instr, found.group(1).replace("\\'", "'"), own
        if not instr.operands or instr.operands[0] not in instrs:
            return instr, "", own
        own = own and instr.opcode in _MOVES
        instr = instrs[instr.operands[0]]
    return instr, "", own


def _buffer_kind(instr: _Instr | None, op_name: str, own: bool, argument_kinds: dict) -> str:
    argument = next((kind for prefix, kind in argument_kinds.items() if _names(op_name, prefix)), None)
    if argument:
        return argument if own else "copies of arguments"  # a cast of the weights, a slice of the batch
    if instr is not None and instr.opcode.startswith("all-gather"):
        return "gathered weights"
    if "bernoulli" in op_name or "random_bits" in op_name or "threefry" in op_name:
        return "dropout bits"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward activations"
    return "other"


def _names(op_name: str, prefix: str) -> bool:
    """Whether ``op_name`` is the path of an argument under ``prefix`` (``state.params['h']`` under ``state``)."""
    return op_name == prefix or op_name.startswith((prefix + ".", prefix + "["))


def _holds(op_name: str, instr: _Instr | None, value: str, argument_kinds: dict) -> str:
    """What a buffer holds, for people: an argument's pytree path (``params transformer/wte/embedding``) or
    the JAX operation that made it, without the step's name."""
    path = re.match(r"(state\.)?(\w+)((?:\[[^\]]*\]|\.\w+)*)$", op_name)
    if path and any(_names(op_name, prefix) for prefix in argument_kinds):
        keys = re.findall(r"\['([^']*)'\]|\.(\w+)|\[(\d+)\]", path.group(3))
        parts = [next(k for k in key if k) for key in keys]
        parts = [p for p in parts if p != "value"]
        return f"{path.group(2)} {'/'.join(parts)}".strip()
    if op_name:
        return re.sub(r"^jit\([^)]*\)/", "", op_name)
    return f"{instr.opcode} {value}" if instr is not None else value


def _array_of(shape: str, value: str) -> str:
    """The array of ``value`` (``name{i}``: the i-th of a tuple-shaped instruction) in its HLO ``shape``,
    without layout: ``bf16[4,1024,1600]``."""
    arrays = [f"{dtype}[{dims}]" for dtype, dims, _ in _ARRAY.findall(shape)]
    index = re.search(r"\{(\d+)\}$", value)
    if index and int(index.group(1)) < len(arrays):
        return arrays[int(index.group(1))]
    return arrays[0] if len(arrays) == 1 else shape


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def format_table(plan: dict) -> str:
    """A few lines for the terminal: memory per device in GiB, step time, MFU, attention kernel, layers."""
    memory, hbm = plan["bytes_per_device"], plan["hbm_bytes_per_device"]
    mesh = " ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    rows = [f"plan for {plan['accelerator']} ({plan['topology']}, {plan['devices']} devices, mesh {mesh})"]
    for key in ("parameters", "optimizer_state", "batch", "temporaries"):
        rows.append(f"  {key.replace('_', ' '):<17}{memory[key] / GiB:9.2f} GiB")
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    rows.append(f"  {'total':<17}{memory['total'] / GiB:9.2f} GiB of {hbm / GiB:.2f} GiB per device: {verdict}")
    step, mfu = plan["estimated_step_seconds"], plan["estimated_mfu"]
    rows.append(f"  {'step time':<17}{step * 1e3:9.2f} ms" if step is not None else f"  {'step time':<17}{'-':>9}")
    rows.append(f"  {'MFU':<17}{mfu * 100:8.1f} %" if mfu is not None else f"  {'MFU':<17}{'-':>9}")
    rows.append(f"  {'attention':<17}{plan['attention_kernel'] or '-':>9}")
    if "layers" in plan:  # scanned or unrolled (a run's plan: runner.plan)
        rows.append(f"  {'layers':<17}{plan['layers']:>9}")
    rows.append(f"  ({plan['estimate_method']})")
    peak = plan.get("peak_buffers")
    if peak:
        kinds = ", ".join(f"{kind} {size / GiB:.2f}" for kind, size in list(peak["by_kind"].items())[:6])
        rows.append(f"  {'at the peak':<17}{peak['live_bytes'] / GiB:9.2f} GiB live: {kinds} GiB")
        for i, buffer in enumerate(peak["largest"][:PEAK_SHOWN]):
            holds = buffer["holds"] if len(buffer["holds"]) <= 60 else "..." + buffer["holds"][-57:]
            label = "largest" if i == 0 else ""
            rows.append(f"  {label:<17}{buffer['bytes'] / GiB:9.2f} GiB {buffer['shape']} {buffer['kind']}: {holds}")
    return "\n".join(rows)


def write_plan(path, plan: dict) -> None:
    """``plan`` as JSON at ``path``, written whole or not at all."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(plan, indent=2) + "\n")


def refusal(plan: dict, suggestions: list[str] | None = None, *, remat: str | None = None) -> str:
    """One line: ``needs 21.30 GiB per chip of 15.75 GiB on v5e-8; try: ...`` (up to 3 suggestions; ``remat``:
    the run's policy, so that a run already at ``full`` is not told to use it)."""
    memory, hbm = plan["bytes_per_device"], plan["hbm_bytes_per_device"]
    unit = "core" if plan["accelerator"].startswith("v3") else "chip"
    tips = list(suggestions) if suggestions is not None else _suggestions(plan, remat)
    line = f"needs {memory['total'] / GiB:.2f} GiB per {unit} of {hbm / GiB:.2f} GiB on {plan['accelerator']}"
    peak = plan.get("peak_buffers")
    if peak:  # what the memory is, so the user knows what to change
        line += " (at the peak: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in list(peak["by_kind"].items())[:3])
        line += ")"
    return line + (f"; try: {', '.join(tips[:3])}" if tips else "")


def _suggestions(plan: dict, remat: str | None = None) -> list[str]:
    """What to change, led by what takes the memory: the training state (weights + optimizer) or activations."""
    memory, mesh = plan["bytes_per_device"], plan["mesh"]
    state = memory["parameters"] + memory["optimizer_state"]
    data_devices = plan["devices"] // max(mesh.get("mp", 1), 1)
    shard = [f"more fsdp (fsdp={data_devices})"] if mesh and mesh.get("fsdp", 1) < data_devices else []
    if state > memory["temporaries"]:
        tips = shard + ["LoRA"] + (["Adafactor"] if memory["optimizer_state"] > memory["parameters"] else [])
    else:
        tips = (["--remat full"] if remat != "full" else []) + ["a smaller batch", *shard]
    generation, _, count = plan["accelerator"].partition("-")
    bigger = int(count) * 2 if int(count) > 1 else 4  # Cloud TPU has no two-chip slice (no v5e-2)
    return [*tips, f"a bigger topology ({generation}-{bigger})"][:3]
