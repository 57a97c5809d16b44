"""Scanned against unrolled transformer blocks (``scan_layers``, ``jaxseq.models.layers.Stacked``): the compile time
and the steady-state step time of the real train step (``jaxseq.train.step.TrainProgram.step``) of GPT-2 shapes at
several depths.

    python bench/scan_layers.py                      # CPU, tiny GPT-2 shapes at depths 6, 12, 24 (a minute or two)
    python bench/scan_layers.py --device gpu --dtype bfloat16 --width 768 --heads 12 --seq 1024 --batch 16 \\
        --vocab 50257 --depths 12,24,48              # GPT-2 small widths on one GPU

Each (depth, mode) row runs in its own process (a fresh JAX: no compilation cache, no autotuning results or
device memory carried over): it builds the model with random weights, lowers and compiles the jitted, donated
train step (AdamW, all dropout 0, random token ids), then times ``--steps`` steps after ``--warmup``, dispatched
back to back with one sync at the end. Rows: ``lower_seconds`` (tracing to StableHLO), ``compile_seconds`` (XLA),
``seconds_per_step``, ``hlo_bytes`` (the optimised program's text: its size in depth), the device's peak memory
where it reports one. Results merge into bench/results/scan_layers.json under the device's key (and the remat
policy's, if not none).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import records

MODES = ("unrolled", "scanned")


def run_row(args, depth: int, mode: str) -> dict:
    """One (depth, mode) row, in this process."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from transformers import GPT2Config

    from jaxseq.mesh import batch_sharding, make_mesh
    from jaxseq.models import decide_execution, from_config
    from jaxseq.train.objectives import AUTO_CHUNK, CausalLM
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.step import TrainProgram

    config = GPT2Config(
        n_layer=depth, n_embd=args.width, n_head=args.heads, n_positions=args.seq, vocab_size=args.vocab,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    mesh = make_mesh("dp=1", devices=jax.devices()[:1])
    dtype = jnp.dtype(args.dtype)
    execution = decide_execution(
        config, "causal-lm", mesh=mesh, dtype=dtype, scan_layers=mode == "scanned", attention=args.attention,
        remat=args.remat,
    )  # fmt: skip
    model = from_config(config, "causal-lm", dtype=dtype, mesh=mesh, seed=0, execution=execution)
    attention = execution.attention.name
    optimizer = OptimizerConfig(learning_rate=1e-4, weight_decay=0.01, lr_scheduler_type="constant")
    program = TrainProgram(model, CausalLM(chunk_tokens=AUTO_CHUNK), mesh, optimizer, total_steps=10**6, seed=0)
    state = program.init_state(nnx.state(model))
    del model
    ids = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq), dtype=np.int32)
    batch = jax.device_put({"input_ids": ids}, batch_sharding(mesh))

    start = time.perf_counter()
    lowered = program.step.lower(state, None, batch)
    lowered_at = time.perf_counter()
    step = lowered.compile()
    compiled_at = time.perf_counter()
    for _ in range(args.warmup):
        state, metrics = step(state, None, batch)
    jax.block_until_ready(metrics)
    start_steps = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, None, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start_steps) / args.steps
    return {
        "depth": depth,
        "mode": mode,
        "attention": attention,
        "lower_seconds": lowered_at - start,
        "compile_seconds": compiled_at - lowered_at,
        "seconds_per_step": seconds,
        "tokens_per_second": args.batch * args.seq / seconds,
        "loss": float(metrics["loss"]),
        "hlo_bytes": len(step.as_text()),
        "peak_memory_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
    }


def row_command(args, depth: int, mode: str) -> list[str]:
    flags = ("width", "heads", "seq", "batch", "vocab", "dtype", "remat", "attention", "steps", "warmup")
    return [
        sys.executable, __file__, "--worker", str(depth), mode,
        *(item for flag in flags for item in (f"--{flag}", str(getattr(args, flag)))),
    ]  # fmt: skip


