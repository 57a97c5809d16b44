"""Scanned layers (``scan_layers=True``, ``jaxseq.models.layers.Stacked``): the blocks' parameters stacked with a
leading layer axis and run by one scan give the unrolled model's logits, gradients, generations, train steps and
Hugging Face files, from the same (perturbed) weights: decoders (GPT-2, GPT-J, Llama, Mistral, Qwen3, OPT), BERT and
RoBERTa (their classifiers' last layer at the [CLS] tokens alone, apart from the scan) and T5 (v1.0 and v1.1; the
position bias of the unrolled first block beside each stack)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.data import glue, packing  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.mesh import batch_sharding, make_mesh  # noqa: E402
from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.execution import Execution, Gathering  # noqa: E402
from jaxseq.models.hub import abstract_model  # noqa: E402
from jaxseq.models.layers import Stacked, dropout, layer_paths  # noqa: E402
from jaxseq.models.t5 import shift_right  # noqa: E402
from jaxseq.models.weights import read_checkpoint, torch_layout  # noqa: E402
from jaxseq.sharding import unstacked_path  # noqa: E402
from jaxseq.train.lora import LoraConfig, merge_adapter  # noqa: E402
from jaxseq.train.objectives import CausalLM, Seq2SeqLM, SequenceClassification  # noqa: E402
from tests.reference import padded_batch  # noqa: E402
from tests.test_gather_layers import constraints  # noqa: E402
from tests.test_step_parity import flat_params, jaxseq_program  # noqa: E402
from tests.tiny import DEFAULT, tiny_config  # noqa: E402

VOCAB = 64


LAYERS = dict(num_hidden_layers=3, intermediate_size=48, vocab_size=VOCAB)  # three blocks to scan
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2_config():
    return tiny_config("gpt2", n_layer=3, vocab_size=VOCAB, **NO_DROPOUT, scale_attn_by_inverse_layer_idx=True)


def gptj_config():
    return tiny_config("gptj", n_layer=3, vocab_size=VOCAB, **NO_DROPOUT)


def llama_config():
    return tiny_config("llama", **LAYERS, attention_bias=True, tie_word_embeddings=False)


def mistral_config():
    return tiny_config("mistral", **LAYERS, sliding_window=4)


def qwen3_config():
    return tiny_config("qwen3", **LAYERS, attention_bias=True)


def gemma2_config():
    """Every layer sliding (a scan needs one window), both soft-caps, tied head."""
    return tiny_config(
        "gemma2", **LAYERS, sliding_window=4, query_pre_attn_scalar=12, attn_logit_softcapping=3.0,
        final_logit_softcapping=8.0, layer_types=["sliding_attention"] * 3,
    )  # fmt: skip


def gemma3_config():
    """Every layer full (a scan needs one window), q/k norms, linear rope scaling."""
    return tiny_config(
        "gemma3_text", **LAYERS, sliding_window=4, query_pre_attn_scalar=12, layer_types=["full_attention"] * 3,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}},
    )  # fmt: skip


def bert_config():
    return tiny_config(
        "bert", **LAYERS, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )  # fmt: skip


def opt_config():
    return tiny_config(
        "opt", num_hidden_layers=3, ffn_dim=48, word_embed_proj_dim=16, do_layer_norm_before=False, vocab_size=VOCAB,
        dropout=0.0,
    )  # fmt: skip


def roberta_config():
    return tiny_config(
        "roberta", **LAYERS, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0
    )  # fmt: skip


def t5_config(**kw):
    return tiny_config(
        "t5", num_layers=3, num_decoder_layers=2, d_ff=48, vocab_size=VOCAB, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1, **kw,
    )  # fmt: skip


def t5_v11_config():
    return t5_config(feed_forward_proj="gated-gelu", tie_word_embeddings=False)


CONFIGS = {
    "gpt2": gpt2_config,
    "gptj": gptj_config,
    "llama": llama_config,
    "mistral": mistral_config,
    "qwen3": qwen3_config,
    "gemma2": gemma2_config,
    "gemma3": gemma3_config,
    "opt": opt_config,
    "bert": bert_config,
    "bert-mlm": bert_config,
    "roberta": roberta_config,
    "t5": t5_config,
    "t5-v1.1": t5_v11_config,
}
TASKS = {
    "bert": "sequence-classification",
    "bert-mlm": "masked-lm",
    "roberta": "sequence-classification",
    "t5": "seq2seq-lm",
    "t5-v1.1": "seq2seq-lm",
}
STACKS = {
    "gpt2": ("transformer/h",),
    "gptj": ("transformer/h",),
    "llama": ("model/layers",),
    "mistral": ("model/layers",),
    "qwen3": ("model/layers",),
    "gemma2": ("model/layers",),
    "gemma3": ("model/layers",),
    "opt": ("model/decoder/layers",),
    "bert": ("bert/encoder/layer",),
    "bert-mlm": ("bert/encoder/layer",),
    "roberta": ("roberta/encoder/layer",),
    "t5": ("encoder/block", "decoder/block"),
    "t5-v1.1": ("encoder/block", "decoder/block"),
}
T5_BIAS = "first_only/layer/0/SelfAttention/relative_attention_bias/embedding"  # beside each T5 stack


ENCODERS = ("bert", "roberta")  # classifiers in these tests


def task(family: str) -> str:
    return TASKS.get(family, "causal-lm")


def objective(family: str, batch_shards: int | None = None):
    """The family's training objective (a causal LM's in chunks of 4 tokens, its batch in ``batch_shards``)."""
    if family.startswith("t5"):
        return Seq2SeqLM()
    if family.startswith(ENCODERS):
        return SequenceClassification(glue.get_task("mnli"))
    return CausalLM() if batch_shards is None else CausalLM(chunk_tokens=4, batch_shards=batch_shards)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's unrolled model, every parameter perturbed away from its initialisation, saved as an HF
    folder (padding vocabulary rows come back as zeros, as a load gives them)."""
    out = {}
    for family, make in CONFIGS.items():
        model = from_config(make(), task(family), seed=0)
        state = nnx.state(model, nnx.Param)
        leaves, treedef = jax.tree.flatten(state)
        rng = np.random.default_rng(1)
        noisy = [x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]
        nnx.update(model, jax.tree.unflatten(treedef, noisy))
        out[family] = save_pretrained(model, tmp_path_factory.mktemp(family))
    return out


