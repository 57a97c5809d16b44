"""jaxseq vs transformers PyTorch fine-tuning MiniLM on a GLUE task, speed and accuracy from the same runs.

    python bench/glue_vs_pytorch.py --task sst2 [--seeds 0,1,2] [--sides jaxseq_packed,pytorch_dynamic_padding]
    python bench/glue_vs_pytorch.py --task mrpc      # length-heavy sentence pairs, 3 epochs at length 128
    python bench/glue_vs_pytorch.py --task rte_like  # RTE's sizes and lengths, from English text (see below)
    python bench/glue_vs_pytorch.py --task cola_like # short sentences at the same settings (SST-2's, CoLA's size)
    python bench/glue_vs_pytorch.py --markdown       # BENCHMARKS.md's table from bench/results/glue.json

Rows, for each seed, in turn (so that other load on the machine falls on every side):
- ``jaxseq_packed``: the ``jaxseq glue`` command with its default flags (packing on, evaluation in length buckets);
  its time is the whole command's wall time: start-up, data, compilation, training and the final evaluation.
- ``jaxseq_unpacked``: the same with ``--no_pack_sequences`` (one example per padded row).
- ``pytorch_dynamic_padding``: transformers' BertForSequenceClassification with dynamic padding (each batch
  padded to its longest example, as DataCollatorWithPadding does), eager, torch.optim.AdamW with fused=True
  (the Trainer's default ``adamw_torch_fused``; on 2 CPU cores MiniLM's update takes 28 ms fused, 92 ms
  as torch.optim.AdamW comes); its time is the training loop alone (no start-up, no compilation, no
  evaluation).
Both sides start from the same weights (the new classifier head drawn by PyTorch from the seed and saved),
see the examples in the same order (jaxseq's epoch order, a function of the seed), and use AdamW (weight
decay 0.01 on matrices, clip 1.0) with linear decay and no warmup, float32; only their dropout masks differ.
Accuracy is on the whole dev set. Results go to bench/results/glue.json under the task's name.

``rte_like`` stands in for RTE, the length-heavy task that is not in ../shared: 2490 training and 277 dev
pairs (RTE's sizes) in RTE's TSV format, written from ../shared/data/text's WikiText-2 at each run with a
fixed seed. A premise is a run of consecutive sentences whose word count is log-normal (median 36, sigma
0.8): with MiniLM's tokenizer the pairs average 66.9 of 128 tokens, 12.8% fill 128, and a batch of 16's
longest pair is 125.4 on average (RTE: 66.6, 12.6%, 126.6). The hypothesis is 6-12 words copied from the
premise (entailment) or from another sentence (not_entailment), half each, so its accuracy is not RTE's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import records

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SIDES = ("jaxseq_packed", "jaxseq_unpacked", "pytorch_dynamic_padding")
BASELINE = "pytorch_dynamic_padding"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One benchmarked fine-tune (both sides alike)."""

    task: str
    train_samples: int | None  # None: the whole training split
    epochs: int
    batch: int
    max_length: int
    lr: float = 5e-5
    synthetic: bool = False  # the data is written by ``write_rte_like``


SETTINGS = {
    "sst2": Setting("sst2", 8000, 1, 32, 64),  # short single sentences (13 tokens on average)
    "mrpc": Setting("mrpc", None, 3, 16, 128),  # sentence pairs, the longest task at hand (RTE-like settings)
    "rte_like": Setting("rte", None, 3, 16, 128, synthetic=True),  # RTE's sizes and lengths
    # CoLA's size (8551 short single sentences) at RTE's settings: SST-2's first 8551 (13 tokens on average)
    "cola_like": Setting("sst2", 8551, 3, 16, 128),
}


def wikitext_sentences(text_dir: Path) -> list[str]:
    """WikiText-2's valid and test sentences, detokenised (headings dropped)."""
    import re

    text = " ".join((text_dir / f"wikitext-2.{s}.tokens").read_text(encoding="utf-8") for s in ("valid", "test"))
    text = re.sub(r"\s*=[^=\n]*=\s*", " ", text)
    text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".").replace("<unk>", "thing")
    text = re.sub(r"\s+", " ", re.sub(r" ([,.;:!?)'])", r"\1", text).replace("( ", "("))
    return [s.strip() + "." for s in text.split(". ") if len(s.split()) >= 4]


