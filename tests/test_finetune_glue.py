"""scripts/finetune_glue.py as a user runs it: real MiniLM, real GLUE TSVs, a few steps, all outputs;
and bad input ending in one line, a non-zero exit and no half-written model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import shared_asset

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "finetune_glue.py"
pytest.importorskip("transformers")


def run_script(*args, timeout=600):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


def quick_args(tmp_path, task, *extra):
    return [
        "--model_name_or_path",
        shared_asset("models/all-MiniLM-L6-v2"),
        "--data_dir",
        shared_asset("data/glue"),
        "--task_name",
        task,
        "--output_dir",
        tmp_path,
        "--max_train_samples",
        64,
        "--max_eval_samples",
        50,
        "--max_seq_length",
        64,
        "--per_device_train_batch_size",
        2,
        "--per_device_eval_batch_size",
        4,
        "--max_steps",
        4,
        "--logging_steps",
        2,
        "--learning_rate",
        1e-4,
        *extra,
    ]


@pytest.mark.slow
def test_mrpc_end_to_end_on_a_mesh(tmp_path):
    result = run_script(*quick_args(tmp_path, "mrpc", "--mesh", "dp=2,mp=4", "--compilation_cache_dir", ""))
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "eval_results.json").read_text())
    assert {"eval_accuracy", "eval_f1", "eval_loss", "eval_combined_score"} <= set(results)
    assert results["eval_samples"] == 50
    assert 0.0 <= results["eval_accuracy"] <= 1.0
    all_results = json.loads((tmp_path / "all_results.json").read_text())
    assert all_results["train_samples"] == 64 and "train_runtime" in all_results
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [2, 4]
    for name in ("config.yaml", "training_curves.png", "model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / name).is_file(), name
    assert list((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "checkpoints" / "4").is_dir()

    import torch
    import transformers

    model, info = transformers.BertForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.id2label == {0: "not_equivalent", 1: "equivalent"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        logits = model(**tokenizer(["a test"], ["another test"], return_tensors="pt")).logits
    assert logits.shape == (1, 2)


@pytest.mark.slow
def test_stsb_regression_end_to_end_and_second_run_compiles_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "xla-cache"
    # every program persisted, however fast it compiles: with the default threshold (0.5 s) a program just under it
    # in the first run and just over it in the second (a loaded machine) would add an entry
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    first = run_script(*quick_args(tmp_path / "first", "stsb", "--compilation_cache_dir", cache))
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((tmp_path / "first" / "eval_results.json").read_text())
    assert {"eval_pearson", "eval_spearmanr"} <= set(results)
    assert -1.0 <= results["eval_pearson"] <= 1.0
    config = json.loads((tmp_path / "first" / "config.json").read_text())
    assert len(config["id2label"]) == 1  # a regression head
    cached = sorted(p.name for p in cache.iterdir())
    assert cached, "the first run persisted its compiled programs"
    second = run_script(*quick_args(tmp_path / "second", "stsb", "--compilation_cache_dir", cache))
    assert second.returncode == 0, second.stderr[-3000:]
    assert sorted(p.name for p in cache.iterdir()) == cached  # every program came from the cache


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


BAD = {
    "unknown task": (lambda t: ["--task_name", "squad"], "invalid choice: 'squad'"),
    "missing columns": (
        lambda t: ["--train_file", write(t / "train.csv", "text,label\nhi,1\n")],
        "lacks column(s) sentence",
    ),
    "label out of range": (
        lambda t: ["--train_file", write(t / "train.csv", "sentence,label\nhi,7\n")],
        "label 7 is outside 0..1 for sst2",
    ),
    "empty split": (lambda t: ["--train_file", write(t / "train.csv", "sentence,label\n")], "has no examples"),
    "sequence too long": (lambda t: ["--max_seq_length", "4096"], "exceeds the model's 512 positions"),
    "mesh": (lambda t: ["--mesh", "dp=3"], "needs 3 devices but 8 are available"),
    "bad yaml": (lambda t: ["--config", write(t / "c.yaml", "learning_rate: [1e-4\n")], "is not valid YAML"),
    "unknown yaml key": (
        lambda t: ["--config", write(t / "c.yaml", "learning_rat: 1e-4\n")],
        "unknown key(s) learning_rat",
    ),
    "missing model": (lambda t: ["--model_name_or_path", t / "nowhere"], "is not a folder"),
    "half the multi-host flags": (
        lambda t: ["--num_processes", "2"],
        "need --coordinator_address, --num_processes and --process_id together",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_leaves_nothing(case, tmp_path):
    make_args, message = BAD[case]
    out = tmp_path / "out"
    args = quick_args(out, "sst2", "--compilation_cache_dir", "")
    extra = make_args(tmp_path)
    for flag, value in zip(extra[::2], extra[1::2]):  # flags given later win; replace to keep argv tidy
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    result = run_script(*args)
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("argv", "packs"),
    [
        ([], True),
        (["--no_pack_sequences"], False),
        (["--pack_sequences", "false"], False),
        (["--no_pack_sequences", "--pack_sequences"], True),  # the last flag wins
        (["--config", "{yaml}"], False),
        (["--config", "{yaml}", "--pack_sequences"], True),
    ],
)
def test_packing_is_on_by_default_and_no_pack_sequences_turns_it_off(tmp_path, argv, packs):
    from jaxseq.commands import glue as command
    from jaxseq.runner import parse_job

    (tmp_path / "c.yaml").write_text("pack_sequences: false\n")
    argv = [a.format(yaml=tmp_path / "c.yaml") for a in argv]
    glue = parse_job(command.JOB, [*argv, "--output_dir", str(tmp_path / "out")]).data
    assert glue.pack_sequences is packs


@pytest.mark.slow
def test_default_packing_trains_and_evaluates_as_unpacked_rows(tmp_path):
    # dropout off: packed rows draw other dropout masks than unpacked ones; the math is otherwise the same
    no_dropout = ["--config_overrides", "hidden_dropout_prob=0,attention_probs_dropout_prob=0"]
    runs = {}
    for name, extra in {"packed": [], "unpacked": ["--no_pack_sequences"]}.items():
        result = run_script(*quick_args(tmp_path / name, "sst2", *no_dropout, *extra, "--compilation_cache_dir", ""))
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        results = json.loads((tmp_path / name / "eval_results.json").read_text())
        runs[name] = (result.stdout, [r["train/loss"] for r in records if "train/loss" in r], results)
    assert "packing 16 examples into" in runs["packed"][0] and "packing" not in runs["unpacked"][0]
    assert runs["packed"][1] == pytest.approx(runs["unpacked"][1], abs=1e-4)
    for key in ("eval_loss", "eval_accuracy"):
        assert runs["packed"][2][key] == pytest.approx(runs["unpacked"][2][key], abs=1e-4)
