"""GPT-J against transformers PyTorch: logits, hidden states, export round trip, KV cache, bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.registry import model_class  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402

# One compiled forward per model structure (op-by-op eager execution costs seconds per test).
forward = nnx.jit(lambda model, *args, **kwargs: model(*args, **kwargs))


def tiny_config(**kw):
    base = dict(
        n_layer=2,
        n_embd=64,
        n_head=4,
        rotary_dim=8,
        vocab_size=101,
        n_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.GPTJConfig(**{**base, **kw})


RTOL = 1e-5  # max |jaxseq - transformers| over max |transformers| (float32 logits agree to ~1e-6 of their scale)


@pytest.fixture(scope="module")
def gptj_lm(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gptj-lm")
    model = perturb(transformers.GPTJForCausalLM(tiny_config()))
    model.save_pretrained(path)
    return model, path


def test_causal_lm_logits_match_pytorch(gptj_lm):
    ref, path = gptj_lm
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = forward(load_pretrained(path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    assert got.dtype == jnp.float32
    assert scaled_diff(mask, got, want) <= RTOL


def test_base_model_loads_lm_checkpoint(gptj_lm):
    ref, path = gptj_lm
    ids, mask = padded_batch(101)
    want = torch_forward(ref.transformer, input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    got = forward(load_pretrained(path, "base"), jnp.asarray(ids), jnp.asarray(mask)).last_hidden_state
    assert scaled_diff(mask, got, want) <= RTOL


def test_causal_lm_export_round_trip(gptj_lm, tmp_path):
    _, path = gptj_lm
    model = load_pretrained(path, "causal-lm")
    save_pretrained(model, tmp_path)
    back, info = transformers.GPTJForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = padded_batch(101)
    want = torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy()
    got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert scaled_diff(mask, got, want) <= RTOL


def test_tied_embeddings_keep_the_head_bias(tmp_path):
    ref = perturb(transformers.GPTJForCausalLM(tiny_config(tie_word_embeddings=True)))
    ref.save_pretrained(tmp_path / "ref")
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    model = load_pretrained(tmp_path / "ref", "causal-lm")
    got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert scaled_diff(mask, got, want) <= RTOL

    save_pretrained(model, tmp_path / "out")
    back, info = transformers.GPTJForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again = torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy()
    assert scaled_diff(mask, again, want) <= RTOL


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
        out = step(state, jnp.asarray(ids[:, t : t + 1]), cache)
        logits.append(out.logits)
        cache = out.cache
    assert int(cache.index) == width
    assert max_diff_on(mask, jnp.concatenate(logits, axis=1), want) <= 1e-4


def test_bfloat16_compute_stays_close_to_float32(gptj_lm):
    """bfloat16 keeps 8 significant bits (eps = 2**-7): every matmul, the layer norms and the residual
    stream round to about eps/2 of their magnitude. Two blocks of such roundings measured a worst logit
    error of 0.0124 with logits up to 1.67, i.e. about 1 eps of the largest logit; 3 eps of it leaves room
    for other platforms' rounding and still fails on a real bug (a wrong rotary angle or mask moves logits
    by their whole size). The lower bound checks the forward really ran in bfloat16."""
    _, path = gptj_lm
    ids, mask = padded_batch(101)
    f32 = forward(load_pretrained(path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    bf16_model = load_pretrained(path, "causal-lm", dtype=jnp.bfloat16)
    assert bf16_model.transformer.wte.embedding.get_value().dtype == jnp.float32
    bf16 = forward(bf16_model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert bf16.dtype == jnp.float32
    diff, scale = max_diff_on(mask, bf16, f32), float(jnp.abs(f32).max())
    assert 1e-4 < diff <= 3 * float(jnp.finfo(jnp.bfloat16).eps) * scale


def test_sequence_classification_matches_pytorch_and_round_trips(tmp_path):
    ref = perturb(transformers.GPTJForSequenceClassification(tiny_config(num_labels=3)))
    ref.save_pretrained(tmp_path / "ref")
    ids, mask = padded_batch(101)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    model = load_pretrained(tmp_path / "ref", "sequence-classification")
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    assert got.shape == (3, 3)
    assert scaled_diff(None, got, want) <= RTOL

    save_pretrained(model, tmp_path / "out")
    back, info = transformers.GPTJForSequenceClassification.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again = torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy()
    assert scaled_diff(None, again, got) <= RTOL


def test_classifier_head_on_lm_checkpoint_is_initialised_and_reported(gptj_lm, caplog):
    _, path = gptj_lm
    model = load_pretrained(path, "sequence-classification", num_labels=2)
    assert "score.weight" in caplog.text
    assert "lm_head.bias" in caplog.text
    assert model.score.kernel.shape == (64, 2)


@pytest.mark.parametrize(
    "task, tied", [("base", False), ("causal-lm", False), ("causal-lm", True), ("sequence-classification", False)]
)
def test_partition_rules_cover_every_parameter(task, tied):
    config = tiny_config(vocab_size=128, tie_word_embeddings=tied, num_labels=2)
    abstract = nnx.state(nnx.eval_shape(lambda: model_class(config, task)(config, rngs=nnx.Rngs(0))))
    specs = partition.match_partition_rules(partition.get_partition_rules("gptj"), abstract)
    partition.check_divisible(abstract, specs, make_mesh("fsdp=2,mp=4"))
    named = dict(partition.named_leaves(specs))
    prefix = "" if task == "base" else "transformer/"
    assert named[f"{prefix}h/0/attn/q_proj/kernel"] == P("fsdp", "mp")
    assert named[f"{prefix}h/1/mlp/fc_out/kernel"] == P("mp", "fsdp")
