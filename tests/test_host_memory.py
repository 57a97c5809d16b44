"""On the CPU, XLA allocates a step's temporaries anew at every step and frees them after. The ``jaxseq``
command runs in transparent huge pages (``commands.use_huge_pages``): the kernel faults in a few hundred huge
pages a step instead of a hundred thousand small ones, and the freed temporaries still go back, so a started
run holds no more memory than a plain JAX program. (#34: glibc once set to keep them for reuse, one arena
without mmap or trimming, grew its heap by a whole temporary whenever one could not take the block just
freed: a QA step's 7 GiB, up to four times.)"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from jaxseq import commands

PROGRAM = """
import json, os, resource, sys
if sys.argv[1] == "command":
    from jaxseq import commands
    commands.use_huge_pages()  # as the jaxseq command starts: re-executes this program
import jax, jax.numpy as jnp
from jaxseq import cli
if sys.argv[1] == "command":
    cli.start(cli.RuntimeConfig(compilation_cache_dir=""))

@jax.jit
def step(a, b):  # a 128 MiB temporary: the product, which the sum cannot fuse into on the CPU
    return jnp.sum(jnp.sin(a @ b))

def resident_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

a, b = jnp.ones((8192, 64)), jnp.ones((64, 4096))
step(a, b).block_until_ready()
faults = []
for _ in range(16):  # one step at a time
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(a, b).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
jax.block_until_ready([step(a, b) for _ in range(8)])  # queued, as the trainer dispatches them
print(json.dumps({"resident_mib": resident_mib(), "faults": faults, "tunables": os.environ.get("GLIBC_TUNABLES")}))
"""

TEMPORARY_MIB = 8192 * 4096 * 4 / 2**20
TEMPORARY_PAGES = int(TEMPORARY_MIB * 256)


def run(how: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    result = subprocess.run([sys.executable, "-c", PROGRAM, how], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def huge_pages_on() -> bool:
    try:
        return platform.libc_ver()[0] == "glibc" and "[never]" not in commands.THP_SETTING.read_text()
    except OSError:
        return False


@pytest.mark.skipif(not huge_pages_on(), reason="transparent huge pages of Linux, glibc's allocator")
def test_the_command_faults_in_its_temporaries_in_huge_pages_and_gives_them_back():
    plain, command = run("plain"), run("command")
    assert plain["tunables"] is None and command["tunables"] == commands.HUGE_PAGES
    assert min(plain["faults"]) > TEMPORARY_PAGES // 2  # every step: each 4 KB page of its temporary
    assert max(command["faults"]) < TEMPORARY_PAGES // 20, command["faults"]
    assert command["resident_mib"] < plain["resident_mib"] + TEMPORARY_MIB / 2, (plain, command)
