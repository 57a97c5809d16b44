"""Sharded forward and AdamW step on 8 virtual devices equal the single-device result, per family."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import batch_sharding, data_parallel_size, format_mesh, make_mesh, mesh_sizes, parse_mesh_spec  # noqa: E402
from jaxseq.models import Execution, from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.layers import THREEFRY4X32_BITS, dropout_prng  # noqa: E402
from tests.reference import padded_batch  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

# every axis: the batch split over dp and over fsdp, weights over fsdp, model parallelism over 2 and 4 devices
MESHES = ["dp=2,mp=4", "fsdp=4,mp=2"]
VOCAB = 128


def lm_loss(model, batch, rngs=None):
    logits = model(batch["input_ids"], batch["attention_mask"], rngs=rngs).logits
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["input_ids"][:, 1:])
    weights = batch["attention_mask"][:, 1:]
    return (losses * weights).sum() / weights.sum(), logits


def classification_loss(model, batch, rngs=None):
    logits = model(batch["input_ids"], batch["attention_mask"], rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean(), logits


def seq2seq_loss(model, batch, rngs=None):
    logits = model(batch["input_ids"], batch["attention_mask"], batch["decoder_input_ids"], rngs=rngs).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["input_ids"]).mean(), logits


def make_batch(seed=0):
    ids, mask = padded_batch(VOCAB, lengths=(16, 11, 7, 16, 3, 9, 16, 12), seed=seed)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": (ids[:, 0] % 2).astype(np.int32),
        "decoder_input_ids": np.roll(ids, 1, axis=1),
    }


CASES = {
    "gpt2-lm": (
        lambda: tiny_config("gpt2", n_embd=64, vocab_size=VOCAB, n_positions=64, pad_token_id=0),
        "causal-lm",
        lm_loss,
    ),
    "gpt2-cls": (
        lambda: tiny_config("gpt2", n_embd=64, vocab_size=VOCAB, n_positions=64, pad_token_id=0, num_labels=2),
        "sequence-classification",
        classification_loss,
    ),
    "gptj-lm": (
        lambda: tiny_config("gptj", n_embd=64, rotary_dim=8, vocab_size=VOCAB, n_positions=64),
        "causal-lm",
        lm_loss,
    ),
    "t5": (
        lambda: tiny_config(
            "t5",
            d_model=64,
            d_kv=16,
            d_ff=128,
            vocab_size=VOCAB,
            dropout_rate=0.0,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
        ),
        "seq2seq-lm",
        seq2seq_loss,
    ),
    "bert-cls": (
        lambda: tiny_config(
            "bert", hidden_size=64, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, num_labels=2
        ),
        "sequence-classification",
        classification_loss,
    ),
}

LLAMA = dict(
    hidden_size=64, intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, num_labels=2
)
# Grouped-query attention on a (dp=2, fsdp=2, mp=2) mesh: key/value heads fewer than mp (their features split over
# mp) and as many as mp (a whole head per device), a sliding window, qkv biases, tied and untied heads.
LLAMA_CASES = {
    "llama-kv1-lm": (lambda: tiny_config("llama", **LLAMA, num_key_value_heads=1), "causal-lm", lm_loss),
    "mistral-kv2-window-lm": (
        lambda: tiny_config("mistral", **LLAMA, num_key_value_heads=2, sliding_window=5),
        "causal-lm",
        lm_loss,
    ),
    "qwen2-kv2-tied-cls": (
        lambda: tiny_config(
            "qwen2",
            **LLAMA,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
        ),
        "sequence-classification",
        classification_loss,
    ),
}


def run(case, mesh_spec=None, dropout_key=None):
    """One AdamW step: logits, loss, updated params (on their devices) and optimizer state; in training mode
    (dropout drawn from ``dropout_key``) when one is given."""
    make_config, task, loss_fn = {**CASES, **LLAMA_CASES}[case]
    config = make_config()
    mesh = make_mesh(mesh_spec) if mesh_spec else None
    graphdef, params = nnx.split(from_config(config, task, mesh=mesh, seed=0))
    # Adam's first update is lr * g / (|g| + eps): for a gradient near 0 (a key bias, a dead ReLU unit) its sign
    # is set by summation order, which sharding changes. eps=1e-5 bounds that amplification so the comparison
    # tests the sharded computation, not float noise at 1e-9.
    tx = optax.adamw(1e-3, eps=1e-5, weight_decay=0.01)
    batch = make_batch()

    def step(params, opt_state, batch):
        def loss_of(p):
            rngs = None if dropout_key is None else nnx.Rngs(dropout=dropout_key)
            return loss_fn(nnx.merge(graphdef, p), batch, rngs)

        (loss, logits), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return {"logits": logits, "loss": loss, "params": optax.apply_updates(params, updates), "opt": opt_state}

    if mesh is None:
        return jax.jit(step)(params, tx.init(params), batch)
    rules = partition.get_partition_rules(config.model_type)
    param_sh = partition.make_shardings(mesh, partition.match_partition_rules(rules, params))
    opt_sh = partition.make_shardings(mesh, partition.match_partition_rules(rules, jax.eval_shape(tx.init, params)))
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    batch_sh = {k: batch_sharding(mesh, np.ndim(v)) for k, v in batch.items()}
    step = jax.jit(
        step,
        in_shardings=(param_sh, opt_sh, batch_sh),
        out_shardings={"logits": None, "loss": None, "params": param_sh, "opt": opt_sh},
        donate_argnums=(0, 1),
    )
    return step(params, opt_state, partition.shard(batch, batch_sh))


@pytest.fixture(scope="module")
def single_device():
    return {case: run(case) for case in CASES}


# GPT-2's and T5's steps on both meshes, the other cases on one each
SHARDED = [(case, mesh) for case in ("gpt2-lm", "t5") for mesh in MESHES] + [
    ("gpt2-cls", MESHES[1]),
    ("gptj-lm", MESHES[0]),
    ("bert-cls", MESHES[0]),
]


@pytest.mark.parametrize("case, mesh_spec", SHARDED)
def test_sharded_step_equals_single_device(case, mesh_spec, single_device):
    assert_same_step(run(case, mesh_spec), single_device[case])


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_families_on_a_dp_fsdp_mp_mesh_equal_single_device(case):
    """The k/v projections are sharded like q's, by output column over mp: one key/value head of 16 features
    is split 8 + 8 over mp=2, two heads are one per device; either way the step is the single-device step."""
    got = run(case, "dp=2,fsdp=2,mp=2")
    assert_same_step(got, run(case))
    kv_heads = LLAMA_CASES[case][0]().num_key_value_heads
    k_proj = dict(partition.named_leaves(got["params"]))["model/layers/0/self_attn/k_proj/kernel"]
    assert k_proj.sharding.spec == P("fsdp", "mp")
    assert {s.data.shape for s in k_proj.addressable_shards} == {(32, kv_heads * 16 // 2)}


# the dropout PRNG of programs on CPU, and on TPU and GPU (jaxseq.models.layers.dropout_prng)
@pytest.mark.parametrize("case, platform, mesh_spec", [("gpt2-lm", "cpu", MESHES[0]), ("bert-cls", "tpu", MESHES[1])])
def test_dropout_draws_the_same_masks_on_any_mesh(case, platform, mesh_spec, single_device):
    """Dropout (GPT-2's and BERT's default 0.1: attention probabilities, residuals, embeddings) drawn per shard
    from partitionable keys gives the single-device step on a mesh, so no chip draws the global batch's
    bits and a run's numbers do not depend on its mesh."""
    key = jax.random.key(3, impl=dropout_prng(platform))
    want = run(case, dropout_key=key)
    assert abs(float(want["loss"]) - float(single_device[case]["loss"])) > 1e-3  # dropout is on
    assert_same_step(run(case, mesh_spec, dropout_key=key), want)


