"""T5 (v1.0 and v1.1) against transformers PyTorch: logits, export round trip, cached decoding, bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.t5 import relative_position_bucket, shift_right  # noqa: E402
from tests.reference import max_diff_on, padded_batch, torch_forward  # noqa: E402

VOCAB = 101
VARIANTS = {
    "v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def tiny_config(variant, **kw):
    base = dict(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=128, vocab_size=VOCAB,
                relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0)
    return transformers.T5Config(**{**base, **VARIANTS[variant], **kw})


def batches():
    """Right-padded encoder and decoder inputs, longer than max_distance so the log buckets are used."""
    ids, mask = padded_batch(VOCAB, lengths=(24, 17, 6))
    dec_ids, dec_mask = padded_batch(VOCAB, lengths=(9, 22, 4), seed=1)
    return ids, mask, dec_ids, dec_mask


@nnx.jit
def forward(model, ids, mask, dec_ids, dec_mask, rngs=None):
    """One compiled forward per model: far faster here than running the small ops one by one."""
    return model(ids, mask, dec_ids, dec_mask, rngs=rngs)


def run(model, ids, mask, dec_ids, dec_mask, rngs=None):
    return forward(model, *(jnp.asarray(a) for a in (ids, mask, dec_ids, dec_mask)), rngs)


def torch_logits(ref, ids, mask, dec_ids, dec_mask):
    out = torch_forward(ref, input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids,
                        decoder_attention_mask=dec_mask)
    return out.logits.numpy(), out.encoder_last_hidden_state.numpy()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def t5(request, tmp_path_factory):
    """A random tiny transformers model saved with save_pretrained. transformers 5 ties ``lm_head`` to
    ``shared`` even for v1.1 configs unless the checkpoint holds a distinct ``lm_head.weight``, as real
    v1.1 / Flan-T5 checkpoints do; the v1.1 reference is given one, so it is shaped like those."""
    torch.manual_seed(0)
    ref = transformers.T5ForConditionalGeneration(tiny_config(request.param))
    if request.param == "v1.1":
        ref.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 64))
    path = tmp_path_factory.mktemp(f"t5-{request.param}")
    ref.save_pretrained(path)
    model = load_pretrained(path, "seq2seq-lm")
    return request.param, ref, path, model, run(model, *batches())


def test_relative_position_buckets_match_transformers():
    bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    relative = np.arange(-700, 701)
    for bidirectional in (True, False):
        for num_buckets, max_distance in ((8, 20), (32, 128)):
            want = bucket(torch.as_tensor(relative), bidirectional=bidirectional, num_buckets=num_buckets,
                          max_distance=max_distance).numpy()
            got = jax.jit(lambda r: relative_position_bucket(  # noqa: B023
                r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
            ))(jnp.asarray(relative, jnp.int32))
            np.testing.assert_array_equal(np.asarray(got), want)


def test_shift_right_matches_transformers():
    labels = np.array([[5, 6, 7, -100, -100], [8, -100, 9, 10, 1]])
    ref = transformers.T5ForConditionalGeneration(tiny_config("v1.0", decoder_start_token_id=3))
    want = ref._shift_right(torch.as_tensor(labels)).numpy()
    np.testing.assert_array_equal(np.asarray(shift_right(jnp.asarray(labels), 3, 0)), want)


def test_logits_match_pytorch(t5):
    variant, ref, _, model, out = t5
    assert hasattr(model, "lm_head") == (variant == "v1.1")
    ids, mask, dec_ids, dec_mask = batches()
    want, want_enc = torch_logits(ref, ids, mask, dec_ids, dec_mask)
    assert out.logits.dtype == jnp.float32 and out.logits.shape == want.shape
    assert max_diff_on(dec_mask, out.logits, want) <= 1e-4
    assert max_diff_on(mask, out.encoder_last_hidden_state, want_enc) <= 1e-4
    # The encoder output is reusable: decoding from it gives the same logits.
    decode = nnx.jit(lambda m, h, mask, ids, dec_mask: m.decode(ids, h, mask, dec_mask))
    again = decode(model, out.encoder_last_hidden_state, jnp.asarray(mask), jnp.asarray(dec_ids),
                   jnp.asarray(dec_mask)).logits
    assert max_diff_on(dec_mask, again, out.logits) <= 1e-5


def test_export_round_trip(t5, tmp_path):
    _, _, _, model, out = t5
    save_pretrained(model, tmp_path)
    back, info = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask, dec_ids, dec_mask = batches()
    want, _ = torch_logits(back, ids, mask, dec_ids, dec_mask)
    assert max_diff_on(dec_mask, out.logits, want) <= 1e-4


def test_cached_decoding_matches_teacher_forcing(t5):
    _, _, _, model, out = t5
    ids, mask, dec_ids, dec_mask = (jnp.asarray(a) for a in batches())
    full = out.logits
    steps, max_len = dec_ids.shape[1], dec_ids.shape[1] + 3  # spare cache positions stay masked
    cache_mask = jnp.pad(dec_mask, ((0, 0), (0, max_len - steps)))
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def encode(state, ids, mask):
        return nnx.merge(graphdef, state).encode(ids, mask)

    @jax.jit
    def step(state, token, mask, cache):
        traces.append(1)
        return nnx.merge(graphdef, state).decode(token, None, mask, cache_mask, cache=cache)

    encoder_hidden = encode(state, ids, mask)
    cache = model.init_cache(encoder_hidden, mask, max_len)
    logits = []
    for t in range(steps):
        out = step(state, dec_ids[:, t:t + 1], mask, cache)
        logits.append(out.logits)
        cache = out.cache
    assert len(traces) == 1 and int(cache.index) == steps
    assert max_diff_on(np.asarray(dec_mask), jnp.concatenate(logits, axis=1), full) <= 1e-4


def test_bfloat16_compute_stays_close_to_float32(t5):
    """bfloat16 keeps 8 significant bits (relative rounding 2**-9); through 2 + 2 layers of attention and
    feed-forward the errors compound to a few percent of the logits' range, far below what would change
    a prediction. Measured: 0.9% (v1.0) and 0.6% (v1.1) of the largest |logit|; bound 3%."""
    _, _, path, _, out = t5
    _, _, _, dec_mask = batches()
    want = np.asarray(out.logits)
    low = load_pretrained(path, "seq2seq-lm", dtype=jnp.bfloat16)
    got = run(low, *batches()).logits
    assert got.dtype == jnp.float32
    diff = max_diff_on(dec_mask, got, want)
    scale = float(np.abs(np.where(dec_mask[..., None], want, 0)).max())
    print(f"bf16 vs f32 max |diff| {diff:.4f} = {diff / scale:.2%} of max |logit| {scale:.2f}")
    assert diff <= 0.03 * scale


@pytest.fixture(scope="module")
def fresh():
    """A randomly initialised v1.1 model, wide enough to measure the initial weights' spread."""
    config = tiny_config("v1.1", d_model=256, d_ff=512, dropout_rate=0.5, relative_attention_num_buckets=256)
    return from_config(config, "seq2seq-lm")


