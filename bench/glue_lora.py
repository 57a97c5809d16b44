"""LoRA vs full fine-tuning of MiniLM on SST-2 with jaxseq, on the GLUE benchmark's settings.

    python bench/glue_lora.py [--lora_rank 8] [--lora_learning_rate 1e-3]

Both runs use bench/glue_vs_pytorch.py's SST-2 settings (the first 8000 training examples, 1 epoch, batch 32,
linear decay, AdamW with weight decay 0.01, max length 64, packed rows, seed 0); full fine-tuning at lr 5e-5,
LoRA (adapters on query and value, the classifier trained in full) at --lora_learning_rate, since adapters
starting from zero want a larger step. Prints both dev accuracies, the trainable parameters and the bytes of
optimizer state each run holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from glue_vs_pytorch import SETTINGS, SHARED, initial_model, run_jaxseq


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "all-MiniLM-L6-v2")
    parser.add_argument("--glue", type=Path, default=SHARED / "data" / "glue")
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--lora_alpha", type=float, default=16.0)
    parser.add_argument("--lora_learning_rate", type=float, default=1e-3)
    parser.add_argument("--lora_targets", default=None, help="regex of adapted kernels (default: query, value)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    lora_flags = (
        "--lora_rank",
        str(args.lora_rank),
        "--lora_alpha",
        str(args.lora_alpha),
        "--learning_rate",
        str(args.lora_learning_rate),
        *(("--lora_targets", args.lora_targets) if args.lora_targets else ()),
    )
    with tempfile.TemporaryDirectory() as tmp:
        args.initial = initial_model(args.model, 0, Path(tmp) / "initial")
        full = run_jaxseq(args, SETTINGS["sst2"], 0, Path(tmp) / "full")
        lora = run_jaxseq(args, SETTINGS["sst2"], 0, Path(tmp) / "lora", extra=lora_flags)
    report = {
        "full": full,
        "lora": {**lora, "rank": args.lora_rank, "learning_rate": args.lora_learning_rate},
        "accuracy_gap_points": 100 * (lora["accuracy"] - full["accuracy"]),
        "optimizer_state_ratio": lora["optimizer_state_bytes"] / full["optimizer_state_bytes"],
    }
    print(json.dumps(report, indent=2))
    print(
        f"dev accuracy: full {full['accuracy']:.4f}, LoRA rank {args.lora_rank} {lora['accuracy']:.4f} "
        f"({report['accuracy_gap_points']:+.2f} points); optimizer state: full "
        f"{full['optimizer_state_bytes'] / 2**20:.1f} MiB, LoRA {lora['optimizer_state_bytes'] / 2**20:.2f} MiB "
        f"({100 * report['optimizer_state_ratio']:.2f}%); trainable parameters {full['trainable_parameters']:,} "
        f"vs {lora['trainable_parameters']:,}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
