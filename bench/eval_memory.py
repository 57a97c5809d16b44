"""Host peak memory of a causal-LM evaluation over 8 CPU devices with GPT-2's vocabulary (50257 tokens).

    python bench/eval_memory.py [--loss_chunk_tokens 512] [--per_device_eval_batch_size 8] [--block_size 1024]
        [--json bench/results/eval_memory.json]

A GPT-2 with tiny hidden states (2 layers of width 32, one attention head) and GPT-2's real vocabulary, so
the logits outweigh everything else: the Trainer's evaluation (``Trainer.evaluate``: the jitted eval step,
every example, loss and perplexity) over one eval batch of 8 devices x ``--per_device_eval_batch_size`` rows
of ``--block_size`` tokens of Tiny Shakespeare (the real GPT-2 tokenizer from ../shared/data/tokenizers/gpt2).
The process runs alone (8 virtual CPU devices, set before JAX starts), so its peak RSS (VmHWM of
/proc/self/status) is the evaluation's: printed as one JSON line (``tests/test_eval_memory.py`` runs it and checks it
against the arithmetic). Arithmetic, with the defaults: the whole batch's float32 logits are
64 x 1024 x 50257 x 4 bytes = 13.2 GB (1.65 GB per device); a loss chunk is 8 rows x 64 positions = 512
tokens per device, 103 MB of logits, 0.82 GB for the 8 devices sharing this host. ``--loss_chunk_tokens 0``:
the unchunked loss (mind the 13.2 GB at the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
DEVICES = 8


def rss_mb() -> float:
    """This process's resident memory now (MB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB): its memory map's high-water mark. Not ``getrusage``'s
    ru_maxrss, which Linux carries across exec from the process that started this one (a test suite
    holding 4.8 GB of models read 4035 MB "added" by a 2.2 GB evaluation)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024 / 1e6


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss_chunk_tokens", type=int, default=512, help="0: the unchunked loss")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "data" / "tokenizers" / "gpt2")
    parser.add_argument("--text", type=Path, default=SHARED / "data" / "text" / "tinyshakespeare.txt")
    parser.add_argument("--json", type=Path, help="also add the record to this JSON list")
    args = parser.parse_args(argv)

    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(ROOT))
    import jax
    import numpy as np
    import transformers

    from jaxseq.mesh import make_mesh
    from jaxseq.models import from_config
    from jaxseq.train.feeding import abstract_batch
    from jaxseq.train.objectives import CausalLM
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.spec import RunSpec
    from jaxseq.train.trainer import Trainer
    from jaxseq.train.trainer_config import TrainerConfig

    tokenizer = transformers.GPT2TokenizerFast(
        vocab=str(args.tokenizer / "vocab.json"), merges=str(args.tokenizer / "merges.txt")
    )
    rows, block = DEVICES * args.per_device_eval_batch_size, args.block_size
    ids = tokenizer(args.text.read_text()[: 6 * rows * block])["input_ids"]
    blocks = np.resize(np.asarray(ids, np.uint16), (rows, block))  # repeats the text if it falls short
    vocab = len(tokenizer)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=1, vocab_size=vocab, n_positions=block)
    mesh = make_mesh(f"dp={DEVICES}")
    model = from_config(config, "causal-lm", mesh=mesh, seed=0)
    with tempfile.TemporaryDirectory() as out:
        trainer_config = TrainerConfig(
            output_dir=out,
            max_steps=1,
            per_device_train_batch_size=1,
            per_device_eval_batch_size=args.per_device_eval_batch_size,
        )
        spec = RunSpec(
            mesh, config, "causal-lm", CausalLM(args.loss_chunk_tokens or None), trainer_config, OptimizerConfig()
        )
        trainer = Trainer(spec, model, {"input_ids": blocks}, {"": {"input_ids": blocks}})
        before = rss_mb()
        started = time.perf_counter()
        metrics = trainer.evaluate()
        seconds = time.perf_counter() - started
        peak = peak_rss_mb()
        batch = abstract_batch(mesh, rows, {"input_ids": ((block,), np.uint16)})
        compiled = trainer.program.eval_step.lower(trainer.eval_params(), None, batch).compile()
        trainer.close()
    task = trainer.task
    positions = task.chunk_positions(rows, block) if task.chunk_tokens else block
    chunk_logits = rows // DEVICES * positions * vocab * 4
    record = {
        "devices": DEVICES,
        "device": jax.devices()[0].device_kind,
        "rows": rows,
        "block_size": block,
        "vocab_size": vocab,
        "loss_chunk_tokens": args.loss_chunk_tokens,
        "chunk_positions": positions,
        "chunk_logits_bytes_per_device": chunk_logits,
        "full_logits_bytes_per_device": rows // DEVICES * block * vocab * 4,
        "eval_step_temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
        "rss_before_eval_mb": round(before, 1),
        "peak_rss_mb": round(peak, 1),
        "eval_added_mb": round(peak - before, 1),
        "eval_seconds": round(seconds, 2),
        "eval_loss": metrics["loss"],
        "eval_perplexity": metrics["perplexity"],
        "jax": jax.__version__,
    }
    print(json.dumps(record))
    if args.json:  # a list of records: this one replaces an earlier one of the same settings
        keys = ("loss_chunk_tokens", "rows", "block_size", "vocab_size")
        records = json.loads(args.json.read_text()) if args.json.exists() else []
        records = [r for r in records if any(r.get(k) != record[k] for k in keys)] + [record]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
