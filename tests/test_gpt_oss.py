"""gpt-oss against transformers PyTorch, every weight perturbed and the sinks made large: a config with sliding and
full layers (a window of 4), YaRN rope, q/k/v/o biases, clamped experts with biases, the router loss; and one with
none of these (full layers only, default rope, no attention biases, a tied head, top-1 of 4 experts, as many
key/value heads as query heads). Logits on both paddings (the second scanned too), greedy generation through the
KV cache and the rolling window, export, one training step's loss and every gradient, on one device and on
meshes (experts split over ep), and what is refused in one line: MXFP4 checkpoints, a fused kernel asked by name,
scanning mixed layers. Two more configs (every layer sliding, an irregular pattern, head_dim apart from hidden /
heads, every expert or a single one, llama3 and linear ropes) for logits and greedy tokens alone."""

import json
import shutil

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
from jaxseq.models import Execution, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.attention import choose_kernel  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.hub import load_config  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import assert_gradients_match, padded_batch, perturb, torch_forward  # noqa: E402
from tests.test_llama import NEW, PAD, VOCAB, forward, prompts  # noqa: E402
from tests.test_mixtral import relative_diff  # noqa: E402

COEF = 0.02
YARN = dict(
    rope_type="yarn", factor=4.0, beta_fast=16.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=32,
    rope_theta=1000.0,
)  # fmt: skip
CONFIGS = {
    "mixed": dict(sliding_window=4, rope_parameters=YARN, output_router_logits=True, router_aux_loss_coef=COEF),
    "plain": dict(
        layer_types=["full_attention"] * 3, attention_bias=False, tie_word_embeddings=True, num_key_value_heads=4,
        num_local_experts=4, num_experts_per_tok=1, rope_parameters=dict(rope_type="default", rope_theta=500.0),
    ),
}  # fmt: skip


def tiny_config(**kw):
    """3 layers (sliding, full, sliding by default), 4 experts of width 32, top-2, clamped at 2."""
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        swiglu_limit=2.0, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.GptOssConfig(**{**base, **kw})


def reference(fields: dict):
    """A transformers LM of ``tiny_config(**fields)``, every weight perturbed and the sinks of the logits' size
    (each takes a real share of its softmax)."""
    torch.manual_seed(0)
    ref = perturb(transformers.GptOssForCausalLM(tiny_config(**fields))).eval()
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.mul_(8)
    return ref


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    ref = reference(CONFIGS[request.param])
    path = tmp_path_factory.mktemp("gpt_oss")
    ref.save_pretrained(path)
    return request.param, ref, path


def test_logits_and_aux_loss_match_pytorch_on_both_paddings(saved):
    name, ref, path = saved
    model = load_pretrained(path, "causal-lm")
    scanned = load_pretrained(path, "causal-lm", execution=Execution(scan_layers=True)) if name == "plain" else None
    for ids, mask in (padded_batch(VOCAB), prompts((12, 9, 5))):
        want = torch_forward(ref, input_ids=ids, attention_mask=mask)
        for m in filter(None, (model, scanned)):
            out = forward(m, jnp.asarray(ids), jnp.asarray(mask))
            assert relative_diff(mask, out.logits, want.logits.numpy()) <= 1e-4
        if name == "mixed":
            assert abs(float(out.aux_loss) - COEF * float(want.aux_loss)) <= 1e-6


def test_greedy_generation_matches_pytorch_on_left_padded_prompts(saved):
    """24 new tokens after prompts of up to 11: far past the window of 4 (the rolling cache's path)."""
    _, ref, path = saved
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


def test_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    """The unrolled model's export, and the scanned one's (the experts' stacks with a layer axis) where it scans."""
    name, ref, path = saved
    save_pretrained(load_pretrained(path, "causal-lm", execution=Execution(scan_layers=name == "plain")), tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back) is transformers.GptOssForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= 1e-5


def loss_and_grads(model, batch):
    return nnx.jit(nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None)))(model)


def test_training_loss_and_every_gradient_equal_transformers(saved):
    """One step's loss (the router loss included where the config asks for it) and the gradient of every
    weight: the sinks, the router's kernel and bias, the experts' stacks and biases."""
    _, ref, path = saved
    ids, mask = padded_batch(VOCAB)
    ref.train()
    ref.zero_grad()
    out = ref(
        input_ids=torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(),
        labels=torch.as_tensor(np.where(mask == 1, ids, -100)).long(),
    )  # fmt: skip
    out.loss.backward()
    ref.eval()
    want = {name: p.grad.numpy().copy() for name, p in ref.named_parameters()}
    ref.zero_grad()
    model = load_pretrained(path, "causal-lm")
    loss, grads = loss_and_grads(model, {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)})
    assert abs(float(loss) - out.loss.item()) <= 1e-5
    assert_gradients_match(model, nnx.state(grads, nnx.Param), want)


