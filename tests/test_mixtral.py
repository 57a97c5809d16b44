"""Mixtral against transformers PyTorch, every weight perturbed: logits on right- and left-padded rows (unrolled
and scanned layers), export, greedy generation, the router load balancing loss and the training loss with it,
one step's gradients, meshes (experts split over ep, or over fsdp and mp), FLOPs that count only the experts
each token goes to, and a `jaxseq clm --mesh dp=2,ep=4` run whose loss falls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.execution import Execution  # noqa: E402
from jaxseq.models.hub import load_config  # noqa: E402
from jaxseq.models.mixtral.modeling import expert_parallel, grouped_experts, route  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, torch_forward  # noqa: E402
from tests.test_llama import NEW, PAD, VOCAB, forward, prompts  # noqa: E402

COEF = 0.02


def tiny_config(**kw):
    """4 experts, top-2, 2 layers; ``output_router_logits`` so that transformers returns the aux loss."""
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.3, output_router_logits=True,
        router_aux_loss_coef=COEF,
    )  # fmt: skip
    return transformers.MixtralConfig(**{**base, **kw})


def relative_diff(mask, got, want) -> float:
    want = np.asarray(want, np.float32)
    return max_diff_on(mask, got, want) / max(1.0, max_diff_on(mask, want, np.zeros_like(want)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    ref = perturb(transformers.MixtralForCausalLM(tiny_config())).eval()
    path = tmp_path_factory.mktemp("mixtral")
    ref.save_pretrained(path)
    return ref, path


@pytest.mark.parametrize("scan", [False, True])
def test_logits_match_pytorch_on_both_paddings(saved, scan):
    ref, path = saved
    model = load_pretrained(path, "causal-lm", execution=Execution(scan_layers=scan))
    for ids, mask in (padded_batch(VOCAB), prompts((12, 9, 5))):
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= 1e-4


def test_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    ref, path = saved
    save_pretrained(load_pretrained(path, "causal-lm"), tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back) is transformers.MixtralForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= 1e-5


def test_greedy_generation_matches_pytorch(saved):
    ref, path = saved
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None, output_router_logits=False,
        )  # fmt: skip
    want = out[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 4 for row in want)
    got = generate(load_pretrained(path, "causal-lm"), ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


@pytest.mark.parametrize("chunk", [None, 4])
def test_aux_loss_and_training_loss_equal_transformers(saved, chunk):
    """transformers' aux_loss (load_balancing_loss_func over both layers, padding masked) times the coefficient,
    and its loss with labels (LM loss plus that), from the full logits and from the chunked loss."""
    ref, path = saved
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask, labels=np.where(mask == 1, ids, -100))
    model = load_pretrained(path, "causal-lm")
    out = forward(model, jnp.asarray(ids), jnp.asarray(mask))
    assert abs(float(out.aux_loss) - COEF * float(want.aux_loss)) <= 1e-6
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}
    loss = nnx.jit(lambda m, b: CausalLM(chunk).loss(m, b, None))(model, batch)
    assert abs(float(loss) - float(want.loss)) <= 1e-5


def test_gradients_equal_transformers(saved):
    """One training step's loss (aux included) and the gradients of the router and an expert's kernels."""
    ref, path = saved
    ids, mask = padded_batch(VOCAB)
    ref.train()
    ref.zero_grad()
    out = ref(
        input_ids=torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(),
        labels=torch.as_tensor(np.where(mask == 1, ids, -100)).long(),
    )  # fmt: skip
    out.loss.backward()
    ref.eval()
    model = load_pretrained(path, "causal-lm")
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None)))(model)
    assert abs(float(loss) - out.loss.item()) <= 1e-5
    layer = grads.model.layers[1].block_sparse_moe
    torch_layer = ref.model.layers[1].mlp
    want = {
        "gate": torch_layer.gate.weight.grad.numpy().T,
        "w1": torch_layer.experts.gate_up_proj.grad[2, :48].numpy().T,
        "w2": torch_layer.experts.down_proj.grad[2].numpy().T,
    }
    got = {"gate": layer.gate.kernel[...], "w1": layer.experts.w1[...][2], "w2": layer.experts.w2[...][2]}
    for name in want:
        scale = max(1e-8, float(np.abs(want[name]).max()))
        assert float(np.abs(np.asarray(got[name]) - want[name]).max()) / scale <= 1e-4, name
    ref.zero_grad()


@pytest.mark.parametrize("mesh", ["dp=2,fsdp=2,mp=2", "dp=2,ep=4", "fsdp=2,ep=2,mp=2"])
@pytest.mark.parametrize("scan", [False, True])
def test_meshes_give_the_same_logits_and_gradients(saved, mesh, scan):
    """The experts split over ep (each device computes its experts for its ep group's tokens), or over fsdp
    and mp: the logits, the aux loss and one step's gradients of every weight as on one device."""
    _, path = saved
    ids, mask = padded_batch(VOCAB)
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}

    def logits_loss_grads(model):
        grad = nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None))
        loss, grads = nnx.jit(grad)(model)
        out = forward(model, batch["input_ids"], batch["attention_mask"])
        return out, loss, dict(partition.named_leaves(nnx.state(grads, nnx.Param)))

    want, want_loss, want_grads = logits_loss_grads(
        load_pretrained(path, "causal-lm", execution=Execution(scan_layers=scan))
    )
    devices = make_mesh(mesh)
    execution = decide_execution(load_config(path), "causal-lm", mesh=devices, scan_layers=scan)  # as a run's
    model = load_pretrained(path, "causal-lm", mesh=devices, execution=execution)
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    layer = "model/layers/stacked" if scan else "model/layers/0"
    stacked = (None,) * scan
    assert specs[f"{layer}/block_sparse_moe/experts/w1"] == P(*stacked, "ep", "fsdp", "mp")
    assert specs[f"{layer}/block_sparse_moe/experts/w2"] == P(*stacked, "ep", "mp", "fsdp")
    assert (model.model.layers.stacked if scan else model.model.layers[0]).block_sparse_moe.expert_mesh == (
        devices if "ep" in mesh else None
    )
    got, loss, grads = logits_loss_grads(model)
    assert relative_diff(mask, got.logits, want.logits) <= 1e-5
    assert abs(float(got.aux_loss) - float(want.aux_loss)) <= 1e-7
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))  # a few float32 ULPs
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        scale = max(1e-6, float(np.abs(want_grads[name]).max()))
        assert float(np.abs(np.asarray(g) - np.asarray(want_grads[name])).max()) / scale <= 1e-4, name


