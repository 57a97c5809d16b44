"""The house rules the code keeps: no import circle among jaxseq's modules (imports inside functions and a
package's own ``__init__`` counted), imports of jaxseq's modules at the top of a file, and one-line errors
that survive an exception without a message."""

import ast
from pathlib import Path

import pytest

from jaxseq.errors import first_line

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "jaxseq").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(jaxseq module imported, whether at the top of the file) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name in known:
                # importing a.b.c runs the __init__ of a and a.b first
                parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
                found += [(m, id(node) in top) for m in (*parents, name) if m in known]
    return found


def test_no_import_circle():
    known = modules()
    graph = {name: {m for m, _ in imports(path, set(known)) if m != name} for name, path in known.items()}
    for name in graph:  # a package's __init__ is no circle with its own modules importing each other
        graph[name] -= {m for m in graph[name] if name.startswith(m + ".")}
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail(f"import circle: {' -> '.join(trail[trail.index(nxt) :] + [nxt])}")
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_jaxseq_imports_sit_at_the_top():
    known = set(modules())
    inside = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in [*(ROOT / "jaxseq").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
        for module, at_top in imports(path, known)
        if not at_top
    ]
    assert not inside, inside


def test_no_unguarded_first_line_of_a_message():
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("jaxseq", "scripts", "bench")
        for p in (ROOT / folder).rglob("*.py")
        if "splitlines()[0]" in p.read_text()
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    "error, expected",
    [
        (ValueError(""), "ValueError"),
        (OSError("\n\n  "), "OSError"),
        (KeyError("missing"), "'missing'"),
        (RuntimeError("\n  first real line \nsecond"), "first real line"),
        (RuntimeError("x" * 500), "x" * 200),
    ],
)
def test_first_line_survives_any_message(error, expected):
    assert first_line(error) == expected
