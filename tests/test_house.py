"""The house rules the code keeps: no import circle among jaxseq's modules (imports inside functions and a
package's own ``__init__`` counted), imports only down docs/architecture.md's rooms, imports of jaxseq's modules
at the top of a file, one-line errors that survive an exception without a message, a folder per model family and
no list of families written by hand."""

import ast
import importlib
import re
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


def rooms() -> list[list[str]]:
    """docs/architecture.md's rooms, top down: the paths each row of its table names (``jaxseq/train/`` a
    folder, ``jaxseq/commands/*.py`` a folder's files, ``mesh.py`` beside the row's first path)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## The rooms, from the top down", 1)[1].split("\n## ", 1)[0]
    found = []
    for line in table.splitlines():
        if line.startswith("| `"):
            names = re.findall(r"`([^`]+)`", line.split("|")[1])
            folder = str(Path(names[0]).parent)
            found.append([name if "/" in name else f"{folder}/{name}" for name in names])
    return found


def room_of(path: Path, table: list[list[str]]) -> int | None:
    rel = path.relative_to(ROOT).as_posix()
    for i, names in enumerate(table):
        for name in names:
            if name.endswith("/*.py") and Path(rel).parent.as_posix() == name[: -len("/*.py")]:
                return i
            if rel == name or (name.endswith("/") and rel.startswith(name)):
                return i
    return None


def test_the_rooms_name_real_paths():
    table = rooms()
    assert len(table) > 5
    for names in table:
        for name in names:
            assert list(ROOT.glob(name.rstrip("/"))), f"docs/architecture.md names {name}, which does not exist"


def test_imports_only_go_down_the_rooms():
    """An import (at the top, inside a function or a package's ``__init__``) of a module in a room above its own
    is an import pointing up; modules the table does not place are not checked."""
    known, table = modules(), rooms()
    up = []
    for name, path in known.items():
        room = room_of(path, table)
        for module, _ in imports(path, set(known)) if room is not None else ():
            other = room_of(known[module], table)
            if other is not None and other < room and not name.startswith(module + "."):
                up.append(f"{name} imports {module}, a room above it")
    assert not up, up


def test_every_family_is_a_folder_of_its_own():
    """``jaxseq/models/<model_type>/``: its NNX classes, its ``FAMILY`` (the registry's entry) and nothing of
    another family's besides what it builds on."""
    from jaxseq.models.registry import FAMILIES

    for model_type, family in FAMILIES.items():
        package = f"jaxseq.models.{model_type}"
        assert (ROOT / "jaxseq" / "models" / model_type / "__init__.py").is_file(), model_type
        assert importlib.import_module(package).FAMILY is family
        for task, cls in family.tasks.items():
            assert cls.__module__.startswith(package + "."), f"{model_type}'s {task} class lives in {cls.__module__}"
        assert family.name and family.flops is not None, model_type
    flat = [p.name for p in (ROOT / "jaxseq" / "models").glob("*.py") if p.stem in FAMILIES]
    assert not flat, f"a family's module outside its folder: {flat}"


def test_families_share_heads_not_each_others_folders():
    """A decoder family's language-model head and last-token classifier come from ``models/heads.py``: no family
    imports GPT-2's folder for them."""
    from jaxseq.models.registry import FAMILIES

    known = modules()
    for model_type in FAMILIES:
        if model_type == "gpt2":
            continue
        for name, path in known.items():
            if name.startswith(f"jaxseq.models.{model_type}."):
                borrowed = [m for m, _ in imports(path, set(known)) if m.startswith("jaxseq.models.gpt2")]
                assert not borrowed, f"{name} imports {borrowed}"


def family_lists(text: str) -> list[str]:
    """Lists of two or more families written out (``GPT-2, GPT-J or T5``, ``gpt2|gptj``) in ``text``."""
    from jaxseq.models.registry import FAMILIES

    names = sorted({n for f in FAMILIES.values() for n in (f.name, f.model_type)}, key=len, reverse=True)
    token = "(?<![\\w-])(?:" + "|".join(map(re.escape, names)) + ")(?![\\w-])"
    return re.findall(f"{token}(?:\\s*(?:,|/|\\||\\bor\\b|\\band\\b)\\s*{token})+", text)


def test_no_family_list_is_written_by_hand():
    """Lists of families shown to users (help, docstrings, errors) come from the registry
    (``registry.family_names``, ``task_table``), so a new family is one folder and one registry line."""
    assert family_lists("a GPT-2, GPT-J or Llama model; --model_type gpt2|gptj") == [
        "GPT-2, GPT-J or Llama",
        "gpt2|gptj",
    ]
    files = [*sorted((ROOT / "jaxseq" / "commands").glob("*.py")), ROOT / "jaxseq" / "generation.py"]
    files += [ROOT / "jaxseq" / "models" / "__init__.py", ROOT / "pyproject.toml"]
    found = {path.relative_to(ROOT).as_posix(): lists for path in files if (lists := family_lists(path.read_text()))}
    assert not found, found


def test_readme_family_lists_name_every_family():
    """A README sentence that lists the families (six or more of them) names every family that has a
    causal-lm model: a family added to the registry is added to README's prose too."""
    from jaxseq.models.registry import FAMILIES

    names = [f.name for f in FAMILIES.values()]
    causal = {f.name for f in FAMILIES.values() if "causal-lm" in f.tasks}
    named = lambda line: {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", line)}
    lines = (ROOT / "README.md").read_text().splitlines()
    # the generated task table's rows list each task's families (test_readme_task_table_is_the_registrys)
    lists = [line for line in lines if len(named(line)) >= 6 and not line.startswith("| `")]
    assert lists
    stale = [line[:100] for line in lists if not causal <= named(line)]
    assert not stale, f"README family lists missing {sorted(causal - set.intersection(*map(named, lists)))}: {stale}"


def test_readme_task_table_is_the_registrys():
    from jaxseq.models.registry import task_table

    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- families:[^\n]*-->\n(.*?)\n<!-- /families -->", text, re.S)
    assert block, "README.md lost its generated family table"
    assert block.group(1) == task_table(), "README's table is stale: paste jaxseq.models.registry.task_table()"
