"""The Python examples of README and the docs pages run as written and do what they say."""

import re
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MESH_PAGE = ROOT / "docs" / "concepts" / "mesh-and-partition-rules.md"
API_PAGE = ROOT / "docs" / "api.md"


def section_code(heading: str, path: Path = README) -> str:
    """The first Python block of the section ``## heading`` of ``path``."""
    text = path.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("path", [README, MESH_PAGE], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_partitioning_your_own_model_example(path, capsys):
    scope = {}
    exec(compile(section_code("Partitioning your own model", path), path.name, "exec"), scope)
    state, y = scope["state"], scope["y"]
    assert state["up"]["kernel"][...].sharding.spec == P("fsdp", "mp")
    assert {s.data.shape for s in state["up"]["kernel"][...].addressable_shards} == {(64, 64)}
    assert y.shape == (8, 64)
    assert "4 arrays" in capsys.readouterr().out
