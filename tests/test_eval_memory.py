"""Bounded memory in evaluation: the causal-LM eval (loss, perplexity) of an 8-device batch with GPT-2's
vocabulary never holds the batch's float32 logits, neither in the compiled program nor in the host's RSS.

Arithmetic shared by the tests (GPT-2 of width 32, one head, vocab 50257, blocks of 1024 tokens, the
default per-device eval batch 8, 8 devices: 64 rows):

- the whole batch's logits: 8 rows x 1024 x 50257 x 4 bytes = 1.65 GB per device, 13.2 GB for 8 devices;
- one loss chunk (the default 512 tokens per device): 8 rows x 64 positions x 50257 x 4 bytes = 103 MB per
  device, 0.82 GB for 8;
- one layer's attention scores: 8 rows x 1 head x 1024 x 1024 x 4 bytes = 34 MB per device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")

from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.hub import abstract_model  # noqa: E402
from jaxseq.train.feeding import abstract_batch  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from jaxseq.train.optim import OptimizerConfig  # noqa: E402
from jaxseq.train.step import TrainProgram  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, BLOCK, ROWS_PER_DEVICE, DEVICES = 50257, 1024, 8, 8
FULL_LOGITS = ROWS_PER_DEVICE * BLOCK * VOCAB * 4  # per device
CHUNK_LOGITS = ROWS_PER_DEVICE * 64 * VOCAB * 4  # per device, at the default 512 tokens
SCORES = ROWS_PER_DEVICE * BLOCK * BLOCK * 4  # one layer's attention scores per device


def config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=1, vocab_size=VOCAB, n_positions=BLOCK)


@pytest.mark.parametrize("mesh_spec", ["dp=8", "dp=2,fsdp=4"])
def test_compiled_eval_step_never_holds_the_batch_logits(mesh_spec):
    """The Trainer's eval step (``TrainProgram.eval_step``) compiled for 8 devices: its temporaries per device
    stay within two chunks' logits and four layers' worth of attention scores (103 x 2 + 34 x 4 = 342 MB;
    measured 207 MB: a chunk of logits and its copy with the vocabulary's padding masked), far below the
    1.65 GB of the batch's logits, which the unchunked loss needs (measured: 3.3 GB, the padded logits and
    their slice to the real vocabulary; the check that this test can fail). The train step of the same batch
    stays below them too (measured: 825 MB)."""
    mesh = make_mesh(mesh_spec)
    batch = abstract_batch(mesh, DEVICES * ROWS_PER_DEVICE, {"input_ids": ((BLOCK,), np.uint16)})
    temps = {}
    execution = decide_execution(config(), "causal-lm", mesh=mesh)  # as a run decides it
    for chunk_tokens in (512, None):
        program = TrainProgram(
            abstract_model(config(), "causal-lm", execution=execution),
            CausalLM(chunk_tokens),
            mesh,
            OptimizerConfig(),
            total_steps=1,
            seed=0,
        )
        if chunk_tokens:
            assert program.task.batch_shards == DEVICES  # dp x fsdp: the rows each device holds
            assert program.task.chunk_positions(DEVICES * ROWS_PER_DEVICE, BLOCK) == 64
        compiled = program.eval_step.lower(program.abstract_state.params, None, batch).compile()
        temps[chunk_tokens] = compiled.memory_analysis().temp_size_in_bytes
        if chunk_tokens:
            step = program.step.lower(program.abstract_state, None, batch).compile()
            train_temps = step.memory_analysis().temp_size_in_bytes
    print(f"eval temp bytes per device: {temps[512]:,} chunked, {temps[None]:,} unchunked; train {train_temps:,}")
    assert temps[512] <= 2 * CHUNK_LOGITS + 4 * SCORES < FULL_LOGITS / 4
    assert temps[None] >= FULL_LOGITS  # the unchunked loss holds them: what this test tells apart
    assert train_temps < FULL_LOGITS


def test_host_peak_rss_of_an_8_device_eval_is_bounded():
    """``bench/eval_memory.py`` in its own process (8 virtual CPU devices, the real GPT-2 tokenizer, one
    eval batch of 64 x 1024 tokens through ``Trainer.evaluate``): the evaluation raises the peak RSS (VmHWM:
    the process's own, not the parent's that ru_maxrss carries across exec) above the RSS before it by at most
    what 8 devices' temporaries can take,
    8 x 2 x (chunk logits 103 MB + 3 x 34 MB of attention scores) = 3.3 GB, plus 0.5 GB for compiling and
    the runtime: 3.8 GB, against the 13.2 GB that the batch's logits alone would take (measured: 1.5 GB
    added, a peak of 2.4 GB, in about 30 s)."""
    tokenizer = shared_asset("data/tokenizers/gpt2")
    text = shared_asset("data/text/tinyshakespeare.txt")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "XLA_FLAGS": ""}
    command = [
        sys.executable,
        str(ROOT / "bench" / "eval_memory.py"),
        "--tokenizer",
        str(tokenizer),
        "--text",
        str(text),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    print(record)
    assert record["vocab_size"] == VOCAB and record["devices"] == DEVICES and record["rows"] == DEVICES * 8
    assert record["chunk_logits_bytes_per_device"] == CHUNK_LOGITS
    bound_mb = (DEVICES * 2 * (CHUNK_LOGITS + 3 * SCORES) + 0.5e9) / 1e6
    assert record["eval_added_mb"] < bound_mb < DEVICES * FULL_LOGITS / 1e6
    assert record["eval_step_temp_bytes_per_device"] < FULL_LOGITS / 4
    assert 10.5 < record["eval_loss"] < 11.2  # an untrained model: about ln(50257) = 10.8