def pair(folders, family, scanned: Execution = Execution(scan_layers=True), **kwargs):
    """The unrolled and the scanned model of ``family`` loaded from its folder (``scanned``: how the scanned one
    runs)."""
    load = lambda execution: load_pretrained(folders[family], task(family), execution=execution, **kwargs)
    return load(Execution()), load(scanned)


def per_layer(tree) -> dict[str, np.ndarray]:
    """A parameter tree (parameters or gradients) of either model by the unrolled model's paths."""
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(tree)}
    out = {}
    for path, (stored, layer) in layer_paths(tree).items():
        array = np.asarray(flat[stored])
        out["/".join(map(str, path))] = array if layer is None else array[layer]
    return out


def batch(family="gpt2", packed=False):
    """Right-padded rows; BERT's and RoBERTa's with labels (BERT's with token types; ``packed``: into 3 rows), T5's
    with targets."""
    ids, mask = padded_batch(VOCAB, lengths=(12, 7, 5, 4) if family.startswith(ENCODERS) else (12, 9, 5, 12))
    out = {"input_ids": ids, "attention_mask": mask}
    if family.startswith("bert"):
        types = (np.arange(12)[None, :] >= mask.sum(1, keepdims=True) // 2) & (mask == 1)
        out.update(token_type_ids=types.astype(np.int32))
    if family.startswith(ENCODERS):
        out.update(labels=np.array([0, 2, 1, 2], np.int32))
        out = packing.pack(out, 3) if packed else out
    if family.startswith("t5"):
        labels, target_mask = padded_batch(VOCAB, lengths=(6, 3, 7, 5), seed=1)
        out.update(labels=labels, decoder_attention_mask=target_mask)
    return {name: jnp.asarray(array) for name, array in out.items()}


def on_mesh(b, mesh):
    """Batch ``b`` split over the mesh's batch axes."""
    return {name: jax.device_put(array, batch_sharding(mesh, array.ndim)) for name, array in b.items()}


def logits(family, model, b):
    if family.startswith("t5"):
        return model(b["input_ids"], b["attention_mask"], shift_right(b["labels"], 0, 0)).logits
    extra = {name: b[name] for name in ("token_type_ids", "position_ids", "pool_index") if name in b}
    out = model(b["input_ids"], b["attention_mask"], **extra)
    return out if family.startswith(ENCODERS) else out.logits


def loss_and_grads(model, b, family="gpt2", mesh=None):
    graphdef, params = nnx.split(model)
    loss = objective(family, 1 if mesh is None else 4).loss
    return jax.jit(jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), b, None)))(params)


