"""Evaluate a {families} checkpoint on lm-evaluation-harness tasks (sharded over every device).

    jaxseq eval --model_name_or_path out/model --tasks hellaswag,arc_easy --output_dir out/eval
    jaxseq eval --model_name_or_path gpt2 --tasks my_task --include_path my_tasks/ --num_fewshot 5 \\
        --limit 100 --log_samples --output_dir out/eval-mine
    jaxseq eval --model_name_or_path out/chat --tasks gsm8k --apply_chat_template --bf16 --output_dir out/gsm8k

lm-eval's tasks, groups and tags (`lm-eval ls tasks`), or your own task YAMLs in --include_path, run as
`lm_eval --model hf` runs them: the same requests, tokenized the same way, answered by the jaxseq model
(log-likelihoods from packed forward passes, greedy generation with jaxseq's decoding). OUTPUT_DIR receives
lm-eval's results (results.json) and, with --log_samples, each task's samples (samples_TASK.jsonl); the
table lm-eval prints is printed. Needs the eval extra: pip install 'jaxseq[eval]'.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from jaxseq.cli import RuntimeConfig, parse, script, start
from jaxseq.config import arg
from jaxseq.distributed import DistributedConfig
from jaxseq.errors import JaxseqError
from jaxseq.harness import (
    JaxseqLM,
    Settings,
    evaluate_tasks,
    generation_eos,
    prepare_tasks,
    print_table,
    require_lm_eval,
    save_results,
)
from jaxseq.models.hub import apply_overrides, load_config, load_pretrained, parse_overrides, position_limit, resolve
from jaxseq.models.registry import families_with, family_for, family_names
from jaxseq.models.source import PretrainedModel, check_vocabulary, load_tokenizer
from jaxseq.train.lora import ADAPTER_HELP, merge_adapter

__doc__ = __doc__.format(families=family_names("causal-lm"))  # the families the registry lists


@dataclasses.dataclass
class EvalConfig:
    """What to evaluate, with lm-eval's flag names."""

    tasks: str | None = arg(None, "lm-eval tasks, groups or tags, comma-separated (e.g. hellaswag,arc_easy)")
    include_path: str | None = arg(None, "a folder of your own task YAML files, found by their task names")
    num_fewshot: int | None = arg(None, "examples in each prompt's few-shot context (default: each task's own)")
    limit: float | None = arg(None, "examples per task at most (below 1: that fraction of each task); for testing")
    apply_chat_template: bool = arg(False, "write each prompt with the tokenizer's chat template")
    fewshot_as_multiturn: bool | None = arg(
        None, "with --apply_chat_template: few-shot examples as turns of the chat (default: yes)"
    )
    system_instruction: str | None = arg(None, "a system instruction put before every prompt")
    log_samples: bool = arg(False, "also write every example's requests and answers (samples_TASK.jsonl)")
    per_device_eval_batch_size: int = arg(
        8, "rows of --max_length tokens per device in a scoring batch (narrower rows come more to a batch); "
        "prompts per device in a generation batch",
    )  # fmt: skip
    max_length: int | None = arg(
        None, "context length in tokens; longer inputs are cut from the left (default: the model's positions)"
    )
    output_dir: str | None = arg(None, "where results.json (and samples_TASK.jsonl) go; without it: printed only")
    lora_adapter: str | None = arg(None, f"{ADAPTER_HELP}: merged into the weights before evaluating")


SECTIONS = (PretrainedModel, EvalConfig, RuntimeConfig, DistributedConfig)


def settings_of(cfg: EvalConfig) -> Settings:
    if cfg.num_fewshot is not None and cfg.num_fewshot < 0:
        raise JaxseqError(f"--num_fewshot must be at least 0, got {cfg.num_fewshot}")
    if cfg.limit is not None and cfg.limit <= 0:
        raise JaxseqError(f"--limit must be positive (a count, or a fraction below 1), got {cfg.limit}")
    if cfg.per_device_eval_batch_size < 1:
        raise JaxseqError(f"--per_device_eval_batch_size must be at least 1, got {cfg.per_device_eval_batch_size}")
    if cfg.max_length is not None and cfg.max_length < 2:
        raise JaxseqError(f"--max_length must be at least 2 tokens, got {cfg.max_length}")
    if cfg.log_samples and not cfg.output_dir:
        raise JaxseqError("--log_samples writes files: pass --output_dir too")
    return Settings(
        num_fewshot=cfg.num_fewshot,
        limit=cfg.limit,
        apply_chat_template=cfg.apply_chat_template,
        fewshot_as_multiturn=cfg.fewshot_as_multiturn,
        system_instruction=cfg.system_instruction,
        log_samples=cfg.log_samples,
    )


@script
def main(argv) -> int:
    source, cfg, runtime, distributed = parse(__doc__, SECTIONS, argv)
    require_lm_eval()
    if not source.model_name_or_path:
        raise JaxseqError("pass --model_name_or_path (a Hub id such as gpt2, or a local model folder)")
    names = [name.strip() for name in (cfg.tasks or "").split(",") if name.strip()]
    if not names:
        raise JaxseqError("pass --tasks (lm-eval task names, comma-separated; `lm-eval ls tasks` lists them)")
    settings = settings_of(cfg)

    folder = resolve(source.model_name_or_path)
    config = load_config(folder)
    family_for(config.model_type)  # one that jaxseq has
    if config.model_type not in families_with("causal-lm"):
        raise JaxseqError(
            f"{config.model_type} models are not causal language models; jaxseq eval takes "
            f"{family_names('causal-lm')} checkpoints"
        )
    overrides = parse_overrides(source.config_overrides, config)
    limit = position_limit(apply_overrides(config, **overrides))
    if cfg.max_length and limit and cfg.max_length > limit:
        raise JaxseqError(f"--max_length {cfg.max_length} exceeds the model's {limit} positions; lower it")
    tokenizer = load_tokenizer(source.tokenizer_name or folder, fast=False)
    if cfg.apply_chat_template and not tokenizer.chat_template:
        raise JaxseqError("--apply_chat_template: the tokenizer has no chat template; pass one that has")
    model_args = {"pretrained": source.model_name_or_path, "dtype": runtime.dtype}
    if cfg.lora_adapter:
        model_args["peft"] = cfg.lora_adapter
    loaded = prepare_tasks(names, settings, include_path=cfg.include_path, metadata=dict(model_args))

    mesh = start(runtime, distributed)  # a multi-host run: every process runs every request, process 0 writes
    model = load_pretrained(folder, "causal-lm", mesh=mesh, dtype=jnp.dtype(runtime.dtype), **overrides)
    if cfg.lora_adapter:
        merge_adapter(model, cfg.lora_adapter)
    check_vocabulary(tokenizer, model.config)
    lm = JaxseqLM(
        model,
        tokenizer,
        batch_size=cfg.per_device_eval_batch_size,
        max_length=cfg.max_length,
        mesh=mesh,
        eos_token_ids=generation_eos(folder, model.config),
        name=source.model_name_or_path,
    )
    results, tracker = evaluate_tasks(lm, loaded, settings, model_args=model_args)
    if jax.process_index() != 0:
        return 0
    if cfg.output_dir:
        written = save_results(results, tracker, cfg.output_dir)
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    print(
        f"jaxseq ({args}), limit: {cfg.limit}, num_fewshot: {cfg.num_fewshot}, "
        f"batch_size: {cfg.per_device_eval_batch_size} per device"
    )
    print_table(results)
    return 0
