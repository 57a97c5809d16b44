"""Multi-host runs: JAX's multi-controller runtime, one process per host (or per GPU), started the same
way on every host. ``initialize`` must run before anything touches devices.

Explicitly: ``--coordinator_address host:port --num_processes N --process_id I`` on each process.
Automatically (no flags): where ``jax.distributed.initialize()`` detects the cluster by itself, i.e. under
SLURM (``srun``, one task per host or per GPU), on Cloud TPU pod slices, and with the ``JAX_COORDINATOR_ADDRESS``
/ ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment variables. A plain single process needs nothing.
"""

from __future__ import annotations

import dataclasses
import os

from jaxseq.config import arg
from jaxseq.errors import JaxseqError, first_line


@dataclasses.dataclass
class DistributedConfig:
    coordinator_address: str | None = arg(
        None,
        "multi-host: host:port of process 0, the same on every process (auto-detected under SLURM, "
        "on TPU pods and from JAX_COORDINATOR_ADDRESS)",
    )
    num_processes: int | None = arg(None, "multi-host: how many processes take part")
    process_id: int | None = arg(None, "multi-host: this process's rank, 0 .. num_processes - 1")


def _cluster_detected() -> bool:
    """Whether jax.distributed.initialize() finds a multi-process cluster without arguments."""
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        return True
    if int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1 and "SLURM_JOB_ID" in env:
        return True
    return bool(env.get("TPU_WORKER_HOSTNAMES", "").count(","))  # a pod slice lists more than one host


def initialize(config: DistributedConfig) -> None:
    """Join the multi-process runtime if flags or the environment ask for it; a no-op otherwise."""
    given = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
    if given and len(given) < 3:
        missing = sorted(set(dataclasses.asdict(config)) - set(given))
        raise JaxseqError(
            f"multi-host runs need --coordinator_address, --num_processes and --process_id "
            f"together; missing --{', --'.join(missing)}"
        )
    if not given and not _cluster_detected():
        return
    if given and not 0 <= config.process_id < config.num_processes:
        raise JaxseqError(f"--process_id {config.process_id} is outside 0 .. {config.num_processes - 1}")
    import jax

    # CPU collectives between processes go through gloo (GPUs use NCCL, TPUs their own interconnect)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
    except (RuntimeError, ValueError) as e:
        raise JaxseqError(
            f"cannot join the multi-host run at {config.coordinator_address or 'the detected coordinator'}: "
            f"{first_line(e)}"
        ) from None