def token_loss(model, b, _):
    """A masked LM's cross-entropy of every real token (none masked: the head's gradients are what count)."""
    scores = jax.nn.log_softmax(logits("bert-mlm", model, b))
    picked = jnp.take_along_axis(scores, b["input_ids"][..., None], -1)[..., 0]
    return -(picked * b["attention_mask"]).sum() / b["attention_mask"].sum()


def logits_loss_and_grads(model, b, family):
    """The model's logits, and its loss and gradients, from one compiled program."""
    graphdef, params = nnx.split(model)
    objective_loss = token_loss if family == "bert-mlm" else objective(family).loss
    loss = lambda p: objective_loss(nnx.merge(graphdef, p), b, None)
    return jax.jit(lambda p: (logits(family, nnx.merge(graphdef, p), b), jax.value_and_grad(loss)(p)))(params)


def assert_same_grads(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    got, want = per_layer(got[1]), per_layer(want[1])
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=2e-6, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "family, policy, packed",
    [
        ("gpt2", "full", False),
        ("gptj", "dots", False),
        ("llama", "offload", False),
        ("mistral", "full", False),
        ("qwen3", "dots", False),
        ("gemma2", "full", False),
        ("gemma3", "dots", False),
        ("opt", "full", False),
        ("bert", "none", False),
        ("bert", "full", True),
        ("bert-mlm", "dots", False),
        ("roberta", "dots", True),
        ("t5", "none", False),
        ("t5-v1.1", "dots", False),
    ],
)
def test_scanned_model_equals_unrolled(family, policy, packed, folders, tmp_path):
    """Stored as one stacked module per stack, each parameter with a leading layer axis (beside T5's stacks, the
    position bias of their unrolled first block), under the same PyTorch names, exported as exactly the unrolled
    model's tensors; and from the same weights, under each remat policy, the unrolled model's logits, loss and
    gradients (encoders' packed rows too)."""
    unrolled, scanned = pair(folders, family, Execution(scan_layers=True, remat=policy))
    config = CONFIGS[family]()
    params = partition.named_leaves(nnx.state(scanned, nnx.Param))
    for stack in STACKS[family]:
        layers = config.num_decoder_layers if stack.startswith("decoder") else config.num_hidden_layers
        inside = {name: x.shape for name, x in params if name.startswith(stack + "/")}
        stacked = {name: shape for name, shape in inside.items() if name.startswith(f"{stack}/stacked/")}
        assert stacked and all(shape[0] == layers for shape in stacked.values())
        assert set(inside) - set(stacked) == ({f"{stack}/{T5_BIAS}"} if family.startswith("t5") else set())
    assert torch_layout(scanned) == torch_layout(unrolled)

    save_pretrained(scanned, tmp_path / "scanned")
    want, got = read_checkpoint(folders[family]), read_checkpoint(tmp_path / "scanned")
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name](), want[name](), err_msg=name)
    assert (
        json.loads((tmp_path / "scanned" / "config.json").read_text())["architectures"]
        == json.loads((folders[family] / "config.json").read_text())["architectures"]
    )

    b = batch(family, packed)
    (want_logits, want), (got_logits, got) = (logits_loss_and_grads(m, b, family) for m in (unrolled, scanned))
    np.testing.assert_allclose(got_logits, want_logits, atol=2e-5, rtol=1e-5)
    assert_same_grads(got, want)


