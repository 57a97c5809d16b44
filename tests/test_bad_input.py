"""Every failure a user can cause, run as the user runs it (the real script in a subprocess): each ends with a
non-zero exit and one line naming the problem and the way out, no traceback, and nothing half-written on
disk. Faults too: a NaN loss stops at its step and keeps the last good checkpoint (or is skipped and
counted); SIGTERM and Ctrl-C save a checkpoint that a rerun resumes from; a save that cannot be written
leaves the previous checkpoint usable.

The cases run three processes at a time (each imports JAX and transformers, a few CPU seconds); the ones
that train are marked slow."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import shared_asset
from tests.test_pretrain_clm import last_logged_step

transformers = pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
ENV = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "JAX_PLATFORMS": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def command(script: str, *args) -> list[str]:
    return [sys.executable, str(SCRIPTS / script), *map(str, args)]


def run(script: str, *args, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(command(script, *args), capture_output=True, text=True, timeout=timeout, env=ENV, **kw)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []


def checkpoint_steps(out: Path) -> list[int]:
    folder = out / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def one_line(result) -> str:
    """The single line a failed run ends with: no traceback, one ``error:``/``interrupted:`` line, last."""
    err = result.stderr
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    flagged = [line for line in lines if line.startswith(("error:", "interrupted:")) or ": error: " in line]
    assert len(flagged) == 1, err[-3000:]
    assert lines[-1] == flagged[0], err[-3000:]
    return flagged[0]


# --------------------------------------------------------------------------- what the cases run on


class RunsCode:
    """Pickled, it becomes a call of os.system: unpickling it in the case's folder leaves a file there."""

    def __reduce__(self):
        return os.system, ("touch pickled-code-ran",)


