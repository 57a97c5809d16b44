"""scripts/pretrain_clm.py as a user runs it: a tiny GPT-2 trained from scratch on Tiny Shakespeare with the
real GPT-2 tokenizer lowers validation perplexity (and transformers computes the same loss from the exported
model); killed with SIGKILL and rerun, it ends with parameters bitwise equal to an uninterrupted run's; the
tokenized text comes from the cache on a rerun; bad input ends in one line with nothing written. Plus the
text pipeline (documents, exact piecewise tokenization, group_texts packing) in-process."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")

from jaxseq.data import text  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_clm.py"
# every subprocess sees the same two CPU devices (data parallel over both): same programs, same numbers
ENV = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
STEPS, SAVE_STEPS, BLOCK = 40, 10, 32


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The real GPT-2 tokenizer saved as a folder, GPT-2's default config (the runs shrink it with
    --config_overrides), and caches shared by every run of this module."""
    root = tmp_path_factory.mktemp("clm-assets")
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    assert len(tokenizer) == 50257
    tokenizer.save_pretrained(root / "tokenizer")
    transformers.GPT2Config().save_pretrained(root / "config")
    return {"root": root, "tokenizer": tokenizer, "text": shared_asset("data/text/tinyshakespeare.txt")}


def clm_args(assets, out, *extra):
    root = assets["root"]
    return [
        "--config_name",
        root / "config",
        "--config_overrides",
        "n_layer=2,n_embd=64,n_head=4",
        "--tokenizer_name",
        root / "tokenizer",
        "--train_file",
        assets["text"],
        "--block_size",
        BLOCK,
        "--max_eval_samples",
        60,
        "--per_device_train_batch_size",
        2,
        "--per_device_eval_batch_size",
        8,
        "--max_steps",
        STEPS,
        "--save_steps",
        SAVE_STEPS,
        "--eval_steps",
        10,
        "--logging_steps",
        1,
        "--learning_rate",
        3e-3,
        "--seed",
        0,
        "--output_dir",
        out,
        "--data_cache_dir",
        root / "token-cache",
        "--compilation_cache_dir",
        root / "xla-cache",
        *extra,
    ]


def command(*args):
    return [sys.executable, str(SCRIPT), *map(str, args)]


def run_script(*args, timeout=600):
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout, env=ENV)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_logged_step(out: Path) -> int:
    """The last training step in a live run's metrics.jsonl (a line being written is skipped)."""
    path, step = out / "metrics.jsonl", 0
    for line in path.read_text().splitlines(keepends=True) if path.exists() else []:
        if line.endswith("\n") and '"train/loss"' in line:
            step = json.loads(line)["step"]
    return step


def cache_listing(assets) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (assets["root"] / "token-cache").iterdir()}


