"""``--compile_topology``: each training script compiles the exact train step of its run for a TPU slice with
real libtpu on this CPU, from config.json alone, prints a plan and writes plan.json; a run that cannot fit
ends in one line naming what it needs, of how much, and what to change."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import transformers
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq import partition
from jaxseq.mesh import make_mesh
from jaxseq.models.hub import abstract_model
from tests.conftest import shared_asset

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {
    "topology", "accelerator", "devices", "mesh", "hbm_bytes_per_device", "bytes_per_device", "fits",
    "model_flops_per_step", "compiled_flops_per_device", "estimated_step_seconds", "estimated_mfu",
    "estimate_method", "attention_kernel", "compile_seconds", "jax_version", "libtpu_version", "layers", "inputs",
    "peak_buffers",
}  # fmt: skip

if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("libtpu is missing under CI: install jaxseq[tpu]", pytrace=False)
    pytestmark = pytest.mark.skip(reason="libtpu is not installed (pip install 'jaxseq[tpu]')")


T5_TINY = "num_layers=2,num_decoder_layers=2,d_model=64,d_ff=128,num_heads=2,d_kv=32,vocab_size=512"


def plan(script: str, output_dir: Path, *args) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("XLA_FLAGS", None)  # the plan's devices are the topology's, not this machine's
    cmd = [sys.executable, str(ROOT / "scripts" / script), "--output_dir", str(output_dir), *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    path = output_dir / "plan.json"
    return result, json.loads(path.read_text()) if path.is_file() else None


BUDGETS = Path(__file__).with_name("plan_budgets.json")
GROWTH = 1.05  # a plan may need at most 5% more memory or estimated step time than its recorded budget


def check_budget(name: str, plan: dict) -> None:
    """The plan's memory per device and estimated step time against their budgets in tests/plan_budgets.json:
    a change (or a JAX or libtpu upgrade) that grows either more than 5% fails with the numbers. With
    JAXSEQ_RECORD_PLAN_BUDGETS=1 the plan's figures are recorded instead (commit the file)."""
    budgets = json.loads(BUDGETS.read_text()) if BUDGETS.is_file() else {}
    figures = {
        "total_bytes": plan["bytes_per_device"]["total"],
        "estimated_step_seconds": plan["estimated_step_seconds"],
        "jax": plan["jax_version"],
        "libtpu": plan["libtpu_version"],
    }
    if os.environ.get("JAXSEQ_RECORD_PLAN_BUDGETS") == "1":
        BUDGETS.write_text(json.dumps({**budgets, name: figures}, indent=2, sort_keys=True) + "\n")
        return
    assert name in budgets, f"no budget for plan {name!r}: record it with JAXSEQ_RECORD_PLAN_BUDGETS=1"
    budget = budgets[name]
    for key in ("total_bytes", "estimated_step_seconds"):
        assert figures[key] <= budget[key] * GROWTH, (
            f"plan {name}: {key} grew from {budget[key]:.6g} (jax {budget['jax']}, libtpu {budget['libtpu']}) to "
            f"{figures[key]:.6g} (jax {figures['jax']}, libtpu {figures['libtpu']}), "
            f"{figures[key] / budget[key] - 1:+.1%}: find what grew, or record the new figures if it is meant"
        )


def check_fields(plan: dict, accelerator: str, devices: int) -> None:
    assert set(plan) == FIELDS
    assert plan["accelerator"] == accelerator and plan["devices"] == devices
    memory = plan["bytes_per_device"]
    assert set(memory) == {"parameters", "optimizer_state", "batch", "temporaries", "total"}
    parts = memory["parameters"] + memory["optimizer_state"] + memory["batch"] + memory["temporaries"]
    assert memory["total"] == parts and memory["total"] > 0
    assert plan["hbm_bytes_per_device"] == int(15.75 * 2**30)
    assert plan["jax_version"] and plan["libtpu_version"]
    assert plan["attention_kernel"] in ("splash", "cudnn", "xla")


