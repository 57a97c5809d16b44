"""How a model's blocks run, one value passed to the family's constructor: whether they are stacked and scanned,
the attention kernel, what each block keeps for the backward pass (remat), whether each block gathers its fully
sharded weights itself, the devices a mixture of experts splits its experts over and where dropout masks are
drawn. Every module reads what it needs of it in its ``__init__``; nothing changes a model after it is built.
A run decides it once from its flags and mesh (``models.decide.decide_execution``); ``Execution()`` is a plain
model: unrolled blocks, XLA's attention, no remat, no gathering."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from jaxseq.errors import JaxseqError

REMAT_POLICIES = ("none", "full", "dots", "offload")
"""What a transformer block keeps for the backward pass (``Execution.remat``): ``none`` every activation (no
remat); ``full`` nothing inside the block, only its input (one more forward per block); ``dots`` the outputs of
the matmuls without batch dimensions (the dense layers', not attention's), recomputing the cheap elementwise work
around them; ``offload`` the same matmul outputs, moved to pinned host memory."""


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """The kernel an attention layer runs: ``name`` (xla, splash, cudnn); ``mesh``: splash runs per device under
    ``shard_map``, the batch split over dp and fsdp and the heads over mp; ``required``: chosen by name, so a
    shape it cannot take is an error rather than a fallback to XLA; ``interpret``: splash in Pallas interpret
    mode (its numerics on CPU, for tests); ``context``: the mesh whose ``cp`` axis splits each row's tokens (cp > 1):
    a model that splits its sequence (``attention.split_sequence``) attends over keys and values gathered from
    the whole ``cp`` group (``attention.context_attention``), None: every device holds whole rows."""

    name: str = "xla"
    mesh: Mesh | None = None
    required: bool = False
    interpret: bool = False
    context: Mesh | None = None


@dataclasses.dataclass(frozen=True)
class Gathering:
    """Fully-sharded data parallelism one block at a time (``layers.WeightGather``): each block casts its
    parameters sharded over ``axis`` to the dtype its layer computes in and gathers them to their partition spec
    (``rules``: the family's partition rules, matched on the block's own parameter paths) with ``axis`` taken
    out, inside its (rematerialised) call, so only one block's weights are whole at a time; the block's input
    stays split over the batch axes of ``mesh``."""

    mesh: Mesh
    rules: tuple = ()
    axis: str = "fsdp"


@dataclasses.dataclass(frozen=True)
class Execution:
    """``scan_layers``: the blocks stacked and run by one scan (``layers.Stacked``), else a Python loop;
    ``attention``: the kernel every attention layer runs (``attention.attend``); ``remat``: a ``REMAT_POLICIES``
    name; ``gather``: per-block weight gathering (fsdp > 1), None: off; ``experts``: the mesh whose ``ep`` axis
    splits a mixture of experts by expert (ep > 1), None: each device computes every expert; ``draws_ahead``: a
    scanned stack draws its blocks' dropout masks before the scan (``layers.Stacked``; CPU programs)."""

    scan_layers: bool = False
    attention: AttentionKernel = AttentionKernel()
    remat: str = "none"
    gather: Gathering | None = None
    experts: Mesh | None = None
    draws_ahead: bool = False

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise JaxseqError(f"unknown remat policy {self.remat!r}; choose one of {', '.join(REMAT_POLICIES)}")
