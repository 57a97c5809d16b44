"""Fine-tune a Hugging Face encoder to tag each word (named entities, as transformers' run_ner.py) with jaxseq.

    jaxseq ner --model_name_or_path bert-base-cased --dataset_name conll2003 --output_dir out/ner
    jaxseq ner --train_file train.json --validation_file dev.json --text_column_name tokens \\
        --label_column_name ner_tags --output_dir out/ner
    jaxseq ner --model_name_or_path out/ner --test_file test.json --do_predict --output_dir out/ner-test

Files are csv or json(l) with a list of words (--text_column_name) and one tag per word (--label_column_name:
IOB tags such as B-PER, or ints a Hub dataset names); each word's tag goes on its first sub-token
(--label_all_tokens: on all of them). Evaluation reports seqeval's entity precision, recall and F1 and token
accuracy (eval_precision, eval_recall, eval_f1, eval_accuracy). Writes to --output_dir what `jaxseq glue` does
(eval_results.json, all_results.json, metrics, checkpoints, the model as a Hugging Face folder); with
--do_predict, predictions.txt (one line per example, one tag per word) and predict_results.json.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.packing import TOKENS
from jaxseq.data.records import read_records
from jaxseq.data.rows import EncodedRows
from jaxseq.data.text import load_hub_dataset
from jaxseq.data.tokens import check_example, encode, label_list, read_examples
from jaxseq.errors import JaxseqError
from jaxseq.files import atomic_write
from jaxseq.metrics import seqeval
from jaxseq.models.source import ModelSource, pad_with_eos, sequence_length
from jaxseq.runner import ONLY_PREDICT_ALONE, STAGE_OF_SPLIT, Job, Prepared, Setup, run
from jaxseq.train.objectives import TokenClassification

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TASK = "token-classification"
SPLITS = {"train": "train_file", "validation": "validation_file", "test": "test_file"}


@dataclasses.dataclass
class NerDataConfig:
    dataset_name: str | None = arg(None, "a Hub dataset of words and tags (e.g. conll2003), instead of files")
    dataset_config_name: str | None = arg(None, "the dataset's configuration name")
    train_file: str | None = arg(None, "training examples: csv or json(l), a list of words and their tags a row")
    validation_file: str | None = arg(None, "evaluation examples, same format")
    test_file: str | None = arg(None, "examples to predict (--do_predict), same format; tags optional")
    text_column_name: str | None = arg(None, "column of the words (default: 'tokens', else the first column)")
    label_column_name: str | None = arg(
        None, "column of the tags (default: '<task_name>_tags' or 'ner_tags', else the second column)"
    )
    task_name: str = arg("ner", "which tags of a dataset that has several (conll2003: ner, pos, chunk)")
    max_seq_length: int | None = arg(
        None, "tokens per example, words past it are cut (default: 128, or the model's positions if fewer)"
    )
    label_all_tokens: bool = arg(
        False, "tag every sub-token of a word (a B- tag becomes its I- tag after the first), not only the first"
    )
    pack_sequences: bool = arg(
        True,
        "pack several sentences into each row of --max_seq_length, every token keeping its tag (same math per "
        "sentence, much less padding), in training, evaluation and prediction; --no_pack_sequences: one sentence "
        "per row (evaluation cuts its batches to a few lengths)",
    )
    return_entity_level_metrics: bool = arg(
        False, "also report precision, recall, F1 and count of each entity type (eval_PER_f1, ...)"
    )
    max_train_samples: int | None = arg(None, "use only the first N training examples")
    max_eval_samples: int | None = arg(None, "use only the first N evaluation examples")
    max_predict_samples: int | None = arg(None, "predict only the first N test examples")


def load_splits(data: NerDataConfig, wanted: list[str]) -> tuple[dict[str, list[dict]], str, str, list | None]:
    """(examples by split, text column, label column, the dataset's tag names for int tags or None)."""
    if data.dataset_name:
        hub = load_hub_dataset(data.dataset_name, data.dataset_config_name)
        missing = [split for split in wanted if split not in hub]
        if missing:
            raise JaxseqError(f"dataset {data.dataset_name} has no {', '.join(missing)} split; it has {', '.join(hub)}")
        first = hub[wanted[0]]
        text, label = columns(data, list(first.column_names))
        feature = first.features.get(label) if label else None
        names = getattr(getattr(feature, "feature", None), "names", None)
        found = {split: [dict(r) for r in hub[split]] for split in wanted}
        for split, examples in found.items():
            for i, example in enumerate(examples):
                check_example(example, text, label if label in example else None, f"{data.dataset_name} {split} {i}")
        return found, text, label, names
    files = {split: getattr(data, SPLITS[split]) for split in wanted}
    if missing := [f"{STAGE_OF_SPLIT[s]} needs --{SPLITS[s]}" for s, f in files.items() if not f]:
        raise JaxseqError(f"{' and '.join(missing)} (or --dataset_name)")
    first = read_records(files[wanted[0]])
    text, label = columns(data, list(first[0]) if first else [])
    found = {split: read_examples(path, text, label, tags_required=split != "test") for split, path in files.items()}
    return found, text, label, None


def columns(data: NerDataConfig, names: list[str]) -> tuple[str, str | None]:
    """The text and label columns, as run_ner picks them: the flags, else 'tokens' and '<task>_tags', else the
    first and second columns."""
    text = data.text_column_name or ("tokens" if "tokens" in names else names[0])
    label = data.label_column_name
    if label is None:
        tagged = f"{data.task_name}_tags"
        label = tagged if tagged in names else (names[1] if len(names) > 1 else None)
    return text, label


def labels_for(config, found: list[str]) -> list[str]:
    """The tag names in label-id order: the pretrained model's own (a fine-tuned tagger) when it names every
    tag found, else the tags found, sorted (run_ner)."""
    id2label = getattr(config, "id2label", None) or {}
    named = [id2label[i] for i in sorted(id2label)]
    default = all(name == f"LABEL_{i}" for i, name in enumerate(named))
    return named if named and not default and set(found) <= set(named) else found


def write_predictions(
    labels: list[str], gold: EncodedRows | None, output_dir: Path, suffix: str, predictions: np.ndarray
) -> Path:
    """``predictions.txt`` (a line an example, its words' predicted tags, as run_ner) and, where the test set
    has tags, ``predict_results.json`` with seqeval's figures (``predict_f1``, ...)."""
    scored = predictions >= 0
    tags = [[labels[i] for i in row[keep]] for row, keep in zip(predictions, scored)]
    results = {"predict_samples": len(predictions)}
    if gold is not None:
        truth = gold.take(np.arange(len(gold)))["labels"][:, : predictions.shape[1]]
        references = [[labels[i] for i in row[keep]] for row, keep in zip(truth, scored)]
        results.update({f"predict_{k}": v for k, v in seqeval(references, tags).items()})
    atomic_write(output_dir / "predict_results.json", json.dumps(results, indent=4, sort_keys=True) + "\n")
    return atomic_write(output_dir / f"predictions{suffix}.txt", "".join(" ".join(row) + "\n" for row in tags))


def prepare(setup: Setup) -> Prepared:
    """The examples of each stage asked for, tokenized when a batch first needs them, one example a row (a
    plan reads only the training examples, for the tag names)."""
    args, data = setup.args, setup.args.data
    stages = (True, False, False) if setup.planning else args.stages.stages()
    wanted = [split for split, on in zip(SPLITS, stages) if on]
    found, text, label, names = load_splits(data, wanted)
    if label is None:
        raise JaxseqError("the data has no tag column: pass --label_column_name")
    if names is not None:  # a Hub dataset's int tags: their names
        for examples in found.values():
            for example in examples:
                if label in example:
                    example[label] = [names[t] for t in example[label]]
    limits = {"train": data.max_train_samples, "validation": data.max_eval_samples, "test": data.max_predict_samples}
    found = {split: examples[: limits[split]] for split, examples in found.items()}
    config = setup.config
    seq = sequence_length(data.max_seq_length, config, "max_seq_length", 128)
    tagged = [e for split, examples in found.items() for e in examples if label in e]
    labels = labels_for(config, names or label_list(tagged, label))
    label2id = {name: i for i, name in enumerate(labels)}
    setup.override(num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=label2id)
    tokenizer = setup.tokenizer
    if config.model_type in ("roberta", "gpt2") and not getattr(tokenizer, "add_prefix_space", False):
        tokenizer = type(tokenizer).from_pretrained(setup.tokenizer_name, add_prefix_space=True)
        setup.tokenizer = tokenizer
    pad_with_eos(tokenizer)
    tokenize = functools.partial(
        encode,
        tokenizer=tokenizer,
        text_column=text,
        label_column=label,
        label_to_id=label2id,
        max_seq_length=seq,
        label_all_tokens=data.label_all_tokens,
    )
    rows = {split: EncodedRows(examples, tokenize) for split, examples in found.items()}
    test = rows.get("test")
    gold = test if test is not None and found["test"] and label in found["test"][0] else None
    return Prepared(
        TokenClassification(labels, entity_level=data.return_entity_level_metrics),
        train=rows.get("train"),
        evals={"": rows["validation"]} if "validation" in rows else {},
        predicts={"": test} if test is not None else {},
        pack=TOKENS if data.pack_sequences else None,
        seq_len=seq,
        summary=lambda _: (
            f"{len(labels)} tags ({', '.join(labels)}); "
            + " / ".join(f"{len(examples)} {split}" for split, examples in found.items())
            + " examples"
        ),
        write_predictions=functools.partial(write_predictions, labels, gold),
    )


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "data": NerDataConfig},
    prepare,
    default_model=DEFAULT_MODEL,
    default_stages=ONLY_PREDICT_ALONE,
    predicts="tag --test_file (or the dataset's test split) into OUTPUT_DIR/predictions.txt and predict_results.json",
)


@script
def main(argv) -> int:
    return run(JOB, argv)