@pytest.mark.parametrize(("remat", "scan", "layers"), [("none", "auto", "unrolled"), ("full", "auto", "scanned")])
def test_clm_plan_on_v5e_8(tmp_path, remat, scan, layers):
    """The plan compiles the run's step, its blocks scanned as the run's would be (--scan_layers), with the
    same parameter and optimizer bytes per device either way. (No attention dropout: at this tiny shape, XLA's
    attention dropout under remat, scanned or not, overflows the stack of libtpu 0.0.42.1's compiler.)"""
    n_layer, n_embd, vocab = 2, 128, 1024
    result, found = plan(
        "pretrain_clm.py", tmp_path,
        "--model_type", "gpt2",
        "--config_overrides", f"n_layer={n_layer},n_embd={n_embd},n_head=4,vocab_size={vocab},attn_pdrop=0",
        "--block_size", 256, "--per_device_train_batch_size", 2, "--mesh", "dp=2,fsdp=4", "--dtype", "bfloat16",
        "--remat", remat, "--scan_layers", scan, "--compile_topology", "v5e-8",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    plan_ = found
    check_fields(plan_, "v5e-8", 8)
    assert plan_["layers"] == layers and re.search(rf"^  layers +{layers}$", result.stdout, re.M)
    assert plan_["fits"] and plan_["mesh"] == {"dp": 2, "fsdp": 4, "mp": 1}
    assert "plan for v5e-8" in result.stdout and "fits" in result.stdout
    # float32 master weights, each device holding its shard under GPT-2's rules on this mesh (here, on CPU
    # devices); AdamW's two moments twice that, plus its step counter
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab)
    state = nnx.state(abstract_model(config, "causal-lm"), nnx.Param)
    mesh = make_mesh("dp=2,fsdp=4")
    specs = partition.match_partition_rules(partition.get_partition_rules("gpt2"), state)
    shards = [
        NamedSharding(mesh, s).shard_shape(x.shape)
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
    ]
    params = sum(math.prod(shape) for shape in shards)
    assert plan_["bytes_per_device"]["parameters"] == params * 4
    assert plan_["bytes_per_device"]["optimizer_state"] == pytest.approx(2 * params * 4, abs=64)
    assert plan_["bytes_per_device"]["batch"] == 2 * 256 * 2  # uint16 tokens of this device's rows, as the run feeds
    # at the peak every weight and moment is live, named by its path in the run's train state
    peak = plan_["peak_buffers"]
    assert peak["by_kind"]["parameters"] == params * 4
    assert peak["by_kind"]["optimizer state"] == pytest.approx(plan_["bytes_per_device"]["optimizer_state"], abs=64)
    assert any(b["holds"].startswith("params transformer/") for b in peak["largest"])
    assert re.search(r"^  at the peak +[\d.]+ GiB live: ", result.stdout, re.M)
    assert plan_["model_flops_per_step"] > 6 * params * 4 * 16 * 256 * 0.5
    assert plan_["estimated_step_seconds"] > 0 and 0 < plan_["estimated_mfu"] <= 1
    assert plan_["compiled_flops_per_device"] > 0 and plan_["compile_seconds"] > 0
    check_budget(f"clm-gpt2-v5e-8-remat-{remat}-{layers}", plan_)


