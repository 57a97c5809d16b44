"""Qwen3.5 against transformers PyTorch, every weight perturbed: the chunked delta rule against the step-by-step
recurrence (and packed runs kept apart); logits of linear and full layers mixed on right- and left-padded rows,
packed rows as their examples alone, the classifier; greedy decoding through the linear layers' states; one
train step's loss and every gradient, on one device and on a dp/fsdp/mp mesh; export; a config with every
optional part switched the other way; FLOPs and the refusal to scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import Execution, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.hub import load_config  # noqa: E402
from jaxseq.models.qwen3_5_text import gated_delta_chunked, gated_delta_recurrent  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.models.weights import torch_layout  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import (  # noqa: E402
    assert_causal_lm_matches,
    assert_gradients_match,
    padded_batch,
    perturb,
    torch_forward,
)
from tests.test_llama import NEW, PAD, VOCAB, forward, prompts  # noqa: E402
from tests.test_mixtral import relative_diff  # noqa: E402

LINEAR, FULL = "linear_attention", "full_attention"


def tiny_config(**kw):
    """Linear, full, linear layers; 2 key heads for 4 value heads; rotary over a quarter of each head."""
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=[LINEAR, FULL, LINEAR],
        max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
    )  # fmt: skip
    return transformers.Qwen3_5TextConfig(**{**base, **kw})


OTHER_WAY = dict(  # every optional part the other way: biases, tied head, wider rotary, kernel 2, equal heads
    attention_bias=True, tie_word_embeddings=True, linear_conv_kernel_dim=2, linear_num_key_heads=4,
    layer_types=[FULL, LINEAR, LINEAR], hidden_act="gelu_pytorch_tanh",
    rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
)  # fmt: skip


def save(tmp_path_factory, name, config, cls=None):
    torch.manual_seed(0)
    ref = perturb((cls or transformers.Qwen3_5ForCausalLM)(config)).eval()
    path = tmp_path_factory.mktemp(name)
    ref.save_pretrained(path)
    return ref, path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save(tmp_path_factory, "qwen3_5", tiny_config())


def delta_inputs(seq, seed=0, batch=2, key_heads=2, value_heads=4, dk=8, dv=16):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(batch, seq, key_heads, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(batch, seq, value_heads, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 0.2, (batch, seq, value_heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (batch, seq, value_heads)).astype(np.float32)
    state = rng.normal(size=(batch, value_heads, dk, dv)).astype(np.float32)
    return tuple(map(jnp.asarray, (q, k, v, g, beta))), jnp.asarray(state)


def test_chunked_delta_rule_equals_the_recurrence_and_keeps_runs_apart():
    """Three chunks (150 positions) from a given state: outputs and final state as the step-by-step recurrence;
    with two runs, the second starts from zeros, as the recurrence over it alone."""
    (q, k, v, g, beta), state = delta_inputs(150)
    want, want_state = gated_delta_recurrent(q, k, v, g, beta, state)
    got, got_state = jax.jit(gated_delta_chunked)(q, k, v, g, beta, state)
    assert float(jnp.abs(got - want).max()) <= 1e-5 * float(jnp.abs(want).max())
    assert float(jnp.abs(got_state - want_state).max()) <= 1e-5 * float(jnp.abs(want_state).max())

    cut = 70  # inside the second chunk
    runs = jnp.asarray((np.arange(150) >= cut)[None].repeat(2, 0), jnp.int32)
    got, got_state = jax.jit(gated_delta_chunked)(q, k, v, g, beta, state, runs)
    first, _ = gated_delta_recurrent(*(x[:, :cut] for x in (q, k, v, g, beta)), state)
    second, second_state = gated_delta_recurrent(*(x[:, cut:] for x in (q, k, v, g, beta)))
    want = jnp.concatenate([first, second], axis=1)
    assert float(jnp.abs(got - want).max()) <= 1e-5 * float(jnp.abs(want).max())
    assert float(jnp.abs(got_state - second_state).max()) <= 1e-5 * float(jnp.abs(second_state).max())


def test_logits_match_pytorch_on_both_paddings_and_packed_rows_as_alone(saved):
    ref, path = saved
    model = load_pretrained(path, "causal-lm")
    for ids, mask in (padded_batch(VOCAB), prompts((12, 9, 5))):
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= 1e-4

    ids, _ = padded_batch(VOCAB, (12,))
    segments = np.asarray([[1] * 5 + [2] * 7], np.int32)  # two examples in one row, each from position 0
    positions = np.asarray([list(range(5)) + list(range(7))], np.int32)
    packed = forward(model, jnp.asarray(ids), jnp.asarray(segments), jnp.asarray(positions)).logits
    for start, end in ((0, 5), (5, 12)):
        alone = forward(model, jnp.asarray(ids[:, start:end])).logits
        assert relative_diff(np.ones((1, end - start)), packed[:, start:end], alone) <= 1e-5


def test_classifier_matches_pytorch_on_both_paddings(tmp_path_factory):
    config = tiny_config(num_labels=3)
    ref, path = save(tmp_path_factory, "qwen3_5_classifier", config, transformers.Qwen3_5TextForSequenceClassification)
    model = load_pretrained(path, "sequence-classification")
    for ids, mask in (padded_batch(VOCAB, low=3), prompts((12, 9, 5))):
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        got = forward(model, jnp.asarray(ids), jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def reference_greedy(ref, ids, mask):
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    return out[:, ids.shape[1] :].numpy()


def test_greedy_generation_matches_pytorch_on_left_padded_prompts(saved):
    """Prefill through the chunked rule, then a step at a time through the recurrence and the convolution's
    history, beside the full layer's KV cache: token for token transformers' ``generate``."""
    ref, path = saved
    ids, mask = prompts()
    want = reference_greedy(ref, ids, mask)
    assert all(len(set(row)) > 4 for row in want)
    got = generate(load_pretrained(path, "causal-lm"), ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


def test_the_other_way_logits_generation_and_export(tmp_path_factory, tmp_path):
    """Attention biases, a tied head, half the head rotating, a 2-tap convolution, as many key heads as value
    heads, another activation, a full layer first: logits, greedy decoding and the export round trip."""
    ref, path = save(tmp_path_factory, "qwen3_5_other", tiny_config(**OTHER_WAY))
    model = load_pretrained(path, "causal-lm")
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= 1e-4
    prompt_ids, prompt_mask = prompts()
    got = generate(model, prompt_ids, prompt_mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), reference_greedy(ref, prompt_ids, prompt_mask))

    save_pretrained(model, tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back) is transformers.Qwen3_5ForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert relative_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= 1e-5


UNSEEN = {  # configs unlike the fixture's, each a part switched or a shape that once went wrong
    # YaRN's attention factor scales the rotations (once left out); irregular layers, 3 value heads a key head
    "yarn-irregular": dict(
        num_hidden_layers=4, layer_types=[FULL, LINEAR, FULL, LINEAR], linear_num_key_heads=1,
        linear_num_value_heads=3, linear_value_head_dim=24, linear_conv_kernel_dim=5, num_key_value_heads=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "factor": 4.0,
                         "original_max_position_embeddings": 32, "attention_factor": 1.3},
    ),
    # no full layer: decoding needs no attention mask (once it broke); the config's legacy rope fields
    "all-linear": dict(
        layer_types=[LINEAR] * 3, rope_theta=777.0, partial_rotary_factor=0.5, rms_norm_eps=1e-3,
        hidden_act="gelu_pytorch_tanh", linear_key_head_dim=16, linear_value_head_dim=8,
    ),
    # every layer full, as full_attention_interval=1 makes it; rotary over every feature, a tied head, biases
    "all-full": dict(
        layer_types=None, full_attention_interval=1, head_dim=24, attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "partial_rotary_factor": 1.0, "factor": 2.0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(UNSEEN))
def test_unseen_configs_match_transformers(name, tmp_path):
    """Logits on both paddings (a row past one chunk of the delta rule) and greedy tokens, as transformers."""
    config = tiny_config(**UNSEEN[name])
    torch.manual_seed(0)
    ref = perturb(transformers.Qwen3_5ForCausalLM(config)).eval()
    ref.save_pretrained(tmp_path)
    assert_causal_lm_matches(ref, load_pretrained(tmp_path, "causal-lm"), VOCAB, PAD)


def test_loss_and_every_gradient_equal_transformers(saved):
    ref, path = saved
    ids, mask = padded_batch(VOCAB)
    ref.zero_grad()
    out = ref(
        input_ids=torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(),
        labels=torch.as_tensor(np.where(mask == 1, ids, -100)).long(),
    )  # fmt: skip
    out.loss.backward()
    model = load_pretrained(path, "causal-lm")
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None)))(model)
    assert abs(float(loss) - out.loss.item()) <= 1e-5
    named = torch_layout(model)
    want = {n: p.grad.numpy() for n, p in ref.named_parameters() if p.grad is not None and n in named}
    assert any("linear_attn.A_log" in n for n in want) and any("conv1d" in n for n in want)
    assert_gradients_match(model, grads, want)
    ref.zero_grad()


def test_mesh_gives_the_same_logits_loss_and_gradients(saved):
    """dp=2, fsdp=2, mp=2 (the linear layers' projections and convolution split over mp) as one device."""
    _, path = saved
    ids, mask = padded_batch(VOCAB, (12, 9, 5, 7))
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}

    def logits_loss_grads(model):
        loss, grads = nnx.jit(nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None)))(model)
        out = forward(model, batch["input_ids"], batch["attention_mask"])
        return out, loss, dict(partition.named_leaves(nnx.state(grads, nnx.Param)))

    want, want_loss, want_grads = logits_loss_grads(load_pretrained(path, "causal-lm"))
    devices = make_mesh("dp=2,fsdp=2,mp=2")
    execution = decide_execution(load_config(path), "causal-lm", mesh=devices)
    model = load_pretrained(path, "causal-lm", mesh=devices, execution=execution)
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    assert specs["model/layers/0/linear_attn/in_proj_qkv/kernel"] == jax.sharding.PartitionSpec("fsdp", "mp")
    assert specs["model/layers/0/linear_attn/conv1d/kernel"] == jax.sharding.PartitionSpec("mp", None, None)
    got, loss, grads = logits_loss_grads(model)
    assert relative_diff(mask, got.logits, want.logits) <= 1e-4  # sharded sums round apart
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        scale = max(1e-6, float(np.abs(want_grads[name]).max()))
        # the perturbed model's linear layers amplify float32 rounding: sharded sums land ~1e-4 apart
        assert float(np.abs(np.asarray(g) - np.asarray(want_grads[name])).max()) / scale <= 3e-4, name


