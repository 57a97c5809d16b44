"""Pretrained models: find a checkpoint (a folder or a Hub id), read its config, build the NNX model with
every weight placed straight onto its sharding, and write folders that transformers (PyTorch) loads.
Tensor reading and naming live in ``jaxseq.models.weights``; which families exist, in ``registry``."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Collection
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import config as jax_config  # threefry_gpu_kernel_lowering: no public context manager

from jaxseq.errors import JaxseqError, first_line
from jaxseq.files import atomic_folder
from jaxseq.models.execution import Execution
from jaxseq.models.family import READABLE, readable
from jaxseq.models.registry import FAMILIES, TASKS, family_for, model_class
from jaxseq.models.weights import match_names, read_checkpoint, resize_vocab, some, stored_layout, torch_layout
from jaxseq.sharding import check_divisible, gather, make_shardings, match_partition_rules

logger = logging.getLogger("jaxseq")

_HUB_PATTERNS = ["*.json", "*.txt", "*.model", "tokenizer*"]
# transformers' own weight files, whole or sharded (``model-00001-of-00004.safetensors`` + the index): not the
# other copies some repositories hold beside them (Mistral's ``consolidated.safetensors``, Llama 3's ``original/``)
_WEIGHT_PATTERNS = (
    ["model*.safetensors", "model.safetensors.index.json"],
    ["pytorch_model*.bin*"],
    ["flax_model*.msgpack*"],
)


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
        raise JaxseqError(f"cannot read {folder / 'config.json'}: {first_line(e)}") from None
    return apply_overrides(text_tower(config), num_labels=num_labels, **overrides)


TEXT_TOWER = "model.language_model."
"""Where a multimodal checkpoint keeps its text model's weights (``model.language_model.layers.0...``)."""


def text_tower(config):
    """The config of a multimodal checkpoint's text model (its ``text_config``, Gemma 4's ``gemma4_text``, with
    the checkpoint's ``tie_word_embeddings``), where jaxseq has that family and not the checkpoint's own; else
    ``config``."""
    text = None if config.model_type in FAMILIES else getattr(config, "text_config", None)
    if text is None or text.model_type not in FAMILIES:
        return config
    text = copy.deepcopy(text)
    text.tie_word_embeddings = config.tie_word_embeddings  # the whole model's, as transformers ties its head
    return text


def text_tower_weights(tensors: dict) -> dict:
    """A multimodal checkpoint's text model weights under the text model's own names (``TEXT_TOWER`` ->
    ``model.``, ``lm_head`` kept); the other towers' left out. Other checkpoints' as they are."""
    if not any(name.startswith(TEXT_TOWER) for name in tensors):
        return tensors
    text = {"model." + n[len(TEXT_TOWER) :]: t for n, t in tensors.items() if n.startswith(TEXT_TOWER)}
    return {**text, **{n: t for n, t in tensors.items() if n.startswith("lm_head.")}}


def position_limit(config) -> int | None:
    """The most positions a model of ``config`` takes, from the config field its family names
    (``Family.positions``); None where positions are relative and have no limit (T5)."""
    return family_for(config.model_type).position_limit(config)


def parse_overrides(text: str | None, config) -> dict:
    """``"n_layer=2,n_embd=128,resid_pdrop=0"`` -> typed values (the type of the config's current value,
    a number for an unset field, ``None`` for ``none``/``null``). Unknown field names are left for
    ``apply_overrides`` to report."""
    readable(config)
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
    config = readable(copy.deepcopy(config))
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise JaxseqError(f"{type(config).__name__} has no field {key!r}; check the override's spelling")
        setattr(config, key, value)
    kinds = getattr(config, "layer_types", None) or []
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and len(kinds) != config.num_hidden_layers:
        # the per-layer pattern of the new depth (and the per-layer fields that follow it), as the config class
        # makes them for a config of that depth
        fields = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}
        config = readable(type(config)(**{**fields, "layer_types": None}))
    if num_labels is not None and num_labels != config.num_labels:
        config.num_labels = num_labels
    return config