@pytest.mark.parametrize("family", ["gpt2", "mistral", "bert", "t5-v1.1"])
def test_gathered_one_layer_at_a_time_inside_the_scan(family, folders):
    """The family's own rules shard a stacked parameter behind a replicated layer axis, and a model loaded onto a
    mesh is placed straight onto those shardings. fsdp's per-block gather works inside the scanned body: the
    same loss and gradients on a (dp, fsdp, mp) mesh, and the program gathers one layer's weights (as many
    constraints as one block has, not one per layer; BERT's classifier gathers its last layer's once more,
    where it runs apart from the scan)."""
    mesh = make_mesh("dp=2,fsdp=2,mp=2")
    gathering = Gathering(mesh, tuple(partition.get_partition_rules(family.split("-")[0])))
    unrolled, model = pair(folders, family, Execution(scan_layers=True, remat="full", gather=gathering), mesh=mesh)
    kernels = {"gpt2": "attn/c_attn", "mistral": "self_attn/q_proj", "bert": "self/query", "t5-v1.1": "SelfAttention/q"}
    for name, x in partition.named_leaves(nnx.state(model, nnx.Param)):
        if name.endswith(kernels[family] + "/kernel"):
            assert x.sharding.spec == P(None, "fsdp", "mp"), name
        for shard in x.addressable_shards:
            assert shard.data.shape == x.sharding.shard_shape(x.shape), name
    b = on_mesh(batch(family), mesh)
    want = loss_and_grads(unrolled, b, family, mesh)
    stacks = [m.weight_gather.weights for _, m in nnx.iter_modules(model) if isinstance(m, Stacked)]
    assert len(stacks) == len(STACKS[family])
    for weights in stacks:
        assert weights and all(len(s.spec) == 2 and "fsdp" not in str(s.spec) for _, _, s in weights)
    assert_same_grads(loss_and_grads(model, b, family, mesh), want)

    _, params = nnx.split(model)
    loss = lambda p: objective(family, 4).loss(nnx.merge(nnx.graphdef(model), p), b, None)
    found = [spec for spec, _, _ in constraints(jax.make_jaxpr(loss)(params).jaxpr)]
    gathered = {sharding.spec for weights in stacks for _, _, sharding in weights}
    runs = 2 if family == "bert" else 1  # once in each scan's body, for every layer
    assert sum(spec in gathered for spec in found) == runs * sum(map(len, stacks))


def test_each_layer_draws_its_own_dropout_key():
    """In training each scanned layer's dropout draws from the step's key folded with its layer index."""

    class Drop(nnx.Module):
        def __init__(self, rngs):
            self.scale = nnx.Param(jnp.ones((16,)))

        def __call__(self, x, *, cache=None, index=0, rngs=None):
            kept = dropout(self.scale[...], 0.5, rngs)
            return x + kept, kept

    stack = Stacked(Drop, 4, nnx.Rngs(0))
    rngs = nnx.Rngs(dropout=jax.random.key(7))
    out, kept = stack("none", jnp.zeros((16,)), rngs=rngs)
    key = nnx.Rngs(dropout=jax.random.key(7)).dropout()
    want = [dropout(jnp.ones((16,)), 0.5, nnx.Rngs(dropout=jax.random.fold_in(key, i))) for i in range(4)]
    np.testing.assert_array_equal(kept, np.stack(want))
    assert len({tuple(np.asarray(row)) for row in kept}) == 4
    np.testing.assert_allclose(out, kept.sum(0))