def no_code_ran(out: Path) -> None:
    assert not (out.parent / "pickled-code-ran").exists()
    nothing_written(out)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Real MiniLM and GLUE TSVs; the real GPT-2 tokenizer as a folder with GPT-2's config (runs shrink it);
    a GPT-NeoX config (a family jaxseq lacks); a copy of MiniLM with its weights cut short; a GLUE folder whose
    TSV lacks a column; a tiny GPT-2 whose pytorch_model.bin is a pickle that runs a command."""
    root = tmp_path_factory.mktemp("bad-input")
    minilm, glue = shared_asset("models/all-MiniLM-L6-v2"), shared_asset("data/glue")
    gpt2 = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(gpt2 / "vocab.json"), merges=str(gpt2 / "merges.txt"))
    tokenizer.save_pretrained(root / "gpt2-tokenizer")
    transformers.GPT2Config().save_pretrained(root / "gpt2-config")
    transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2
    ).save_pretrained(root / "neox")
    shutil.copytree(root / "gpt2-tokenizer", root / "neox", dirs_exist_ok=True)
    cut = root / "minilm-truncated"
    cut.mkdir()
    for file in minilm.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, cut / file.name)
    with open(minilm / "model.safetensors", "rb") as f:
        (cut / "model.safetensors").write_bytes(f.read(1 << 20))  # the header and the first MB of 90
    write(root / "glue-bad" / "SST-2" / "train.tsv", "text\tlabel\nfine film\t1\n")
    write(root / "glue-bad" / "SST-2" / "dev.tsv", "sentence\tlabel\nfine film\t1\n")
    evil = root / "gpt2-pickled-code"  # a .bin whose pickle runs a command when unpickled
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(evil)
    shutil.copytree(root / "gpt2-tokenizer", evil, dirs_exist_ok=True)
    with zipfile.ZipFile(evil / "pytorch_model.bin", "w") as archive:  # torch.save's layout
        archive.writestr("archive/data.pkl", pickle.dumps({"transformer.wte.weight": RunsCode()}, protocol=2))
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/byteorder", "little")
    return {
        "root": root,
        "minilm": minilm,
        "evil": evil,
        "glue": glue,
        "truncated": cut,
        "neox": root / "neox",
        "gpt2_tokenizer": root / "gpt2-tokenizer",
        "gpt2_config": root / "gpt2-config",
        "text": shared_asset("data/text/botchan.txt"),
        "token_cache": root / "token-cache",
    }


def glue_args(a, out, **changes):
    args = {
        "--model_name_or_path": a["minilm"],
        "--data_dir": a["glue"],
        "--task_name": "sst2",
        "--output_dir": out,
        "--max_train_samples": 32,
        "--max_eval_samples": 16,
        "--max_seq_length": 32,
        "--per_device_train_batch_size": 2,
        "--per_device_eval_batch_size": 4,
        "--max_steps": 2,
        "--compilation_cache_dir": "",
    }
    return flags(args, changes)


def clm_args(a, out, **changes):
    args = {
        "--config_name": a["gpt2_config"],
        "--config_overrides": "n_layer=2,n_embd=64,n_head=4",
        "--tokenizer_name": a["gpt2_tokenizer"],
        "--train_file": a["text"],
        "--block_size": 32,
        "--max_eval_samples": 8,
        "--per_device_train_batch_size": 2,
        "--per_device_eval_batch_size": 4,
        "--max_steps": 4,
        "--logging_steps": 1,
        "--learning_rate": 1e-3,
        "--seed": 0,
        "--output_dir": out,
        "--data_cache_dir": a["token_cache"],
        "--compilation_cache_dir": "",
        "--peak_flops": 1e11,
    }
    return flags(args, changes)


def seq2seq_args(a, out, **changes):
    args = {
        "--model_type": "t5",
        "--config_overrides": "num_layers=1,num_decoder_layers=1,d_model=32,d_ff=64,"
        "num_heads=2,d_kv=16,vocab_size=50304",
        "--tokenizer_name": a["gpt2_tokenizer"],
        "--train_file": a["pairs"],
        "--validation_file": a["pairs"],
        "--output_dir": out,
        "--max_steps": 2,
        "--compilation_cache_dir": "",
    }
    return flags(args, changes)


def grpo_args(a, folder, out, **changes):
    rewards = write(folder / "r.py", "def f(**kw):\n    return []\n")
    args = {
        "--model_name_or_path": a["gpt2_config"],
        "--tokenizer_name": a["gpt2_tokenizer"],
        "--train_file": write(folder / "prompts.jsonl", '{"prompt": "hi"}\n'),
        "--reward_funcs": f"{rewards}:f",
        "--output_dir": out,
        "--max_steps": 1,
        "--compilation_cache_dir": "",
    }
    return flags(args, changes)


def flags(args: dict, changes: dict) -> list[str]:
    """``changes`` use underscores for dashes (``max_steps=...``); None drops a flag; ``extra`` appends raw."""
    extra = changes.pop("extra", [])
    for name, value in changes.items():
        key = f"--{name}"
        if value is None:
            args.pop(key, None)
        else:
            args[key] = value
    return [str(x) for kv in args.items() for x in kv] + [str(x) for x in extra]


# --------------------------------------------------------------------------- the table


@dataclasses.dataclass
class Case:
    script: str
    args: Callable  # (assets, case folder, output dir) -> argv
    code: int
    message: str
    left: Callable[[Path], None] | None = None  # checks what is on disk afterwards (default: nothing)
    after: str | None = None  # a case whose output dir this one starts from (a copy, snapshotted)
    trains: bool = False  # runs training steps: marked slow
    debug: bool = False  # run with --debug: the traceback instead of the one line


def nothing_written(out: Path) -> None:
    assert files_under(out) == [], files_under(out)


def kept_last_good_checkpoint(out: Path) -> None:
    assert checkpoint_steps(out) == [1]  # step 2 went NaN: nothing after step 1 was saved
    assert not (out / "model.safetensors").exists() and not (out / "eval_results.json").exists()
    assert not list((out / "checkpoints").glob("*tmp*"))


SECRET = "hf_jaxseqTestToken0123456789"


def skipped_and_counted(out: Path) -> None:
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if "train/loss" in r]
    assert [r["train/skipped_updates"] for r in train] == [0, 1, 2, 3]  # every update after the first blew up
    assert (out / "model.safetensors").is_file() and (out / "config.yaml").is_file()
    # the token given on the command line is in no file of the run (config, metrics, model card, ...)
    assert [p for p in files_under(out) if SECRET.encode() in p.read_bytes()] == []


def other_run_untouched(out: Path) -> None:
    """The run of another model (n_embd 64) whose folder this run (n_embd 32) was pointed at is as it was."""
    snapshot = json.loads((out.parent / "snapshot.json").read_text())
    assert snapshot and snapshot == listing(out)


def listing(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_bytes().hex()[:64] + str(p.stat().st_size) for p in files_under(out)}


CASES = {
    # ---- finetune_glue.py
    "model path that does not exist": Case(
        "finetune_glue.py", lambda a, t, o: glue_args(a, o, model_name_or_path=t / "nowhere"), 1, "is not a folder"
    ),
    "the same with --debug": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, model_name_or_path=t / "nowhere", extra=["--debug"]),
        1,
        "is not a folder",
        debug=True,
    ),
    "hub id while offline": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, model_name_or_path="jaxseq-tests/no-such-model"),
        1,
        "cannot download 'jaxseq-tests/no-such-model' from the Hugging Face Hub",
    ),
    "tokenizer hub id while offline": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, tokenizer_name="jaxseq-tests/no-such-tokenizer"),
        1,
        "cannot load a tokenizer from jaxseq-tests/no-such-tokenizer",
    ),
    "unsupported model_type": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, model_name_or_path=a["neox"]),
        1,
        "model_type 'gpt_neox' is not supported",
    ),
    "malformed yaml": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, config=write(t / "c.yaml", "learning_rate: [1e-4\n")),
        1,
        "is not valid YAML",
    ),
    "unknown flag": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, extra=["--learning_rat", "1e-4"]),
        2,
        "unrecognized arguments: --learning_rat 1e-4",
    ),
    "mesh the devices cannot form": Case(
        "finetune_glue.py", lambda a, t, o: glue_args(a, o, mesh="dp=3"), 1, "needs 3 devices but 2 are available"
    ),
    "unknown task": Case(
        "finetune_glue.py", lambda a, t, o: glue_args(a, o, task_name="squad"), 2, "invalid choice: 'squad'"
    ),
    "missing train file": Case(
        "finetune_glue.py", lambda a, t, o: glue_args(a, o, train_file=t / "train.csv"), 1, "does not exist"
    ),
    "tsv missing its columns": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, data_dir=a["root"] / "glue-bad"),
        1,
        "lacks column(s) 'sentence'",
    ),
    "label outside num_labels": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, train_file=write(t / "train.csv", "sentence,label\nhi,7\n")),
        1,
        "label 7 is outside 0..1 for sst2",
    ),
    "empty split": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, train_file=write(t / "train.csv", "sentence,label\n")),
        1,
        "has no examples",
    ),
    "max_seq_length above the positions": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, max_seq_length=4096),
        1,
        "--max_seq_length 4096 exceeds the model's 512 positions",
    ),
    "batch size of zero": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, per_device_train_batch_size=0),
        1,
        "--per_device_train_batch_size must be at least 1, got 0",
    ),
    "output dir under a file": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, write(t / "a-file", "x") / "out"),
        1,
        "is a file, not a folder; pick another --output_dir",
    ),
    "truncated safetensors": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, model_name_or_path=a["truncated"]),
        1,
        "is truncated or corrupt (not a valid safetensors file)",
    ),
    "tokenizer larger than the vocabulary": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, tokenizer_name=a["gpt2_tokenizer"]),
        1,
        "the tokenizer has 50257 tokens but the model only 30522",
    ),
    "unwritable cache folder (any failing file operation)": Case(
        "finetune_glue.py",
        lambda a, t, o: glue_args(a, o, compilation_cache_dir=write(t / "a-file", "x") / "xla"),
        1,
        "Not a directory: ",
    ),
    # ---- pretrain_clm.py
    "block_size above the positions": Case(
        "pretrain_clm.py",
        lambda a, t, o: clm_args(a, o, block_size=2048),
        1,
        "--block_size 2048 exceeds the model's 1024 positions",
    ),
    "dimension not divisible by its mesh axis": Case(
        "pretrain_clm.py",
        lambda a, t, o: clm_args(a, o, mesh="mp=2", config_overrides="n_layer=2,n_embd=64,n_head=4,n_inner=101"),
        1,
        "transformer/h/stacked/mlp/c_fc/kernel shape (2, 64, 101) spec P(None, 'fsdp', 'mp')",  # scanned on CPU
    ),
    "output dir holding another model's checkpoint": Case(
        "pretrain_clm.py",
        lambda a, t, o: clm_args(a, o, config_overrides="n_layer=2,n_embd=32,n_head=4"),
        1,
        "was written for a different model or optimizer (params/transformer/h/stacked/attn/c_attn/bias/value is "
        "(2, 192) there, (2, 96) here",
        left=other_run_untouched,
        after="loss becomes NaN",
        trains=True,
    ),
    "output dir holding the model's checkpoint with other --scan_layers": Case(
        "pretrain_clm.py",
        lambda a, t, o: clm_args(a, o, scan_layers="false"),
        1,
        "holds the model's blocks scanned; resume with --scan_layers true",  # auto scans on CPU
        left=other_run_untouched,
        after="loss becomes NaN",
        trains=True,
    ),
    "loss becomes NaN": Case(
        "pretrain_clm.py",
        lambda a, t, o: clm_args(a, o, learning_rate=1e30, save_steps=1),
        1,
        "the training loss became nan at step 2; the last good checkpoint is step 1",
        left=kept_last_good_checkpoint,
        trains=True,
    ),
    "NaN updates skipped with a flag (and a Hub token kept secret)": Case(
        "pretrain_clm.py",
        lambda a, t, o: clm_args(
            a,
            o,
            learning_rate=1e30,
            skip_nonfinite_updates="true",
            push_to_hub="true",
            hub_dry_run="true",
            hub_token=SECRET,
        ),
        0,
        "",
        left=skipped_and_counted,
        trains=True,
    ),
    # ---- finetune_seq2seq.py
    "seq2seq without a data file": Case(
        "finetune_seq2seq.py",
        lambda a, t, o: seq2seq_args(a, o, train_file=None, validation_file=None),
        1,
        "pass --train_file, --validation_file or --do_predict with --test_file",
    ),
    "seq2seq predicting without a test file": Case(
        "finetune_seq2seq.py",
        lambda a, t, o: seq2seq_args(a, o, extra=["--do_predict"]),
        1,
        "--do_predict needs --test_file",
    ),
    "seq2seq file missing its columns": Case(
        "finetune_seq2seq.py",
        lambda a, t, o: seq2seq_args(a, o, source_column="question"),
        1,
        "lacks column(s) question",
    ),
    # ---- generate.py
    "generate with a model that cannot generate": Case(
        "generate.py",
        lambda a, t, o: ["--model_name_or_path", a["minilm"], "--prompt", "hi"],
        1,
        "bert models cannot generate text",
    ),
    "pytorch .bin holding pickled code": Case(
        "generate.py",
        lambda a, t, o: ["--model_name_or_path", a["evil"], "--prompt", "hi", "--output_file", o / "c.jsonl"],
        1,
        "holds pickled objects besides tensors, and jaxseq never unpickles them",
        left=no_code_ran,
    ),
    "generate with a missing prompt file": Case(
        "generate.py",
        lambda a, t, o: ["--model_name_or_path", a["minilm"], "--prompt_file", t / "p.txt"],
        1,
        "prompt file",
    ),
    # ---- grpo.py
    "grpo batch not whole groups of completions": Case(
        "grpo.py",
        lambda a, t, o: grpo_args(a, t, o, num_generations=4, per_device_train_batch_size=3),
        1,
        "--per_device_train_batch_size 3 x 2 device(s) x --gradient_accumulation_steps 1 = 6 completions a step, "
        "which must be divisible by --num_generations 4 (whole groups, as TRL's generation_batch_size); use e.g. "
        "--per_device_train_batch_size 4",
    ),
}


# --------------------------------------------------------------------------- signals and failing saves


def run_until(args: list, out: Path, step: int, signum: int) -> subprocess.CompletedProcess:
    """Start pretrain_clm, send ``signum`` once metrics.jsonl shows ``step`` trained, wait for the end."""
    process = subprocess.Popen(
        command("pretrain_clm.py", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    deadline = time.monotonic() + 240
    while process.poll() is None and time.monotonic() < deadline and last_logged_step(out) < step:
        time.sleep(0.01)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def interrupted_runs(a, folder: Path) -> dict:
    """One run stopped by SIGTERM after step 3, rerun and stopped by Ctrl-C three steps later, rerun with files
    unable to grow past 1 MB (as on a full disk: the final save fails), rerun to the end. Each stage's result
    and the checkpoints it left."""
    out = folder / "out"
    args = clm_args(a, out, max_steps=40, save_steps=0, eval_steps=1000, compilation_cache_dir=folder / "xla")
    stages = {}
    stages["sigterm"] = run_until(args, out, 3, signal.SIGTERM), checkpoint_steps(out)
    stages["sigint"] = run_until(args, out, stages["sigterm"][1][-1] + 3, signal.SIGINT), checkpoint_steps(out)
    stages["full disk"] = run("pretrain_clm.py", *args, preexec_fn=limit_file_size(1 << 20)), checkpoint_steps(out)
    stages["last"] = run("pretrain_clm.py", *args), checkpoint_steps(out)
    return {"out": out, **stages}


# --------------------------------------------------------------------------- running it all


def run_all(assets, root: Path, names: list[str], extra: dict | None = None) -> dict:
    """The cases ``names`` (and ``extra`` jobs), three processes at a time, the longest first."""
    folders = {name: root / name.replace(" ", "-").replace("'", "") for name in names}
    futures = {}

    def one(name):
        case, folder = CASES[name], folders[name]
        folder.mkdir()
        out = folder / "out"
        if case.after:
            futures[case.after].result()
            shutil.copytree(folders[case.after] / "out", out)
            (folder / "snapshot.json").write_text(json.dumps(listing(out)))
        return run(case.script, *case.args(assets, folder, out), cwd=folder), out

    with ThreadPoolExecutor(3) as pool:
        for name, job in (extra or {}).items():
            futures[name] = pool.submit(job)
        for name in sorted(
            names, key=lambda n: (not CASES[n].trains, CASES[n].after is not None, CASES[n].script != "pretrain_clm.py")
        ):
            futures[name] = pool.submit(one, name)
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def outcomes(assets, tmp_path_factory, request):
    """The runs the selected tests need, all in one pool (so the slow ones overlap the quick ones)."""
    root = tmp_path_factory.mktemp("cases")
    assets["pairs"] = write(
        root / "pairs.jsonl", "".join(json.dumps({"source": f"say {i}", "target": f"{i}"}) + "\n" for i in range(8))
    )
    selected = [item for item in request.session.items if item.module is request.module]
    cases = [item.callspec.params for item in selected if hasattr(item, "callspec")]
    names = {params["name"] for params in cases if "name" in params}
    names |= {CASES[n].after for n in names if CASES[n].after}
    extra = {}
    if any(item.name.startswith("test_signals") for item in selected):
        extra["interrupted runs"] = lambda: interrupted_runs(assets, root / "interrupted")
    return run_all(assets, root, [n for n in CASES if n in names], extra)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if CASES[n].trains else []) for n in CASES])
def test_case(name, outcomes):
    case = CASES[name]
    result, out = outcomes[name]
    assert result.returncode == case.code, (result.returncode, result.stderr[-3000:])
    if case.debug:
        assert "Traceback (most recent call last)" in result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("jaxseq.errors.JaxseqError: ") and case.message in last, last
    elif case.code:
        line = one_line(result)
        assert case.message in line, line
    assert SECRET not in result.stdout + result.stderr
    (case.left or nothing_written)(out)


@pytest.mark.slow
def test_signals_save_a_checkpoint_a_rerun_resumes_and_a_failed_save_keeps_the_last(outcomes):
    runs = outcomes["interrupted runs"]
    out = runs["out"]
    checkpoints = out / "checkpoints"
    first, after_first = runs["sigterm"]
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    assert len(after_first) == 1 and after_first[0] >= 3, after_first
    stopped = after_first[0]
    assert one_line(first) == (
        f"interrupted: SIGTERM at step {stopped}: saved a checkpoint in "
        f"{checkpoints / str(stopped)}; rerun the same command to resume from it"
    )

    second, after_second = runs["sigint"]
    assert second.returncode == 130, second.stderr[-3000:]
    assert f"resumed from {checkpoints / str(stopped)} (step {stopped})" in second.stdout
    assert one_line(second) == (
        f"interrupted: SIGINT at step {after_second[-1]}: saved a checkpoint in "
        f"{checkpoints / str(after_second[-1])}; rerun the same command to resume from it"
    )
    assert after_second == [stopped, after_second[-1]] and after_second[-1] >= stopped + 3

    full, after_full = runs["full disk"]
    assert full.returncode == 1, full.stderr[-3000:]
    assert f"resumed from {checkpoints / str(after_second[-1])}" in full.stdout
    assert one_line(full) == (
        f"error: cannot write the checkpoint of step 40 in {checkpoints} (File too large); "
        f"the previous checkpoint (step {after_second[-1]}) is intact and a rerun resumes from "
        "it; free disk space or pick another --output_dir"
    )
    assert after_full == after_second

    last, after_last = runs["last"]
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"resumed from {checkpoints / str(after_second[-1])}" in last.stdout  # the failed save was never used
    assert after_last == [after_second[-1], 40] and (out / "model.safetensors").is_file()
    logged = [
        json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in line
    ]
    assert logged == list(range(1, 41))  # one run's log: nothing lost, nothing twice


@pytest.mark.parametrize("writer", ["orbax", "other"])
def test_a_failed_saves_unretrieved_write_errors_stay_quiet(writer, caplog):
    """A failed save leaves gathered writes whose error nobody retrieves; asyncio logs each with a traceback
    (a ``_GatheringFuture`` names only the error, its traceback names orbax). Those are dropped, since the
    failure is reported in one line where the save is awaited; the same error from other code is logged."""
    import asyncio

    from jaxseq.train.checkpoint import _quiet_orbax_errors

    _quiet_orbax_errors()
    source = os.path.join(os.sep, "site-packages", writer, "checkpoint", "serialization.py")
    namespace: dict = {}
    code = "async def write():\n    raise ValueError('Failed to write: File too large')\n"
    exec(compile(code, source, "exec"), namespace)

    async def save():
        gathered = asyncio.gather(namespace["write"]())
        await asyncio.sleep(0.01)
        assert gathered.done()
        del gathered  # never retrieved: asyncio logs it now

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(save())
    logged = [r for r in caplog.records if "exception was never retrieved" in r.getMessage()]
    assert len(logged) == (writer == "other"), [r.getMessage() for r in logged]