def write_rte_like(folder: Path, text_dir: Path, seed: int = 0) -> Path:
    """An RTE folder (train.tsv, dev.tsv) of pairs with RTE's sizes and lengths; see the module's docstring."""
    import numpy as np

    rng, sentences = np.random.default_rng(seed), wikitext_sentences(text_dir)

    def pair():
        want = min(300, max(6, int(rng.lognormal(np.log(36), 0.8))))
        words, j = [], int(rng.integers(0, len(sentences) - 60))
        while len(words) < want:
            words, j = words + sentences[j].split(), j + 1
        words, size = words[:want], int(rng.integers(6, 13))
        if rng.random() < 0.5:
            source, label = words, "entailment"
        else:
            source, label = sentences[int(rng.integers(0, len(sentences)))].split() * 3, "not_entailment"
        start = int(rng.integers(0, max(1, min(len(words), len(source)) - size)))
        return " ".join(words), " ".join(source[start : start + size]).rstrip(".,") + ".", label

    (folder / "RTE").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 2490), ("dev", 277)):
        lines = ["index\tsentence1\tsentence2\tlabel"] + ["\t".join((str(i), *pair())) for i in range(n)]
        (folder / "RTE" / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def jaxseq_command(args, setting: Setting, seed: int, out: Path, packed: bool, extra=()) -> list[str]:
    """``jaxseq glue`` at ``setting``; ``extra`` flags come last, so they win."""
    cmd = [sys.executable, "-m", "jaxseq", "glue", "--model_name_or_path", str(args.initial), "--data_dir"]
    cmd += [str(args.glue), "--task_name", setting.task, "--output_dir", str(out), "--max_seq_length"]
    cmd += [str(setting.max_length), "--per_device_train_batch_size", str(setting.batch), "--num_train_epochs"]
    cmd += [str(setting.epochs), "--learning_rate", str(setting.lr), "--weight_decay", "0.01"]
    cmd += ["--lr_scheduler_type", "linear", "--seed", str(seed), "--compilation_cache_dir", ""]
    if setting.train_samples:
        cmd += ["--max_train_samples", str(setting.train_samples)]
    return cmd + ([] if packed else ["--no_pack_sequences"]) + list(extra)


def run_jaxseq(args, setting: Setting, seed: int, out: Path, packed: bool = True, extra=()) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    cmd = jaxseq_command(args, setting, seed, out, packed, extra)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"jaxseq glue failed:\n{result.stderr[-3000:]}")
    results = json.loads((out / "all_results.json").read_text())
    return {
        "accuracy": results["eval_accuracy"],
        **({"f1": results["eval_f1"]} if "eval_f1" in results else {}),
        "seconds": wall,
        "train_seconds": results["train_runtime"],
        "compile_seconds": results["train_compile_seconds"],
        "trainable_parameters": results["trainable_parameters"],
        "optimizer_state_bytes": results["optimizer_state_bytes"],
    }


