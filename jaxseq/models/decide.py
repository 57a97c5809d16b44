"""How a run's model executes, decided once from the run's flags and mesh: the ``execution.Execution`` that its
family's constructor is given (``decide_execution``; ``train.spec.RunSpec.execution`` calls it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxseq.errors import JaxseqError
from jaxseq.mesh import mesh_platform
from jaxseq.models.attention import choose_kernel, splits_sequence
from jaxseq.models.execution import Execution, Gathering
from jaxseq.models.hub import abstract_model
from jaxseq.models.registry import family_for


def scans(scan_layers: str | bool, platform: str, remat: str, config) -> bool:
    """Whether a run on ``platform`` stacks and scans its blocks: ``scan_layers`` true or false (``--scan_layers``),
    or auto: on CPU, where a first run's compilation is a large share of its time (NER's and QA's BENCHMARKS
    rows) and the step is about as fast with its dropout masks drawn before the scan
    (``layers.Stacked.draws_ahead``), and under ``--remat full``; unrolled where the config's blocks cannot
    scan (``Family.scans``: layers whose kinds do not repeat a pattern, ``layers.repeating_period``).

    On an H100 (GPT-2 small widths, 16 x 1024 tokens) the scanned step took 46.0 ms against 45.0 unrolled
    at 12 blocks under full remat (at the same memory), 83.9 against 72.1 under dots, 99.3 against 65.6 without
    remat (24 blocks), and it compiles in about 6 s at any depth (unrolled: 10 s at 12 blocks, over a
    minute at 48). TPU plans with fsdp (v5e-8) hold no more per chip scanned (GPT-J-6B 11.21 GiB against
    12.44 unrolled, Llama-3-8B 14.52 against 14.05) and compile in a quarter of the time."""
    if isinstance(scan_layers, bool) or scan_layers != "auto":
        return scan_layers in (True, "true")
    if not (platform == "cpu" or remat == "full"):
        return False
    family_scans = family_for(config.model_type).scans
    return family_scans is None or family_scans(config)


def decide_execution(
    config,
    task: str,
    *,
    mesh: Mesh | None = None,
    dtype=jnp.float32,
    scan_layers: str | bool = False,
    attention: str = "xla",
    remat: str = "none",
    packed: bool = False,
    interpret: bool = False,
    say: Callable[[str], None] | None = None,
) -> Execution:
    """How the model of ``config`` for ``task`` runs on ``mesh`` (None: this process's default devices) in
    ``dtype`` (the compute dtype): its blocks scanned or not (``scans``), the attention kernel
    (``attention.choose_kernel``: ``auto`` resolved per backend and model, saying through ``say`` why it falls
    back to XLA; a kernel named that cannot apply is a one-line error; ``packed``: batches that pack several
    examples per row; ``interpret``: splash in Pallas interpret mode), the ``remat`` policy, per-block weight
    gathering with its family's partition rules when the mesh's fsdp > 1, the experts split over ep when ep > 1,
    each row's tokens split over cp when cp > 1 (the kernel's ``context``; a family whose model cannot split its
    sequence stops in one line) and dropout masks drawn before a scan on CPU."""
    platform = mesh_platform(mesh)
    scanned = scans(scan_layers, platform, remat, config)
    plain = lambda: abstract_model(config, task, dtype=dtype, execution=Execution(scan_layers=scanned))
    kernel = choose_kernel(attention, mesh, plain, packed=packed, interpret=interpret, say=say)
    sizes = {} if mesh is None else dict(mesh.shape)
    if sizes.get("cp", 1) > 1:
        if not splits_sequence(plain()):
            raise JaxseqError(
                f"{family_for(config.model_type).name} cannot split its sequence over cp (context parallelism runs "
                "the decoders that share Llama's attention and stack); use a mesh with cp=1"
            )
        kernel = dataclasses.replace(kernel, context=mesh)
    rules = tuple(family_for(config.model_type).partition_rules)
    return Execution(
        scan_layers=scanned,
        attention=kernel,
        remat=remat,
        gather=Gathering(mesh, rules) if sizes.get("fsdp", 1) > 1 else None,
        experts=mesh if sizes.get("ep", 1) > 1 else None,
        draws_ahead=platform == "cpu",
    )
