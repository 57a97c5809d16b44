"""Hugging Face checkpoints in and out: read safetensors / PyTorch .bin / Flax msgpack into our NNX
modules (placed straight onto their devices), and write folders that transformers (PyTorch) loads.

Our parameter paths mirror the PyTorch names (``transformer/h/0/attn/c_attn/kernel`` is
``transformer.h.0.attn.c_attn.weight``), so conversion is a rename plus a transpose for ``nnx.Linear``
kernels; see ``torch_layout``. Nothing here unpickles: ``.bin`` files load with ``weights_only=True``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.models.family import Family
from jaxseq.models.layers import Conv1D

logger = logging.getLogger("jaxseq")

TASKS = ("base", "causal-lm", "seq2seq-lm", "sequence-classification", "masked-lm")
_LEAF_TO_TORCH = {"kernel": "weight", "embedding": "weight", "scale": "weight"}
_HUB_PATTERNS = ["*.json", "*.txt", "*.model", "tokenizer*"]
_WEIGHT_PATTERNS = (["*.safetensors", "*.safetensors.index.json"], ["pytorch_model*.bin*"], ["flax_model*.msgpack*"])


# --------------------------------------------------------------------------- where the files are


def _is_weights_folder(path: Path) -> bool:
    return (
        any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")) or any(path.glob("flax_model*.msgpack"))
    )


def resolve(name_or_path: str | os.PathLike, *, weights: bool = True) -> Path:
    """A local folder as is; otherwise a Hub id, downloaded (config, tokenizer and, if ``weights``, one
    weight format)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise JaxseqError(f"model path {name!r} is not a folder; pass a folder holding config.json and weights")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        for patterns in _WEIGHT_PATTERNS if weights else ([],):
            folder = Path(snapshot_download(name, allow_patterns=_HUB_PATTERNS + patterns))
            if _is_weights_folder(folder):
                return folder
        return folder
    except HFValidationError:
        raise JaxseqError(f"{name!r} is neither a local folder nor a valid Hugging Face Hub id") from None
    except GatedRepoError:
        raise JaxseqError(f"{name!r} is gated on the Hub: accept its terms and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise JaxseqError(
            f"no model {name!r} on the Hugging Face Hub (or it is private: log in with `hf auth login`)"
        ) from None
    except (LocalEntryNotFoundError, OSError) as e:
        raise JaxseqError(
            f"cannot download {name!r} from the Hugging Face Hub (offline? {type(e).__name__}); "
            "connect to the network or pass a local folder"
        ) from None


