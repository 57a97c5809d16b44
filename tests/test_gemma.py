"""Gemma 2 and Gemma 3's text decoder against transformers PyTorch, from perturbed weights: logits on left- and
right-padded rows longer than the sliding window (sliding and full layers alternating), the base model's hidden
states, export round trips, the KV cache (a sliding layer's rolling), greedy generation, the classifier, and the
one-line refusals (soft-capped attention on a fused kernel, scanned mixed layers, EmbeddingGemma's bidirectional
attention)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.execution import Execution  # noqa: E402
from jaxseq.models.llama import layer_windows  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, torch_forward  # noqa: E402
from tests.test_llama import NEW, PAD, VOCAB, forward, prompts  # noqa: E402

TOL = 1e-4  # relative to max(1, max |logit|) on real positions

CASES = {  # family, config fields beyond the shared tiny ones
    # layers sliding, full, sliding over 4 positions; both soft-caps; query_pre_attn_scalar apart from head_dim;
    # untied head
    "gemma2-softcaps": (
        "gemma2",
        dict(
            query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=8.0, tie_word_embeddings=False
        ),
    ),
    # no soft-caps, tied head (Gemma's default), one key/value head, layer_types full, sliding, sliding
    "gemma2-mqa-tied": (
        "gemma2",
        dict(
            num_key_value_heads=1,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        ),
    ),
    # q/k norms; linear rope scaling on the full layer, a local rope base of its own on the sliding ones; the
    # final soft-cap; untied head
    "gemma3-ropes": (
        "gemma3_text",
        dict(
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
            final_logit_softcapping=8.0,
            tie_word_embeddings=False,
        ),
    ),
    # Gemma 3's defaults (rope bases 1e6 global, 1e4 local; no soft-caps); tied head; attn_logit_softcapping set,
    # which transformers' Gemma 3 never applies (nor does jaxseq: the logits agree only so)
    "gemma3-tied": (
        "gemma3_text",
        dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"], attn_logit_softcapping=3.0),
    ),
}
# Greedy decoding of a tiny tied Gemma repeats the prompt's last token (the embedding, scaled by sqrt(hidden_size),
# outweighs the layers in the residual stream and meets itself in the tied head), which would show no wrong step;
# generation runs the untied cases (the head is one function, ``logits``, which the forward tests check tied).
GENERATE = ("gemma2-softcaps", "gemma3-ropes")
CONFIG_CLASSES = {"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"}
LM_CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
CLASSIFIERS = {"gemma2": "Gemma2ForSequenceClassification", "gemma3_text": "Gemma3TextForSequenceClassification"}


def tiny_config(case, **kw):
    family, fields = CASES[case]
    base = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        sliding_window=4, query_pre_attn_scalar=16, initializer_range=0.3, attn_implementation="eager",
    )  # fmt: skip
    return getattr(transformers, CONFIG_CLASSES[family])(**{**base, **fields, **kw})


def relative_diff(mask, got, want) -> float:
    """Largest difference on real positions, relative to max(1, max |want| there)."""
    want = np.asarray(want, np.float32)
    return max_diff_on(mask, got, want) / max(1.0, max_diff_on(mask, want, np.zeros_like(want)))


def batches():
    """The same rows of 12, 9 and 5 tokens padded on the right and on the left."""
    return {"right": padded_batch(VOCAB), "left": prompts((12, 9, 5))}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """``(name, perturbed transformers LM, its folder)``."""
    torch.manual_seed(0)
    family = CASES[request.param][0]
    ref = perturb(getattr(transformers, LM_CLASSES[family])(tiny_config(request.param))).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, ref, path


def test_logits_and_hidden_states_match_pytorch_on_both_paddings(case):
    """Both layer kinds matter: rows of 12 and 9 tokens run past the window of 4."""
    name, ref, path = case
    assert set(layer_windows(tiny_config(name))) == {None, 4}
    model, base = load_pretrained(path, "causal-lm"), load_pretrained(path, "base")
    for side, (ids, mask) in batches().items():
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
        assert got.shape == want.shape and relative_diff(mask, got, want) <= TOL, side
        want = torch_forward(ref.model, input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
        got = forward(base, jnp.asarray(ids), jnp.asarray(mask)).last_hidden_state
        assert relative_diff(mask, got, want) <= TOL, side


def test_export_loads_in_transformers_with_the_same_logits(case, tmp_path):
    _, ref, path = case
    save_pretrained(load_pretrained(path, "causal-lm"), tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(back) is type(ref)
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= TOL


def test_kv_cache_decoding_matches_full_forward(case):
    """Chunks of 4, 3, 1, 2, 1, 1 tokens through a 16-position cache: the sliding layers keep a rolling cache of
    their 4 positions (wrapped around twice), the full layers all 16."""
    name, _, path = case
    model = load_pretrained(path, "causal-lm")
    ids, mask = padded_batch(VOCAB)
    want = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    width, max_len = ids.shape[1], 16
    cache_mask = jnp.asarray(np.pad(mask, ((0, 0), (0, max_len - width)), constant_values=1))
    cache = model.init_cache(len(ids), max_len)
    lengths = [max_len if window is None else window for window in layer_windows(tiny_config(name))]
    assert [layer.k.shape[2] for layer in cache.layers] == lengths
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


@pytest.mark.parametrize("name", GENERATE)
def test_greedy_generation_matches_pytorch_on_left_padded_prompts(name, tmp_path):
    """transformers' ``generate()`` and jaxseq's agree token for token over 24 new tokens, far past the window."""
    torch.manual_seed(0)
    ref = perturb(getattr(transformers, LM_CLASSES[CASES[name][0]])(tiny_config(name))).eval()
    ref.save_pretrained(tmp_path)
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    want = out[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 4 for row in want)  # the tokens wander, so a wrong step shows
    got = generate(load_pretrained(tmp_path, "causal-lm"), ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


@pytest.mark.parametrize("name", list(CASES))
def test_classifier_matches_pytorch_on_both_paddings_and_round_trips(name, tmp_path):
    """The score of each row's last real token, no soft-cap (transformers' generic classifier)."""
    torch.manual_seed(0)
    cls = getattr(transformers, CLASSIFIERS[CASES[name][0]])
    ref = perturb(cls(tiny_config(name, num_labels=3))).eval()
    ref.save_pretrained(tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref", "sequence-classification")
    save_pretrained(model, tmp_path / "out")
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="eager"
    )
    assert type(back) is cls and not info["missing_keys"] and not info["unexpected_keys"]
    for side, (ids, mask) in batches().items():
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        rows = np.ones((len(ids), 1), np.int32)
        assert relative_diff(rows, forward(model, jnp.asarray(ids), jnp.asarray(mask)), want) <= TOL, side
        assert relative_diff(rows, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= TOL


def test_soft_capped_attention_takes_xla_saying_why_once_and_refuses_a_fused_kernel_by_name():
    """On a TPU (a mesh's view of its devices) auto says once why it runs XLA; splash or cuDNN named is a one-line
    error. Without the attention soft-cap auto takes splash."""
    tpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu")]), shape={})  # a mesh's view
    config = tiny_config("gemma2-softcaps")

    def kernel(config, choice, mesh, **kw):
        return decide_execution(config, "causal-lm", mesh=mesh, attention=choice, **kw).attention.name

    said = []
    assert kernel(config, "auto", tpu, dtype=jnp.bfloat16, say=said.append) == "xla"
    assert said == ["attention: XLA (splash attention does not soft-cap attention logits (attn_logit_softcapping); "
                    "use --attention xla)"]  # fmt: skip
    gpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu")]), shape={})
    for name, mesh in (("splash", tpu), ("cudnn", gpu)):
        with pytest.raises(JaxseqError, match=r"attention does not soft-cap attention logits"):
            kernel(config, name, mesh, dtype=jnp.bfloat16)
    assert kernel(tiny_config("gemma2-mqa-tied"), "auto", tpu) == "splash"


def test_scanning_mixed_layers_is_refused_auto_unrolls_them_and_uniform_layers_scan(tmp_path):
    """--scan_layers true on sliding and full layers that do not repeat a pattern twice stops in one line; auto
    (scanning under --remat full) unrolls them; layers of one window scan (a repeating pattern's:
    tests/test_pattern_scan.py)."""
    from jaxseq.train.objectives import CausalLM
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.spec import RunSpec
    from jaxseq.train.trainer_config import TrainerConfig

    mixed = tiny_config("gemma2-softcaps")
    with pytest.raises(JaxseqError, match=r"^scan_layers scans layers that repeat one pattern"):
        from_config(mixed, "causal-lm", execution=Execution(scan_layers=True))
    uniform = tiny_config("gemma2-softcaps", layer_types=["sliding_attention"] * 3)
    assert len(from_config(uniform, "causal-lm", execution=Execution(scan_layers=True)).model.layers) == 3

    def scans(config, flag):
        trainer = TrainerConfig(output_dir=str(tmp_path), scan_layers=flag, remat="full")
        return RunSpec(None, config, "causal-lm", CausalLM(), trainer, OptimizerConfig()).scan_layers

    assert (scans(mixed, "auto"), scans(uniform, "auto"), scans(mixed, "true")) == (False, True, True)


def test_gemma3_ropes_per_layer_kind_and_refusals():
    """The sliding layers turn with the local base, the full ones with the global rope and its scaling, as
    transformers' Gemma3RotaryEmbedding computes them; a rope type jaxseq lacks and EmbeddingGemma's
    bidirectional attention stop in one line."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from jaxseq.models.llama import rope_frequencies

    config = tiny_config("gemma3-ropes")
    rotary = Gemma3RotaryEmbedding(config)
    for window, kind in ((None, "full_attention"), (4, "sliding_attention")):
        want = getattr(rotary, f"{kind}_inv_freq").numpy()
        np.testing.assert_allclose(rope_frequencies(config, window), want, rtol=2e-7, atol=0)
    assert not np.allclose(rope_frequencies(config, None), rope_frequencies(config, 4))
    # YaRN on the full layers, its ``truncate`` off per kind: transformers reads it from the top of
    # rope_parameters, which per layer kind has none, so the ramp is truncated all the same
    yarn = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4, "original_max_position_embeddings": 16}
    yarn = tiny_config("gemma3-ropes", rope_parameters={**config.rope_parameters, "full_attention": {
        **yarn, "truncate": False, "beta_fast": 5.0, "beta_slow": 0.7}})  # fmt: skip
    want = Gemma3RotaryEmbedding(yarn).full_attention_inv_freq.numpy()
    np.testing.assert_allclose(rope_frequencies(yarn, None), want, rtol=2e-7, atol=0)
    dynamic = {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}}
    with pytest.raises(JaxseqError, match=r"^rope type 'dynamic' is not supported; jaxseq supports default, linear"):
        from_config(tiny_config("gemma3-tied", rope_parameters=dynamic), "causal-lm")
    with pytest.raises(JaxseqError, match=r"^use_bidirectional_attention .* is not supported"):
        from_config(tiny_config("gemma3-tied", use_bidirectional_attention=True), "causal-lm")


@pytest.mark.parametrize("name", ["Gemma2Config", "Gemma3TextConfig"])
def test_a_depth_override_takes_the_layer_pattern_of_that_depth(name):
    """`--config_overrides num_hidden_layers=42` on a config whose layer_types were made for its own depth: the
    pattern transformers makes for a config of 42 layers (a config built with that depth), not a refusal."""
    from jaxseq.models.hub import apply_overrides

    cls = getattr(transformers, name)
    got = apply_overrides(cls(), num_hidden_layers=42)
    assert got.layer_types == cls(num_hidden_layers=42).layer_types and len(got.layer_types) == 42
    kept = ["full_attention"] * 3
    assert apply_overrides(cls(num_hidden_layers=3, layer_types=kept), hidden_size=64).layer_types == kept
