"""README's "Partitioning your own model" example runs as written and shards what it says."""

import re
from pathlib import Path

from jax.sharding import PartitionSpec as P

README = Path(__file__).resolve().parents[1] / "README.md"


def section_code(heading: str) -> str:
    text = README.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_partitioning_your_own_model_example(capsys):
    scope = {}
    exec(compile(section_code("Partitioning your own model"), "README.md", "exec"), scope)
    state, y = scope["state"], scope["y"]
    assert state["up"]["kernel"][...].sharding.spec == P("fsdp", "mp")
    assert {s.data.shape for s in state["up"]["kernel"][...].addressable_shards} == {(64, 64)}
    assert y.shape == (8, 64)
    assert "4 arrays" in capsys.readouterr().out
