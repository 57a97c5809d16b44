"""Attention kernels: splash (Pallas, run here in interpret mode: its own numerics on CPU) against XLA's attention,
forward and gradients, for causal (GPT-2, GPT-J), grouped-query with sliding windows (Mistral, Qwen2), padded
bidirectional (BERT) and packed-segment inputs, alone and under shard_map on a dp/mp mesh; how ``--attention`` is
chosen and refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.execution import AttentionKernel, Execution  # noqa: E402
from jaxseq.models.hub import from_config  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

SEQ = 256  # two 128-position splash tiles


WIDE = dict(hidden_size=64, intermediate_size=96, max_position_embeddings=SEQ, vocab_size=300)


def gpt2(**kw):
    return tiny_config("gpt2", n_embd=64, n_positions=SEQ, vocab_size=300, attn_pdrop=0.0, **kw)


def gptj():
    return tiny_config("gptj", n_embd=64, rotary_dim=8, n_positions=SEQ, vocab_size=300, attn_pdrop=0.0)


def mistral():
    """Two key/value heads for four query heads (one per device on mp=2), every layer sliding over 100."""
    return tiny_config("mistral", **WIDE, sliding_window=100)


def qwen2():
    """One key/value head (fewer than mp=2: repeated for splash), layer 0 full, layer 1 sliding over 70."""
    return tiny_config(
        "qwen2", **WIDE, num_key_value_heads=1, use_sliding_window=True, sliding_window=70, max_window_layers=1
    )


def bert():
    return tiny_config(
        "bert", vocab_size=300, hidden_size=64, intermediate_size=128, max_position_embeddings=SEQ,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip


def batch(kind: str, rows: int = 4, seed: int = 0):
    """Token ids and the attention mask: 1/0 padding of unequal rows, or packed examples' segment ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 300, (rows, SEQ)).astype(np.int32)
    lengths = np.array([SEQ, 200, 131, 7])[:rows]
    mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
    if kind == "packed":  # 1, 2, 3 ... examples of varied length, then padding
        bounds = np.sort(rng.integers(1, SEQ, (rows, 3)), axis=1)
        mask = mask * (1 + (np.arange(SEQ)[None, :, None] >= bounds[:, None, :]).sum(-1)).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(mask)


def loss_and_grads(model, ids, mask):
    """A loss over real positions only (padding's outputs are discarded, whichever kernel) and its gradients."""
    graphdef, state = nnx.split(model)
    real = (mask > 0)[..., None]

    def loss(state):
        out = nnx.merge(graphdef, state)(ids, mask)
        if not isinstance(out, jax.Array):
            out = out.logits if hasattr(out, "logits") else out.last_hidden_state
        if out.ndim == 2:  # a classifier: pooled already
            return jnp.sum(out**2)
        return jnp.sum(jnp.where(real, out, 0.0) ** 2) / out.shape[-1]

    return jax.value_and_grad(loss)(state)


def assert_same(a, b, rtol=2e-5, grad_rtol=1e-4):
    """Loss within ``rtol``; gradients within ``grad_rtol`` of each one's largest entry (float32 sums over
    every position of the batch, added in another order by the blockwise kernel: measured up to 4e-5)."""
    (la, ga), (lb, gb) = a, b
    np.testing.assert_allclose(float(la), float(lb), rtol=rtol)
    pairs = [
        (path, np.asarray(x.get_value()), np.asarray(y.get_value()))
        for (path, x), (_, y) in zip(nnx.to_flat_state(ga), nnx.to_flat_state(gb))
    ]
    scale = max(np.abs(y).max() for _, _, y in pairs)  # gradients that vanish by structure compare to this
    for path, x, y in pairs:
        assert np.abs(x - y).max() <= grad_rtol * max(np.abs(y).max(), 1e-3 * scale), path


