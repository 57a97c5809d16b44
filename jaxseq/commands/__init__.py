"""The ``jaxseq`` command: ``jaxseq <job> [flags]``, one subcommand per job, each the same code and flags as
its script in ``scripts/`` (``jaxseq glue`` is ``python scripts/finetune_glue.py``). A job's module is
imported only when it runs, so ``jaxseq --help`` answers at once."""

from __future__ import annotations

import argparse
import importlib
import sys

from jaxseq import __version__

# subcommand -> (module under jaxseq.commands, what it does)
COMMANDS = {
    "glue": ("glue", "fine-tune a model on a GLUE task (transformers' run_glue.py flags)"),
    "clm": ("clm", "pretrain or keep training a causal language model (run_clm.py flags)"),
    "mlm": ("mlm", "pretrain or keep training a masked language model (run_mlm.py flags)"),
    "t5-mlm": ("t5_mlm", "pretrain T5 by span corruption (run_t5_mlm_flax.py flags)"),
    "chat": ("chat", "fine-tune a causal LM on chats, learning only the assistant's turns"),
    "dpo": ("dpo", "align a causal LM with preference pairs: DPO, IPO, hinge, robust DPO, SimPO, ORPO (as TRL)"),
    "kto": ("kto", "align a causal LM with unpaired feedback, desirable or undesirable completions: KTO (as TRL)"),
    "reward": ("reward", "train a reward model on preference pairs: a one-output classifier, Bradley-Terry (as TRL)"),
    "distill": ("distill", "distil a teacher into a causal LM: GKD, on-policy or on the data (as TRL)"),
    "grpo": ("grpo", "train a causal LM on your reward functions with GRPO, sampling in the loop (as TRL)"),
    "seq2seq": ("seq2seq", "fine-tune T5 on source/target pairs"),
    "ner": ("ner", "fine-tune an encoder to tag words: named entities (run_ner.py flags, seqeval metrics)"),
    "qa": ("qa", "fine-tune an encoder to answer questions from a context: SQuAD v1.1/v2.0 (run_qa.py flags)"),
    "generate": ("generate", "generate text with a causal or seq2seq language model (`jaxseq generate --help`)"),
    "serve": ("serve", "serve a causal LM with OpenAI's API (completions, chat, streaming), batching continuously"),
    "eval": ("eval", "evaluate a causal LM on lm-evaluation-harness tasks, as `lm_eval --model hf` does"),
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


def main(argv: list[str] | None = None) -> int:
    """Run ``jaxseq JOB ARGS...`` (``sys.argv[1:]`` when ``argv`` is None); returns the job's exit code. The
    same from a script as from the command: nothing about the process is changed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:  # --help, --version, nothing, or a misspelt job: argparse answers
        parser().parse_args(argv[:1] or ["--help"])
    job = argv[0]
    module = importlib.import_module(f"jaxseq.commands.{COMMANDS[job][0]}")
    prog = sys.argv[0]
    sys.argv[0] = f"jaxseq {job}"  # the program name argparse shows in the job's usage and errors
    try:
        return module.main(argv[1:]) or 0
    finally:
        sys.argv[0] = prog
