"""Grouped scans (``layers.Grouped``): a stack whose layers repeat a pattern of kinds runs as one scan over its
whole groups of one period, the layers past the last group unrolled after it. gpt-oss (sliding, full: groups of 2
and one layer after), Gemma 2 (groups of 2), Gemma 3 (two sliding and a full: groups of 3 and one layer after),
Qwen3.5 (linear, full: groups of 2 and one layer after), Qwen3.5-MoE (two linear and a full: groups of 3) and Gemma
4 (a full layer with its own head size and two sliding, per-layer inputs: groups of 3 and one layer after; without
per-layer inputs, keys as the full layers' values: groups of 2), from transformers' PyTorch models with every weight
perturbed: the scanned model's logits, loss and every gradient, greedy tokens (``generate``; the engine for Gemma 3)
equal the unrolled model's; it loads from and exports to the transformers folder (transformers' logits of the export
equal ours); PEFT names are per layer; on an fsdp=4, mp=2 mesh (per-block gathers, remat inside the scan) a train
step equals one device's; both layouts initialise alike, each layer draws its own dropout key, and ``--scan_layers
auto`` scans these stacks (Gemma 4's KV-shared layers stay unrolled: refused in one line)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.engine import Engine, SamplingParams  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.decide import decide_execution, scans  # noqa: E402
from jaxseq.models.execution import Execution  # noqa: E402
from jaxseq.models.layers import Grouped, dropout, repeating_period  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.models.weights import read_checkpoint, torch_layout  # noqa: E402
from jaxseq.sharding import unstacked_path  # noqa: E402
from jaxseq.train.lora import Lora, LoraConfig  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402
from tests.test_engine import word_tokenizer  # noqa: E402
from tests.test_scan_layers import (  # noqa: E402
    assert_same_grads,
    assert_same_step,
    batch,
    logits_loss_and_grads,
    on_mesh,
    one_device,
    per_layer,
)
from tests.test_step_parity import jaxseq_program  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

S, F, L = "sliding_attention", "full_attention", "linear_attention"
COMMON = dict(vocab_size=64, initializer_range=0.3, attn_implementation="eager")
CONFIGS = {
    "gpt_oss": dict(
        num_hidden_layers=5, layer_types=[S, F, S, F, S], sliding_window=4, output_router_logits=True,
        router_aux_loss_coef=0.02, pad_token_id=0,
    ),
    "gemma2": dict(
        num_hidden_layers=4, layer_types=[S, F, S, F], sliding_window=4, query_pre_attn_scalar=12,
        attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
    ),
    "gemma3_text": dict(
        num_hidden_layers=7, layer_types=[S, S, F, S, S, F, S], sliding_window=4, query_pre_attn_scalar=12,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    "qwen3_5_text": dict(num_hidden_layers=5, layer_types=[L, F, L, F, L], pad_token_id=0),
    "qwen3_5_moe_text": dict(
        num_hidden_layers=6, layer_types=[L, L, F, L, L, F], output_router_logits=True, router_aux_loss_coef=0.02,
        pad_token_id=0,
    ),
    "gemma4_text": dict(
        num_hidden_layers=7, layer_types=[F, S, S, F, S, S, F], sliding_window=4, tie_word_embeddings=False,
        final_logit_softcapping=10.0, pad_token_id=0,
    ),
    "gemma4_text-dense": dict(
        num_hidden_layers=4, layer_types=[S, F, S, F], sliding_window=4, hidden_size_per_layer_input=0,
        attention_k_eq_v=True, num_global_key_value_heads=1, tie_word_embeddings=False, pad_token_id=0,
    ),
}  # fmt: skip
PERIODS = {
    "gpt_oss": 2, "gemma2": 2, "gemma3_text": 3, "qwen3_5_text": 2, "qwen3_5_moe_text": 3, "gemma4_text": 3,
    "gemma4_text-dense": 2,
}  # fmt: skip
GENERATES = ("gpt_oss", "gemma3_text", "qwen3_5_text", "gemma4_text", "gemma4_text-dense")  # Gemma 2's and
# Qwen3.5-MoE's caches are these layers'
TORCH = {
    "gpt_oss": "GptOssForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4_text-dense": "Gemma4ForCausalLM",
}


def model_type(case: str) -> str:
    """The model type of a case of ``CONFIGS`` (``gemma4_text-dense``: ``gemma4_text``)."""
    return case.split("-")[0]


def config_of(family: str):
    return tiny_config(model_type(family), **{**COMMON, **CONFIGS[family]})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's transformers model, every weight perturbed, saved as a folder."""
    out = {}
    for family in CONFIGS:
        torch.manual_seed(0)
        ref = perturb(getattr(transformers, TORCH[family])(config_of(family))).eval()
        with torch.no_grad():
            for name, buffer in ref.named_buffers():
                if name.endswith("layer_scalar"):  # Gemma 4's layer scalars (buffers)
                    buffer.add_(0.3 * torch.randn(buffer.shape))
        path = tmp_path_factory.mktemp(family)
        ref.save_pretrained(path)
        out[family] = ref, path
    return out


