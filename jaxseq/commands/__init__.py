"""The ``jaxseq`` command: ``jaxseq <job> [flags]``, one subcommand per job, each the same code and flags as
its script in ``scripts/`` (``jaxseq glue`` is ``python scripts/finetune_glue.py``). A job's module is
imported only when it runs, so ``jaxseq --help`` answers at once."""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import platform
import sys
import threading
from pathlib import Path

from jaxseq import __version__
from jaxseq.imports import torch_hidden

# subcommand -> (module under jaxseq.commands, what it does)
COMMANDS = {
    "glue": ("glue", "fine-tune a model on a GLUE task (transformers' run_glue.py flags)"),
    "clm": ("clm", "pretrain or keep training a causal language model (run_clm.py flags)"),
    "mlm": ("mlm", "pretrain or keep training a masked language model (run_mlm.py flags)"),
    "t5-mlm": ("t5_mlm", "pretrain T5 by span corruption (run_t5_mlm_flax.py flags)"),
    "chat": ("chat", "fine-tune a causal LM on chats, learning only the assistant's turns"),
    "dpo": ("dpo", "align a causal LM with preference pairs: DPO, IPO, hinge, robust DPO, SimPO, ORPO (as TRL)"),
    "grpo": ("grpo", "train a causal LM on your reward functions with GRPO, sampling in the loop (as TRL)"),
    "seq2seq": ("seq2seq", "fine-tune T5 on source/target pairs"),
    "ner": ("ner", "fine-tune an encoder to tag words: named entities (run_ner.py flags, seqeval metrics)"),
    "qa": ("qa", "fine-tune an encoder to answer questions from a context: SQuAD v1.1/v2.0 (run_qa.py flags)"),
    "generate": ("generate", "generate text with a causal or seq2seq language model (`jaxseq generate --help`)"),
    "push": ("push", "push a finished run's model, results and model card to the Hugging Face Hub"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxseq",
        description="Train, evaluate and run Hugging Face sequence models in JAX. "
        "`jaxseq JOB --help` lists a job's flags; `--config NAME` takes a YAML file or a shipped config "
        "by name (glue_sst2, glue_sst2_quick).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="jobs:\n" + "\n".join(f"  {name:<10}{help}" for name, (_, help) in COMMANDS.items()),
    )
    p.add_argument("--version", action="version", version=f"jaxseq {__version__}")
    p.add_argument("job", choices=tuple(COMMANDS), metavar="JOB", help=f"one of {', '.join(COMMANDS)}")
    return p


HUGE_PAGES = "glibc.malloc.hugetlb=1"
"""glibc's tunable: back the blocks malloc maps with transparent huge pages (``madvise``)."""
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def use_huge_pages() -> None:
    """Re-execute this process (``os.execve``: the same process id, its command line as it was) with
    ``GLIBC_TUNABLES`` asking glibc for transparent huge pages, which it reads only at process start. XLA:CPU
    allocates a step's temporaries anew at every step and frees them after; glibc maps each such block
    fresh, and the kernel faults in and zeroes it page by page: a 512 MiB temporary takes 533 ms a step
    in 4 KB pages (133k faults), 346 ms in huge pages (574), and is given back when freed. Only on Linux
    with glibc and huge pages not turned off, and once (the tunable is then set)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if HUGE_PAGES.split("=")[0] in tunables or platform.libc_ver()[0] != "glibc":
        return
    try:
        if "[never]" in THP_SETTING.read_text():
            return
    except OSError:  # no such setting: a kernel without transparent huge pages
        return
    env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, HUGE_PAGES)))}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def import_transformers_without_torch() -> None:
    """Import transformers as it runs where PyTorch is not installed (``imports.torch_hidden``). The jobs use
    its configurations, tokenizers and generation settings, never its PyTorch models, yet its configurations
    import torch (``configuration_utils`` -> ``modeling_rope_utils``): about 2 s of every command's start on
    two cores, ``--help`` included. transformers asks ``importlib.util.find_spec("torch")`` once and keeps
    the answer. Nothing to do where either is already imported."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        return
    advisory = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # its notice that PyTorch was not found
    try:
        with torch_hidden():
            import transformers

            transformers.utils.is_torch_available()  # asked (and cached) now, while torch is hidden
    finally:
        if advisory is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advisory


def exit_now(code: int) -> None:
    """End the process as Python would, less the interpreter's teardown: the non-daemon threads are joined
    (``threading``'s own shutdown), the ``atexit`` handlers run (trackers, logging), the standard streams
    are flushed, then ``os._exit``. A job has closed its files, checkpoints and trackers by the time it
    returns; the teardown only destroys objects (XLA's executables, JAX's caches, modules): about a second
    of a ``jaxseq ner`` run's 1.35 s from its return to its exit, on two cores."""
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first at exit
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run ``jaxseq JOB ARGS...``; returns the job's exit code. As the process's command (no ``argv``
    given), first in huge pages (``use_huge_pages``), with transformers imported without torch
    (``import_transformers_without_torch``), and ended by ``exit_now`` once the job returns."""
    command = argv is None
    if command:
        use_huge_pages()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:  # --help, --version, nothing, or a misspelt job: argparse answers
        parser().parse_args(argv[:1] or ["--help"])
    job = argv[0]
    if command:
        import_transformers_without_torch()
    module = importlib.import_module(f"jaxseq.commands.{COMMANDS[job][0]}")
    sys.argv[0] = f"jaxseq {job}"  # the program name argparse shows in the job's usage and errors
    code = module.main(argv[1:]) or 0
    if command:
        exit_now(code)
    return code
