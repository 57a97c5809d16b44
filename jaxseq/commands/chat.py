"""Fine-tune a causal language model on chats, learning only the assistant's turns (supervised fine-tuning).

    jaxseq chat --model_name_or_path path/to/model --train_file chats.jsonl \\
        --output_dir out/chat --max_seq_length 1024

Conversations come from .jsonl/.json files or a Hub dataset: records with "messages" (a list of {"role",
"content"}), or "prompt" and "completion". Each is rendered with the tokenizer's chat template (or
--chat_template); the loss covers the tokens of every assistant turn and nothing else. Conversations are
packed several to a row (--no_pack_sequences: one per row), attention and positions never crossing from one
to the next. Writes to --output_dir what `jaxseq clm` writes (eval_results.json with the held-out loss and
perplexity over assistant tokens, metrics.jsonl, TensorBoard, checkpoints), and the model with its tokenizer
and chat template as a Hugging Face folder that transformers' generate and pipelines chat with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.cli import PlanConfig, RuntimeConfig, finish, parse, plan_run, script, start
from jaxseq.config import save_config
from jaxseq.data.chat import ChatDataConfig, load_chat_rows, use_chat_template
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
    ChatDataConfig,
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
ROW = ("input_ids", "attention_mask", "position_ids", "loss_mask")


@script
def main(argv) -> int:
    source, data, runtime, plan, trainer_config, optimizer_config, lora_config, speed, loss, hub, distributed = parse(
        __doc__, SECTIONS, argv
    )
    check(source)
    if plan.compile_topology:
        config, _, _ = model_config(source, "causal-lm", weights=False)
        seq = sequence_length(data.max_seq_length, config, "max_seq_length", 2048)
        plan_run(
            plan,
            runtime,
            trainer_config,
            optimizer_config,
            lora_config,
            config=config,
            task="causal-lm",
            objective=loss.objective(),
            row=dict.fromkeys(ROW, ((seq,), np.int32)),
            seq_len=seq,
            causal=True,
        )
        return 0
    mesh = start(runtime, distributed)
    main_process = jax.process_index() == 0
    log = print if main_process else (lambda *_: None)
    config, folder, overrides = model_config(source, "causal-lm")
    tokenizer = load_tokenizer(source.tokenizer_name or folder)
    use_chat_template(tokenizer, data.chat_template)
    check_vocabulary(tokenizer, config)
    seq = sequence_length(data.max_seq_length, config, "max_seq_length", 2048)
    train_rows, valid_rows = load_chat_rows(data, tokenizer, seq, progress=main_process, log=log)

    dtype = jnp.dtype(runtime.dtype)
    model = build_model(
        source, "causal-lm", config, folder, overrides, mesh=mesh, dtype=dtype, seed=trainer_config.seed,
        scan_layers=trainer_config.scans(mesh),
    )  # fmt: skip
    peak, peak_source = peak_flops(mesh.devices.flat, dtype, speed.peak_flops)
    flops = flops_per_token(model, seq)
    trainer = Trainer(
        model,
        loss.objective(),
        trainer_config,
        optimizer_config,
        train_rows,
        {"": valid_rows},
        mesh,
        loss_scaling=runtime.dtype == "float16",
        tokens_per_example=seq,
        flops_per_example=flops * seq,
        peak_flops=peak,
        lora=lora_config,
        packed_rows=data.pack_sequences,
    )
    if main_process:
        save_config(trainer.output_dir / "config.yaml", source, data, runtime, trainer_config, optimizer_config,
                    lora_config, speed, loss)  # fmt: skip
    trainer.logger.write(trainer.describe())
    rows, learned = len(train_rows["input_ids"]), int(train_rows["loss_mask"].sum())
    trainer.logger.write(
        f"{config.model_type}: {rows:,} training rows of {seq} tokens ({learned:,} assistant tokens, "
        f"{learned / (rows * seq):.0%} of the rows), {len(valid_rows['input_ids']):,} validation rows; "
        f"{trainer.total_steps} steps of global batch {trainer.global_batch} on {jax.device_count()} devices "
        f"(mesh {dict(mesh.shape)}); MFU is of {peak_source}"
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
        train_samples=rows,
        eval_samples=len(valid_rows["input_ids"]),
        extra_eval={"perplexity": results["eval_perplexity"]},
    )
    return 0