def load_config(folder: Path, *, num_labels: int | None = None, **overrides):
    """``config.json`` through transformers' AutoConfig, with overrides checked against its fields."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise JaxseqError(f"no config.json in {folder}; point to a Hugging Face model folder")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise JaxseqError(f"cannot read {folder / 'config.json'}: {str(e).splitlines()[0]}") from None
    return apply_overrides(config, num_labels=num_labels, **overrides)


def parse_overrides(text: str | None, config) -> dict:
    """``"n_layer=2,n_embd=128,resid_pdrop=0"`` -> typed values (the type of the config's current value,
    a number for an unset field, ``None`` for ``none``/``null``). Unknown field names are left for
    ``apply_overrides`` to report."""
    booleans = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    overrides = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, eq, raw = (s.strip() for s in item.partition("="))
        if not eq or not key:
            raise JaxseqError(f"bad config override {item!r}: write them like 'n_layer=2,n_embd=128'")
        current = getattr(config, key, None)
        try:
            if raw.lower() in ("none", "null"):
                value = None
            elif isinstance(current, bool):
                value = booleans[raw.lower()]
            elif isinstance(current, (int, float)):
                value = float(raw) if isinstance(current, float) else int(raw)
            elif current is None:  # an unset field (n_inner): a number if it reads as one
                value = _number(raw)
            else:
                value = raw
        except (ValueError, KeyError):
            raise JaxseqError(f"config override {key}={raw!r}: expected a {type(current).__name__}") from None
        overrides[key] = value
    return overrides


def _number(raw: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def apply_overrides(config, *, num_labels: int | None = None, **overrides):
    config = copy.deepcopy(config)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise JaxseqError(f"{type(config).__name__} has no field {key!r}; check the override's spelling")
        setattr(config, key, value)
    if num_labels is not None and num_labels != config.num_labels:
        config.num_labels = num_labels
    return config


# --------------------------------------------------------------------------- reading weights

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
    """Lazy, zero-copy tensors of a safetensors file. (The ``safetensors`` package's numpy reader
    cannot return bfloat16, so the few lines of its documented format are read here with a memmap.)"""
    corrupt = JaxseqError(f"{path} is truncated or corrupt (not a valid safetensors file); download it again")
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    except (ValueError, OSError, UnicodeDecodeError):
        raise corrupt from None

    def tensor(info):
        start, end = info["data_offsets"]
        if end > data.size or info["dtype"] not in _ST_DTYPES:
            raise corrupt
        return data[start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])

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
        raise JaxseqError(f"cannot read {path}: {str(e).splitlines()[0]}") from None

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
        raise JaxseqError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
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


# --------------------------------------------------------------------------- names


def torch_layout(model: nnx.Module) -> dict[str, tuple[tuple, bool]]:
    """PyTorch name -> (our parameter path, whether the kernel is transposed) for every parameter."""
    transposed = {
        path for path, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear) and not isinstance(m, Conv1D)
    }
    layout = {}
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        *mod, leaf = path
        name = ".".join(map(str, [*mod, _LEAF_TO_TORCH.get(leaf, leaf)]))
        layout[name] = (path, leaf == "kernel" and tuple(mod) in transposed)
    return layout


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
            parts.append(f"missing {_some(bad_missing)}")
        if bad_unexpected:
            parts.append(f"unexpected {_some(bad_unexpected)}")
        raise JaxseqError(
            f"checkpoint does not fit the {family.model_type} model: {'; '.join(parts)}; "
            "check that config.json matches the weights"
        )
    return {n: found[n] for n in expected if n in found}, new_heads, dropped


def _some(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# --------------------------------------------------------------------------- building models


def family_for(model_type: str | None) -> Family:
    from jaxseq.models import FAMILIES

    if model_type not in FAMILIES:
        raise JaxseqError(f"model_type {model_type!r} is not supported; jaxseq supports {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def model_class(config, task: str) -> type:
    family = family_for(config.model_type)
    if task not in family.tasks:
        raise JaxseqError(
            f"task {task!r} is not available for {family.model_type}; choose one of {', '.join(family.tasks)}"
        )
    return family.tasks[task]


def _constructor(config, task, dtype, param_dtype, seed):
    cls = model_class(config, task)
    return lambda: cls(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed))


def _placement(mesh, rules, abstract_state, model_type):
    """Sharding of every parameter: from the partition rules on a mesh, else the default device."""
    if mesh is None:
        return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract_state)
    from jaxseq import partition

    rules = rules if rules is not None else partition.get_partition_rules(model_type)
    specs = partition.match_partition_rules(rules, abstract_state)
    partition.check_divisible(abstract_state, specs, mesh)
    return partition.make_shardings(mesh, specs)


def from_config(config, task: str, *, dtype=jnp.float32, param_dtype=jnp.float32, mesh=None, rules=None, seed: int = 0):
    """A randomly initialised model (for pretraining from scratch), built under ``jit`` straight onto its
    shardings, so no device ever holds the whole model when a mesh is given."""
    make = _constructor(config, task, dtype, param_dtype, seed)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    shardings = _placement(mesh, rules, abstract_state, config.model_type)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def load_pretrained(
    name_or_path: str | os.PathLike,
    task: str,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    mesh=None,
    rules=None,
    num_labels: int | None = None,
    seed: int = 0,
    **config_overrides,
):
    """Load a Hugging Face checkpoint (local folder or Hub id) as the NNX model for ``task``.

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype. With a ``mesh`` every weight goes
    straight from disk onto its sharding (partition rules of the family, or ``rules``). A task head that
    the checkpoint lacks (a classifier on a base model) is initialised from ``seed`` and reported.
    """
    if task not in TASKS:
        raise JaxseqError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    folder = resolve(name_or_path)
    config = load_config(folder, num_labels=num_labels, **config_overrides)
    family = family_for(config.model_type)
    make = _constructor(config, task, dtype, param_dtype, seed)
    abstract = nnx.eval_shape(make)
    graphdef, abstract_state = nnx.split(abstract)
    layout = torch_layout(abstract)
    tensors, new_heads, dropped = match_names(family, set(layout), read_checkpoint(folder))
    shardings = _placement(mesh, rules, abstract_state, family.model_type)

    flat_shardings = dict(nnx.to_flat_state(shardings))
    flat_abstract = dict(nnx.to_flat_state(abstract_state))
    values = {}
    for name, (path, transpose) in layout.items():
        if name not in tensors:
            continue
        want = flat_abstract[path].get_value()
        array = tensors[name]()
        array = array.T if transpose else array
        if array.shape != want.shape:
            raise JaxseqError(
                f"weight {name} has shape {tuple(array.shape)} but the config gives {tuple(want.shape)}; "
                "check that config.json matches the weights"
            )
        values[path] = _put(np.asarray(array, dtype=want.dtype), flat_shardings[path].get_value())
    if new_heads:
        logger.warning("initialised weights that the checkpoint lacks: %s", ", ".join(new_heads))
        wanted = [layout[n][0] for n in new_heads]
        init = jax.jit(
            lambda: [dict(nnx.to_flat_state(nnx.state(make())))[p].get_value() for p in wanted],
            out_shardings=[flat_shardings[p].get_value() for p in wanted],
        )
        values.update(zip(wanted, init()))
    if dropped:
        logger.warning("ignored checkpoint weights this task does not use: %s", _some(dropped))
    for path, value in values.items():
        flat_abstract[path].set_value(value)
    return nnx.merge(graphdef, abstract_state)


def _put(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Place a host array onto its sharding; each device receives only its own slice."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


# --------------------------------------------------------------------------- writing


def save_pretrained(model: nnx.Module, out_dir: str | os.PathLike, tokenizer=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (PyTorch names) and the tokenizer, if given, so that
    the matching transformers PyTorch class loads the folder with no missing or unexpected weights.
    In a multi-host run every process calls this (the shards are gathered); process 0 writes."""
    from safetensors.numpy import save_file

    from jaxseq.partition import gather

    out = Path(out_dir)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    host = gather({path: v.get_value() for path, v in flat.items()})  # every process takes part
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (path, transpose) in torch_layout(model).items():
        array = host[path]
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).hf_architecture]
    with tempfile.TemporaryDirectory(dir=out, prefix=".saving-") as tmp:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), out / name)
    return out
