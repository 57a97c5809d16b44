"""`jaxseq eval` vs `lm_eval --model hf` (lm-evaluation-harness's own PyTorch model) on the same tasks, checkpoint
and CPU: each whole command timed, from start to exit.

    python bench/eval_vs_lm_eval.py [--docs 64] [--articles 2] [--prompts 16] [--hf_batch_size 16]

The checkpoint: GPT-2 small (GPT2Config(), random init seed 0, float32) with GPT-2's tokenizer from ../shared.
The tasks, local YAMLs and JSON-lines data written at each run from ../shared/data/text's WikiText-2 with a
fixed seed, run by both commands through --include_path:
- ``mc_endings``: HellaSwag's shape: a context of 30-60 words and four endings of 5-15 words (acc, acc_norm);
- ``mc_letters``: MMLU's shape: a question, four options and the letters A-D as one-token answers (acc);
- ``wikitext``: rolling perplexity of --articles whole WikiText-2 test articles (thousands of tokens each, in
  windows of 1024: word_perplexity, byte_perplexity, bits_per_byte);
- ``completion``: --prompts greedy generations of up to 32 tokens, cut at a newline (exact_match).
Sides, in turn: ``jaxseq`` (its default flags, a fresh XLA cache: every program compiled in the run),
``lm_eval_hf`` (``--batch_size`` --hf_batch_size, ``--device cpu``, PyTorch's default threads) and
``jaxseq_warm`` (jaxseq again, with the XLA cache the first run filled). Each gets a fresh datasets cache.
Prints each side's wall time and jaxseq's ratio to lm_eval's (target: at most 0.7), checks that both report the
same accuracies and log-likelihood figures within 1e-4, and records the run in bench/results/eval_vs_lm_eval.json.
The box the records come from is shared with other work: compare the sides of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import records

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TASKS = ("mc_endings", "mc_letters", "wikitext", "completion")
TARGET = 0.7


def articles(text: str) -> list[str]:
    """WikiText-2's articles (a line ` = Title = ` starts one), each as one string."""
    out, current = [], []
    for line in text.splitlines():
        if line.startswith(" = ") and not line.startswith(" = = ") and current:
            out.append("\n".join(current).strip())
            current = []
        current.append(line)
    out.append("\n".join(current).strip())
    return [a for a in out if len(a) > 2000]


def write_tasks(root: Path, args) -> None:
    rng = np.random.default_rng(0)
    text = (SHARED / "data/text/wikitext-2.test.tokens").read_text()
    words = [w for w in text.split() if w.isalpha()]
    data = root / "data"
    data.mkdir(parents=True)

    def span(lo, hi):
        start = int(rng.integers(0, len(words) - hi))
        return " ".join(words[start : start + int(rng.integers(lo, hi))])

    def task(name, body, records_):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records_))
        source = f"dataset_path: json\ndataset_kwargs:\n  data_files: {data}/{name}.jsonl\ntest_split: train\n"
        (root / f"{name}.yaml").write_text(f"task: {name}\n{source}{body}")

    endings = [{"ctx": span(30, 60), "endings": [span(5, 15) for _ in range(4)], "label": int(rng.integers(4))}
               for _ in range(args.docs)]  # fmt: skip
    task(
        "mc_endings",
        'output_type: multiple_choice\ndoc_to_text: "{{ctx}}"\ndoc_to_choice: "{{endings}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        endings,
    )
    letters = [{"question": span(15, 40) + "?", "options": [span(2, 6) for _ in range(4)],
                "answer": int(rng.integers(4))} for _ in range(args.docs)]  # fmt: skip
    task(
        "mc_letters",
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}\\nA. {{options[0]}}\\nB. {{options[1]}}\\nC. {{options[2]}}\\nD. {{options[3]}}'
        '\\nAnswer:"\ndoc_to_choice: ["A", "B", "C", "D"]\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n',
        letters,
    )
    task(
        "wikitext",
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{page}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        [{"page": page} for page in articles(text)[: args.articles]],
    )
    task(
        "completion",
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 32\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
        [{"question": span(20, 50), "answer": span(1, 3)} for _ in range(args.prompts)],
    )


def run(command: list[str], env: dict) -> float:
    """Wall seconds of ``command``, which must succeed."""
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:3])} failed:\n{done.stderr[-3000:]}")
    return seconds


def results_of(folder: Path) -> dict:
    """The results of lm_eval's run (results_<date>.json below --output_path) or jaxseq's (results.json)."""
    found = sorted(folder.rglob("results*.json"))
    return json.loads(found[-1].read_text())["results"]


