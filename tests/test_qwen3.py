"""Qwen3 against transformers PyTorch beyond what it shares with Llama's cases in ``tests/test_llama.py``
(right-padded logits, hidden states, export, KV cache, greedy generation, bfloat16): left-padded logits, the
classifier on left- and right-padded rows and its export, and a (dp, fsdp, mp) mesh. Weights perturbed."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, torch_forward  # noqa: E402
from tests.test_llama import VOCAB, forward, prompts, tiny_config  # noqa: E402

CASES = ("qwen3-norms-head-dim", "qwen3-biases-window-tied")


def relative_diff(mask, got, want) -> float:
    """Largest difference on real positions, relative to max(1, max |want| there)."""
    want = np.asarray(want, np.float32)
    return max_diff_on(mask, got, want) / max(1.0, max_diff_on(mask, want, np.zeros_like(want)))


def batches():
    """The same rows of 12, 9 and 5 tokens padded on the right and on the left."""
    right = padded_batch(VOCAB)
    return {"right": right, "left": prompts((12, 9, 5))}


def saved(model, path):
    torch.manual_seed(0)
    perturb(model).eval().save_pretrained(path)
    return model


@pytest.mark.parametrize("name", CASES)
def test_left_padded_logits_match_pytorch(name, tmp_path):
    """Positions count from the row's first column on both sides (transformers' default without
    position_ids), so left padding shifts them; the real positions' logits agree."""
    ref = saved(transformers.Qwen3ForCausalLM(tiny_config(name)), tmp_path)
    model = load_pretrained(tmp_path, "causal-lm")
    ids, mask = batches()["left"]
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert relative_diff(mask, got, want) <= 1e-4


def test_classifier_matches_pytorch_on_both_paddings_and_round_trips(tmp_path):
    """The score of each row's last real token (on the left-padded rows, the last column)."""
    ref = saved(transformers.Qwen3ForSequenceClassification(tiny_config(CASES[1], num_labels=3)), tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref", "sequence-classification")
    save_pretrained(model, tmp_path / "out")
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert type(back) is transformers.Qwen3ForSequenceClassification
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for side, (ids, mask) in batches().items():
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        rows = np.ones((len(ids), 1), np.int32)
        assert relative_diff(rows, forward(model, jnp.asarray(ids), jnp.asarray(mask)), want) <= 1e-4, side
        assert relative_diff(rows, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= 1e-4


def test_mesh_places_the_norms_and_gives_the_same_logits(tmp_path):
    """On (dp=2, fsdp=2, mp=2) the q/k norm scales are replicated and the projections split as Llama's; the
    logits equal one device's."""
    saved(transformers.Qwen3ForCausalLM(tiny_config(CASES[0])), tmp_path)
    ids, mask = padded_batch(VOCAB)
    want = forward(load_pretrained(tmp_path, "causal-lm"), jnp.asarray(ids), jnp.asarray(mask)).logits
    model = load_pretrained(tmp_path, "causal-lm", mesh=make_mesh("dp=2,fsdp=2,mp=2"))
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    assert specs["model/layers/0/self_attn/q_norm/scale"] == specs["model/layers/1/self_attn/k_norm/scale"] == P()
    assert specs["model/layers/0/self_attn/q_proj/kernel"] == P("fsdp", "mp")
    got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
    assert max_diff_on(mask, got, want) <= 1e-5