def device_info(platform: str) -> dict:
    """The device the rows run on, from a short process of its own (this one keeps JAX unloaded)."""
    probe = "import jax, json; d = jax.devices()[0]; print(json.dumps([d.platform, d.device_kind, jax.device_count()]))"
    done = subprocess.run([sys.executable, "-c", probe], env=row_env(platform), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"no {platform} device: {done.stderr.strip().splitlines()[-1:]}")
    kind, name, count = json.loads(done.stdout.strip().splitlines()[-1])
    return {"platform": kind, "device": name, "device_count": count}


def row_env(platform: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cuda" if platform == "gpu" else platform, "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(records.ROOT), env.get("PYTHONPATH")]))
    return env


def markdown(results: dict) -> str:
    """BENCHMARKS.md's tables: one per device (and remat policy), a row per depth and mode."""
    lines = []
    for key, entry in results.items():
        s, env = entry["settings"], entry.get("environment", {})
        lines += [
            f"**{key}** ({env.get('date')}, jax {env.get('versions', {}).get('jax')}): GPT-2 shapes {s['width']} "
            f"wide, {s['heads']} heads, vocabulary {s['vocab']}, {s['batch']} x {s['seq']} tokens, {s['dtype']}, "
            f"remat {s['remat']}, mean of {s['steps']} steps.",
            "",
            "| blocks | mode | lower | compile | step | program (HLO text) | peak memory |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in entry["rows"]:
            if "error" in row:
                lines.append(f"| {row['depth']} | {row['mode']} | {row['error']} | | | | |")
                continue
            peak = row.get("peak_memory_bytes")
            lines.append(
                f"| {row['depth']} | {row['mode']} | {row['lower_seconds']:.2f} s | {row['compile_seconds']:.2f} s | "
                f"{1000 * row['seconds_per_step']:.1f} ms | {row['hlo_bytes'] / 1e6:.2f} MB | "
                + ("-" if peak is None else f"{peak / 2**30:.1f} GiB")
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "tpu"), help="the JAX platform to run on")
    parser.add_argument("--depths", default="6,12,24", help="comma-separated numbers of blocks")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {', '.join(MODES)}")
    parser.add_argument("--width", type=int, default=64, help="n_embd")
    parser.add_argument("--heads", type=int, default=4, help="n_head")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row")
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (GPT-2's: 50257)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--remat", default="none", help="remat policy of every block: none, full, dots, offload")
    parser.add_argument("--attention", default="auto", help="attention kernel: auto, xla, cudnn, splash")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    parser.add_argument("--row_timeout", type=float, default=600, help="seconds a row may take")
    parser.add_argument("--json", type=Path, default=records.RESULTS / "scan_layers.json", help="results file")
    parser.add_argument("--markdown", action="store_true", help="run nothing: write BENCHMARKS.md's tables")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.markdown:
        return records.write_markdown("scan_layers", markdown)
    if args.worker:
        print(json.dumps(run_row(args, int(args.worker[0]), args.worker[1])))
        return 0
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown --modes {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    device = device_info(args.device)
    settings = {k: getattr(args, k) for k in ("width", "heads", "seq", "batch", "vocab", "dtype", "remat", "steps")}
    rows = []
    for depth in map(int, args.depths.split(",")):
        for mode in modes:
            start = time.perf_counter()
            try:
                done = subprocess.run(
                    row_command(args, depth, mode), env=row_env(args.device), capture_output=True, text=True,
                    timeout=args.row_timeout,
                )  # fmt: skip
                row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
                error = None if row else done.stderr.strip().splitlines()[-3:]
            except subprocess.TimeoutExpired:
                row, error = None, f"did not finish in {args.row_timeout:g} s"
            row = row or {"depth": depth, "mode": mode, "error": error}
            row["wall_seconds"] = time.perf_counter() - start
            rows.append(row)
            print(json.dumps(row), flush=True)
    with contextlib.suppress(OSError):  # no git where the bench runs: no commit recorded
        device["environment"] = records.environment()
    results = json.loads(args.json.read_text()) if args.json.is_file() else {}
    key = f"{device['platform']}:{device['device']}" + ("" if args.remat == "none" else f" remat={args.remat}")
    results[key] = {**device, "settings": settings, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
