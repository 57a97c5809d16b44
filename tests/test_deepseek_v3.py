"""DeepSeek-V3 against transformers PyTorch, every weight perturbed (the router's correction bias too), in two
configs: queries through ``q_lora_rank``, YaRN rope with ``mscale``/``mscale_all_dim``, interleaved rotary
pairs, group-limited routing, renormalised top-k and a dense first layer; and plain ``q_proj``, default rope,
rotate-half, attention biases, one group, raw top-k weights and every layer MoE; each unrolled and scanned.
Logits on both paddings, greedy generation, the latent cache, export, a train step's loss and every gradient,
meshes (experts over ep), FLOPs and LoRA's targets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import Execution, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.deepseek_v3.modeling import DenseThenStacked  # noqa: E402
from jaxseq.models.hub import load_config  # noqa: E402
from jaxseq.models.layers import Stacked  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.models.weights import stored_layout  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import assert_causal_lm_matches, padded_batch, perturb, torch_forward  # noqa: E402
from tests.test_llama import NEW, PAD, VOCAB, forward, prompts  # noqa: E402
from tests.test_mixtral import relative_diff  # noqa: E402

EXPERTS, INNER = 8, 32
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
    "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 8, "beta_slow": 1,
}  # fmt: skip
CASES = {
    "latent-q-yarn-groups": dict(
        q_lora_rank=24, rope_parameters=YARN, rope_interleave=True, n_group=4, topk_group=2, norm_topk_prob=True,
        first_k_dense_replace=1,
    ),
    "q-proj-all-moe": dict(
        q_lora_rank=None, rope_interleave=False, attention_bias=True, n_group=1, topk_group=1, norm_topk_prob=False,
        first_k_dense_replace=0,
    ),
}  # fmt: skip


def tiny_config(**kw):
    """3 layers of hidden 64, 4 heads (query/key 12 + 8 rotary features, values 10), a latent of 16; 8 experts of
    width 32, top-2, one shared; a dense MLP of 80."""
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=INNER, num_hidden_layers=3,
        num_attention_heads=4, n_shared_experts=1, n_routed_experts=EXPERTS, num_experts_per_tok=2, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, routed_scaling_factor=1.5,
        max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
    )  # fmt: skip
    return transformers.DeepseekV3Config(**{**base, **kw})


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = perturb(transformers.DeepseekV3ForCausalLM(tiny_config(**CASES[request.param]))).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a buffer, which perturb leaves at zero: biased choices route differently
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.add_(0.5 * torch.randn(EXPERTS, generator=generator))
    path = tmp_path_factory.mktemp("deepseek_v3")
    ref.save_pretrained(path)
    return ref, path, request.param


def test_logits_match_pytorch_on_both_paddings(saved):
    """Unrolled and scanned: the first config's dense layer one by one, then its MoE layers as one scan."""
    ref, path, case = saved
    for scan in (False, True):
        model = load_pretrained(path, "causal-lm", execution=Execution(scan_layers=scan))
        if scan:
            assert type(model.model.layers) is (DenseThenStacked if case == "latent-q-yarn-groups" else Stacked)
        for ids, mask in (padded_batch(VOCAB), prompts((12, 9, 5))):
            want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
            assert relative_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= 1e-4


def test_greedy_generation_matches_pytorch(saved):
    ref, path, _ = saved
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    want = out[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 4 for row in want)
    got = generate(load_pretrained(path, "causal-lm"), ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


def test_latent_cache_decodes_as_the_full_forward(saved):
    """The cache holds each layer's normalised latent and rotated shared key part (not per-head keys and
    values); a prefill then one token at a time from it gives the full forward's logits. Scanned (unrolled:
    the generation test): the MoE layers' caches stacked."""
    _, path, case = saved
    config = load_config(path)
    ids, mask = padded_batch(VOCAB, lengths=(12, 12))
    model = load_pretrained(path, "causal-lm", execution=Execution(scan_layers=True))
    cache = model.init_cache(2, 12)
    moe, layers = (cache.layers[-1], 2) if case == "latent-q-yarn-groups" else (cache.layers, 3)  # after the dense
    assert moe.k.shape == (layers, 2, 1, 12, config.kv_lora_rank) and moe.v.shape == (layers, 2, 1, 12, 8)
    want = forward(model, jnp.asarray(ids)).logits
    out = forward(model, jnp.asarray(ids[:, :7]), cache=cache)
    got = [out.logits]
    for t in range(7, 12):
        out = forward(model, jnp.asarray(ids[:, t : t + 1]), cache=out.cache)
        got.append(out.logits)
    assert relative_diff(mask, jnp.concatenate(got, axis=1), want) <= 1e-5


def test_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    ref, path, _ = saved
    save_pretrained(load_pretrained(path, "causal-lm"), tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back) is transformers.DeepseekV3ForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, buffer in ref.named_buffers():  # the correction bias comes back
        if name.endswith("e_score_correction_bias"):
            np.testing.assert_array_equal(dict(back.named_buffers())[name].numpy(), buffer.numpy())
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert relative_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= 1e-5


def gradients_by_name(model, grads) -> dict:
    """jaxseq's gradients by checkpoint name, in PyTorch's layout (each expert's projections apart)."""
    flat = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}
    out = {}
    for path, names in stored_layout(model).items():
        for index, (name, transposed) in names.items():
            array = flat[path] if index is None else flat[path][index]
            out[name] = array.T if transposed else array
    return out


