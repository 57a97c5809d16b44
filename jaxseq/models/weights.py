"""Checkpoint tensors in and out: read safetensors / PyTorch ``.bin`` / Flax msgpack files (sharded or
not) lazily by PyTorch name, and map those names onto our parameter paths.

Our parameter paths mirror the PyTorch names (``transformer/h/0/attn/c_attn/kernel`` is
``transformer.h.0.attn.c_attn.weight``), so conversion is a rename plus a transpose for ``nnx.Linear``
kernels; see ``torch_layout``. Nothing here unpickles: ``.bin`` files load with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx

from jaxseq.errors import JaxseqError, first_line
from jaxseq.models.family import Family
from jaxseq.models.layers import Conv1D, NamedAsIs, is_expert_stack, layer_paths

_LEAF_TO_TORCH = {"kernel": "weight", "embedding": "weight", "scale": "weight"}

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _read_safetensors(path: Path) -> dict[str, Callable[[], np.ndarray]]:
    """Tensors of a safetensors file, each read from disk only when called, into its own array: a load holds
    at most the tensor being placed on the host, never the whole file (no memory map stays resident). (The
    ``safetensors`` package's numpy reader cannot return bfloat16, so its documented format is read here.)"""
    corrupt = JaxseqError(f"{path} is truncated or corrupt (not a valid safetensors file); download it again")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
    except (ValueError, OSError, UnicodeDecodeError):
        raise corrupt from None
    if any(8 + n + info["data_offsets"][1] > size or info["dtype"] not in _ST_DTYPES for info in header.values()):
        raise corrupt

    def tensor(info):
        start, end = info["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        with open(path, "rb") as f:
            f.seek(8 + n + start)
            array = np.fromfile(f, dtype=dtype, count=(end - start) // dtype.itemsize)
        return array.reshape(info["shape"])

    return {name: (lambda info=info: tensor(info)) for name, info in header.items()}


def _read_torch_bin(path: Path) -> dict[str, Callable[[], np.ndarray]]:
    try:
        import torch
    except ImportError:
        raise JaxseqError(
            f"{path.name} is a PyTorch checkpoint: install torch to read it, or convert it to safetensors"
        ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for bad files
        if "Weights only load failed" in str(e):  # torch's own advice (weights_only=False) would run its code
            raise JaxseqError(
                f"{path} holds pickled objects besides tensors, and jaxseq never unpickles them "
                "(they can run code); use a safetensors copy of the model from a source you trust"
            ) from None
        raise JaxseqError(f"cannot read {path}: {first_line(e)}") from None

    def tensor(t):
        t = t.detach()
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()

    return {name: (lambda t=t: tensor(t)) for name, t in state.items()}


def _read_flax_msgpack(path: Path) -> dict[str, Callable[[], np.ndarray]]:
    """Flax checkpoints, renamed to PyTorch names by transformers' own rule (2-D kernels transposed)."""
    from flax import serialization
    from flax.traverse_util import flatten_dict

    try:
        tree = serialization.msgpack_restore(path.read_bytes())
    except Exception as e:  # msgpack raises many types for bad files
        raise JaxseqError(f"cannot read {path}: {first_line(e)}") from None
    out = {}
    for keys, value in flatten_dict(tree).items():
        *mod, leaf = keys
        value = np.asarray(value)
        if leaf == "kernel" and value.ndim == 2:
            value = value.T
        out[".".join([*mod, _LEAF_TO_TORCH.get(leaf, leaf)])] = lambda v=value: v
    return out


def read_checkpoint(folder: Path) -> dict[str, Callable[[], np.ndarray]]:
    """All tensors of the folder's checkpoint (sharded or not), by PyTorch name, loaded on demand."""
    readers = (
        ("model.safetensors", _read_safetensors),
        ("pytorch_model.bin", _read_torch_bin),
        ("flax_model.msgpack", _read_flax_msgpack),
    )
    for filename, reader in readers:
        index = folder / f"{filename}.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            tensors = {}
            for file in files:
                if not (folder / file).is_file():
                    raise JaxseqError(f"{folder / file} is listed in {index.name} but missing; download it again")
                tensors.update(reader(folder / file))
            return tensors
        if (folder / filename).is_file():
            return reader(folder / filename)
    raise JaxseqError(f"no weights in {folder} (looked for model.safetensors, pytorch_model.bin, flax_model.msgpack)")


def torch_layout(model: nnx.Module) -> dict[str, tuple[tuple, bool]]:
    """PyTorch name -> (our parameter path as the unrolled model has it, whether the kernel is transposed) for
    every parameter; where a scanned model keeps that path is ``layers.layer_paths``'s."""
    transposed = {
        path for path, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear) and not isinstance(m, Conv1D)
    }
    params = nnx.state(model, nnx.Param)
    variables = dict(nnx.to_flat_state(params))
    layout = {}
    for path, (stored, _) in layer_paths(params).items():
        *mod, leaf = path
        own = isinstance(variables[stored], NamedAsIs)
        name = ".".join(map(str, [*mod, leaf if own else _LEAF_TO_TORCH.get(leaf, leaf)]))
        expert = is_expert_stack(stored, variables[stored])
        layout[name] = (path, (leaf == "kernel" and stored[:-1] in transposed) or expert)
    return layout


def stored_layout(model: nnx.Module) -> dict[tuple, dict[int | tuple | None, tuple[str, bool]]]:
    """``torch_layout`` by where the model keeps each parameter (``layers.layer_paths``): our path -> {index on
    its stacked axes (None: not stacked): (PyTorch name, whether the kernel is transposed)}."""
    where = layer_paths(nnx.state(model, nnx.Param))
    out = {}
    for name, (path, transposed) in torch_layout(model).items():
        stored, layer = where[path]
        out.setdefault(stored, {})[layer] = (name, transposed)
    return out


def resize_vocab(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    """``array`` with its vocabulary ``axis`` padded with zeros or trimmed to ``size`` entries (see
    ``Family.vocab_params``)."""
    have = array.shape[axis]
    if have >= size:
        return array[(slice(None),) * axis + (slice(0, size),)]
    pad = [(0, 0)] * array.ndim
    pad[axis] = (0, size - have)
    return np.pad(array, pad)


def match_names(family: Family, expected: set[str], found: dict[str, Callable]):
    """Map checkpoint names onto ours. Returns (tensors by our name, missing heads, dropped heads)."""
    prefix = f"{family.base_prefix}." if family.base_prefix else None
    found = dict(found)
    if prefix:
        ours_prefixed = any(n.startswith(prefix) for n in expected)
        theirs_prefixed = any(n.startswith(prefix) for n in found)
        if ours_prefixed and not theirs_prefixed:  # a bare base-model checkpoint into a head model
            found = {
                (prefix + n if prefix + n in expected or not family.is_head(n) else n): t for n, t in found.items()
            }
        elif theirs_prefixed and not ours_prefixed:  # a head-model checkpoint into the bare base model
            found = {(n[len(prefix) :] if n.startswith(prefix) else n): t for n, t in found.items()}
    for alias, target in family.aliases.items():
        if alias in found:
            tensor = found.pop(alias)
            if alias in expected:
                found[alias] = tensor
            elif target in expected and target not in found:
                found[target] = tensor
    for name, source in family.fallbacks.items():
        if name in expected and name not in found and source in found:
            found[name] = found[source]
    unexpected = sorted(n for n in found if n not in expected and not family.is_ignored(n))
    missing = sorted(n for n in expected if n not in found)
    dropped = [n for n in unexpected if family.is_head(n)]
    new_heads = [n for n in missing if family.is_head(n)]
    bad_unexpected = [n for n in unexpected if n not in dropped]
    bad_missing = [n for n in missing if n not in new_heads]
    if bad_missing or bad_unexpected:
        parts = []
        if bad_missing:
            parts.append(f"missing {some(bad_missing)}")
        if bad_unexpected:
            parts.append(f"unexpected {some(bad_unexpected)}")
        raise JaxseqError(
            f"checkpoint does not fit the {family.model_type} model: {'; '.join(parts)}; "
            "check that config.json matches the weights"
        )
    return {n: found[n] for n in expected if n in found}, new_heads, dropped


def some(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
