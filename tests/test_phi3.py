"""Phi-3 against transformers PyTorch from perturbed weights: logits on right- and left-padded rows (fused
qkv_proj and gate_up_proj, grouped-query attention, partial rotary embeddings, a sliding window shorter than the
text, LongRoPE's short and long factors and attention factor, tied and untied heads), the base model's hidden
states, the KV cache, greedy generation, the export that transformers loads, the classifier, scanned layers, a
(dp, fsdp, mp) mesh, and the one-line refusal of a rope type Phi-3 does not have. Training-step parity is in
``tests/test_step_parity.py``, the FLOP count in ``tests/test_flops.py``."""

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
from jaxseq.models import Execution, from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.phi3.modeling import rope_frequencies  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, torch_forward  # noqa: E402
from tests.test_llama import prompts  # noqa: E402

VOCAB, NEW, PAD = 101, 24, 0
TOL = 1e-4  # of max(1, max |logit|) on the real positions

forward = nnx.jit(lambda model, *args, **kwargs: model(*args, **kwargs))


def longrope(original: int, rotated: int) -> dict:
    """LongRoPE parameters for ``rotated / 2`` frequencies, the short and long factors apart per frequency."""
    half = rotated // 2
    return {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
        "short_factor": [1.0 + 0.3 * i for i in range(half)], "long_factor": [2.0 + 1.5 * i for i in range(half)],
    }  # fmt: skip


CASES = {
    # 4 query heads on 2 key/value heads, rotation over half of each head, every layer sliding over 4 positions,
    # untied head
    "phi3-gqa-partial-window": dict(num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=4),
    # LongRoPE past an original length of 8 (the 12-token rows take the long factors, rows of 8 or fewer the
    # short ones), attention factor from max_position_embeddings / original (128 / 8), rotation over 3/4 of each
    # head (Phi-4-mini's), tied head
    "phi3-longrope-tied": dict(
        num_key_value_heads=4,
        partial_rotary_factor=0.75,
        rope_parameters=longrope(8, 12),
        original_max_position_embeddings=8,
        tie_word_embeddings=True,
    ),
    # LongRoPE that generation never leaves the short factors of (original 64), attention factor 1.08
    "phi3-longrope-short": dict(rope_parameters=longrope(64, 16), original_max_position_embeddings=64),
}


# the cases whose decoding stays on one side of original_max_position_embeddings: the original-8 LongRoPE case
# crosses it, where transformers' generate recomputes the whole prefix with the long factors and jaxseq's cache
# keeps the keys as they were rotated (jaxseq.models.phi3.modeling); its logits are compared above
UNCROSSED = ["phi3-gqa-partial-window", "phi3-longrope-short"]


def tiny_config(case, **kw):
    base = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        initializer_range=0.3,  # large weights: greedy decoding wanders instead of repeating
    )  # fmt: skip
    return transformers.Phi3Config(**{**base, **CASES[case], **kw})


def relative_diff(mask, got, want) -> float:
    """Largest difference on real positions, relative to max(1, max |want| there)."""
    want = np.asarray(want, np.float32)
    return max_diff_on(mask, got, want) / max(1.0, max_diff_on(mask, want, np.zeros_like(want)))


def batches():
    """Rows of 12, 9 and 5 tokens padded on the right and on the left, and rows of at most 8 (LongRoPE's short
    factors in the original-8 case)."""
    return {"right": padded_batch(VOCAB), "left": prompts((12, 9, 5)), "short": padded_batch(VOCAB, (8, 6, 3))}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """``(name, perturbed transformers Phi3ForCausalLM, its folder)``."""
    torch.manual_seed(0)
    ref = perturb(transformers.Phi3ForCausalLM(tiny_config(request.param))).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, ref, path


def test_logits_and_hidden_states_match_pytorch(case):
    _, ref, path = case
    model = load_pretrained(path, "causal-lm")
    for side, (ids, mask) in batches().items():
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
        assert got.shape == want.shape
        assert relative_diff(mask, got, want) <= TOL, side
    ids, mask = batches()["right"]
    want = torch_forward(ref.model, input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    got = forward(load_pretrained(path, "base"), jnp.asarray(ids), jnp.asarray(mask)).last_hidden_state
    assert relative_diff(mask, got, want) <= TOL


def test_rope_frequencies_equal_transformers():
    """The short and long inverse frequencies and the attention factor as transformers computes them; the
    longrope case's rows really take different ones (12 tokens: long, 8: short)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = tiny_config("phi3-longrope-tied")
    short, long, original, scale = rope_frequencies(config)
    want_short, want_scale = ROPE_INIT_FUNCTIONS["longrope"](config)
    want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=original + 1)
    assert short.shape == (6,) and original == 8 and scale == pytest.approx(want_scale, rel=1e-12)
    assert scale == pytest.approx((1 + np.log(16) / np.log(8)) ** 0.5)
    np.testing.assert_allclose(short, want_short.numpy(), rtol=2e-7, atol=0)
    np.testing.assert_allclose(long, want_long.numpy(), rtol=2e-7, atol=0)
    assert not np.allclose(short, long)
    config = tiny_config("phi3-gqa-partial-window")
    want, _ = Phi3RotaryEmbedding.compute_default_rope_parameters(config)
    short, long, _, scale = rope_frequencies(config)
    assert long is None and scale == 1.0 and short.shape == (4,)
    np.testing.assert_allclose(short, want.numpy(), rtol=2e-7, atol=0)


def test_export_loads_in_transformers_with_the_same_logits(case, tmp_path):
    """The fused kernels leave under their own names: transformers' Phi3ForCausalLM loads the folder whole."""
    _, ref, path = case
    save_pretrained(load_pretrained(path, "causal-lm"), tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back) is transformers.Phi3ForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = batches()["right"]
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= TOL


@pytest.mark.parametrize("case", UNCROSSED, indirect=True)
def test_kv_cache_decoding_matches_full_forward(case):
    """A 4-token prompt, then chunks of 3, 1, 2, 1 and 1 tokens through the cache (a rolling one of the 4-token
    window in the sliding case): the same logits as one pass."""
    name, _, path = case
    model = load_pretrained(path, "causal-lm")
    ids, mask = batches()["right"]
    want = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    width, max_len = ids.shape[1], 16
    cache_mask = jnp.asarray(np.pad(mask, ((0, 0), (0, max_len - width)), constant_values=1))
    cache = model.init_cache(len(ids), max_len)
    window = tiny_config(name).sliding_window
    assert cache.layers[0].k.shape[2] == (window or max_len)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, cache):
        return nnx.merge(graphdef, state)(ids, cache_mask, cache=cache)

    logits, start = [], 0
    for size in (4, 3, 1, 2, 1, 1):
        out = step(state, jnp.asarray(ids[:, start : start + size]), cache)
        logits.append(out.logits)
        cache, start = out.cache, start + size
    assert relative_diff(mask, jnp.concatenate(logits, axis=1), want) <= TOL


