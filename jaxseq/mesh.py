"""The device mesh: always five axes ``("dp", "fsdp", "ep", "cp", "mp")`` (data, fully-sharded data, expert,
context and model parallel).

``make_mesh("dp=2,mp=4")`` on 8 devices; missing axes are 1; one axis may be ``-1`` (inferred). Batches are
split over ``dp``, ``fsdp`` and ``ep`` together (``batch_spec``); parameters over ``fsdp`` and ``mp``
(partition.py), a mixture of experts' experts over ``ep`` (each device holds its share of the experts and
computes them for the tokens of its ``ep`` group), each row's tokens over ``cp`` (a ``cp`` group shares its
rows, each device holding a share of every row's positions: ``models.attention.split_sequence``). ``ep`` and
``cp`` are shown only when they are more than 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.errors import JaxseqError

AXES = ("dp", "fsdp", "ep", "cp", "mp")
SHOWN_WHEN_SPLIT = ("ep", "cp")  # axes shown only when more than 1
BATCH_AXES = ("dp", "fsdp", "ep")


def parse_mesh_spec(spec: str | Mapping[str, int] | None, device_count: int) -> dict[str, int]:
    """``"dp=2,mp=4"`` or ``{"dp": 2, "mp": 4}`` -> sizes of all four axes, with one ``-1`` inferred."""
    if spec is None or spec == "":
        spec = {"dp": -1}
    if isinstance(spec, str):
        items = {}
        for part in spec.replace(" ", "").split(","):
            name, eq, value = part.partition("=")
            try:
                items[name] = int(value)
            except ValueError:
                eq = ""
            if not eq:
                raise JaxseqError(f"bad mesh spec {spec!r}: write it like 'dp=2,mp=4' (axes {', '.join(AXES)})")
        spec = items
    unknown = set(spec) - set(AXES)
    if unknown:
        raise JaxseqError(f"unknown mesh axis {', '.join(sorted(unknown))} in {spec!r}; the axes are {', '.join(AXES)}")
    sizes = {axis: int(spec.get(axis, 1)) for axis in AXES}
    inferred = [axis for axis, size in sizes.items() if size == -1]
    if len(inferred) > 1 or any(size == 0 or size < -1 for size in sizes.values()):
        raise JaxseqError(f"bad mesh spec {spec!r}: sizes must be positive, with at most one -1")
    known = math.prod(size for size in sizes.values() if size != -1)
    if inferred:
        if device_count % known:
            raise JaxseqError(f"mesh {spec!r} cannot be formed: {device_count} devices are not divisible by {known}")
        sizes[inferred[0]] = device_count // known
    if math.prod(sizes.values()) != device_count:
        raise JaxseqError(
            f"mesh {format_mesh(sizes)} needs {math.prod(sizes.values())} devices but {device_count} are "
            "available; make the axis sizes multiply to the device count (or use -1 for one axis)"
        )
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, devices=None) -> Mesh:
    """A ``("dp", "fsdp", "ep", "cp", "mp")`` mesh over ``devices`` (default: all), laid out for the interconnect."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec, len(devices))
    shape = tuple(sizes[axis] for axis in AXES)
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, AXES)


def mesh_platform(mesh: Mesh | None) -> str:
    """The platform (``cpu``, ``gpu``, ``tpu``) of ``mesh``'s devices; None: this process's default devices."""
    return (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform


def mesh_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    """The axis sizes as runs print and record them: ``ep`` and ``cp`` only when more than 1."""
    sizes = dict(mesh.shape if isinstance(mesh, Mesh) else mesh)
    return {axis: sizes.get(axis, 1) for axis in AXES if axis not in SHOWN_WHEN_SPLIT or sizes.get(axis, 1) > 1}


def format_mesh(sizes: Mesh | Mapping[str, int]) -> str:
    return ",".join(f"{axis}={n}" for axis, n in mesh_sizes(sizes).items())


def batch_spec(ndim: int = 2) -> P:
    """Leading (batch) dimension split over ``dp``, ``fsdp`` and ``ep``; the rest replicated."""
    return P(BATCH_AXES, *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(ndim))


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways a global batch is split: the batch dimension must be divisible by this (a ``cp`` group
    shares its rows)."""
    return mesh.shape["dp"] * mesh.shape["fsdp"] * mesh.shape["ep"]


def context_size(mesh: Mesh | Mapping[str, int] | None) -> int:
    """How many devices share each row's tokens (the ``cp`` axis; 1 without a mesh)."""
    return 1 if mesh is None else dict(mesh.shape if isinstance(mesh, Mesh) else mesh).get("cp", 1)
