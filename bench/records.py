"""What every bench writes beside its figures (date, machine, versions), and BENCHMARKS.md's generated tables.

A bench keeps its results in bench/results/NAME.json and renders its table from that file between the markers
``<!-- NAME: begin -->`` and ``<!-- NAME: end -->`` of BENCHMARKS.md, so the tables are never typed by hand.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"


def environment() -> dict:
    """Date, machine, library versions and the jaxseq commit of a run."""
    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {_memory_gib()} GiB",
        "versions": versions,
        "jaxseq_commit": commit.stdout.strip() or None,
    }


def cpu_model() -> str:
    """The CPU's name (/proc/cpuinfo's ``model name``: the same benchmark differs by vendor), else its
    architecture."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    return platform.processor() or platform.machine()


MATMUL = """
import time, jax, jax.numpy as jnp
a = jnp.ones((2048, 2048)); f = jax.jit(lambda a: a @ a); f(a).block_until_ready()
rates = []
for _ in range(5):
    start = time.perf_counter(); jax.block_until_ready([f(a) for _ in range(10)])
    rates.append(10 * 2 * 2048**3 / (time.perf_counter() - start) / 1e9)
print(sorted(rates)[2])
"""


def cpu_matmul_gflops() -> float:
    """A float32 [2048, 2048] product's rate on this CPU in JAX, GFLOP/s (the median of 5 runs of 10), in a
    fresh process: how fast the box was when a bench ran (shared boxes vary by a factor of 2-4)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    ran = subprocess.run([sys.executable, "-c", MATMUL], env=env, capture_output=True, text=True)
    if ran.returncode:
        raise SystemExit(f"the matmul measurement failed:\n{ran.stderr[-2000:]}")
    return round(float(ran.stdout.split()[-1]), 1)


def _memory_gib() -> int:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError):
        return 0


def read(name: str) -> dict:
    """bench/results/NAME.json, or {} before the first run."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write(name: str, results: dict) -> Path:
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def replace_table(name: str, text: str, path: Path = BENCHMARKS) -> None:
    """Put ``text`` between BENCHMARKS.md's markers of ``name`` (which must be there)."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    document = path.read_text()
    if begin not in document or end not in document:
        raise SystemExit(f"{path.name} has no {begin} ... {end} markers; add them where the table goes")
    start, stop = document.index(begin) + len(begin), document.index(end)
    path.write_text(document[:start] + "\n" + text.strip() + "\n" + document[stop:])


def write_markdown(name: str, markdown) -> int:
    """A bench's ``--markdown``: its table from bench/results/NAME.json into BENCHMARKS.md, and printed."""
    table = markdown(read(name))
    replace_table(name, table)
    print(table)
    return 0


def chosen_sides(parser, value: str, allowed: tuple[str, ...]) -> list[str]:
    """The comma-separated ``--sides`` of a bench, each one of ``allowed`` (else the parser's one-line error)."""
    sides = value.split(",")
    if unknown := set(sides) - set(allowed):
        parser.error(f"unknown --sides {', '.join(sorted(unknown))}; choose from {', '.join(allowed)}")
    return sides
