"""The causal-LM loss computed a chunk at a time (every row, as many positions as keep a device within
``chunk_tokens`` tokens) equals the plain full-logits cross-entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import from_config  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import padded_batch  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

CONFIGS = {
    "gpt2": lambda: tiny_config("gpt2"),
    "gptj": lambda: tiny_config("gptj"),
    "gptj-tied": lambda: tiny_config("gptj", tie_word_embeddings=True),
}


def full_logits_loss(model, batch):
    """The textbook loss: logits of every position but the last against the next token, padding left out."""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    logits = model(ids, mask).logits
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
    weights = jnp.ones_like(losses) if mask is None else mask[:, 1:].astype(jnp.float32)
    return (losses * weights).sum() / weights.sum(), (losses * weights).sum(-1), weights.sum(-1)


def value_and_grad(model, loss):
    graphdef, params = nnx.split(model)
    return jax.jit(jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p))))(params)


def assert_close(got, want, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize(
    "family, chunk_tokens, batch_shards, positions, masked",
    # 3 rows of 10 positions: chunks that do not divide them, one position at a time, and one chunk
    [
        ("gpt2", 12, 1, 4, True),
        ("gpt2", 9, 1, 3, False),
        ("gpt2", 1, 1, 1, True),
        ("gptj", 12, 1, 4, True),
        ("gptj", 48, 1, 10, True),
        ("gptj", 2, 3, 2, True),  # one row per device: 2 positions
        ("gptj-tied", 9, 1, 3, True),
    ],
)
def test_chunked_loss_and_gradients_equal_full_logits(family, chunk_tokens, batch_shards, positions, masked):
    model = from_config(CONFIGS[family](), "causal-lm", seed=0)
    ids, mask = (jnp.asarray(a) for a in padded_batch(64, lengths=(10, 7, 9)))
    batch = {"input_ids": ids, "attention_mask": mask} if masked else {"input_ids": ids}
    task = CausalLM(chunk_tokens=chunk_tokens, batch_shards=batch_shards)
    assert task.chunk_positions(*ids.shape) == positions
    got = value_and_grad(model, lambda m: task.loss(m, batch, None))
    want = value_and_grad(model, lambda m: full_logits_loss(m, batch)[0])
    assert_close(got, want)
    plain = value_and_grad(model, lambda m: CausalLM(chunk_tokens=None).loss(m, batch, None))
    assert_close(got, plain)

    predicted = jax.jit(lambda p: task.predict(nnx.merge(nnx.graphdef(model), p), batch))(nnx.state(model))
    _, loss_sum, tokens = full_logits_loss(model, batch)
    assert_close(predicted["loss_sum"], loss_sum)
    np.testing.assert_array_equal(predicted["tokens"], tokens)


def test_chunks_are_bounded_in_tokens_per_device():
    """Positions per chunk = the fewest equal chunks of at most ``chunk_tokens // rows per device`` positions."""
    assert CausalLM(512, batch_shards=8).chunk_positions(64, 1024) == 64  # 8 rows per device x 64 = 512 tokens
    assert CausalLM(512).chunk_positions(64, 1024) == 8  # unbound: as if one device held all 64 rows
    assert CausalLM(512, batch_shards=8).chunk_positions(8, 2048) == 512  # one row per device
    assert CausalLM(512, batch_shards=8).chunk_positions(8, 300) == 300  # one chunk
    assert CausalLM(300).chunk_positions(1, 1000) == 250  # 4 chunks of 250, not 300 + 300 + 300 + 100
    assert CausalLM(4).chunk_positions(8, 10) == 1  # more rows per device than tokens: one position
    assert CausalLM(512, batch_shards=8).chunk_positions(12, 100) == 100  # 12 rows over 8 devices: 2 per device
    assert CausalLM(512).for_batch_shards(4).batch_shards == 4
    for bad in ({"chunk_tokens": 0}, {"batch_shards": 0}):
        with pytest.raises(JaxseqError):
            CausalLM(**bad)


def sub_jaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                yield getattr(sub, "jaxpr", sub)


