"""Pushing a run to the Hub, as a user runs it: a real MiniLM LoRA fine-tune on SST-2 with --push_to_hub
--hub_dry_run stages exactly the files that would go up, with a model card holding the run's real metrics,
and the token appears nowhere; offline, scripts/push_to_hub.py fails in one line and touches nothing."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from huggingface_hub import metadata_load

from tests.conftest import shared_asset

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_jaxseqTestTokenThatMustNeverBeWritten42"
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a real fine-tune, run once for the module


def run(script, *args):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "minilm-sst2-lora"
    result = run(
        "finetune_glue.py",
        "--model_name_or_path",
        shared_asset("models/all-MiniLM-L6-v2"),
        "--data_dir",
        shared_asset("data/glue"),
        "--task_name",
        "sst2",
        "--output_dir",
        out,
        "--max_train_samples",
        64,
        "--max_eval_samples",
        40,
        "--max_seq_length",
        32,
        "--per_device_train_batch_size",
        1,
        "--per_device_eval_batch_size",
        5,
        "--max_steps",
        4,
        "--logging_steps",
        2,
        "--learning_rate",
        1e-3,
        "--compilation_cache_dir",
        "",
        "--lora_rank",
        4,
        "--push_to_hub",
        "--hub_dry_run",
        "--hub_token",
        TOKEN,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_dry_run_stages_the_model_and_a_card_with_the_real_metrics(finished_run):
    out, result = finished_run
    staged = out / "hub_dry_run"
    names = {p.name for p in staged.iterdir()}
    local = {p.name for p in out.iterdir() if p.is_file()}
    assert names == local | {"README.md"}  # the run's files (its folders stay home) and the card
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "all_results.json",
        "eval_results.json",
        "training_curves.png",
        "config.yaml",
        "metrics.jsonl",
        "README.md",
    } <= names
    for name in names - {"README.md"}:
        assert (staged / name).read_bytes() == (out / name).read_bytes(), name

    card = (staged / "README.md").read_text()
    header, body = card.split("---\n", 2)[1:]
    meta = yaml.safe_load(header)
    assert meta["pipeline_tag"] == "text-classification" and meta["library_name"] == "transformers"
    assert meta["datasets"] == ["nyu-mll/glue"] and "lora" in meta["tags"]
    assert "base_model" not in meta  # a local folder is not a Hub id
    results = json.loads((out / "all_results.json").read_text())
    assert f"| accuracy | {results['eval_accuracy']:.4g} |" in body
    assert f"| loss | {results['eval_loss']:.4g} |" in body
    assert f"trainable parameters: {results['trainable_parameters']}" in body
    assert "GLUE SST2" in body and "`all-MiniLM-L6-v2` (a local checkpoint)" in body
    assert "| learning_rate | 0.001 |" in body and "| lora_rank | 4 |" in body
    assert "![training loss and evaluation metrics](training_curves.png)" in body
    assert "staged the upload" in result.stdout
    scores = metadata_load(staged / "README.md")["model-index"][0]["results"][0]
    evaluated = json.loads((out / "eval_results.json").read_text())
    shown = {m["type"]: m["value"] for m in scores["metrics"]}
    assert shown["accuracy"] == evaluated["eval_accuracy"] and shown["loss"] == evaluated["eval_loss"]
    assert scores["dataset"] == {"type": "nyu-mll/glue", "name": "GLUE SST2", "config": "sst2", "split": "validation"}


def test_the_token_is_written_nowhere(finished_run):
    out, result = finished_run
    assert TOKEN not in result.stdout + result.stderr
    for path in out.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_the_merged_lora_model_loads_in_transformers(finished_run):
    import transformers

    out, _ = finished_run
    _model, info = transformers.BertForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def digest(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_push_script_dry_run_stages_the_same(finished_run, tmp_path):
    out, _ = finished_run
    before = (out / "hub_dry_run" / "README.md").read_text()
    result = run("push_to_hub.py", out, out.name, "--hub_dry_run")
    assert result.returncode == 0, result.stderr
    assert (out / "hub_dry_run" / "README.md").read_text() == before


def test_offline_push_is_one_line_and_leaves_the_run_untouched(finished_run):
    out, _ = finished_run
    before = digest(out)
    result = run("push_to_hub.py", out, "someone/minilm-sst2", "--hub_token", TOKEN)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not push" in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert TOKEN not in result.stdout + result.stderr
    assert digest(out) == before


def test_push_of_a_folder_without_a_model_is_one_line(tmp_path):
    (tmp_path / "all_results.json").write_text("{}")
    result = run("push_to_hub.py", tmp_path, "someone/nothing", "--hub_dry_run")
    assert result.returncode == 1 and "holds no exported model" in result.stderr
