"""Multi-host training with real processes: 2 processes on 127.0.0.1 with 4 virtual CPU devices each (gloo
collectives) train a tiny GPT-2 on a dp=4,mp=2 mesh and match 1 process with 8 devices: the same loss sequence
and final parameters. GLUE fine-tuning (packed: each process packs its own examples) through
scripts/finetune_glue.py, whose 2-process checkpoint then restores in a 1-process run; causal-LM pretraining
through scripts/pretrain_clm.py, each process tokenizing its share of the text. scripts/generate.py on 2
processes writes the completions of 1 process. GRPO on 2 processes, a prompt's group of completions spanning
both, logs 1 process's rewards and losses; so does on-policy distillation its losses."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from jaxseq.models import from_config, save_pretrained  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TIMEOUT = 300


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.pad_token = tokenizer.eos_token
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=64,
        vocab_size=50257,  # GPT-2's own: padded to 50304 rows, it splits over mp
        pad_token_id=tokenizer.pad_token_id,
        num_labels=2,
    )
    out = tmp_path_factory.mktemp("tiny-gpt2")
    save_pretrained(from_config(config, "sequence-classification", seed=0), out, tokenizer=tokenizer)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, devices: int, output_dir: Path, cache: Path, process_flags=(), script="finetune_glue.py"):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "HF_HUB_OFFLINE": "1"}
    output = (
        ["--output_file", output_dir / "completions.jsonl"] if script == "generate.py" else ["--output_dir", output_dir]
    )
    cmd = [
        sys.executable,
        str(SCRIPTS / script),
        *map(str, args),
        *map(str, output),
        "--compilation_cache_dir",
        str(cache),
        *map(str, process_flags),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(processes) -> list[str]:
    """Wait for every process (killing all of them on timeout or on a failure) and return their output."""
    outputs = []
    try:
        for p in processes:
            out, _ = p.communicate(timeout=TIMEOUT)
            outputs.append(out)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def one_and_two(args, tmp_path: Path, script="finetune_glue.py") -> tuple[Path, Path, list[str]]:
    """Run ``args`` in 1 process with 8 devices, then in 2 processes with 4 each: both output dirs and the
    2 processes' output."""
    cache = tmp_path / "xla"
    one, two = tmp_path / "one", tmp_path / "two"
    finish([launch(args, 8, one, cache, script=script)])
    port = free_port()
    outputs = finish(
        [
            launch(
                args,
                4,
                two,
                cache,
                ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", 2, "--process_id", rank],
                script=script,
            )
            for rank in range(2)
        ]
    )
    return one, two, outputs


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "train/loss" in r]