@pytest.mark.parametrize("case", UNCROSSED, indirect=True)
def test_greedy_generation_matches_pytorch_on_left_padded_prompts(case):
    """24 new tokens after prompts of 11, 6 and 2, far past the window, token for token."""
    _, ref, path = case
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    want = out[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 4 for row in want)  # the tokens wander, so a wrong step shows
    got = generate(load_pretrained(path, "causal-lm"), ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


def test_scanned_layers_give_the_same_logits_and_export(case, tmp_path):
    _, ref, path = case
    model = load_pretrained(path, "causal-lm", execution=Execution(scan_layers=True))
    ids, mask = batches()["right"]
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= TOL
    save_pretrained(model, tmp_path)
    back = transformers.Phi3ForCausalLM.from_pretrained(tmp_path)
    assert relative_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= TOL


def test_classifier_matches_pytorch_on_both_paddings_and_round_trips(tmp_path):
    """The score of each row's last real token (on the left-padded rows, the last column)."""
    torch.manual_seed(0)
    ref = perturb(transformers.Phi3ForSequenceClassification(tiny_config("phi3-gqa-partial-window", num_labels=3)))
    ref.eval().save_pretrained(tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref", "sequence-classification")
    save_pretrained(model, tmp_path / "out")
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert type(back) is transformers.Phi3ForSequenceClassification
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for side, (ids, mask) in batches().items():
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        rows = np.ones((len(ids), 1), np.int32)
        assert relative_diff(rows, forward(model, jnp.asarray(ids), jnp.asarray(mask)), want) <= TOL, side
        assert relative_diff(rows, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= TOL


@pytest.mark.parametrize("case", ["phi3-gqa-partial-window"], indirect=True)
def test_mesh_shards_the_fused_kernels_over_fsdp_and_gives_the_same_logits(case):
    """On (dp=2, fsdp=2, mp=2): qkv_proj and gate_up_proj over fsdp only (mp would cut across q|k|v and
    gate|up), o_proj and down_proj rows over mp as Llama's; the logits equal one device's (to float32 rounding)."""
    _, _, path = case
    ids, mask = batches()["right"]
    want = forward(load_pretrained(path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    model = load_pretrained(path, "causal-lm", mesh=make_mesh("dp=2,fsdp=2,mp=2"))
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    assert specs["model/layers/0/self_attn/qkv_proj/kernel"] == specs["model/layers/1/mlp/gate_up_proj/kernel"]
    assert specs["model/layers/0/self_attn/qkv_proj/kernel"] == P("fsdp", None)
    assert specs["model/layers/0/self_attn/o_proj/kernel"] == specs["model/layers/0/mlp/down_proj/kernel"]
    assert specs["model/layers/0/mlp/down_proj/kernel"] == P("mp", "fsdp")
    got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert relative_diff(mask, got, want) <= 1e-5  # the sums' order differs across devices


@pytest.mark.parametrize("kind", ["dynamic", "linear", "yarn-like"])
def test_unsupported_rope_type_is_a_one_line_error(kind):
    """transformers' Phi3Config refuses these itself; a config edited afterwards (or read without it) stops in
    jaxseq with one line naming the type."""
    config = tiny_config("phi3-gqa-partial-window")
    config.rope_parameters = {**config.rope_parameters, "rope_type": kind, "factor": 2.0}
    with pytest.raises(JaxseqError, match=rf"^rope_scaling type '{kind}' is not supported for phi3; ") as err:
        from_config(config, "causal-lm")
    assert "\n" not in str(err.value)


def test_generation_across_the_longrope_switch_is_refused_in_one_line(tmp_path):
    """Prompts shorter than original_max_position_embeddings (8) that generation would carry past it: refused
    (transformers re-encodes the prefix with the long factors there); within it, or from past it, generated."""
    torch.manual_seed(0)
    ref = perturb(transformers.Phi3ForCausalLM(tiny_config("phi3-longrope-tied"))).eval()
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "causal-lm")
    ids = np.full((1, 6), 5, np.int32)
    with pytest.raises(JaxseqError, match="longrope switch at 8 positions") as error:
        generate(model, ids, max_new_tokens=4, pad_token_id=PAD)
    assert "\n" not in str(error.value)
    assert generate(model, ids, max_new_tokens=3, pad_token_id=PAD).sequences.shape == (1, 3)  # 6 + 3 = 9: no
    assert generate(model, np.full((1, 10), 5, np.int32), max_new_tokens=4, pad_token_id=PAD).sequences.shape[1] == 4
