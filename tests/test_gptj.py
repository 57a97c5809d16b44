"""GPT-J against transformers PyTorch: logits, hidden states, export round trip, KV cache, bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from tests.reference import max_diff_on, padded_batch, torch_forward  # noqa: E402

# One compiled forward per model structure (op-by-op eager execution costs seconds per test).
forward = nnx.jit(lambda model, *args, **kwargs: model(*args, **kwargs))


def tiny_config(**kw):
    base = dict(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=101, n_positions=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    return transformers.GPTJConfig(**{**base, **kw})


def perturbed(model):
    """The PyTorch model with noise on every parameter: its fresh biases are zero and its norms one, which
    would hide a bias or norm loaded into the wrong place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def gptj_lm(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gptj-lm")
    model = perturbed(transformers.GPTJForCausalLM(tiny_config()))
    model.save_pretrained(path)
    return model, path


def test_causal_lm_logits_match_pytorch(gptj_lm):
    ref, path = gptj_lm
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = forward(load_pretrained(path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    assert got.dtype == jnp.float32
    assert max_diff_on(mask, got, want) <= 1e-4


def test_base_model_loads_lm_checkpoint(gptj_lm):
    ref, path = gptj_lm
    ids, mask = padded_batch(101)
    want = torch_forward(ref.transformer, input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    got = forward(load_pretrained(path, "base"), jnp.asarray(ids), jnp.asarray(mask)).last_hidden_state
    assert max_diff_on(mask, got, want) <= 1e-4


def test_causal_lm_export_round_trip(gptj_lm, tmp_path):
    _, path = gptj_lm
    model = load_pretrained(path, "causal-lm")
    save_pretrained(model, tmp_path)
    back, info = transformers.GPTJForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = padded_batch(101)
    want = torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy()
    got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert max_diff_on(mask, got, want) <= 1e-4


def test_tied_embeddings_keep_the_head_bias(tmp_path):
    ref = perturbed(transformers.GPTJForCausalLM(tiny_config(tie_word_embeddings=True)))
    ref.save_pretrained(tmp_path / "ref")
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    model = load_pretrained(tmp_path / "ref", "causal-lm")
    got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert max_diff_on(mask, got, want) <= 1e-4

    save_pretrained(model, tmp_path / "out")
    back, info = transformers.GPTJForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again = torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy()
    assert max_diff_on(mask, again, want) <= 1e-4


def test_kv_cache_decoding_matches_full_forward(gptj_lm):
    """The right-padded batch as a prompt, then one token at a time through a cache longer than the text,
    with default positions (the cache's index onwards) and a mask covering the cache's max_len."""
    _, path = gptj_lm
    model = load_pretrained(path, "causal-lm")
    ids, mask = padded_batch(101)
    want = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits

    width, max_len, prompt = ids.shape[1], 16, 4
    cache_mask = jnp.asarray(np.pad(mask, ((0, 0), (0, max_len - width)), constant_values=1))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, cache):
        return nnx.merge(graphdef, state)(ids, cache_mask, cache=cache)

    out = step(state, jnp.asarray(ids[:, :prompt]), model.init_cache(len(ids), max_len))
    logits, cache = [out.logits], out.cache
    for t in range(prompt, width):
        out = step(state, jnp.asarray(ids[:, t:t + 1]), cache)
        logits.append(out.logits)
        cache = out.cache
    assert int(cache.index) == width
    assert max_diff_on(mask, jnp.concatenate(logits, axis=1), want) <= 1e-4


def test_bfloat16_compute_stays_close_to_float32(gptj_lm):
    """bfloat16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.2%); through two parallel-residual
    blocks, a 101-way head and float32 params, the measured worst logit error is ~0.5% of the largest
    logit, so 2% of it (and a floor for tiny logits) leaves headroom without hiding a real bug."""
    _, path = gptj_lm
    ids, mask = padded_batch(101)
    f32 = forward(load_pretrained(path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    bf16_model = load_pretrained(path, "causal-lm", dtype=jnp.bfloat16)
    assert bf16_model.transformer.wte.embedding.get_value().dtype == jnp.float32
    bf16 = forward(bf16_model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert bf16.dtype == jnp.float32
    scale = float(jnp.abs(f32).max())
    print("BF16", max_diff_on(mask, bf16, f32), scale, float(np.abs(np.asarray(f32)).mean()))
    assert max_diff_on(mask, bf16, f32) <= 0.02 * scale + 1e-3


def test_sequence_classification_matches_pytorch_and_round_trips(tmp_path):
    ref = perturbed(transformers.GPTJForSequenceClassification(tiny_config(num_labels=3)))
    ref.save_pretrained(tmp_path / "ref")
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    model = load_pretrained(tmp_path / "ref", "sequence-classification")
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    assert got.shape == (3, 3)
    assert np.abs(got - want).max() <= 1e-4

    save_pretrained(model, tmp_path / "out")
    back, info = transformers.GPTJForSequenceClassification.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again = torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy()
    assert np.abs(again - got).max() <= 1e-4


def test_classifier_head_on_lm_checkpoint_is_initialised_and_reported(gptj_lm, caplog):
    _, path = gptj_lm
    model = load_pretrained(path, "sequence-classification", num_labels=2)
    assert "score.weight" in caplog.text
    assert "lm_head.bias" in caplog.text
    assert model.score.kernel.shape == (64, 2)


def test_dropout_only_with_rngs(gptj_lm):
    _, path = gptj_lm
    ids, mask = (jnp.asarray(a) for a in padded_batch(101))
    eval_logits = forward(load_pretrained(path, "causal-lm"), ids, mask).logits
    model = load_pretrained(path, "causal-lm", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    # An "rbg" key: XLA's own generator compiles in about half the time threefry takes.
    train = forward(model, ids, mask, rngs=nnx.Rngs(dropout=jax.random.key(0, impl="rbg"))).logits
    assert bool(jnp.isfinite(train).all())
    assert float(jnp.abs(train - eval_logits).max()) > 1e-3
