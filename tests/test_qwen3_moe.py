"""Qwen3-MoE against transformers PyTorch, every weight perturbed: a dense layer among MoE ones
(``mlp_only_layers``), top-k weights not renormalised (``norm_topk_prob`` false) and renormalised, q/k norms;
logits on both paddings, the router loss and the training loss, export, greedy generation and FLOPs."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.models import Execution, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import padded_batch, perturb, torch_forward  # noqa: E402
from tests.test_llama import NEW, PAD, VOCAB, forward, prompts  # noqa: E402
from tests.test_mixtral import relative_diff  # noqa: E402

COEF = 0.02


def tiny_config(**kw):
    """4 experts of width 32, top-2; layer 1 of 3 a dense MLP of width 80."""
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, mlp_only_layers=[1], norm_topk_prob=False, pad_token_id=PAD, bos_token_id=1,
        eos_token_id=2, initializer_range=0.3, output_router_logits=True, router_aux_loss_coef=COEF,
    )  # fmt: skip
    return transformers.Qwen3MoeConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=[False, True], ids=["raw-topk", "norm-topk"])
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = perturb(transformers.Qwen3MoeForCausalLM(tiny_config(norm_topk_prob=request.param))).eval()
    path = tmp_path_factory.mktemp("qwen3_moe")
    ref.save_pretrained(path)
    return ref, path


def test_logits_aux_loss_and_training_loss_match_pytorch(saved):
    ref, path = saved
    model = load_pretrained(path, "causal-lm")
    for ids, mask in (padded_batch(VOCAB), prompts((12, 9, 5))):
        want = torch_forward(ref, input_ids=ids, attention_mask=mask, labels=np.where(mask == 1, ids, -100))
        out = forward(model, jnp.asarray(ids), jnp.asarray(mask))
        assert relative_diff(mask, out.logits, want.logits.numpy()) <= 1e-4
        assert abs(float(out.aux_loss) - COEF * float(want.aux_loss)) <= 1e-6
        if mask[:, 0].all():  # right padding: no pad position predicts a real token
            batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}
            loss = nnx.jit(lambda m, b: CausalLM(None).loss(m, b, None))(model, batch)
            assert abs(float(loss) - float(want.loss)) <= 1e-5


def test_export_and_greedy_generation(saved, tmp_path):
    ref, path = saved
    model = load_pretrained(path, "causal-lm")
    save_pretrained(model, tmp_path)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back) is transformers.Qwen3MoeForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None, output_router_logits=False,
        )  # fmt: skip
    want = out[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 4 for row in want)
    got = generate(model, ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


def test_mixed_layers_do_not_scan_and_flops_count_routed_experts(saved, tmp_path):
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.spec import RunSpec
    from jaxseq.train.trainer_config import TrainerConfig

    with pytest.raises(JaxseqError, match="scan_layers") as error:
        load_pretrained(saved[1], "causal-lm", execution=Execution(scan_layers=True))
    assert "\n" not in str(error.value)

    def scans(config):  # --scan_layers auto under --remat full: the run's layout
        trainer = TrainerConfig(output_dir=str(tmp_path), scan_layers="auto", remat="full")
        return RunSpec(None, config, "causal-lm", CausalLM(), trainer, OptimizerConfig()).scan_layers

    assert (scans(tiny_config()), scans(tiny_config(mlp_only_layers=[]))) == (False, True)
    rows, seq = 2, 16
    attention = 2 * 2.0 * 64 * (seq * seq / 2) * rows  # one layer's QK^T and AV, causal half
    moe = 64 * 4 + 2 * 3 * 64 * 32  # router and 2 of 4 experts
    weights = 3 * (2 * 64 * 64 + 2 * 64 * 32) + 2 * moe + 3 * 64 * 80 + 64 * VOCAB  # 3 layers, 1 dense, head
    want = 3 * (2.0 * weights * rows * seq + 3 * attention)
    assert family_for("qwen3_moe").model_flops(tiny_config(), "causal-lm", rows, seq) == pytest.approx(want)
