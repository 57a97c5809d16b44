"""``--plan_search``: the layouts of one global batch, pruned by an analytic model, compiled with real libtpu
(no TPU), ranked, and the fastest that fits written as a ``--config`` that replans to the same plan."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers
import yaml

from jaxseq.errors import JaxseqError
from jaxseq.models.registry import model_flops
from jaxseq.plan import search as plan_search
from jaxseq.plan import topology
from jaxseq.plan.search import Candidate, Shape, candidates, estimate

ROOT = Path(__file__).resolve().parents[1]
GPT2_SMALL = Shape(trained=124_000_000, frozen=0, layers=12, width=768, heads=12, vocab=50257, seq_len=1024,
                   global_rows=64,
                   step_flops=model_flops(transformers.GPT2Config(), "causal-lm", 64, 1024))  # fmt: skip


def test_every_layout_keeps_the_global_batch():
    layouts = candidates(GPT2_SMALL, 8, chunked=True)
    meshes = {c.mesh for c in layouts}
    assert {(1, 8, 1), (8, 1, 1), (2, 2, 2), (1, 2, 4)} <= meshes
    assert not any(mp == 8 for _, _, mp in meshes)  # 12 heads do not split 8 ways
    for c in layouts:
        dp, fsdp, mp = c.mesh
        assert dp * fsdp * mp == 8
        assert c.micro_batch * c.accumulation * dp * fsdp == 64
    assert {c.remat for c in layouts} == {"none", "dots", "full"}
    assert {c.loss_chunk_tokens for c in layouts} == {-1, 0}
    assert {c.loss_chunk_tokens for c in candidates(GPT2_SMALL, 8, chunked=False)} == {None}


def test_the_memory_model_orders_what_each_choice_costs():
    v5e = topology("v5e-8")

    def memory(**changes):
        base = dict(mesh=(1, 8, 1), remat="none", micro_batch=8, accumulation=1, attention="auto", loss_chunk_tokens=0)
        return estimate(Candidate(**{**base, **changes}), GPT2_SMALL, v5e)[0]

    assert memory(remat="full") < memory(remat="dots") < memory()
    assert memory(micro_batch=2, accumulation=4) < memory()
    assert memory(mesh=(8, 1, 1)) > memory()  # replicated weights and moments
    assert memory(loss_chunk_tokens=-1) < memory()
    assert memory(attention="xla") > memory()  # the written-out scores


def test_the_search_flags_are_not_passed_to_candidates():
    argv = ["--model_type", "gpt2", "--plan_search", "--output_dir", "out", "--plan_search_compiles", "3"]
    argv += ["--plan_search_timeout", "60"]
    argv += ["--compile_topology", "v5e-8", "--plan_search", "true"]
    assert plan_search._strip(argv) == ["--model_type", "gpt2", "--compile_topology", "v5e-8"]


def test_a_search_without_a_slice_is_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pretrain_clm.py"), "--model_type", "gpt2", "--plan_search",
         "--output_dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 1 and not list(tmp_path.iterdir())
    assert result.stderr.strip().splitlines() == [
        "error: --plan_search searches the plans of a TPU slice: add --compile_topology (e.g. v5e-8)"
    ]


def test_a_search_whose_compiles_all_time_out_is_one_line(tmp_path):
    """--plan_search_timeout: each layout's compile is stopped after that many seconds; when none finishes, the
    search ends in one line saying so, and writes no plan."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pretrain_clm.py"), "--model_type", "gpt2", "--config_overrides",
         "n_layer=2,n_embd=64,n_head=4,vocab_size=256", "--block_size", "64", "--compile_topology", "v5e-8",
         "--plan_search", "--plan_search_compiles", "2", "--plan_search_timeout", "0.01",
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: none of the ") and "timed out after 0.01 s" in line, line
    assert not (tmp_path / "out" / "best_plan.yaml").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None and os.environ.get("CI") != "true",
    reason="libtpu is not installed (pip install 'jaxseq[tpu]')",
)
def test_search_writes_the_fastest_fitting_layout_and_it_replans_the_same(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("XLA_FLAGS", None)
    script = [sys.executable, str(ROOT / "scripts" / "pretrain_clm.py")]
    run = [
        "--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=128,n_head=4,vocab_size=1024,attn_pdrop=0",
        "--block_size", "256", "--per_device_train_batch_size", "8", "--dtype", "bfloat16",
        "--compile_topology", "v5e-8",
    ]  # fmt: skip
    searched = subprocess.run(
        [*script, *run, "--plan_search", "--plan_search_compiles", "3", "--output_dir", str(tmp_path / "search")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert searched.returncode == 0, searched.stderr[-3000:]
    assert "plan search on v5e-8" in searched.stdout and "fastest that fits:" in searched.stdout
    table = searched.stdout[searched.stdout.index("rank") :]
    assert sum(line.lstrip().startswith(("1 ", "2 ", "3 ", "- ")) for line in table.splitlines()) == 3
    best = yaml.safe_load((tmp_path / "search" / "best_plan.yaml").read_text())
    trainer, runtime = best["TrainerConfig"], best["RuntimeConfig"]
    shards = {k: int(v) for k, v in (p.split("=") for p in runtime["mesh"].split(","))}
    assert (
        trainer["per_device_train_batch_size"]
        * trainer["gradient_accumulation_steps"]
        * shards["dp"]
        * (shards["fsdp"])
        == 8 * 8
    )  # the global batch asked for: 8 rows on each of 8 data-parallel devices
    assert any(section.get("model_type") == "gpt2" for section in best.values())  # the whole run, not a diff
    found = json.loads((tmp_path / "search" / "plan.json").read_text())
    assert found["fits"]
    # the YAML is a --config for the same command: planned again, it is the same program
    replanned = subprocess.run(
        [*script, "--config", str(tmp_path / "search" / "best_plan.yaml"), "--compile_topology", "v5e-8",
         "--output_dir", str(tmp_path / "again")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert replanned.returncode == 0, replanned.stderr[-3000:]
    again = json.loads((tmp_path / "again" / "plan.json").read_text())
    assert again["fits"] and again["bytes_per_device"] == found["bytes_per_device"]
    assert again["estimated_step_seconds"] == found["estimated_step_seconds"]


def test_experts_add_ep_layouts_that_split_them():
    """A mixture of experts (8 experts, top 2): layouts with ep dividing the experts and the data shards, whose
    batch is split over ep too; ep holds less of the experts per chip, and the step time is the family's FLOP
    count (Mixtral's: only the routed experts). A dense model gets no ep layout."""
    mixtral = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_local_experts=8)
    flops = lambda top: model_flops(
        transformers.MixtralConfig(**mixtral, num_experts_per_tok=top), "causal-lm", 64, 1024
    )
    moe = dataclasses.replace(GPT2_SMALL, trained=1_000_000_000, expert_params=900_000_000, experts=8,
                              step_flops=flops(2))  # fmt: skip
    layouts = candidates(moe, 8, chunked=False)
    assert {c.ep for c in layouts} == {1, 2, 4, 8}
    for c in layouts:
        dp, fsdp, mp = c.mesh
        assert dp * fsdp * c.ep * mp == 8 and c.micro_batch * c.accumulation * dp * fsdp * c.ep == 64
    assert Candidate((2, 1, 1), "full", 8, 1, "auto", None, ep=4).mesh_spec == "dp=2,fsdp=1,ep=4,mp=1"
    assert {c.ep for c in candidates(GPT2_SMALL, 8, chunked=False)} == {1}
    v5e = topology("v5e-8")
    memory = lambda ep, dp: estimate(Candidate((dp, 1, 1), "full", 8, 1, "auto", None, ep=ep), moe, v5e)[0]
    assert memory(ep=8, dp=1) < memory(ep=1, dp=8)  # the experts split 8 ways, not replicated
    every_expert = dataclasses.replace(moe, step_flops=flops(8))
    c = Candidate((1, 8, 1), "full", 8, 1, "auto", None)
    assert estimate(c, moe, v5e)[1] < estimate(c, every_expert, v5e)[1]  # a token meets 2 of 8 experts


FAKE_JOB = """
import json, os, sys, time
from pathlib import Path


def main(argv):
    flags = dict(zip(argv[::2], argv[1::2]))
    if flags["--attention"] == "auto":
        time.sleep(600)  # a compile that hangs
    out = Path(flags["--output_dir"])
    out.mkdir(parents=True)
    plan = {"fits": True, "bytes_per_device": {"total": 2**30}, "estimated_mfu": 0.5,
            "estimated_step_seconds": 1.0 / int(flags["--per_device_train_batch_size"]),
            "libtpu_load": os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD")}
    (out / "plan.json").write_text(json.dumps(plan))
    return 0
"""


def test_a_hung_compile_is_ranked_as_timed_out_and_the_search_goes_on(tmp_path, monkeypatch):
    """Candidates whose plan process hangs are stopped after the timeout and listed as timed out; the others are
    ranked and the fastest of them written, each planned with libtpu allowed beside the search's own."""
    from jaxseq.plan import CHIPS, Topology
    from jaxseq.train.trainer_config import TrainerConfig

    (tmp_path / "fake_plan_job.py").write_text(FAKE_JOB)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("ALLOW_MULTIPLE_LIBTPU_LOAD", raising=False)
    topo = Topology("v5e-8", "v5e:2x4", 8, tuple(range(8)), CHIPS["v5e"])
    shape = dataclasses.replace(GPT2_SMALL, seq_len=128)
    said = []
    started = time.monotonic()
    plan = plan_search.search("fake_plan_job", [], {"trainer": TrainerConfig()}, shape, topo, tmp_path / "out",
                              chunked=False, compiles=4, timeout=2, say=said.append)  # fmt: skip
    assert time.monotonic() - started < 120
    table = said[1].splitlines()[1:-1]
    timed_out = [line for line in table if line.endswith("compile timed out after 2 s")]
    ranked = [line for line in table if line.endswith("fits")]
    assert len(timed_out) == 2 and len(ranked) == 2, said[1]
    assert all(line.split()[0] == "-" for line in timed_out) and [line.split()[0] for line in ranked] == ["1", "2"]
    assert plan["libtpu_load"] == "1" and "ALLOW_MULTIPLE_LIBTPU_LOAD" not in os.environ
    best = yaml.safe_load((tmp_path / "out" / "best_plan.yaml").read_text())["TrainerConfig"]
    assert plan["estimated_step_seconds"] == 1 / best["per_device_train_batch_size"]
    assert json.loads((tmp_path / "out" / "plan.json").read_text()) == plan
    (tmp_path / "fake_plan_job.py").write_text(FAKE_JOB.replace('== "auto"', "is not None"))  # every one hangs
    refused = "none of the 4 layouts compiled for v5e-8 (the first: compile timed out after 1 s)"
    with pytest.raises(JaxseqError, match=re.escape(refused)):
        plan_search.search("fake_plan_job", [], {}, shape, topo, tmp_path / "out2", chunked=False, compiles=2,
                           timeout=1, say=said.append)  # fmt: skip
