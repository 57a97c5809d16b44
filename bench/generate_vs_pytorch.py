"""jaxseq vs transformers PyTorch greedy generation with GPT-2 small (124M), same weights, measured in one run.

    python bench/generate_vs_pytorch.py [--batch_sizes 1 8] [--prompt_tokens 32] [--new_tokens 64] [--repeats 3]

Both sides: a randomly initialised GPT-2 small (seed 0, saved once and loaded by both), float32, random
prompts of --prompt_tokens tokens, greedy decoding of exactly --new_tokens tokens (min_new_tokens keeps EOS
from ending a row early); PyTorch uses generate() with its KV cache, measured with each of --torch_threads
intra-op thread counts (on a small, shared CPU one thread can beat two by a wide margin), the fastest being
the baseline. Steady-state time is the median of --repeats calls after a warm-up, the runners taking turns;
jaxseq's compile time (tracing, lowering and XLA compilation in its first call, as JAX's monitoring events
report them) is left out and reported apart. Prints tokens/s, the ratio per batch size, and how many greedy
tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

EOS = 50256  # GPT-2's; min_new_tokens keeps it from ending a row early


def jaxseq_generator(path: Path, args):
    """A function ``ids -> new tokens`` running jaxseq's ``generate`` on the checkpoint at ``path``."""
    import jax

    from jaxseq.generation import generate
    from jaxseq.models import load_pretrained

    model = load_pretrained(path, "causal-lm")
    compile_seconds = []  # tracing, lowering and XLA compilation, as JAX reports them

    def on_event(name, seconds, **_):
        if name.startswith("/jax/core/compile/"):
            compile_seconds.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)

    def call(ids):
        result = generate(
            model,
            ids,
            np.ones_like(ids),
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
        return np.asarray(jax.block_until_ready(result.sequences))

    call.compile_seconds = compile_seconds
    return call


def pytorch_generator(path: Path, args, threads: int):
    """The same with transformers' ``generate()`` (KV cache on) on ``threads`` intra-op threads."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path).eval()

    def call(ids):
        torch.set_num_threads(threads)
        tensor = torch.as_tensor(ids).long()
        with torch.no_grad():
            result = model.generate(
                tensor,
                attention_mask=torch.ones_like(tensor),
                do_sample=False,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                eos_token_id=EOS,
                pad_token_id=EOS,
                use_cache=True,
            )
        return result[:, ids.shape[1] :].numpy()

    return call


def measure(runners: dict, ids: np.ndarray, repeats: int) -> dict:
    """Per runner: first-call seconds, the median of ``repeats`` later calls (the runners take turns, so
    load from other processes on the machine falls on all of them alike) and the tokens."""
    first, times, tokens = {}, {name: [] for name in runners}, {}
    for name, run in runners.items():
        start = time.perf_counter()
        tokens[name] = run(ids)
        first[name] = time.perf_counter() - start
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run(ids)
            times[name].append(time.perf_counter() - start)
    return {
        name: {"first": first[name], "seconds": statistics.median(times[name]), "tokens": tokens[name]}
        for name in runners
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--torch_threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="PyTorch is measured with each; the fastest is the baseline",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    rng = np.random.default_rng(0)
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        runners = {"jaxseq": jaxseq_generator(Path(tmp), args)}
        runners.update({f"pytorch_{n}_threads": pytorch_generator(Path(tmp), args, n) for n in args.torch_threads})
        for b in args.batch_sizes:
            ids = rng.integers(0, 50000, (b, args.prompt_tokens)).astype(np.int32)
            runners["jaxseq"].compile_seconds.clear()
            result = measure(runners, ids, args.repeats)
            rates = {name: b * args.new_tokens / r["seconds"] for name, r in result.items()}
            torch_best = max((n for n in rates if n != "jaxseq"), key=rates.get)
            report[f"batch_{b}"] = {
                **{f"{name}_tokens_per_second": rate for name, rate in rates.items()},
                "pytorch_best": torch_best,
                "speedup": rates["jaxseq"] / rates[torch_best],
                "jaxseq_compile_seconds": sum(runners["jaxseq"].compile_seconds),
                "jaxseq_first_call_seconds": result["jaxseq"]["first"],
                "same_tokens_fraction": float(np.mean(result["jaxseq"]["tokens"] == result[torch_best]["tokens"])),
            }
            print(f"batch {b}: " + ", ".join(f"{name} {rate:.1f} tokens/s" for name, rate in rates.items()), flush=True)
    print(json.dumps(report, indent=2))
    targets = {1: 1.0, 8: 1.5}
    for b in args.batch_sizes:
        r = report[f"batch_{b}"]
        target = f" (target >= {targets[b]}x)" if b in targets else ""
        print(
            f"batch {b}: jaxseq {r['jaxseq_tokens_per_second']:.1f} tokens/s, pytorch (best: {r['pytorch_best']}) "
            f"{r[r['pytorch_best'] + '_tokens_per_second']:.1f} tokens/s -> {r['speedup']:.2f}x{target}; compile "
            f"{r['jaxseq_compile_seconds']:.1f}s apart; greedy tokens agree on {r['same_tokens_fraction']:.0%}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
