"""``--report_to``: a tiny scripts/pretrain_clm.py run with ``--report_to all`` sends every logged figure to
TensorBoard, W&B (offline), Trackio (local) and MLflow (file store), each read back through its own files or
client and compared with metrics.jsonl; a backend whose library is missing, or an unknown name, is one line."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from jaxseq.errors import JaxseqError
from jaxseq.train import trackers
from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
for library in ("wandb", "trackio", "mlflow"):
    pytest.importorskip(library)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_clm.py"


def tfrecords(path: Path):
    """The records of a TFRecord file (what TensorBoard reads): length, its CRC, the data, its CRC."""
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        yield data[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4


def tensorboard_scalars(folder: Path) -> dict:
    from tensorboardX.proto import event_pb2

    found = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for record in tfrecords(path):
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                found.setdefault(event.step, {})[value.tag] = value.simple_value
    return found


def wandb_records(path: Path):
    """The records of a W&B run file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose chunks
    (7-byte header: CRC, length, type full/first/middle/last) make up protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunks = path.read_bytes(), 7, 1 << 15, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(chunks)
            chunks = b""


def wandb_history(folder: Path) -> tuple[dict, dict, str]:
    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    history, config, name = {}, {}, None
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            name = record.run.display_name
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return history, config, name


def close_to(got: dict, expected: dict, rel: float) -> None:
    assert set(got) == set(expected)
    for step, values in expected.items():
        assert set(got[step]) == set(values), step
        for key, value in values.items():
            assert got[step][key] == pytest.approx(value, rel=rel), (step, key)


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.save_pretrained(root / "tokenizer")
    transformers.GPT2Config().save_pretrained(root / "config")
    (root / "text.txt").write_text(shared_asset("data/text/tinyshakespeare.txt").read_text()[:40_000])
    out = root / "run"
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "TRACKIO_DIR": str(root / "trackio"),
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    env.pop("WANDB_DIR", None)
    args = {
        "--config_name": root / "config",
        "--config_overrides": "n_layer=1,n_embd=32,n_head=2",
        "--tokenizer_name": root / "tokenizer",
        "--train_file": root / "text.txt",
        "--block_size": 16,
        "--max_eval_samples": 8,
        "--per_device_train_batch_size": 2,
        "--per_device_eval_batch_size": 4,
        "--max_steps": 4,
        "--eval_steps": 2,
        "--logging_steps": 1,
        "--peak_flops": 1e11,
        "--data_cache_dir": "",
        "--compilation_cache_dir": "",
        "--output_dir": out,
        "--report_to": "all",
        "--run_name": "tiny-clm",
        "--project": "jaxseq-tests",
    }
    argv = [sys.executable, str(SCRIPT), *(str(x) for kv in args.items() for x in kv)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        record.pop("time")
        logged.setdefault(step, {}).update(record)
    assert sorted(logged) == [1, 2, 3, 4] and "eval/loss" in logged[2] and "train/loss" in logged[4]
    return root, out, logged


@pytest.mark.slow  # one end-to-end run for the four
def test_tensorboard_has_every_figure(reported):
    _, out, logged = reported
    close_to(tensorboard_scalars(out / "tensorboard"), logged, rel=1e-6)  # float32 in the events


@pytest.mark.slow  # one end-to-end run for the four
def test_wandb_offline_run_has_every_figure_and_the_config(reported):
    _, out, logged = reported
    history, config, name = wandb_history(out)  # WANDB_DIR unset: the run sits in the output dir
    close_to(history, logged, rel=1e-12)
    assert name == "tiny-clm" and config["learning_rate"] == 5e-5 and config["max_steps"] == 4


@pytest.mark.slow  # one end-to-end run for the four
def test_trackio_local_run_has_every_figure(reported):
    root, _, logged = reported
    script = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
        "print(json.dumps([S.get_runs('jaxseq-tests'), S.get_logs('jaxseq-tests', 'tiny-clm'), "
        "S.get_run_config('jaxseq-tests', 'tiny-clm')]))"
    )
    env = {**os.environ, "TRACKIO_DIR": str(root / "trackio")}  # trackio reads it once, at import
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    runs, logs, config = json.loads(result.stdout.strip().splitlines()[-1])
    assert runs == ["tiny-clm"] and config["max_steps"] == 4
    got = {}
    for row in logs:
        got.setdefault(row["step"], {}).update({k: v for k, v in row.items() if "/" in k})
    close_to(got, logged, rel=1e-12)


@pytest.mark.slow  # one end-to-end run for the four
def test_mlflow_file_store_has_every_figure_and_the_params(reported, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    root, _, logged = reported
    client = MlflowClient((root / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("jaxseq-tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny-clm" and run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "4" and run.data.params["report_to"] == "all"
    got = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            got.setdefault(metric.step, {})[key] = metric.value
    close_to(got, logged, rel=1e-12)


def test_report_to_names(monkeypatch):
    assert trackers.parse_report_to("none") == ()
    assert trackers.parse_report_to("mlflow, tensorboard") == ("tensorboard", "mlflow")
    assert trackers.parse_report_to("all") == trackers.BACKENDS  # all four are installed here
    with pytest.raises(JaxseqError, match=r"^--report_to 'comet' is not one of none, tensorboard, wandb"):
        trackers.parse_report_to("tensorboard,comet")
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert trackers.parse_report_to("all") == ("tensorboard", "trackio", "mlflow")
    missing = r"^--report_to wandb needs the wandb library: pip install 'jaxseq\[wandb\]'$"
    with pytest.raises(JaxseqError, match=missing):
        trackers.parse_report_to("wandb")


def test_mlflow_without_a_backend_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nowhere://tracking")
    with pytest.raises(JaxseqError, match=r"^--report_to mlflow cannot start a run at nowhere://tracking \(") as e:
        trackers.MLflow(tmp_path, "run", "project", {})
    assert "\n" not in str(e.value)


def test_tensorboard_writes_every_figure(tmp_path):
    """The TensorBoard tracker writes every figure it is given, at its step."""
    board = trackers.TensorBoard(tmp_path, "run", "project", {})
    board.log(1, {"train/loss": 2.5})
    board.log(2, {"train/loss": 1.25, "eval/f1": 0.5})
    board.close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == {
        1: {"train/loss": 2.5},
        2: {"train/loss": 1.25, "eval/f1": 0.5},
    }
