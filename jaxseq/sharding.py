"""Sharding machinery: ordered ``(regex, PartitionSpec)`` rules -> PartitionSpec trees -> NamedShardings.

Each leaf's path is joined with ``/`` (``transformer/h/0/attn/c_attn/kernel``) and matched with
``re.search`` against the rules in order; the first match wins. Optimizer states match too: their leaves
carry the parameter path (``0/mu/transformer/h/0/attn/c_attn/kernel``), so they follow their parameter.
Scalars (step counters) are replicated. A path with a ``stacked`` segment (``STACKED``: the blocks of a scanned
stack, ``jaxseq.models.layers.Stacked``) has a leading layer axis: it takes its rule's spec behind a replicated
dimension, so one rule serves a parameter stacked or not. Usable on any pytree, not only jaxseq's models.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.errors import JaxseqError
from jaxseq.mesh import format_mesh, mesh_sizes

Rules = Sequence[tuple[str, P]]
STACKED = "stacked"
"""The path segment of blocks stacked with a leading layer axis (``models.layers.Stacked``), where the unrolled
model's paths hold the layer's index."""


def every(start: int, step: int) -> str:
    """The path segment of a stack that holds layers ``start``, ``start + step``, ... (``"1::4"``: a grouped
    stack's blocks at place 1 of each group of 4, ``models.layers.Grouped``), read by ``unstacked_path``."""
    return f"{start}::{step}"


def unstacked_path(path: tuple, layer: int) -> tuple:
    """The path that layer ``layer`` of a stacked parameter's ``path`` has in the unrolled model. A stack held at
    index ``k`` of a list of blocks (``.../layers/3/stacked/...``: blocks unrolled before it) holds layers ``k``,
    ``k + 1``, ...: its path's ``k`` and ``STACKED`` become ``k + layer``; one held under ``every(k, step)``
    (``.../layers/1::4/stacked/...``) holds layers ``k``, ``k + step``, ...: they become ``k + step * layer``."""
    if STACKED not in path:
        return tuple(path)
    at = path.index(STACKED)
    before = path[at - 1] if at else None
    if isinstance(before, str) and "::" in before:
        start, step = map(int, before.split("::"))
        return (*path[: at - 1], start + step * layer, *path[at + 1 :])
    if isinstance(before, int) or (isinstance(before, str) and before.isdigit()):
        return (*path[: at - 1], type(before)(int(before) + layer), *path[at + 1 :])
    return (*path[:at], layer, *path[at + 1 :])


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_string(path) -> str:
    """``/``-joined names of a pytree key path (an NNX Variable's own ``value`` key left out)."""
    names = [_key_name(k) for k in path]
    if names and names[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        names = names[:-1]
    return "/".join(names)


def named_leaves(tree) -> list[tuple[str, object]]:
    return [(path_string(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def match_partition_rules(rules: Rules, tree):
    """A PartitionSpec for every leaf of ``tree`` (same structure). Unmatched paths are an error."""
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def spec_for(path, leaf):
        if np.ndim(leaf) == 0 or math.prod(np.shape(leaf)) == 1:
            return P()
        name = path_string(path)
        for pattern, spec in compiled:
            if pattern.search(name):
                return P(None, *spec) if STACKED in name.split("/") else spec
        raise JaxseqError(f"no partition rule matches parameter {name!r} (shape {np.shape(leaf)}); add a rule for it")

    return jax.tree_util.tree_map_with_path(spec_for, tree)


def follow_params(params, param_specs, tree):
    """Specs for an optimizer state: a leaf whose path ends in a parameter's path and has its shape takes
    the parameter's spec (Adam's moments); one with an extra leading dimension (L-BFGS's history) takes
    it behind a replicated dimension; everything else (counters, coefficients) is replicated."""
    known = {
        name: (np.shape(leaf), spec)
        for (name, leaf), spec in zip(named_leaves(params), jax.tree.leaves(param_specs, is_leaf=_is_spec))
    }

    def spec_for(path, leaf):
        parts = path_string(path).split("/")
        for i in range(len(parts)):
            match = known.get("/".join(parts[i:]))
            if match is None:
                continue
            shape, spec = match
            if np.shape(leaf) == shape:
                return spec
            if np.shape(leaf)[1:] == shape:
                return P(None, *spec)
            break
        return P()

    return jax.tree_util.tree_map_with_path(spec_for, tree)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _axes_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def check_divisible(tree, specs, mesh: Mesh) -> None:
    """Every sharded dimension must divide evenly by its mesh axes; otherwise an error listing them all."""
    bad = []
    flat_specs = jax.tree.leaves(specs, is_leaf=_is_spec)
    for (name, leaf), spec in zip(named_leaves(tree), flat_specs):
        shape = np.shape(leaf)
        if len(spec) > len(shape):
            bad.append(f"{name} shape {shape} has fewer dims than spec {spec}")
            continue
        for dim, axes in zip(shape, spec):
            if dim % _axes_size(mesh, axes):
                bad.append(f"{name} shape {shape} spec {spec}")
                break
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise JaxseqError(
            f"cannot shard on mesh {format_mesh(mesh)}: {'; '.join(bad[:3])}{more} are not divisible by their "
            "mesh axes; pick a mesh whose axis sizes divide these dimensions"
        )


def make_shardings(mesh: Mesh, specs):
    """PartitionSpec tree -> NamedSharding tree."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


def shard(tree, shardings):
    """Place (or move) every array of ``tree`` onto its sharding."""
    return jax.device_put(tree, shardings)


def gather(tree):
    """Every array of ``tree`` as a host numpy array (all shards assembled, also across processes)."""

    def to_host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(to_host, tree)


def describe(tree, specs, mesh: Mesh) -> str:
    """A table of every leaf: path, shape, dtype, spec and bytes per device, with totals. A stacked leaf
    (``STACKED`` in its path) is a row per layer, named, shaped and split as the unrolled model's."""
    rows, total, per_device = [], 0, 0
    flat_specs = jax.tree.leaves(specs, is_leaf=_is_spec)
    for (name, leaf), spec in zip(named_leaves(tree), flat_specs):
        shape, dtype = tuple(np.shape(leaf)), np.dtype(leaf.dtype)
        split = math.prod(_axes_size(mesh, axes) for axes in spec)
        names = tuple(name.split("/"))
        layers = [(name, shape, spec)]
        if STACKED in names:
            layers = [("/".join(map(str, unstacked_path(names, i))), shape[1:], P(*spec[1:])) for i in range(shape[0])]
        for name, layer_shape, layer_spec in layers:
            nbytes = math.prod(layer_shape) * dtype.itemsize
            rows.append((name, str(layer_shape), dtype.name, str(layer_spec), nbytes // split))
            total, per_device = total + nbytes, per_device + nbytes // split
    if any(f"/{STACKED}/" in name for name, _ in named_leaves(tree)):  # in the unrolled tree's order
        rows.sort(key=lambda row: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in row[0].split("/")])
    widths = [
        max(len(str(r[i])) for r in rows + [("path", "shape", "dtype", "spec", "bytes/device")]) for i in range(5)
    ]
    header = ("path", "shape", "dtype", "spec", "bytes/device")
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(
        f"{len(rows)} arrays, {total / 2**20:.1f} MiB in all, {per_device / 2**20:.1f} MiB per device on mesh "
        f"{', '.join(f'{k}={v}' for k, v in mesh_sizes(mesh).items())}"
    )
    return "\n".join(lines)
