"""jaxseq vs transformers PyTorch, one training step at a time, same settings, one run.

    python bench/train_vs_pytorch.py --model gpt2|bert [--sides jaxseq,pytorch_eager,...] [--repeats 2]
    python bench/train_vs_pytorch.py --markdown          # BENCHMARKS.md's table from bench/results/train.json

Jobs (``SETTINGS``): ``gpt2``, GPT-2 small pretraining (batch 4 x 128 tokens of Tiny Shakespeare); ``bert``,
sequence classification with a BERT of MiniLM-L6's shape on full rows of 16 x 128 tokens (the shape of a GLUE
fine-tune, no padding). Both sides: random init, dropout 0.1, AdamW (weight decay on matrices, global-norm clip
1.0), float32, one JAX device / all of PyTorch's CPU threads. PyTorch runs three ways: eager with AdamW as it
comes, eager with fused AdamW, and torch.compile'd with fused AdamW; jaxseq's ratio is against the fastest.
Each side runs in its own subprocess (its peak memory, max RSS, is its own); the sides alternate --repeats
times and each keeps its fastest run (other load only ever slows a run down). jaxseq runs the Trainer's jitted,
donated train step as Trainer.train does (steps dispatched back to back, one sync at the end). Speed is the
wall time of --steps steps after the first (compiling) one and --warmup more; compile time is given apart.
Utilisation is 6 N + 12 L d s FLOPs per token (jaxseq.train.throughput) over the FLOP/s of a float32 1024 x
1024 matmul measured in the same process, before and after (the higher counts): "of measured matmul", as this
is a CPU. --profile DIR writes a trace of two jaxseq steps (DIR/plugins/profile/*/perfetto_trace.json.gz).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import records

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
RESULTS = ROOT / "bench" / "results" / "train.json"
SIDES = ("jaxseq", "pytorch_eager", "pytorch_fused", "pytorch_compile")
"""pytorch_eager: transformers' model and torch.optim.AdamW as they come (a per-parameter loop on CPU);
pytorch_fused: the same with AdamW(fused=True); pytorch_compile: torch.compile(model) with the fused AdamW."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One benchmarked job: the model, its batch and its learning rate (both sides alike)."""

    description: str
    batch: int
    seq: int
    lr: float
    weight_decay: float = 0.01


SETTINGS = {
    "gpt2": Setting(
        "GPT-2 small (124M, GPT2Config(), random init, dropout 0.1), causal LM on Tiny Shakespeare", 4, 128, 6e-4
    ),
    "bert": Setting(
        "BERT of MiniLM-L6's shape (d 384, 6 layers, 12 heads, ffn 1536, vocab 30522, random init, dropout 0.1), "
        "2-way sequence classification of full rows of random tokens",
        16,
        128,
        5e-5,
    ),
}


def hf_config(model: str):
    """transformers' config of the benchmarked model (both sides build from it)."""
    from transformers import BertConfig, GPT2Config

    if model == "gpt2":
        return GPT2Config()
    return BertConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536, num_labels=2
    )


