"""`jaxseq glue` with transformers' stages (--do_train, --do_eval, --do_predict), run in this process on real
MRPC text and a tiny BERT with MiniLM's tokenizer: the best model is what is exported and reported,
evaluating the export alone gives the same score, the prediction file agrees with it, and a saved step
can be evaluated and exported later. Also the GLUE test-split files (no labels) and run_glue's format."""

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from jaxseq.commands import glue  # noqa: E402
from jaxseq.data.glue import NO_LABEL, get_task, load_split  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT folder with MiniLM's real tokenizer."""
    minilm = shared_asset("models/all-MiniLM-L6-v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    folder = tmp_path_factory.mktemp("tiny-bert")
    transformers.BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mrpc_with_test(tmp_path_factory):
    """Shared MRPC train/dev plus a test.tsv in the GLUE download script's layout (no labels): the first 40
    dev pairs, so predictions can be scored against the dev labels."""
    root = tmp_path_factory.mktemp("glue")
    source = shared_asset("data/glue/MRPC")
    shutil.copytree(source, root / "MRPC")
    with open(source / "dev.tsv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:41]
    lines = ["index\t#1 ID\t#2 ID\t#1 String\t#2 String"] + [
        f"{i}\t{r[1]}\t{r[2]}\t{r[3]}\t{r[4]}" for i, r in enumerate(rows)
    ]
    (root / "MRPC" / "test.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root, [int(r[0]) for r in rows]


def run(model, data, out, *flags):
    args = [
        "--model_name_or_path",
        model,
        "--data_dir",
        data,
        "--task_name",
        "mrpc",
        "--output_dir",
        out,
        "--max_train_samples",
        64,
        "--max_eval_samples",
        40,
        "--max_seq_length",
        64,
        "--per_device_train_batch_size",
        2,
        "--per_device_eval_batch_size",
        2,
        "--learning_rate",
        1e-3,
        "--logging_steps",
        2,
        "--compilation_cache_dir",
        "",
        *flags,
    ]
    assert glue.main([str(a) for a in args]) == 0


def read_predictions(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    assert lines[0] == "index\tprediction"
    assert [int(line.split("\t")[0]) for line in lines[1:]] == list(range(len(lines) - 1))
    return [line.split("\t")[1] for line in lines[1:]]


@pytest.mark.slow
def test_train_best_export_evaluate_alone_and_predict(tiny_bert, mrpc_with_test, tmp_path):
    data, labels = mrpc_with_test
    out = tmp_path / "run"
    run(
        tiny_bert,
        data,
        out,
        "--do_train",
        "--do_eval",
        "--do_predict",
        "--max_steps",
        8,
        "--eval_strategy",
        "steps",
        "--eval_steps",
        2,
        "--save_strategy",
        "steps",
        "--save_steps",
        2,
        "--load_best_model_at_end",
        "--metric_for_best_model",
        "eval_accuracy",
    )
    logged = {
        r["step"]: r["eval/accuracy"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "eval/accuracy" in r
    }
    assert sorted(logged) == [2, 4, 6, 8]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_accuracy"] == max(logged.values())
    predicted = read_predictions(out / "predict_results_mrpc.txt")
    names = ("not_equivalent", "equivalent")
    assert set(predicted) <= set(names) and len(predicted) == 40
    from_file = np.mean([names.index(p) == label for p, label in zip(predicted, labels)])
    assert from_file == pytest.approx(results["eval_accuracy"])  # the test rows are the dev rows

    alone = tmp_path / "alone"  # the exported model alone: the best score again, the same predictions
    run(out, data, alone, "--do_eval", "--do_predict")
    assert json.loads((alone / "eval_results.json").read_text())["eval_accuracy"] == pytest.approx(
        results["eval_accuracy"]
    )
    assert read_predictions(alone / "predict_results_mrpc.txt") == predicted
    assert not (alone / "checkpoints").exists() or not any((alone / "checkpoints").iterdir())
    assert not (alone / "model.safetensors").exists()  # nothing trained or restored: nothing to export

    step = min(logged)  # any saved step, evaluated and exported later
    if not (out / "checkpoints" / str(step)).is_dir():
        step = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    later = tmp_path / "later"
    run(tiny_bert, data, later, "--do_eval", "--resume_from_checkpoint", out / "checkpoints" / str(step))
    assert json.loads((later / "eval_results.json").read_text())["eval_accuracy"] == pytest.approx(logged[step])
    model = transformers.BertForSequenceClassification.from_pretrained(later)
    assert model.config.id2label == {0: "not_equivalent", 1: "equivalent"}


def test_test_splits_read_without_labels(tmp_path):
    task = get_task("cola")  # CoLA's test.tsv has a header, unlike its train/dev files
    (tmp_path / "CoLA").mkdir()
    (tmp_path / "CoLA" / "test.tsv").write_text(
        "index\tsentence\n0\tBill whistled past the house.\n1\tThe car honked.\n"
    )
    assert load_split(task, "test", data_dir=tmp_path) == [
        ("Bill whistled past the house.", None, NO_LABEL),
        ("The car honked.", None, NO_LABEL),
    ]
    mnli = get_task("mnli")
    assert mnli.test_splits == ("test_matched", "test_mismatched")
    user = tmp_path / "test.csv"  # a user's file: 'label' optional, -1 (the Hub's) means none
    user.write_text("sentence1,sentence2,label\na,b,-1\nc,d,1\n")
    assert load_split(get_task("rte"), "test", file=user) == [("a", "b", NO_LABEL), ("c", "d", 1.0)]


def test_predictions_in_run_glue_format(tmp_path):
    stsb = glue.write_predictions(get_task("stsb"), tmp_path, "", np.array([3.14159, 0.5]))
    assert stsb.read_text() == "index\tprediction\n0\t3.142\n1\t0.500\n"
    mm = glue.write_predictions(get_task("mnli"), tmp_path, "_mm", np.array([2, 0]))
    assert mm.name == "predict_results_mnli-mm.txt"
    assert mm.read_text() == "index\tprediction\n0\tcontradiction\n1\tentailment\n"
