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
from tests.reference import max_diff_on, padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402

VOCAB = 101
RTOL = 1e-5  # max |jaxseq - transformers| over max |transformers| (float32 agrees to ~1e-6 of the scale)
VARIANTS = {
    "v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def tiny_config(variant, **kw):
    base = dict(
        num_layers=2,
        num_decoder_layers=2,
        d_model=64,
        d_kv=16,
        num_heads=4,
        d_ff=128,
        vocab_size=VOCAB,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        decoder_start_token_id=0,
    )
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
    out = torch_forward(
        ref, input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask
    )
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
    perturb(ref)
    path = tmp_path_factory.mktemp(f"t5-{request.param}")
    ref.save_pretrained(path)
    model = load_pretrained(path, "seq2seq-lm")
    return request.param, ref, path, model, run(model, *batches())


def test_relative_position_buckets_match_transformers():
    bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    relative = np.arange(-700, 701)
    cases = [(b, n, d) for b in (True, False) for n, d in ((8, 20), (32, 128))]
    got = jax.jit(
        lambda r: [relative_position_bucket(r, bidirectional=b, num_buckets=n, max_distance=d) for b, n, d in cases]
    )(jnp.asarray(relative, jnp.int32))
    for (b, n, d), ours in zip(cases, got):
        want = bucket(torch.as_tensor(relative), bidirectional=b, num_buckets=n, max_distance=d).numpy()
        np.testing.assert_array_equal(np.asarray(ours), want)


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
    assert scaled_diff(dec_mask, out.logits, want) <= RTOL
    assert scaled_diff(mask, out.encoder_last_hidden_state, want_enc) <= RTOL


def test_export_round_trip(t5, tmp_path):
    _, _, _, model, out = t5
    save_pretrained(model, tmp_path)
    back, info = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask, dec_ids, dec_mask = batches()
    want, _ = torch_logits(back, ids, mask, dec_ids, dec_mask)
    assert scaled_diff(dec_mask, out.logits, want) <= RTOL


def test_loads_checkpoint_with_tied_copies_and_legacy_bias(t5, tmp_path):
    """Old checkpoints store every tied copy and an unused cross-attention bias; they load all the same."""
    _, _, path, model, _ = t5
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        tensors.setdefault(name, tensors["shared.weight"])  # v1.1 keeps its own lm_head
    tensors["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = np.zeros((8, 4), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    again = load_pretrained(tmp_path, "seq2seq-lm")
    for (name, ours), (_, theirs) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again))):
        np.testing.assert_array_equal(np.asarray(ours.get_value()), np.asarray(theirs.get_value()), err_msg=str(name))


def test_cached_decoding_matches_teacher_forcing(t5):
    """Under one jit: encode once, init_cache, prefill the first decoder tokens together, then feed the
    rest one at a time through the cache; equals the teacher-forced forward on the real positions."""
    _, _, _, model, out = t5
    ids, mask, dec_ids, dec_mask = (jnp.asarray(a) for a in batches())
    steps, max_len, prefill = dec_ids.shape[1], dec_ids.shape[1] + 3, 3  # spare positions stay masked
    cache_mask = jnp.pad(dec_mask, ((0, 0), (0, max_len - steps)))
    graphdef, state = nnx.split(model)

    @jax.jit
    def generate(state):
        model = nnx.merge(graphdef, state)
        encoder_hidden = model.encode(ids, mask)
        cache = model.init_cache(encoder_hidden, mask, max_len)
        first = model.decode(dec_ids[:, :prefill], None, mask, cache_mask, cache=cache)

        def step(cache, token):
            step_out = model.decode(token[:, None], None, mask, cache_mask, cache=cache)
            return step_out.cache, step_out.logits[:, 0]

        cache, logits = jax.lax.scan(step, first.cache, dec_ids[:, prefill:].T)
        return cache, jnp.concatenate([first.logits, jnp.swapaxes(logits, 0, 1)], axis=1)

    cache, logits = generate(state)
    assert int(cache.index) == steps
    assert [kv.k.shape for kv in cache.cross] == [(3, 4, ids.shape[1], 16)] * 2
    assert max_diff_on(np.asarray(dec_mask), logits, out.logits) <= 1e-4


