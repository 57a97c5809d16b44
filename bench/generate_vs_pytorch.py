"""jaxseq vs transformers PyTorch greedy generation with GPT-2 small (124M), same weights, measured in one run.

    python bench/generate_vs_pytorch.py [--batch_sizes 1 8] [--prompt_tokens 32] [--new_tokens 64] [--repeats 3]
    python bench/generate_vs_pytorch.py --markdown     # BENCHMARKS.md's table from bench/results/generate.json

Both sides: a randomly initialised GPT-2 small (seed 0, saved once and loaded by both), float32, random
prompts of --prompt_tokens tokens, greedy decoding of exactly --new_tokens tokens (min_new_tokens keeps EOS
from ending a row early). PyTorch runs generate() with its KV cache on each of --torch_threads intra-op
thread counts (on a small, shared CPU one thread can beat two by a wide margin), and with a static KV cache
and its forward under torch.compile (transformers' recipe for fast generation); the fastest PyTorch runner
is the baseline. Steady-state time is the median of --repeats calls after a warm-up, the runners taking
turns; compilation (jaxseq's, from JAX's monitoring events, and torch.compile's) is in the untimed first
call. Prints tokens/s, the ratio per batch size and how many greedy tokens agree; records the run in
bench/results/generate.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import records

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


def pytorch_generator(path: Path, args, threads: int | None = None, compiled: bool = False):
    """The same with transformers' ``generate()`` (KV cache on), on ``threads`` intra-op threads (None: torch's
    default); ``compiled``: a static KV cache and the model's forward under torch.compile, as transformers
    documents for fast generation (compiled in the first call of each shape, which ``measure`` leaves out)."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path).eval()
    if compiled:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward)

    def call(ids):
        if threads:
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


def markdown(results: dict) -> str:
    """BENCHMARKS.md's table: tokens/s per runner and batch size, and jaxseq's ratio to the fastest PyTorch."""
    s = results["settings"]
    batches = [key for key in results if key.startswith("batch_")]
    runners = [k.removesuffix("_tokens_per_second") for k in results[batches[0]] if k.endswith("_tokens_per_second")]
    lines = [
        f"{results['date']}, {results['machine']}, jax {results['versions'].get('jax')}, torch "
        f"{results['versions'].get('torch')}: {s['model']}, prompts of {s['prompt_tokens']} tokens, "
        f"{s['new_tokens']} new tokens, greedy, median of {s['repeats']} calls after a warm-up.",
        "",
        "| runner | " + " | ".join(b.replace("_", " ") for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for runner in runners:
        cells = [f"{results[b][runner + '_tokens_per_second']:.1f} tokens/s" for b in batches]
        lines.append(f"| {runner} | " + " | ".join(cells) + " |")
    lines.append(
        "| jaxseq / fastest PyTorch | "
        + " | ".join(f"**{results[b]['speedup']:.2f}x** ({results[b]['pytorch_best']})" for b in batches)
        + " |"
    )
    lines.append(
        "| jaxseq compile (apart) | "
        + " | ".join(f"{results[b]['jaxseq_compile_seconds']:.1f} s" for b in batches)
        + " |"
    )
    lines.append(
        "| greedy tokens equal | " + " | ".join(f"{results[b]['same_tokens_fraction']:.0%}" for b in batches) + " |"
    )
    return "\n".join(lines)


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
    parser.add_argument("--no_compile", action="store_true", help="leave out the torch.compile'd static-cache runner")
    parser.add_argument("--no_save", action="store_true", help="do not record the run in bench/results/generate.json")
    parser.add_argument("--markdown", action="store_true", help="run nothing: write BENCHMARKS.md's table")
    args = parser.parse_args()
    if args.markdown:
        return records.write_markdown("generate", markdown)

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    rng = np.random.default_rng(0)
    report = {
        **records.environment(),
        "settings": {
            "model": "GPT-2 small (GPT2Config(), random init seed 0), float32",
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "torch_threads": args.torch_threads,
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        runners = {"jaxseq": jaxseq_generator(Path(tmp), args)}
        runners.update({f"pytorch_{n}_threads": pytorch_generator(Path(tmp), args, n) for n in args.torch_threads})
        if not args.no_compile:
            runners["pytorch_compile_static_cache"] = pytorch_generator(Path(tmp), args, compiled=True)
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
    print(markdown(report))
    targets = {1: 1.0, 8: 1.5}
    for b in args.batch_sizes:
        r = report[f"batch_{b}"]
        target = f" (target >= {targets[b]}x)" if b in targets else ""
        print(
            f"batch {b}: jaxseq {r['jaxseq_tokens_per_second']:.1f} tokens/s, pytorch (best: {r['pytorch_best']}) "
            f"{r[r['pytorch_best'] + '_tokens_per_second']:.1f} tokens/s -> {r['speedup']:.2f}x{target}; compile "
            f"{r['jaxseq_compile_seconds']:.1f}s apart; greedy tokens agree on {r['same_tokens_fraction']:.0%}"
        )
    if not args.no_save:
        print(f"wrote {records.write('generate', report)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
