"""The nine GLUE tasks: where their text and labels are (Hub dataset or the GLUE download script's TSVs),
how many labels they have, and which metrics they report (under transformers' ``run_glue`` key names)."""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxseq import metrics
from jaxseq.data.records import read_records, require_columns
from jaxseq.errors import JaxseqError

Example = tuple[str, str | None, float]  # (text_a, text_b, label)
NO_LABEL = -1.0  # the label of a test example without one (as the Hub's GLUE test splits have it)


@dataclasses.dataclass(frozen=True)
class GlueTask:
    name: str
    keys: tuple[str, str | None]  # text columns in the Hub dataset (and in user csv/json files)
    labels: tuple[str, ...] | None  # label names, in the Hub dataset's order; None: regression
    metric_names: tuple[str, ...]
    folder: str  # folder name of the GLUE download script
    tsv_columns: tuple[str | int, str | int | None, str | int]  # text_a, text_b, label: header name or index
    tsv_header: bool = True
    eval_splits: tuple[str, ...] = ("validation",)

    @property
    def test_splits(self) -> tuple[str, ...]:
        """The unlabelled splits ``--do_predict`` predicts (MNLI: matched and mismatched)."""
        return tuple(split.replace("validation", "test") for split in self.eval_splits)

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    def metrics(self, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        """The task's metrics (``metric_names``) from predictions and labels (``compute_metrics``)."""
        return compute_metrics(self, predictions, labels)


TASKS = {
    t.name: t
    for t in (
        GlueTask(
            "cola",
            ("sentence", None),
            ("unacceptable", "acceptable"),
            ("matthews_correlation",),
            "CoLA",
            (3, None, 1),
            tsv_header=False,
        ),
        GlueTask(
            "sst2", ("sentence", None), ("negative", "positive"), ("accuracy",), "SST-2", ("sentence", None, "label")
        ),
        GlueTask(
            "mrpc",
            ("sentence1", "sentence2"),
            ("not_equivalent", "equivalent"),
            ("accuracy", "f1"),
            "MRPC",
            ("#1 String", "#2 String", "Quality"),
        ),
        GlueTask(
            "qqp",
            ("question1", "question2"),
            ("not_duplicate", "duplicate"),
            ("accuracy", "f1"),
            "QQP",
            ("question1", "question2", "is_duplicate"),
        ),
        GlueTask(
            "stsb",
            ("sentence1", "sentence2"),
            None,
            ("pearson", "spearmanr"),
            "STS-B",
            ("sentence1", "sentence2", "score"),
        ),
        GlueTask(
            "mnli",
            ("premise", "hypothesis"),
            ("entailment", "neutral", "contradiction"),
            ("accuracy",),
            "MNLI",
            ("sentence1", "sentence2", "gold_label"),
            eval_splits=("validation_matched", "validation_mismatched"),
        ),
        GlueTask(
            "qnli",
            ("question", "sentence"),
            ("entailment", "not_entailment"),
            ("accuracy",),
            "QNLI",
            ("question", "sentence", "label"),
        ),
        GlueTask(
            "rte",
            ("sentence1", "sentence2"),
            ("entailment", "not_entailment"),
            ("accuracy",),
            "RTE",
            ("sentence1", "sentence2", "label"),
        ),
        GlueTask(
            "wnli",
            ("sentence1", "sentence2"),
            ("not_entailment", "entailment"),
            ("accuracy",),
            "WNLI",
            ("sentence1", "sentence2", "label"),
        ),
    )
}
# The local file of each split in the GLUE download script's layout.
_TSV_FILES = {
    "train": "train.tsv",
    "validation": "dev.tsv",
    "validation_matched": "dev_matched.tsv",
    "validation_mismatched": "dev_mismatched.tsv",
    "test": "test.tsv",
    "test_matched": "test_matched.tsv",
    "test_mismatched": "test_mismatched.tsv",
}
# Split suffixes of the metric keys, as run_glue writes them (MNLI mismatched: eval_accuracy_mm).
SPLIT_SUFFIX = {"validation_mismatched": "_mm", "test_mismatched": "_mm"}


def get_task(name: str) -> GlueTask:
    key = name.lower().replace("-", "")
    if key not in TASKS:
        raise JaxseqError(f"unknown GLUE task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[key]


def compute_metrics(task: GlueTask, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The task's metrics from predictions (class ids, or scores for regression) and labels."""
    functions: dict[str, Callable] = {
        "accuracy": metrics.accuracy,
        "f1": metrics.f1,
        "matthews_correlation": metrics.matthews_correlation,
        "pearson": metrics.pearson,
        "spearmanr": metrics.spearmanr,
    }
    result = {name: functions[name](predictions, labels) for name in task.metric_names}
    if len(result) > 1:
        result["combined_score"] = float(np.mean(list(result.values())))
    return result


# --------------------------------------------------------------------------- reading


def _label_value(task: GlueTask, raw: str, where: str) -> float:
    raw = raw.strip()
    if task.is_regression:
        try:
            return float(raw)
        except ValueError:
            raise JaxseqError(f"{where}: label {raw!r} is not a number (STS-B scores are floats)") from None
    if raw in task.labels:
        return float(task.labels.index(raw))
    try:
        value = int(float(raw))
    except ValueError:
        raise JaxseqError(
            f"{where}: label {raw!r} is not one of {', '.join(task.labels)} or 0..{task.num_labels - 1}"
        ) from None
    if not 0 <= value < task.num_labels:
        raise JaxseqError(f"{where}: label {value} is outside 0..{task.num_labels - 1} for {task.name}")
    return float(value)


def read_glue_tsv(task: GlueTask, path: Path, *, test: bool = False) -> list[Example]:
    """A TSV in the GLUE download script's format: no CSV quoting, UTF-8 (MRPC starts with a BOM). ``test``: a
    test split, whose labels may be absent (``NO_LABEL``); CoLA's test.tsv has a header, unlike its others."""
    if not path.is_file():
        raise JaxseqError(f"{path} does not exist; point --data_dir at a folder with {task.folder}/ (GLUE TSVs)")
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    columns, header = task.tsv_columns, task.tsv_header
    if test and not header and rows and rows[0][:1] == ["index"]:
        columns, header = ("sentence", None, "label"), True
    if header:
        header, rows = rows[0], rows[1:]
        needed = columns[:2] if test else columns
        missing = [c for c in needed if c is not None and c not in header]
        if missing:
            raise JaxseqError(f"{path} lacks column(s) {', '.join(map(repr, missing))}; its header is {header}")
        columns = tuple(None if c is None or c not in header else header.index(c) for c in columns)
    return _examples(task, rows, columns, str(path), test)


def _examples(task, rows, columns, where, test: bool = False) -> list[Example]:
    a, b, label = columns
    width = max(c for c in columns if c is not None) + 1
    out = []
    for i, row in enumerate(rows):
        if len(row) < width:
            if not any(cell.strip() for cell in row):
                continue
            raise JaxseqError(f"{where} row {i + 1} has {len(row)} fields, expected at least {width}")
        if label is None or (test and row[label].strip() in ("", "-1")):  # an unlabelled test example
            value = NO_LABEL
        else:
            value = _label_value(task, row[label], f"{where} row {i + 1}")
        out.append((row[a], None if b is None else row[b], value))
    return out


def read_user_file(task: GlueTask, path: Path, *, test: bool = False) -> list[Example]:
    """A user's csv/tsv (with a header) or json/jsonl file with the task's text columns and ``label`` (which
    a ``test`` file may lack)."""
    records = read_records(path)
    keys = [k for k in task.keys if k is not None]
    labelled = not test or (bool(records) and "label" in records[0])
    require_columns(records, [*keys, *(["label"] if labelled else [])], path)
    rows = [[str(r[k]) for k in keys] + ([str(r["label"])] if labelled else []) for r in records]
    columns = (0, 1 if len(keys) == 2 else None, len(keys) if labelled else None)
    return _examples(task, rows, columns, str(path), test)


def read_hub_split(task: GlueTask, split: str) -> list[Example]:
    """A split of the ``nyu-mll/glue`` dataset on the Hub, through ``datasets``."""
    try:
        import datasets
    except ImportError:
        raise JaxseqError("reading GLUE from the Hub needs `pip install datasets`; or pass --data_dir") from None
    try:
        ds = datasets.load_dataset("nyu-mll/glue", task.name, split=split)
    except Exception as e:  # datasets raises many types when offline
        raise JaxseqError(
            f"cannot load GLUE {task.name} from the Hugging Face Hub ({type(e).__name__}); offline? "
            "pass --data_dir with the GLUE TSVs (or --train_file/--validation_file)"
        ) from None
    a, b = task.keys
    return [(r[a], None if b is None else r[b], float(r["label"])) for r in ds]


def load_split(task: GlueTask, split: str, *, data_dir=None, file=None) -> list[Example]:
    """Examples of one split from a user file, a GLUE folder, or the Hub (in that order of preference). Test
    splits may be unlabelled (``NO_LABEL``)."""
    test = split.startswith("test")
    if file is not None:
        examples = read_user_file(task, Path(file), test=test)
        where = str(file)
    elif data_dir is not None:
        root = Path(data_dir)
        folder = root / task.folder if (root / task.folder).is_dir() else root
        examples = read_glue_tsv(task, folder / _TSV_FILES[split], test=test)
        where = str(folder / _TSV_FILES[split])
    else:
        examples = read_hub_split(task, split)
        where = f"nyu-mll/glue {task.name} {split}"
    if not examples:
        raise JaxseqError(f"the {split} split ({where}) has no examples")
    return examples


def encode(task: GlueTask, examples: list[Example], tokenizer, max_seq_length: int) -> dict[str, np.ndarray]:
    """Tokenise to fixed-length arrays: ``input_ids``, ``attention_mask``, ``token_type_ids`` (if the
    tokenizer makes them) and ``labels`` (int32 classes, or float32 scores for regression)."""
    texts_a = [a for a, _, _ in examples]
    texts_b = [b for _, b, _ in examples] if task.keys[1] is not None else None
    encoded = tokenizer(
        texts_a, texts_b, padding="max_length", truncation=True, max_length=max_seq_length, return_tensors="np"
    )
    arrays = {
        k: np.asarray(v, np.int32) for k, v in encoded.items() if k in ("input_ids", "attention_mask", "token_type_ids")
    }
    labels = np.asarray([label for _, _, label in examples])
    arrays["labels"] = labels.astype(np.float32 if task.is_regression else np.int32)
    return arrays
