"""The docs site: a page per job in mkdocs.yml's navigation, README kept a front page, tables that are generated
kept current, family lists complete, and the project speaking of itself alone."""

import re
from pathlib import Path

import yaml

from jaxseq.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_LINES = 300


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's navigation, in order, relative to docs/."""

    def walk(item) -> list[str]:
        if isinstance(item, str):
            return [item]
        if isinstance(item, list):
            return [page for entry in item for page in walk(entry)]
        return [page for value in item.values() for page in walk(value)]

    return walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])


def test_every_job_has_a_page_in_the_navigation():
    pages = nav_pages()
    missing = [job for job in COMMANDS if f"jobs/{job}.md" not in pages]
    assert not missing, f"jobs without a page in mkdocs.yml's nav: {missing}"
    for job in COMMANDS:
        text = (DOCS / "jobs" / f"{job}.md").read_text()
        assert text.startswith(f"# {job}"), f"docs/jobs/{job}.md should open with its job's name"
        assert re.search(rf"^(?:\$ )?(?:.*\| )?jaxseq {re.escape(job)} ", text, re.M), (
            f"docs/jobs/{job}.md shows no example"
        )


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    pages = nav_pages()
    assert [p for p in pages if not (DOCS / p).is_file()] == []
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(on_disk) - set(pages)) == []


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, (
        f"README.md has {len(lines)} lines; move the details to docs/ (at most {README_LINES})"
    )


def test_the_models_page_table_is_the_registrys():
    from jaxseq.models.registry import task_table

    text = (DOCS / "concepts" / "models.md").read_text()
    block = re.search(r"<!-- families:[^\n]*-->\n(.*?)\n<!-- /families -->", text, re.S)
    assert block, "docs/concepts/models.md lost its generated family table"
    assert block.group(1) == task_table(), "the Models page's table is stale: paste jaxseq.models.registry.task_table()"


def test_docs_family_lists_name_every_family():
    """A docs paragraph that lists the families (six or more) names every family that has a causal-lm model
    (architecture.md, the developers' map, names the families that reuse others' modules: test_house's)."""
    from jaxseq.models.registry import FAMILIES

    names = [f.name for f in FAMILIES.values()]
    causal = {f.name for f in FAMILIES.values() if "causal-lm" in f.tasks}
    named = lambda text: {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)}
    stale = []
    for page in DOCS.rglob("*.md"):
        if page.name == "architecture.md":
            continue
        paragraphs = re.split(r"\n\s*\n|\n- ", page.read_text())
        stale += [(page.name, p[:80]) for p in paragraphs if len(named(p)) >= 6 and not causal <= named(p)]
    assert not stale, f"family lists missing {sorted(causal)} members: {stale}"


SESSION_WORDS = re.compile(r"sessions? [0-9]+|issue #?[0-9]+|\(#[0-9]+\)", re.I)


def test_the_project_speaks_of_itself_alone():
    """No work-log words (numbered sessions, issue numbers) in what users and developers read."""
    paths = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    for folder in ("docs", "jaxseq", "scripts", "tests", "bench"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".md", ".py", ".json", ".yaml")]
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for p in paths
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if SESSION_WORDS.search(line)
    ]
    assert not found, "\n".join(found)