def agreement(ours: dict, theirs: dict) -> dict:
    """Accuracies equal, other figures' largest relative difference."""
    equal, worst = True, 0.0
    for task, figures in theirs.items():
        for key, value in figures.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            mine = ours[task][key]
            if key.split(",")[0] in ("acc", "acc_norm", "exact_match"):
                equal &= mine == value
            elif value:
                worst = max(worst, abs(mine - value) / abs(value))
    return {"accuracies_equal": bool(equal), "largest_relative_difference": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=64, help="documents of each multiple-choice task")
    parser.add_argument("--articles", type=int, default=2, help="WikiText-2 articles scored whole")
    parser.add_argument("--prompts", type=int, default=16, help="generation prompts")
    parser.add_argument("--hf_batch_size", type=int, default=16, help="lm_eval's --batch_size")
    parser.add_argument("--no_save", action="store_true", help="do not record the run")
    args = parser.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    bin_dir = Path(sys.executable).parent
    report = {
        **records.environment(),
        "cpu_matmul_gflops": records.cpu_matmul_gflops(),
        "settings": {
            "model": "GPT-2 small (GPT2Config(), random init seed 0), float32, max_length 1024",
            "tasks": list(TASKS),
            "docs": args.docs,
            "articles": args.articles,
            "prompts": args.prompts,
            "lm_eval_batch_size": args.hf_batch_size,
            "jaxseq_flags": "defaults (--per_device_eval_batch_size 8)",
            "note": "whole commands' wall time on a CPU box shared with other work",
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp / "gpt2")
        vocab = SHARED / "data/tokenizers/gpt2"
        GPT2TokenizerFast(vocab=str(vocab / "vocab.json"), merges=str(vocab / "merges.txt")).save_pretrained(
            tmp / "gpt2"
        )
        write_tasks(tmp / "tasks", args)
        tasks = ",".join(TASKS)
        base_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        base_env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        xla_cache = tmp / "xla"
        sides = {
            "jaxseq": [str(bin_dir / "jaxseq"), "eval", "--model_name_or_path", str(tmp / "gpt2"), "--tasks", tasks,
                       "--include_path", str(tmp / "tasks"), "--output_dir", str(tmp / "out-jaxseq"),
                       "--compilation_cache_dir", str(xla_cache)],
            "lm_eval_hf": [str(bin_dir / "lm_eval"), "run", "--model", "hf", "--model_args",
                           f"pretrained={tmp / 'gpt2'},dtype=float32", "--tasks", tasks, "--include_path",
                           str(tmp / "tasks"), "--batch_size", str(args.hf_batch_size), "--device", "cpu",
                           "--output_path", str(tmp / "out-lm_eval")],
        }  # fmt: skip
        sides["jaxseq_warm"] = [*sides["jaxseq"][:-4], "--output_dir", str(tmp / "out-warm"), *sides["jaxseq"][-2:]]
        seconds = {}
        for name, command in sides.items():
            env = {**base_env, "HF_DATASETS_CACHE": str(tmp / f"datasets-{name}")}
            seconds[name] = run(command, env)
            print(f"{name}: {seconds[name]:.1f}s", flush=True)
        ours, theirs = results_of(tmp / "out-jaxseq"), results_of(tmp / "out-lm_eval")
        report["results"] = {
            **{f"{name}_seconds": round(s, 2) for name, s in seconds.items()},
            "ratio": round(seconds["jaxseq"] / seconds["lm_eval_hf"], 3),
            "ratio_warm": round(seconds["jaxseq_warm"] / seconds["lm_eval_hf"], 3),
            **agreement(ours, theirs),
            "figures": {task: {k: v for k, v in ours[task].items() if k != "alias"} for task in ours},
        }
    r = report["results"]
    print(
        f"jaxseq eval {r['jaxseq_seconds']:.1f}s (warm XLA cache {r['jaxseq_warm_seconds']:.1f}s), lm_eval --model hf "
        f"{r['lm_eval_hf_seconds']:.1f}s -> {r['ratio']:.2f}x ({r['ratio_warm']:.2f}x warm; target <= {TARGET}); "
        f"accuracies equal: {r['accuracies_equal']}, largest relative difference {r['largest_relative_difference']:.1e}"
    )
    if not math.isfinite(r["largest_relative_difference"]) or r["largest_relative_difference"] > 1e-4:
        print("warning: the figures differ by more than 1e-4", file=sys.stderr)
    if not args.no_save:
        print(f"wrote {records.write('eval_vs_lm_eval', report)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
