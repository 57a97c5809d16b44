"""Context parallelism: a ``cp`` mesh axis splits each row's tokens over its devices (each holding chunks i and
2cp-1-i of every row), attention gathering keys and values from the group. Its logits, loss and every gradient
equal one device's, causal and packed, unrolled and scanned, on ``cp=4``, ``dp=2,cp=4`` and ``fsdp=2,cp=2,mp=2``
(Mixtral's experts on ``ep=2,cp=4``; splash attention in Pallas interpret mode); its train steps, full and
LoRA, give one device's losses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.mesh import batch_sharding, data_parallel_size, format_mesh, make_mesh
from jaxseq.models import from_config
from jaxseq.models.attention import _balanced, _natural, balanced_order, merge_sequence, split_sequence
from jaxseq.models.decide import decide_execution
from jaxseq.plan import topology
from jaxseq.plan.search import Shape, candidates, estimate
from jaxseq.sharding import named_leaves
from jaxseq.train.lora import LoraConfig
from jaxseq.train.objectives import CausalLM
from jaxseq.train.optim import OptimizerConfig
from jaxseq.train.step import TrainProgram
from tests.reference import padded_batch
from tests.tiny import tiny_config

VOCAB, SEQ = 101, 32
CONFIG = dict(hidden_size=64, intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
LOSS = CausalLM(4)  # chunks of one position per device here: the loss's chunks split over cp too


def llama():
    return tiny_config("llama", **CONFIG, attention_bias=True)


def batch(packed: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Four right-padded rows; packed: segment ids 1, 2 (and 3) as ``data.packing`` writes them."""
    ids, mask = padded_batch(VOCAB, (SEQ, 27, 19, 8), seed=seed)
    if packed:
        mask[0, 10:] = 2
        mask[1, 13:21] = 2
        mask[1, 21:27] = 3
    return {"input_ids": ids, "attention_mask": mask}


def mesh_of(spec: str | None):
    if spec is None:
        return None
    sizes = dict(part.split("=") for part in spec.split(","))
    return make_mesh(spec, devices=jax.devices()[: int(np.prod([int(v) for v in sizes.values()]))])


def forward_backward(
    spec: str | None, *, scan: bool, packed: bool, attention: str = "xla", seq: int = SEQ, config=None
):
    """(loss, logits at real tokens, gradients by path) of the tiny Llama (or ``config``'s) under ``spec``'s mesh."""
    mesh = mesh_of(spec)
    config = config or (llama() if seq == SEQ else tiny_config("llama", **{**CONFIG, "max_position_embeddings": seq}))
    execution = decide_execution(config, "causal-lm", mesh=mesh, scan_layers=scan, attention=attention, interpret=True)
    graphdef, params = nnx.split(from_config(config, "causal-lm", mesh=mesh, seed=0, execution=execution))
    data = batch(packed) if seq == SEQ else long_batch(seq)
    if mesh is not None:
        data = {k: jax.device_put(v, batch_sharding(mesh, v.ndim)) for k, v in data.items()}

    def loss_of(params, data):
        model = nnx.merge(graphdef, params)
        return LOSS.loss(model, data, None), model(data["input_ids"], data["attention_mask"]).logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_of, has_aux=True))(params, data)
    real = np.asarray(data["attention_mask"]) != 0  # a padding query's output is discarded (splash: its own)
    return float(loss), np.asarray(logits)[real], dict(named_leaves(jax.tree.map(np.asarray, grads)))