def test_flops_count_only_the_routed_experts():
    """Per token and layer: q, o (64 x 64 each), k, v (64 x 32 each), the router (64 x 4) and 2 of the 4
    experts (3 x 64 x 48 each); causal attention over 16 positions; the head (64 x 101)."""
    config, rows, seq = tiny_config(), 2, 16
    per_token = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 64 * 4 + 2 * 3 * 64 * 48) + 64 * VOCAB
    attention = 2 * 2.0 * 2 * 64 * (seq * seq / 2) * rows
    want = 3 * (2.0 * per_token * rows * seq + attention)
    assert family_for("mixtral").model_flops(config, "causal-lm", rows, seq) == pytest.approx(want)


def test_lora_of_the_experts_is_refused_in_one_line(saved):
    """The experts' kernels are read by the grouped matmul, never called: an adapter on them would not train."""
    from jaxseq.partition import get_partition_rules, match_partition_rules
    from jaxseq.train.lora import Lora, LoraConfig

    model = load_pretrained(saved[1], "causal-lm")
    specs = match_partition_rules(get_partition_rules("mixtral"), nnx.state(model))
    assert Lora(LoraConfig(lora_rank=2), model, specs).targets  # q/v by default
    for config in (LoraConfig(lora_rank=2, lora_targets=r"w1/kernel$"), LoraConfig(lora_rank=2, quantize="int8")):
        with pytest.raises(JaxseqError, match="experts") as error:
            Lora(config, model, specs)
        assert "\n" not in str(error.value)