def test_scan_is_refused_in_one_line_and_flops_count_the_chunks(saved):
    with pytest.raises(JaxseqError, match="scan_layers") as error:
        load_pretrained(saved[1], "causal-lm", execution=Execution(scan_layers=True))
    assert "\n" not in str(error.value)
    assert family_for("qwen3_5_text").scans(tiny_config()) is False

    rows, seq = 2, 100  # two chunks of 64 positions
    linear = 64 * (2 * 16 + 64) + 2 * 64 * 64 + 2 * 64 * 4  # in_proj_qkv, in_proj_z and out_proj, in_proj_a/b
    full = 3 * 64 * 64 + 2 * 64 * 32  # q with its gate, o; k and v
    weights = 2 * linear + full + 3 * 3 * 64 * 80 + 64 * VOCAB
    attention = 2 * 2.0 * 64 * (seq * seq / 2) * rows
    chunk = 2 * 64 * 64 * 8 + 2 * 5 * 64**3 + 64 * 64 * (8 + 16) + 64 * 64 * 16 + 3 * 64 * 8 * 16  # 5 squarings
    delta = 2 * (2.0 * chunk * 2 * rows * 4)  # 2 layers, 2 chunks, 4 value heads
    want = 3 * (2.0 * weights * rows * seq + attention + delta)
    assert family_for("qwen3_5_text").model_flops(tiny_config(), "causal-lm", rows, seq) == pytest.approx(want)