class TwoSites(nnx.Module):
    """A block that drops out twice, at different shapes and rates, and returns what it kept."""

    def __init__(self, rngs):
        self.scale = nnx.Param(jnp.ones((4096,)))

    def __call__(self, x, rngs=None):
        wide = dropout(jnp.broadcast_to(self.scale[...], (2, 4096)), 0.5, rngs)
        narrow = dropout(self.scale[...], 0.1, rngs)
        return x + wide.sum() + narrow.sum(), (wide, narrow)


def test_masks_drawn_ahead_are_each_layers_own_at_each_sites_rate():
    """``draws_ahead`` (on CPU): each site's masks are drawn for every layer before the scan, one draw a site,
    and each layer takes its own, at its site's rate; the step's key decides them."""
    stack = Stacked(TwoSites, 4, nnx.Rngs(0), Execution(draws_ahead=True))
    run = lambda seed: stack("none", jnp.zeros(()), rngs=nnx.Rngs(dropout=jax.random.key(seed)))[1]
    wide, narrow = run(7)
    assert wide.shape == (4, 2, 4096) and narrow.shape == (4, 4096)
    for kept, rate in ((wide, 0.5), (narrow, 0.1)):
        dropped = np.asarray(kept == 0).reshape(4, -1).mean(1)
        np.testing.assert_allclose(dropped, rate, atol=0.02)  # ~5 standard deviations at 4096 draws
        np.testing.assert_allclose(np.unique(kept), [0.0, 1 / (1 - rate)], rtol=1e-6)
        assert len({tuple(np.asarray(row).ravel()) for row in kept}) == 4  # no layer repeats another's mask
    again, other = run(7), run(8)
    np.testing.assert_array_equal(again[1], narrow)
    assert not np.array_equal(other[1], narrow)


def test_masks_drawn_ahead_serve_the_backward_pass_under_remat(folders):
    """A scanned BERT on CPU (a run's ``Execution`` draws its masks ahead there) with dropout: the rematerialised
    backward pass takes the forward's masks, so loss and gradients under ``--remat full`` equal those without."""
    b = batch("bert")

    def grads(policy, seed):
        execution = Execution(scan_layers=True, remat=policy, draws_ahead=True)
        model = load_pretrained(folders["bert"], task("bert"), execution=execution,
                                hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.2)  # fmt: skip
        assert model.bert.encoder.layer.draws_ahead
        graphdef, params = nnx.split(model)
        loss = lambda p: objective("bert").loss(nnx.merge(graphdef, p), b, nnx.Rngs(dropout=jax.random.key(seed)))
        return jax.jit(jax.value_and_grad(loss))(params)

    plain, remat = grads("none", 0), grads("full", 0)
    assert_same_grads(remat, plain)
    assert grads("none", 1)[0] != plain[0]


def test_scanned_and_unrolled_models_initialise_alike():
    """From one seed a fresh model's weights are the same scanned or unrolled (each layer made in turn from
    the seed's stream), and so are the modules made after the stack (a task's head): switching layouts does
    not change a run. T5's scanned stacks keep the first block's position bias apart, so they draw otherwise."""
    for family in ("llama", "bert"):
        unrolled, scanned = (
            per_layer(nnx.state(from_config(CONFIGS[family](), task(family), seed=3, execution=scan), nnx.Param))
            for scan in (Execution(), Execution(scan_layers=True))
        )
        assert set(scanned) == set(unrolled)
        for name, array in unrolled.items():
            np.testing.assert_array_equal(scanned[name], array, err_msg=f"{family} {name}")


