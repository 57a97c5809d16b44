"""jaxseq vs transformers PyTorch fine-tuning MiniLM on SST-2, same settings, measured in one run.

    python bench/glue_vs_pytorch.py [--train_samples 8000] [--model ../shared/models/all-MiniLM-L6-v2]

Settings (both sides): the first N SST-2 training examples, 1 epoch, batch 32, lr 5e-5 with linear decay
and no warmup, AdamW (weight decay 0.01 on matrices, global-norm clip 1.0), max length 64, float32, seed 0.
Both sides start from the same weights (the new classifier head is drawn once, by PyTorch, and saved) and
see the examples in the same order (jaxseq's, a function of the seed); only their dropout masks differ.
Wall time counts the training loop only (jaxseq's also holds its compilation and the final evaluation);
evaluation is on the full dev set. Prints both dev accuracies and the wall-time ratio.

jaxseq runs with packing, the script's default (several short examples per row of 64, the same math per
example; --no_pack passes --no_pack_sequences); PyTorch pads every example to 64 as run_glue.py does by default.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def run_jaxseq(args, out: Path, extra: tuple[str, ...] = ()) -> dict:
    """scripts/finetune_glue.py at the settings above; ``extra`` flags come last, so they win."""
    cmd = (
        [
            sys.executable,
            str(ROOT / "scripts" / "finetune_glue.py"),
            "--model_name_or_path",
            str(args.model),
            "--data_dir",
            str(args.glue),
            "--task_name",
            "sst2",
            "--output_dir",
            str(out),
            "--max_train_samples",
            str(args.train_samples),
            "--max_seq_length",
            "64",
            "--per_device_train_batch_size",
            "32",
            "--per_device_eval_batch_size",
            "128",
            "--num_train_epochs",
            "1",
            "--learning_rate",
            "5e-5",
            "--weight_decay",
            "0.01",
            "--lr_scheduler_type",
            "linear",
            "--logging_steps",
            "50",
            "--seed",
            "0",
            "--compilation_cache_dir",
            "",
        ]
        + (["--no_pack_sequences"] if args.no_pack else [])
        + list(extra)
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run(cmd, check=True, env=env)
    results = json.loads((out / "all_results.json").read_text())
    return {
        "accuracy": results["eval_accuracy"],
        "train_seconds": results["train_runtime"],
        "compile_seconds": results["train_compile_seconds"],
        "trainable_parameters": results["trainable_parameters"],
        "optimizer_state_bytes": results["optimizer_state_bytes"],
    }


def initial_model(model: Path, out: Path) -> Path:
    """MiniLM with a freshly drawn 2-way classifier head (seed 0), saved as the common starting point."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(0)
    BertForSequenceClassification.from_pretrained(model, num_labels=2).save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def run_pytorch(args) -> dict:
    import numpy as np
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification, get_linear_schedule_with_warmup

    from jaxseq.data.batches import epoch_order
    from jaxseq.data.glue import encode, get_task, load_split

    torch.manual_seed(0)
    task = get_task("sst2")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train = encode(task, load_split(task, "train", data_dir=args.glue)[: args.train_samples], tokenizer, 64)
    dev = encode(task, load_split(task, "validation", data_dir=args.glue), tokenizer, 64)
    model = BertForSequenceClassification.from_pretrained(args.model)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=5e-5
    )
    steps = len(train["labels"]) // 32
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, steps)
    order = epoch_order(len(train["labels"]), seed=0, epoch=0)  # jaxseq's order for seed 0
    tensors = {k: torch.as_tensor(v).long() for k, v in train.items()}
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        index = torch.as_tensor(order[step * 32 : (step + 1) * 32])
        batch = {k: v[index] for k, v in tensors.items()}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"pytorch step {step}/{steps} loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - start
    model.eval()
    predictions = []
    with torch.no_grad():
        for i in range(0, len(dev["labels"]), 128):
            batch = {k: torch.as_tensor(v[i : i + 128]).long() for k, v in dev.items() if k != "labels"}
            predictions.append(model(**batch).logits.argmax(-1).numpy())
    accuracy = float(np.mean(np.concatenate(predictions) == dev["labels"]))
    return {"accuracy": accuracy, "train_seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "all-MiniLM-L6-v2")
    parser.add_argument("--glue", type=Path, default=SHARED / "data" / "glue")
    parser.add_argument("--train_samples", type=int, default=8000)
    parser.add_argument("--no_pack", action="store_true", help="run jaxseq with --no_pack_sequences")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.model = initial_model(args.model, Path(tmp) / "initial")
        jax_result = run_jaxseq(args, Path(tmp) / "jaxseq")
        torch_result = run_pytorch(args)
    report = {
        "jaxseq": {**jax_result, "pack_sequences": not args.no_pack},
        "pytorch": torch_result,
        "accuracy_gap_points": 100 * (jax_result["accuracy"] - torch_result["accuracy"]),
        "wall_time_ratio": jax_result["train_seconds"] / torch_result["train_seconds"],
    }
    print(json.dumps(report, indent=2))
    print(
        f"dev accuracy: jaxseq {jax_result['accuracy']:.4f}, pytorch {torch_result['accuracy']:.4f} "
        f"({report['accuracy_gap_points']:+.2f} points); wall time jaxseq/pytorch = {report['wall_time_ratio']:.2f}x "
        f"(target <= 0.6x; jaxseq compile {jax_result['compile_seconds']:.1f}s included)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
