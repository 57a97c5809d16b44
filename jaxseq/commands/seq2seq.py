"""Fine-tune a T5 model on source/target pairs with jaxseq (sharded over every device you have): transformers'
run_summarization.py.

    jaxseq seq2seq --model_name_or_path google-t5/t5-small --text_column text --summary_column summary \\
        --train_file train.jsonl --validation_file dev.jsonl --source_prefix "summarize: " --output_dir out/t5
    jaxseq seq2seq --model_name_or_path out/t5 --test_file test.jsonl --do_predict --num_beams 4 --output_dir out/test
    jaxseq seq2seq --model_type t5 --config_overrides num_layers=2,d_model=128 \\
        --tokenizer_name my-t5-tokenizer --train_file train.csv --validation_file dev.csv

Files are csv/tsv (with a header), JSON lists or JSONL, with a source and a target column. Training is
teacher-forced cross-entropy on the target tokens; evaluation reports the loss and perplexity over every
target token and, by default (--predict_with_generate), generates (greedy, or beam search with --num_beams)
to score eval_rouge1/2/L/Lsum (rouge_score, stemmed, as the script), eval_gen_len and eval_exact_match.
Writes to --output_dir: eval_results.json, all_results.json, metrics.jsonl, TensorBoard events,
training_curves.png, the config used, orbax checkpoints (a rerun resumes), and the model with its tokenizer
as a Hugging Face folder; with --do_predict, generated_predictions.txt (a line a prediction) and
predict_results.json. Without --train_file it only evaluates and/or predicts; with --do_train or --do_eval,
only the stages named.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.rows import EncodedRows
from jaxseq.data.seq2seq import encode_pairs, load_pairs
from jaxseq.errors import JaxseqError
from jaxseq.files import atomic_write
from jaxseq.models.source import ModelSource
from jaxseq.runner import Job, Prepared, Setup, run
from jaxseq.train.objectives import Seq2SeqLM

DEFAULT_MODEL = "google-t5/t5-small"
TASK = "seq2seq-lm"


@dataclasses.dataclass
class Seq2SeqDataConfig:
    train_file: str | None = arg(None, "training pairs: csv, tsv, json or jsonl (none: no training)")
    validation_file: str | None = arg(None, "evaluation pairs, same format (none: no evaluation)")
    test_file: str | None = arg(None, "pairs to predict (--do_predict), same format")
    source_column: str = arg("source", "column holding the input text")
    target_column: str = arg("target", "column holding the text to produce")
    text_column: str | None = arg(None, "run_summarization's name for --source_column (wins over it)")
    summary_column: str | None = arg(None, "run_summarization's name for --target_column (wins over it)")
    source_prefix: str = arg("", "text put before every source, e.g. 'summarize: ' or 'translate English to German: '")
    max_source_length: int = arg(128, "source tokens per example (longer sources are truncated)")
    max_target_length: int = arg(64, "target tokens per example, EOS included (longer targets are truncated)")
    val_max_target_length: int | None = arg(
        None, "target tokens of evaluation/test examples, and new tokens generated (default: --max_target_length)"
    )
    max_train_samples: int | None = arg(None, "use only the first N training pairs")
    max_eval_samples: int | None = arg(None, "use only the first N evaluation pairs")
    max_predict_samples: int | None = arg(None, "use only the first N test pairs")
    predict_with_generate: bool = arg(True, "generate for the evaluation sources and score ROUGE and exact match")
    generation_max_length: int | None = arg(None, "new tokens per generated answer (default: --val_max_target_length)")
    num_beams: int | None = arg(
        None, "beams in evaluation/prediction, 1 is greedy (default: the model's generation_config.json, else 1)"
    )


def load_data(data: Seq2SeqDataConfig, stages: tuple[bool, bool, bool] | None = None) -> dict[str, list[tuple]]:
    """The pairs of each stage (train, evaluate, predict) by split (``train``, ``eval``, ``predict``); by default
    of each file given but --test_file (``default_stages``)."""
    columns = (data.text_column or data.source_column, data.summary_column or data.target_column)
    train, evaluate, predict = stages or (*default_stages(data), False)
    for asked, file, flag in ((train, "train_file", "do_train"), (evaluate, "validation_file", "do_eval")):
        if asked and not getattr(data, file):
            raise JaxseqError(f"--{flag} needs --{file}")
    if predict and not data.test_file:
        raise JaxseqError("--do_predict needs --test_file")
    if not (train or evaluate or predict):
        raise JaxseqError(
            "pass --train_file, --validation_file or --do_predict with --test_file (csv, tsv, json or jsonl with "
            f"'{columns[0]}' and '{columns[1]}' columns)"
        )
    for name in ("max_source_length", "max_target_length", "val_max_target_length", "num_beams"):
        if getattr(data, name) is not None and getattr(data, name) < 1:
            raise JaxseqError(f"--{name} must be at least 1")
    files = {
        "train": (train and data.train_file, data.max_train_samples),
        "eval": (evaluate and data.validation_file, data.max_eval_samples),
        "predict": (predict and data.test_file, data.max_predict_samples),
    }
    return {split: load_pairs(path, *columns)[:limit] for split, (path, limit) in files.items() if path}


def default_stages(data: Seq2SeqDataConfig) -> tuple[bool, bool]:
    """Training and evaluation without --do_train and --do_eval (--do_predict alone too): each where its file
    is given."""
    return bool(data.train_file), bool(data.validation_file)


def search_settings(folder, num_beams: int | None) -> dict:
    """``num_beams`` (else the model's generation_config.json's, else 1) with that file's length_penalty and
    early_stopping, as transformers' generate() on the model would use them."""
    settings = {"num_beams": 1, "length_penalty": 1.0, "early_stopping": False}
    if folder is not None and (Path(folder) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        saved = GenerationConfig.from_pretrained(folder)
        settings = {k: getattr(saved, k) if getattr(saved, k) is not None else v for k, v in settings.items()}
    return settings if num_beams is None else {**settings, "num_beams": num_beams}


def write_predictions(objective: Seq2SeqLM, gold, output_dir: Path, suffix: str, predictions: np.ndarray) -> Path:
    """``generated_predictions.txt`` (a prediction a line, newlines flattened) and ``predict_results.json``
    (``predict_rouge1``, ..., ``predict_gen_len``, ``predict_samples``), as run_summarization writes them."""
    labels = gold.take(np.arange(len(gold)))
    references = np.where(labels["decoder_attention_mask"] > 0, labels["labels"], -1)
    results = {f"predict_{k}": v for k, v in objective.text_metrics(predictions, references).items()}
    results["predict_samples"] = len(predictions)
    atomic_write(output_dir / f"predict_results{suffix}.json", json.dumps(results, indent=4, sort_keys=True) + "\n")
    lines = [text.replace("\n", " ") + "\n" for text in objective.decode(predictions)]
    return atomic_write(output_dir / f"generated_predictions{suffix}.txt", "".join(lines))


def prepare(setup: Setup) -> Prepared:
    """Source/target pairs, tokenized when a batch first needs them, by the process that takes them (a plan
    reads none: its batches are pairs of --max_source_length and --max_target_length tokens)."""
    args, data = setup.args, setup.args.data
    common = {"seq_len": data.max_source_length, "target_len": data.max_target_length}
    if setup.planning:
        source_row, target_row = ((data.max_source_length,), np.int32), ((data.max_target_length,), np.int32)
        row = {
            "input_ids": source_row,
            "attention_mask": source_row,
            "labels": target_row,
            "decoder_attention_mask": target_row,
        }
        return Prepared(Seq2SeqLM(), row=row, **common)
    stages = args.stages.stages(default_stages(data), alone=default_stages(data))
    pairs = load_data(data, stages)
    tokenizer = setup.tokenizer
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise JaxseqError("the tokenizer needs a pad and an EOS token (T5 tokenizers have both); pass a T5 tokenizer")
    val_target_length = data.val_max_target_length or data.max_target_length
    tokenize = functools.partial(
        encode_pairs, tokenizer=tokenizer, max_source_length=data.max_source_length, source_prefix=data.source_prefix
    )
    lengths = {"train": data.max_target_length, "eval": val_target_length, "predict": val_target_length}
    rows = {
        split: EncodedRows(split_pairs, functools.partial(tokenize, max_target_length=lengths[split]))
        for split, split_pairs in pairs.items()
    }
    generating = data.predict_with_generate or stages[2]
    max_new = (data.generation_max_length or val_target_length) if generating else 0
    objective = Seq2SeqLM(tokenizer, max_new_tokens=max_new, **search_settings(setup.folder, data.num_beams))
    return Prepared(
        objective,
        train=rows.get("train"),
        evals={"": rows["eval"]} if "eval" in rows else {},
        predicts={"": rows["predict"]} if "predict" in rows else {},
        summary=lambda _: (
            " / ".join(f"{len(p)} {split}" for split, p in pairs.items())
            + " pairs"
            + (f"; generating up to {max_new} tokens with {objective.search['num_beams']} beam(s)" if max_new else "")
        ),
        write_predictions=functools.partial(write_predictions, objective, rows.get("predict")),
        **common,
    )


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "data": Seq2SeqDataConfig},
    prepare,
    default_model=DEFAULT_MODEL,
    default_stages="train on --train_file and evaluate on --validation_file, each where given (with --do_predict "
    "alone too)",
    predicts="generate for --test_file into OUTPUT_DIR/generated_predictions.txt and predict_results.json",
)


@script
def main(argv) -> int:
    return run(JOB, argv)
