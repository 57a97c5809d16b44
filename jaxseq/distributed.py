"""Multi-host runs: JAX's multi-controller runtime, one process per host (or per GPU), started the same
way on every host. ``initialize`` must run before anything touches devices.

Explicitly: ``--coordinator_address host:port --num_processes N --process_id I`` on each process (or the
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment variables).
Automatically: wherever ``jax.distributed`` detects the cluster by itself (its cluster environments: SLURM,
Open MPI's ``mpirun``, Kubernetes, Cloud TPU pods), and under torchrun-style launchers (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), whose master becomes the coordinator (incomplete ones are
refused in one line). A plain single process needs nothing; N copies that found no peers still never write
one output dir together (``jaxseq.files.RunLock``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

from jaxseq.config import arg
from jaxseq.errors import JaxseqError, first_line

FLAGS = ("coordinator_address", "num_processes", "process_id")


@dataclasses.dataclass
class DistributedConfig:
    coordinator_address: str | None = arg(
        None,
        "multi-host: host:port of process 0, the same on every process (auto-detected under SLURM, Open MPI, "
        "Kubernetes, on TPU pods, from torchrun's MASTER_ADDR and from JAX_COORDINATOR_ADDRESS)",
    )
    num_processes: int | None = arg(None, "multi-host: how many processes take part (or JAX_NUM_PROCESSES)")
    process_id: int | None = arg(None, "multi-host: this process's rank, 0 .. num_processes - 1 (or JAX_PROCESS_ID)")


def _environment(config: DistributedConfig) -> dict:
    """The flags, each unset one taken from its ``JAX_*`` environment variable."""
    env = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES"}
    env["process_id"] = "JAX_PROCESS_ID"
    values = {}
    for name in FLAGS:
        value = getattr(config, name)
        if value is None and os.environ.get(env[name]):
            raw = os.environ[env[name]]
            try:
                value = raw if name == "coordinator_address" else int(raw)
            except ValueError:
                raise JaxseqError(f"{env[name]}={raw!r} is not an integer") from None
        if value is not None:
            values[name] = value
    return values


def detected_cluster() -> tuple[str, int] | None:
    """(name, process count) of the cluster ``jax.distributed.initialize()`` would join by itself, asked of
    JAX's own cluster environments; None outside any."""
    from jax._src.clusters import ClusterEnv

    for env in ClusterEnv._cluster_types:
        with warnings.catch_warnings():  # every pod without the kubernetes package would print jax's advice
            warnings.simplefilter("ignore")
            present = not env.opt_in_only_method and env.is_env_present()
        if present:
            return env.__name__, int(env.get_process_count())
    return None


def torchrun_coordinator(env=os.environ) -> dict | None:
    """The run a torchrun-style environment describes (``WORLD_SIZE`` > 1): its master's host with the next
    port (``MASTER_PORT`` is torch's own store; ``JAX_COORDINATOR_PORT`` picks another), ``WORLD_SIZE``
    processes, this one ``RANK``. None for a single process; one line if the variables are incomplete."""
    if int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise JaxseqError(
            f"WORLD_SIZE={env['WORLD_SIZE']} says this is one of several processes, but {', '.join(missing)} "
            "is not set; launch with torchrun, or pass --coordinator_address, --num_processes and --process_id"
        )
    port = env.get("JAX_COORDINATOR_PORT") or str(int(env["MASTER_PORT"]) + 1)
    return {
        "coordinator_address": f"{env['MASTER_ADDR']}:{port}",
        "num_processes": int(env["WORLD_SIZE"]),
        "process_id": int(env["RANK"]),
    }


def initialize(config: DistributedConfig) -> None:
    """Join the multi-process runtime if flags, the environment or a detected cluster ask for it; a no-op
    for a single process."""
    given = _environment(config)
    if len(given) < 3:
        cluster = detected_cluster()  # jax.distributed fills in what the flags leave unset
        if cluster is not None and cluster[1] <= 1 and not given:
            return
        if cluster is None:
            torchrun = torchrun_coordinator()
            if torchrun is not None:
                given = {**torchrun, **given}
            elif given:
                missing = sorted(set(FLAGS) - set(given))
                raise JaxseqError(
                    f"multi-host runs need --coordinator_address, --num_processes and --process_id "
                    f"together; missing --{', --'.join(missing)}"
                )
            else:
                return
    if {"process_id", "num_processes"} <= set(given) and not 0 <= given["process_id"] < given["num_processes"]:
        raise JaxseqError(f"--process_id {given['process_id']} is outside 0 .. {given['num_processes'] - 1}")
    import jax

    # CPU collectives between processes go through gloo (GPUs use NCCL, TPUs their own interconnect)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**given)
    except (RuntimeError, ValueError) as e:
        raise JaxseqError(
            f"cannot join the multi-host run at {given.get('coordinator_address') or 'the detected coordinator'}: "
            f"{first_line(e)}"
        ) from None
