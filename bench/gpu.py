"""What only an NVIDIA GPU shows: jaxseq's cuDNN attention path and its train-step speed against PyTorch.

    python bench/gpu.py [--sections init,attention,train] [--json bench/results/gpu.json] [--steps 20]

init: seconds to compile ``from_config``'s random initialisation of BERT-base and GPT-2 small with XLA's
inline threefry hash and with CUDA's threefry kernel (what ``from_config`` uses on one GPU), each in its
own process with a time limit, beside the attention section.

attention: ``jaxseq.models.attention.attend`` with the cuDNN kernel against the XLA kernel, both in bfloat16,
each compared with XLA in float32 on the same (upcast) inputs: forward outputs and the gradients of q, k
and v, as ||x - ref|| / ||ref|| over the rows that are real tokens; causal (GPT-2 shape) and bidirectional
with right padding (BERT shape). The compiled programs are searched for cuDNN's fused attention custom
calls (``__cudnn$fmha...``), forward and backward.

train: one optimizer step (AdamW, bf16 compute, fp32 weights and state, all dropout 0 so that every side
runs the same function and cuDNN can take attention) of GPT-2 small at 1024 tokens and BERT-base
classification at 128 and 512 tokens, random token ids, rows:
  jaxseq_cudnn, jaxseq_xla  the Trainer's jitted, donated step, dispatched back to back, one sync at the end
  pytorch_eager             transformers with SDPA attention, bf16 autocast, fused AdamW
  pytorch_compile           the same under torch.compile
Each row runs in its own process (JAX and PyTorch each take the GPU's memory). Tokens/s over --steps steps
after --warmup; MFU = (6 N + 12 L d s) FLOPs per token (jaxseq.train.throughput) over the published dense
bf16 peak of the chip (H100/H200 SXM: 989 TFLOP/s), and over a bf16 8192^3 matmul measured in the run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # name: (family, seq, per-step batch)
    "gpt2-small": ("gpt2", 1024, 16),
    "bert-base-128": ("bert", 128, 64),
    "bert-base-512": ("bert", 512, 16),
}
SIDES = ("jaxseq_cudnn", "jaxseq_xla", "pytorch_eager", "pytorch_compile")
LR, WEIGHT_DECAY = 1e-4, 0.01


def rel(x, ref) -> float:
    import numpy as np

    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def cudnn_calls(hlo_text: str) -> list[str]:
    """The cuDNN fused-attention custom calls named in a compiled program's HLO text."""
    return sorted(set(re.findall(r"__cudnn\$fmha\w*", hlo_text)))


def attention_checks() -> list[dict]:
    """cuDNN and XLA attention in bf16 against XLA in fp32: forward and gradients, and the compiled calls."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxseq.models.attention import AttentionKernel, attend, self_attention_mask

    cases = [
        ("causal", 4, 1024, 12, 64, True, [1024, 1024, 1024, 1024]),
        ("padded bidirectional", 4, 512, 12, 64, False, [512, 300, 128, 77]),
        ("padded causal", 4, 1024, 12, 64, True, [1024, 700, 256, 33]),
    ]
    rows = []
    for name, batch, seq, heads, dim, causal, lengths in cases:
        keys = jax.random.split(jax.random.key(len(rows)), 4)
        q, k, v, cot = (jax.random.normal(key, (batch, seq, heads, dim), jnp.float32) for key in keys)
        valid = (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
        cot = cot * valid[:, :, None, None]  # padded query rows carry no gradient
        padded = any(n < seq for n in lengths)
        key_mask = jnp.asarray(valid) if padded else None

        def run(kernel, q, k, v, *, key_mask=key_mask, causal=causal, seq=seq, cot=cot):
            mask = self_attention_mask(key_mask, seq, causal=causal)
            out, vjp = jax.vjp(
                lambda q, k, v: attend(q, k, v, mask, kernel=AttentionKernel(kernel), causal=causal), q, k, v
            )
            return out, vjp(cot.astype(out.dtype))

        ref_out, ref_grads = jax.jit(lambda q, k, v: run("xla", q, k, v))(q, k, v)
        row = {"case": name, "shape": [batch, seq, heads, dim], "key_lengths": lengths}
        half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        for kernel in ("cudnn", "xla"):
            fn = jax.jit(lambda q, k, v, kernel=kernel: run(kernel, q, k, v))
            text = fn.lower(*half).compile().as_text()
            out, grads = fn(*half)
            keep = valid[:, :, None, None].astype(bool)
            row[kernel] = {
                "forward_rel_error": rel(np.where(keep, out.astype(jnp.float32), 0), np.where(keep, ref_out, 0)),
                **{f"d{n}_rel_error": rel(g.astype(jnp.float32), r) for n, g, r in zip("qkv", grads, ref_grads)},
                "cudnn_calls": cudnn_calls(text),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def init_compile_seconds(family: str, lowering: str) -> dict:
    """Compile (not run) the jitted random initialisation of ``family``'s base-size model."""
    import jax
    from flax import nnx
    from jax._src import config as jax_config

    from jaxseq.models.hub import _constructor

    task = "causal-lm" if family == "gpt2" else "sequence-classification"
    make = _constructor(hf_config(family), task, jax.numpy.bfloat16, jax.numpy.float32, 0)
    with jax_config.threefry_gpu_kernel_lowering(lowering == "kernel"):
        start = time.perf_counter()
        jax.jit(lambda: nnx.state(make())).lower().compile()
    return {"compile_seconds": time.perf_counter() - start}


