"""Qwen3.5-MoE against transformers PyTorch, every weight perturbed: linear and full layers each with routed experts
and a gated shared expert; logits on both paddings, the router loss and the training loss, every gradient,
greedy decoding, export, the experts split over ep on a mesh, and FLOPs that count the routed and shared
experts."""

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
from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.hub import load_config  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import assert_causal_lm_matches, padded_batch, perturb, torch_forward  # noqa: E402
from tests.test_llama import NEW, PAD, VOCAB, forward, prompts  # noqa: E402
from tests.test_mixtral import relative_diff  # noqa: E402
from tests.test_qwen3_5_text import FULL, LINEAR, reference_greedy  # noqa: E402

COEF = 0.02


def tiny_config(**kw):
    """Linear, full, linear layers; 4 experts of width 32, top-2; a shared expert of width 48."""
    base = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=[LINEAR, FULL, LINEAR], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=128,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.3, output_router_logits=True,
        router_aux_loss_coef=COEF,
    )  # fmt: skip
    return transformers.Qwen3_5MoeTextConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    ref = perturb(transformers.Qwen3_5MoeForCausalLM(tiny_config())).eval()
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    ref.save_pretrained(path)
    return ref, path


def test_logits_aux_loss_training_loss_and_gradients_match_pytorch(saved):
    ref, path = saved
    model = load_pretrained(path, "causal-lm")
    for ids, mask in (prompts((12, 9, 5)), padded_batch(VOCAB)):
        want = torch_forward(ref, input_ids=ids, attention_mask=mask)
        out = forward(model, jnp.asarray(ids), jnp.asarray(mask))
        assert relative_diff(mask, out.logits, want.logits.numpy()) <= 1e-4
        assert abs(float(out.aux_loss) - COEF * float(want.aux_loss)) <= 1e-6

    ref.zero_grad()  # right padding: no pad position predicts a real token
    out = ref(
        input_ids=torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(),
        labels=torch.as_tensor(np.where(mask == 1, ids, -100)).long(),
    )  # fmt: skip
    out.loss.backward()
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None)))(model)
    assert abs(float(loss) - out.loss.item()) <= 1e-5
    for layer in range(3):
        mine, theirs = grads.model.layers[layer].mlp, ref.model.layers[layer].mlp
        want = {
            "gate": theirs.gate.weight.grad.numpy().T,
            "gate_proj": theirs.experts.gate_up_proj.grad[1, :32].numpy().T,
            "down_proj": theirs.experts.down_proj.grad[1].numpy().T,
            "shared": theirs.shared_expert.up_proj.weight.grad.numpy().T,
            "shared_gate": theirs.shared_expert_gate.weight.grad.numpy().T,
        }
        got = {
            "gate": mine.gate.kernel[...], "gate_proj": mine.experts.gate_proj[...][1],
            "down_proj": mine.experts.down_proj[...][1], "shared": mine.shared_expert.up_proj.kernel[...],
            "shared_gate": mine.shared_expert_gate.kernel[...],
        }  # fmt: skip
        for name in want:
            scale = max(1e-8, float(np.abs(want[name]).max()))
            assert float(np.abs(np.asarray(got[name]) - want[name]).max()) / scale <= 1e-4, (layer, name)
    ref.zero_grad()


def test_export_and_greedy_generation(saved, tmp_path):
    ref, path = saved
    model = load_pretrained(path, "causal-lm")
    save_pretrained(model, tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back) is transformers.Qwen3_5MoeForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = prompts()
    ref.config.output_router_logits = False  # generate() has no labels to add it to
    try:
        want = reference_greedy(ref, ids, mask)
    finally:
        ref.config.output_router_logits = True
    assert all(len(set(row)) > 4 for row in want)
    got = generate(model, ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


def test_experts_split_over_ep_give_the_same_logits_and_gradients(saved):
    """fsdp=2, ep=2, mp=2: the experts split by expert, everything else as Qwen3.5's rules say."""
    _, path = saved
    ids, mask = padded_batch(VOCAB, (12, 9, 5, 7))
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}

    def logits_loss_grads(model):
        loss, grads = nnx.jit(nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None)))(model)
        out = forward(model, batch["input_ids"], batch["attention_mask"])
        return out, loss, dict(partition.named_leaves(nnx.state(grads, nnx.Param)))

    want, want_loss, want_grads = logits_loss_grads(load_pretrained(path, "causal-lm"))
    devices = make_mesh("fsdp=2,ep=2,mp=2")
    execution = decide_execution(load_config(path), "causal-lm", mesh=devices)
    model = load_pretrained(path, "causal-lm", mesh=devices, execution=execution)
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    assert specs["model/layers/0/mlp/experts/gate_proj"] == P("ep", "fsdp", "mp")
    assert specs["model/layers/0/mlp/shared_expert_gate/kernel"] == P("fsdp", None)
    assert model.model.layers[0].mlp.expert_mesh == devices
    got, loss, grads = logits_loss_grads(model)
    assert relative_diff(mask, got.logits, want.logits) <= 1e-4  # sharded sums round apart
    assert abs(float(got.aux_loss) - float(want.aux_loss)) <= 1e-7
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        scale = max(1e-6, float(np.abs(want_grads[name]).max()))
        assert float(np.abs(np.asarray(g) - np.asarray(want_grads[name])).max()) / scale <= 1e-4, name


UNSEEN = {  # configs unlike the fixture's: a zero-width shared expert (once a crash) with top-1 routing
    "top1-no-shared": dict(num_experts_per_tok=1, shared_expert_intermediate_size=0, layer_types=[FULL, LINEAR]),
    "top-all": dict(num_experts=3, num_experts_per_tok=3, layer_types=[LINEAR, FULL]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(UNSEEN))
def test_unseen_configs_match_transformers(name, tmp_path):
    config = tiny_config(num_hidden_layers=2, output_router_logits=False, **UNSEEN[name])
    torch.manual_seed(0)
    ref = perturb(transformers.Qwen3_5MoeForCausalLM(config)).eval()
    ref.save_pretrained(tmp_path)
    assert_causal_lm_matches(ref, load_pretrained(tmp_path, "causal-lm"), VOCAB, PAD)


def test_flops_count_the_routed_and_the_shared_experts():
    rows, seq = 2, 16  # one chunk
    linear = 64 * (2 * 16 + 64) + 2 * 64 * 64 + 2 * 64 * 4
    full = 3 * 64 * 64 + 2 * 64 * 32
    moe = 64 * 4 + 2 * 3 * 64 * 32 + 3 * 64 * 48 + 64  # router, 2 of 4 experts, shared expert and its gate
    weights = 2 * linear + full + 3 * moe + 64 * VOCAB
    attention = 2 * 2.0 * 64 * (seq * seq / 2) * rows
    chunk = 2 * 64 * 64 * 8 + 2 * 5 * 64**3 + 64 * 64 * (8 + 16) + 64 * 64 * 16 + 3 * 64 * 8 * 16  # 5 squarings
    delta = 2 * (2.0 * chunk * rows * 4)
    want = 3 * (2.0 * weights * rows * seq + attention + delta)
    assert family_for("qwen3_5_moe_text").model_flops(tiny_config(), "causal-lm", rows, seq) == pytest.approx(want)
