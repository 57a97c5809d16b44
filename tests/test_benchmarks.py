"""BENCHMARKS.md's tables are generated from bench/results/*.json (each bench's ``--markdown``), never typed."""

import importlib
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
TABLES = {
    "plans": "plans",
    "train": "train_vs_pytorch",
    "glue": "glue_vs_pytorch",
    "generate": "generate_vs_pytorch",
    "scan_layers": "scan_layers",
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_matches_its_results(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    records = importlib.import_module("records")
    bench = importlib.import_module(TABLES[name])
    results = records.read(name)
    assert results, f"bench/results/{name}.json is missing"
    document = records.BENCHMARKS.read_text()
    found = re.search(rf"<!-- {name}: begin -->\n(.*?)\n<!-- {name}: end -->", document, re.S)
    assert found, f"BENCHMARKS.md has no {name} markers"
    assert found.group(1) == bench.markdown(results).strip(), f"run: python bench/{TABLES[name]}.py --markdown"
    sys.modules.pop(TABLES[name], None)
