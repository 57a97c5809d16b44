"""A plan: compile a step for a slice, and read off memory per chip (the compiler's own check), the roofline
step time and MFU, and what holds the memory at its peak."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import re
import tempfile
import time

import jax

from jaxseq.mesh import mesh_sizes
from jaxseq.plan.buffers import ARGUMENT_KINDS, dump_options, peak_buffers
from jaxseq.plan.chips import Topology
from jaxseq.plan.hlo import HloCost, attention_kernel, hlo_cost


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
            compiled = lowered.compile(compiler_options=dump_options(dump))
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