def start_init_checks(timeout: float) -> list:
    """Start one process per (family, threefry lowering); ``finish_init_checks`` collects them."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started = []
    for family in ("bert", "gpt2"):
        for lowering in ("xla", "kernel"):
            cmd = [sys.executable, __file__, "--init_worker", family, lowering]
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            started.append(({"family": family, "threefry": lowering}, proc, time.perf_counter() + timeout))
    return started


def finish_init_checks(started: list) -> list[dict]:
    rows = []
    for row, proc, deadline in started:
        try:
            out, err = proc.communicate(timeout=max(deadline - time.perf_counter(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            row["error"] = "did not finish compiling in the time limit"
        else:
            if proc.returncode == 0:
                row.update(json.loads(out.strip().splitlines()[-1]))
            else:
                row["error"] = err.strip().splitlines()[-3:]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def synthetic_batches(family: str, seq: int, rows: int, vocab: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (rows, seq), dtype=np.int32)
    if family == "gpt2":
        return {"input_ids": ids}
    return {
        "input_ids": ids,
        "attention_mask": np.ones((rows, seq), np.int32),
        "token_type_ids": np.zeros((rows, seq), np.int32),
        "labels": rng.integers(0, 2, rows, dtype=np.int32),
    }


def hf_config(family: str):
    from transformers import BertConfig, GPT2Config

    if family == "gpt2":
        return GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2)


def run_jaxseq(model_name: str, kernel: str, args) -> dict:
    import jax

    from jaxseq.data.glue import get_task
    from jaxseq.mesh import make_mesh
    from jaxseq.models.registry import model_flops
    from jaxseq.train.objectives import CausalLM, SequenceClassification
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.spec import RunSpec
    from jaxseq.train.trainer import Trainer
    from jaxseq.train.trainer_config import TrainerConfig

    family, seq, batch = MODELS[model_name]
    config = hf_config(family)
    mesh = make_mesh("dp=1")
    task = "causal-lm" if family == "gpt2" else "sequence-classification"
    data = synthetic_batches(family, seq, batch * (args.steps + args.warmup + 4), config.vocab_size)
    objective = (
        CausalLM(chunk_tokens=args.loss_chunk_tokens or None)
        if family == "gpt2"
        else SequenceClassification(get_task("sst2"))
    )
    with tempfile.TemporaryDirectory() as out:
        trainer_config = TrainerConfig(
            output_dir=out, per_device_train_batch_size=batch, max_steps=10**6, attention=kernel, report_to="none"
        )
        optimizer = OptimizerConfig(learning_rate=LR, weight_decay=WEIGHT_DECAY, lr_scheduler_type="constant")
        spec = RunSpec(mesh, config, task, objective, trainer_config, optimizer, dtype="bfloat16")
        model = spec.build_model()
        flops = model_flops(config, task, batch, seq)
        trainer = Trainer(spec, model, data, {})
        del model
        batches = trainer.feed.batches()
        start = time.perf_counter()
        trainer.state, metrics = trainer._train_step(trainer.state, next(batches))
        first_loss = float(metrics["loss"])
        compile_seconds = time.perf_counter() - start
        for _ in range(args.warmup - 1):
            trainer.state, metrics = trainer._train_step(trainer.state, next(batches))
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.state, metrics = trainer._train_step(trainer.state, next(batches))
        last_loss = float(metrics["loss"])
        seconds = (time.perf_counter() - start) / args.steps
        if args.profile:
            with jax.profiler.trace(args.profile, create_perfetto_trace=True):
                for _ in range(3):
                    trainer.state, metrics = trainer._train_step(trainer.state, next(batches))
                jax.block_until_ready(metrics)
        trainer.close()
    dumps = Path(os.environ["JAXSEQ_BENCH_DUMP"]).glob("*after_optimizations.txt")
    calls = sorted({c for p in dumps for c in cudnn_calls(p.read_text())})
    return {
        "seconds_per_step": seconds,
        "tokens_per_second": batch * seq / seconds,
        "model_flops_per_step": flops,
        "compile_seconds": compile_seconds,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "cudnn_calls_in_step": calls,
        "peak_memory_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
    }


def run_pytorch(model_name: str, compiled: bool, args) -> dict:
    import numpy as np
    import torch
    from transformers import BertForSequenceClassification, GPT2LMHeadModel

    family, seq, batch = MODELS[model_name]
    config = hf_config(family)
    torch.manual_seed(0)
    cls = GPT2LMHeadModel if family == "gpt2" else BertForSequenceClassification
    model = cls._from_config(config, attn_implementation="sdpa").cuda().train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        fused=True,
    )
    data = {
        k: torch.as_tensor(np.asarray(v, np.int64)).cuda()
        for k, v in synthetic_batches(family, seq, batch, config.vocab_size).items()
    }
    forward = torch.compile(model) if compiled else model

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if family == "gpt2":
                loss = forward(input_ids=data["input_ids"], labels=data["input_ids"]).loss
            else:
                loss = forward(**data).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    first_loss = float(step())
    compile_seconds = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    last_loss = float(loss)
    seconds = (time.perf_counter() - start) / args.steps
    return {
        "seconds_per_step": seconds,
        "tokens_per_second": batch * seq / seconds,
        "compile_seconds": compile_seconds,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(),
        "torch": torch.__version__,
    }


def matmul_tflops() -> float:
    import jax
    import jax.numpy as jnp

    n = 8192
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in range(2))
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def worker(args) -> dict:
    model_name, side = args.worker
    if side.startswith("jaxseq"):
        return run_jaxseq(model_name, side.removeprefix("jaxseq_"), args)
    return run_pytorch(model_name, side == "pytorch_compile", args)


def family_of(model_name: str) -> str:
    return MODELS[model_name][0]


def train_rows(args, no_init: set[str]) -> list[dict]:
    """One process per (model, side); jaxseq rows of a family in ``no_init`` (its initialisation did not
    compile in the init section) are recorded as skipped."""
    rows = []
    for model_name in args.models.split(","):
        for side in args.sides.split(","):
            if side.startswith("jaxseq") and family_of(model_name) in no_init:
                rows.append({"model": model_name, "side": side, "error": "skipped: the initialisation did not compile"})
                continue
            cmd = [sys.executable, __file__, "--worker", model_name, side, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--loss_chunk_tokens", str(args.loss_chunk_tokens)]  # fmt: skip
            if args.profile and side.startswith("jaxseq"):
                cmd += ["--profile", args.profile]
            dump = tempfile.mkdtemp()
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "JAXSEQ_BENCH_DUMP": dump,
                   "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}  # fmt: skip
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            start = time.perf_counter()
            env.pop("XLA_PYTHON_CLIENT_PREALLOCATE")  # the row's process takes the GPU as a user's would
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=args.row_timeout)
            except subprocess.TimeoutExpired as stopped:
                done = subprocess.CompletedProcess(cmd, -1, "", f"timed out; stderr: {stopped.stderr!s}"[-2000:])
            shutil.rmtree(dump, ignore_errors=True)
            row = {"model": model_name, "side": side, "wall_seconds": time.perf_counter() - start}
            if side.startswith("jaxseq") and family_of(model_name) == "gpt2":
                row["loss_chunk_tokens"] = args.loss_chunk_tokens
            if done.returncode == 0:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            else:
                row["error"] = done.stderr.strip().splitlines()[-3:]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="init,attention,train", help="comma-separated: init, attention, train")
    parser.add_argument("--init_timeout", type=float, default=75, help="seconds an init compilation may take")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated of {', '.join(MODELS)}")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated of {', '.join(SIDES)}")
    parser.add_argument("--loss_chunk_tokens", type=int, default=-1, help="jaxseq's loss chunk: -1 auto, 0 whole")
    parser.add_argument("--profile", help="write a JAX trace of 3 steps of each jaxseq row here")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps, the compiling one included")
    parser.add_argument("--row_timeout", type=float, default=240, help="seconds a train row may take")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--init_worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.init_worker:
        print(json.dumps(init_compile_seconds(*args.init_worker)))
        return 0
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process only checks; each row has the GPU
    import jax
    import transformers

    from jaxseq.train.throughput import published_peak_flops

    device = jax.devices()[0]
    peak = published_peak_flops([device])
    results = {
        "date": datetime.date.today().isoformat(),
        "device": device.device_kind,
        "platform": device.platform,
        "host": platform.node(),
        "jax": jax.__version__,
        "transformers": transformers.__version__,
        "published_bf16_peak_flops": peak,
        "measured_bf16_matmul_flops": matmul_tflops(),
    }
    print(json.dumps(results), flush=True)
    sections = args.sections.split(",")
    started = start_init_checks(args.init_timeout) if "init" in sections else []
    if "attention" in sections:
        results["attention"] = attention_checks()
    if started:
        results["init"] = finish_init_checks(started)
    if "train" in sections:
        no_init = {r["family"] for r in results.get("init", []) if r["threefry"] == "kernel" and "error" in r}
        results["train"] = rows = train_rows(args, no_init)
        for row in rows:
            if "model_flops_per_step" not in row:
                twin = next((r for r in rows if r["model"] == row["model"] and "model_flops_per_step" in r), None)
                if twin:
                    row["model_flops_per_step"] = twin["model_flops_per_step"]
            if "model_flops_per_step" in row and "seconds_per_step" in row:
                achieved = row["model_flops_per_step"] / row["seconds_per_step"]
                row["mfu_published_peak"] = achieved / peak if peak else None
                row["mfu_measured_matmul"] = achieved / results["measured_bf16_matmul_flops"]
        print(f"\n{results['device']}: published bf16 peak {(peak or 0) / 1e12:.0f} TFLOP/s, "
              f"measured matmul {results['measured_bf16_matmul_flops'] / 1e12:.0f}")  # fmt: skip
        print(f"{'model':<15}{'side':<17}{'tokens/s':>11}{'ms/step':>9}{'MFU':>7}{'compile s':>10}  vs best")
        for model_name in args.models.split(","):
            mine = [r for r in rows if r["model"] == model_name and "tokens_per_second" in r]
            best = max((r["tokens_per_second"] for r in mine if r["side"].startswith("pytorch")), default=None)
            for r in mine:
                ratio = f"{r['tokens_per_second'] / best:.2f}x" if best else "-"
                print(f"{model_name:<15}{r['side']:<17}{r['tokens_per_second']:>11.0f}"
                      f"{r['seconds_per_step'] * 1e3:>9.1f}{r.get('mfu_published_peak') or 0:>7.1%}"
                      f"{r['compile_seconds']:>10.1f}  {ratio}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