def test_scanned_training_with_dropout_runs(folders):
    _, scanned = pair(folders, "gpt2", resid_pdrop=0.3, attn_pdrop=0.2)
    b = batch()
    graphdef, params = nnx.split(scanned)
    loss = lambda p, seed: CausalLM().loss(nnx.merge(graphdef, p), b, nnx.Rngs(dropout=jax.random.key(seed)))
    first, grads = jax.jit(jax.value_and_grad(loss))(params, 0)
    assert np.isfinite(first) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    again, other = (float(jax.jit(loss)(params, seed)) for seed in (0, 1))
    assert again == pytest.approx(float(first), rel=1e-6) and other != pytest.approx(again, rel=1e-3)


@pytest.mark.parametrize("family", ["gpt2", "gptj", "mistral", "gemma2", "opt", "t5-v1.1"])
def test_scanned_generation_equals_unrolled(family, folders):
    """Greedy tokens from a stacked KV cache (``[layers, batch, ...]``, carried through the scan; T5's
    cross-attention keys/values stacked too) equal the unrolled model's, with left padding, also on a mesh."""
    unrolled, scanned = pair(folders, family)
    config = CONFIGS[family]()
    ids, mask = padded_batch(VOCAB, lengths=(7, 3))
    if family.startswith("t5"):
        cache = scanned.init_cache(scanned.encode(jnp.asarray(ids), jnp.asarray(mask)), jnp.asarray(mask), 8)
        assert cache.layers.k.shape[0] == cache.cross.k.shape[0] == config.num_decoder_layers
    else:
        assert scanned.init_cache(2, 8).layers.k.shape[0] == config.num_hidden_layers
    want = generate(unrolled, ids, mask, max_new_tokens=10).sequences
    np.testing.assert_array_equal(generate(scanned, ids, mask, max_new_tokens=10).sequences, want)
    if family in ("gpt2", "t5-v1.1"):
        _, sharded = pair(folders, family, mesh=make_mesh("dp=2,mp=4"))
        np.testing.assert_array_equal(generate(sharded, ids, mask, max_new_tokens=10).sequences, want)


def test_configs_that_cannot_scan_say_so():
    qwen = tiny_config(
        "qwen2", **LAYERS, max_position_embeddings=DEFAULT, use_sliding_window=True, sliding_window=4,
        max_window_layers=1,
    )  # fmt: skip
    with pytest.raises(JaxseqError, match="repeat one pattern of kinds at least twice"):
        abstract_model(qwen, "causal-lm", execution=Execution(scan_layers=True))


def one_device():
    return make_mesh("dp=1", devices=jax.devices()[:1])


def train_step(folders, family, mesh, *, scan_layers, remat="none", lora=None, adapters=None):
    """One step of the train program (``TrainProgram.step``): (loss, trained parameters before and after by the
    unrolled model's paths or, with LoRA, as trained, the program and the frozen weights)."""
    execution = Execution(scan_layers=scan_layers, remat=remat)
    model = load_pretrained(folders[family], task(family), mesh=mesh, execution=execution)
    program = jaxseq_program(model, objective(family), mesh, max_grad_norm=1.0, lora=lora)
    frozen = nnx.state(model) if lora else None
    trained = nnx.state(model) if lora is None else adapters(program, frozen)
    before = per_layer(trained) if lora is None else flat_params(trained)
    state = program.init_state(trained)
    state, metrics = program.step(state, frozen, on_mesh(batch(family), mesh))
    after = per_layer(state.params) if lora is None else flat_params(state.params)
    return float(metrics["loss"]), before, after, program, frozen


