"""Fine-tune a T5 model on source/target pairs with jaxseq (sharded over every device you have).

    jaxseq seq2seq --model_name_or_path google-t5/t5-small \\
        --train_file train.jsonl --validation_file dev.jsonl --source_prefix "summarize: " --output_dir out/t5
    jaxseq seq2seq --model_type t5 --config_overrides num_layers=2,d_model=128 \\
        --tokenizer_name my-t5-tokenizer --train_file train.csv --validation_file dev.csv

Files are csv/tsv (with a header), JSON lists or JSONL, with a source and a target column. Training is
teacher-forced cross-entropy on the target tokens; evaluation reports the loss and perplexity over every
target token and, by default, decodes greedily to score exact match.
Writes to --output_dir: eval_results.json, all_results.json, metrics.jsonl, TensorBoard events,
training_curves.png, the config used, orbax checkpoints (a rerun resumes), and the model with its tokenizer
as a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.rows import EncodedRows
from jaxseq.data.seq2seq import encode_pairs, load_pairs
from jaxseq.errors import JaxseqError
from jaxseq.models.source import ModelSource, check_vocabulary, load_tokenizer, model_config
from jaxseq.runner import Job, Prepared, run
from jaxseq.train.objectives import Seq2SeqLM

DEFAULT_MODEL = "google-t5/t5-small"
TASK = "seq2seq-lm"


@dataclasses.dataclass
class Seq2SeqDataConfig:
    train_file: str | None = arg(None, "training pairs: csv, tsv, json or jsonl (required)")
    validation_file: str | None = arg(None, "evaluation pairs, same format (required)")
    source_column: str = arg("source", "column holding the input text")
    target_column: str = arg("target", "column holding the text to produce")
    source_prefix: str = arg("", "text put before every source, e.g. 'summarize: ' or 'translate English to German: '")
    max_source_length: int = arg(128, "source tokens per example (longer sources are truncated)")
    max_target_length: int = arg(64, "target tokens per example, EOS included (longer targets are truncated)")
    max_train_samples: int | None = arg(None, "use only the first N training pairs")
    max_eval_samples: int | None = arg(None, "use only the first N evaluation pairs")
    predict_with_generate: bool = arg(True, "decode the evaluation sources greedily and score exact match")
    generation_max_length: int | None = arg(None, "new tokens per generated answer (default: --max_target_length)")


def load_data(data: Seq2SeqDataConfig):
    if not data.train_file or not data.validation_file:
        raise JaxseqError(
            "pass --train_file and --validation_file (csv, tsv, json or jsonl with "
            f"'{data.source_column}' and '{data.target_column}' columns)"
        )
    for name in ("max_source_length", "max_target_length"):
        if getattr(data, name) < 1:
            raise JaxseqError(f"--{name} must be at least 1")
    train = load_pairs(data.train_file, data.source_column, data.target_column)[: data.max_train_samples]
    evals = load_pairs(data.validation_file, data.source_column, data.target_column)[: data.max_eval_samples]
    return train, evals


def prepare(args, planning: bool) -> Prepared:
    """Source/target pairs, tokenized when a batch first needs them, by the process that takes them (a plan
    reads none: its batches are pairs of --max_source_length and --max_target_length tokens)."""
    source, data = args.source, args.data
    common = {"seq_len": data.max_source_length, "target_len": data.max_target_length}
    if planning:
        config, _, _ = model_config(source, TASK, weights=False)
        source_row, target_row = ((data.max_source_length,), np.int32), ((data.max_target_length,), np.int32)
        row = {
            "input_ids": source_row,
            "attention_mask": source_row,
            "labels": target_row,
            "decoder_attention_mask": target_row,
        }
        return Prepared(config, Seq2SeqLM(), row=row, **common)
    train_pairs, eval_pairs = load_data(data)
    config, folder, overrides = model_config(source, TASK)
    tokenizer = load_tokenizer(source.tokenizer_name or folder)
    check_vocabulary(tokenizer, config)
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise JaxseqError("the tokenizer needs a pad and an EOS token (T5 tokenizers have both); pass a T5 tokenizer")
    tokenize = functools.partial(
        encode_pairs,
        tokenizer=tokenizer,
        max_source_length=data.max_source_length,
        max_target_length=data.max_target_length,
        source_prefix=data.source_prefix,
    )
    max_new = (data.generation_max_length or data.max_target_length) if data.predict_with_generate else 0
    return Prepared(
        config,
        Seq2SeqLM(tokenizer, max_new_tokens=max_new),
        train=EncodedRows(train_pairs, tokenize),
        evals={"": EncodedRows(eval_pairs, tokenize)},
        checkpoint=folder if source.model_name_or_path else None,
        overrides=overrides,
        tokenizer=tokenizer,
        summary=lambda _: f"{len(train_pairs)} train / {len(eval_pairs)} eval pairs",
        **common,
    )


JOB = Job(__doc__, TASK, {"source": ModelSource, "data": Seq2SeqDataConfig}, prepare, default_model=DEFAULT_MODEL)


@script
def main(argv) -> int:
    return run(JOB, argv)
