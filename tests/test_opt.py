"""OPT against transformers PyTorch, from perturbed weights, in both layouts: 125m-style pre-norm and 350m-style
post-norm with project_in/project_out (word_embed_proj_dim apart from hidden_size); logits and hidden states on
left- and right-padded rows (positions from the mask, offset by 2), export round trips, the KV cache, greedy
generation on left-padded prompts, the classifier, biases and norm weights switched off, and a mesh."""

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
from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from tests.reference import max_diff_on, perturb, torch_forward  # noqa: E402

VOCAB, PAD, NEW = 101, 1, 24
RTOL = 1e-4  # of max(1, max |logit|)

CASES = {  # config fields beyond the shared tiny ones
    "125m-pre-norm-untied": dict(do_layer_norm_before=True, tie_word_embeddings=False),
    "350m-post-norm-projected": dict(do_layer_norm_before=False, word_embed_proj_dim=32),
}


def tiny_config(case, **kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
        max_position_embeddings=64, pad_token_id=PAD, bos_token_id=2, eos_token_id=2, dropout=0.0,
        init_std=0.2,  # large weights: greedy decoding wanders instead of repeating
    )  # fmt: skip
    return transformers.OPTConfig(**{**base, **CASES[case], **kw})


def rows(left: bool, lengths=(12, 9, 5)):
    """int32 ``(ids, mask)`` of random tokens (3..VOCAB-1) padded on the left or the right."""
    rng = np.random.RandomState(0)
    width = max(lengths)
    ids, mask = np.full((len(lengths), width), PAD, np.int32), np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        span = slice(width - n, width) if left else slice(0, n)
        ids[row, span], mask[row, span] = rng.randint(3, VOCAB, n), 1
    return ids, mask


def relative_diff(mask, got, want) -> float:
    """Largest difference on real positions, relative to max(1, max |want| there)."""
    want = np.asarray(want, np.float32)
    return max_diff_on(mask, got, want) / max(1.0, max_diff_on(mask, want, np.zeros_like(want)))


