"""Fine-tune a Hugging Face model on a GLUE task with jaxseq (sharded over every device you have).

    jaxseq glue --task_name sst2 --output_dir out/sst2
    jaxseq glue --config glue_sst2 --mesh dp=2,mp=4
    jaxseq glue --task_name sst2 --model_name_or_path out/sst2 --do_eval --do_predict --output_dir out/sst2-test

Reads GLUE from the Hub (datasets) or a local folder of GLUE TSVs (--data_dir), or your own
csv/tsv/json files (--train_file/--validation_file/--test_file). Writes to --output_dir: eval_results.json,
all_results.json, metrics.jsonl, TensorBoard events, training_curves.png, the config used,
orbax checkpoints, and the fine-tuned model with its tokenizer as a Hugging Face folder; with --do_predict,
predict_results_<task>.txt. Without --do_train, --do_eval or --do_predict it trains and evaluates; with any
of them, only what they name (transformers' run_glue.py).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.glue import SPLIT_SUFFIX, TASKS, encode, get_task, load_split
from jaxseq.data.rows import EncodedRows
from jaxseq.errors import JaxseqError
from jaxseq.files import atomic_write
from jaxseq.models.registry import model_class
from jaxseq.models.source import ModelSource, pad_with_eos, sequence_length
from jaxseq.runner import ONLY_PREDICT_ALONE, Job, Prepared, Setup, run
from jaxseq.train.objectives import SequenceClassification

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TASK = "sequence-classification"


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
    test_file: str | None = arg(None, "your own file to predict (--do_predict), same format, 'label' optional")
    max_seq_length: int = arg(128, "tokens per example (longer texts are truncated, shorter padded)")
    max_train_samples: int | None = arg(None, "use only the first N training examples")
    max_eval_samples: int | None = arg(None, "use only the first N examples of each eval split")
    max_predict_samples: int | None = arg(None, "predict only the first N examples of each test split")
    pack_sequences: bool = arg(
        True,
        "pack several short examples into each row of --max_seq_length, in training, evaluation and prediction "
        "(same math per example, much less padding: several times faster on short texts); --no_pack_sequences: "
        "one example per row",
    )


def load_examples(glue: GlueConfig, stages: tuple[bool, bool, bool]):
    """(task, training examples or None, eval sets, predict sets) for the stages (train, evaluate, predict);
    sets are keyed by their metric suffix (MNLI mismatched: ``_mm``)."""
    task = get_task(glue.task_name)
    do_train, do_eval, do_predict = stages

    def splits(names, file, limit):
        if file:
            found = {"": load_split(task, names[0], file=file)}
        else:
            found = {SPLIT_SUFFIX.get(split, ""): load_split(task, split, data_dir=glue.data_dir) for split in names}
        return {k: v[:limit] for k, v in found.items()} if limit else found

    train = None
    if do_train:
        train = load_split(task, "train", data_dir=glue.data_dir, file=glue.train_file)[: glue.max_train_samples]
    evals = splits(task.eval_splits, glue.validation_file, glue.max_eval_samples) if do_eval else {}
    tests = splits(task.test_splits, glue.test_file, glue.max_predict_samples) if do_predict else {}
    return task, train, evals, tests


def write_predictions(task, output_dir: Path, suffix: str, predictions: np.ndarray) -> Path:
    """``predict_results_<task>.txt`` (MNLI mismatched: ``<task>-mm``) as run_glue.py writes it: a header
    ``index\tprediction``, then label names, or scores with three decimals for a regression."""
    path = output_dir / f"predict_results_{task.name}{suffix.replace('_', '-')}.txt"
    if task.is_regression:
        lines = [f"{i}\t{value:3.3f}" for i, value in enumerate(predictions)]
    else:
        lines = [f"{i}\t{task.labels[int(value)]}" for i, value in enumerate(predictions)]
    return atomic_write(path, "index\tprediction\n" + "".join(line + "\n" for line in lines))


def glue_model_config(setup: Setup):
    """The model's config (with --config_overrides); offline, the error says how to run without the Hub."""
    try:
        return setup.config
    except JaxseqError as e:
        if "cannot download" in str(e):
            raise JaxseqError(
                f"{e}. To run offline, pass --model_name_or_path /path/to/hf-model-folder and "
                "--data_dir /path/to/glue-tsvs"
            ) from None
        raise


def prepare(setup: Setup) -> Prepared:
    """The GLUE task's examples, tokenized when a batch first needs them by the process that takes them, and
    packed several to a row. A plan reads the training examples too (the run's packed row counts depend on
    them), unless it has no tokenizer to read them with and does not pack."""
    args, glue, planning = setup.args, setup.args.data, setup.planning
    task = get_task(glue.task_name)
    config = glue_model_config(setup)
    sequence_length(glue.max_seq_length, config, "max_seq_length", glue.max_seq_length)
    setup.override(num_labels=task.num_labels)
    pool = getattr(model_class(config, TASK), "pooled_token", None) if glue.pack_sequences else None
    if planning and not setup.tokenizer_name:
        if pool:
            raise JaxseqError(
                "a plan of a packed GLUE run packs the training examples: pass --tokenizer_name (or plan the run "
                "with --no_pack_sequences)"
            )
        return Prepared(SequenceClassification(task), row=_row(config, task, glue))
    tokenizer = setup.tokenizer
    pad_with_eos(tokenizer)  # GPT-2 style: classify at the last real token
    if getattr(config, "pad_token_id", None) is None:
        setup.override(pad_token_id=tokenizer.pad_token_id)
    if not task.is_regression:
        setup.override(id2label=dict(enumerate(task.labels)), label2id={name: i for i, name in enumerate(task.labels)})
    stages = (True, False, False) if planning else args.stages.stages()
    _, train_examples, eval_examples, test_examples = load_examples(glue, stages)
    tokenize = functools.partial(encode, task, tokenizer=tokenizer, max_seq_length=glue.max_seq_length)
    return Prepared(
        SequenceClassification(task),
        train=None if train_examples is None else EncodedRows(train_examples, tokenize),
        evals={k: EncodedRows(v, tokenize) for k, v in eval_examples.items()},
        predicts={k: EncodedRows(v, tokenize) for k, v in test_examples.items()},
        pack=pool,
        seq_len=glue.max_seq_length,
        summary=lambda _: (
            f"{task.name}: {len(train_examples or ())} train / {sum(map(len, eval_examples.values()))} eval / "
            f"{sum(map(len, test_examples.values()))} test examples"
        ),
        write_predictions=functools.partial(write_predictions, task),
    )


def _row(config, task, glue: GlueConfig) -> dict:
    """One unpacked example's arrays, for a plan that reads no data."""
    row = dict.fromkeys(("input_ids", "attention_mask"), ((glue.max_seq_length,), np.int32))
    if config.model_type == "bert":
        row["token_type_ids"] = ((glue.max_seq_length,), np.int32)
    row["labels"] = ((), np.float32 if task.is_regression else np.int32)
    return row


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "data": GlueConfig},
    prepare,
    default_model=DEFAULT_MODEL,
    default_stages=ONLY_PREDICT_ALONE,
    predicts="the test split(s) (or --test_file) into OUTPUT_DIR/predict_results_<task>.txt, as run_glue.py",
    fast_tokenizer=False,
)


@script
def main(argv) -> int:
    return run(JOB, argv)
