"""Fine-tune a Hugging Face encoder to answer questions with a span of a context (SQuAD, as transformers'
run_qa.py) with jaxseq.

    jaxseq qa --model_name_or_path bert-base-uncased --dataset_name squad --output_dir out/squad
    jaxseq qa --train_file train-v2.0.json --validation_file dev-v2.0.json --version_2_with_negative \\
        --output_dir out/squad2

Files are the official SQuAD JSON (v1.1 or v2.0) or datasets' flat squad rows (id, title, context, question,
answers) in csv or json(l). A context longer than --max_seq_length is cut into windows sharing --doc_stride
tokens; each answer is the best span of any window (--n_best_size, --max_answer_length), mapped back to the
context's characters. Evaluation reports the official script's eval_exact_match and eval_f1 (v2: eval_exact,
eval_f1 and their HasAns_/NoAns_ splits) and writes eval_predictions.json ({id: answer}),
eval_nbest_predictions.json and, for v2, eval_null_odds.json; --do_predict writes predict_predictions.json
(and predict_results.json where the test file has answers). The rest as `jaxseq glue`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import numpy as np

from jaxseq.cli import script
from jaxseq.config import arg
from jaxseq.data.rows import ArrayRows
from jaxseq.data.squad import check_rows, features, postprocess, read_squad, squad_metrics
from jaxseq.data.text import load_hub_dataset
from jaxseq.errors import JaxseqError
from jaxseq.files import atomic_write
from jaxseq.models.source import ModelSource, sequence_length
from jaxseq.runner import ONLY_PREDICT_ALONE, STAGE_OF_SPLIT, Job, Prepared, Setup, run
from jaxseq.train.objectives import SpanExtraction

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TASK = "question-answering"
SPLITS = {"train": "train_file", "validation": "validation_file", "test": "test_file"}
HOST_ONLY = ("example_index", "offsets")
"""Arrays of a window kept on the host, to find its answer in the context; never fed to the model."""


@dataclasses.dataclass
class QaDataConfig:
    dataset_name: str | None = arg(None, "a Hub dataset of squad rows (squad, squad_v2), instead of files")
    dataset_config_name: str | None = arg(None, "the dataset's configuration name")
    train_file: str | None = arg(None, "training questions: the official SQuAD JSON, or flat squad rows (csv/json)")
    validation_file: str | None = arg(None, "evaluation questions, same format")
    test_file: str | None = arg(None, "questions to answer (--do_predict), same format; answers optional")
    max_seq_length: int = arg(384, "tokens per window: the question, then as much context as fits")
    doc_stride: int = arg(128, "tokens shared by consecutive windows of a long context")
    n_best_size: int = arg(20, "the best starts and ends of each window that make candidate answers")
    max_answer_length: int = arg(30, "the most tokens an answer spans")
    version_2_with_negative: bool = arg(False, "SQuAD v2.0: some questions have no answer (the empty answer)")
    null_score_diff_threshold: float = arg(
        0.0, "v2: answer nothing when the null score beats the best span's by more than this"
    )
    pack_sequences: bool = arg(
        True,
        "in training, pack several windows into each row of --max_seq_length (attention and positions restart "
        "in each; each window's start and end are scored over its own tokens); evaluation and prediction cut "
        "their batches to a few lengths instead; --no_pack_sequences: one window per row",
    )
    max_train_samples: int | None = arg(None, "use only the first N training questions")
    max_eval_samples: int | None = arg(None, "use only the first N evaluation questions")
    max_predict_samples: int | None = arg(None, "answer only the first N test questions")


def load_splits(data: QaDataConfig, wanted: list[str]) -> dict[str, list[dict]]:
    if data.dataset_name:
        hub = load_hub_dataset(data.dataset_name, data.dataset_config_name)
        if missing := [split for split in wanted if split not in hub]:
            raise JaxseqError(f"dataset {data.dataset_name} has no {', '.join(missing)} split; it has {', '.join(hub)}")
        return {split: check_rows([dict(r) for r in hub[split]], f"{data.dataset_name} {split}") for split in wanted}
    files = {split: getattr(data, SPLITS[split]) for split in wanted}
    if missing := [f"{STAGE_OF_SPLIT[s]} needs --{SPLITS[s]}" for s, f in files.items() if not f]:
        raise JaxseqError(f"{' and '.join(missing)} (or --dataset_name)")
    return {split: read_squad(path) for split, path in files.items()}


def answer(data: QaDataConfig, examples, windows, output_dir: Path | None, prefix: str, logits) -> dict:
    """Answers from every window's ``[seq, 2]`` logits (``postprocess``), written as run_qa does
    (``<prefix>_predictions.json``, ``_nbest_predictions.json``, v2 ``_null_odds.json``) when ``output_dir`` is
    given; returns the official figures where the questions have answers."""
    width = logits.shape[1]
    answers, nbest, null_odds = postprocess(
        examples,
        windows["example_index"],
        windows["offsets"][:, :width],
        logits[..., 0],
        logits[..., 1],
        n_best_size=data.n_best_size,
        max_answer_length=data.max_answer_length,
        version_2_with_negative=data.version_2_with_negative,
        null_score_diff_threshold=data.null_score_diff_threshold,
    )
    if output_dir is not None and jax.process_index() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        files = {"predictions": answers, "nbest_predictions": nbest}
        if data.version_2_with_negative:
            files["null_odds"] = null_odds
        for name, value in files.items():
            atomic_write(output_dir / f"{prefix}_{name}.json", json.dumps(value, indent=4) + "\n")
    answered = data.version_2_with_negative or all(e["answers"]["text"] for e in examples)  # a test file may lack them
    return squad_metrics(examples, answers, data.version_2_with_negative) if answered else {}


def write_predictions(data, examples, windows, output_dir: Path, suffix: str, logits: np.ndarray) -> Path:
    """``predict_predictions.json`` (and the n-best, null odds), and ``predict_results.json`` with the official
    figures where the test questions have answers."""
    results = {f"predict_{k}": v for k, v in answer(data, examples, windows, output_dir, "predict", logits).items()}
    results["predict_samples"] = len(examples)
    atomic_write(output_dir / "predict_results.json", json.dumps(results, indent=4, sort_keys=True) + "\n")
    return output_dir / "predict_predictions.json"


def prepare(setup: Setup) -> Prepared:
    """Every question's windows, tokenized at the start (their count depends on the contexts), one a row."""
    args, data, planning = setup.args, setup.args.data, setup.planning
    if data.doc_stride >= data.max_seq_length:
        raise JaxseqError(f"--doc_stride {data.doc_stride} must be less than --max_seq_length {data.max_seq_length}")
    stages = (True, False, False) if planning else args.stages.stages()
    wanted = [split for split, on in zip(SPLITS, stages) if on]
    found = load_splits(data, wanted)
    limits = {"train": data.max_train_samples, "validation": data.max_eval_samples, "test": data.max_predict_samples}
    found = {split: examples[: limits[split]] for split, examples in found.items()}
    unanswered = [e["id"] for e in found.get("validation", ()) if not e["answers"]["text"]]
    if unanswered and not data.version_2_with_negative:
        raise JaxseqError(
            f"{len(unanswered)} evaluation questions have no answer (first: {unanswered[0]}), as in SQuAD v2.0: "
            "pass --version_2_with_negative"
        )
    seq = sequence_length(data.max_seq_length, setup.config, "max_seq_length", data.max_seq_length)
    tokenizer = setup.tokenizer
    windows = {
        split: features(examples, tokenizer, max_seq_length=seq, doc_stride=data.doc_stride)
        for split, examples in found.items()
    }
    rows = {split: ArrayRows({k: v for k, v in w.items() if k not in HOST_ONLY}) for split, w in windows.items()}
    output_dir = Path(args.trainer.output_dir)
    names = ("exact", "f1") if data.version_2_with_negative else ("exact_match", "f1")
    score = (
        functools.partial(answer, data, found["validation"], windows["validation"], output_dir, "eval")
        if "validation" in found
        else lambda logits: {}
    )
    return Prepared(
        SpanExtraction(score, names),
        train=rows.get("train"),
        evals={"": rows["validation"]} if "validation" in rows else {},
        predicts={"": rows["test"]} if "test" in rows else {},
        pack="first" if data.pack_sequences else None,
        seq_len=seq,
        summary=lambda _: " / ".join(f"{len(found[s])} {s} questions ({len(rows[s])} windows)" for s in found),
        write_predictions=(
            functools.partial(write_predictions, data, found["test"], windows["test"]) if "test" in found else None
        ),
    )


JOB = Job(
    __doc__,
    TASK,
    {"source": ModelSource, "data": QaDataConfig},
    prepare,
    default_model=DEFAULT_MODEL,
    default_stages=ONLY_PREDICT_ALONE,
    predicts="answer the questions of --test_file (or the dataset's test split) into "
    "OUTPUT_DIR/predict_predictions.json (and predict_results.json where they have answers)",
)


@script
def main(argv) -> int:
    return run(JOB, argv)
