"""Fine-tune a Hugging Face model on a GLUE task with jaxseq (sharded over every device you have).

    jaxseq glue --task_name sst2 --output_dir out/sst2
    jaxseq glue --config glue_sst2 --mesh dp=2,mp=4

Reads GLUE from the Hub (datasets) or a local folder of GLUE TSVs (--data_dir), or your own
csv/tsv/json files (--train_file/--validation_file). Writes to --output_dir: eval_results.json,
all_results.json, metrics.jsonl, TensorBoard events, training_curves.png, the config used,
orbax checkpoints, and the fine-tuned model with its tokenizer as a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.cli import PlanConfig, RuntimeConfig, finish, parse, plan_run, script, start
from jaxseq.config import arg, save_config
from jaxseq.data.glue import SPLIT_SUFFIX, TASKS, encode, get_task, load_split
from jaxseq.data.rows import EncodedRows
from jaxseq.distributed import DistributedConfig
from jaxseq.errors import JaxseqError
from jaxseq.hub_push import HubConfig
from jaxseq.models.hub import apply_overrides
from jaxseq.models.source import ModelSource, build_model, check, load_tokenizer, model_config
from jaxseq.train.lora import LoraConfig
from jaxseq.train.objectives import SequenceClassification
from jaxseq.train.optim import OptimizerConfig
from jaxseq.train.trainer import Trainer, TrainerConfig

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@dataclasses.dataclass
class GlueConfig:
    task_name: str = arg("sst2", "GLUE task", choices=tuple(TASKS))
    data_dir: str | None = arg(
        None,
        "local folder of GLUE TSVs (the GLUE download script's layout); default: the nyu-mll/glue dataset on the Hub",
    )
    train_file: str | None = arg(
        None, "your own training file (csv, tsv, json, jsonl) with the task's text columns and 'label'"
    )
    validation_file: str | None = arg(None, "your own validation file, same format as --train_file")
    max_seq_length: int = arg(128, "tokens per example (longer texts are truncated, shorter padded)")
    max_train_samples: int | None = arg(None, "use only the first N training examples")
    max_eval_samples: int | None = arg(None, "use only the first N examples of each eval split")
    pack_sequences: bool = arg(
        False,
        "pack several short examples into each row of --max_seq_length (same "
        "math per example, much less padding: several times faster on short texts)",
    )


SECTIONS = (
    ModelSource,
    GlueConfig,
    RuntimeConfig,
    PlanConfig,
    TrainerConfig,
    OptimizerConfig,
    LoraConfig,
    HubConfig,
    DistributedConfig,
)


def load_examples(glue: GlueConfig):
    task = get_task(glue.task_name)
    train = load_split(task, "train", data_dir=glue.data_dir, file=glue.train_file)
    if glue.validation_file:
        evals = {"": load_split(task, "validation", file=glue.validation_file)}
    else:
        evals = {
            SPLIT_SUFFIX.get(split, ""): load_split(task, split, data_dir=glue.data_dir) for split in task.eval_splits
        }
    if glue.max_train_samples:
        train = train[: glue.max_train_samples]
    if glue.max_eval_samples:
        evals = {k: v[: glue.max_eval_samples] for k, v in evals.items()}
    return task, train, evals


def glue_model_config(source: ModelSource):
    """The model's config (with --config_overrides), its folder and the overrides; offline, the error says
    how to run without the Hub."""
    try:
        return model_config(source, "sequence-classification")
    except JaxseqError as e:
        if "cannot download" in str(e):
            raise JaxseqError(
                f"{e}. To run offline, pass --model_name_or_path /path/to/hf-model-folder and "
                "--data_dir /path/to/glue-tsvs"
            ) from None
        raise


def max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


@script
def main(argv) -> int:
    source, glue, runtime, plan, trainer_config, optimizer_config, lora_config, hub, distributed = parse(
        __doc__, SECTIONS, argv
    )
    check(source, default_model=DEFAULT_MODEL)
    if plan.compile_topology:
        task = get_task(glue.task_name)
        config, _, _ = model_config(source, "sequence-classification", weights=False)
        config = apply_overrides(config, num_labels=task.num_labels)
        row = dict.fromkeys(("input_ids", "attention_mask"), ((glue.max_seq_length,), np.int32))
        if config.model_type == "bert":
            row["token_type_ids"] = ((glue.max_seq_length,), np.int32)
        row["labels"] = ((), np.float32 if task.is_regression else np.int32)
        plan_run(
            plan,
            runtime,
            trainer_config,
            optimizer_config,
            lora_config,
            config=config,
            task="sequence-classification",
            objective=SequenceClassification(task),
            row=row,
            seq_len=glue.max_seq_length,
            causal=config.model_type != "bert",
        )
        return 0
    mesh = start(runtime, distributed)
    task, train_examples, eval_examples = load_examples(glue)
    config, folder, overrides = glue_model_config(source)
    limit = max_positions(config)
    if limit is not None and glue.max_seq_length > limit:
        raise JaxseqError(f"--max_seq_length {glue.max_seq_length} exceeds the model's {limit} positions; lower it")
    tokenizer = load_tokenizer(source.tokenizer_name or folder, fast=False)
    if len(tokenizer) > config.vocab_size:
        raise JaxseqError(
            f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size}; "
            "pass the model's own tokenizer"
        )
    overrides = {**overrides, "num_labels": task.num_labels}
    if tokenizer.pad_token is None:  # GPT-2 style: pad with EOS, and classify at the last real token
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(config, "pad_token_id", None) is None:
        overrides["pad_token_id"] = tokenizer.pad_token_id
    if not task.is_regression:
        overrides["id2label"] = dict(enumerate(task.labels))
        overrides["label2id"] = {name: i for i, name in enumerate(task.labels)}
    model = build_model(
        source,
        "sequence-classification",
        apply_overrides(config, **overrides),
        folder,
        overrides,
        mesh=mesh,
        dtype=jnp.dtype(runtime.dtype),
        seed=trainer_config.seed,
    )
    # tokenized when a batch first needs them, by the process that takes them: each process only its share
    tokenize = functools.partial(encode, task, tokenizer=tokenizer, max_seq_length=glue.max_seq_length)
    train_data = EncodedRows(train_examples, tokenize)
    eval_sets = {k: EncodedRows(v, tokenize) for k, v in eval_examples.items()}

    trainer = Trainer(
        model,
        SequenceClassification(task),
        trainer_config,
        optimizer_config,
        train_data,
        eval_sets,
        mesh,
        loss_scaling=runtime.dtype == "float16",
        pack=model.pooled_token if glue.pack_sequences else None,
        lora=lora_config,
    )
    if jax.process_index() == 0:  # after Trainer has checked any checkpoint already in output_dir
        save_config(
            trainer.output_dir / "config.yaml", source, glue, runtime, trainer_config, optimizer_config, lora_config
        )
    trainer.logger.write(trainer.describe())
    trainer.logger.write(
        f"{task.name}: {len(train_examples)} train / {sum(map(len, eval_examples.values()))} eval examples, "
        f"{trainer.total_steps} steps of global batch {trainer.global_batch} on {jax.device_count()} devices "
        f"(mesh {dict(mesh.shape)})"
    )
    if trainer.feed.pack:
        trainer.logger.write(
            f"packing {trainer.feed.micro_batch} examples into {trainer.feed.packed_rows} rows per "
            f"micro-batch (of {glue.max_seq_length} tokens)"
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
        train_samples=len(train_examples),
        eval_samples=len(next(iter(eval_examples.values()))),
    )
    return 0