def folder(saved, family):
    return saved[family][1]


def pair(saved, family, remat: str = "none"):
    """The unrolled and the scanned model of ``family`` from its folder, both under ``remat``."""
    load = lambda scan: load_pretrained(folder(saved, family), "causal-lm", execution=Execution(scan, remat=remat))
    return load(False), load(True)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_grouped_stack_loads_and_exports_per_layer(family, saved, tmp_path):
    """Each place of a group is one stack under ``p::period`` with a leading group axis, the layers after the last
    group keep their own index; checkpoint and PEFT names are the unrolled model's; the export holds exactly the
    loaded tensors, and transformers' logits of it equal the scanned model's."""
    ref, path = saved[family]
    config, period = config_of(family), PERIODS[family]
    unrolled, scanned = pair(saved, family)
    stack = scanned.model.layers
    assert isinstance(stack, Grouped) and (stack.period, stack.groups) == (period, config.num_hidden_layers // period)
    names = {name: x.shape for name, x in partition.named_leaves(nnx.state(stack, nnx.Param))}
    rest = range(stack.groups * period, config.num_hidden_layers)
    for name, shape in names.items():
        head = name.split("/")[0]
        assert (head == f"{head.split('::')[0]}::{period}" and shape[0] == stack.groups) or int(head) in rest, name
    by_name = lambda model: {name: ("/".join(map(str, p)), t) for name, (p, t) in torch_layout(model).items()}
    assert by_name(scanned) == by_name(unrolled)
    lora_names, described = [], []
    for model in (unrolled, scanned):
        specs = partition.match_partition_rules(
            partition.get_partition_rules(model_type(family)), nnx.state(model, nnx.Param)
        )
        lora = Lora(LoraConfig(lora_rank=2, lora_alpha=4.0), model, specs)  # the family's default targets
        lora_names.append(sorted(n for p in lora.targets for n in lora._names((*p, "kernel")).values()))
        described.append(lora.describe(100, 1))
    assert lora_names[0] == lora_names[1] and len(lora_names[1]) >= config.num_hidden_layers
    assert described[0] == described[1]  # the adapted kernels by module, whatever the layout

    save_pretrained(scanned, tmp_path)
    want, got = read_checkpoint(path), read_checkpoint(tmp_path)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name](), want[name](), err_msg=name)
    ids, mask = padded_batch(64, lengths=(12, 7))
    exported = getattr(transformers, TORCH[family]).from_pretrained(tmp_path, attn_implementation="eager")
    theirs = torch_forward(exported, input_ids=ids, attention_mask=mask).logits.numpy()
    np.testing.assert_array_equal(theirs, torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy())
    ours = nnx.jit(lambda model, ids, mask: model(ids, mask).logits)(scanned, jnp.asarray(ids), jnp.asarray(mask))
    assert scaled_diff(mask, ours, theirs) <= 1e-4


def assert_close_grads(got, want, within: float = 1e-4):
    """The same loss, and every gradient within ``within`` of its largest entry: Gemma 4's float32 gradients
    (a norm on every query, key and value) differ by up to 5e-5 of that between two unrolled runs (no remat
    against full remat), more than ``assert_same_grads`` allows."""
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    got, want = per_layer(got[1]), per_layer(want[1])
    assert set(got) == set(want)
    for name in want:
        scale = np.abs(want[name]).max()
        assert np.abs(got[name] - want[name]).max() <= within * scale, name


