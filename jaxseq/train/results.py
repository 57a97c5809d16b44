"""What a finished run writes: ``eval_results.json`` and ``all_results.json`` as transformers' scripts write
them, and the trained model as a Hugging Face folder (or a PEFT adapter)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax

from jaxseq.files import atomic_write


def write_results(
    output_dir: Path, results: dict, *, train_samples: int, eval_samples: int, extra_eval: dict | None = None
) -> dict:
    """``eval_results.json`` (the ``eval_*`` entries of ``Trainer.train``'s results, plus ``extra_eval``)
    and ``all_results.json`` (everything); the eval figures are printed on one line. Returns the eval entries."""
    eval_results = {
        **{k: v for k, v in results.items() if k.startswith("eval_")},
        **(extra_eval or {}),
        "eval_samples": eval_samples,
    }
    write_json(output_dir / "eval_results.json", eval_results)
    write_json(output_dir / "all_results.json", {**results, **eval_results, "train_samples": train_samples})
    if jax.process_index() == 0:
        print(" ".join(f"{k}={v:.4g}" for k, v in sorted(eval_results.items()) if isinstance(v, float)))
    return eval_results


def write_json(path: Path, values: dict) -> None:
    """Process 0 writes ``values`` to ``path`` (atomically); the others do nothing."""
    if jax.process_index() != 0:
        return
    atomic_write(path, json.dumps(values, indent=2, sort_keys=True) + "\n")


def export_model(trainer, output_dir: str | os.PathLike, tokenizer=None, *, base_model: str | None = None) -> Path:
    """The trained model into ``output_dir``: a Hugging Face folder (LoRA adapters merged into the weights),
    or with ``--lora_export adapter`` the adapter alone in PEFT's format. Evaluated parameters are exported
    (the moving average with ``--ema_decay`` and ``--eval_with_ema``). Every process calls this."""
    return trainer.training.export(trainer.eval_params(), trainer.frozen, output_dir, tokenizer, base_model=base_model)