def assert_same_step(got, want):
    """The same loss, and each parameter's update within 1e-4 of the tensor's largest (plus float32 rounding of
    the weight): the programs sum in other orders, which Adam amplifies in small gradients. A separate key bias
    (BERT's) has no gradient but rounding (a softmax ignores what is added to all of a query's scores): its
    update is that noise, so it is held to the update's own size."""
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    assert set(got[2]) == set(want[2])
    for name, after in want[2].items():
        update = after - want[1][name]
        scale = 1.0 if name.endswith("key/bias") else 1e-4
        tol = scale * np.abs(update).max() + 2 * np.finfo(np.float32).eps * np.abs(after)
        assert np.all(np.abs(got[2][name] - after) <= tol), name


@pytest.mark.parametrize("family", ["llama", "t5-v1.1"])
def test_sharded_scanned_step_equals_one_device(family, folders):
    """A scanned model's train step on a (dp=2, fsdp=2, mp=2) mesh, per-layer gathers and remat inside the scan,
    equals the unrolled model's step on one device."""
    want = train_step(folders, family, one_device(), scan_layers=False)
    got = train_step(folders, family, make_mesh("dp=2,fsdp=2,mp=2"), scan_layers=True, remat="full")
    assert_same_step(got, want)


def test_lora_on_stacked_kernels_equals_unrolled(folders, tmp_path):
    """LoRA adapts a stacked kernel with stacked adapters ([layers, in, r], [layers, r, out]): from the same
    adapters, a train step, the merged export and the PEFT adapter equal the unrolled model's."""
    config = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_targets="q_proj,v_proj")
    unrolled_adapters = {}

    def unrolled(program, frozen):
        adapters = program.training.init(frozen)
        leaves, treedef = jax.tree_util.tree_flatten(adapters)
        keys = jax.random.split(jax.random.key(3), len(leaves))
        adapters = jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
        unrolled_adapters.update(flat_params(adapters))
        return adapters

    def stacked(program, frozen):
        shapes = flat_params(program.training.init(frozen))
        flat = {}
        for name, shape in shapes.items():
            path = tuple(name.split("/"))
            layers = [unrolled_adapters["/".join(map(str, unstacked_path(path, i)))] for i in range(shape.shape[0])]
            flat[path] = jnp.stack(layers)
        return traverse_util.unflatten_dict(flat)

    mesh = one_device()
    want = train_step(folders, "llama", mesh, scan_layers=False, lora=config, adapters=unrolled)
    got = train_step(folders, "llama", mesh, scan_layers=True, lora=config, adapters=stacked)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for name, array in got[2].items():
        for i, layer in enumerate(array):
            np.testing.assert_allclose(
                layer, want[2]["/".join(map(str, unstacked_path(name.split("/"), i)))], atol=1e-6
            )

    for side, (_, _, after, program, frozen) in (("unrolled", want), ("scanned", got)):
        trained = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in after.items()})
        save_pretrained(program.training.merged_model(trained, frozen), tmp_path / side / "merged")
        program.training.lora.save_adapter(trained, tmp_path / side / "adapter", base_model=None)
    assert "on 6 kernels" in got[3].training.lora.describe(100, 1)  # q and v of 3 layers

    # and the unrolled model's PEFT adapter merged into a scanned model
    base = load_pretrained(folders["llama"], "causal-lm", execution=Execution(scan_layers=True))
    save_pretrained(merge_adapter(base, tmp_path / "unrolled" / "adapter"), tmp_path / "scanned" / "merged-adapter")

    def files(side, kind):
        folder = tmp_path / side / kind
        if kind == "adapter":
            return load_file(folder / "adapter_model.safetensors")
        return {name: read() for name, read in read_checkpoint(folder).items()}

    for kind, other in (("merged", "merged"), ("adapter", "adapter"), ("merged-adapter", "merged")):
        ours, theirs = files("scanned", kind), files("unrolled", other)
        assert set(ours) == set(theirs)
        for name, array in theirs.items():
            np.testing.assert_allclose(ours[name], array, atol=1e-6, err_msg=name)
    adapter_config = lambda side: json.loads((tmp_path / side / "adapter" / "adapter_config.json").read_text())
    assert adapter_config("scanned") == adapter_config("unrolled")
