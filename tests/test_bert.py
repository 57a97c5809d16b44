"""BERT against transformers PyTorch: tiny random models of every task (load, export round trip, tied and
untied heads, cross-task checkpoints) and the real pretrained all-MiniLM-L6-v2 in float32 and bfloat16."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import bert, load_pretrained, save_pretrained  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.reference import max_diff_on, padded_batch, torch_forward  # noqa: E402

VOCAB = 101
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar.",
    "Hello!",
    "JAX compiles numerical Python programs with XLA, and Flax builds neural networks on top of it.",
]


def tiny_config(**kw):
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                vocab_size=VOCAB, max_position_embeddings=64, type_vocab_size=2, pad_token_id=0)
    return transformers.BertConfig(**{**base, **kw})


def randomise(model):
    """Perturb every parameter, so that zero-initialised biases and unit LayerNorm scales are tested too."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def inputs():
    """Right-padded ids, mask, and token types (segment B over the second half of each row's tokens)."""
    ids, mask = padded_batch(VOCAB)
    lengths = mask.sum(1, keepdims=True)
    types = ((np.arange(ids.shape[1])[None, :] >= lengths // 2) & (mask == 1)).astype(np.int32)
    return ids, mask, types


@nnx.jit
def forward(model, *args, rngs=None):
    """The model's forward pass, compiled once per model structure (much faster than op-by-op on CPU)."""
    return model(*args, rngs=rngs)


def outputs(model, task, ids, mask, types):
    """(per-position output, per-row output or None) of a jaxseq or transformers model, as numpy."""
    if isinstance(model, torch.nn.Module):
        out = torch_forward(model, input_ids=ids, attention_mask=mask, token_type_ids=types)
        if task == "base":
            return out.last_hidden_state.numpy(), out.pooler_output.numpy()
        return out.logits.numpy(), None
    out = forward(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    if task == "base":
        return np.asarray(out.last_hidden_state), np.asarray(out.pooler_output)
    return np.asarray(out), None


def assert_close(task, mask, got, want, tol=1e-4):
    if task == "sequence-classification":  # one row of logits per sequence
        assert got[0].shape == want[0].shape
        assert np.abs(got[0] - want[0]).max() <= tol
    else:
        assert got[0].shape == want[0].shape
        assert max_diff_on(mask, got[0], want[0]) <= tol
    if want[1] is not None:
        assert np.abs(got[1] - want[1]).max() <= tol


CASES = {
    "base": ("base", transformers.BertModel, {}),
    "base-decoder": ("base", transformers.BertModel, dict(is_decoder=True)),
    "classification": ("sequence-classification", transformers.BertForSequenceClassification, dict(num_labels=3)),
    "regression": ("sequence-classification", transformers.BertForSequenceClassification, dict(num_labels=1)),
    "masked-lm": ("masked-lm", transformers.BertForMaskedLM, {}),
    "masked-lm-untied": ("masked-lm", transformers.BertForMaskedLM, dict(tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_pytorch_and_round_trips(case, tmp_path):
    task, torch_cls, kw = CASES[case]
    ref = randomise(torch_cls(tiny_config(**kw)))
    ref.save_pretrained(tmp_path / "ref")
    ids, mask, types = inputs()
    want = outputs(ref, task, ids, mask, types)

    model = load_pretrained(tmp_path / "ref", task)
    assert type(model).hf_architecture == torch_cls.__name__
    got = outputs(model, task, ids, mask, types)
    assert_close(task, mask, got, want)
    if task == "sequence-classification":
        assert got[0].shape == (3, kw["num_labels"]) and got[0].dtype == np.float32
    if task == "masked-lm":
        assert got[0].shape == (3, 12, VOCAB) and got[0].dtype == np.float32

    save_pretrained(model, tmp_path / "out")
    back, info = torch_cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_close(task, mask, outputs(back, task, ids, mask, types), got)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bert-base")
    ref = randomise(transformers.BertModel(tiny_config()))
    ref.save_pretrained(path)
    return ref, path


def test_defaults_are_zero_token_types_and_no_padding(tiny_base):
    ref, path = tiny_base
    ids, _, _ = inputs()
    want = torch_forward(ref, input_ids=ids).last_hidden_state.numpy()
    got = forward(load_pretrained(path, "base"), jnp.asarray(ids)).last_hidden_state
    assert np.abs(np.asarray(got) - want).max() <= 1e-4


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
    assert max_diff_on(mask, outputs(model, "masked-lm", ids, mask, types)[0], want.numpy()) <= 1e-4


def test_masked_lm_checkpoint_as_classifier_initialises_pooler(tmp_path, caplog):
    transformers.BertForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "sequence-classification", num_labels=2)
    new, dropped = caplog.text.split("lacks:")[1].split("does not use:")
    assert "bert.pooler.dense.weight" in new and "classifier.weight" in new
    assert "cls.predictions.bias" in dropped and "cls.predictions.transform.dense.weight" in dropped
    ids, mask, types = (jnp.asarray(a) for a in inputs())
    eval_a, eval_b = forward(model, ids, mask, types), forward(model, ids, mask, types)
    train = forward(model, ids, mask, types, rngs=nnx.Rngs(dropout=1))
    assert np.array_equal(eval_a, eval_b)  # rngs=None is deterministic; with rngs, dropout is on
    assert np.all(np.isfinite(train)) and not np.allclose(train, eval_a)


def test_unsupported_configs_and_lengths_are_clear_errors(tiny_base):
    with pytest.raises(JaxseqError, match="position_embedding_type"):
        bert.BertModel(tiny_config(position_embedding_type="relative_key"), rngs=nnx.Rngs(0))
    with pytest.raises(JaxseqError, match="add_cross_attention"):
        bert.BertModel(tiny_config(is_decoder=True, add_cross_attention=True), rngs=nnx.Rngs(0))
    model = load_pretrained(tiny_base[1], "base")
    with pytest.raises(JaxseqError, match="max_position_embeddings"):
        model(jnp.ones((1, 65), jnp.int32))


# --------------------------------------------------------------------------- the real all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm():
    path = shared_asset("models/all-MiniLM-L6-v2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    enc = tok(SENTENCES, padding=True, return_tensors="np")
    batch = {k: enc[k].astype(np.int32) for k in ("input_ids", "attention_mask", "token_type_ids")}
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths)) == len(SENTENCES)  # really different lengths, so padding is exercised
    ref = transformers.BertModel.from_pretrained(path)
    want = torch_forward(ref, **batch)
    got = forward(load_pretrained(path, "base"), *(jnp.asarray(batch[k]) for k in batch))
    return path, batch, want, got


def test_minilm_matches_pytorch(minilm):
    _, batch, want, got = minilm
    mask = batch["attention_mask"]
    assert max_diff_on(mask, got.last_hidden_state, want.last_hidden_state.numpy()) <= 1e-4
    assert np.abs(np.asarray(got.pooler_output) - want.pooler_output.numpy()).max() <= 1e-4


def test_minilm_as_classifier_keeps_pooler_and_reports_new_classifier(minilm, caplog):
    path, batch, want, _ = minilm
    model = load_pretrained(path, "sequence-classification", num_labels=2)
    assert "classifier.weight" in caplog.text and "classifier.bias" in caplog.text
    assert "pooler" not in caplog.text  # the checkpoint's pooler is loaded, not re-initialised
    assert model.classifier.kernel.shape == (384, 2)
    ids, mask, types = (jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))
    pooled = forward(model.bert, ids, mask, types).pooler_output
    assert np.abs(np.asarray(pooled) - want.pooler_output.numpy()).max() <= 1e-4
    logits = forward(model, ids, mask, types)
    assert logits.shape == (len(SENTENCES), 2) and logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))


def test_minilm_bfloat16_compute_stays_close(minilm):
    """bfloat16 keeps 8 significant bits (relative rounding 2**-9); over 6 post-norm layers the rounding of
    every matmul input and residual compounds. Measured: max |bf16 - f32| = BF16_MEASURED on hidden states
    of max magnitude ~MAX_H; the bound leaves ~2x margin, still far below the size of the states."""
    path, batch, _, f32 = minilm
    model = load_pretrained(path, "base", dtype=jnp.bfloat16)
    out = forward(model, *(jnp.asarray(batch[k]) for k in batch))
    assert out.last_hidden_state.dtype == jnp.bfloat16
    mask = batch["attention_mask"]
    diff = max_diff_on(mask, out.last_hidden_state, f32.last_hidden_state)
    print(f"bf16 max abs diff {diff:.4f}, max |h| {np.abs(np.asarray(f32.last_hidden_state)).max():.3f}")
    assert diff <= 1.0