@pytest.mark.parametrize(
    "saved, mesh", [("mixed", "dp=2,fsdp=2,mp=2"), ("mixed", "dp=2,ep=4"), ("plain", "dp=2,ep=4")], indirect=["saved"]
)
def test_meshes_give_the_same_logits_and_gradients(saved, mesh):
    """The experts split over ep (each device its experts' stacks and biases) or over fsdp and mp: the logits,
    the loss and one step's gradients of every weight as on one device; the second config's layers scanned, on
    the ep mesh."""
    name, _, path = saved
    scan = name == "plain"
    ids, mask = padded_batch(VOCAB)
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}

    def logits_loss_grads(model):
        loss, grads = loss_and_grads(model, batch)
        out = forward(model, batch["input_ids"], batch["attention_mask"])
        return out, loss, dict(partition.named_leaves(nnx.state(grads, nnx.Param)))

    one = load_pretrained(path, "causal-lm", execution=Execution(scan_layers=scan))
    want, want_loss, want_grads = logits_loss_grads(one)
    devices = make_mesh(mesh)
    execution = decide_execution(load_config(path), "causal-lm", mesh=devices, scan_layers=scan)
    model = load_pretrained(path, "causal-lm", mesh=devices, execution=execution)
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    layer, stacked = ("model/layers/stacked", (None,)) if scan else ("model/layers/0", ())
    assert specs[f"{layer}/mlp/experts/gate_up_proj"] == P(*stacked, "ep", "fsdp", "mp")
    assert specs[f"{layer}/mlp/experts/down_proj_bias"] == P(*stacked, "ep", None)
    block = model.model.layers.stacked if scan else model.model.layers[0]
    assert block.mlp.expert_mesh == (devices if "ep" in mesh or "fsdp" in mesh else None)
    got, loss, grads = logits_loss_grads(model)
    assert relative_diff(mask, got.logits, want.logits) <= 1e-5
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    assert grads.keys() == want_grads.keys()
    for key, g in grads.items():
        scale = max(1e-6, float(np.abs(want_grads[key]).max()))
        assert float(np.abs(np.asarray(g) - np.asarray(want_grads[key])).max()) / scale <= 1e-4, key


@pytest.mark.parametrize("saved", ["mixed"], indirect=True)
def test_refusals_are_one_line(saved, tmp_path):
    """An MXFP4 checkpoint; splash or cuDNN asked by name (they have no sinks); scanning sliding and full layers."""
    _, _, path = saved
    quantized = tmp_path / "mxfp4"
    shutil.copytree(path, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (quantized / "config.json").write_text(json.dumps(config))
    model = load_pretrained(path, "causal-lm")
    checks = [
        ("mxfp4", lambda: load_pretrained(quantized, "causal-lm")),
        ("sinks", lambda: choose_kernel("splash", None, lambda: model, interpret=True)),
        ("sinks", lambda: choose_kernel("cudnn", None, lambda: model)),
        ("scan_layers", lambda: load_pretrained(path, "causal-lm", execution=Execution(scan_layers=True))),
    ]
    for word, call in checks:
        with pytest.raises(JaxseqError, match=word) as error:
            call()
        assert "\n" not in str(error.value)
    said = []
    assert choose_kernel("auto", None, lambda: model, say=said.append).name == "xla"


@pytest.mark.parametrize("saved", ["mixed"], indirect=True)
def test_lora_adapts_the_attention_and_refuses_the_experts(saved):
    """PEFT has no defaults for gpt-oss: q_proj and v_proj by default, all four attention projections asked by
    name; the experts' stacks are read by the grouped matmul, never called: an adapter on them is refused."""
    from jaxseq.partition import get_partition_rules, match_partition_rules
    from jaxseq.train.lora import Lora, LoraConfig

    _, _, path = saved
    model = load_pretrained(path, "causal-lm")
    specs = match_partition_rules(get_partition_rules("gpt_oss"), nnx.state(model))
    assert len(Lora(LoraConfig(lora_rank=2), model, specs).targets) == 2 * 3
    attention = LoraConfig(lora_rank=2, lora_targets="q_proj,k_proj,v_proj,o_proj")
    assert len(Lora(attention, model, specs).targets) == 4 * 3
    with pytest.raises(JaxseqError, match="experts") as error:
        Lora(LoraConfig(lora_rank=2, lora_targets="gate_up_proj"), model, specs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("saved", ["mixed"], indirect=True)
def test_sequence_classification_matches_pytorch(saved, tmp_path):
    """transformers' GptOssForSequenceClassification (the last real token's score) from the same body."""
    name, _, _ = saved
    torch.manual_seed(1)
    ref = perturb(transformers.GptOssForSequenceClassification(tiny_config(**CONFIGS[name], num_labels=3))).eval()
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "sequence-classification")
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


MSCALE = dict(
    rope_type="yarn", rope_theta=1e4, factor=8.0, original_max_position_embeddings=32, mscale=0.7, mscale_all_dim=1.0
)
YARN_CONFIGS = {
    "gpt-oss": tiny_config(),  # gpt-oss's own: factor 32 over 4096 positions, not truncated
    "truncated": tiny_config(rope_parameters={**YARN, "truncate": True, "beta_fast": 8.0}),
    "llama-mscale": transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=MSCALE
    ),
}