def initial_model(model: Path, seed: int, out: Path) -> Path:
    """MiniLM with a 2-way classifier head drawn from ``seed``, saved as both sides' starting point."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(seed)
    BertForSequenceClassification.from_pretrained(model, num_labels=2).save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def run_pytorch(args, setting: Setting, seed: int) -> dict:
    import numpy as np
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification, get_linear_schedule_with_warmup

    from jaxseq.data.batches import epoch_order, steps_per_epoch
    from jaxseq.data.glue import compute_metrics, encode, get_task, load_split

    torch.manual_seed(seed)
    task = get_task(setting.task)
    tokenizer = AutoTokenizer.from_pretrained(args.initial)
    examples = load_split(task, "train", data_dir=args.glue)[: setting.train_samples]
    train = encode(task, examples, tokenizer, setting.max_length)
    dev = encode(task, load_split(task, "validation", data_dir=args.glue), tokenizer, setting.max_length)
    model = BertForSequenceClassification.from_pretrained(args.initial)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=setting.lr,
        fused=True,  # transformers' Trainer's default, its fastest AdamW on the CPU
    )
    per_epoch = steps_per_epoch(len(train["labels"]), setting.batch)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, per_epoch * setting.epochs)
    tensors = {k: torch.as_tensor(v).long() for k, v in train.items()}
    lengths = torch.as_tensor(train["attention_mask"].sum(-1))

    def padded(index):  # DataCollatorWithPadding: the batch cut to its longest example
        longest = int(lengths[index].max())
        return {k: v[index] if k == "labels" else v[index, :longest] for k, v in tensors.items()}

    model.train()
    start = time.perf_counter()
    for epoch in range(setting.epochs):
        order = epoch_order(len(train["labels"]), seed=seed, epoch=epoch)  # jaxseq's order
        for step in range(per_epoch):
            loss = model(**padded(torch.as_tensor(order[step * setting.batch : (step + 1) * setting.batch]))).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    model.eval()
    dev_tensors = {k: torch.as_tensor(v).long() for k, v in dev.items()}
    predictions = []
    with torch.no_grad():
        for i in range(0, len(dev["labels"]), 64):
            batch = {k: v[i : i + 64] for k, v in dev_tensors.items() if k != "labels"}
            predictions.append(model(**batch).logits.argmax(-1).numpy())
    metrics = compute_metrics(task, np.concatenate(predictions), dev["labels"])
    return {"accuracy": metrics["accuracy"], **({"f1": metrics["f1"]} if "f1" in metrics else {}), "seconds": seconds}


def summary(args, setting: Setting, seeds: list[dict]) -> dict:
    """Each side's mean and spread over the seeds, and jaxseq's ratios against PyTorch."""
    sides = list(seeds[0]["rows"])
    rows = {}
    for side in sides:
        runs = [s["rows"][side] for s in seeds]
        accuracy = [r["accuracy"] for r in runs]
        seconds = [r["seconds"] for r in runs]
        rows[side] = {
            "accuracy_mean": statistics.mean(accuracy),
            "accuracy_min": min(accuracy),
            "accuracy_max": max(accuracy),
            "seconds_mean": statistics.mean(seconds),
            "seconds_min": min(seconds),
            "seconds_max": max(seconds),
        }
    entry = {
        **records.environment(),
        "settings": {
            **dataclasses.asdict(setting),
            "model": "all-MiniLM-L6-v2 (BERT, 22.7M)",
            "dtype": "float32",
            "pytorch_optimizer": PYTORCH_OPTIMIZER,
        },
        "rows": rows,
        "seeds": seeds,
    }
    if BASELINE in rows:
        for side in sides:
            if side.startswith("jaxseq"):
                entry[f"{side}_time_ratio"] = rows[side]["seconds_mean"] / rows[BASELINE]["seconds_mean"]
                entry[f"{side}_accuracy_points"] = 100 * (rows[side]["accuracy_mean"] - rows[BASELINE]["accuracy_mean"])
    return entry


PYTORCH_OPTIMIZER = "torch.optim.AdamW(fused=True)"
TIMES = {
    "jaxseq_packed": "whole command (start-up, compilation, training, evaluation), default flags",
    "jaxseq_unpacked": "whole command, --no_pack_sequences",
    "pytorch_dynamic_padding": "training loop only",
}


def markdown(results: dict) -> str:
    lines = []
    for task, entry in results.items():
        s = entry["settings"]
        samples = f"the first {s['train_samples']}" if s["train_samples"] else "all"
        lines += [
            f"**{task}**, {entry['date']}, {entry['machine']}, jax {entry['versions'].get('jax')}, torch "
            f"{entry['versions'].get('torch')}: MiniLM-L6, {samples} training examples, {s['epochs']} epoch(s) of "
            f"batch {s['batch']}, max length {s['max_length']}, lr {s['lr']} linear; seeds "
            f"{', '.join(str(x['seed']) for x in entry['seeds'])}; PyTorch's optimizer "
            f"{s.get('pytorch_optimizer', 'torch.optim.AdamW (not fused)')}.",
            "",
            "| side | dev accuracy, mean (min-max) | time, mean (min-max) | what the time holds |",
            "|---|---|---|---|",
        ]
        for side, row in entry["rows"].items():
            lines.append(
                f"| {side} | {row['accuracy_mean']:.4f} ({row['accuracy_min']:.4f}-{row['accuracy_max']:.4f}) | "
                f"**{row['seconds_mean']:.1f} s** ({row['seconds_min']:.1f}-{row['seconds_max']:.1f}) | {TIMES[side]} |"
            )
        for side in ("jaxseq_packed", "jaxseq_unpacked"):
            if f"{side}_time_ratio" in entry:
                lines.append(
                    f"| {side} / {BASELINE} | {entry[f'{side}_accuracy_points']:+.2f} points | "
                    f"**{entry[f'{side}_time_ratio']:.2f}x** | |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=tuple(SETTINGS), default="sst2")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every side runs each")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "all-MiniLM-L6-v2")
    parser.add_argument("--glue", type=Path, default=SHARED / "data" / "glue")
    parser.add_argument("--no_save", action="store_true", help="do not record the run in bench/results/glue.json")
    parser.add_argument("--markdown", action="store_true", help="run nothing: write BENCHMARKS.md's table")
    args = parser.parse_args()
    if args.markdown:
        return records.write_markdown("glue", markdown)
    sides = records.chosen_sides(parser, args.sides, SIDES)
    setting = SETTINGS[args.task]
    if setting.synthetic:
        args.glue = write_rte_like(Path(tempfile.mkdtemp()) / "glue", SHARED / "data" / "text")
    seeds = []
    for seed in map(int, args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            args.initial = initial_model(args.model, seed, Path(tmp) / "initial")
            rows = {}
            for side in sides:
                if side == BASELINE:
                    rows[side] = run_pytorch(args, setting, seed)
                else:
                    rows[side] = run_jaxseq(args, setting, seed, Path(tmp) / side, packed=side == "jaxseq_packed")
                print(f"seed {seed} {side}: {json.dumps(rows[side])}", file=sys.stderr, flush=True)
        seeds.append({"seed": seed, "rows": rows})
    entry = summary(args, setting, seeds)
    print(markdown({args.task: entry}))
    if not args.no_save:
        results = records.read("glue")
        results[args.task] = entry
        print(f"wrote {records.write('glue', results)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
