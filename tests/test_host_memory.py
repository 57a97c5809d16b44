"""On the CPU, a run started by ``cli.start`` reuses the host memory of a step's temporaries instead of having
the kernel hand out (and zero) fresh pages at every step: counted as the process's page faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROGRAM = """
import json, resource, sys
import jax, jax.numpy as jnp
from jaxseq import cli
if sys.argv[1] == "start":
    cli.start(cli.RuntimeConfig(compilation_cache_dir=""))

@jax.jit
def step(a, b):  # a 128 MiB temporary: the product, which the sum cannot fuse into on the CPU
    return jnp.sum(jnp.sin(a @ b))

a, b = jnp.ones((8192, 64)), jnp.ones((64, 4096))
step(a, b).block_until_ready()
step(a, b).block_until_ready()
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(a, b).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults, "computes_on_cpu": cli.computes_on_cpu()}))
"""

TEMPORARY_PAGES = 8192 * 4096 * 4 // 4096


def faults_per_step(how: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    result = subprocess.run([sys.executable, "-c", PROGRAM, how], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_started_cpu_run_reuses_its_temporaries_pages():
    """Without: every step faults in all pages of its temporary. With: the heap settles after a few steps
    (glibc 2.36's memalign cannot always take the block just freed), then no step does."""
    plain, started = faults_per_step("plain"), faults_per_step("start")
    assert started["computes_on_cpu"]
    fresh = [sum(n > TEMPORARY_PAGES // 2 for n in run["faults"]) for run in (plain, started)]
    assert fresh[0] == 16 and fresh[1] <= 8, (plain, started)
