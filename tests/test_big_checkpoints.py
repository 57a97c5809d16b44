"""Big checkpoints: a sharded safetensors checkpoint (``model.safetensors.index.json`` and several files) loads
tensor by tensor, exactly, with the host's memory growing by about the model on its devices plus the tensor
being placed, never by the whole checkpoint at once (measured as peak RSS in a fresh process)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]

MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    from pathlib import Path
    import numpy as np
    from jaxseq.models import load_pretrained

    def status(key):
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    folder = sys.argv[1]
    load_pretrained(folder, "causal-lm")  # warm-up: the runtime's own first-use allocations
    gc.collect()
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from here
    model = load_pretrained(folder, "causal-lm")
    peak = status("VmHWM")
    from flax import nnx
    sizes = [v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    print(json.dumps({"growth": peak - before, "model": sum(sizes), "largest": max(sizes)}))
    """
)


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded-gpt2")
    config = transformers.GPT2Config(n_layer=12, n_embd=384, n_head=6, vocab_size=1000, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, max_shard_size="10MB")
    return folder, model


def test_a_sharded_checkpoint_loads_exactly(sharded_checkpoint):
    from jaxseq.models import load_pretrained
    from jaxseq.models.weights import torch_layout

    folder, reference = sharded_checkpoint
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4  # really several files
    ours = load_pretrained(folder, "causal-lm")
    from flax import nnx

    flat = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param)))
    state = reference.state_dict()
    for name, (path, transposed) in torch_layout(ours).items():
        want = state[name].numpy()
        got = np.asarray(flat[path].get_value())
        got = got.T if transposed else got
        if got.shape != want.shape:  # the vocabulary padded to 1024 rows (layers.padded_vocab_size), zeros
            np.testing.assert_array_equal(got[want.shape[0] :], 0.0, err_msg=name)
            got = got[: want.shape[0]]
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is read from Linux's /proc")
def test_loading_holds_about_one_tensor_beyond_the_model(sharded_checkpoint):
    folder, _ = sharded_checkpoint
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    model, largest, growth = measured["model"], measured["largest"], measured["growth"]
    assert model > 20 * largest  # a model of many tensors, so the bound below means something
    # the model itself lives in host memory on CPU devices; the checkpoint may add about one tensor at a time
    assert growth <= model + 4 * largest + 8 * 2**20, measured