def torch_gradients(ref) -> dict:
    """transformers' gradients by checkpoint name: its fused experts split per expert, the router's correction
    bias (a buffer) zero."""
    out = {}
    for name, p in ref.named_parameters():
        grad = p.grad.numpy()
        if name.endswith("experts.gate_up_proj"):
            for e in range(EXPERTS):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = grad[e, :INNER]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = grad[e, INNER:]
        elif name.endswith("experts.down_proj"):
            for e in range(EXPERTS):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = grad[e]
        else:
            out[name] = grad
    out.update({n: np.zeros(b.shape, np.float32) for n, b in ref.named_buffers() if "e_score_correction" in n})
    return out


def loss_and_gradients(model, batch):
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None)))(model)
    return loss, grads


def test_train_step_loss_and_every_gradient_equal_transformers(saved):
    ref, path, _ = saved
    ids, mask = padded_batch(VOCAB)
    ref.train()
    ref.zero_grad()
    out = ref(
        input_ids=torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(),
        labels=torch.as_tensor(np.where(mask == 1, ids, -100)).long(),
    )  # fmt: skip
    out.loss.backward()
    ref.eval()
    want = torch_gradients(ref)
    ref.zero_grad()
    model = load_pretrained(path, "causal-lm")
    loss, grads = loss_and_gradients(model, {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)})
    assert abs(float(loss) - out.loss.item()) <= 1e-5
    got = gradients_by_name(model, grads)
    assert got.keys() == want.keys()
    largest = max(np.abs(w).max() for w in want.values())
    for name, w in want.items():
        g = got[name][tuple(slice(0, n) for n in w.shape)]  # the vocabulary's padding cut off
        assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max() + 1e-6 * largest, name


def test_meshes_give_the_same_logits_and_gradients(saved):
    """On 8 devices the logits, the loss and every gradient (by checkpoint name) are the unrolled one-device
    model's: the first config scanned (a dense layer, then its MoE layers as one scan) on fsdp=2,ep=2,mp=2 (the
    experts over ep, the latent projections over fsdp, the heads over mp), the second unrolled on
    dp=2,fsdp=2,ep=2."""
    _, path, case = saved
    scan = case == "latent-q-yarn-groups"
    mesh = "fsdp=2,ep=2,mp=2" if scan else "dp=2,fsdp=2,ep=2"
    ids, mask = padded_batch(VOCAB)
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}

    def outputs(model):
        loss, grads = loss_and_gradients(model, batch)
        return forward(model, batch["input_ids"], batch["attention_mask"]), loss, gradients_by_name(model, grads)

    want, want_loss, want_grads = outputs(load_pretrained(path, "causal-lm"))
    devices = make_mesh(mesh)
    execution = decide_execution(load_config(path), "causal-lm", mesh=devices, scan_layers=scan)  # as a run's
    model = load_pretrained(path, "causal-lm", mesh=devices, execution=execution)
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    layer, stacked = ("model/layers/1/stacked", (None,)) if scan else ("model/layers/1", ())
    assert specs[f"{layer}/mlp/experts/gate_proj"] == P(*stacked, "ep", "fsdp", "mp")
    assert specs[f"{layer}/self_attn/kv_b_proj/kernel"] == P(*stacked, "fsdp", "mp")
    assert specs[f"{layer}/self_attn/kv_a_proj_with_mqa/kernel"] == P(*stacked, "fsdp", None)
    got, loss, grads = outputs(model)
    assert relative_diff(mask, got.logits, want.logits) <= 1e-5
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        scale = max(1e-6, float(np.abs(want_grads[name]).max()))
        assert float(np.abs(np.asarray(g) - np.asarray(want_grads[name])).max()) / scale <= 1e-4, name