def test_cpu_dropout_keys_draw_threefry4x32_bits():
    """``THREEFRY4X32_BITS``: a key's bits are JAX's Threefry-4x32 bits of its 4 words, bit for bit; a step's
    keys derived inside a program (``fold_in`` then ``split``, which XLA:CPU turned into a program running for
    minutes with Threefry-4x32's own derivation) are the eager ones, all distinct; the masks of two steps keep
    90% each and agree as independent draws do (0.9^2 + 0.1^2)."""
    key = jax.random.key(11, impl=THREEFRY4X32_BITS)
    words = jax.random.key_data(key)
    for shape, dtype in (((7, 5), jnp.uint32), ((64,), jnp.uint8)):
        want = jax.random.bits(jax.random.wrap_key_data(words, impl="threefry4x32"), shape, dtype)
        np.testing.assert_array_equal(jax.random.bits(key, shape, dtype), want)

    def keys(step):
        return jax.random.key_data(jax.random.split(jax.random.fold_in(key, step), 5))

    traced = jax.jit(keys)(jnp.int32(3))
    np.testing.assert_array_equal(traced, keys(3))
    every = np.concatenate([traced, keys(4), jax.random.key_data(jax.random.split(key, 5))])
    assert len({tuple(k) for k in every.tolist()}) == len(every)
    masks = [np.asarray(jax.random.bernoulli(jax.random.fold_in(key, step), 0.9, (1000, 1000))) for step in (1, 2)]
    assert all(abs(m.mean() - 0.9) < 0.002 for m in masks)
    assert abs((masks[0] == masks[1]).mean() - 0.82) < 0.003


