"""GPT-2 against transformers PyTorch: logits, classification pooling, export round trip."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402

RTOL = 1e-5  # max |jaxseq - transformers| over max |transformers| (float32 logits agree to ~1e-6 of their scale)


def tiny_config(**kw):
    base = dict(
        n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    return transformers.GPT2Config(**{**base, **kw})


@pytest.fixture(scope="module")
def gpt2_lm(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2-lm")
    model = perturb(transformers.GPT2LMHeadModel(tiny_config()))
    model.save_pretrained(path)
    return model, path


def test_causal_lm_logits_match_pytorch(gpt2_lm):
    ref, path = gpt2_lm
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = load_pretrained(path, "causal-lm")(jnp.asarray(ids), jnp.asarray(mask)).logits
    assert scaled_diff(mask, got, want) <= RTOL


def test_base_model_loads_lm_checkpoint(gpt2_lm):
    ref, path = gpt2_lm
    ids, mask = padded_batch(101)
    want = torch_forward(ref.transformer, input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    got = load_pretrained(path, "base")(jnp.asarray(ids), jnp.asarray(mask)).last_hidden_state
    assert scaled_diff(mask, got, want) <= RTOL


def test_sequence_classification_matches_pytorch_and_round_trips(tmp_path):
    ref = perturb(transformers.GPT2ForSequenceClassification(tiny_config(num_labels=3)))
    ref.save_pretrained(tmp_path / "ref")
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    model = load_pretrained(tmp_path / "ref", "sequence-classification")
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    assert got.shape == (3, 3)
    assert scaled_diff(None, got, want) <= RTOL

    save_pretrained(model, tmp_path / "out")
    back, info = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again = torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy()
    assert scaled_diff(None, again, got) <= RTOL


def test_classifier_head_on_lm_checkpoint_is_initialised_and_reported(gpt2_lm, caplog):
    _, path = gpt2_lm
    model = load_pretrained(path, "sequence-classification", num_labels=2)
    assert "score.weight" in caplog.text
    assert model.score.kernel.shape == (64, 2)


def test_causal_lm_export_round_trip(gpt2_lm, tmp_path):
    _, path = gpt2_lm
    model = load_pretrained(path, "causal-lm")
    save_pretrained(model, tmp_path)
    back, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = padded_batch(101)
    want = torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy()
    got = model(jnp.asarray(ids), jnp.asarray(mask)).logits
    assert scaled_diff(mask, got, want) <= RTOL


def test_bfloat16_compute_stays_close_to_float32(gpt2_lm):
    _, path = gpt2_lm
    ids, mask = padded_batch(101)
    full = load_pretrained(path, "causal-lm")(jnp.asarray(ids), jnp.asarray(mask)).logits
    half_model = load_pretrained(path, "causal-lm", dtype=jnp.bfloat16)
    assert half_model.transformer.h[0].attn.c_attn.kernel[...].dtype == jnp.float32  # master params stay fp32
    half = half_model(jnp.asarray(ids), jnp.asarray(mask)).logits
    # bf16 keeps 8 mantissa bits (relative error ~4e-3 per rounding); logits here (perturbed weights) have
    # std ~0.4 and max |logit| ~1.6. Measured: 0.013 max abs diff; the bound leaves room for other seeds and
    # BLAS orderings.
    assert max_diff_on(mask, half, full) <= 0.03


def test_dropout_is_driven_by_explicit_rngs(gpt2_lm):
    from flax import nnx

    _, path = gpt2_lm
    model = load_pretrained(path, "causal-lm")
    ids, mask = (jnp.asarray(a) for a in padded_batch(101))
    eval_a, eval_b = model(ids, mask).logits, model(ids, mask).logits
    np.testing.assert_array_equal(eval_a, eval_b)
    train_a = model(ids, mask, rngs=nnx.Rngs(dropout=1)).logits
    train_b = model(ids, mask, rngs=nnx.Rngs(dropout=1)).logits
    train_c = model(ids, mask, rngs=nnx.Rngs(dropout=2)).logits
    np.testing.assert_array_equal(train_a, train_b)
    assert np.abs(np.asarray(train_a - train_c)).max() > 1e-3
    assert np.abs(np.asarray(train_a - eval_a)).max() > 1e-3


@pytest.mark.parametrize(
    "variant",
    [
        dict(scale_attn_by_inverse_layer_idx=True),
        dict(reorder_and_upcast_attn=True),
        dict(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
    ],
)
def test_stanford_crfm_attention_variants_match_pytorch(tmp_path, variant):
    """Configs that scale attention by the inverse layer index and/or upcast it (Stanford CRFM's GPT-2s), with
    perturbed weights and 4 layers so the per-layer scales differ: logits and greedy continuations (KV cache)
    equal transformers' eager attention, the path that honours both flags."""
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(tiny_config(n_layer=4, attn_implementation="eager", **variant))
    perturb(ref, std=0.1)
    ref.eval().save_pretrained(tmp_path)
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    model = load_pretrained(tmp_path, "causal-lm")
    got = model(jnp.asarray(ids), jnp.asarray(mask)).logits
    assert scaled_diff(mask, got, want) <= RTOL
    if variant.get("scale_attn_by_inverse_layer_idx"):  # without the flag the same weights give other logits
        plain = transformers.GPT2LMHeadModel(tiny_config(n_layer=4, attn_implementation="eager"))
        plain.load_state_dict(ref.state_dict())
        assert max_diff_on(mask, torch_forward(plain, input_ids=ids, attention_mask=mask).logits.numpy(), want) > 1e-3
    if variant.get("reorder_and_upcast_attn"):  # in float32 a no-op; under bfloat16 attention runs in float32
        bf16 = load_pretrained(tmp_path, "causal-lm", dtype=jnp.bfloat16)
        lower = load_pretrained(tmp_path, "causal-lm", dtype=jnp.bfloat16, reorder_and_upcast_attn=False)
        upcast = bf16(jnp.asarray(ids), jnp.asarray(mask)).logits
        assert max_diff_on(mask, upcast, want) <= 0.05 * float(np.abs(want).max())
        assert max_diff_on(mask, upcast, lower(jnp.asarray(ids), jnp.asarray(mask)).logits) > 0

    from jaxseq.generation import generate

    prompt = ids[:1, :8]
    with torch.no_grad():
        greedy = ref.generate(torch.as_tensor(prompt).long(), max_new_tokens=6, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(
        np.asarray(generate(model, prompt, max_new_tokens=6).sequences), greedy[:, 8:].numpy()
    )