@pytest.mark.parametrize(
    "family, policy",
    [("gpt_oss", "dots"), ("gemma2", "none"), ("gemma3_text", "full"), ("qwen3_5_text", "none"),
     ("qwen3_5_moe_text", "full"), ("gemma4_text", "full"), ("gemma4_text-dense", "dots")],
)  # fmt: skip
def test_grouped_scan_equals_unrolled(family, policy, saved):
    """From the same weights, under a remat policy: logits within 1e-5, the loss (gpt-oss's and Qwen3.5-MoE's with
    their router loss) and every gradient; greedy tokens from left-padded prompts through rolling and whole KV
    caches (gpt-oss, Gemma 3, Gemma 4: a layer past the groups) and linear layers' states (Qwen3.5)."""
    unrolled, scanned = pair(saved, family, policy)
    b = batch()
    (want_logits, want), (got_logits, got) = (logits_loss_and_grads(m, b, family) for m in (unrolled, scanned))
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    if model_type(family) == "gemma4_text":
        assert_close_grads(got, want)
    else:
        assert_same_grads(got, want)
    if family not in GENERATES:
        return
    ids, mask = padded_batch(64, lengths=(7, 3))
    ids, mask = ids[:, ::-1].copy(), mask[:, ::-1].copy()  # left-padded
    unrolled, scanned = pair(saved, family) if policy != "none" else (unrolled, scanned)  # generate runs no remat
    tokens = generate(unrolled, ids, mask, max_new_tokens=8).sequences
    np.testing.assert_array_equal(generate(scanned, ids, mask, max_new_tokens=8).sequences, tokens)


