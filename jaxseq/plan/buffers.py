"""Memory at the peak: which buffers the compiler's buffer assignment holds when a device's memory peaks,
read from the buffer live ranges XLA dumps."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from jaxseq.plan.hlo import ARRAY, Instr, parse_module

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


def dump_options(directory: str) -> dict:
    """Compiler options that write the optimized program's buffer live ranges (``peak_buffers``) to ``directory``."""
    return {"xla_dump_to": directory, "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "^$"}


def peak_buffers(dump_dir: str, program_text: str | None = None, argument_kinds: dict = ARGUMENT_KINDS) -> dict | None:
    """What one device holds when its memory peaks, from the compiler's buffer live ranges in ``dump_dir``
    (``-live-range.txt``, written with :func:`dump_options`) and the optimized HLO (``program_text``, else the
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
    module = parse_module(program_text)
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


def _origin(instrs: dict, name: str) -> tuple[Instr | None, str, bool]:
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


def _buffer_kind(instr: Instr | None, op_name: str, own: bool, argument_kinds: dict) -> str:
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


def _holds(op_name: str, instr: Instr | None, value: str, argument_kinds: dict) -> str:
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
    arrays = [f"{dtype}[{dims}]" for dtype, dims, _ in ARRAY.findall(shape)]
    index = re.search(r"\{(\d+)\}$", value)
    if index and int(index.group(1)) < len(arrays):
        return arrays[int(index.group(1))]
    return arrays[0] if len(arrays) == 1 else shape