# --------------------------------------------------------------------------- building models


def _constructor(config, task, dtype, param_dtype, seed, execution: Execution):
    """The model's constructor; ``execution``: how its blocks run (``models.execution``)."""
    cls = model_class(config, task)
    return lambda: cls(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed), execution=execution)


def _initialising(shardings):
    """The setting to compile a random initialisation under: on one GPU, threefry lowers to CUDA's kernel
    instead of XLA's inline hash of every parameter, which made BERT-base's initialisation compile for
    minutes there (bench/gpu.py). Sharded initialisations keep the default: the kernel is a custom call
    that the partitioner would compute whole on every device."""
    devices = {d for s in jax.tree.leaves(shardings) for d in s.device_set}
    one_gpu = len(devices) == 1 and next(iter(devices)).platform == "gpu"
    return jax_config.threefry_gpu_kernel_lowering(one_gpu)


def _run_once(program, shardings):
    """``program()``, a jitted program run once: on the CPU compiled without LLVM's optimisations
    (``xla_backend_optimization_level`` 0), which compiles MiniLM's new head in 0.1 s instead of 0.35-0.4 s
    (while the first step compiles) and runs it in a millisecond either way."""
    cpu = all(device.platform == "cpu" for sharding in shardings for device in sharding.device_set)
    return program.lower().compile({"xla_backend_optimization_level": 0} if cpu else None)()


def _placement(mesh, abstract_state, model_type):
    """Sharding of every parameter: from its family's partition rules on a mesh, else the default device."""
    if mesh is None:
        return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract_state)
    specs = match_partition_rules(family_for(model_type).partition_rules, abstract_state)
    check_divisible(abstract_state, specs, mesh)
    return make_shardings(mesh, specs)


def abstract_model(
    config,
    task: str,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    execution: Execution = Execution(),
) -> nnx.Module:
    """The model of ``config`` for ``task`` with shapes and dtypes only: no weight is read or allocated.
    ``execution``: how its blocks run (``models.execution``)."""
    return nnx.eval_shape(_constructor(config, task, dtype, param_dtype, 0, execution))