def training_rows(args) -> dict:
    """The training rows by name: GPT-2's token blocks of the text (GPT-2 tokenizer, cached by
    jaxseq.data.text), or BERT's full rows of random tokens with random labels."""
    import numpy as np

    setting = SETTINGS[args.model]
    if args.model == "bert":
        rng = np.random.default_rng(0)
        n = setting.batch * (2 + args.warmup + args.steps)
        ids = rng.integers(1000, hf_config("bert").vocab_size, (n, setting.seq), dtype=np.int32)
        ones = np.ones_like(ids)
        return {"input_ids": ids, "attention_mask": ones, "token_type_ids": 0 * ones, "labels": rng.integers(0, 2, n)}
    from transformers import GPT2TokenizerFast

    from jaxseq.data.text import TextDataConfig, load_blocks

    tokenizer = GPT2TokenizerFast(vocab=str(args.tokenizer / "vocab.json"), merges=str(args.tokenizer / "merges.txt"))
    train, _ = load_blocks(TextDataConfig(train_file=str(args.text)), tokenizer, setting.seq, log=lambda _: None)
    return {"input_ids": np.asarray(train)}


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_jaxseq(args) -> dict:
    import jax

    from jaxseq.cli import RuntimeConfig, start
    from jaxseq.data.glue import TASKS
    from jaxseq.models import from_config
    from jaxseq.train.objectives import CausalLM, SequenceClassification
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.spec import RunSpec
    from jaxseq.train.throughput import measure_peak_flops
    from jaxseq.train.trainer import Trainer
    from jaxseq.train.trainer_config import TrainerConfig

    setting = SETTINGS[args.model]
    mesh = start(RuntimeConfig(mesh="dp=1", compilation_cache_dir=""))  # as the jaxseq command starts
    peak_before = measure_peak_flops()
    data = training_rows(args)
    task = "causal-lm" if args.model == "gpt2" else "sequence-classification"
    model = from_config(hf_config(args.model), task, mesh=mesh, seed=0, dtype=jax.numpy.dtype(args.dtype))
    objective = CausalLM() if args.model == "gpt2" else SequenceClassification(TASKS["sst2"])
    with tempfile.TemporaryDirectory() as out:
        trainer_config = TrainerConfig(output_dir=out, per_device_train_batch_size=setting.batch, max_steps=10**6)
        optimizer = OptimizerConfig(
            learning_rate=setting.lr, weight_decay=setting.weight_decay, lr_scheduler_type="constant"
        )
        spec = RunSpec(mesh, model.config, task, objective, trainer_config, optimizer, dtype=args.dtype)
        trainer = Trainer(spec, model, data, {})
        del model
        batches = trainer.feed.batches()
        losses, times = [], []
        for _step in range(1 + args.warmup):
            start = time.perf_counter()
            trainer.state, metrics = trainer._train_step(trainer.state, next(batches))
            losses.append(float(metrics["loss"]))  # syncs: the compiling step is timed alone
            times.append(time.perf_counter() - start)
        # the timed steps run as Trainer.train runs them: dispatched back to back (the next batch is built
        # while the device works on the current step), synced once at the end
        start = time.perf_counter()
        pending = []
        for _ in range(args.steps):
            trainer.state, metrics = trainer._train_step(trainer.state, next(batches))
            pending.append(metrics["loss"])
        losses += [float(loss) for loss in pending]
        seconds = (time.perf_counter() - start) / args.steps
        if args.profile:
            with jax.profiler.trace(str(args.profile), create_perfetto_trace=True):
                for _ in range(2):
                    trainer.state, metrics = trainer._train_step(trainer.state, next(batches))
                jax.block_until_ready(metrics)
        trainer.close()
    # on a shared machine the peak moves with the load: measured before and after, the higher one counts
    peak = max(peak_before, measure_peak_flops())
    return {
        "seconds_per_step": seconds,
        "matmul_peak_flops": peak,
        "compile_seconds": times[0] - seconds,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "max_rss_mb": max_rss_mb(),
    }


def model_flops_per_step(model: str) -> float:
    """Training FLOPs of one step: the family's count from the config (``jaxseq.models.registry.model_flops``,
    causal attention counted over its lower triangle; nothing is built or computed)."""
    from jaxseq.models.registry import model_flops

    setting = SETTINGS[model]
    task = "causal-lm" if model == "gpt2" else "sequence-classification"
    return model_flops(hf_config(model), task, setting.batch, setting.seq)


def torch_peak_flops(size: int = 1024) -> float:
    import torch

    a = torch.randn(size, size)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def run_pytorch(args) -> dict:
    """transformers' PyTorch model; eager or torch.compile'd (``args.worker``), AdamW as it comes or fused."""
    import numpy as np
    import torch
    from transformers import BertForSequenceClassification, GPT2LMHeadModel

    setting = SETTINGS[args.model]
    peak_before = torch_peak_flops()
    torch.manual_seed(0)
    data = {k: torch.as_tensor(np.asarray(v, np.int64)) for k, v in training_rows(args).items()}
    config = hf_config(args.model)
    model = (GPT2LMHeadModel if args.model == "gpt2" else BertForSequenceClassification)(config)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": setting.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = args.worker in ("pytorch_fused", "pytorch_compile")
    optimizer = torch.optim.AdamW(groups, lr=setting.lr, fused=fused or None)
    forward = torch.compile(model) if args.worker == "pytorch_compile" else model
    order = np.random.default_rng(0).permutation(len(data["input_ids"]))
    losses, times = [], []
    for step in range(1 + args.warmup + args.steps):
        if step == 1 + args.warmup:
            start = time.perf_counter()  # the same window as jaxseq's: batch building included
        begin = time.perf_counter()
        rows = order[step * setting.batch : (step + 1) * setting.batch]
        batch = {k: v[rows] for k, v in data.items()}
        if args.model == "gpt2":
            batch["labels"] = batch["input_ids"]
        loss = forward(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - begin)
    seconds = (time.perf_counter() - start) / args.steps
    peak = max(peak_before, torch_peak_flops())
    return {
        "seconds_per_step": seconds,
        "matmul_peak_flops": peak,
        "compile_seconds": times[0] - seconds,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "threads": torch.get_num_threads(),
        "max_rss_mb": max_rss_mb(),
    }