def long_batch(seq: int) -> dict[str, np.ndarray]:
    ids, mask = padded_batch(VOCAB, (seq, seq - 56), seed=1)
    mask[0, seq // 3 :] = 2
    return {"input_ids": ids, "attention_mask": mask}


def assert_same(got, want):
    assert abs(got[0] - want[0]) < 1e-5, (got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=2e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        np.testing.assert_allclose(got[2][name], want[2][name], atol=2e-6, err_msg=name)


@pytest.fixture(scope="module")
def one_device():
    return {scan: forward_backward(None, scan=scan, packed=True) for scan in (False, True)}


def test_balanced_order_gives_each_device_chunks_i_and_2cp_minus_1_minus_i():
    order = balanced_order(16, 4)  # 8 chunks of 2 positions
    chunks = order.reshape(4, 2, 2)[:, :, 0] // 2  # each device's two chunks
    assert chunks.tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert sorted(order.tolist()) == list(range(16))
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(_balanced(x, 4), np.asarray(x)[:, order])
    np.testing.assert_array_equal(_natural(_balanced(x, 4), 4), x)


@pytest.mark.parametrize(
    "spec, scan",
    [("dp=2,cp=4", False), ("fsdp=2,cp=2,mp=2", True), ("cp=4", True)],
)
def test_cp_logits_loss_and_gradients_equal_one_device(spec, scan, one_device):
    """Packed rows (segment ids 1-3) and right padding, a sequence of 32 split into 8 chunks of 4 (cp=4) or 4 of
    8 (cp=2): every parameter's gradient, the loss (its chunks over each device's positions) and the logits."""
    assert_same(forward_backward(spec, scan=scan, packed=True), one_device[scan])


def test_cp_with_experts_split_over_ep_equals_one_device():
    """Mixtral's experts over ep=2 while each row's tokens are over cp=4: each device routes its own positions."""
    config = tiny_config("mixtral", **CONFIG)
    want = forward_backward(None, scan=False, packed=True, config=config)
    assert_same(forward_backward("ep=2,cp=4", scan=False, packed=True, config=config), want)


def test_cp_splash_equals_xla_on_one_device():
    """Splash (Pallas interpret mode) over queries in balanced order (its causal mask over their positions in
    the row, ``q_seq_shards`` = cp) and gathered keys: one device's XLA numbers, packed and padded."""
    want = forward_backward(None, scan=False, packed=True, seq=256)
    assert_same(forward_backward("dp=2,cp=2", scan=False, packed=True, attention="splash", seq=256), want)


def train_losses(spec: str, lora: LoraConfig | None = None, steps: int = 2) -> list[float]:
    """The losses of ``steps`` AdamW steps (each on its own packed batch) of the tiny Llama on ``spec``."""
    mesh = mesh_of(spec)
    config = llama()
    execution = decide_execution(config, "causal-lm", mesh=mesh, scan_layers=True, attention="xla")
    model = from_config(config, "causal-lm", mesh=mesh, seed=0, execution=execution)
    optimizer = OptimizerConfig(learning_rate=1e-2, adam_epsilon=1e-3, lr_scheduler_type="constant")
    program = TrainProgram(model, LOSS, mesh, optimizer, total_steps=steps, seed=0, lora=lora)
    if lora is None:
        frozen, state = None, program.init_state(nnx.state(model))
    else:
        frozen = program.training.freeze(nnx.state(model))
        state = program.init_state(program.training.init(nnx.state(model)))
    losses = []
    for step in range(steps):
        data = batch(packed=True, seed=step)
        assert len(data["input_ids"]) % data_parallel_size(mesh) == 0
        state, metrics = program.step(state, frozen, {k: jnp.asarray(v) for k, v in data.items()})
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize(
    "spec, reference, lora",
    [
        ("dp=2,cp=4", "dp=2", None),
        (
            "cp=4",
            "dp=1",
            LoraConfig(
                lora_rank=4,
                lora_alpha=8.0,
                lora_dropout=0.0,
                lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            ),
        ),
    ],
)
def test_train_steps_with_cp_give_the_losses_without_it(spec, reference, lora):
    """The Trainer's jitted step (AdamW, the chunked loss, scanned layers), full or LoRA: each step's loss on
    the cp mesh equals the run's without cp, whose rows the same data-parallel replicas hold."""
    want, got = train_losses(reference, lora), train_losses(spec, lora)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert want[0] != want[1]


def test_cp_mesh_is_shown_refused_where_a_family_cannot_split_and_pads_rows_to_whole_chunks():
    mesh = make_mesh("fsdp=2,cp=4")
    assert format_mesh(mesh) == "dp=1,fsdp=2,cp=4,mp=1" and data_parallel_size(mesh) == 2
    assert format_mesh(make_mesh("dp=8")) == "dp=8,fsdp=1,mp=1"  # cp shown only when used
    with pytest.raises(JaxseqError, match="GPT-2 cannot split its sequence over cp"):
        decide_execution(tiny_config("gpt2"), "causal-lm", mesh=mesh)
    rows = jnp.arange(2 * 36).reshape(2, 36)  # 36 tokens do not cut into 8 chunks: padded to 40, then dropped
    (split,) = split_sequence(mesh, rows)
    assert split.shape == (2, 40) and split.sharding.spec[1] == "cp"
    np.testing.assert_array_equal(merge_sequence(mesh, split, 36), rows)


def test_plan_search_considers_cp_for_models_that_split_their_sequence():
    long = Shape(trained=0, frozen=8_000_000_000, layers=32, width=4096, heads=32, vocab=128256, seq_len=131072,
                 global_rows=2, step_flops=1e17, splits_sequence=True)  # fmt: skip
    layouts = candidates(long, 8, chunked=False)
    assert {c.cp for c in layouts} == {1, 2, 4, 8}
    for c in layouts:
        dp, fsdp, mp = c.mesh
        assert dp * fsdp * c.ep * c.cp * mp == 8 and c.micro_batch * c.accumulation * dp * fsdp * c.ep == 2
    assert {c.cp for c in candidates(dataclasses.replace(long, splits_sequence=False), 8, chunked=False)} == {1}
    v5p = topology("v5p-16")
    first = next(c for c in layouts if c.cp == 4 and c.mesh == (1, 2, 1) and c.remat == "full")
    assert first.mesh_spec == "dp=1,fsdp=2,cp=4,mp=1"
    alone = dataclasses.replace(first, cp=1)
    assert estimate(first, long, v5p)[0] < estimate(alone, long, v5p)[0]  # a quarter of each row's activations