def from_config(
    config,
    task: str,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    mesh=None,
    seed: int = 0,
    execution: Execution = Execution(),
):
    """A randomly initialised model (for pretraining from scratch), built under ``jit`` straight onto its
    shardings, so no device ever holds the whole model when a mesh is given. ``execution``: how its blocks run
    (``models.execution``: stacked and run by one scan or a Python loop, their attention kernel, remat, ...)."""
    make = _constructor(config, task, dtype, param_dtype, seed, execution)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    shardings = _placement(mesh, abstract_state, config.model_type)
    with _initialising(shardings):
        state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def load_pretrained(
    name_or_path: str | os.PathLike,
    task: str,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    mesh=None,
    num_labels: int | None = None,
    seed: int = 0,
    execution: Execution = Execution(),
    on_host: Collection[tuple] = (),
    **config_overrides,
):
    """Load a Hugging Face checkpoint (local folder or Hub id) as the NNX model for ``task``.

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype. With a ``mesh`` every weight goes
    straight from disk onto its sharding (its family's partition rules). A task head that
    the checkpoint lacks (a classifier on a base model) is initialised from ``seed`` and reported.
    ``execution``: how its blocks run (``models.execution``); with its blocks stacked and scanned
    (``scan_layers``, ``layers.Stacked``) each stacked weight is assembled on the host from its layers' tensors
    (one weight at a time) and each device receives only its slice. ``on_host``: module paths whose kernels stay
    on the host, NumPy arrays in the model (QLoRA's, quantised onto the devices one layer at a time).
    """
    if task not in TASKS:
        raise JaxseqError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    folder = resolve(name_or_path)
    config = load_config(folder, num_labels=num_labels, **config_overrides)
    family = family_for(config.model_type)
    make = _constructor(config, task, dtype, param_dtype, seed, execution)
    abstract = nnx.eval_shape(make)
    graphdef, abstract_state = nnx.split(abstract)
    layout = torch_layout(abstract)
    tensors, new_heads, dropped = match_names(family, set(layout), text_tower_weights(read_checkpoint(folder)))
    shardings = _placement(mesh, abstract_state, family.model_type)

    flat_shardings = dict(nnx.to_flat_state(shardings))
    flat_abstract = dict(nnx.to_flat_state(abstract_state))
    values = {}
    for path, names in stored_layout(abstract).items():
        if any(name not in tensors for name, _ in names.values()):  # a new head (match_names says which)
            continue
        want = flat_abstract[path].get_value()
        index = next(iter(names))  # None, a layer or an expert, or (layer, expert): the stacked axes
        shape = want.shape[0 if index is None else 1 if isinstance(index, int) else len(index) :]
        layers = [
            _read(tensors, name, transpose, shape, family.vocab_axis(path), config)
            for _, (name, transpose) in sorted(names.items())
        ]
        array = layers[0] if index is None else np.stack(layers).reshape(want.shape)
        array = np.asarray(array, dtype=want.dtype)
        values[path] = (
            array if path[-1] == "kernel" and path[:-1] in on_host else _put(array, flat_shardings[path].get_value())
        )
    if new_heads:
        logger.warning("initialised weights that the checkpoint lacks: %s", ", ".join(new_heads))
        wanted = [layout[n][0] for n in new_heads]  # a head is never stacked: its path is its own
        head_shardings = [flat_shardings[p].get_value() for p in wanted]
        init = jax.jit(
            lambda: [dict(nnx.to_flat_state(nnx.state(make())))[p].get_value() for p in wanted],
            out_shardings=head_shardings,
        )
        with _initialising(head_shardings):
            values.update(zip(wanted, _run_once(init, head_shardings)))
    if dropped:
        logger.warning("ignored checkpoint weights this task does not use: %s", some(dropped))
    for path, value in values.items():
        flat_abstract[path].set_value(value)
    return nnx.merge(graphdef, abstract_state)


def _read(tensors, name: str, transpose: bool, shape: tuple, vocab_axis: int | None, config) -> np.ndarray:
    """Checkpoint tensor ``name`` in our layout (``shape``, the vocabulary padded), checked against the config."""
    array = tensors[name]()
    array = array.T if transpose else array
    expected = list(shape)
    if vocab_axis is not None:
        expected[vocab_axis] = config.vocab_size
    if array.shape != tuple(expected):
        raise JaxseqError(
            f"weight {name} has shape {tuple(array.shape)} but the config gives {tuple(expected)}; "
            "check that config.json matches the weights"
        )
    return array if vocab_axis is None else resize_vocab(array, vocab_axis, shape[vocab_axis])


def _put(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Place a host array onto its sharding; each device receives only its own slice."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


# --------------------------------------------------------------------------- writing


def save_pretrained(model: nnx.Module, out_dir: str | os.PathLike, tokenizer=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (PyTorch names) and the tokenizer, if given, so that
    the matching transformers PyTorch class loads the folder with no missing or unexpected weights.
    In a multi-host run every process calls this (the shards are gathered); process 0 writes."""
    from safetensors.numpy import save_file  # the only writer of safetensors, imported when writing

    out = Path(out_dir)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    host = gather({path: v.get_value() for path, v in flat.items()})  # every process takes part
    if jax.process_index() != 0:
        return out
    family, tensors = family_for(model.config.model_type), {}
    for path, names in stored_layout(model).items():
        for layer, (name, transpose) in names.items():
            array = host[path] if layer is None else host[path][layer]
            vocab_axis = family.vocab_axis(path)
            if vocab_axis is not None:
                array = resize_vocab(array, vocab_axis, model.config.vocab_size)
            tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    config = copy.deepcopy(model.config)
    config.__dict__.pop(READABLE, None)  # jaxseq's (family.readable), not the model's
    config.architectures = [type(model).hf_architecture]
    with atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out
