"""Ahead-of-time compiles for a TPU slice (libtpu, no TPU needed): per-block weight gathering lowers the
train step's memory. Under CI a missing libtpu fails these tests instead of skipping them."""

import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu too

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.mesh import batch_spec, make_mesh  # noqa: E402
from jaxseq.models.execution import Execution, Gathering  # noqa: E402
from jaxseq.models.gptj import GPTJForCausalLM  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from jaxseq.train.optim import OptimizerConfig, make_optimizer  # noqa: E402
from jaxseq.train.step import TrainState, state_specs  # noqa: E402


def tpu_devices(topology: str):
    """The abstract devices of a TPU slice, e.g. ``v5e:2x4``; without libtpu a skip, or under CI a failure."""
    try:
        from jax.experimental import topologies

        return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    except Exception as error:
        message = f"cannot compile for TPU {topology} here (is libtpu installed? pip install jaxseq[tpu]): {error}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def compile_train_step(model, mesh, seq: int, task):
    """The Trainer's step (loss, gradients, AdamW update; the state donated) compiled for ``mesh``."""
    rules = partition.get_partition_rules(model.config.model_type)
    graphdef, params = nnx.split(model)
    tx, _ = make_optimizer(OptimizerConfig(optimizer="adamw"), 100)
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, jax.eval_shape(tx.init, params))
    shardings = partition.make_shardings(mesh, state_specs(partition.match_partition_rules(rules, params), abstract))

    def step(state, batch):
        loss = lambda p: task.loss(nnx.merge(graphdef, p), batch, None)
        grads = jax.grad(loss)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)

    rows = mesh.shape["dp"] * mesh.shape["fsdp"]
    batch = {"input_ids": jax.ShapeDtypeStruct((rows, seq), jnp.int32)}
    batch_shardings = {"input_ids": NamedSharding(mesh, batch_spec(2))}
    jitted = jax.jit(step, in_shardings=(shardings, batch_shardings), out_shardings=shardings, donate_argnums=0)
    return jitted.lower(abstract, batch).compile()


def test_gathering_one_block_at_a_time_lowers_the_memory_of_a_v5e_train_step():
    mesh = make_mesh("fsdp=8", tpu_devices("v5e:2x4"))
    config = transformers.GPTJConfig(n_layer=2, n_embd=512, n_head=8, rotary_dim=16, vocab_size=1024)

    def compiled(gather: bool):
        rules = tuple(partition.get_partition_rules("gptj"))
        execution = Execution(remat="full", gather=Gathering(mesh, rules) if gather else None)
        model = nnx.eval_shape(
            lambda: GPTJForCausalLM(
                config, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0), execution=execution
            )
        )
        return compile_train_step(model, mesh, 512, CausalLM(chunk_tokens=256, batch_shards=8))

    plain, gathered = compiled(False), compiled(True)
    plain_bytes, gathered_bytes = (c.memory_analysis().temp_size_in_bytes for c in (plain, gathered))
    print(f"temp bytes per device: {plain_bytes:,} without gathering, {gathered_bytes:,} with")
    assert gathered_bytes < 0.5 * plain_bytes
    # the blocks' kernels are all-gathered whole, in bfloat16 (fc_in: [512, 2048], split [64, 2048] over fsdp)
    assert re.search(r"= bf16\[512,2048\]\{[^}]*\} all-gather\(", gathered.as_text())
