"""How a run finds its peers: the clusters jax.distributed detects (SLURM shown with two real processes),
torchrun's variables mapped to a coordinator (two real processes), launchers that say too little refused in
one line, and never two runs writing one output_dir."""

import os
import socket
import subprocess
import sys

import pytest

from jaxseq.distributed import DistributedConfig, initialize, torchrun_coordinator
from jaxseq.errors import JaxseqError
from jaxseq.files import RunLock

# what each process prints: how many processes joined, and which one it is
PROBE = (
    "import jax; from jaxseq.distributed import DistributedConfig, initialize; initialize(DistributedConfig()); "
    "print('joined', jax.process_count(), jax.process_index(), flush=True)"
)
CLEAN = ("SLURM_", "OMPI_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "JAX_", "KUBERNETES_", "TPU_")


def free_port(low: int = 0) -> int:
    """A port nobody listens on (at least ``low``)."""
    for port in [0] if low == 0 else range(low, 65536):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port from {low}")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)}
    return {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu", **extra}


def run_pair(env_of) -> list[str]:
    """Start two processes with ``env_of(rank)`` and return their outputs (both must succeed)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE], env=env_of(rank), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-2000:]
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outputs


def test_slurm_is_detected_by_jax_distributed():
    job = free_port(low=65535 - 2**12 + 1) - (65535 - 2**12 + 1)  # jax derives the port from the job id
    outputs = run_pair(
        lambda rank: clean_env(
            SLURM_JOB_ID=str(job),
            SLURM_STEP_NODELIST="localhost",
            SLURM_NTASKS="2",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
        )
    )
    assert sorted(line for out in outputs for line in out.splitlines() if line.startswith("joined")) == [
        "joined 2 0",
        "joined 2 1",
    ]


def test_torchrun_variables_map_to_a_coordinator():
    port = free_port()
    outputs = run_pair(
        lambda rank: clean_env(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1)
        )
    )
    assert sorted(line for out in outputs for line in out.splitlines() if line.startswith("joined")) == [
        "joined 2 0",
        "joined 2 1",
    ]


def test_torchrun_mapping_and_refusal():
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert torchrun_coordinator(env) == {"coordinator_address": "node0:29501", "num_processes": 4, "process_id": 3}
    assert torchrun_coordinator({**env, "JAX_COORDINATOR_PORT": "1234"})["coordinator_address"] == "node0:1234"
    assert torchrun_coordinator({"RANK": "0", "WORLD_SIZE": "1"}) is None  # one process: nothing to join
    with pytest.raises(JaxseqError, match=r"WORLD_SIZE=4 says .* MASTER_ADDR, MASTER_PORT is not set"):
        torchrun_coordinator({"RANK": "1", "WORLD_SIZE": "4"})


def test_half_given_flags_are_refused(monkeypatch):
    for name in [k for k in os.environ if k.startswith(CLEAN)]:
        monkeypatch.delenv(name)
    with pytest.raises(JaxseqError, match="missing --coordinator_address, --process_id"):
        initialize(DistributedConfig(num_processes=2))


def test_one_run_per_output_dir(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / RunLock.NAME).write_text(f"{socket.gethostname()} {holder.pid}")
        with pytest.raises(JaxseqError, match=rf"another run .* pid {holder.pid}. is writing to {tmp_path}"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path)  # its run died: taken over
    lock.acquire()
    assert (tmp_path / RunLock.NAME).read_text() == f"{socket.gethostname()} {os.getpid()}"
    with pytest.raises(JaxseqError, match="another run"):
        RunLock(tmp_path).acquire()  # held by a live run (this one)
    lock.release()
    assert not (tmp_path / RunLock.NAME).exists()
