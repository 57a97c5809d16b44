"""Every flag a job documents is run by some test: its option strings (aliases, switches such as ``--bf16``
and ``--no_X`` included), read from the parser each job's ``main`` builds, are looked for in the other test
files' job invocations: a ``"--flag"`` string in a test (or in a helper, table or constant it uses) that
runs the job (by name, script, or command module), a keyword of a helper that makes flags of its keywords
(``f"--{name}"``), or a key of a YAML file given to it with ``--config``. A job's own sections count per job;
the sections every training job shares (``runner.SHARED``'s and ``ModelSource``), ``--config``, ``--debug``
and the ``--no_X`` switches (one mechanism for every flag) count for any job's test ("any job: --flag")."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from pathlib import Path

from jaxseq import runner
from jaxseq.commands import COMMANDS

TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS.parent / "scripts"
FLAG = re.compile(r"--[a-z][a-z0-9_]*")
YAML_KEY = re.compile(r"^\s*([a-z][a-z0-9_]*)\s*:", re.MULTILINE)
COMMON_FLAGS = {"--config", "--debug"}


class _Parsed(Exception):
    """Raised from the parser a job's ``main`` builds, once built: nothing runs."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def job_parser(job: str) -> argparse.ArgumentParser:
    """The parser ``jaxseq JOB`` builds, taken as its ``main`` starts parsing."""
    module = importlib.import_module(f"jaxseq.commands.{COMMANDS[job][0]}")

    def grab(parser, *args, **kwargs):
        raise _Parsed(parser)

    parse = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = grab
    try:
        module.main([])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_known_args = parse
    raise AssertionError(f"jaxseq {job} parsed no flags")


def common_sections() -> set[str]:
    """The config sections every training job has: the runner's own and those each job declares alike."""
    jobs = [importlib.import_module(f"jaxseq.commands.{module}") for module, _ in COMMANDS.values()]
    declared = [
        {s.__name__ for s in job.JOB.sections.values()}
        for job in jobs
        if isinstance(getattr(job, "JOB", None), runner.Job)
    ]
    return {section.__name__ for section in runner.SHARED.values()} | set.intersection(*declared)


def documented_flags(job: str, common: set[str]) -> dict[str, bool]:
    """Each option string of ``job`` -> whether a test of any job may run it (else a test of ``job`` must)."""
    parser = job_parser(job)
    flags = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    flags[option] = group.title in common or option in COMMON_FLAGS or option.startswith("--no_")
    return flags


def script_jobs() -> dict[str, str]:
    """``scripts/NAME.py`` -> the job it runs."""
    modules = {module: job for job, (module, _) in COMMANDS.items()}
    jobs = {}
    for script in SCRIPTS.glob("*.py"):
        found = re.search(r"from jaxseq\.commands\.(\w+) import main", script.read_text())
        if found and found[1] in modules:
            jobs[script.name] = modules[found[1]]
    return jobs