def test_grouped_scan_decodes_in_the_engine_as_unrolled_generate(saved):
    """The engine's slots keep a grouped cache (each place's layers stacked, sliding ones rolling): its greedy
    tokens equal the unrolled model's ``generate``."""
    unrolled, scanned = pair(saved, "gemma3_text")
    cache = scanned.init_cache(2, 16).layers
    assert [c.k.shape[0] for c in cache[:3]] == [2, 2, 2] and [c.max_len for c in cache] == [4, 4, 16, 4]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, n).tolist() for n in (9, 3, 6)]
    engine = Engine(scanned, word_tokenizer(64), max_batch_size=2, max_len=32, eos_token_ids=[])
    got = [r.tokens for r in engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    ids = np.array([[0] * (9 - len(p)) + p for p in prompts], np.int32)
    mask = (np.arange(9)[None] >= 9 - np.array([len(p) for p in prompts])[:, None]).astype(np.int32)
    assert got == np.asarray(generate(unrolled, ids, mask, max_new_tokens=8).sequences).tolist()


def test_grouped_step_on_a_mesh_equals_one_device(saved):
    """Gemma 3 scanned on fsdp=4, mp=2 (each place's stacks sharded behind their group axis, each block gathering
    its own weights under full remat, the layer after the groups too): one train step equals the unrolled model's
    on one device."""

    def step(mesh, scan_layers, remat="none"):
        path = folder(saved, "gemma3_text")
        config = load_pretrained(path, "causal-lm").config
        execution = decide_execution(config, "causal-lm", mesh=mesh, scan_layers=scan_layers, remat=remat)
        model = load_pretrained(path, "causal-lm", mesh=mesh, execution=execution)
        program = jaxseq_program(model, CausalLM(), mesh, max_grad_norm=1.0)
        params = nnx.state(model)
        state, metrics = program.step(program.init_state(params), None, on_mesh(batch(), mesh))
        return float(metrics["loss"]), per_layer(params), per_layer(state.params), model

    want = step(one_device(), False)
    got = step(make_mesh("fsdp=4,mp=2"), True, "full")
    layers = got[3].model.layers
    assert layers.weight_gathers[0] and all(stack.weight_gather for stack in layers.places())
    spec = getattr(layers, "2::3").stacked.self_attn.q_proj.kernel.get_value().sharding.spec
    assert spec == P(None, "fsdp", "mp")
    assert_same_step(got[:3], want[:3])


def test_grouped_and_unrolled_models_initialise_alike():
    """Each layer is made in the unrolled order from the seed's stream: the same weights either way."""
    config = config_of("gemma3_text")
    unrolled, scanned = (
        per_layer(nnx.state(from_config(config, "causal-lm", seed=3, execution=execution), nnx.Param))
        for execution in (Execution(), Execution(scan_layers=True))
    )
    assert set(scanned) == set(unrolled)
    for name, array in unrolled.items():
        np.testing.assert_array_equal(scanned[name], array, err_msg=name)


class Drop(nnx.Module):
    """A block that returns what its dropout kept of ones."""

    def __init__(self, rngs):
        self.scale = nnx.Param(jnp.ones((16,)))

    def __call__(self, x, *, rngs=None):
        kept = dropout(self.scale[...], 0.5, rngs)
        return x + kept, kept


@pytest.mark.parametrize("ahead", [False, True])
def test_each_grouped_layer_draws_its_own_dropout_key(ahead):
    """In the loop, layer ``i`` draws from the step's key folded with ``i``, in the groups and after them; drawn
    ahead (CPU), every layer's masks differ too."""
    stack = Grouped([Drop(None) for _ in range(7)], 3, Execution(draws_ahead=ahead))
    _, kept = stack("none", jnp.zeros((16,)), rngs=nnx.Rngs(dropout=jax.random.key(7)))
    by_layer = {}
    for place, values in enumerate(kept):
        for group, row in enumerate(values if place < 3 else values[None]):
            by_layer[place + 3 * group if place < 3 else 6] = np.asarray(row)
    assert sorted(by_layer) == list(range(7)) and len({tuple(row) for row in by_layer.values()}) == 7
    if not ahead:
        key = nnx.Rngs(dropout=jax.random.key(7)).dropout()
        for layer, row in by_layer.items():
            want = dropout(jnp.ones((16,)), 0.5, nnx.Rngs(dropout=jax.random.fold_in(key, layer)))
            np.testing.assert_array_equal(row, want, err_msg=str(layer))


def test_auto_scans_repeating_patterns_and_a_stack_without_one_is_refused():
    """``--scan_layers auto`` (under full remat) scans layers in a repeating pattern; layers whose kinds do not
    repeat at least twice are refused in one line, and auto unrolls them."""
    assert [repeating_period(k) for k in ([S] * 4, [S, F] * 3, [S, S, F, S, S, F, S], [F, S, S], [S, F, S])] == [
        1, 2, 3, None, None,
    ]  # fmt: skip
    config = config_of("gemma3_text")
    assert scans("auto", "tpu", "full", config) and not scans("auto", "tpu", "none", config)
    odd = tiny_config("gemma3_text", **{**COMMON, "num_hidden_layers": 3, "layer_types": [F, S, S]})
    assert not scans("auto", "tpu", "full", odd)
    with pytest.raises(JaxseqError, match=r"^scan_layers scans layers that repeat") as error:
        from_config(odd, "causal-lm", execution=Execution(scan_layers=True))
    assert "\n" not in str(error.value)
    assert unstacked_path(("model", "layers", "1::3", "stacked", "mlp"), 2) == ("model", "layers", 7, "mlp")


def test_gemma4_kv_shared_layers_stay_unrolled_and_the_31b_shape_scans():
    """Gemma 4's KV-shared layers read an earlier layer's keys and values, which a grouped scan does not pass on:
    ``--scan_layers true`` is refused in one line and auto unrolls them; without sharing, a stack in a pattern
    scans (Gemma-4-31B's: 60 layers, every sixth full)."""
    family = family_for("gemma4_text")
    shared = config_of("gemma4_text")
    shared.num_kv_shared_layers = 3
    assert not family.scans(shared) and not scans("auto", "tpu", "full", shared)
    with pytest.raises(JaxseqError, match=r"^scan_layers cannot scan this Gemma 4: its last 3 layers share") as error:
        from_config(shared, "causal-lm", execution=Execution(scan_layers=True))
    assert "\n" not in str(error.value)
    assert family.scans(config_of("gemma4_text")) and scans("auto", "tpu", "full", config_of("gemma4_text"))
    big = tiny_config("gemma4_text", **{**COMMON, "num_hidden_layers": 60, "layer_types": ([S] * 5 + [F]) * 10})
    assert family.scans(big) and repeating_period(big.layer_types) == 6