def params(output_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(output_dir / "model.safetensors")


@pytest.mark.parametrize("packing", ["--pack_sequences", "--no_pack_sequences"])  # unpacked: eval in length buckets
def test_two_processes_match_one_and_their_checkpoint_restores_in_one(tmp_path, tiny_gpt2, packing):
    args = [
        "--model_name_or_path",
        tiny_gpt2,
        "--data_dir",
        shared_asset("data/glue"),
        "--task_name",
        "sst2",
        "--max_train_samples",
        64,
        "--max_eval_samples",
        24,
        "--max_seq_length",
        32 if packing == "--pack_sequences" else 64,  # unpacked: eval batches cut to the widest they need
        "--mesh",
        "dp=4,mp=2",
        "--per_device_train_batch_size",
        2,
        "--per_device_eval_batch_size",
        2,
        "--max_steps",
        4,
        "--logging_steps",
        1,
        "--save_steps",
        2,
        "--learning_rate",
        1e-4,
        "--seed",
        0,
        packing,
    ]
    one, two, outputs = one_and_two(args, tmp_path)
    assert "8 devices" in outputs[0]  # process 0 reports the global device count
    # each process tokenized only the examples it took: half of each of the 4 global batches of 8
    assert "training examples tokenized by each process: [16, 16] of 64" in outputs[0]

    a, b = losses(one), losses(two)
    assert len(a) == 4 and all(np.isfinite(a)) and len(set(a)) == 4
    np.testing.assert_allclose(b, a, atol=1e-5)
    pa, pb = params(one), params(two)
    assert pa.keys() == pb.keys()
    assert max(float(np.abs(pa[k] - pb[k]).max()) for k in pa) <= 1e-5
    assert json.loads((two / "eval_results.json").read_text())["eval_accuracy"] == pytest.approx(
        json.loads((one / "eval_results.json").read_text())["eval_accuracy"]
    )
    assert sorted(p.name for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]

    # the 2-process checkpoint restores in 1 process: nothing left to train, the same parameters come out
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    (resumed / "model.safetensors").unlink()
    out = finish([launch(args, 8, resumed, tmp_path / "xla")])[0]
    assert "(step 4)" in out
    pr = params(resumed)
    assert all(np.array_equal(pr[k], pb[k]) for k in pb)


@pytest.mark.parametrize("streaming", [False, True])
def test_two_processes_pretrain_like_one_each_tokenizing_a_share_of_the_text(tmp_path, tiny_gpt2, streaming):
    text = shared_asset("data/text/tinyshakespeare.txt")
    args = [
        "--config_name",
        tiny_gpt2,
        "--tokenizer_name",
        tiny_gpt2,
        "--train_file",
        text,
        "--block_size",
        32,
        "--max_eval_samples",
        16,
        "--per_device_train_batch_size",
        2,
        "--per_device_eval_batch_size",
        2,
        "--max_steps",
        3,
        "--logging_steps",
        1,
        "--eval_steps",
        3,
        "--learning_rate",
        3e-3,
        # not 1e-8: Adam's step is O(lr) however small the gradient, so a near-zero one rounded differently by
        # the process layout moves apart (at 1e-8 one embedding element of 3.2M ended 4.6e-5 apart while the
        # losses agreed to 1e-6 and every other parameter to 1.3e-6)
        "--adam_epsilon",
        1e-6,
        "--seed",
        0,
        "--mesh",
        "dp=4,mp=2",
        "--data_cache_dir",
        "",
        "--peak_flops",
        1e11,
        "--streaming",
        streaming,
    ]
    one, two, _ = one_and_two(args, tmp_path, script="pretrain_clm.py")
    a, b = losses(one), losses(two)
    assert len(a) == 3 and len(set(a)) == 3
    np.testing.assert_allclose(b, a, atol=1e-5)  # the exchanged token stream is the one-process stream
    pa, pb = params(one), params(two)
    assert max(float(np.abs(pa[k] - pb[k]).max()) for k in pa) <= 1e-5


def test_each_process_tokenizes_a_contiguous_share(monkeypatch):
    import jax

    from jaxseq.data import text

    parts = [(f"piece {i} " * (1 + i % 7), i % 3 == 0) for i in range(50)]
    shares = []
    for rank in range(3):
        monkeypatch.setattr(jax, "process_count", lambda: 3)
        monkeypatch.setattr(jax, "process_index", lambda rank=rank: rank)
        shares.append(text._my_share(parts))
    assert [p for share in shares for p in share] == parts  # in order, each piece exactly once
    sizes = [sum(len(p) for p, _ in share) for share in shares]
    assert max(sizes) - min(sizes) <= max(len(p) for p, _ in parts)  # balanced by characters


def test_two_processes_generate_what_one_does(tmp_path, tiny_gpt2):
    import transformers

    lm = tmp_path / "lm"  # the same tiny GPT-2 with its LM head (tied to the embeddings)
    config = transformers.AutoConfig.from_pretrained(tiny_gpt2)
    save_pretrained(
        from_config(config, "causal-lm", seed=0), lm, tokenizer=transformers.AutoTokenizer.from_pretrained(tiny_gpt2)
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The king said\nTo be, or not\nO Romeo\nWhat light through yonder window\nNow is the\n")
    args = [
        "--model_name_or_path",
        lm,
        "--prompt_file",
        prompts,
        "--max_new_tokens",
        8,
        "--batch_size",
        8,
        "--mesh",
        "dp=4,mp=2",
        "--do_sample",
        "--top_k",
        20,
        "--seed",
        3,
    ]
    one, two, _ = one_and_two(args, tmp_path, script="generate.py")
    records = (one / "completions.jsonl").read_text().splitlines()
    assert len(records) == 5
    assert (two / "completions.jsonl").read_text().splitlines() == records


GRPO_REWARD = """
import os

def fraction_of_a(prompts, completions, completion_ids, **kwargs):
    with open(os.path.join({log!r}, f"{{os.getpid()}}.txt"), "a") as f:
        f.write(f"{{len(completion_ids)}}\\n")
    return [sum(t == {a} for t in ids) / max(len(ids), 1) for ids in completion_ids]
"""


def test_two_processes_train_grpo_as_one_with_groups_across_them(tmp_path):
    """GRPO as 2 processes x 4 devices and as 1 x 8 on a dp=8 mesh: 3 completions a device, groups of 8, so
    the second prompt's group spans both processes. Each process scores only its own 12 completions of the
    step's 24; the rewards are gathered before the groups are normalised; both layouts sample the same
    completions, so every step's reward and loss (two updates per sampled batch, a KL to the reference) match."""
    from tests.tiny import LETTERS, letters_gpt2

    vocab = letters_gpt2(tmp_path / "model")
    logs = {name: tmp_path / f"calls-{name}" for name in ("one", "two")}
    rng = np.random.default_rng(0)
    prompts = [{"prompt": " ".join(rng.choice(LETTERS, 1 + i % 4))} for i in range(16)]  # lengths 1 to 4
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    args = lambda name: [
        "--model_name_or_path", tmp_path / "model", "--train_file", tmp_path / "prompts.jsonl",
        "--reward_funcs", f"{tmp_path / f'rewards_{name}.py'}:fraction_of_a", "--mesh", "dp=8",
        "--num_generations", 8, "--per_device_train_batch_size", 3, "--num_iterations", 2, "--beta", 0.04,
        "--max_completion_length", 6, "--max_steps", 8, "--logging_steps", 1, "--learning_rate", 3e-3,
        "--save_strategy", "no", "--report_to", "none", "--seed", 0,
    ]  # fmt: skip
    for name, log in logs.items():
        log.mkdir()
        (tmp_path / f"rewards_{name}.py").write_text(GRPO_REWARD.format(log=str(log), a=vocab["a"]))
    cache, one, two = tmp_path / "xla", tmp_path / "one", tmp_path / "two"
    finish([launch(args("one"), 8, one, cache, script="grpo.py")])
    port = free_port()
    flags = lambda rank: ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", 2, "--process_id", rank]
    finish([launch(args("two"), 4, two, cache, flags(rank), script="grpo.py") for rank in range(2)])

    calls = {name: sorted(p.read_text().split() for p in log.iterdir()) for name, log in logs.items()}
    assert calls["one"] == [["24"] * 4]  # one process scores all 24 completions of each of the 4 sampled batches
    assert calls["two"] == [["12"] * 4] * 2  # each of two scores its own 12
    logged = {}
    for name, out in (("one", one), ("two", two)):
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if "train/reward" in r]
        assert [r["step"] for r in train] == list(range(1, 9)), name
        logged[name] = {k: np.array([r[f"train/{k}"] for r in train]) for k in ("reward", "loss", "kl")}
    a, b = logged["one"], logged["two"]
    assert np.array_equal(a["reward"][::2], a["reward"][1::2])  # a sampled batch serves two steps
    assert len(set(a["reward"].tolist())) > 1 and len(set(a["loss"].tolist())) == 8  # 4 batches, 8 updates
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-5, err_msg=k)