class Unit:
    """A top-level statement of a test file, or one entry of a table of runs: the flags and YAML text it holds,
    the jobs it names, and the module's names it uses."""

    def __init__(self, nodes: list[ast.AST], aliases: dict[str, str], scripts: dict[str, str], entry=False):
        self.flags, self.yaml, self.jobs, self.uses, self.entry = set(), set(), set(), set(), entry
        self.calls: list[tuple[str, set[str]]] = []  # (function, its keyword arguments): flags, if it builds them
        self.builds = False  # turns names into flags (f"--{name}"): its dicts' keys are flags
        keys = set()
        docstrings = {
            id(n.value)
            for node in nodes
            for n in ast.walk(node)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
        }
        for node in nodes:
            for n in ast.walk(node):
                if isinstance(n, ast.Name):
                    self.uses.add(n.id)
                    if n.id in aliases:
                        self.jobs.add(aliases[n.id])
                elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
                    self._string(n.value, scripts)
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                    self.calls.append((n.func.id, {k.arg for k in n.keywords if k.arg}))
                    if n.func.id == "dict":
                        keys.update(k.arg for k in n.keywords if k.arg)
                elif isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant):
                    self.builds |= n.values[0].value == "--"
                elif isinstance(n, ast.Dict):
                    keys.update(k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        if self.builds:
            self.flags.update(f"--{key}" for key in keys if key.isidentifier())

    def _string(self, text: str, scripts: dict[str, str]) -> None:
        flag = FLAG.match(text)
        if flag and text[flag.end() :][:1] in ("", "="):
            self.flags.add(flag[0])
        if text in COMMANDS:
            self.jobs.add(text)
        self.jobs.update(job for script, job in scripts.items() if text.endswith(script))
        if "\n" in text:
            self.yaml.update(f"--{key}" for key in YAML_KEY.findall(text))


def units_of(tree: ast.Module, scripts: dict[str, str]) -> dict[str, list[Unit]]:
    """The file's units by the names they define; a table (a dict, list or tuple) whose entries name jobs is
    one unit an entry, each under the table's name."""
    modules = {module: job for job, (module, _) in COMMANDS.items()}
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxseq.commands"):
            inner = node.module.removeprefix("jaxseq.commands").lstrip(".")
            for name in node.names:
                job = modules.get(inner or name.name)
                if job is not None:
                    aliases[name.asname or name.name] = job
    units: dict[str, list[Unit]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            units.setdefault(node.name, []).append(Unit([node], aliases, scripts))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            if isinstance(value, ast.Dict):
                entries = [[k, v] if k is not None else [v] for k, v in zip(value.keys, value.values)]
            else:
                entries = [[e] for e in value.elts] if isinstance(value, (ast.List, ast.Tuple)) else []
            split = [Unit(entry, aliases, scripts, entry=True) for entry in entries]
            if not any(unit.jobs for unit in split):
                split = [Unit([value], aliases, scripts)]
            for target in targets:
                if isinstance(target, ast.Name):
                    units.setdefault(target.id, []).extend(split)
    return units


def flags_in(source: str, scripts: dict[str, str]) -> dict[str, set[str]]:
    """Job -> the flags the tests of one file run it with."""
    units = units_of(ast.parse(source), scripts)
    builders: dict[str, bool] = {}

    def builds(name: str) -> bool:
        """Whether the function ``name`` turns names into flags, or calls one that does."""
        if name not in builders:
            builders[name] = False  # while it is being worked out (recursion)
            group = units.get(name, ())
            builders[name] = any(u.builds or any(builds(used) for used in u.uses) for u in group)
        return builders[name]

    def reach(unit: Unit, seen: set[int]) -> tuple[set[str], set[str]]:
        """(jobs, flags) of ``unit`` and of the units it uses, transitively; the entries of a table it uses
        add their jobs only (each entry's flags are its own job's)."""
        jobs, flags = set(unit.jobs), unit.flags | (unit.yaml if "--config" in unit.flags else set())
        flags |= {f"--{keyword}" for name, keywords in unit.calls if builds(name) for keyword in keywords}
        for name in unit.uses:
            for used in units.get(name, ()):
                if id(used) not in seen:
                    seen.add(id(used))
                    more_jobs, more_flags = reach(used, seen)
                    jobs |= more_jobs
                    if not used.entry:
                        flags |= more_flags
        return jobs, flags

    run: dict[str, set[str]] = {}
    for unit in (u for group in units.values() for u in group):
        jobs, flags = reach(unit, {id(unit)})
        for job in jobs:
            run.setdefault(job, set()).update(flags)
    return run


def flags_run() -> dict[str, set[str]]:
    """Job -> the flags some test (of any file but this one) runs it with."""
    scripts = script_jobs()
    run: dict[str, set[str]] = {job: set() for job in COMMANDS}
    for path in sorted(TESTS.glob("test_*.py")):
        if path.name != Path(__file__).name:
            for job, flags in flags_in(path.read_text(), scripts).items():
                run[job] |= flags
    return run


def test_every_documented_flag_of_every_job_is_run_by_a_test():
    run, sections = flags_run(), common_sections()
    anywhere = set().union(*run.values())
    missing, common_missing = [], set()
    for job in COMMANDS:
        for flag, common in documented_flags(job, sections).items():
            if common and flag not in anywhere:
                common_missing.add(flag)
            elif not common and flag not in run[job]:
                missing.append(f"{job}: {flag}")
    missing += [f"any job: {flag}" for flag in sorted(common_missing)]
    assert not missing, f"{len(missing)} documented flag(s) no test runs:\n" + "\n".join(missing)


def test_the_scan_credits_each_job_the_flags_its_runs_pass():
    """Flags in invocations, helpers, constants, tables of runs and YAML configs count for the job run there;
    a docstring's or a message's do not, nor a table entry's for another entry's job."""
    source = '''
from jaxseq.commands import ner as tagger
SCRIPT = "scripts/pretrain_clm.py"
BASE = ["--learning_rate", "1e-3"]
CASES = {"a": ("finetune_glue.py", ["--task_name", "sst2"]), "b": ("run_qa.py", ["--doc_stride=32"])}
def helper(*flags):
    return run_jaxseq("mlm", *flags)
def test_mlm():
    """--not_a_flag in a docstring."""
    helper("--line_by_line", *BASE)
def test_clm(tmp_path):
    (tmp_path / "c.yaml").write_text("TrainerConfig:\\n  max_steps: 3\\n")
    subprocess.run([SCRIPT, "--config", str(tmp_path / "c.yaml")])
def test_ner():
    tagger.main(["--label_all_tokens"])
    assert "--plan_search must" in error
@pytest.mark.parametrize("case", CASES)
def test_case(case):
    run(*CASES[case], "--debug")
def as_flags(**changes):
    defaults = dict(learning_rate=0.1)
    return [a for k, v in {"max_steps": 2, **defaults, **changes}.items() for a in (f"--{k}", str(v))]
def glue_args(**changes):
    return ["finetune_glue.py", *as_flags(**changes)]
def test_glue():
    subprocess.run(glue_args(seed=3, timeout=9), timeout=60)
'''
    run = flags_in(source, script_jobs())
    assert run == {
        "mlm": {"--line_by_line", "--learning_rate"},
        "clm": {"--config", "--max_steps"},
        "ner": {"--label_all_tokens"},
        "glue": {"--task_name", "--debug", "--max_steps", "--learning_rate", "--seed", "--timeout"},
        "qa": {"--doc_stride", "--debug"},
    }
