"""The generation engine's continuous batching against static batches, and ``jaxseq serve`` under concurrent
requests, on the same CPU.

    python bench/engine.py [--requests 64] [--slots 16] [--short 16] [--long 128] [--long_share 0.2]

Rollout row: --requests completions whose budgets are skewed (--long_share of them --long tokens, the rest
--short; no EOS, so each runs to its budget), sampled at temperature 1 from a random GPT-2 of 6 layers x 512
(float32). The engine keeps --slots requests in flight, each leaving at its budget; jaxseq's static
``generate`` and transformers' ``generate`` (KV cache, the faster of 1 and 2 threads) take them --slots at a
time, each batch running to its longest budget. Tokens/s counts the tokens requested. Compilation is in an
untimed first run.

Server row: ``jaxseq serve`` (a fresh process, the same model, --slots slots) answers 16 completions of 4 to
64 tokens sent at once, and the same 16 one after another (greedy; the official ``openai`` client); the ratio
of the two times. Records the run in bench/results/engine.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import records

SHARED = records.ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2"
JAXSEQ = Path(sys.executable).with_name("jaxseq")


def budgets(args) -> list[int]:
    rng = np.random.default_rng(0)
    return [args.long if rng.random() < args.long_share else args.short for _ in range(args.requests)]


def prompts(args) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, 50000, int(rng.integers(8, 33))).tolist() for _ in range(args.requests)]


def timed(run) -> float:
    run()  # compiles
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def engine_seconds(folder: Path, tokenizer, args) -> float:
    from jaxseq.engine import Engine, SamplingParams
    from jaxseq.models import load_pretrained

    engine = Engine(load_pretrained(folder, "causal-lm"), tokenizer, max_batch_size=args.slots, max_len=256,
                    eos_token_ids=[])  # fmt: skip
    engine.warm_up()

    def run():
        for ids, n in zip(prompts(args), budgets(args)):
            engine.add(ids, SamplingParams(max_tokens=n, temperature=1.0))
        while engine.busy:
            engine.step()

    return timed(run)


def static_batches(args):
    """(prompt rows, budgets) of each static batch of --slots requests."""
    ps, bs = prompts(args), budgets(args)
    return [(ps[i : i + args.slots], bs[i : i + args.slots]) for i in range(0, len(ps), args.slots)]


def left_padded(rows: list[list[int]]):
    width = max(map(len, rows))
    ids = np.array([[0] * (width - len(r)) + r for r in rows], np.int32)
    mask = np.arange(width)[None] >= width - np.array([len(r) for r in rows])[:, None]
    return ids, mask.astype(np.int32)


def jaxseq_static_seconds(folder: Path, args) -> float:
    from jaxseq.generation import generate
    from jaxseq.models import load_pretrained

    model = load_pretrained(folder, "causal-lm")

    def run():
        for rows, budget in static_batches(args):
            ids, mask = left_padded(rows)
            np.asarray(generate(model, ids, mask, max_new_tokens=max(budget), do_sample=True).sequences)

    return timed(run)


def torch_static_seconds(folder: Path, args, threads: int) -> float:
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(folder).eval()

    def run():
        torch.set_num_threads(threads)
        for rows, budget in static_batches(args):
            ids, mask = left_padded(rows)
            with torch.no_grad():
                model.generate(torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(),
                               do_sample=True, top_k=0, max_new_tokens=max(budget), min_new_tokens=max(budget),
                               pad_token_id=0)  # fmt: skip

    return timed(run)


def server_seconds(folder: Path, args) -> dict:
    """Seconds of 16 completions (4 to 64 tokens) at once and one after another, against ``jaxseq serve``."""
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [str(JAXSEQ), "serve", "--model_name_or_path", str(folder), "--served_model_name", "bench", "--port",
               str(port), "--max_batch_size", str(args.slots), "--max_model_len", "256"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        while True:
            try:
                urllib.request.urlopen(f"{base}/models", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("jaxseq serve exited") from None
                time.sleep(1)
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        lengths = [4 + (60 * i) // 15 for i in range(16)]
        ask = lambda n: client.completions.create(model="bench", prompt="Once upon a time", max_tokens=n,
                                                  temperature=0).usage.completion_tokens  # fmt: skip
        ask(8)  # a first request
        start = time.perf_counter()
        for n in lengths:
            ask(n)
        one_by_one = time.perf_counter() - start
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(ask, lengths))
        together = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"sequential_seconds": one_by_one, "concurrent_seconds": together, "ratio": together / one_by_one}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=128)
    parser.add_argument("--long_share", type=float, default=0.2)
    parser.add_argument("--no_save", action="store_true", help="do not record the run in bench/results")
    args = parser.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    tokenizer = GPT2TokenizerFast(vocab=str(SHARED / "vocab.json"), merges=str(SHARED / "merges.txt"))
    requested = sum(budgets(args))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=256)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        seconds = {
            "engine": engine_seconds(folder, tokenizer, args),
            "jaxseq_static": jaxseq_static_seconds(folder, args),
            **{f"pytorch_static_{n}_threads": torch_static_seconds(folder, args, n) for n in (1, 2)},
        }
        server = server_seconds(folder, args)
    rates = {name: requested / s for name, s in seconds.items()}
    best = max((n for n in rates if n != "engine"), key=rates.get)
    report = {
        **records.environment(),
        "settings": {
            "model": "GPT-2 6 layers x 512 (random init seed 0), float32",
            "requests": args.requests,
            "slots": args.slots,
            "budgets": f"{args.long_share:.0%} of {args.long} tokens, the rest {args.short}",
            "tokens_requested": requested,
            "server": "16 greedy completions of 4 to 64 tokens, at once vs one after another",
        },
        **{f"{name}_tokens_per_second": rate for name, rate in rates.items()},
        "best_static": best,
        "engine_speedup": rates["engine"] / rates[best],
        "server": server,
    }
    for name, rate in rates.items():
        print(f"{name}: {rate:.1f} tokens/s")
    print(f"engine / best static ({best}): {report['engine_speedup']:.2f}x")
    print(f"server: 16 at once {server['concurrent_seconds']:.2f}s, one by one {server['sequential_seconds']:.2f}s "
          f"(ratio {server['ratio']:.2f})")  # fmt: skip
    if not args.no_save:
        print(f"wrote {records.write('engine', report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
