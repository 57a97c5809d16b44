"""The `jaxseq` command: installed from a wheel (not editable) into a fresh environment it answers from any
folder, with the shipped configs as package data; values from a --config YAML are converted and checked
exactly as the same flags (one line naming the key and what it takes); transformers' flag names work."""

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from jaxseq.commands import glue
from jaxseq.config import save_config
from jaxseq.runner import parse_job
from tests.conftest import shared_asset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding jaxseq installed from its wheel (its dependencies: this interpreter's, by a .pth
    file, which runs none of their .pth files, so the editable install of the checkout stays out)."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "jaxseq"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(
            ROOT / name,
            source / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if name == "jaxseq" else {}),
        )
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", source], check=True)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(purelib, "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    wheel = next((tmp / "dist").glob("jaxseq-*.whl"))
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], check=True)
    return venv


def run_installed(venv: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([*map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_installed_command_from_any_folder(installed, tmp_path):
    found = run_installed(
        installed, tmp_path, "python", "-c", "import jaxseq.config as c; print(c.__file__, c.shipped_configs())"
    )
    assert found.returncode == 0, found.stderr
    assert str(installed) in found.stdout.split()[0]  # the installed copy, not the checkout
    assert "glue_sst2_quick" in found.stdout and str(installed) in found.stdout.split(" ", 1)[1]
    top = run_installed(installed, tmp_path, "jaxseq", "--help")
    assert top.returncode == 0, top.stderr
    for job in ("glue", "clm", "seq2seq", "generate", "push"):
        assert f"\n  {job} " in top.stdout
    version = run_installed(installed, tmp_path, "jaxseq", "--version")
    assert version.stdout.strip() == "jaxseq 0.1.0"
    job = run_installed(installed, tmp_path, "jaxseq", "glue", "--help")
    assert job.returncode == 0, job.stderr
    assert job.stdout.startswith("usage: jaxseq glue")
    assert all(f in job.stdout for f in ("--do_predict", "--eval_strategy", "--load_best_model_at_end", "--bf16"))
    (tmp_path / "bad.yaml").write_text("TrainerConfig:\n  eval_strategy: sometimes\n")
    bad = run_installed(installed, tmp_path, "jaxseq", "glue", "--config", "bad.yaml", "--output_dir", "out")
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "error: config file bad.yaml: eval_strategy must be one of no, steps, epoch, got 'sometimes'"
    ]
    assert not (tmp_path / "out").exists()
    misspelt = run_installed(installed, tmp_path, "jaxseq", "glu")
    assert misspelt.returncode == 2 and "invalid choice: 'glu'" in misspelt.stderr


BAD_YAML = {
    "optimizer: adam\n": "optimizer must be one of adamw, adafactor, lion, sgd, muon, lbfgs, got 'adam'",
    "TrainerConfig:\n  max_steps: 2.5\n": "max_steps must be an integer, got 2.5",
    "learning_rate: fast\n": "learning_rate must be a number, got 'fast'",
    "pack_sequences: maybe\n": "pack_sequences must be true or false, got 'maybe'",
    "task_name: [sst2, mrpc]\n": "task_name must be a single value, got ['sst2', 'mrpc']",
    "seed: null\n": "seed is empty; give it a value (its default is 42)",
    "lr_scheduler_type: polynomial\n": "lr_scheduler_type must be one of linear, cosine, constant, got 'polynomial'",
}


@pytest.mark.parametrize("text", list(BAD_YAML))
def test_yaml_values_are_checked_like_flags(text, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    assert glue.main(["--config", str(config), "--output_dir", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: config file {config}: {BAD_YAML[text]}"]
    assert not (tmp_path / "out").exists()


def test_yaml_values_become_what_the_flags_would(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "TrainerConfig:\n  max_steps: 7\n  remat: true\n  metric_for_best_model: eval_f1\n"
        "optim: adamw_torch_fused\nbf16: true\nlearning_rate: 3.0e-5\n"
    )
    args = parse_job(glue.JOB, ["--config", str(config)])
    trainer, optimizer, runtime = args.trainer, args.optimizer, args.runtime
    assert (trainer.max_steps, trainer.remat, trainer.metric_for_best_model) == (7, "full", "f1")
    assert (optimizer.optimizer, optimizer.learning_rate, runtime.dtype) == ("adamw", 3e-5, "bfloat16")
    # flags win over the file, and the shipped configs load by name
    args = parse_job(glue.JOB, ["--config", "glue_sst2_quick", "--fp16"])
    data, runtime, trainer = args.data, args.runtime, args.trainer
    assert (data.task_name, data.max_train_samples, trainer.metric_for_best_model) == ("sst2", 2000, "accuracy")
    assert runtime.dtype == "float16"


def test_transformers_flag_names(tmp_path):
    flags = [
        "--bf16",
        "--optim",
        "adafactor",
        "--gradient_checkpointing",
        "--lr_scheduler_type",
        "constant_with_warmup",
    ]
    flags += ["--evaluation_strategy", "epoch", "--output_dir", str(tmp_path)]
    args = parse_job(glue.JOB, flags)
    runtime, trainer, optimizer = args.runtime, args.trainer, args.optimizer
    assert (runtime.dtype, optimizer.optimizer, trainer.remat) == ("bfloat16", "adafactor", "full")
    assert (optimizer.lr_scheduler_type, trainer.eval_strategy) == ("constant", "epoch")
    assert parse_job(glue.JOB, ["--bf16", "false"]).runtime.dtype == "float32"


def test_unknown_shipped_config_is_one_line(capsys):
    assert glue.main(["--config", "glue_nothing"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: config file glue_nothing does not exist; pass a YAML file or a shipped config "
        "(glue_sst2, glue_sst2_quick)"
    ]


def test_a_runs_saved_config_loads_back(tmp_path):
    flags = ["--task_name", "mrpc", "--load_best_model_at_end", "--eval_strategy", "steps", "--do_predict"]
    sections = parse_job(glue.JOB, [*flags, "--output_dir", str(tmp_path)])
    save_config(tmp_path / "config.yaml", *vars(sections).values())
    again = parse_job(glue.JOB, ["--config", str(tmp_path / "config.yaml")])
    assert again == sections


def test_the_command_reads_pytorch_bin_checkpoints(tmp_path):
    """`jaxseq generate` from a pytorch_model.bin (read with torch): the greedy tokens of transformers'
    PyTorch model from the same file."""
    import torch
    import transformers

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("XLA_FLAGS", None)
    gpt2 = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(gpt2 / "vocab.json"), merges=str(gpt2 / "merges.txt"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=len(tokenizer))
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))  # far from the default init, so a misread weight shows
    folder = tmp_path / "bin"
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    out = tmp_path / "completions.jsonl"
    flags = ["--model_name_or_path", folder, "--prompt", "The cat sat on", "--max_new_tokens", 8]
    ran = subprocess.run(
        [sys.executable, "-m", "jaxseq", "generate", *map(str, flags), "--output_file", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    record = json.loads(out.read_text().splitlines()[0])
    ids = torch.tensor([tokenizer("The cat sat on")["input_ids"]])
    want = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=config.eos_token_id)[0, ids.shape[1] :]
    assert record["completion"] == tokenizer.decode(want, skip_special_tokens=True)
    assert record["completion_tokens"] == len(want) == 8
