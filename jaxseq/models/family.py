"""What jaxseq needs to know about a model family, declared in the family's folder
(``jaxseq/models/<model_type>/``) and listed once in ``models.registry``."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from jaxseq.errors import JaxseqError


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: its name, its NNX classes per task, how its PyTorch checkpoints are named and what its
    config says about its size.

    ``name`` is what people call it (``GPT-2``), shown wherever jaxseq lists its families.

    ``tasks`` maps a task (``causal-lm``, ``sequence-classification``, ...) to the NNX class; each class
    carries ``hf_architecture`` (the transformers PyTorch class it mirrors). Parameter paths mirror the
    PyTorch names, so the rest is a short table:

    - ``base_prefix``: attribute holding the base model in head classes (``transformer``, ``bert``);
      checkpoints of the bare base model lack it and are re-prefixed on load.
    - ``heads``: regexes of parameters that belong to a task head. A missing head is initialised and
      reported; a head of another task in the checkpoint is dropped and reported.
    - ``aliases``: checkpoint names that are copies of one of our parameters (tied weights).
    - ``fallbacks``: where to take a parameter from when the checkpoint lacks it (T5 v1.1 saved by
      transformers 5 stores its tied ``lm_head`` only as ``shared``).
    - ``ignore``: checkpoint names that are not parameters (old buffers such as ``attn.bias``).
    - ``partition_rules``: ordered ``(regex, PartitionSpec)`` pairs over ``/``-joined parameter paths
      (see ``jaxseq.partition``).
    - ``lora_targets``: regex of the kernels LoRA adapts by default (PEFT's defaults for the family).
    - ``vocab_params``: ``(regex, axis)`` pairs: the parameters (``/``-joined paths) whose ``axis`` runs
      over the vocabulary, padded to ``layers.padded_vocab_size``; checkpoints are padded with zeros on load
      and trimmed back to ``config.vocab_size`` on export.
    - ``positions``: the config field holding the most positions the model takes (``n_positions``), None
      where positions are relative and have no limit (T5); read through ``position_limit``.
    - ``flops``: ``flops(config, task, rows, seq_len, target_len, training) -> float``, the model FLOPs of one
      step from the config alone (``jaxseq.models.flops``); read through ``model_flops``.
    - ``scans``: ``scans(config) -> bool``, whether the config's blocks can run as one scan (None: always);
      ``--scan_layers auto`` unrolls those that cannot (layers of different sliding windows).
    """

    model_type: str
    name: str
    tasks: dict[str, type]
    base_prefix: str | None = None
    heads: tuple[str, ...] = ()
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    fallbacks: dict[str, str] = dataclasses.field(default_factory=dict)
    ignore: tuple[str, ...] = ()
    partition_rules: tuple = ()
    lora_targets: str = ""
    vocab_params: tuple[tuple[str, int], ...] = ()
    positions: str | None = "max_position_embeddings"
    flops: Callable[..., float] | None = None
    scans: Callable[[Any], bool] | None = None

    @property
    def is_encoder_decoder(self) -> bool:
        """Whether its models encode a source and decode a target (``seq2seq-lm``, T5)."""
        return "seq2seq-lm" in self.tasks

    def position_limit(self, config) -> int | None:
        """The most positions a model of ``config`` takes, None where there is no limit."""
        return getattr(config, self.positions, None) if self.positions else None

    def model_flops(
        self, config, task: str, rows: int, seq_len: int, target_len: int = 0, *, training: bool = True
    ) -> float:
        """Model FLOPs of one step over ``rows`` rows of ``seq_len`` tokens (an encoder-decoder's source; its
        target is ``target_len`` tokens): forward and backward when ``training``, else the forward pass. Only
        matrix products count, attention's causal half once (``jaxseq.models.flops``)."""
        if task not in self.tasks:
            raise JaxseqError(f"task {task!r} is not available for {self.name}; choose one of {', '.join(self.tasks)}")
        if self.flops is None:
            raise JaxseqError(f"jaxseq has no FLOP count for {self.name}")
        return float(self.flops(config, task, rows, seq_len, target_len, training))

    def is_head(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.heads)

    def is_ignored(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.ignore)

    def vocab_axis(self, path: str | tuple) -> int | None:
        """The vocabulary axis of the parameter at ``path`` (``/``-joined, or its names), or None if it has none."""
        path = path if isinstance(path, str) else "/".join(map(str, path))
        return next((axis for pattern, axis in self.vocab_params if re.search(pattern, path)), None)


READABLE = "allow_global_per_layer_attribute_access"
"""The config flag by which transformers lets a per-layer field be read as the global value."""


def readable(config):
    """``config``, its per-layer fields (transformers' ``per_layer_config``: Gemma 4's head sizes per layer
    kind) readable as the global values, which transformers refuses by default, also where jax compares two
    models' configs; the families with such fields read them per layer."""
    if getattr(config, "is_heterogeneous", False):
        setattr(config, READABLE, True)
    return config