DISTILL_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %} <eos>{% endif %} {% endfor %}"
)


def test_two_processes_distill_on_policy_as_one(tmp_path):
    """``jaxseq distill`` at --lmbda 0.5 as 2 processes x 4 devices and as 1 x 8 on a dp=4,mp=2 mesh, two
    micro-batches a step: each process holds 4 rows of each micro-batch of 8; an on-policy step gathers every
    process's prompts, samples every row in one program and places each process's own, so both layouts train
    on the same completions and log the same loss every step, on-policy steps and the data's alike."""
    import shutil

    import torch

    from jaxseq.train.distill import DistillConfig, OnPolicy
    from tests.tiny import LETTERS, letters_gpt2

    letters_gpt2(tmp_path / "student")
    teacher = tmp_path / "teacher"
    config = transformers.GPT2Config.from_pretrained(tmp_path / "student")
    config.update({"n_layer": 3, "n_embd": 48, "initializer_range": 0.3})  # a teacher far from uniform
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(config).save_pretrained(teacher)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tmp_path / "student" / name).exists():
            shutil.copy(tmp_path / "student" / name, teacher / name)
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(rng.choice(LETTERS, n))
    records = [{"prompt": words(1 + i % 4), "completion": words(1 + i % 3)} for i in range(16)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "template.jinja").write_text(DISTILL_TEMPLATE)
    seed, steps = 0, 6
    on_policy = [OnPolicy(DistillConfig(lmbda=0.5), 4, [0], 1, seed).on_policy(s) for s in range(steps)]
    assert 0 < sum(on_policy) < steps  # the run has both kinds of steps
    args = [
        "--model_name_or_path", tmp_path / "student", "--teacher_model_name_or_path", teacher,
        "--train_file", tmp_path / "rows.jsonl", "--chat_template", tmp_path / "template.jinja",
        "--lmbda", 0.5, "--max_new_tokens", 4, "--mesh", "dp=4,mp=2", "--per_device_train_batch_size", 2,
        "--gradient_accumulation_steps", 2, "--max_steps", steps, "--logging_steps", 1, "--learning_rate", 3e-3,
        "--save_strategy", "no", "--report_to", "none", "--seed", seed,
    ]  # fmt: skip
    one, two, _ = one_and_two(args, tmp_path, script="distill.py")
    a, b = losses(one), losses(two)
    assert len(a) == steps and min(a) > 0.05 and len(set(a)) == steps, a
    np.testing.assert_allclose(b, a, atol=1e-5)