def worker(args, side: str) -> dict:
    """Run one side in a fresh process (one device for JAX) and read back its figures."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--worker", side, "--model", args.model, "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--text", str(args.text), "--tokenizer", str(args.tokenizer)]
    if args.profile and side == "jaxseq":
        cmd += ["--profile", str(args.profile)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        raise SystemExit(f"{side} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summary(args, runs: dict[str, list[dict]]) -> dict:
    """The fastest run of each side, with tokens/s and model FLOPs utilisation, and jaxseq's ratios."""
    setting = SETTINGS[args.model]
    flops = model_flops_per_step(args.model)
    rows = {}
    for side, results in runs.items():
        best = dict(min(results, key=lambda r: r["seconds_per_step"]))
        best["tokens_per_second"] = setting.batch * setting.seq / best["seconds_per_step"]
        best["model_flops_per_second"] = flops / best["seconds_per_step"]
        best["mfu_of_measured_matmul"] = best["model_flops_per_second"] / best["matmul_peak_flops"]
        best["tokens_per_second_runs"] = [setting.batch * setting.seq / r["seconds_per_step"] for r in results]
        best["max_rss_mb_runs"] = [r["max_rss_mb"] for r in results]
        rows[side] = best
    pytorch = [side for side in rows if side.startswith("pytorch")]
    strongest = max(pytorch, key=lambda side: rows[side]["tokens_per_second"]) if pytorch else None
    entry = {
        **records.environment(),
        "settings": {
            "model": setting.description,
            "batch": setting.batch,
            "seq": setting.seq,
            "optimizer": f"AdamW lr {setting.lr} constant, weight decay {setting.weight_decay} on matrices, clip 1.0",
            "dtype": "float32",
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
            "repeats": args.repeats,
            "model_flops_per_step": flops,
        },
        "rows": rows,
        "strongest_pytorch": strongest,
    }
    if strongest and "jaxseq" in rows:
        entry["jaxseq_vs_strongest_pytorch"] = (
            rows["jaxseq"]["tokens_per_second"] / rows[strongest]["tokens_per_second"]
        )
    return entry


def markdown(results: dict) -> str:
    """BENCHMARKS.md's table: one block per model, one row per side."""
    lines = []
    for model, entry in results.items():
        settings = entry["settings"]
        lines += [
            f"**{model}**, {entry['date']}, {entry['machine']}, jax {entry['versions'].get('jax')}, torch "
            f"{entry['versions'].get('torch')}: {settings['model']}; batch {settings['batch']} x {settings['seq']}, "
            f"{settings['optimizer']}, {settings['dtype']}; fastest of {settings['repeats']} runs of "
            f"{settings['timed_steps']} steps each.",
            "",
            "| side | tokens/s (all runs) | s/step | MFU of measured matmul | peak memory | compile |",
            "|---|---|---|---|---|---|",
        ]
        for side, row in entry["rows"].items():
            runs = ", ".join(f"{t:.0f}" for t in row["tokens_per_second_runs"])
            compile_ = f"{row['compile_seconds']:.1f} s" if side in ("jaxseq", "pytorch_compile") else "-"
            lines.append(
                f"| {side} | **{row['tokens_per_second']:.1f}** ({runs}) | {row['seconds_per_step']:.3f} | "
                f"{row['mfu_of_measured_matmul']:.1%} of {row['matmul_peak_flops'] / 1e9:.0f} G | "
                f"{row['max_rss_mb']:.0f} MB | {compile_} |"
            )
        if "jaxseq_vs_strongest_pytorch" in entry:
            lines.append(
                f"| jaxseq / {entry['strongest_pytorch']} (the strongest PyTorch) | "
                f"**{entry['jaxseq_vs_strongest_pytorch']:.2f}x** | | | | |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(SETTINGS), default="gpt2", help="the benchmarked job")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (compiling) one")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; the fastest counts")
    parser.add_argument("--text", type=Path, default=SHARED / "data" / "text" / "tinyshakespeare.txt")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=SHARED / "data" / "tokenizers" / "gpt2",
        help="folder with GPT-2's vocab.json and merges.txt",
    )
    parser.add_argument("--profile", type=Path, help="write a JAX trace of two jaxseq steps here")
    parser.add_argument("--no_save", action="store_true", help="do not record the run in bench/results/train.json")
    parser.add_argument("--markdown", action="store_true", help="run nothing: write BENCHMARKS.md's table")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_jaxseq(args) if args.worker == "jaxseq" else run_pytorch(args)))
        return 0
    if args.markdown:
        return records.write_markdown("train", markdown)
    sides = records.chosen_sides(parser, args.sides, SIDES)
    runs = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side in sides:
            runs[side].append(worker(args, side))
            tokens = SETTINGS[args.model].batch * SETTINGS[args.model].seq / runs[side][-1]["seconds_per_step"]
            print(f"{side}: {tokens:.1f} tokens/s", file=sys.stderr, flush=True)
    entry = summary(args, runs)
    print(markdown({args.model: entry}))
    if not args.no_save:
        results = records.read("train")
        results[args.model] = entry
        print(f"wrote {records.write('train', results)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