@pytest.mark.parametrize(
    "name, config, task, kind, mesh",
    [
        ("gpt2 causal padded", gpt2, "causal-lm", "padded", None),
        ("gpt2 causal packed, dp=2,mp=2", gpt2, "causal-lm", "packed", "dp=2,mp=2"),
        ("gptj causal padded, dp=4", gptj, "causal-lm", "padded", "dp=4"),
        ("mistral grouped kv heads, sliding window, padded, dp=2,mp=2", mistral, "causal-lm", "padded", "dp=2,mp=2"),
        ("qwen2 one kv head, sliding and full layers, packed", qwen2, "causal-lm", "packed", "fsdp=2,mp=2"),
        ("bert bidirectional padded", bert, "sequence-classification", "padded", None),
        ("bert bidirectional packed, fsdp=2,mp=2", bert, "base", "packed", "fsdp=2,mp=2"),
    ],
)
def test_splash_matches_xla_forward_and_gradients(name, config, task, kind, mesh):
    mesh = make_mesh(mesh, jax.devices()[:4]) if mesh else None
    ids, mask = batch(kind)
    want = loss_and_grads(from_config(config(), task, mesh=mesh, seed=1), ids, mask)
    chosen = decide_execution(config(), task, mesh=mesh, attention="splash", interpret=True).attention
    assert chosen == AttentionKernel("splash", mesh, required=True, interpret=True)
    model = from_config(config(), task, mesh=mesh, seed=1, execution=Execution(attention=chosen))
    lowered = jax.jit(lambda ids, mask: model(ids, mask)).lower(ids, mask).as_text()
    assert "splash" in lowered or "flash" in lowered  # the Pallas kernel is in the program, not XLA's attention
    assert_same(loss_and_grads(model, ids, mask), want)


def kernel(config, task, choice, mesh=None, **kw) -> str:
    """The attention kernel a run of ``config`` for ``task`` on ``mesh`` chooses for ``--attention choice``."""
    return decide_execution(config, task, mesh=mesh, attention=choice, **kw).attention.name


def test_auto_falls_back_to_xla_off_tpu_and_explicit_choices_that_cannot_apply_stop_in_one_line(caplog):
    assert kernel(gpt2(), "causal-lm", "auto") == "xla"  # CPU: no fused kernel
    with pytest.raises(JaxseqError, match=r"splash attention runs on TPUs \(here: cpu\)"):
        kernel(gpt2(), "causal-lm", "splash")
    with pytest.raises(JaxseqError, match=r"cuDNN attention runs on NVIDIA GPUs"):
        kernel(gpt2(), "causal-lm", "cudnn")
    dropping = gpt2().__class__(**{**gpt2().to_dict(), "attn_pdrop": 0.1})
    with pytest.raises(JaxseqError, match=r"no attention dropout: set it to 0 with --config_overrides attn_pdrop=0"):
        kernel(dropping, "causal-lm", "splash", interpret=True)
    bert_dropping = bert().__class__(**{**bert().to_dict(), "attention_probs_dropout_prob": 0.1})
    with pytest.raises(JaxseqError, match=r"--config_overrides attention_probs_dropout_prob=0"):
        kernel(bert_dropping, "base", "splash", interpret=True)
    t5 = tiny_config("t5", vocab_size=128, num_layers=1)
    with pytest.raises(JaxseqError, match=r"relative position bias; use --attention xla"):
        kernel(t5, "seq2seq-lm", "splash", interpret=True)
    assert kernel(t5, "seq2seq-lm", "auto") == "xla"
    with pytest.raises(JaxseqError, match=r"unknown attention kernel 'flash'"):
        kernel(gpt2(), "causal-lm", "flash")


def test_splash_asked_for_by_name_refuses_lengths_off_its_tiles_and_auto_falls_back(caplog):
    ids, mask = batch("padded")
    want = from_config(gpt2(), "causal-lm")(ids[:, :100], mask[:, :100]).logits
    named = Execution(attention=AttentionKernel("splash", required=True, interpret=True))
    with pytest.raises(JaxseqError, match=r"multiples of 128, got 100; pad --block_size"):
        from_config(gpt2(), "causal-lm", execution=named)(ids[:, :100], mask[:, :100])
    # as auto would have chosen it (on a TPU): XLA for this length, said in the log
    auto = from_config(gpt2(), "causal-lm", execution=Execution(attention=AttentionKernel("splash", interpret=True)))
    np.testing.assert_array_equal(np.asarray(auto(ids[:, :100], mask[:, :100]).logits), np.asarray(want))
    assert "multiples of 128" in caplog.text and "runs on XLA" in caplog.text