def test_glue_and_seq2seq_plans(tmp_path):
    minilm = shared_asset("models/all-MiniLM-L6-v2")
    result, plan_ = plan(
        "finetune_glue.py", tmp_path / "glue", "--model_name_or_path", minilm, "--task_name", "stsb",
        "--data_dir", shared_asset("data/glue"), "--max_train_samples", 256,
        "--max_seq_length", 64, "--per_device_train_batch_size", 4, "--compile_topology", "v4-8",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(plan_) == FIELDS | {"packing"} and plan_["accelerator"] == "v4-8" and plan_["devices"] == 4
    assert plan_["fits"]
    # the default GLUE run packs: the plan compiled its packed steps, segment ids and all
    inputs, packing = plan_["inputs"], plan_["packing"]
    rows = max(packing["row_counts"])
    assert packing["segment_ids"] == "attention_mask" and rows < 4 * 4  # fewer rows than examples
    for name in ("input_ids", "token_type_ids", "attention_mask", "position_ids"):
        assert inputs[name] == {"shape": [rows, 64], "dtype": "int32"}
    assert inputs["pool_index"] == {"shape": [16], "dtype": "int32"}
    assert inputs["labels"] == {"shape": [16], "dtype": "float32"}  # STS-B: a regression
    check_budget("glue-minilm-stsb-packed-v4-8", plan_)
    result, plan_ = plan(
        "finetune_seq2seq.py", tmp_path / "t5", "--model_type", "t5",
        "--config_overrides", T5_TINY,
        "--max_source_length", 64, "--max_target_length", 16, "--per_device_train_batch_size", 2,
        "--optimizer", "adafactor", "--compile_topology", "v5e:2x4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    check_fields(plan_, "v5e-8", 8)
    assert plan_["fits"]
    check_budget("seq2seq-t5-tiny-adafactor-v5e-8", plan_)


def test_a_run_that_cannot_fit_refuses_in_one_line(tmp_path):
    result, plan_ = plan(
        "pretrain_clm.py", tmp_path, "--model_type", "gpt2",
        "--config_overrides", "n_layer=2,n_embd=256,n_head=4", "--block_size", 1024,
        "--per_device_train_batch_size", 512, "--compile_topology", "v5e-4",
    )  # fmt: skip
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: needs "), result.stderr[-2000:]
    # what fills the chip, from the buffers live at the peak: activations, so --remat full comes first
    assert re.search(r"GiB per chip of 15\.75 GiB on v5e-4 \(at the peak: forward activations [\d.]+ GiB, ", lines[0])
    assert "; try: --remat full, " in lines[0]
    assert "Traceback" not in result.stderr
    assert plan_ is not None and not plan_["fits"] and plan_["devices"] == 4


def test_an_unknown_topology_is_one_line(tmp_path):
    result, _ = plan("pretrain_clm.py", tmp_path, "--model_type", "gpt2", "--compile_topology", "v9x-8")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "unknown TPU topology 'v9x-8'" in result.stderr


NO_DROPOUT = "attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"


def test_splash_attention_is_in_the_compiled_plan_and_cuts_temporaries(tmp_path):
    """GPT-2 (no dropout, 1024 tokens, 8 rows per chip, v5e-8) with ``--attention splash`` and ``xla``: each plan
    records the kernel found in its compiled program, and splash never stores the [batch, heads, q, kv] scores
    (measured here: 115 vs 328 MB of temporaries per chip; GPT-2 small: 2.56 vs 6.40 GiB)."""
    temporaries = {}
    for kernel in ("splash", "xla"):
        result, plan_ = plan(
            "pretrain_clm.py", tmp_path / kernel, "--model_type", "gpt2",
            "--config_overrides", f"n_layer=2,n_embd=256,n_head=4,vocab_size=1024,{NO_DROPOUT}",
            "--block_size", 1024, "--per_device_train_batch_size", 8, "--mesh", "dp=8", "--dtype", "bfloat16",
            "--attention", kernel, "--compile_topology", "v5e-8",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert plan_["attention_kernel"] == kernel
        temporaries[kernel] = plan_["bytes_per_device"]["temporaries"]
    assert temporaries["splash"] <= 0.8 * temporaries["xla"], temporaries


def test_bert_plan_chooses_splash_by_itself_and_refuses_what_splash_cannot_do(tmp_path):
    minilm = shared_asset("models/all-MiniLM-L6-v2")
    args = ["--model_name_or_path", minilm, "--task_name", "mrpc", "--max_seq_length", 256, "--max_train_samples", 128]
    args += ["--data_dir", shared_asset("data/glue")]
    args += ["--per_device_train_batch_size", 4, "--compile_topology", "v5e-8"]
    result, plan_ = plan(
        "finetune_glue.py", tmp_path / "auto", *args, "--config_overrides", "attention_probs_dropout_prob=0"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert plan_["attention_kernel"] == "splash"  # auto, on a TPU, for padded bidirectional rows
    result, plan_ = plan("finetune_glue.py", tmp_path / "dropout", *args, "--attention", "splash")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
    assert "--config_overrides attention_probs_dropout_prob=0" in lines[0] and plan_ is None


def test_a_packed_glue_plan_without_a_tokenizer_says_what_to_pass(tmp_path):
    """A default GLUE run packs, and its packed row counts come from the tokenized examples: a plan from a bare
    --model_type has no tokenizer to read them with, so it stops in one line instead of planning another step."""
    tiny = "num_hidden_layers=2,hidden_size=64,num_attention_heads=2,intermediate_size=128"
    args = ["--model_type", "bert", "--config_overrides", tiny, "--compile_topology", "v5e-8"]
    result, plan_ = plan("finetune_glue.py", tmp_path / "packed", *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
    assert "pass --tokenizer_name" in lines[0] and "--no_pack_sequences" in lines[0] and plan_ is None
    result, plan_ = plan("finetune_glue.py", tmp_path / "unpacked", *args, "--no_pack_sequences")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "packing" not in plan_ and plan_["inputs"]["input_ids"]["shape"] == [8 * 32, 128]


def test_grpo_plans_its_train_step_and_its_sampler(tmp_path):
    """A GRPO plan reads the prompts only for their length (the longest: 7 tokens of the letters' tokenizer; no
    weights): its train step takes --per_device_train_batch_size completions a device of 7 prompt + 16
    completion tokens with their advantages, completion mask and (--num_iterations 2) old log-probs, the KL's
    reference inside the step (--beta); the sampler's program is compiled too, all 4 prompts x 8 completions of
    a step at once (each prompt prefilled once; 4 prompts padded to a row a device) with the training state
    held meanwhile, under "sampler" in plan.json. Without prompts or
    --max_prompt_length it stops in one line."""
    from tests.tiny import LETTERS, letters_gpt2

    letters_gpt2(tmp_path / "model")
    prompts = [{"prompt": " ".join(LETTERS[: 3 + i % 5])} for i in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    common = [
        "--model_name_or_path", tmp_path / "model", "--num_generations", 8, "--max_completion_length", 16,
        "--per_device_train_batch_size", 4, "--mesh", "fsdp=8", "--compile_topology", "v5e-8",
    ]  # fmt: skip
    data, reused = ["--train_file", tmp_path / "prompts.jsonl"], ["--num_iterations", 2, "--beta", 0.04]
    result, plan_ = plan("grpo.py", tmp_path / "plan", *common, *data, *reused)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(plan_) == FIELDS | {"sampler"} and plan_["fits"]
    check_fields({k: v for k, v in plan_.items() if k != "sampler"}, "v5e-8", 8)
    rows = 4 * 8
    assert plan_["inputs"] == {
        "input_ids": {"shape": [rows, 7 + 16], "dtype": "int32"},
        "attention_mask": {"shape": [rows, 7 + 16], "dtype": "int32"},
        "completion_mask": {"shape": [rows, 16], "dtype": "int32"},
        "advantages": {"shape": [rows], "dtype": "float32"},
        "old_logps": {"shape": [rows, 16], "dtype": "float32"},
    }
    # a reference beside the trained weights (--beta): twice the parameters of a run without it
    result, plain = plan("grpo.py", tmp_path / "no-kl", *common, *data)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "old_logps" not in plain["inputs"]
    memory, sampler = plan_["bytes_per_device"], plan_["sampler"]
    assert memory["parameters"] > plain["bytes_per_device"]["parameters"]
    assert sampler["fits"] and sampler["inputs"] == {"input_ids": {"shape": [8, 32], "dtype": "int32"}}
    taken = sampler["bytes_per_device"]  # the same training state, and this device's rows of prompt tokens
    assert (taken["parameters"], taken["optimizer_state"]) == (memory["parameters"], memory["optimizer_state"])
    assert taken["batch"] == 2 * 1 * 32 * 4 and taken["total"] > taken["parameters"]
    assert "sampler: plan for v5e-8" in result.stdout and sampler["estimated_step_seconds"] is None

    result, found = plan("grpo.py", tmp_path / "no-prompts", *common)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and found is None, result.stderr[-2000:]
    assert "--max_prompt_length" in lines[0]