def all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside it (jit, scan, checkpoint, custom_vjp)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def test_chunked_loss_never_makes_the_whole_logits():
    """Every array of the step (forward and backward) is smaller than the batch's float32 logits."""
    config = CONFIGS["gptj"]()
    config.vocab_size = 512  # the logits outgrow every other array
    model = from_config(config, "causal-lm", seed=0)
    ids = jnp.zeros((2, 24), jnp.int32)
    graphdef, params = nnx.split(model)
    task = CausalLM(chunk_tokens=16)  # 2 rows x 8 positions
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: task.loss(nnx.merge(graphdef, p), {"input_ids": ids}, None)))(params)
    full = 2 * 24 * config.vocab_size
    assert max(np.prod(v.aval.shape) for e in all_eqns(jaxpr.jaxpr) for v in e.outvars) < full
    assert CausalLM(chunk_tokens=None).chunk_tokens is None  # the plain path stays available


@pytest.mark.parametrize("family", ["gpt2", "gptj", "gptj-tied"])
def test_head_multiplies_in_the_compute_dtype_and_accumulates_in_float32(family):
    """The LM head's forward products take bfloat16 operands and give float32 logits; its backward products
    take bfloat16 operands too (no float32 x bfloat16 product, which runs as TF32 on GPUs), and its gradients
    are the float32 model's within bfloat16 rounding."""
    model = from_config(CONFIGS[family](), "causal-lm", dtype=jnp.bfloat16, seed=0)
    h = jax.random.normal(jax.random.key(0), (2, 3, 32), jnp.float32)
    dots = lambda jaxpr: [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    forward = dots(jax.make_jaxpr(model.logits)(h.astype(jnp.bfloat16)))
    assert forward and all(e.params["preferred_element_type"] == jnp.float32 for e in forward)
    assert all(v.aval.dtype == jnp.bfloat16 for e in forward for v in e.invars)
    assert model.logits(h.astype(jnp.bfloat16)).dtype == jnp.float32

    graphdef, params = nnx.split(model)
    cotangent = jax.random.normal(jax.random.key(1), (2, 3, model.logits(h).shape[-1]), jnp.float32)

    def head_loss(params, h, graphdef=graphdef):
        return (nnx.merge(graphdef, params).logits(h) * cotangent).sum()

    grad = jax.grad(head_loss, argnums=(0, 1))
    backward = dots(jax.make_jaxpr(grad)(params, h.astype(jnp.bfloat16)))
    assert len(backward) >= 3 * len(forward)  # the products of both gradients
    assert all(v.aval.dtype == jnp.bfloat16 for e in backward for v in e.invars)

    wide = from_config(CONFIGS[family](), "causal-lm", dtype=jnp.float32, seed=0)
    wide_graphdef, wide_params = nnx.split(wide)
    got = grad(params, h.astype(jnp.bfloat16))
    want = jax.grad(lambda p, h: head_loss(p, h, wide_graphdef), argnums=(0, 1))(wide_params, h)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


def test_automatic_chunks_follow_the_device():
    """-1 (auto): 512-token chunks on CPUs and TPUs; on a GPU the whole logits while a device's float32 logits
    take at most 1/16 of its memory, else chunks that do."""
    from types import SimpleNamespace

    from jaxseq.train.objectives import AUTO_CHUNK, CausalLMConfig

    auto = CausalLMConfig().objective()
    assert auto.chunk_tokens == AUTO_CHUNK
    cpu = auto.for_batch_shards(2, jax.devices()[0])
    assert (cpu.chunk_tokens, cpu.batch_shards) == (512, 2)
    tpu = auto.for_batch_shards(2, SimpleNamespace(platform="tpu", memory_stats=lambda: {"bytes_limit": 16 << 30}))
    assert tpu.chunk_tokens == 512
    vocab = 50257  # padded to 50304: 201,216 bytes of float32 logits per token
    gpu = auto.for_batch_shards(2, SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 80 << 30}))
    fits = (80 << 30) // 16 // (4 * 50304)  # 26,680 tokens per device
    assert gpu._chunk_tokens(2 * 16, 1024, vocab) is None  # 16 rows of 1024 per device: whole
    assert gpu._chunk_tokens(2 * 32, 1024, vocab) == fits  # 32 rows: chunked
    assert gpu.chunk_positions(2 * 32, 1024, fits) * 32 <= fits
    with pytest.raises(JaxseqError, match="-1"):
        CausalLMConfig(loss_chunk_tokens=-2)
