"""Partitioning, the public face: each model family's ordered ``(regex, PartitionSpec)`` rules
(``get_partition_rules``) and the machinery that applies them to any pytree (``jaxseq.sharding``)::

    rules = get_partition_rules("gpt2")
    specs = match_partition_rules(rules, params)  # first matching rule wins; an unmatched path is an error
    params = shard(params, make_shardings(mesh, specs))
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxseq.models.registry import family_for
from jaxseq.sharding import (
    Rules,
    check_divisible,
    describe,
    follow_params,
    gather,
    make_shardings,
    match_partition_rules,
    named_leaves,
    path_string,
    shard,
)

__all__ = [
    "Rules",
    "check_divisible",
    "describe",
    "follow_params",
    "gather",
    "get_partition_rules",
    "make_shardings",
    "match_partition_rules",
    "named_leaves",
    "path_string",
    "shard",
]


def get_partition_rules(model_type: str) -> list[tuple[str, P]]:
    """The Megatron-style rules of a jaxseq model family (they live beside the family's modules)."""
    return list(family_for(model_type).partition_rules)
