"""Pretrain a GPT-2, GPT-J, Llama, Mistral or Qwen2 causal language model with jaxseq, from scratch or from a
checkpoint.

    jaxseq clm --model_name_or_path path/to/gpt2 --train_file corpus.txt --output_dir out/clm
    jaxseq clm --config_name gpt2 --config_overrides n_layer=6,n_embd=384,n_head=6 \\
        --tokenizer_name gpt2 --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --block_size 256

Text from local files (txt, jsonl, csv) or a Hub dataset is tokenized once (cached under
~/.cache/jaxseq/text), joined with EOS between documents and cut into blocks of --block_size tokens.
Writes to --output_dir: eval_results.json (eval_loss, perplexity), all_results.json, metrics.jsonl
(training loss, tokens/s and model FLOPs utilisation), TensorBoard events, training_curves.png, the
config used, orbax checkpoints (a rerun resumes from the last one and ends bitwise where an uninterrupted
run would, even after a kill), and the model with its tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.cli import PlanConfig, RuntimeConfig, finish, parse, plan_run, script, start
from jaxseq.config import save_config
from jaxseq.data.text import TextDataConfig, check_sources, load_blocks
from jaxseq.distributed import DistributedConfig
from jaxseq.hub_push import HubConfig
from jaxseq.models.source import (
    ModelSource,
    build_model,
    check,
    check_vocabulary,
    load_tokenizer,
    model_config,
    sequence_length,
)
from jaxseq.train.lora import LoraConfig
from jaxseq.train.objectives import CausalLMConfig
from jaxseq.train.optim import OptimizerConfig
from jaxseq.train.throughput import SpeedConfig, flops_per_token, peak_flops
from jaxseq.train.trainer import Trainer, TrainerConfig

SECTIONS = (
    ModelSource,
    TextDataConfig,
    RuntimeConfig,
    PlanConfig,
    TrainerConfig,
    OptimizerConfig,
    LoraConfig,
    SpeedConfig,
    CausalLMConfig,
    HubConfig,
    DistributedConfig,
)


@script
def main(argv) -> int:
    source, data, runtime, plan, trainer_config, optimizer_config, lora_config, speed, loss, hub, distributed = parse(
        __doc__, SECTIONS, argv
    )
    check(source)
    if plan.compile_topology:
        config, _, _ = model_config(source, "causal-lm", weights=False)
        block_size = sequence_length(data.block_size, config, "block_size", 1024)
        plan_run(
            plan,
            runtime,
            trainer_config,
            optimizer_config,
            lora_config,
            config=config,
            task="causal-lm",
            objective=loss.objective(),
            row={"input_ids": ((block_size,), np.int32)},
            seq_len=block_size,
            causal=True,
        )
        return 0
    check_sources(data)

    mesh = start(runtime, distributed)
    main_process = jax.process_index() == 0
    log = print if main_process else (lambda *_: None)
    config, folder, overrides = model_config(source, "causal-lm")
    tokenizer = load_tokenizer(source.tokenizer_name or folder)
    check_vocabulary(tokenizer, config)
    block_size = sequence_length(data.block_size, config, "block_size", 1024)
    train_blocks, valid_blocks = load_blocks(data, tokenizer, block_size, progress=main_process, log=log)

    dtype = jnp.dtype(runtime.dtype)
    model = build_model(
        source, "causal-lm", config, folder, overrides, mesh=mesh, dtype=dtype, seed=trainer_config.seed,
        scan_layers=trainer_config.scans(mesh),
    )  # fmt: skip
    peak, peak_source = peak_flops(mesh.devices.flat, dtype, speed.peak_flops)
    flops = flops_per_token(model, block_size)
    trainer = Trainer(
        model,
        loss.objective(),
        trainer_config,
        optimizer_config,
        {"input_ids": train_blocks},
        {"": {"input_ids": valid_blocks}},
        mesh,
        loss_scaling=runtime.dtype == "float16",
        tokens_per_example=block_size,
        flops_per_example=flops * block_size,
        peak_flops=peak,
        lora=lora_config,
    )
    if main_process:
        save_config(
            trainer.output_dir / "config.yaml",
            source,
            data,
            runtime,
            trainer_config,
            optimizer_config,
            lora_config,
            speed,
            loss,
        )
    trainer.logger.write(trainer.describe())
    trainer.logger.write(
        f"{config.model_type}: {len(train_blocks):,} training / {len(valid_blocks):,} validation blocks of "
        f"{block_size} tokens; {trainer.total_steps} steps of global batch {trainer.global_batch} on "
        f"{jax.device_count()} devices (mesh {dict(mesh.shape)}); {flops / 1e9:.3g} GFLOP per token, peak "
        f"{peak / 1e9:.4g} GFLOP/s: MFU is of {peak_source}"
    )
    try:
        results = trainer.train()
    finally:
        trainer.close()
    finish(
        trainer,
        results,
        tokenizer=tokenizer,
        base_model=source.model_name_or_path,
        hub=hub,
        train_samples=len(train_blocks),
        eval_samples=len(valid_blocks),
        extra_eval={"perplexity": results["eval_perplexity"]},  # run_clm's name for it
    )
    log(" ".join(f"{k}={results[k]:.4g}" for k in ("train_tokens_per_second", "train_mfu") if k in results))
    return 0
