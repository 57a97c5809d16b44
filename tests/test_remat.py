"""Rematerialised blocks give the same loss and gradients as stored activations, for every family and policy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import from_config  # noqa: E402
from jaxseq.models.execution import REMAT_POLICIES, Execution  # noqa: E402
from tests.reference import padded_batch  # noqa: E402
from tests.tiny import DEFAULT, tiny_config  # noqa: E402

CONFIGS = {
    "gpt2": lambda: (tiny_config("gpt2"), "causal-lm"),
    "gptj": lambda: (tiny_config("gptj"), "causal-lm"),
    "t5": lambda: (tiny_config("t5"), "seq2seq-lm"),
    # grouped-query attention, a sliding window shorter than the rows
    "mistral": lambda: (tiny_config("mistral", max_position_embeddings=DEFAULT, sliding_window=4), "causal-lm"),
    "bert": lambda: (tiny_config("bert", max_position_embeddings=DEFAULT), "masked-lm"),
}


def loss_and_grads(model, task):
    ids, mask = (jnp.asarray(a) for a in padded_batch(64, lengths=(10, 7)))
    graphdef, params = nnx.split(model)

    def loss(params):
        m = nnx.merge(graphdef, params)
        args = (ids, mask, ids) if task == "seq2seq-lm" else (ids, mask)
        out = m(*args, rngs=nnx.Rngs(dropout=0))
        logits = out if isinstance(out, jax.Array) else out.logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-6)


def remat_policies(model) -> set[str]:
    return {m.remat for _, m in nnx.iter_modules(model) if hasattr(m, "remat")}


@pytest.mark.parametrize(
    "family, policy", [(family, "full") for family in CONFIGS] + [("gptj", "dots"), ("gptj", "offload")]
)
def test_remat_gives_the_same_gradients(family, policy):
    config, task = CONFIGS[family]()
    plain = loss_and_grads(from_config(config, task, seed=0), task)
    remat_model = from_config(config, task, seed=0, execution=Execution(remat=policy))
    assert remat_policies(remat_model) == {policy}
    assert_same(loss_and_grads(remat_model, task), plain)


def test_remat_policy_names():
    assert REMAT_POLICIES == ("none", "full", "dots", "offload")
    config, task = CONFIGS["gpt2"]()
    assert remat_policies(from_config(config, task)) == {"none"}
    assert remat_policies(from_config(config, task, execution=Execution(remat="full"))) == {"full"}
    with pytest.raises(JaxseqError, match="unknown remat policy 'some'; choose one of none, full, dots, offload"):
        Execution(remat="some")