forward = nnx.jit(lambda model, *args, **kwargs: model(*args, **kwargs))


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """``(name, perturbed transformers LM, its folder)``."""
    torch.manual_seed(0)
    ref = perturb(transformers.OPTForCausalLM(tiny_config(request.param))).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, ref, path


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_logits_and_hidden_states_match_pytorch(case, left):
    _, ref, path = case
    ids, mask = rows(left)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = forward(load_pretrained(path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert relative_diff(mask, got, want) <= RTOL
    want = torch_forward(ref.model, input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    got = forward(load_pretrained(path, "base"), jnp.asarray(ids), jnp.asarray(mask)).last_hidden_state
    assert relative_diff(mask, got, want) <= RTOL


def test_export_loads_in_transformers_with_the_same_logits(case, tmp_path):
    _, ref, path = case
    save_pretrained(load_pretrained(path, "causal-lm"), tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and type(back) is transformers.OPTForCausalLM
    ids, mask = rows(left=True)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy(), want) <= RTOL


def test_kv_cache_decoding_matches_full_forward(case):
    """Left-padded rows fed as a prompt of 4 tokens, then chunks of 3, 1, 2, 1 and 1 through a longer cache:
    the positions come from the cache-long mask at the cache's index."""
    _, _, path = case
    model = load_pretrained(path, "causal-lm")
    ids, mask = rows(left=True)
    want = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    width, max_len = ids.shape[1], 16
    cache_mask = jnp.asarray(np.pad(mask, ((0, 0), (0, max_len - width)), constant_values=1))
    cache, logits, start = model.init_cache(len(ids), max_len), [], 0
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, ids, cache: nnx.merge(graphdef, state)(ids, cache_mask, cache=cache))
    for size in (4, 3, 1, 2, 1, 1):
        out = step(state, jnp.asarray(ids[:, start : start + size]), cache)
        logits.append(out.logits)
        cache, start = out.cache, start + size
    assert start == width and int(cache.index) == width
    assert relative_diff(mask, jnp.concatenate(logits, axis=1), want) <= 1e-5


def test_greedy_generation_matches_pytorch_on_left_padded_prompts(case):
    _, ref, path = case
    ids, mask = rows(left=True, lengths=(11, 6, 2))
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    want = out[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 4 for row in want)  # the tokens wander, so a wrong step shows
    got = generate(load_pretrained(path, "causal-lm"), ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


@pytest.mark.parametrize("name", list(CASES))
def test_classifier_matches_pytorch_on_both_paddings_and_round_trips(name, tmp_path):
    """The score of each row's last real token, from the word_embed_proj_dim-wide states."""
    torch.manual_seed(0)
    ref = perturb(transformers.OPTForSequenceClassification(tiny_config(name, num_labels=3))).eval()
    ref.save_pretrained(tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref", "sequence-classification")
    save_pretrained(model, tmp_path / "out")
    back, info = transformers.OPTForSequenceClassification.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    every_row = np.ones(3, np.int32)
    for left in (False, True):
        ids, mask = rows(left)
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        assert relative_diff(every_row, forward(model, jnp.asarray(ids), jnp.asarray(mask)), want) <= RTOL
        assert relative_diff(every_row, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= RTOL


def test_without_biases_or_norm_weights(tmp_path):
    """enable_bias=False and layer_norm_elementwise_affine=False: no such parameters, and the same logits."""
    torch.manual_seed(0)
    config = tiny_config("125m-pre-norm-untied", enable_bias=False, layer_norm_elementwise_affine=False)
    ref = perturb(transformers.OPTForCausalLM(config)).eval()
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "causal-lm")
    names = [name for name, _ in partition.named_leaves(nnx.state(model, nnx.Param))]
    assert not [name for name in names if name.endswith(("bias", "scale"))]
    ids, mask = rows(left=False)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= RTOL


def test_mesh_places_every_parameter_and_gives_the_same_logits(case):
    """On (dp=2, fsdp=2, mp=2): the projections split as GPT-2's, the same logits as one device."""
    name, _, path = case
    ids, mask = rows(left=True)
    want = forward(load_pretrained(path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    model = load_pretrained(path, "causal-lm", mesh=make_mesh("dp=2,fsdp=2,mp=2"))
    specs = {key: x.sharding.spec for key, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    assert specs["model/decoder/layers/0/fc1/kernel"] == P("fsdp", "mp")
    assert specs["model/decoder/layers/1/self_attn/out_proj/kernel"] == P("mp", "fsdp")
    assert ("model/decoder/project_in/kernel" in specs) == name.endswith("projected")
    assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= 1e-5


def test_layerdrop_is_a_one_line_error():
    with pytest.raises(JaxseqError, match=r"^OPT's layerdrop \(0.1\) is not supported; set it to 0"):
        from_config(tiny_config("125m-pre-norm-untied", layerdrop=0.1), "causal-lm")


def test_a_bare_decoder_checkpoint_loads_as_a_language_model(tmp_path, caplog):
    """The Hub's OPT checkpoints hold OPTModel's names (``decoder.*``, no ``model.`` prefix, no ``lm_head``): they
    load as the causal LM, its head tied to the token embeddings, with transformers' logits."""
    torch.manual_seed(0)
    ref = perturb(transformers.OPTForCausalLM(tiny_config("350m-post-norm-projected"))).eval()
    ref.model.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "causal-lm")
    assert "initialised" not in caplog.text
    ids, mask = rows(left=True)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= RTOL


def test_packed_classifier_rows_equal_unpacked(tmp_path):
    """The packer's positions restart at 0 in every example, as OPT counts them: packed examples score as unpacked
    ones, each read at its last token."""
    from jaxseq.data import packing

    torch.manual_seed(0)
    config = tiny_config("350m-post-norm-projected", num_labels=3)
    perturb(transformers.OPTForSequenceClassification(config)).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "sequence-classification")
    ids, mask = rows(left=False, lengths=(16, 9, 5, 7, 3))
    batch = packing.pack({"input_ids": ids, "attention_mask": mask}, 3, pool=type(model).pooled_token)
    packed = forward(model, **{k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(packed, forward(model, jnp.asarray(ids), jnp.asarray(mask)), rtol=1e-5, atol=1e-5)
