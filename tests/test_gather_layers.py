"""Per-block weight gathering (``Execution.gather``, ``layers.weight_gather``): the same loss and gradients, the
gathers inside each rematerialised block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.mesh import batch_sharding, make_mesh  # noqa: E402
from jaxseq.models import from_config  # noqa: E402
from jaxseq.models.execution import Execution, Gathering  # noqa: E402
from jaxseq.models.layers import WeightGather, without_axis  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import padded_batch  # noqa: E402
from tests.tiny import DEFAULT, tiny_config  # noqa: E402

CONFIGS = {
    "gpt2": lambda: tiny_config("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gptj": lambda: tiny_config("gptj", n_positions=DEFAULT),
    "mistral": lambda: tiny_config("mistral", max_position_embeddings=DEFAULT, sliding_window=4),
}
# the blocks, a query kernel and a norm scale (replicated) of each family
BLOCKS = {
    "gpt2": (lambda m: m.transformer.h, "attn/c_attn/kernel", "ln_1/scale"),
    "gptj": (lambda m: m.transformer.h, "attn/q_proj/kernel", "ln_1/scale"),
    "mistral": (lambda m: m.model.layers, "self_attn/q_proj/kernel", "input_layernorm/scale"),
}


def gathering(family, mesh) -> Execution:
    """Full remat, each block gathering its own weights (``Execution.gather``)."""
    return Execution(remat="full", gather=Gathering(mesh, tuple(partition.get_partition_rules(family))))


def loss_fn(model, batch):
    graphdef, params = nnx.split(model)
    task = CausalLM(chunk_tokens=4, batch_shards=4)  # 1 row per device (dp x fsdp = 4) x 4 positions
    return graphdef, params, lambda p: task.loss(nnx.merge(graphdef, p), batch, None)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_gathering_keeps_loss_and_gradients(family):
    mesh = make_mesh("dp=2,fsdp=2,mp=2")
    ids, mask = padded_batch(64, lengths=(10, 7, 9, 4))
    batch = jax.device_put({"input_ids": ids, "attention_mask": mask}, batch_sharding(mesh))

    def run(model):
        _, params, loss = loss_fn(model, batch)
        return jax.jit(jax.value_and_grad(loss))(params)

    want = run(from_config(CONFIGS[family](), "causal-lm", mesh=mesh, seed=0))
    model = from_config(CONFIGS[family](), "causal-lm", mesh=mesh, seed=0, execution=gathering(family, mesh))
    got = run(model)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    get_blocks, kernel, norm = BLOCKS[family]
    gathered = {name: sharding.spec for name, _, sharding in get_blocks(model).weight_gathers[0].weights}
    assert gathered[kernel] == P(None, "mp")  # P("fsdp", "mp") without fsdp
    assert not any("fsdp" in str(spec) for spec in gathered.values())
    assert norm not in gathered  # replicated already: nothing to gather

    plain = from_config(CONFIGS[family](), "causal-lm", mesh=mesh, seed=0, execution=Execution(remat="full"))
    assert all(gather is None for gather in get_blocks(plain).weight_gathers)


def constraints(jaxpr, inside=False):
    """``(spec, dtype, inside)`` of every sharding constraint: whether it sits inside a checkpoint (remat)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            yield eqn.params["sharding"].spec, eqn.invars[0].aval.dtype, inside
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    yield from constraints(
                        getattr(sub, "jaxpr", sub), inside or eqn.primitive.name in ("checkpoint", "remat", "remat2")
                    )


def test_gathers_sit_inside_each_rematerialised_block():
    """Every block's kernels are gathered in the compute dtype in the forward pass, and again inside the
    block's checkpoint in the backward pass (its recomputation), one block at a time."""
    mesh = make_mesh("fsdp=8")
    config = CONFIGS["gptj"]()
    model = from_config(config, "causal-lm", dtype=jnp.bfloat16, mesh=mesh, seed=0, execution=gathering("gptj", mesh))
    batch = {"input_ids": jnp.zeros((8, 8), jnp.int32)}
    _, params, loss = loss_fn(model, batch)
    found = list(constraints(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))
    per_block = len(model.transformer.h.weight_gathers[0].weights)
    assert per_block == 6  # q, k, v, out_proj, fc_in, fc_out kernels
    weights = [(dtype, inside) for spec, dtype, inside in found if spec in (P(None, "mp"), P("mp", None))]
    assert all(dtype == jnp.bfloat16 for dtype, _ in weights)
    assert sum(not inside for _, inside in weights) == config.n_layer * per_block  # the forward pass
    assert sum(inside for _, inside in weights) >= config.n_layer * per_block  # the recomputation (and transpose)
    # and each block's input split over the batch axes
    assert sum(spec == P(("dp", "fsdp", "ep"), None, None) for spec, _, _ in found) >= 2 * config.n_layer


def test_weight_gather_is_a_hashable_static_attribute():
    mesh = make_mesh("fsdp=8")
    a = WeightGather((("mlp/fc_in/kernel", jnp.dtype(jnp.bfloat16), NamedSharding(mesh, P(None, "mp"))),), mesh)
    b = WeightGather((("mlp/fc_in/kernel", jnp.dtype(jnp.bfloat16), NamedSharding(mesh, P(None, "mp"))),), mesh)
    assert hash(a) == hash(b) and a == b
    assert without_axis(P("fsdp", "mp"), "fsdp") == P(None, "mp")
    assert without_axis(P(("dp", "fsdp"), None), "fsdp") == P(("dp",), None)
