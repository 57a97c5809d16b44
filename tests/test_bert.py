"""BERT against transformers PyTorch: tiny random models of every task (load, export round trip, tied and
untied heads, cross-task checkpoints) and the real pretrained all-MiniLM-L6-v2 in float32 and bfloat16.

Forward passes go through one ``nnx.jit`` (a compile per model structure) instead of op-by-op dispatch,
which on CPU costs a compile per primitive and dominates the run time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.data import packing  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import attention, bert, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.hub import from_config, load_config  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402

VOCAB = 101
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar.",
    "Hello!",
    "JAX compiles numerical Python programs with XLA, and Flax builds neural networks on top of it.",
]


def tiny_config(**kw):
    base = dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        type_vocab_size=2,
        pad_token_id=0,
    )
    return transformers.BertConfig(**{**base, **kw})


def randomise(model):
    """Perturb every parameter, so that zero-initialised biases and unit LayerNorm scales are tested too."""
    return perturb(model, std=0.1)


def inputs():
    """Right-padded ids, mask, and token types (segment B over the second half of each row's tokens)."""
    ids, mask = padded_batch(VOCAB)
    lengths = mask.sum(1, keepdims=True)
    types = ((np.arange(ids.shape[1])[None, :] >= lengths // 2) & (mask == 1)).astype(np.int32)
    return ids, mask, types


@nnx.jit
def forward(model, *args, rngs=None):
    return model(*args, rngs=rngs)


def outputs(model, task, ids, mask=None, types=None):
    """(per-position output, per-row output or None) of a jaxseq or transformers model, as numpy.
    ``mask``/``types`` of None are left out, so each side applies its defaults."""
    given = {k: v for k, v in (("attention_mask", mask), ("token_type_ids", types)) if v is not None}
    if isinstance(model, torch.nn.Module):
        out = torch_forward(model, input_ids=ids, **given)
        if task == "base":
            return out.last_hidden_state.numpy(), out.pooler_output.numpy()
        return out.logits.numpy(), None
    out = forward(model, jnp.asarray(ids), *(jnp.asarray(v) for v in given.values()))
    if task == "base":
        return np.asarray(out.last_hidden_state), np.asarray(out.pooler_output)
    return np.asarray(out), None


def assert_close(task, mask, got, want, rtol=1e-5):
    """Outputs equal within ``rtol`` of the reference's scale, max |want| (float32 agrees to ~1e-6 of it)."""
    assert got[0].shape == want[0].shape
    per_row = task == "sequence-classification"  # one row of logits per sequence
    assert scaled_diff(None if per_row else mask, got[0], want[0]) <= rtol
    if want[1] is not None:
        assert scaled_diff(None, got[1], want[1]) <= rtol


CASES = {  # task, transformers class, config overrides, whether attention_mask/token_type_ids are passed
    "base": ("base", transformers.BertModel, {}, True),
    "base-decoder-defaults": ("base", transformers.BertModel, dict(is_decoder=True), False),
    "classification": ("sequence-classification", transformers.BertForSequenceClassification, dict(num_labels=3), True),
    "regression": ("sequence-classification", transformers.BertForSequenceClassification, dict(num_labels=1), True),
    "masked-lm": ("masked-lm", transformers.BertForMaskedLM, {}, True),
    "masked-lm-untied": ("masked-lm", transformers.BertForMaskedLM, dict(tie_word_embeddings=False), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_pytorch_and_round_trips(case, tmp_path):
    """Load a transformers checkpoint, match its outputs, save, and load the save back into transformers.
    The decoder case (causal self-attention) runs without mask and token types, checking the defaults."""
    task, torch_cls, kw, with_mask = CASES[case]
    ref = randomise(torch_cls(tiny_config(**kw)))
    ref.save_pretrained(tmp_path / "ref")
    ids, mask, types = inputs()
    if not with_mask:
        mask, types = None, None
    want = outputs(ref, task, ids, mask, types)

    model = load_pretrained(tmp_path / "ref", task)
    assert type(model).hf_architecture == torch_cls.__name__
    got = outputs(model, task, ids, mask, types)
    real = np.ones_like(ids) if mask is None else mask
    assert_close(task, real, got, want)
    assert got[0].dtype == np.float32
    if task == "sequence-classification":
        assert got[0].shape == (3, kw["num_labels"])
    if task == "masked-lm":
        assert got[0].shape == (3, 12, VOCAB)

    save_pretrained(model, tmp_path / "out")
    back, info = torch_cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_close(task, real, outputs(back, task, ids, mask, types), got)


def test_pretraining_checkpoint_as_masked_lm(tmp_path, caplog):
    """A BertForPreTraining checkpoint (pooler, cls.predictions, cls.seq_relationship), with the tied copies
    ``cls.predictions.decoder.*`` and the ``position_ids`` buffer written out as old checkpoints have them."""
    from safetensors.torch import save_file

    ref = randomise(transformers.BertForPreTraining(tiny_config()))
    ref.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["bert.embeddings.position_ids"] = torch.arange(64)[None]
    assert "cls.predictions.decoder.weight" in state and "cls.predictions.decoder.bias" in state
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})

    model = load_pretrained(tmp_path, "masked-lm")
    assert "initialised" not in caplog.text
    dropped = caplog.text.split("does not use:")[1]
    assert "cls.seq_relationship.weight" in dropped and "bert.pooler.dense.weight" in dropped
    assert "position_ids" not in caplog.text and "decoder" not in caplog.text
    ids, mask, types = inputs()
    want = torch_forward(ref, input_ids=ids, attention_mask=mask, token_type_ids=types).prediction_logits
    assert scaled_diff(mask, outputs(model, "masked-lm", ids, mask, types)[0], want.numpy()) <= 1e-5


def test_masked_lm_checkpoint_as_classifier_initialises_pooler(tmp_path, caplog):
    transformers.BertForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "sequence-classification", num_labels=2)
    new, dropped = caplog.text.split("lacks:")[1].split("does not use:")
    assert "bert.pooler.dense.weight" in new and "classifier.weight" in new
    assert "cls.predictions.bias" in dropped and "cls.predictions.transform.dense.weight" in dropped
    assert model.bert.pooler.dense.kernel.shape == (64, 64)


def test_every_dropout_site_gets_the_rngs(monkeypatch):
    """Training passes ``rngs`` to each dropout: embeddings, and per layer the attention probabilities, the
    attention output and the feed-forward output, then the classifier (traced only: no compile)."""
    calls = []

    def counting(x, rate, rngs):
        calls.append((rate, rngs is not None))
        return x

    monkeypatch.setattr(bert.modeling, "dropout", counting)
    monkeypatch.setattr(attention, "dropout", counting)
    config = tiny_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2, classifier_dropout=0.3)
    model = nnx.eval_shape(lambda: bert.BertForSequenceClassification(config, rngs=nnx.Rngs(0)))
    ids, mask, types = (jnp.asarray(a) for a in inputs())
    nnx.eval_shape(lambda m, r: m(ids, mask, types, rngs=r), model, nnx.Rngs(dropout=1))
    layer = [(0.2, True), (0.1, True), (0.1, True)]
    assert calls == [(0.1, True), *layer, *layer, (0.3, True)]


@pytest.mark.parametrize("packed", [False, True])
def test_classifier_runs_its_last_layer_at_the_pooled_tokens_alone(packed):
    """A classifier reads only [CLS]: its last layer computes queries, feed-forward and norms there alone
    (``pooled_only``). Logits and every gradient equal the whole-sequence path's, on padded and packed rows."""
    config = tiny_config(num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = bert.BertForSequenceClassification(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    model = nnx.merge(graphdef, jax.tree.map(lambda p: p + 0.1 * jax.random.normal(next(keys), p.shape), params))
    ids, mask = padded_batch(VOCAB, lengths=(16, 9, 5, 7, 3))
    types = ((np.arange(16)[None, :] >= mask.sum(1, keepdims=True) // 2) & (mask == 1)).astype(np.int32)
    batch = dict(input_ids=ids, attention_mask=mask, token_type_ids=types)
    if packed:
        batch = packing.pack(batch, packing.rows_needed([batch]))
        assert batch["input_ids"].shape[0] == 3
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    def whole(m):
        return m.classifier(m.bert(**batch).pooler_output)

    def pooled(m):
        return m(**batch)

    np.testing.assert_allclose(pooled(model), whole(model), rtol=1e-5, atol=1e-6)
    want, got = (nnx.grad(lambda m, f=f: jnp.sum(f(m) ** 2))(model) for f in (whole, pooled))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6), want, got)


def test_unsupported_configs_and_lengths_are_clear_errors():
    with pytest.raises(JaxseqError, match="position_embedding_type"):
        bert.BertModel(tiny_config(position_embedding_type="relative_key"), rngs=nnx.Rngs(0))
    with pytest.raises(JaxseqError, match="add_cross_attention"):
        bert.BertModel(tiny_config(is_decoder=True, add_cross_attention=True), rngs=nnx.Rngs(0))
    model = nnx.eval_shape(lambda: bert.BertModel(tiny_config(), rngs=nnx.Rngs(0)))
    with pytest.raises(JaxseqError, match="max_position_embeddings"):
        model(jnp.ones((1, 65), jnp.int32))


# --------------------------------------------------------------------------- the real all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm():
    """The checkpoint (a bare BertModel with the old ``embeddings.position_ids``), a tokenised batch of
    sentences of different lengths, transformers' outputs and ours in float32."""
    path = shared_asset("models/all-MiniLM-L6-v2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    enc = tok(SENTENCES, padding=True, return_tensors="np")
    batch = {k: enc[k].astype(np.int32) for k in ("input_ids", "attention_mask", "token_type_ids")}
    assert len(set(batch["attention_mask"].sum(1))) == len(SENTENCES)  # padding is exercised
    ref = transformers.BertModel.from_pretrained(path)
    want = torch_forward(ref, **batch)
    model = load_pretrained(path, "base")
    got = forward(model, *(jnp.asarray(v) for v in batch.values()))
    return path, batch, want, model, got


def test_minilm_matches_pytorch(minilm):
    _, batch, want, _, got = minilm
    mask = batch["attention_mask"]
    assert max_diff_on(mask, got.last_hidden_state, want.last_hidden_state.numpy()) <= 1e-4
    assert np.abs(np.asarray(got.pooler_output) - want.pooler_output.numpy()).max() <= 1e-4


def test_minilm_as_classifier_keeps_pooler_and_reports_new_classifier(minilm, caplog):
    path, batch, _, base, _ = minilm
    model = load_pretrained(path, "sequence-classification", num_labels=2)
    assert "initialised weights that the checkpoint lacks: classifier.bias, classifier.weight\n" in caplog.text
    assert "pooler" not in caplog.text  # the checkpoint's pooler is loaded, not re-initialised
    assert np.array_equal(model.bert.pooler.dense.kernel[...], base.pooler.dense.kernel[...])
    assert model.classifier.kernel.shape == (384, 2)
    fresh = from_config(load_config(path, num_labels=2), "sequence-classification")  # the same seed, 0
    for name in ("kernel", "bias"):  # the new head is the seed's own (compiled unoptimised: to rounding)
        want = np.asarray(getattr(fresh.classifier, name)[...])
        np.testing.assert_allclose(getattr(model.classifier, name)[...], want, rtol=1e-6, atol=1e-8)
    logits = forward(model, *(jnp.asarray(v) for v in batch.values()))
    assert logits.shape == (len(SENTENCES), 2) and logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))


def test_minilm_bfloat16_compute_stays_close(minilm):
    """bfloat16 keeps 8 significant bits (relative rounding error up to 2**-8 = 0.4%) at every matmul input and
    activation, compounding over 6 layers; the float32 master weights stay exact. Measured max |bf16 - f32| of
    last_hidden_state on real tokens: 0.035 (mean 0.0033; 0.048 when run op by op without jit fusion), against
    states of magnitude up to 6.0. The bound 0.15 leaves 3x margin over both and still catches real breakage
    (a wrong mask or a lost residual moves states by O(1))."""
    path, batch, _, _, f32 = minilm
    model = load_pretrained(path, "base", dtype=jnp.bfloat16)
    out = forward(model, *(jnp.asarray(v) for v in batch.values()))
    assert out.last_hidden_state.dtype == jnp.bfloat16
    diff = max_diff_on(batch["attention_mask"], out.last_hidden_state, f32.last_hidden_state)
    assert diff <= 0.15


def test_partition_rules_cover_every_task_and_place_minilm(minilm):
    """Every parameter of every task has a rule, and the real MiniLM shapes divide on a 2 x 4 mesh (sharding
    changes only where arrays live, not the math: the sharded-step parity is test_partition's business)."""
    from jaxseq import partition
    from jaxseq.mesh import make_mesh

    rules = partition.get_partition_rules("bert")
    for task, kw in [
        ("base", {}),
        ("sequence-classification", dict(num_labels=1)),
        ("masked-lm", {}),
        ("masked-lm", dict(tie_word_embeddings=False)),
    ]:
        make = bert.FAMILY.tasks[task]
        state = nnx.state(nnx.eval_shape(lambda make=make, kw=kw: make(tiny_config(**kw), rngs=nnx.Rngs(0))), nnx.Param)
        partition.match_partition_rules(rules, state)  # raises if a parameter has no rule

    path, _, _, single, _ = minilm
    model = load_pretrained(path, "base", mesh=make_mesh("fsdp=2,mp=4"))
    query = model.encoder.layer[0].attention.self.query.kernel[...]
    assert query.sharding.spec == P("fsdp", "mp")
    assert {s.data.shape for s in query.addressable_shards} == {(192, 96)}
    # MiniLM's 30522 tokens are padded to 30592 rows (a multiple of 128), which split over mp=4
    words = model.embeddings.word_embeddings.embedding[...]
    assert words.sharding.spec == P("mp", "fsdp")
    assert {s.data.shape for s in words.addressable_shards} == {(30592 // 4, 192)}
    np.testing.assert_array_equal(np.asarray(words)[30522:], 0.0)
    np.testing.assert_array_equal(np.asarray(words), np.asarray(single.embeddings.word_embeddings.embedding[...]))
    want = single.encoder.layer[0].attention.self.query.kernel[...]
    np.testing.assert_array_equal(np.asarray(query), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_types_are_a_one_hot_product_equal_to_the_lookup(dtype):
    """BERT's token types: the same values and gradient as ``nnx.Embed``'s gather, and no scatter-add into
    the table in the compiled gradient (many updates of one row serialise on a GPU)."""
    from jaxseq.models.layers import one_hot_lookup

    embed = nnx.Embed(3, 16, dtype=dtype, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 3, (4, 9)))
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(4, 9, 16)), dtype)
    graphdef, state = nnx.split(embed)

    def loss(state, lookup):
        out = lookup(nnx.merge(graphdef, state), ids)
        return (out.astype(jnp.float32) * weights.astype(jnp.float32)).sum(), out

    (_, got), grad = jax.value_and_grad(loss, has_aux=True)(state, one_hot_lookup)
    (_, want), want_grad = jax.value_and_grad(loss, has_aux=True)(state, lambda e, i: e(i))
    assert got.dtype == want.dtype and bool((got == want).all())
    # the gradient is each row's sum of its tokens' cotangents; the gather's scatter-add sums them in
    # ``dtype``, the product in float32 (rounded once to ``dtype``), so it is at least as close to the exact sum
    exact = np.zeros((3, 16))
    np.add.at(exact, np.asarray(ids), np.asarray(weights, np.float64))
    error = {
        name: np.abs(np.asarray(g["embedding"].get_value(), np.float64) - exact).max()
        for name, g in (("product", grad), ("gather", want_grad))
    }
    rounding = np.abs(exact).max() * (2**-8 if dtype == jnp.bfloat16 else 1e-6)  # of the gradient's dtype
    assert error["product"] <= min(error["gather"], rounding) + 1e-7, error

    model = bert.BertModel(tiny_config(), dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    input_ids = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 8)))
    step = jax.jit(jax.grad(lambda s: nnx.merge(graphdef, s)(input_ids).last_hidden_state.astype(jnp.float32).sum()))
    text = step.lower(state).compile().as_text()
    scattered = {line.split(" = ")[1].split("{")[0] for line in text.splitlines() if " scatter(" in line}
    assert scattered and not any(shape.startswith("f32[2,64]") for shape in scattered), scattered


def test_exact_gelu_derivatives_match_pytorch():
    """``gelu_exact``'s written-out derivative (one array kept for the backward pass) against PyTorch's GELU:
    values, first and second derivatives over the range where BERT's activations live."""
    from jaxseq.models.layers import gelu_exact

    x = np.linspace(-10, 10, 4001).astype(np.float32)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.gelu(xt)
    (dy,) = torch.autograd.grad(y.sum(), xt, create_graph=True)
    (d2y,) = torch.autograd.grad(dy.sum(), xt)
    first = jax.vmap(jax.grad(gelu_exact))
    second = jax.vmap(jax.grad(jax.grad(gelu_exact)))
    np.testing.assert_allclose(gelu_exact(x), y.detach().numpy(), atol=2e-6)
    np.testing.assert_allclose(first(x), dy.detach().numpy(), atol=2e-6)
    np.testing.assert_allclose(second(x), d2y.numpy(), atol=2e-6)
    residuals = jax.linearize(gelu_exact, jnp.asarray(x))[1]  # what the tangent map closes over: the slope
    assert len(jax.tree.leaves(residuals)) == 1