def assert_same_step(got, want):
    host = partition.gather({k: got[k] for k in ("logits", "loss", "params")})
    np.testing.assert_allclose(host["logits"], want["logits"], atol=1e-5, rtol=0)
    assert abs(float(host["loss"]) - float(want["loss"])) <= 1e-5
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), host["params"], partition.gather(want["params"]))
    assert max(jax.tree.leaves(diffs)) <= 1e-5
    # the optimizer moments live exactly where their parameters do
    param_sh = {n: x.sharding for n, x in partition.named_leaves(got["params"])}
    moments = [(n, x) for n, x in partition.named_leaves(got["opt"]) if "/mu/" in n or "/nu/" in n]
    assert len(moments) == 2 * len(param_sh)
    for name, leaf in moments:
        assert leaf.sharding.is_equivalent_to(param_sh[name.split("/", 2)[2]], leaf.ndim), name


def test_load_pretrained_places_weights_on_their_shardings(tmp_path):
    model = from_config(CASES["gpt2-lm"][0](), "causal-lm")
    save_pretrained(model, tmp_path)
    mesh = make_mesh("dp=2,mp=4")
    loaded = load_pretrained(tmp_path, "causal-lm", mesh=mesh)
    kernel = loaded.transformer.h[0].attn.c_attn.kernel[...]
    assert kernel.sharding.spec == P("fsdp", "mp")
    assert {s.data.shape for s in kernel.addressable_shards} == {(64, 48)}
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(model.transformer.h[0].attn.c_attn.kernel[...]))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dp=3", "mesh dp=3,fsdp=1,mp=1 needs 3 devices but 8 are available"),
        ("dp=2,mp=2", "needs 4 devices but 8 are available"),
        ("dp=-1,mp=3", "8 devices are not divisible by 3"),
        ("tp=8", "unknown mesh axis tp"),
        ("dp:8", "bad mesh spec"),
        ("dp=-1,mp=-1", "at most one -1"),
    ],
)
def test_bad_mesh_specs(spec, message):
    with pytest.raises(JaxseqError, match=message):
        make_mesh(spec)