def test_bfloat16_compute_stays_close_to_float32(t5):
    """bfloat16 keeps 8 significant bits: every matmul output and residual add is rounded by up to 2**-9
    (0.2%) of its size, and through the 2 + 2 blocks these roundings compound to about 1% of the logits'
    size. Measured on the perturbed references, max |diff|: 0.050 with |logits| <= 5.8 (v1.0, 0.9%) and 0.66
    with |logits| <= 30 (v1.1, whose untied head is not scaled down; 2.2%). The bound, 5% of the largest
    |logit|, leaves 2x margin; a wrong dtype somewhere (a bfloat16 softmax or norm) costs far more."""
    _, _, path, _, out = t5
    _, _, _, dec_mask = batches()
    want = np.asarray(out.logits)
    low = load_pretrained(path, "seq2seq-lm", dtype=jnp.bfloat16)
    got = run(low, *batches()).logits
    assert got.dtype == jnp.float32
    diff = max_diff_on(dec_mask, got, want)
    scale = float(np.abs(np.where(dec_mask[..., None], want, 0)).max())
    print(f"bf16 vs f32 max |diff| {diff:.4f} = {diff / scale:.2%} of max |logit| {scale:.2f}")
    assert diff <= 0.05 * scale


@pytest.fixture(scope="module")
def fresh():
    """A randomly initialised one-layer v1.1 model (many buckets, to measure their initial spread)."""
    config = tiny_config(
        "v1.1", num_layers=1, num_decoder_layers=1, dropout_rate=0.5, relative_attention_num_buckets=256
    )
    return from_config(config, "seq2seq-lm")


def test_dropout_only_with_rngs(fresh):
    ids, mask, _, _ = (jnp.asarray(a) for a in batches())

    @nnx.jit
    def encode(model, rngs):
        return model.encode(ids, mask), model.encode(ids, mask, rngs=rngs)

    eval_out, train_out = (np.asarray(h) for h in encode(fresh, nnx.Rngs(dropout=1)))
    eval_again, train_again = (np.asarray(h) for h in encode(fresh, nnx.Rngs(dropout=2)))
    np.testing.assert_array_equal(eval_out, eval_again)
    assert np.isfinite(train_out).all()
    assert not np.allclose(train_out, eval_out) and not np.allclose(train_out, train_again)


def test_init_follows_transformers_scales(fresh):
    d, d_kv, d_ff = 64, 16, 128
    attn = fresh.encoder.block[0].layer[0].SelfAttention
    ff = fresh.decoder.block[0].layer[2].DenseReluDense
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


def test_fresh_v11_checkpoint_of_transformers_5_takes_lm_head_from_shared(tmp_path):
    """transformers 5 saves a freshly built v1.1 model with its head tied, i.e. only ``shared.weight``."""
    torch.manual_seed(1)
    ref = perturb(transformers.T5ForConditionalGeneration(tiny_config("v1.1")))
    ref.save_pretrained(tmp_path)
    ids, mask, dec_ids, dec_mask = batches()
    want, _ = torch_logits(ref, ids, mask, dec_ids, dec_mask)
    got = run(load_pretrained(tmp_path, "seq2seq-lm"), ids, mask, dec_ids, dec_mask).logits
    assert scaled_diff(dec_mask, got, want) <= RTOL


def test_config_overrides_make_a_v11_model():
    """``--config_overrides feed_forward_proj=gated-gelu,tie_word_embeddings=false`` on a built config (whose
    derived is_gated_act, dense_act_fn and scale_decoder_outputs keep their first values): gated GELU, own head."""
    from jaxseq.models.hub import apply_overrides, parse_overrides
    from jaxseq.models.registry import model_class
    from jaxseq.models.t5 import T5DenseGatedActDense, feed_forward

    config = transformers.AutoConfig.for_model("t5", d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2)
    text = "feed_forward_proj=gated-gelu,tie_word_embeddings=false"
    config = apply_overrides(config, **parse_overrides(text, config))
    assert feed_forward(config) == (True, "gelu_new")
    assert feed_forward(transformers.T5Config(feed_forward_proj="gated-silu")) == (True, "silu")
    model = nnx.eval_shape(lambda: model_class(config, "seq2seq-lm")(config, rngs=nnx.Rngs(0)))
    assert isinstance(model.encoder.block[0].layer[1].DenseReluDense, T5DenseGatedActDense)
    assert not model.tied and model.lm_head.kernel.shape == (32, config.vocab_size)


def test_position_bias_gradient_has_no_scatter_into_its_table():
    """The relative position bias is a one-hot product (as T5X computes it): its gradient is a matmul, where a
    gather's is a scatter-add of every (query, key) pair into a few rows, which serialises on GPUs and TPUs."""
    model = from_config(tiny_config("v1.1"), "seq2seq-lm")
    graphdef, state = nnx.split(model)
    ids, mask, dec_ids, dec_mask = (jnp.asarray(a) for a in batches())

    def loss(state):
        return nnx.merge(graphdef, state)(ids, mask, dec_ids, dec_mask).logits.astype(jnp.float32).sum()

    text = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    scattered = {line.split(" = ")[1].split("{")[0] for line in text.splitlines() if " scatter(" in line}
    assert scattered and "f32[8,4]" not in scattered, scattered  # the word embeddings' scatter stays
