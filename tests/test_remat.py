"""Rematerialised blocks give the same loss and gradients as stored activations, for every family."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

transformers = pytest.importorskip("transformers")

from jaxseq.models import from_config  # noqa: E402
from jaxseq.models.layers import enable_remat  # noqa: E402
from tests.reference import padded_batch  # noqa: E402

CONFIGS = {
    "gpt2": lambda: (
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32),
        "causal-lm",
    ),
    "gptj": lambda: (
        transformers.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=64, n_positions=32),
        "causal-lm",
    ),
    "t5": lambda: (
        transformers.T5Config(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=64),
        "seq2seq-lm",
    ),
    "bert": lambda: (
        transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64
        ),
        "masked-lm",
    ),
}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_remat_gives_the_same_gradients(family):
    config, task = CONFIGS[family]()
    ids, mask = (jnp.asarray(a) for a in padded_batch(64, lengths=(10, 7)))

    def loss_and_grads(model):
        graphdef, params = nnx.split(model)

        def loss(params):
            m = nnx.merge(graphdef, params)
            args = (ids, mask, ids) if task == "seq2seq-lm" else (ids, mask)
            out = m(*args, rngs=nnx.Rngs(dropout=0))
            logits = out if isinstance(out, jax.Array) else out.logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

        return jax.jit(jax.value_and_grad(loss))(params)

    plain = loss_and_grads(from_config(config, task, seed=0))
    remat_model = enable_remat(from_config(config, task, seed=0))
    assert any(getattr(m, "remat", False) for _, m in nnx.iter_modules(remat_model))
    remat = loss_and_grads(remat_model)
    np.testing.assert_allclose(remat[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(remat[1]), jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(a, b, atol=1e-6)