def test_dropout_only_with_rngs(fresh):
    eval_a = run(fresh, *batches()).logits
    eval_b = run(fresh, *batches()).logits
    train = run(fresh, *batches(), rngs=nnx.Rngs(dropout=1)).logits
    np.testing.assert_array_equal(np.asarray(eval_a), np.asarray(eval_b))
    assert not np.allclose(np.asarray(train), np.asarray(eval_a))


def test_init_follows_transformers_scales(fresh):
    d, d_kv, d_ff = 256, 16, 512
    attn = fresh.encoder.block[0].layer[0].SelfAttention
    ff = fresh.decoder.block[1].layer[2].DenseReluDense
    expected = {
        "shared": (fresh.shared.embedding, 1.0),
        "lm_head": (fresh.lm_head.kernel, 1.0),
        "q": (attn.q.kernel, (d * d_kv) ** -0.5),
        "k": (attn.k.kernel, d**-0.5),
        "o": (attn.o.kernel, (4 * d_kv) ** -0.5),
        "relative_attention_bias": (attn.relative_attention_bias.embedding, d**-0.5),
        "wi_0": (ff.wi_0.kernel, d**-0.5),
        "wo": (ff.wo.kernel, d_ff**-0.5),
    }
    for name, (param, std) in expected.items():
        assert abs(np.std(np.asarray(param[...])) / std - 1) < 0.1, name
    np.testing.assert_array_equal(np.asarray(fresh.encoder.final_layer_norm.scale[...]), 1.0)


@pytest.mark.xfail(strict=True, reason="needs the loader to copy shared.weight into a missing lm_head.weight")
def test_v1_1_checkpoint_with_tied_lm_head(tmp_path):
    """transformers 5 saves a freshly built v1.1 model with lm_head tied to shared (unscaled output), so
    the checkpoint has no lm_head.weight; today the loader initialises it randomly instead."""
    ref = transformers.T5ForConditionalGeneration(tiny_config("v1.1"))
    ref.save_pretrained(tmp_path)
    ids, mask, dec_ids, dec_mask = batches()
    want, _ = torch_logits(ref, ids, mask, dec_ids, dec_mask)
    got = run(load_pretrained(tmp_path, "seq2seq-lm"), ids, mask, dec_ids, dec_mask).logits
    assert max_diff_on(dec_mask, got, want) <= 1e-4
