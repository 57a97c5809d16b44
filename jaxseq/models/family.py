"""What the loader needs to know about a model family, declared next to its modules."""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: its NNX classes per task and how its PyTorch checkpoints are named.

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
    """

    model_type: str
    tasks: dict[str, type]
    base_prefix: str | None = None
    heads: tuple[str, ...] = ()
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    fallbacks: dict[str, str] = dataclasses.field(default_factory=dict)
    ignore: tuple[str, ...] = ()
    partition_rules: tuple = ()
    lora_targets: str = ""
    vocab_params: tuple[tuple[str, int], ...] = ()

    def is_head(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.heads)

    def is_ignored(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.ignore)

    def vocab_axis(self, path: str | tuple) -> int | None:
        """The vocabulary axis of the parameter at ``path`` (``/``-joined, or its names), or None if it has none."""
        path = path if isinstance(path, str) else "/".join(map(str, path))
        return next((axis for pattern, axis in self.vocab_params if re.search(pattern, path)), None)
