"""Pretrain a GPT-2 or GPT-J causal language model with jaxseq, from scratch or from a checkpoint.

    python scripts/pretrain_clm.py --model_name_or_path path/to/gpt2 --train_file corpus.txt --output_dir out/clm
    python scripts/pretrain_clm.py --config_name gpt2 --config_overrides n_layer=6,n_embd=384,n_head=6 \\
        --tokenizer_name gpt2 --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --block_size 256

Text from local files (txt, jsonl, csv) or a Hub dataset is tokenized once (cached under
~/.cache/jaxseq/text), joined with EOS between documents and cut into blocks of --block_size tokens.
Writes to --output_dir: eval_results.json (eval_loss, perplexity), all_results.json, metrics.jsonl
(training loss, tokens/s and model FLOPs utilisation), TensorBoard events, training_curves.png, the
config used, orbax checkpoints (a rerun resumes from the last one and ends bitwise where an uninterrupted
run would, even after a kill), and the model with its tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from jaxseq.cli import RuntimeConfig, script, start
from jaxseq.config import arg, build_parser, parse_args, save_config
from jaxseq.data.text import TextDataConfig, check_sources
from jaxseq.distributed import DistributedConfig
from jaxseq.errors import JaxseqError
from jaxseq.train.optim import OptimizerConfig
from jaxseq.train.trainer import TrainerConfig


@dataclasses.dataclass
class ModelConfig:
    model_name_or_path: str | None = arg(None, "Hub id or local folder of a GPT-2 or GPT-J checkpoint to keep "
                                               "training (omit to train from scratch with --config_name)")
    config_name: str | None = arg(None, "train from scratch: a local folder holding config.json, or a Hub id")
    model_type: str | None = arg(None, "train from scratch from transformers' default config of this type "
                                       "(gpt2 or gptj) instead of --config_name")
    config_overrides: str | None = arg(None, "config fields to change, comma-separated, e.g. "
                                             "'n_layer=2,n_embd=128,n_head=4,resid_pdrop=0'")
    tokenizer_name: str | None = arg(None, "tokenizer Hub id or folder (default: the one beside the model or "
                                           "config); it must be a fast tokenizer with an EOS token")
    peak_flops: float = arg(0.0, "peak FLOP/s of all devices together, for model FLOPs utilisation (MFU) "
                                 "in the log; 0 measures a jitted matmul once at start")


SECTIONS = (ModelConfig, TextDataConfig, RuntimeConfig, TrainerConfig, OptimizerConfig, DistributedConfig)


def check_model_source(args: ModelConfig) -> None:
    scratch = args.config_name or args.model_type
    if not args.model_name_or_path and not scratch:
        raise JaxseqError("pass --model_name_or_path (keep training a checkpoint) or --config_name/--model_type "
                          "(train from scratch)")
    if args.model_name_or_path and scratch:
        raise JaxseqError("pass either --model_name_or_path or --config_name/--model_type, not both")
    if args.config_name and args.model_type:
        raise JaxseqError("pass either --config_name or --model_type, not both")


def model_config(args: ModelConfig):
    """(HF config with the overrides applied, folder it came from or None, overrides)."""
    from transformers import AutoConfig

    from jaxseq.models import FAMILIES
    from jaxseq.models.hub import apply_overrides, load_config, parse_overrides, resolve

    folder = None
    if args.model_type:
        try:
            config = AutoConfig.for_model(args.model_type)
        except ValueError:
            config = None
    else:
        folder = resolve(args.model_name_or_path or args.config_name, weights=bool(args.model_name_or_path))
        config = load_config(folder)
    causal = sorted(name for name, family in FAMILIES.items() if "causal-lm" in family.tasks)
    model_type = args.model_type if config is None else config.model_type
    if model_type not in causal:
        raise JaxseqError(f"model_type {model_type!r} cannot be trained as a causal LM by jaxseq; "
                          f"use one of {', '.join(causal)}")
    overrides = parse_overrides(args.config_overrides, config)
    return apply_overrides(config, **overrides), folder, overrides


def load_tokenizer(name: str | Path | None):
    from transformers import AutoTokenizer

    if name is None:
        raise JaxseqError("--model_type gives no tokenizer: pass --tokenizer_name")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise JaxseqError(f"cannot load a tokenizer from {name} ({str(e).splitlines()[0][:150]}); "
                          "pass --tokenizer_name") from None
    if not tokenizer.is_fast:
        raise JaxseqError(f"the tokenizer of {name} is not a fast (Rust) tokenizer; pass one with a tokenizer.json")
    return tokenizer


def choose_block_size(requested: int | None, config) -> int:
    """--block_size, or transformers' default: the model's positions, at most 1024."""
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if requested is None:
        return min(1024, limit or 1024)
    if limit is not None and requested > limit:
        raise JaxseqError(f"--block_size {requested} exceeds the model's {limit} positions; lower it")
    return requested


@script
def main(argv) -> int:
    parser = build_parser(__doc__, *SECTIONS)
    args, (model_args, data, runtime, trainer_config, optimizer_config, distributed) = parse_args(
        parser, SECTIONS, argv)
    check_model_source(model_args)
    check_sources(data)

    import jax
    import jax.numpy as jnp

    from jaxseq.data.text import load_blocks
    from jaxseq.models import from_config, load_pretrained, save_pretrained
    from jaxseq.models.layers import enable_remat
    from jaxseq.train.objectives import CausalLM
    from jaxseq.train.throughput import flops_per_token, measure_peak_flops
    from jaxseq.train.trainer import Trainer, write_json

    mesh = start(runtime, distributed)
    main_process = jax.process_index() == 0
    log = print if main_process else (lambda *_: None)
    config, folder, overrides = model_config(model_args)
    tokenizer = load_tokenizer(model_args.tokenizer_name or folder)
    if len(tokenizer) > config.vocab_size:
        raise JaxseqError(f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size}; "
                          "pass the model's tokenizer or override vocab_size")
    block_size = choose_block_size(data.block_size, config)
    train_blocks, valid_blocks = load_blocks(data, tokenizer, block_size, progress=main_process, log=log)

    dtype = jnp.dtype(runtime.dtype)
    if model_args.model_name_or_path:
        model = load_pretrained(folder, "causal-lm", mesh=mesh, dtype=dtype, seed=trainer_config.seed, **overrides)
    else:
        model = from_config(config, "causal-lm", mesh=mesh, dtype=dtype, seed=trainer_config.seed)
    if runtime.remat:
        enable_remat(model)
    peak = model_args.peak_flops or measure_peak_flops(mesh.devices.flat, dtype)
    flops = flops_per_token(model, block_size)
    trainer = Trainer(model, CausalLM(), trainer_config, optimizer_config, {"input_ids": train_blocks},
                      {"": {"input_ids": valid_blocks}}, mesh, loss_scaling=runtime.dtype == "float16",
                      tokens_per_example=block_size, flops_per_example=flops * block_size, peak_flops=peak)
    output_dir = Path(trainer_config.output_dir)
    if main_process:
        save_config(output_dir / "config.yaml", model_args, data, runtime, trainer_config, optimizer_config)
    trainer.logger.write(trainer.describe())
    trainer.logger.write(
        f"{config.model_type}: {len(train_blocks):,} training / {len(valid_blocks):,} validation blocks of "
        f"{block_size} tokens; {trainer.total_steps} steps of global batch {trainer.global_batch} on "
        f"{jax.device_count()} devices (mesh {dict(mesh.shape)}); {flops / 1e9:.3g} GFLOP per token, peak "
        f"{peak / 1e9:.4g} GFLOP/s ({'given' if model_args.peak_flops else 'measured'})"
    )
    try:
        train_results = trainer.train()
    finally:
        trainer.close()
    eval_results = {"eval_loss": train_results["eval_loss"], "perplexity": train_results["eval_perplexity"],
                    "eval_samples": len(valid_blocks)}
    write_json(output_dir / "eval_results.json", eval_results)
    write_json(output_dir / "all_results.json", {**train_results, **eval_results, "train_samples": len(train_blocks),
                                                  "block_size": block_size})
    trainer.logger.plot()
    save_pretrained(trainer.model(), output_dir, tokenizer=tokenizer)  # every process gathers, process 0 writes
    shown = ("eval_loss", "perplexity", "train_tokens_per_second", "train_mfu")
    log(" ".join(f"{k}={v:.4g}" for k, v in {**train_results, **eval_results}.items() if k in shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
