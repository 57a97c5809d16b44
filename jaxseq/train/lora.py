"""LoRA (Hu et al. 2021): train low-rank adapters ``A`` ``[in, r]`` and ``B`` ``[r, out]`` beside frozen
kernels, and export them merged into plain Hugging Face weights or as a PEFT adapter.

The model classes stay as they are. The trainer keeps two trees: the frozen parameters (never
differentiated, updated, donated or checkpointed) and the trainable ones, nested by the model's paths:
every adapter (``bert/encoder/layer/0/attention/self/query/lora_A``) plus the parameters a task head adds
(``classifier/kernel``; PEFT's ``modules_to_save``). Only the trainable tree reaches the gradient and the
optimizer state. In training, each adapted layer computes ``x W + b + (alpha / r) * dropout(x) A B``: its
``dot_general`` gains the adapter's branch for the step, so dropout acts on the adapter's input as in
PEFT and the frozen kernel's gradient is never formed. Evaluation and the merged export fold each
adapter into its kernel, ``W + (alpha / r) A B``, the same function without dropout.

``A`` starts as PEFT's does (Kaiming-uniform, bound ``1 / sqrt(in)``) and ``B`` at zero, so training starts
from the pretrained model. Adapters are sharded after their kernel: ``A``'s input dimension like the
kernel's first axis, ``B``'s output dimension like its last.

A saved adapter (``--lora_adapter``, a PEFT folder as ``save_adapter`` or PEFT writes it) loads back: its
rank, alpha, dropout, adapted layers and saved head decide the run's LoRA, and training continues from its
weights; ``merge_adapter`` folds it into a model's weights for evaluation, generation or export.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec as P

from jaxseq.config import arg
from jaxseq.errors import JaxseqError
from jaxseq.files import atomic_folder
from jaxseq.models.layers import Conv1D, dropout_with_key, layer_paths
from jaxseq.models.registry import family_for
from jaxseq.models.weights import resize_vocab, torch_layout
from jaxseq.sharding import STACKED, gather, match_partition_rules, path_string, unstacked_path
from jaxseq.train.quantize import BLOCK, QUANTIZE, dequantize, quantize

EXPORTS = ("merged", "adapter")
ADAPTER_HELP = (
    "a LoRA adapter folder in PEFT's format (adapter_config.json + adapter_model.safetensors, as "
    "--lora_export adapter writes it) for this base model"
)
_PREFIX = "base_model.model."
# PEFT's task_type by the transformers class a model mirrors
_PEFT_TASKS = {
    "ForSequenceClassification": "SEQ_CLS",
    "LMHeadModel": "CAUSAL_LM",
    "ForCausalLM": "CAUSAL_LM",
    "ForConditionalGeneration": "SEQ_2_SEQ_LM",
}


@dataclasses.dataclass
class LoraConfig:
    lora_rank: int = arg(0, "train rank-r LoRA adapters instead of every weight (0: full fine-tuning)")
    lora_alpha: float = arg(16.0, "adapter scale numerator: each adapted layer adds (alpha / rank) * x A B")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input during training, as PEFT's lora_dropout")
    lora_targets: str | None = arg(
        None,
        "the dense layers that get adapters: module names as PEFT's target_modules, comma-separated "
        "(e.g. 'q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj' for Llama), or a regex on parameter "
        "paths (e.g. '/(query|value)/kernel$'; default: attention query and value as in PEFT)",
    )
    lora_trainable: str | None = arg(
        None,
        "regex on parameter paths trained in full beside the adapters (PEFT's "
        "modules_to_save; default: the classification head, if the model has one)",
    )
    lora_adapter: str | None = arg(
        None,
        f"{ADAPTER_HELP}: training continues from its weights, with its rank, alpha, dropout, adapted layers and "
        "saved head (--lora_rank, --lora_targets, --lora_trainable are then taken from it)",
    )
    lora_export: str = arg(
        "merged",
        "what --output_dir receives: the adapters merged into plain Hugging Face "
        "weights, or the adapter alone in PEFT's format (adapter_config.json + "
        "adapter_model.safetensors)",
        choices=EXPORTS,
    )
    quantize: str = arg(
        "none",
        "QLoRA: store the frozen base weights of the blocks' dense layers quantised (nf4: 4-bit NormalFloat, "
        "an absmax scale per 64 inputs, as bitsandbytes; int8: a scale per output channel), dequantised "
        "one layer at a time where used; needs --lora_rank",
        choices=QUANTIZE,
    )

    def __post_init__(self):
        if self.lora_rank < 0:
            raise JaxseqError(f"--lora_rank must be 0 (off) or positive, got {self.lora_rank}")
        if self.quantize != "none" and not self.enabled:
            raise JaxseqError(f"--quantize {self.quantize} quantises LoRA's frozen weights; add --lora_rank (e.g. 16)")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise JaxseqError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        for flag in ("lora_targets", "lora_trainable"):
            try:
                re.compile(getattr(self, flag) or "")
            except re.error as e:
                raise JaxseqError(f"--{flag} {getattr(self, flag)!r} is not a valid regex ({e})") from None

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0 or bool(self.lora_adapter)


def target_pattern(targets: str) -> str:
    """The regex on kernel paths of ``--lora_targets``: module names (``q_proj,v_proj``) match the kernels of
    the modules so named, anything else is a regex already."""
    if re.fullmatch(r"\w+(\s*,\s*\w+)*", targets):
        return "(^|/)(" + "|".join(name.strip() for name in targets.split(",")) + ")/kernel$"
    return targets


def trained_in_full(model: nnx.Module, config: LoraConfig) -> list[tuple]:
    """The parameter paths LoRA trains in full: ``--lora_trainable``'s, else the task's head."""
    head = config.lora_trainable if config.lora_trainable is not None else getattr(type(model), "task_head", "")
    params = [path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    return [path for path in params if head and re.search(head, _name(path))]


def quantized_kernels(model: nnx.Module, config: LoraConfig) -> list[tuple]:
    """The module paths whose kernels QLoRA keeps quantised (none without ``--quantize``): every dense kernel
    inside the blocks that is not trained in full."""
    if config.quantize == "none":
        return []
    full = set(trained_in_full(model, config))
    in_block = lambda path: any(p == STACKED or str(p).isdigit() for p in path)
    return [
        path
        for path, m in nnx.iter_modules(model)
        if isinstance(m, nnx.Linear) and in_block(path) and (*path, "kernel") not in full
    ]


def _name(path) -> str:
    return "/".join(map(str, path))


def _keys(path) -> tuple[str, ...]:
    return tuple(map(str, path))


class Lora:
    """The adapters of one model: which kernels, their shapes and shardings, and the names they export under."""

    def __init__(self, config: LoraConfig, model: nnx.Module, param_specs):
        """``param_specs``: PartitionSpecs of the model's parameters (``nnx.split(model)[1]``'s structure).
        With ``config.lora_adapter`` the adapter's own settings and weights (``adapter_weights``) are used."""
        self.adapter = read_adapter(config.lora_adapter) if config.lora_adapter else None
        layout = torch_layout(model)
        self.layout = {path: (name, transposed) for name, (path, transposed) in layout.items()}  # unrolled paths
        if self.adapter is not None:
            where = layer_paths(nnx.state(model, nnx.Param))
            config = _adapter_config(
                config, *self.adapter, {name: where[path][0] for name, (path, _) in layout.items()}
            )
        self.config, self.rank = config, config.lora_rank
        self.scale = config.lora_alpha / config.lora_rank
        family = family_for(model.config.model_type)
        targets = config.lora_targets or family.lora_targets
        pattern = target_pattern(targets)
        dense = {path: m for path, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)}
        self.targets = {
            path: (m.in_features, m.out_features)
            for path, m in dense.items()
            if re.search(pattern, _name((*path, "kernel")))
        }
        experts = [  # a mixture of experts' stacked kernels, by their checkpoint paths (experts/0/w1/kernel)
            _name((*path, 0, name, "kernel"))
            for path, m in nnx.iter_modules(model)
            if getattr(m, "grouped", False)
            for name in m.names
        ]
        if any(re.search(pattern, name) for name in experts) or (experts and config.quantize != "none"):
            raise JaxseqError(
                f"LoRA and QLoRA cannot adapt or quantise the {family.model_type} model's experts (their kernels "
                "are multiplied together in grouped matmuls); target the attention projections, without --quantize"
            )
        if not self.targets:
            example = _name((*next(iter(dense)), "kernel")) if dense else "none"
            raise JaxseqError(
                f"--lora_targets {targets!r} matches no dense kernel of the {family.model_type} model "
                f"(they look like {example!r})"
            )
        self.full = trained_in_full(model, config)
        both = [_name(p) for p in self.full if p[-1] == "kernel" and p[:-1] in self.targets]
        if both:
            raise JaxseqError(
                f"{both[0]} is both adapted (--lora_targets) and trained in full (--lora_trainable); "
                "narrow one of the regexes"
            )
        flat_params = nnx.to_flat_state(nnx.state(model, nnx.Param))
        self.shapes = {path: v.get_value().shape for path, v in flat_params}
        self.dtypes = {path: v.get_value().dtype for path, v in flat_params}
        flat_specs = {path: v.get_value() for path, v in nnx.to_flat_state(param_specs)}
        self.kind = config.quantize
        self.quantized = quantized_kernels(model, config)
        odd = [_name(p) for p in self.quantized if self.kind == "nf4" and dense[p].in_features % 64]
        if odd:
            raise JaxseqError(f"--quantize nf4 needs inputs in blocks of 64; {odd[0]}/kernel has other; use int8")
        specs = {}
        for path in self.targets:  # a stacked kernel's leading layer axis stays on its adapters
            ndim = len(self.shapes[(*path, "kernel")])
            *layers, rows, columns = (tuple(flat_specs[(*path, "kernel")]) + (None,) * ndim)[:ndim]
            specs[(*path, "lora_A")] = P(*layers, rows, None)
            specs[(*path, "lora_B")] = P(*layers, None, columns)
        specs.update({path: flat_specs[path] for path in self.full})
        self.specs = _tree(specs)
        frozen = dict(flat_specs)  # with QLoRA, each quantised kernel's codes and scales sharded after it
        for path in self.quantized:
            ndim = len(self.shapes[(*path, "kernel")])
            *layers, rows, columns = (tuple(frozen.pop((*path, "kernel"))) + (None,) * ndim)[:ndim]
            frozen[(*path, "kernel", "codes")] = P(*layers, rows, columns)
            frozen[(*path, "kernel", "scales")] = P(*layers, rows if self.kind == "nf4" else None, columns)
        self.frozen_specs = traverse_util.unflatten_dict(frozen) if self.quantized else param_specs
        self.fan_in_fan_out = any(isinstance(dense[p], Conv1D) for p in self.targets)
        self.architecture = type(model).hf_architecture
        self.family, self.vocab_size = family, model.config.vocab_size

    # ------------------------------------------------------------------ the trainable tree

    def init(self, params, seed: int) -> dict:
        """The trainable tree, in float32 whatever the base's storage dtype: fresh adapters, and the task-head
        parameters taken from ``params`` (the model's state). Jit it with the adapters' shardings to build it
        in place."""
        flat = traverse_util.flatten_dict(params if isinstance(params, dict) else nnx.to_pure_dict(params))
        key = jax.random.key(seed)
        out = {}
        for i, (path, (fan_in, fan_out)) in enumerate(self.targets.items()):
            layers, bound = self.shapes[(*path, "kernel")][:-2], fan_in**-0.5  # layers: a stacked kernel's axis
            out[(*path, "lora_A")] = jax.random.uniform(
                jax.random.fold_in(key, i), (*layers, fan_in, self.rank), jnp.float32, -bound, bound
            )
            out[(*path, "lora_B")] = jnp.zeros((*layers, self.rank, fan_out), jnp.float32)
        out.update({path: flat[path].astype(jnp.float32) for path in self.full})
        return _tree(out)

    def adapter_weights(self) -> dict:
        """The trainable tree (``init``'s structure) holding the loaded adapter's weights, in float32 on the
        host: ``A`` ``[in, r]``, ``B`` ``[r, out]``, the head in our layout, vocabularies padded as the model's."""
        tensors = self.adapter[1]
        out = {}
        for path, (fan_in, fan_out) in self.targets.items():
            names = self._names((*path, "kernel"))
            for part, shape in (("lora_A", (self.rank, fan_in)), ("lora_B", (fan_out, self.rank))):
                layers = []
                for _, name in sorted(names.items()):
                    module = name.removesuffix(".weight")
                    if f"{_PREFIX}{module}.{part}.weight" not in tensors:  # adapted in other layers only
                        raise JaxseqError(
                            f"--lora_adapter has no {module}.{part}: a scanned model adapts every layer of a "
                            "kernel or none; run with --scan_layers false"
                        )
                    array = tensors[f"{_PREFIX}{module}.{part}.weight"].T
                    if part == "lora_B":
                        array = self._padded((*path, "kernel"), array)
                    if array.shape != shape[::-1]:
                        raise JaxseqError(
                            f"--lora_adapter {module}.{part} is {list(array.T.shape)}, this model needs "
                            f"{list(shape)}; pass the adapter of this base model"
                        )
                    layers.append(array)
                out[(*path, part)] = (layers[0] if None in names else np.stack(layers)).astype(np.float32)
        for path in self.full:
            name, transposed = self.layout[path]
            array = tensors[_PREFIX + name]
            array = self._padded(path, array.T if transposed else array)
            if array.shape != self.shapes[path]:
                raise JaxseqError(
                    f"--lora_adapter {name} is {list(array.shape)}, this model's is {list(self.shapes[path])}; "
                    "pass the adapter of this base model"
                )
            out[path] = array.astype(np.float32)
        return _tree(out)

    def fit_scales(self, mesh) -> None:
        """nf4 scales (a row per 64 inputs) whose rows do not split over their mesh axes (fewer blocks than
        fsdp shards, in small models) keep them whole: a sixteenth of their codes' bytes, replicated."""
        if not self.quantized:
            return
        flat = traverse_util.flatten_dict(self.frozen_specs)
        for path in self.quantized:
            spec = flat[(*path, "kernel", "scales")]
            *layers, rows, columns = tuple(spec) + (None,) * (len(self.shapes[(*path, "kernel")]) - len(spec))
            blocks = self.shapes[(*path, "kernel")][-2] // BLOCK
            axes = () if rows is None else rows if isinstance(rows, tuple) else (rows,)
            if blocks % math.prod(mesh.shape[a] for a in axes):
                flat[(*path, "kernel", "scales")] = P(*layers, None, columns)
        self.frozen_specs = traverse_util.unflatten_dict(flat)

    def freeze(self, params):
        """The frozen tree of the model's state ``params``: itself, or with QLoRA each quantised kernel replaced
        by ``{"codes", "scales"}`` (``jaxseq.train.quantize``)."""
        if not self.quantized:
            return params
        flat = {path: v.get_value() for path, v in nnx.to_flat_state(params)}
        for path in self.quantized:
            for part, array in quantize(flat.pop((*path, "kernel")), self.kind).items():
                flat[(*path, "kernel", part)] = array
        return traverse_util.unflatten_dict(flat)

    def _unfrozen(self, frozen, kernel) -> tuple[nnx.State, dict]:
        """``(state, quantised)``: the model's state from ``frozen``, each quantised kernel given by
        ``kernel(path, codes, scales)``, and those codes and scales by module path."""
        if not self.quantized:
            return frozen, {}
        flat = traverse_util.flatten_dict(frozen)
        parts = {path: {p: flat.pop((*path, "kernel", p)) for p in ("codes", "scales")} for path in self.quantized}
        for path, q in parts.items():
            flat[(*path, "kernel")] = kernel(path, q["codes"], q["scales"])
        return nnx.from_flat_state(flat), parts

    def merged(self, trainable: dict, frozen, *, fold: bool = True):
        """The model's full state: ``frozen`` (dequantised) with the trained task head and (``fold``) every
        adapter folded into its kernel, ``W + (alpha / r) A B``."""
        dequantized = lambda path, codes, scales: dequantize(codes, scales, self.kind, self.dtypes[(*path, "kernel")])
        return self._with(traverse_util.flatten_dict(trainable), self._unfrozen(frozen, dequantized)[0], fold)

    def _with(self, flat: dict, state, fold: bool):
        """``state`` with the trainable tree's (``flat``) head and, with ``fold``, its adapters folded in."""

        def leaf(path, w):
            key = tuple(path_string(path).split("/"))
            if key in flat:  # trained in full: float32 as it trains, the base's dtype once merged
                return flat[key].astype(w.dtype) if fold else flat[key]
            a = flat.get((*key[:-1], "lora_A"))
            if fold and key[-1] == "kernel" and a is not None:
                delta = jnp.matmul(a, flat[(*key[:-1], "lora_B")], precision=jax.lax.Precision.HIGHEST)
                return (w + self.scale * delta).astype(w.dtype)
            return w

        return jax.tree_util.tree_map_with_path(leaf, state)

    def training_model(self, graphdef, trainable: dict | None, frozen, key: jax.Array | None = None) -> nnx.Module:
        """The model as it trains: frozen kernels, each adapted layer computing its adapter's branch, with
        dropout on the adapter's input drawn from ``key`` (none without a key); with QLoRA each quantised
        layer dequantises its own kernel where it is used. ``trainable`` None: the base, adapters off."""
        # a quantised kernel's place holds an empty array (a stack's: one per layer); its dot ignores it
        state, quantized = self._unfrozen(
            frozen, lambda path, codes, _: jnp.zeros((*codes.shape[:-2], 0), self.dtypes[(*path, "kernel")])
        )
        flat = {} if trainable is None else traverse_util.flatten_dict(trainable)
        model = nnx.merge(graphdef, self._with(flat, state, fold=False))
        modules = dict(nnx.iter_modules(model))
        rate = self.config.lora_dropout if key is not None else 0.0
        for i, path in enumerate(self.targets if trainable is not None else ()):
            a, b = flat[(*_keys(path), "lora_A")], flat[(*_keys(path), "lora_B")]
            adapter_key = jax.random.fold_in(key, i) if rate else None
            if rate and a.ndim == 3:  # a stacked kernel's: one key per layer
                adapter_key = jax.random.split(adapter_key, a.shape[0])
            modules[path].dot_general = nnx.data(
                _AdapterDot((a, b), self.scale, rate, adapter_key, quantized.get(path), self._how(path))
            )
        for path in quantized.keys() - (self.targets.keys() if trainable is not None else set()):
            modules[path].dot_general = nnx.data(_AdapterDot(None, 0.0, 0.0, None, quantized[path], self._how(path)))
        return model

    def _how(self, path) -> tuple[str, jnp.dtype]:
        """``(quantisation, parameter dtype)`` of the kernel of the dense layer at ``path``."""
        return self.kind, self.dtypes[(*path, "kernel")]

    def describe(self, model_count: int, trainable_count: int) -> str:
        # a layer index, a stack's axis or a grouped stack's place and axis (``1::2/stacked``): any layer
        targets = sorted({re.sub(f"/(\\d+|(\\d+::\\d+/)?{STACKED})/", "/*/", _name(path)) for path in self.targets})
        full = sorted({_name(path) for path in self.full})
        kernels = sum(len(self._names((*path, "kernel"))) for path in self.targets)
        return (
            f"LoRA rank {self.rank} (alpha {self.config.lora_alpha:g}, dropout {self.config.lora_dropout:g}) on "
            f"{kernels} kernels ({', '.join(targets)}); trained in full: {', '.join(full) or 'nothing'}; "
            f"{trainable_count:,} trainable parameters, {100 * trainable_count / model_count:.2f}% of the "
            f"model's {model_count:,}"
        )

    # ------------------------------------------------------------------ PEFT export

    def save_adapter(
        self, trainable: dict, out_dir: str | os.PathLike, *, base_model: str | None, tokenizer=None
    ) -> Path:
        """``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT writes them (``lora_A.weight``
        ``[r, in]``, ``lora_B.weight`` ``[out, r]``, the task head under its own name), and the tokenizer.
        ``PeftModel.from_pretrained(base, out_dir)`` loads it. Every process calls this; process 0 writes."""
        from safetensors.numpy import save_file

        out = Path(out_dir)
        flat = traverse_util.flatten_dict(gather(trainable))
        if jax.process_index() != 0:
            return out
        tensors, targets, to_save = {}, [], set()
        for path in self.targets:
            for layer, name in self._names((*path, "kernel")).items():
                module = name.removesuffix(".weight")
                targets.append(module)
                for part in ("lora_A", "lora_B"):
                    array = flat[(*_keys(path), part)]
                    array = array if layer is None else array[layer]
                    if part == "lora_B":  # its columns are the kernel's: an LM head's run over the padded vocabulary
                        array = self._unpadded((*path, "kernel"), array)
                    tensors[f"base_model.model.{module}.{part}.weight"] = np.ascontiguousarray(array.T)
        for path in self.full:
            name, transposed = self.layout[path]
            array = self._unpadded(path, flat[_keys(path)])
            tensors[f"base_model.model.{name}"] = np.ascontiguousarray(array.T if transposed else array)
            to_save.add(name.rsplit(".", 1)[0])
        task = next((t for suffix, t in _PEFT_TASKS.items() if self.architecture.endswith(suffix)), None)
        config = {
            "peft_type": "LORA",
            "task_type": task,
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.config.lora_alpha,
            "lora_dropout": self.config.lora_dropout,
            "target_modules": sorted(targets),
            "modules_to_save": sorted(to_save) or None,
            "fan_in_fan_out": self.fan_in_fan_out,
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
        }
        with atomic_folder(out) as tmp:
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        return out

    def _names(self, path) -> dict[int | None, str]:
        """The PyTorch names of our parameter at ``path`` by layer: one per layer of a stacked one
        (``layers.Stacked``), else ``{None: name}``."""
        if STACKED not in path:
            return {None: self.layout[path][0]}
        return {i: self.layout[unstacked_path(path, i)][0] for i in range(self.shapes[path][0])}

    def _unpadded(self, path, array: np.ndarray) -> np.ndarray:
        """``array`` (shaped like the parameter at ``path`` along its vocabulary axis) trimmed to the real
        vocabulary, if ``path`` runs over the padded one (``Family.vocab_params``)."""
        axis = self.family.vocab_axis(path)
        return array if axis is None else resize_vocab(array, axis, self.vocab_size)

    def _padded(self, path, array: np.ndarray) -> np.ndarray:
        """``_unpadded``'s inverse: ``array`` padded to the parameter's padded vocabulary."""
        axis = self.family.vocab_axis(path)
        return array if axis is None else resize_vocab(array, axis, self.shapes[path][axis])