@pytest.mark.parametrize("config", YARN_CONFIGS.values(), ids=YARN_CONFIGS.keys())
def test_yarn_frequencies_and_attention_factor_equal_transformers(config):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxseq.models.llama.modeling import rope_attention_factor, rope_frequencies

    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    np.testing.assert_allclose(rope_frequencies(config), inv_freq.numpy(), rtol=2e-7, atol=0)
    assert rope_attention_factor(config) == pytest.approx(factor, rel=1e-12) and factor != 1.0


def test_long_rows_attend_a_chunk_of_queries_at_a_time(monkeypatch):
    """Sinks take XLA's written-out attention, whose rows of more than ``QUERY_CHUNK`` queries go a chunk at a time
    (a sliding window, a right-padded row, grouped-query heads): the output and the gradients of the queries,
    keys, values and sinks are those of the whole row at once."""
    import jax

    from jaxseq.models import attention

    rng = np.random.default_rng(0)
    rows, length, heads, kv_heads, dim = 2, 2 * attention.QUERY_CHUNK, 2, 1, 4
    q, k, v = (jnp.asarray(rng.normal(size=(rows, length, n, dim)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    sinks = jnp.asarray(3 * rng.normal(size=heads), jnp.float32)
    real = jnp.asarray(np.arange(length)[None] < np.array([[length], [length - 500]]), jnp.int32)
    mask = attention.self_attention_mask(real, length, causal=True, window=300)

    def run():
        def loss(q, k, v, sinks):
            y = attention.attend(q, k, v, mask, scale=0.3, causal=True, sinks=sinks)
            return (y * jnp.cos(y)).sum(), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)

    chunked = run()
    monkeypatch.setattr(attention, "QUERY_CHUNK", 2 * length)
    for got, want in zip(jax.tree.leaves(chunked), jax.tree.leaves(run())):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


LLAMA3 = dict(
    rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32,
)  # fmt: skip
UNSEEN = {
    # every layer sliding (a window of 3), head_dim 12 beside hidden 64 / 4 heads, every expert of each token,
    # llama3 rope, another SwiGLU gain and clamp, a tied head
    "all-sliding": dict(
        layer_types=["sliding_attention"] * 3, sliding_window=3, head_dim=12, num_experts_per_tok=4,
        rope_parameters=LLAMA3, swiglu_alpha=3.0, swiglu_limit=0.5, tie_word_embeddings=True,
    ),
    # full, sliding, sliding (a window of 2), one key/value head of 24 features, a single expert, linear rope, no
    # attention biases
    "irregular": dict(
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], sliding_window=2,
        num_key_value_heads=1, head_dim=24, num_local_experts=1, num_experts_per_tok=1, attention_bias=False,
        rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=4.0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(UNSEEN))
def test_more_configs_match_pytorch_logits_and_greedy_tokens(case, tmp_path):
    """Configs beyond the two above, each loaded from transformers' save_pretrained: the logits on both paddings
    and 12 greedy tokens of left-padded prompts, past the window."""
    ref = reference(UNSEEN[case])
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "causal-lm")
    for ids, mask in (padded_batch(VOCAB), prompts((12, 9, 5))):
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= 1e-4
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=12,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    got = generate(model, ids, mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), out[:, ids.shape[1] :].numpy())