def test_mesh_forms():
    assert parse_mesh_spec("dp=2,mp=-1", 8) == {"dp": 2, "fsdp": 1, "ep": 1, "cp": 1, "mp": 4}
    assert parse_mesh_spec({"fsdp": 8}, 8) == {"dp": 1, "fsdp": 8, "ep": 1, "cp": 1, "mp": 1}
    assert parse_mesh_spec(None, 8) == {"dp": 8, "fsdp": 1, "ep": 1, "cp": 1, "mp": 1}
    assert dict(make_mesh("fsdp=4,mp=2").shape) == {"dp": 1, "fsdp": 4, "ep": 1, "cp": 1, "mp": 2}
    assert dict(make_mesh("dp=2,ep=4").shape) == {"dp": 2, "fsdp": 1, "ep": 4, "cp": 1, "mp": 1}
    assert data_parallel_size(make_mesh("dp=2,ep=2,mp=2")) == 4  # ep splits the batch too
    assert format_mesh(make_mesh("fsdp=4,mp=2")) == "dp=1,fsdp=4,mp=2"  # ep shown only when used
    assert mesh_sizes(make_mesh("ep=8")) == {"dp": 1, "fsdp": 1, "ep": 8, "mp": 1}  # cp shown only when used, as ep


def test_indivisible_dimension_is_reported():
    config = tiny_config("gpt2", n_layer=1, n_embd=64, n_inner=102, vocab_size=101, n_positions=64)
    match = r"transformer/h/0/mlp/c_fc/kernel shape \(64, 102\) spec P\('fsdp', 'mp'\)"
    with pytest.raises(JaxseqError, match=match):
        from_config(config, "causal-lm", mesh=make_mesh("dp=2,mp=4"))


def test_rules_first_match_wins_and_unmatched_path_is_named():
    tree = {"block": {"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}}, "step": np.zeros(())}
    rules = [(r"dense/kernel", P("fsdp", "mp")), (r"kernel", P("mp", None)), (r"bias", P())]
    specs = partition.match_partition_rules(rules, tree)
    assert specs == {"block": {"dense": {"kernel": P("fsdp", "mp"), "bias": P()}}, "step": P()}
    with pytest.raises(JaxseqError, match="no partition rule matches parameter 'block/dense/bias'"):
        partition.match_partition_rules(rules[:1], tree)


def test_describe_totals():
    mesh = make_mesh("dp=2,mp=4")
    tree = {"w": jnp.zeros((8, 16)), "b": jnp.zeros((16,))}
    specs = {"w": P(None, "mp"), "b": P()}
    table = partition.describe(tree, specs, mesh)
    rows = {line.split()[0]: line.split("  ") for line in table.splitlines()[1:3]}
    assert [c.strip() for c in rows["w"] if c.strip()] == ["w", "(8, 16)", "float32", "P(None, 'mp')", "128"]
    assert [c.strip() for c in rows["b"] if c.strip()] == ["b", "(16,)", "float32", "P()", "64"]
    assert "2 arrays" in table and "per device" in table


def test_the_parameter_table_of_a_scanned_model_is_the_unrolled_models():
    """A stacked parameter is listed per layer, named, shaped, split and ordered as the unrolled model's."""
    from transformers import GPT2Config

    from jaxseq.models.hub import abstract_model
    from jaxseq.sharding import describe

    mesh = make_mesh("dp=2,fsdp=2,mp=2")
    config = GPT2Config(n_layer=12, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    tables = []
    for scan in (False, True):
        params = nnx.state(abstract_model(config, "causal-lm", execution=Execution(scan_layers=scan)), nnx.Param)
        specs = partition.match_partition_rules(partition.get_partition_rules("gpt2"), params)
        tables.append(describe(params, specs, mesh))
    assert tables[1] == tables[0]
    assert re.search(r"^transformer/h/11/mlp/c_fc/kernel +\(32, 128\)", tables[1], re.M)
