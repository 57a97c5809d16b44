"""A compiled program's cost from its HLO text: FLOPs, HBM traffic and collective traffic per device, loops
counted by their trip counts (``cost_analysis`` counts a loop body once)."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64}
_BITS |= {"u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "token": 0}
ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
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
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    args: str  # the text inside the parentheses: operand names, or a constant's value
    attrs: str


def hlo_cost(hlo_text: str, num_devices: int) -> HloCost:
    """Roofline inputs from ``compiled.as_text()`` (optimized HLO of one device's program)."""
    module = parse_module(hlo_text)
    cost = HloCost(attention_kernel=attention_kernel(hlo_text))
    entry = module.pop("__entry__")
    cost.add(_walk(module, entry, num_devices, seen=set()))
    return cost


def parse_module(text: str) -> dict:
    """{computation: {instruction name: Instr}}, ROOT last, plus ``"__entry__"``; an instruction may span lines."""
    text = re.sub(r"/\*.*?\*/", "", text)
    computations: dict[str, dict[str, Instr]] = {}
    roots: dict[int, Instr] = {}
    current: dict[str, Instr] | None = None
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


def _parse_instr(line: str) -> Instr | None:
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
    return Instr(name, shape, op.group(1), re.findall(r"%([\w.\-]+)", args), args, rest[end + 1 :])


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
    for dtype, dims, layout in ARRAY.findall(shape):
        bits = _BITS.get(dtype, 8 if dtype.startswith("f8") else None)
        if bits is None:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append((math.prod(int(d) for d in dims.split(",") if d) * bits / 8, int(space.group(1)) if space else 0))
    return out


def _bytes(shape: str, hbm_only: bool = False) -> float:
    return sum(b for b, space in _arrays(shape) if space == 0 or not hbm_only)


def _called(instr: Instr, key: str) -> list[str]:
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


def _compute(module: dict, instr: Instr, instrs: dict, num_devices: int, cost: HloCost, seen: set) -> None:
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


def _traffic(module: dict, instr: Instr, instrs: dict) -> float:
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


def _fusion_traffic(module: dict, instr: Instr, instrs: dict) -> float:
    """A fusion reads its operands and writes its outputs, except: a stacked buffer it only slices (a scan's
    per-layer weights) or updates in place (a scan's stacked outputs) costs the slice; buffers it hands through
    untouched, or that belong to an async collective (its ICI time is counted apart), cost nothing."""
    inner = module.get((_called(instr, "calls") or [""])[0], {})
    root = list(inner.values())[-1] if inner else None
    parameters = {int(i.args): i.name for i in inner.values() if i.opcode == "parameter" and i.args.isdigit()}
    uses: dict[str, list[tuple[Instr, int]]] = {}
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


def _collective_part(instr: Instr) -> bool:
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


def _dot_flops(instr: Instr, instrs: dict) -> float:
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
    found = ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _collective_bytes(instr: Instr, instrs: dict, num_devices: int) -> float:
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


def _trip_count(module: dict, loop: Instr, instrs: dict) -> int | None:
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


def _source(instrs: dict, name: str) -> Instr:
    """The instruction behind ``name``, looking through copies and bitcasts."""
    instr = instrs.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and instr.operands[:1]:
        if instr.operands[0] not in instrs:
            break
        instr = instrs[instr.operands[0]]
    return instr or Instr(name, "", "", [], "", "")


def _constant(instr: Instr) -> int | None:
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
