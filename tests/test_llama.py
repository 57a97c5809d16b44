"""Llama, Mistral, Qwen2 and Qwen3 against transformers PyTorch, from perturbed weights: logits (grouped-query
attention, llama3 and linear rope scaling, sliding windows shorter than the text, qkv biases, Qwen3's q/k norms,
tied and untied heads), the
base model's hidden states, export round trips, the KV cache, greedy generation on left-padded prompts, the rotary
frequencies of each rope type, a classifier, and generation on a (dp, fsdp, mp) mesh."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.llama import rope_frequencies  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, torch_forward  # noqa: E402

VOCAB, NEW, PAD = 101, 24, 0
ATOL = 1e-4  # float32 logits of these models agree to ~1e-6

forward = nnx.jit(lambda model, *args, **kwargs: model(*args, **kwargs))

LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}  # fmt: skip  # with head_dim 16 its wavelengths 6.3 .. 19870 fall in all three bands (< 8, 8 .. 32, > 32)

CASES = {  # family, config fields beyond the shared tiny ones
    # 4 query heads on 2 key/value heads, llama3 rope, untied head
    "llama-gqa-llama3": ("llama", dict(rope_parameters=LLAMA3)),
    # head_dim 32 apart from hidden / heads, linear rope from the old rope_scaling/rope_theta fields, tied head,
    # biases on the attention and the MLP
    "llama-linear-tied-biases": (
        "llama",
        dict(
            num_key_value_heads=4,
            head_dim=32,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            rope_theta=500.0,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    # one key/value head, every layer sliding over 4 positions
    "mistral-mqa-window": ("mistral", dict(num_key_value_heads=1, sliding_window=4)),
    # q/k/v biases; layer 0 full, layer 1 sliding over 5 positions (max_window_layers); tied head
    "qwen2-biases-window-tied": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, tie_word_embeddings=True),
    ),
    # q/k norms over head_dim 32 apart from hidden / heads, no biases, untied head
    "qwen3-norms-head-dim": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    # q/k norms with all four attention biases; layer 1 sliding over 5 positions; tied head
    "qwen3-biases-window-tied": (
        "qwen3",
        dict(
            head_dim=16,  # Qwen3Config's default is 128
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
}
CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def tiny_config(case, **kw):
    family, fields = CASES[case]
    base = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        initializer_range=0.3,  # large weights: greedy decoding wanders instead of repeating
    )  # fmt: skip
    return getattr(transformers, CONFIG_CLASSES[family])(**{**base, **fields, **kw})


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """``(name, perturbed transformers LM, its folder)``, saved in safetensors shards with their index, as big
    checkpoints are on the Hub."""
    torch.manual_seed(0)
    ref = perturb(transformers.AutoModelForCausalLM.from_config(tiny_config(request.param))).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path, max_shard_size="150KB")
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
    return request.param, ref, path


def test_logits_and_hidden_states_match_pytorch(case):
    """Right-padded rows of 12, 9 and 5 tokens: longer than the sliding windows (4, 5)."""
    _, ref, path = case
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = forward(load_pretrained(path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert max_diff_on(mask, got, want) <= ATOL
    want = torch_forward(ref.model, input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    got = forward(load_pretrained(path, "base"), jnp.asarray(ids), jnp.asarray(mask)).last_hidden_state
    assert max_diff_on(mask, got, want) <= ATOL


def test_export_loads_in_transformers_with_the_same_logits(case, tmp_path):
    _, ref, path = case
    model = load_pretrained(path, "causal-lm")
    save_pretrained(model, tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(back) is type(ref)
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert max_diff_on(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy(), want) <= ATOL


def test_kv_cache_decoding_matches_full_forward(case):
    """A 4-token prompt, then chunks of 3, 1, 2, 1 and 1 tokens through a cache longer than the text: the
    window slides over cached keys exactly as over the whole sequence. The cache holds the key/value heads
    only, and a sliding layer's only its window (a rolling cache of 4 or 5 positions, wrapped around twice
    here; the chunk of 3 overwrites slots its own first query still reads)."""
    name, _, path = case
    model = load_pretrained(path, "causal-lm")
    ids, mask = padded_batch(VOCAB)
    want = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    width, max_len = ids.shape[1], 16
    cache_mask = jnp.asarray(np.pad(mask, ((0, 0), (0, max_len - width)), constant_values=1))
    cache = model.init_cache(len(ids), max_len)
    config = tiny_config(name)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    windows = {"mistral-mqa-window": (4, 4), "qwen2-biases-window-tied": (max_len, 5)}
    lengths = {**windows, "qwen3-biases-window-tied": (max_len, 5)}.get(name, (max_len, max_len))
    assert [layer.k.shape for layer in cache.layers] == [(3, config.num_key_value_heads, n, dim) for n in lengths]
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, cache):
        return nnx.merge(graphdef, state)(ids, cache_mask, cache=cache)

    logits, start = [], 0
    for size in (4, 3, 1, 2, 1, 1):
        out = step(state, jnp.asarray(ids[:, start : start + size]), cache)
        logits.append(out.logits)
        cache, start = out.cache, start + size
    assert start == width and int(cache.index) == width
    assert max_diff_on(mask, jnp.concatenate(logits, axis=1), want) <= ATOL


def prompts(lengths=(11, 6, 2)):
    """Left-padded int32 ``(ids, mask)`` of random prompts (tokens 3..VOCAB-1)."""
    rng = np.random.RandomState(1)
    width = max(lengths)
    ids, mask = np.full((len(lengths), width), PAD, np.int32), np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        ids[row, width - n :], mask[row, width - n :] = rng.randint(3, VOCAB, n), 1
    return ids, mask


def test_greedy_generation_matches_pytorch_on_left_padded_prompts(case):
    """transformers' ``generate()`` (its own sliding-window cache for Mistral and Qwen2) and jaxseq's agree
    token for token over 24 new tokens, far past every window; sampling with top_k=1 is greedy too."""
    _, ref, path = case
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    want = out[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 4 for row in want)  # the tokens wander, so a wrong step shows
    model = load_pretrained(path, "causal-lm")
    got = generate(model, ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)
    top1 = generate(model, ids, mask, max_new_tokens=NEW, do_sample=True, top_k=1, top_p=0.9, seed=3)
    np.testing.assert_array_equal(np.asarray(top1.sequences), want)


def test_generation_on_a_dp_fsdp_mp_mesh_equals_single_device(tmp_path):
    """Mistral with one key/value head on mp=2 (its projections split inside the head), sampled with top-p:
    the same tokens on a (2, 2, 2) mesh as on one device."""
    torch.manual_seed(0)
    perturb(transformers.MistralForCausalLM(tiny_config("mistral-mqa-window"))).save_pretrained(tmp_path)
    ids, mask = prompts()
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_p=0.9, seed=5)
    single = generate(load_pretrained(tmp_path, "causal-lm"), ids, mask, **kw)
    model = load_pretrained(tmp_path, "causal-lm", mesh=make_mesh("dp=2,fsdp=2,mp=2"))
    kernel = model.model.layers[0].self_attn.k_proj.kernel[...]
    assert {s.data.shape for s in kernel.addressable_shards} == {(32, 8)}  # head_dim 16 split over mp
    np.testing.assert_array_equal(np.asarray(generate(model, ids, mask, **kw).sequences), np.asarray(single.sequences))


def test_sequence_classification_matches_pytorch_and_round_trips(tmp_path):
    torch.manual_seed(0)
    config = tiny_config("qwen2-biases-window-tied", num_labels=3)
    ref = perturb(transformers.Qwen2ForSequenceClassification(config)).eval()
    ref.save_pretrained(tmp_path / "ref")
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    model = load_pretrained(tmp_path / "ref", "sequence-classification")
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(got, want, atol=ATOL)
    save_pretrained(model, tmp_path / "out")
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert type(back) is transformers.Qwen2ForSequenceClassification
    assert not info["missing_keys"] and not info["unexpected_keys"]
    np.testing.assert_allclose(torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy(), want, atol=ATOL)


@pytest.mark.parametrize("case_name", ["llama-gqa-llama3", "llama-linear-tied-biases", "mistral-mqa-window"])
def test_rope_frequencies_equal_transformers(case_name):
    """Each rope type's inverse frequencies as transformers computes them (to float32 rounding)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_config(case_name)
    kind = config.rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS.get(kind, LlamaRotaryEmbedding.compute_default_rope_parameters)
    want, scaling = init(config)
    assert scaling == 1.0
    np.testing.assert_allclose(rope_frequencies(config), want.numpy(), rtol=2e-7, atol=0)