def test_packed_rows_on_a_gpu_take_xla_with_auto_saying_why_and_refuse_cudnn_by_name(caplog):
    from types import SimpleNamespace

    gpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu")]), shape={})  # a mesh's view
    task, kw = "sequence-classification", dict(mesh=gpu, dtype=jnp.bfloat16)
    assert kernel(bert(), task, "auto", **kw) == "cudnn"  # unpacked rows: cuDNN's fused attention
    assert kernel(bert(), task, "auto", packed=True, **kw) == "xla"
    assert "attention: XLA (cuDNN attention cannot keep packed examples apart" in caplog.text
    with pytest.raises(JaxseqError, match=r"cannot keep packed examples apart; add --no_pack_sequences"):
        kernel(bert(), task, "cudnn", packed=True, **kw)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_written_out_attention_keeps_no_probabilities_and_matches_autodiff(kv_heads):
    """XLA's attention with dropout masks drawn before a scanned stack (``_written_out``, CPU programs): its
    backward pass recomputes the probabilities, so it keeps nothing of the scores' size but the masks; output
    and gradients equal differentiating the plain formula (grouped-query heads or not, padding, an additive bias)."""
    from jaxseq.models import attention
    from jaxseq.models.layers import DrawnMasks

    b, q, heads, d, rate = 2, 6, 4, 8, 0.3
    keys = jax.random.split(jax.random.key(0), 6)
    query = jax.random.normal(keys[0], (b, q, heads, d))
    key, value = (jax.random.normal(k, (b, q, kv_heads, d)) for k in keys[1:3])
    mask = jnp.arange(q)[None, None, None, :] < jnp.array([q, 4])[:, None, None, None]  # row 1 padded after 4
    keep = jax.random.bernoulli(keys[3], 1 - rate, (b, heads, q, q))
    weights = jax.random.normal(keys[4], (b, q, heads, d))
    bias = jax.random.normal(keys[5], (1, heads, q, q))  # T5's relative position bias: trained too

    def plain(query, key, value, bias):
        grouped = query.reshape(b, q, kv_heads, heads // kv_heads, d)
        logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, key).reshape(b, heads, q, q) / np.sqrt(d) + bias
        probs = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)
        probs = jnp.where(keep, probs / (1 - rate), 0).reshape(b, kv_heads, heads // kv_heads, q, q)
        return jnp.sum(jnp.einsum("bhgqk,bkhd->bqhgd", probs, value).reshape(b, q, heads, d) * weights)

    def ours(query, key, value, bias):
        out = attention._written_out(query, key, value, "bkhd", mask, bias, d**-0.5, rate, DrawnMasks((keep,)))
        return jnp.sum(out * weights)

    args = (query, key, value, bias)
    np.testing.assert_allclose(ours(*args), plain(*args), rtol=1e-5)
    for got, want in zip(jax.grad(ours, (0, 1, 2, 3))(*args), jax.grad(plain, (0, 1, 2, 3))(*args)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    grouped = query.reshape(b, q, kv_heads, heads // kv_heads, d)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, key).reshape(b, heads, q, q) / np.sqrt(d) + bias
    probs = np.ravel(jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1))
    dropped = np.ravel(jnp.where(keep, probs.reshape(keep.shape) / (1 - rate), 0))
    residuals = [np.ravel(r) for r in jax.tree.leaves(jax.linearize(ours, *args)[1])]
    assert not any(r.size == probs.size and np.allclose(r, probs) for r in residuals)
    assert not any(r.size == dropped.size and np.allclose(r, dropped) for r in residuals)
