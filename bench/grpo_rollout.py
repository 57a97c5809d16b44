"""GRPO's rollout (``jaxseq.train.rl.Rollout.sample``: sampling, decoding, rewards, advantages) against transformers'
``generate`` sampling the same batch on the same CPU, GPT-2 small (124M) weights shared by both.

    python bench/grpo_rollout.py [--prompts 8] [--num_generations 8] [--prompt_tokens 32] [--new_tokens 32]

A batch of --prompts x --num_generations rows (64 by default), each prompt repeated as GRPO samples it,
--new_tokens tokens per row (no EOS stops a row early on either side), temperature 1, float32. PyTorch
samples with its KV cache on each of --torch_threads intra-op thread counts; the fastest is the baseline.
Steady-state time is the median of --repeats calls after a warm-up (``generate_vs_pytorch.measure``: the runners
take turns); jaxseq's compilation is in the untimed first call, and later calls reuse its program. Prints
tokens/s and the ratio; records the run in bench/results/grpo_rollout.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import records
from generate_vs_pytorch import measure

SHARED = records.ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2"


def jaxseq_rollout(path: Path, tokenizer, args):
    """A function ``prompt ids -> completion tokens`` running GRPO's rollout on the checkpoint at ``path``."""
    from jaxseq.models import load_pretrained
    from jaxseq.train.rl import GRPOConfig, Rollout

    model = load_pretrained(path, "causal-lm")
    config = GRPOConfig(num_generations=args.num_generations, max_completion_length=args.new_tokens)
    records_ = [{"prompt": ""} for _ in range(args.prompts)]
    funcs = [("length", lambda completion_ids, **_: [float(len(ids)) for ids in completion_ids])]
    rollout = Rollout(config, tokenizer, records_, funcs, eos_token_ids=[-1])  # no EOS: every row full length
    seeds = iter(range(1_000_000))

    def call(ids):
        prompts = {"input_ids": ids, "attention_mask": np.ones_like(ids), "prompt_index": np.arange(len(ids))}
        rows, _ = rollout.sample(model, prompts, seed=next(seeds))
        return rows["input_ids"][:, ids.shape[1] :]

    return call


def pytorch_generator(path: Path, args, threads: int):
    """transformers' ``generate()`` sampling ``num_generations`` rows per prompt (KV cache on) on ``threads``."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path).eval()

    def call(ids):
        torch.set_num_threads(threads)
        tensor = torch.as_tensor(np.repeat(ids, args.num_generations, axis=0)).long()
        with torch.no_grad():
            result = model.generate(
                tensor,
                attention_mask=torch.ones_like(tensor),
                do_sample=True,
                top_k=0,
                temperature=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=50256,
                use_cache=True,
            )
        return result[:, ids.shape[1] :].numpy()

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts of the batch")
    parser.add_argument("--num_generations", type=int, default=8, help="completions sampled per prompt")
    parser.add_argument("--prompt_tokens", type=int, default=32, help="tokens of each prompt")
    parser.add_argument("--new_tokens", type=int, default=32, help="tokens sampled per completion")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per runner after the warm-up")
    parser.add_argument("--torch_threads", type=int, nargs="+", default=[1, 2], help="PyTorch is timed with each")
    parser.add_argument("--no_save", action="store_true", help="do not record the run in bench/results")
    args = parser.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    tokenizer = GPT2TokenizerFast(vocab=str(SHARED / "vocab.json"), merges=str(SHARED / "merges.txt"))
    rows = args.prompts * args.num_generations
    ids = np.random.default_rng(0).integers(0, 50000, (args.prompts, args.prompt_tokens)).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        runners = {"jaxseq_rollout": jaxseq_rollout(Path(tmp), tokenizer, args)}
        runners.update({f"pytorch_{n}_threads": pytorch_generator(Path(tmp), args, n) for n in args.torch_threads})
        result = measure(runners, ids, args.repeats)
    rates = {name: rows * args.new_tokens / r["seconds"] for name, r in result.items()}
    best = max((n for n in rates if n != "jaxseq_rollout"), key=rates.get)
    report = {
        **records.environment(),
        "settings": {
            "model": "GPT-2 small (GPT2Config(), random init seed 0), float32",
            "batch": rows,
            "prompts": args.prompts,
            "num_generations": args.num_generations,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
        },
        **{f"{name}_tokens_per_second": rate for name, rate in rates.items()},
        "pytorch_best": best,
        "speedup": rates["jaxseq_rollout"] / rates[best],
        "jaxseq_first_call_seconds": result["jaxseq_rollout"]["first"],
    }
    for name, rate in rates.items():
        print(f"{name}: {rate:.1f} tokens/s")
    print(f"jaxseq rollout / fastest PyTorch ({best}): {report['speedup']:.2f}x")
    if not args.no_save:
        print(f"wrote {records.write('grpo_rollout', report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