def test_unsupported_rope_type_is_a_one_line_error():
    config = tiny_config("llama-gqa-llama3", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    message = r"^rope type 'dynamic' is not supported; jaxseq supports default, linear, llama3"
    with pytest.raises(JaxseqError, match=message):
        from_config(config, "causal-lm")


def test_bfloat16_compute_stays_as_close_to_float32_as_transformers_does(case):
    """bfloat16 compute, float32 parameters (and a bfloat16 KV cache in generation): the logits move from the
    float32 ones on average by no more than transformers' own bfloat16 model's do (measured: 0.026 to 0.041
    against its 0.030 to 0.048, logits up to 9.9; these large random weights amplify rounding), and somewhere by
    more than 1e-4 (it really ran in bfloat16). A wrong mask or rotation moves logits by their whole size. (The
    largest difference is one draw of rounding noise: 0.16 against transformers' 0.16 with Qwen3's q/k norms.)"""
    _, ref, path = case
    ids, mask = padded_batch(VOCAB)
    f32 = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    theirs = torch_forward(copy.deepcopy(ref).to(torch.bfloat16), input_ids=ids, attention_mask=mask).logits
    model = load_pretrained(path, "causal-lm", dtype=jnp.bfloat16)
    assert model.model.embed_tokens.embedding.get_value().dtype == jnp.float32
    bf16 = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert bf16.dtype == jnp.float32
    mean_diff = lambda logits: float(np.abs(np.asarray(logits) - f32)[mask == 1].mean())
    assert max_diff_on(mask, bf16, f32) > 1e-4
    assert mean_diff(bf16) <= mean_diff(theirs.float().numpy())
    assert model.init_cache(1, 8).layers[0].k.dtype == jnp.bfloat16
    assert generate(model, *prompts(), max_new_tokens=4).sequences.shape == (3, 4)


def test_sliding_layers_follow_the_config_as_transformers_reads_it():
    """Mistral slides every layer; Qwen2 the layers from max_window_layers on, and none without
    use_sliding_window; too short a layer_types list is a one-line error."""
    from jaxseq.models.llama import layer_windows

    qwen2 = dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert layer_windows(tiny_config("mistral-mqa-window", num_hidden_layers=3)) == (4, 4, 4)
    assert layer_windows(tiny_config("qwen2-biases-window-tied", **qwen2)) == (None, 5, 5)
    assert (
        layer_windows(tiny_config("qwen2-biases-window-tied", **{**qwen2, "use_sliding_window": False})) == (None,) * 3
    )
    assert layer_windows(tiny_config("llama-gqa-llama3")) == (None, None)
    short = tiny_config("qwen2-biases-window-tied", **qwen2)
    short.num_hidden_layers = 4
    with pytest.raises(JaxseqError, match="layer_types names 3 layers but num_hidden_layers is 4"):
        layer_windows(short)
