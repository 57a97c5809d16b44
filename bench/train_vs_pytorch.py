"""jaxseq vs transformers PyTorch pretraining GPT-2 small (124M, random init), same settings, one run.

    python bench/train_vs_pytorch.py [--steps 10] [--warmup 3] [--repeats 2] [--json figures.json]

Settings (both sides): GPT-2 small's default config (dropout 0.1), batch 4 of 128-token blocks of Tiny
Shakespeare (GPT-2 tokenizer), AdamW (lr 6e-4, weight decay 0.01 on matrices, global-norm clip 1.0),
float32, one device / all of PyTorch's CPU threads. Each side runs in its own subprocess, so its peak
memory (max RSS) is its own; the sides alternate --repeats times and each keeps its fastest run (other
load on the machine only ever slows a run down, and PyTorch's OpenMP threads suffer most from it). jaxseq
runs the Trainer's jitted, donated train step as Trainer.train does (steps dispatched back to back, one sync
at the end); PyTorch runs eagerly. Speed is the wall time of --steps steps after the first (compiling) one
and --warmup more; compile time is reported apart. Model FLOPs utilisation is 6 N + 12 L d s FLOPs per
token (jaxseq.train.throughput) over the FLOP/s of a jitted float32 matmul measured in the same process
(before and after the steps; the higher counts). Targets: jaxseq >= 1.5x PyTorch's tokens/s, >= 75%
utilisation, peak memory no higher than PyTorch's. --profile DIR also writes a trace of two jaxseq steps
(open DIR/plugins/profile/*/perfetto_trace.json.gz in ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
BATCH, SEQ, LR, WEIGHT_DECAY = 4, 128, 6e-4, 0.01


def blocks(args):
    """[n, SEQ] token blocks of the text, with the GPT-2 tokenizer (cached by jaxseq.data.text)."""
    from transformers import GPT2TokenizerFast

    from jaxseq.data.text import TextDataConfig, load_blocks

    tokenizer = GPT2TokenizerFast(vocab=str(args.tokenizer / "vocab.json"), merges=str(args.tokenizer / "merges.txt"))
    train, _ = load_blocks(TextDataConfig(train_file=str(args.text)), tokenizer, SEQ, log=lambda _: None)
    return train


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_jaxseq(args) -> dict:
    import jax
    import numpy as np
    from transformers import GPT2Config

    from jaxseq.mesh import make_mesh
    from jaxseq.models import from_config
    from jaxseq.train.objectives import CausalLM
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.throughput import flops_per_token, measure_peak_flops
    from jaxseq.train.trainer import Trainer, TrainerConfig

    peak_before = measure_peak_flops()
    data = {"input_ids": np.asarray(blocks(args))}
    mesh = make_mesh("dp=1")
    model = from_config(GPT2Config(), "causal-lm", mesh=mesh, seed=0)
    flops = flops_per_token(model, SEQ) * SEQ * BATCH
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model,
            CausalLM(),
            TrainerConfig(output_dir=out, per_device_train_batch_size=BATCH, max_steps=10**6),
            OptimizerConfig(learning_rate=LR, weight_decay=WEIGHT_DECAY, lr_scheduler_type="constant"),
            data,
            {},
            mesh,
        )
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
        "tokens_per_second": BATCH * SEQ / seconds,
        "seconds_per_step": seconds,
        "compile_seconds": times[0] - seconds,
        "model_flops_per_second": flops / seconds,
        "matmul_peak_flops": peak,
        "mfu": flops / seconds / peak,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "max_rss_mb": max_rss_mb(),
    }


def run_pytorch(args) -> dict:
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    a = torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    torch.manual_seed(0)
    data = torch.as_tensor(np.asarray(blocks(args), np.int64))
    model = GPT2LMHeadModel(GPT2Config())
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}], lr=LR
    )
    order = np.random.default_rng(0).permutation(len(data))
    losses = []
    for step in range(1 + args.warmup + args.steps):
        if step == 1 + args.warmup:
            start = time.perf_counter()  # the same window as jaxseq's: batch building included
        batch = data[order[step * BATCH : (step + 1) * BATCH]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = (time.perf_counter() - start) / args.steps
    return {
        "tokens_per_second": BATCH * SEQ / seconds,
        "seconds_per_step": seconds,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "torch_matmul_peak_flops": 2 * 1024**3 / best,
        "threads": torch.get_num_threads(),
        "max_rss_mb": max_rss_mb(),
    }


def worker(args, side: str) -> dict:
    """Run one side in a fresh process (one device for JAX) and read back its figures."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--text",
        str(args.text),
        "--tokenizer",
        str(args.tokenizer),
    ]
    if args.profile and side == "jaxseq":
        cmd += ["--profile", str(args.profile)]
    result = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--worker", choices=("jaxseq", "pytorch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_jaxseq(args) if args.worker == "jaxseq" else run_pytorch(args)))
        return 0
    runs = {"jaxseq": [], "pytorch": []}
    for _ in range(args.repeats):
        for side in runs:
            runs[side].append(worker(args, side))
            print(f"{side}: {runs[side][-1]['tokens_per_second']:.1f} tokens/s", file=sys.stderr, flush=True)
    jax_result, torch_result = (max(r, key=lambda x: x["tokens_per_second"]) for r in runs.values())
    report = {
        "jaxseq": jax_result,
        "pytorch": torch_result,
        "speedup": jax_result["tokens_per_second"] / torch_result["tokens_per_second"],
        "memory_ratio": jax_result["max_rss_mb"] / torch_result["max_rss_mb"],
        "all_runs": {
            side: [{k: r[k] for k in ("tokens_per_second", "max_rss_mb")} for r in rs] for side, rs in runs.items()
        },
    }
    print(json.dumps(report, indent=2))
    print(
        f"tokens/s: jaxseq {jax_result['tokens_per_second']:.1f}, pytorch {torch_result['tokens_per_second']:.1f} "
        f"-> {report['speedup']:.2f}x (target >= 1.5x); jaxseq MFU {jax_result['mfu']:.1%} of "
        f"{jax_result['matmul_peak_flops'] / 1e9:.0f} GFLOP/s (target >= 75%); peak memory jaxseq "
        f"{jax_result['max_rss_mb']:.0f} MB, pytorch {torch_result['max_rss_mb']:.0f} MB (target <= 1x); "
        f"jaxseq compile {jax_result['compile_seconds']:.1f}s (not counted)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