@pytest.fixture(scope="module")
def straight(assets):
    """One uninterrupted run (it also measures the matmul peak itself: no --peak_flops)."""
    out = assets["root"] / "straight"
    result = run_script(*clm_args(assets, out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result, cache_listing(assets)


@pytest.fixture(scope="module")
def resumed(assets, straight):
    """The same run killed with SIGKILL after its first checkpoint (mid-save if the kill lands there), an
    unfinished save left behind as a crash leaves it, then the same command again."""
    out = assets["root"] / "resumed"
    checkpoints = out / "checkpoints"
    process = subprocess.Popen(
        command(*clm_args(assets, out)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True
    )
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        names = os.listdir(checkpoints) if checkpoints.is_dir() else []
        saving = any(".orbax-checkpoint-tmp" in n for n in names)
        if str(SAVE_STEPS) in names and (saving or last_logged_step(out) >= 2 * SAVE_STEPS + 5):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    first_output = process.communicate(timeout=60)[0]
    assert process.returncode == -signal.SIGKILL, f"the run was not killed mid-way:\n{first_output[-3000:]}"
    steps = sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit())
    assert steps and steps[-1] < STEPS
    if not any(".orbax-checkpoint-tmp" in n for n in os.listdir(checkpoints)):
        # the kill missed a save: leave the next one half-written, as a kill mid-save does (orbax writes a
        # step to <step>.orbax-checkpoint-tmp and renames it to <step> when complete)
        fake = checkpoints / f"{steps[-1] + SAVE_STEPS}.orbax-checkpoint-tmp"
        shutil.copytree(checkpoints / str(steps[-1]), fake)
        (fake / "commit_success.txt").unlink(missing_ok=True)
        for file in sorted(p for p in fake.rglob("*") if p.is_file())[:3]:
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    result = run_script(*clm_args(assets, out))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"out": out, "result": result, "restored_step": steps[-1], "first_output": first_output}


@pytest.mark.slow
def test_pretraining_lowers_validation_perplexity_and_exports_a_model_transformers_agrees_with(assets, straight):
    import torch

    out, result, _ = straight
    results = json.loads((out / "eval_results.json").read_text())
    assert set(results) == {"eval_loss", "eval_perplexity", "perplexity", "eval_samples"}
    assert results["eval_samples"] == 60 and results["perplexity"] == results["eval_perplexity"]
    assert results["perplexity"] == pytest.approx(np.exp(results["eval_loss"]))
    log = records(out)
    train = [r for r in log if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert 10.0 < train[0]["train/loss"] < 11.5  # a fresh model: about ln(50257)
    evals = [r["eval/perplexity"] for r in log if "eval/perplexity" in r]
    assert len(evals) == STEPS // 10 and evals[-1] < evals[0] and evals[-1] < 2000
    assert all(r["train/tokens_per_second"] > 0 and 0 < r["train/mfu"] < 2 for r in train[1:])
    all_results = json.loads((out / "all_results.json").read_text())
    assert all_results["train_tokens_per_second"] > 0 and all_results["train_mfu"] > 0
    assert all_results["train_samples"] > 9000
    for name in ("config.yaml", "training_curves.png", "model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert "GFLOP/s: MFU is of measured matmul" in result.stdout + result.stderr  # CPU: no published peak

    # transformers' GPT-2 loads the export and gives the eval loss over the same 60 validation blocks
    model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.n_layer == 2 and model.config.n_embd == 64
    config = text.TextDataConfig(
        train_file=str(assets["text"]), max_eval_samples=60, data_cache_dir=str(assets["root"] / "token-cache")
    )
    _, valid = text.load_blocks(config, assets["tokenizer"], BLOCK, progress=False, log=lambda _: None)
    model.eval()
    with torch.no_grad():
        ids = torch.as_tensor(np.asarray(valid, np.int64))
        loss = model(ids, labels=ids).loss.item()  # mean over all 60 x 31 predicted tokens
    assert results["eval_loss"] == pytest.approx(loss, rel=1e-4)


@pytest.mark.slow
def test_sigkill_and_rerun_ends_bitwise_equal_to_an_uninterrupted_run(straight, resumed):
    from safetensors.numpy import load_file

    out = resumed["out"]
    output = resumed["result"].stdout + resumed["result"].stderr
    assert f"resumed from {out / 'checkpoints' / str(resumed['restored_step'])}" in output
    a, b = load_file(straight[0] / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    # the unfinished save was never restored, and is gone
    names = os.listdir(out / "checkpoints")
    assert not any(".orbax-checkpoint-tmp" in n for n in names), names
    assert str(STEPS) in names
    # the log reads as one run: the steps redone after the restore are not listed twice, and every
    # training loss is the uninterrupted run's to the last bit
    losses = {r["step"]: r["train/loss"] for r in records(straight[0]) if "train/loss" in r}
    redone = [(r["step"], r["train/loss"]) for r in records(out) if "train/loss" in r]
    assert [s for s, _ in redone] == list(range(1, STEPS + 1))
    assert all(loss == losses[step] for step, loss in redone)
    assert json.loads((out / "eval_results.json").read_text()) == json.loads(
        (straight[0] / "eval_results.json").read_text()
    )


@pytest.mark.slow
def test_a_rerun_takes_the_tokens_from_the_cache(assets, straight, resumed):
    _out, first, listing = straight
    assert "tokens, cached in" in first.stdout
    assert "tokens from the cache" in resumed["result"].stdout
    assert "tokens from the cache" in resumed["first_output"]
    assert cache_listing(assets) == listing  # nothing was written again


def test_cache_key_follows_the_file_contents_not_the_block_size(tmp_path, assets):
    tokenizer, cache = assets["tokenizer"], text.TokenCache(tmp_path / "cache")
    path = tmp_path / "doc.txt"
    path.write_text("To be, or not to be: that is the question.\n" * 40)
    messages = []
    first = text.file_tokens(path, tokenizer, cache, log=messages.append)
    again = text.file_tokens(path, tokenizer, cache, log=messages.append)
    assert np.array_equal(first, again) and "from the cache" in messages[-1]
    assert text.group_texts(again, 8).shape == (len(first) // 8, 8)  # any block size cuts the same stream
    path.write_text("Whether 'tis nobler in the mind to suffer.\n" * 40)
    changed = text.file_tokens(path, tokenizer, cache, log=messages.append)
    assert "cached in" in messages[-1] and not np.array_equal(changed[:10], first[:10])
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 2


def test_pieces_tokenize_exactly_like_the_whole_document(assets):
    tokenizer = assets["tokenizer"]
    document = shared_asset("data/text/botchan.txt").read_text()
    pieces = list(text.pieces(document, size=4096))
    assert len(pieces) > 20 and "".join(pieces) == document
    whole = tokenizer(document, verbose=False)["input_ids"] + [tokenizer.eos_token_id]
    np.testing.assert_array_equal(text.tokenize([document], tokenizer, progress=False), whole)


def test_a_dataset_uses_its_validation_split_and_is_cached_by_fingerprint(tmp_path, assets, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    rows = [f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(100)]
    for split, part in (("train", rows[:90]), ("validation", rows[90:])):  # a folder load_dataset reads
        write(tmp_path / "data" / f"{split}.jsonl", "".join(json.dumps({"text": r}) + "\n" for r in part))
    config = text.TextDataConfig(dataset_name=str(tmp_path / "data"), data_cache_dir=str(tmp_path / "cache"))
    tokenizer, messages = assets["tokenizer"], []
    train, valid = text.load_blocks(config, tokenizer, 16, progress=False, log=messages.append)
    expected = [tokenizer(r)["input_ids"] + [tokenizer.eos_token_id] for r in rows]
    np.testing.assert_array_equal(train, hf_group_texts({"input_ids": expected[:90]}, 16)["input_ids"])
    np.testing.assert_array_equal(valid, hf_group_texts({"input_ids": expected[90:]}, 16)["input_ids"])
    again = text.load_blocks(config, tokenizer, 16, progress=False, log=messages.append)
    assert len(messages) == 4 and all("tokens from the cache" in m for m in messages[2:])
    np.testing.assert_array_equal(again[0], train)


def hf_group_texts(examples: dict[str, list], block_size: int) -> dict[str, list]:
    """transformers' examples/pytorch/language-modeling/run_clm.py group_texts, verbatim in substance."""
    concatenated = {k: [t for part in examples[k] for t in part] for k in examples}
    total_length = len(concatenated["input_ids"])
    total_length = (total_length // block_size) * block_size
    result = {k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}
    result["labels"] = result["input_ids"].copy()
    return result


def test_documents_are_joined_by_eos_and_grouped_like_run_clm(tmp_path, assets):
    tokenizer = assets["tokenizer"]
    rows = [
        "First Citizen: Before we proceed any further, hear me speak.",
        "",
        "All: Speak, speak.",
        "You are all resolved rather to die than to famish?",
    ]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(rows)))
    (tmp_path / "docs.csv").write_text("id,text\n" + "".join(f'{i},"{r}"\n' for i, r in enumerate(rows)))
    expected = [tokenizer(r)["input_ids"] + [tokenizer.eos_token_id] for r in rows if r]
    for name in ("docs.jsonl", "docs.csv"):
        documents = list(text.read_documents(tmp_path / name))
        assert documents == rows
        tokens = text.tokenize(documents, tokenizer, progress=False)
        assert tokens.dtype == np.uint16
        blocks = text.group_texts(tokens, 5)
        np.testing.assert_array_equal(blocks, hf_group_texts({"input_ids": expected}, 5)["input_ids"])
    train, valid = text.split_blocks(np.arange(100).reshape(20, 5), 10)
    assert train.shape == (18, 5) and valid.shape == (2, 5) and valid[0, 0] == 90


@pytest.fixture(scope="module")
def script():
    """``jaxseq clm`` (scripts/pretrain_clm.py) in this process."""
    from jaxseq.commands import clm

    return clm


def write(path: Path, content: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    return path


def neox_config(t: Path) -> Path:
    """A GPT-NeoX config: a family jaxseq lacks."""
    transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2
    ).save_pretrained(t / "neox")
    return t / "neox"


BAD = {  # flags to change (None drops the flag), the message
    "block size above positions": (lambda t: {"--block_size": 2048}, "--block_size 2048 exceeds the model's 1024"),
    "missing train file": (lambda t: {"--train_file": t / "nowhere.txt"}, "does not exist"),
    "missing validation file": (lambda t: {"--validation_file": t / "nowhere.txt"}, "does not exist"),
    "empty text": (lambda t: {"--train_file": write(t / "empty.txt", "")}, "has no text"),
    "text shorter than a block": (
        lambda t: {"--train_file": write(t / "short.txt", "Hello there.")},
        "not enough for one block of 32",
    ),
    "unknown model type": (lambda t: {"--config_name": neox_config(t)}, "'gpt_neox' has no causal-lm model in jaxseq"),
    "unknown --model_type": (
        lambda t: {"--config_name": None, "--model_type": "gpt3"},
        "'gpt3' has no causal-lm model",
    ),
    "no model": (lambda t: {"--config_name": None}, "pass --model_name_or_path"),
    "model twice": (lambda t: {"--model_name_or_path": t}, "not both"),
    "no text": (lambda t: {"--train_file": None}, "no training text"),
    "bad override": (lambda t: {"--config_overrides": "n_layers=2"}, "GPT2Config has no field 'n_layers'"),
    "vocabulary too small": (lambda t: {"--config_overrides": "vocab_size=1000"}, "the tokenizer has 50257 tokens"),
    "unsupported file": (lambda t: {"--train_file": write(t / "data.parquet", "x")}, "unsupported file type"),
    "no text column": (lambda t: {"--train_file": write(t / "d.jsonl", '{"body": "hi"}\n')}, "has no 'text' field"),
    "missing checkpoint": (lambda t: {"--config_name": None, "--model_name_or_path": t / "nowhere"}, "is not a folder"),
}


def with_flags(args: list, changes: dict) -> list[str]:
    args = [str(a) for a in args]
    for flag, value in changes.items():
        if flag in args:
            i = args.index(flag)
            del args[i : i + 2]
        if value is not None:
            args += [flag, str(value)]
    return args


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, assets, script, capsys):
    changes, message = BAD[case]
    out = tmp_path / "out"
    args = with_flags(clm_args(assets, out, "--peak_flops", 1e11, "--compilation_cache_dir", ""), changes(tmp_path))
    assert script.main(args) == 1
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


def test_bad_input_exits_non_zero_from_the_command_line(tmp_path, assets):
    result = run_script(*clm_args(assets, tmp_path / "out", "--train_file", tmp_path / "nowhere.txt"))
    assert result.returncode == 1
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("[transformers]")]
    assert lines == [f"error: text file {tmp_path / 'nowhere.txt'} does not exist"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gptj_from_scratch_then_from_its_own_checkpoint(tmp_path, assets, script):
    common = [
        "--tokenizer_name",
        assets["root"] / "tokenizer",
        "--train_file",
        shared_asset("data/text/botchan.txt"),
        "--block_size",
        16,
        "--max_eval_samples",
        12,
        "--per_device_train_batch_size",
        1,
        "--per_device_eval_batch_size",
        1,
        "--logging_steps",
        1,
        "--peak_flops",
        1e11,
        "--compilation_cache_dir",
        "",
        "--data_cache_dir",
        assets["root"] / "token-cache",
    ]
    scratch, continued = tmp_path / "scratch", tmp_path / "continued"
    overrides = "n_layer=2,n_embd=64,n_head=4,rotary_dim=8,n_positions=64"
    assert (
        script.main(
            with_flags(
                [
                    *common,
                    "--model_type",
                    "gptj",
                    "--config_overrides",
                    overrides,
                    "--max_steps",
                    2,
                    "--learning_rate",
                    1e-3,
                    "--output_dir",
                    scratch,
                ],
                {},
            )
        )
        == 0
    )
    model, info = transformers.GPTJForCausalLM.from_pretrained(scratch, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.config.rotary_dim == 8
    # reloaded through --model_name_or_path and not moved (learning rate 0): the same eval loss
    assert (
        script.main(
            with_flags(
                [
                    *common,
                    "--model_name_or_path",
                    scratch,
                    "--max_steps",
                    1,
                    "--learning_rate",
                    0,
                    "--output_dir",
                    continued,
                ],
                {},
            )
        )
        == 0
    )
    first, second = (json.loads((out / "eval_results.json").read_text()) for out in (scratch, continued))
    assert second["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-6)
    assert first["eval_samples"] == second["eval_samples"] == 12


@pytest.mark.parametrize("count", [1, 8])
def test_peak_flops_is_measured_on_every_device_of_a_mesh(count, monkeypatch):
    """`jaxseq clm` and `chat` pass a mesh's ``devices.flat``, an iterator: the CPU peak was measured on what
    the published-peak lookup left of it (7 of 8 devices; with one device, nothing: a crash)."""
    import jax
    import jax.numpy as jnp

    from jaxseq.mesh import make_mesh
    from jaxseq.train import throughput

    measured = []
    monkeypatch.setattr(throughput, "measure_peak_flops", lambda devices, dtype: measured.append(list(devices)) or 1.0)
    mesh = make_mesh("dp=-1", devices=jax.devices()[:count])
    assert throughput.peak_flops(mesh.devices.flat, jnp.float32) == (1.0, "measured matmul")
    assert measured == [list(mesh.devices.flat)]
    monkeypatch.undo()
    assert throughput.peak_flops(mesh.devices.flat, jnp.float32)[0] > 0  # a real matmul on every device
