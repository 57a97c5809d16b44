"""Partitioning: ordered regex rules -> PartitionSpecs -> NamedShardings on a (dp, fsdp, mp) mesh."""

from __future__ import annotations

import jax
import numpy as np


def gather(tree):
    """Every array of ``tree`` as a host numpy array (all shards assembled)."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
