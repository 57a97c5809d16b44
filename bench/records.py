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
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {_memory_gib()} GiB",
        "versions": versions,
        "jaxseq_commit": commit.stdout.strip() or None,
    }


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