def test_pretraining_with_experts_split_over_ep_lowers_the_loss(tmp_path):
    """`jaxseq clm --mesh dp=2,ep=4` from a tiny Mixtral config, as a user runs it (the installed command, a
    fresh process, 8 CPU devices): the experts split over ep, and the training loss falls."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import shared_asset

    gpt2 = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(gpt2 / "vocab.json"), merges=str(gpt2 / "merges.txt"))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    out = tmp_path / "out"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    overrides = "hidden_size=64,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2"
    result = subprocess.run(
        [
            str(Path(sys.executable).with_name("jaxseq")), "clm", "--model_type", "mixtral",
            "--config_overrides", f"{overrides},vocab_size=50257,num_local_experts=8,num_experts_per_tok=2",
            "--tokenizer_name", str(tmp_path / "tokenizer"), "--train_file", str(shared_asset("data/text/botchan.txt")),
            "--block_size", "64", "--per_device_train_batch_size", "1", "--max_steps", "40", "--learning_rate", "3e-3",
            "--warmup_steps", "0", "--logging_steps", "1", "--max_eval_samples", "8", "--mesh", "dp=2,ep=4",
            "--output_dir", str(out), "--compilation_cache_dir", "", "--data_cache_dir", str(tmp_path / "cache"),
        ],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh {'dp': 2, 'fsdp': 1, 'ep': 4, 'mp': 1}" in result.stdout
    losses = [
        r["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r
    ]
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses


def undefined_outside_groups(monkeypatch):
    """``jax.lax.ragged_dot`` made to leave NaN in the rows outside its groups, as a grouped matmul may leave
    them undefined (uninitialised memory), in its output and in its input's gradient."""
    real = jax.lax.ragged_dot

    def poison(out, sizes):
        return jnp.where((jnp.arange(out.shape[0]) >= sizes.sum())[:, None], jnp.nan, out)

    @jax.custom_vjp
    def ragged_dot(lhs, rhs, sizes):
        return poison(real(lhs, rhs, sizes), sizes)

    def backward(saved, g):
        lhs, rhs, sizes = saved
        d_lhs, d_rhs = jax.vjp(lambda a, b: real(a, b, sizes), lhs, rhs)[1](g)
        return poison(d_lhs, sizes), d_rhs, None

    ragged_dot.defvjp(lambda lhs, rhs, sizes: (ragged_dot(lhs, rhs, sizes), (lhs, rhs, sizes)), backward)
    monkeypatch.setattr(jax.lax, "ragged_dot", ragged_dot)


def test_experts_split_over_ep_never_take_other_devices_rows(monkeypatch):
    """On ep > 1 each device's grouped matmuls hold rows of its ep group's pairs routed to other devices' experts,
    outside their groups: with a grouped matmul leaving those rows NaN, the output and the gradients of the
    tokens, route weights and kernels are the one-device ones, all finite (no product of such a row with 0)."""
    rng = np.random.default_rng(0)
    experts, hidden, inner, tokens = 8, 16, 24, 32
    kernels = tuple(jnp.asarray(rng.normal(0, 0.3, (experts, *s)), jnp.float32) for s in
                    ((hidden, inner), (hidden, inner), (inner, hidden)))  # fmt: skip
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    _, weights, ids = route(jnp.asarray(rng.normal(size=(tokens, experts))), 2, True)
    act = jax.nn.silu

    def through(run):
        def loss(kernels, x, weights):
            y = run(kernels, x, weights)
            return (y * jnp.cos(y)).sum(), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(kernels, x, weights)
        return y, grads

    want = through(lambda k, x, w: grouped_experts(k, act, x, w, ids))
    undefined_outside_groups(monkeypatch)
    for spec in ("dp=2,ep=4", "ep=8"):
        mesh = make_mesh(spec)
        got = through(lambda k, x, w, mesh=mesh: expert_parallel(mesh, k, act, x, w, ids))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.isfinite(np.asarray(g)).all(), spec
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=spec)
