"""QLoRA (``--quantize``): the nf4 quantiser gives bitsandbytes' dequantised weights and int8 its formula; a
QLoRA step's loss and gradients are a LoRA step's on the dequantised weights, unrolled and scanned; the
frozen tree holds the quantised bytes; ``jaxseq clm`` trains with it and its merged export loads in transformers."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import Execution, from_config  # noqa: E402
from jaxseq.models.execution import Gathering  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.train.lora import LoraConfig  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from jaxseq.train.optim import OptimizerConfig  # noqa: E402
from jaxseq.train.quantize import dequantize, quantize  # noqa: E402
from jaxseq.train.step import TrainProgram  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402

VOCAB, SEQ, RANK = 128, 16, 4
TARGETS = "q_proj,v_proj,down_proj"  # the others (k, o, gate, up) are quantised without an adapter


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def test_nf4_equals_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional")
    rng = np.random.default_rng(0)
    kernel = (rng.standard_normal((2, 128, 96)) * rng.uniform(0.1, 3, (2, 1, 96))).astype(np.float32)  # [L, in, out]
    q = quantize(jnp.asarray(kernel), "nf4")
    assert q["codes"].dtype == jnp.uint8 and q["codes"].shape == (2, 64, 96)  # two codes a byte
    ours = np.asarray(dequantize(q["codes"], q["scales"], "nf4", jnp.float32))
    for layer in range(2):
        weight = torch.from_numpy(kernel[layer].T.copy())  # torch's [out, in]: blocks of 64 along its rows
        packed, state = functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
        reference = functional.dequantize_4bit(packed, state).numpy().T
        np.testing.assert_array_equal(ours[layer], reference)
    assert 0 < np.abs(ours - kernel).max() < np.abs(kernel).max() / 4  # a quantiser, not the identity


def test_int8_follows_its_formula():
    rng = np.random.default_rng(1)
    kernel = rng.standard_normal((48, 40)).astype(np.float32)
    q = quantize(jnp.asarray(kernel), "int8")
    codes, scales = np.asarray(q["codes"]), np.asarray(q["scales"])
    scale = np.abs(kernel).max(0, keepdims=True) / 127.5  # one per output channel
    np.testing.assert_allclose(scales, scale, rtol=1e-6)
    exact = kernel / scale
    expected = np.clip(np.round(exact), -128, 127)
    tie = np.abs(np.abs(exact - np.trunc(exact)) - 0.5) < 1e-4  # x.5 within rounding of the division: either way
    assert codes.dtype == np.int8 and (codes[~tie] == expected[~tie]).all() and (np.abs(codes - expected) <= 1).all()
    np.testing.assert_allclose(np.asarray(dequantize(q["codes"], q["scales"], "int8", jnp.float32)), codes * scales)


def test_quantize_needs_lora():
    with pytest.raises(JaxseqError, match="--lora_rank"):
        LoraConfig(quantize="nf4")


def program(model, mesh, kind):
    lora = LoraConfig(lora_rank=RANK, lora_targets=TARGETS, lora_dropout=0.0, quantize=kind)
    return TrainProgram(model, CausalLM(None), mesh, OptimizerConfig(), total_steps=2, seed=0, lora=lora)


def batch():
    rng = np.random.default_rng(2)
    ids = rng.integers(1, VOCAB, (4, SEQ)).astype(np.int32)
    mask = (np.arange(SEQ)[None] < np.array([[SEQ], [SEQ - 3], [SEQ // 2], [SEQ]])).astype(np.int32)
    return {"input_ids": jnp.asarray(ids * mask), "attention_mask": jnp.asarray(mask)}


@pytest.mark.parametrize(
    "kind, scan, shape",
    [
        ("nf4", False, None),
        ("int8", False, None),
        ("nf4", True, None),
        ("int8", True, None),
        # fsdp: each block gathers its weights on entry (Gathering), and a quantised kernel's place is empty
        ("nf4", False, "fsdp=4,mp=2"),
        ("nf4", True, "fsdp=4,mp=2"),
    ],
    ids=["nf4-unrolled", "int8-unrolled", "nf4-scanned", "int8-scanned", "nf4-unrolled-fsdp", "nf4-scanned-fsdp"],
)
def test_qlora_step_is_lora_on_the_dequantised_weights(kind, scan, shape):
    mesh = make_mesh(shape)
    gathering = Gathering(mesh, tuple(family_for("llama").partition_rules)) if shape else None
    execution = Execution(scan_layers=scan, gather=gathering)
    model = from_config(llama_config(), "causal-lm", mesh=mesh, seed=0, execution=execution)
    qlora = program(model, mesh, kind)
    params = nnx.state(model)
    frozen = qlora.training.freeze(params)
    # the adapters perturbed (B is zero at the start): their branch counts
    trainable = jax.tree.map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.key(x.size), x.shape, x.dtype), qlora.training.init(params)
    )
    # the frozen tree holds the codes and scales, no float kernel of a block
    flat = {"/".join(map(str, k)): v for k, v in traverse_util.flatten_dict(frozen).items()}
    quantised = [k for k in flat if k.endswith("/codes")]
    assert len(quantised) == 7 * (1 if scan else 2)  # every projection of the blocks
    assert not any(k.endswith("proj/kernel") for k in flat) and "lm_head/kernel" in flat
    # a LoRA program on a model holding the dequantised weights, the same adapters
    nnx.update(model, qlora.training.lora.merged({}, frozen))
    lora = program(model, mesh, "none")
    dense = nnx.state(model)
    task = lora.task

    def loss(prog, frozen):
        def f(trainable):
            model = prog.training.lora.training_model(prog.graphdef, trainable, frozen)
            return task.loss_and_metrics(model, batch(), nnx.Rngs(dropout=0))[0]

        return jax.jit(jax.value_and_grad(f))(trainable)

    (lq, gq), (ll, gl) = loss(qlora, frozen), loss(lora, dense)
    np.testing.assert_allclose(lq, ll, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), gq, gl)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(gq))
    # evaluation: the per-layer path without dropout gives the merged LoRA model's predictions
    eq = qlora.eval_step(trainable, frozen, batch())
    el = lora.eval_step(trainable, dense, batch())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), eq, el)
    # the quantised bytes: nf4 half a byte a weight and a float32 scale per 64, int8 a byte and one per column
    kernels = {k: v for k, v in traverse_util.flatten_dict(nnx.to_pure_dict(params)).items() if "proj" in k[-2]}
    weights = sum(v.size for v in kernels.values())
    columns = sum(v.size // v.shape[-2] for v in kernels.values())
    stored = sum(v.nbytes for k, v in flat.items() if k.endswith(("/codes", "/scales")))
    assert stored == (weights // 2 + 4 * weights // 64 if kind == "nf4" else weights + 4 * columns)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_qlora_kernels_reach_the_devices_only_quantised_one_layer_at_a_time(tmp_path, scan, monkeypatch):
    """A QLoRA run's checkpoint kernels stay on the host when loaded (``on_host``) and go to the devices one
    layer at a time to be quantised there: nothing larger than one layer's kernel is sent, and the frozen tree
    is bitwise the one quantised from the model on the devices."""
    from jaxseq.models import load_pretrained
    from jaxseq.train.lora import quantized_kernels

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(tmp_path)
    mesh = make_mesh("fsdp=2,mp=2,dp=2")
    execution = Execution(scan_layers=scan)
    on_device = load_pretrained(tmp_path, "causal-lm", mesh=mesh, execution=execution)
    lora = LoraConfig(lora_rank=RANK, lora_targets=TARGETS, quantize="nf4")
    host = set(quantized_kernels(on_device, lora))
    assert len(host) == 7 * (1 if scan else 2)
    model = load_pretrained(tmp_path, "causal-lm", mesh=mesh, execution=execution, on_host=host)
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(model))}
    assert all(isinstance(v, np.ndarray) == (path[:-1] in host) for path, v in flat.items())
    sent = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: sent.append(np.shape(x)) or device_put(x, *a, **k))
    frozen = program(model, mesh, "nf4").training.freeze(nnx.state(model))
    monkeypatch.undo()
    one_layer = max(int(np.prod(flat[(*p, "kernel")].shape[scan:])) for p in host)
    assert sent and max(int(np.prod(shape)) for shape in sent) <= one_layer
    want = program(on_device, mesh, "nf4")
    want = jax.jit(want.training.lora.freeze, out_shardings=want.training.frozen_shardings)(nnx.state(on_device))
    got, want = traverse_util.flatten_dict(frozen), traverse_util.flatten_dict(want)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
        assert got[key].sharding.is_equivalent_to(want[key].sharding, want[key].ndim), key


def test_clm_qlora_trains_and_its_merged_export_loads_in_transformers(tmp_path):
    """A fresh ``jaxseq clm`` process on one CPU device: a few QLoRA steps, then the merged export's logits
    in transformers equal the run's evaluated model (dequantised weights, adapters folded)."""
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.save_pretrained(tmp_path / "base")
    config = llama_config()
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    out = tmp_path / "out"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "HF_HUB_OFFLINE": "1"}
    flags = {
        "--model_name_or_path": tmp_path / "base",
        "--train_file": shared_asset("data/text/tinyshakespeare.txt"),
        "--block_size": SEQ,
        "--max_train_samples": 64,
        "--max_eval_samples": 8,
        "--per_device_train_batch_size": 2,
        "--max_steps": 3,
        "--learning_rate": 1e-2,
        "--lora_rank": 8,
        "--lora_targets": "q_proj,v_proj",
        "--quantize": "nf4",
        "--output_dir": out,
    }
    args = [str(x) for item in flags.items() for x in item]
    result = subprocess.run(
        [sys.executable, "-m", "jaxseq", "clm", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ids = torch.from_numpy(np.random.default_rng(4).integers(1, 1000, (2, SEQ)))
    theirs = transformers.LlamaForCausalLM.from_pretrained(out)(ids).logits.detach().numpy()
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")(ids).logits.detach().numpy()
    assert np.abs(theirs - base).max() > 1e-3  # quantised and trained: not the base model
    # the export is the run's model: its nf4 base, dequantised, with the adapters trained over three steps
    exported = {k: v.numpy() for k, v in transformers.LlamaForCausalLM.from_pretrained(out).state_dict().items()}
    weight = exported["model.layers.0.mlp.up_proj.weight"]  # quantised, no adapter: exactly nf4 values
    q = quantize(jnp.asarray(base_weight(tmp_path / "base", "model.layers.0.mlp.up_proj.weight").T), "nf4")
    np.testing.assert_array_equal(weight.T, np.asarray(dequantize(q["codes"], q["scales"], "nf4", jnp.float32)))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def base_weight(folder, name):
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))[name]