UNSEEN = {  # configs unlike the cases': no shared expert (once a crash), linear rope, top-1 of one group
    "no-shared-experts": dict(
        n_shared_experts=0, first_k_dense_replace=2, num_experts_per_tok=1, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}, tie_word_embeddings=True,
        q_lora_rank=None, v_head_dim=20,
    ),
    # every layer dense; YaRN with mscale_all_dim alone (the softmax scale and the rotations both scaled)
    "all-dense-yarn": dict(
        first_k_dense_replace=3, q_lora_rank=12, rope_interleave=True, attention_bias=True, qk_nope_head_dim=4,
        rope_parameters={**YARN, "mscale": None, "mscale_all_dim": 1.0, "factor": 40.0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(UNSEEN))
def test_unseen_configs_match_transformers(name, tmp_path):
    torch.manual_seed(0)
    ref = perturb(transformers.DeepseekV3ForCausalLM(tiny_config(**UNSEEN[name]))).eval()
    with torch.no_grad():  # a buffer, which perturb leaves at zero
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.add_(0.5 * torch.randn(EXPERTS))
    ref.save_pretrained(tmp_path)
    assert_causal_lm_matches(ref, load_pretrained(tmp_path, "causal-lm"), VOCAB, PAD)


def test_flops_count_mla_and_the_experts_each_token_goes_to():
    config = tiny_config(**CASES["latent-q-yarn-groups"])
    rows, seq = 2, 16
    # queries 64 -> 24 -> 4 x 20; latent and rotary key 64 -> 16 + 8; keys and values 16 -> 4 x (12 + 10); o 40 -> 64
    attention = 64 * 24 + 24 * 80 + 64 * 24 + 16 * 88 + 40 * 64
    moe = 64 * EXPERTS + (2 + 1) * 3 * 64 * INNER  # router, 2 routed and 1 shared expert
    weights = 3 * attention + 3 * 64 * 80 + 2 * moe + 64 * VOCAB  # layer 0 dense, the head
    products = 2 * 2 * 4 * (20 + 10) / 2 * (seq * seq / 2) * rows  # QK^T over 4 x 20, AV over 4 x 10, causal
    want = 3 * (2.0 * weights * rows * seq + 3 * products)
    assert family_for("deepseek_v3").model_flops(config, "causal-lm", rows, seq) == pytest.approx(want)


def test_lora_adapts_the_queries_and_the_latent_expansion(saved):
    """LoRA's default targets are the queries' and kv_b_proj's kernels; with adapters beside the kernels (as a
    LoRA run samples), decoding from the latent cache, which reads kv_b_proj's kernel through its product, gives
    the logits of the model with the adapters merged."""
    from jaxseq.partition import get_partition_rules, match_partition_rules
    from jaxseq.train.lora import Lora, LoraConfig

    _, path, case = saved
    model = load_pretrained(path, "causal-lm")
    specs = match_partition_rules(get_partition_rules("deepseek_v3"), nnx.state(model))
    lora = Lora(LoraConfig(lora_rank=2), model, specs)
    queries = "q_b_proj" if case == "latent-q-yarn-groups" else "q_proj"
    assert {"/".join(map(str, p[-2:])) for p in lora.targets} == {"self_attn/kv_b_proj", f"self_attn/{queries}"}
    if case != "latent-q-yarn-groups":
        return
    rng = np.random.default_rng(0)
    trained = jax.tree_util.tree_map_with_path(  # B away from its zero start
        lambda p, x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype) if "lora_B" in str(p[-1]) else x,
        lora.init(nnx.state(model), 0),
    )
    graphdef, frozen = nnx.split(model)
    adapted = lora.training_model(graphdef, trained, frozen)
    ids, mask = padded_batch(VOCAB, lengths=(12, 12))
    want = forward(nnx.merge(graphdef, lora.merged(trained, frozen)), jnp.asarray(ids)).logits
    out = forward(adapted, jnp.asarray(ids[:, :11]), cache=adapted.init_cache(2, 12))
    out = forward(adapted, jnp.asarray(ids[:, 11:]), cache=out.cache)
    assert relative_diff(mask[:, 11:], out.logits, want[:, 11:]) <= 1e-5
    assert relative_diff(mask, forward(model, jnp.asarray(ids)).logits, want) > 1e-2  # the adapters count


def test_sequence_classification_matches_pytorch(tmp_path):
    config = tiny_config(**CASES["latent-q-yarn-groups"], num_labels=3)
    torch.manual_seed(0)
    classifier = perturb(transformers.DeepseekV3ForSequenceClassification(config)).eval()
    classifier.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "sequence-classification")
    ids, mask = padded_batch(VOCAB, low=3)
    want = torch_forward(classifier, input_ids=ids, attention_mask=mask).logits.numpy()
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