def read_adapter(folder: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """``(adapter_config.json, tensors)`` of a PEFT LoRA adapter folder; anything else is a one-line error."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not (config_file.is_file() and weights.is_file()):
        raise JaxseqError(
            f"--lora_adapter {folder} holds no adapter_config.json and adapter_model.safetensors; pass the "
            "--output_dir of a run with --lora_export adapter (or a PEFT LoRA adapter folder)"
        )
    config = json.loads(config_file.read_text())
    unsupported = [
        name
        for name, on in (
            (f"peft_type {config.get('peft_type')}", config.get("peft_type") != "LORA"),
            ("use_dora", config.get("use_dora")),
            ("use_rslora", config.get("use_rslora")),
            ("rank_pattern", config.get("rank_pattern")),
            ("alpha_pattern", config.get("alpha_pattern")),
        )
        if on
    ]
    if unsupported:
        raise JaxseqError(f"--lora_adapter {folder} uses {', '.join(unsupported)}, which jaxseq's LoRA does not have")
    return config, load_file(weights)


def _adapter_config(config: LoraConfig, adapter: dict, tensors: dict, paths: dict) -> LoraConfig:
    """``config`` with the adapter's rank, alpha and dropout, and regexes that match exactly the kernels it
    adapts and the parameters it saved in full (``paths``: PyTorch name -> where the model keeps it)."""
    rank = int(adapter["r"])
    if config.lora_rank not in (0, rank):
        raise JaxseqError(
            f"--lora_rank {config.lora_rank} differs from the rank {rank} of --lora_adapter {config.lora_adapter}; "
            "drop --lora_rank"
        )
    adapted, full = set(), set()
    for key in tensors:
        name = key.removeprefix(_PREFIX)
        module, dot, part = name.rpartition(".lora_")
        torch_name = f"{module}.weight" if dot else name
        if torch_name not in paths or (dot and part not in ("A.weight", "B.weight")):
            raise JaxseqError(
                f"--lora_adapter {config.lora_adapter} has {key}, which is no parameter of this model; "
                "pass the adapter of this base model"
            )
        (adapted if dot else full).add(_name(paths[torch_name]))
    exactly = lambda names: "^(" + "|".join(map(re.escape, sorted(names))) + ")$" if names else ""
    return dataclasses.replace(
        config,
        lora_rank=rank,
        lora_alpha=float(adapter["lora_alpha"]),
        lora_dropout=float(adapter.get("lora_dropout") or 0.0),
        lora_targets=exactly(adapted),
        lora_trainable=exactly(full),
    )


def merge_adapter(model: nnx.Module, folder: str | os.PathLike) -> nnx.Module:
    """``model`` (in place, and returned) with the PEFT adapter in ``folder`` merged: each adapted kernel
    ``W + (alpha / r) A B`` and the adapter's saved head in place of the model's, as PEFT's
    ``merge_and_unload``. The weights keep their shardings."""
    state = nnx.state(model)
    specs = match_partition_rules(family_for(model.config.model_type).partition_rules, state)
    lora = Lora(LoraConfig(lora_adapter=str(folder)), model, specs)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    nnx.update(model, jax.jit(lora.merged, out_shardings=shardings)(lora.adapter_weights(), state))
    return model


def adapted_model(model: nnx.Module, folder: str | os.PathLike) -> nnx.Module:
    """A model computing ``model`` with the PEFT adapter in ``folder`` beside it, unmerged: each adapted layer
    ``x W + (alpha / r) x A B`` (PEFT's model before ``merge_and_unload``), the adapter's saved head in place of
    the model's. ``model``'s weights are shared, not copied: several adapters cost their own weights alone."""
    state = nnx.state(model)
    specs = match_partition_rules(family_for(model.config.model_type).partition_rules, state)
    lora = Lora(LoraConfig(lora_adapter=str(folder)), model, specs)
    return lora.training_model(nnx.graphdef(model), jax.tree.map(jnp.asarray, lora.adapter_weights()), state)


class _AdapterDot(nnx.Module):
    """A dense layer's ``dot_general`` with the LoRA branch added, ``x W + scale * dropout(x) A B``, and/or
    (QLoRA) ``W`` dequantised from ``quantized``'s codes and scales in place of the kernel it is given. The
    adapters, codes, scales and dropout key are variables, so a scanned stack (``layers.Stacked``) gives each
    layer its own slice and dequantises that layer's kernel alone."""

    def __init__(self, adapter, scale: float, rate: float, key, quantized=None, how=("none", None)):
        self.adapter = None if adapter is None else nnx.data([nnx.Variable(w) for w in adapter])
        self.scale, self.rate, (self.kind, self.dtype) = scale, rate, how
        self.key = None if key is None else nnx.Variable(key)
        self.quantized = None if quantized is None else nnx.data({k: nnx.Variable(v) for k, v in quantized.items()})

    def __call__(self, x, kernel, dimension_numbers, precision=None, **kwargs):
        if self.quantized is not None:  # in the parameter's dtype, then the one the layer computes in
            q = self.quantized
            kernel = dequantize(q["codes"][...], q["scales"][...], self.kind, self.dtype).astype(kernel.dtype)
        y = jax.lax.dot_general(x, kernel, dimension_numbers, precision=precision, **kwargs)
        if self.adapter is None:
            return y
        if self.rate:
            x = dropout_with_key(x, self.rate, self.key[...])
        a, b = (w[...].astype(x.dtype) for w in self.adapter)
        h = jnp.matmul(jnp.matmul(x, a, precision=precision), b, precision=precision)
        return y + (self.scale * h).astype(y.dtype)


def _tree(flat: dict) -> dict:
    """Nested dicts with string keys (what orbax and ``path_string`` read back the same) from path tuples."""
    return traverse_util.unflatten_dict({_keys(path): value for path, value in flat.items()})
