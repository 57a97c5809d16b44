"""tests/tiny.py has a tiny config for every family in the registry: jaxseq builds it, transformers builds its
PyTorch model, and jaxseq loads that model's folder with its logits."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.models import from_config, load_pretrained  # noqa: E402
from jaxseq.models.registry import FAMILIES  # noqa: E402
from tests.reference import padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402
from tests.tiny import DEFAULT, TINY, tiny_config  # noqa: E402


def test_every_family_has_a_tiny_config():
    assert sorted(TINY) == sorted(FAMILIES)


def test_overrides_change_a_field_and_default_gives_transformers_value():
    config = tiny_config("gpt2", n_embd=64, n_positions=DEFAULT)
    assert (config.n_embd, config.n_layer, config.n_positions) == (64, 2, transformers.GPT2Config().n_positions)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_tiny_config_builds_in_jaxseq_and_loads_from_pytorch(model_type, tmp_path):
    config = tiny_config(model_type)
    assert config.model_type == model_type and config.vocab_size <= 64
    task = next(t for t in ("causal-lm", "seq2seq-lm", "masked-lm") if t in FAMILIES[model_type].tasks)
    from_config(config, task)

    ref = perturb(getattr(transformers, FAMILIES[model_type].tasks[task].hf_architecture)(config))
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, task)
    ids, mask = padded_batch(config.vocab_size, lengths=(8, 5), low=3)
    inputs = dict(input_ids=ids, attention_mask=mask)
    args = (jnp.asarray(ids), jnp.asarray(mask))
    if task == "seq2seq-lm":
        inputs["decoder_input_ids"] = ids
        args += (jnp.asarray(ids),)
    got = model(*args)
    got = np.asarray(getattr(got, "logits", got))
    want = torch_forward(ref, **inputs).logits.numpy()
    assert got.shape == want.shape
    assert scaled_diff(mask, got, want) < 1e-4


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_gradients_equal_pytorchs_where_the_pad_id_is_a_real_token(model_type, tmp_path):
    """Every parameter's gradient equals transformers', the pad id (as EOS often is) among the real tokens:
    where transformers' embedding has a ``padding_idx`` (Llama and its descendants, Gemma, OPT, BERT, RoBERTa)
    that row gets none, elsewhere (GPT-2, GPT-J, T5) it trains as any token."""
    import jax
    from flax import nnx

    from jaxseq.models.weights import torch_layout
    from tests.reference import assert_gradients_match

    task = next(t for t in ("causal-lm", "seq2seq-lm", "masked-lm") if t in FAMILIES[model_type].tasks)
    ids, mask = padded_batch(32, lengths=(8, 5), low=3)
    ids[0, 2] = ids[1, 1] = 1  # the pad id, among the real tokens
    config = tiny_config(model_type, pad_token_id=1)
    ref = perturb(getattr(transformers, FAMILIES[model_type].tasks[task].hf_architecture)(config)).eval()
    ref.save_pretrained(tmp_path)
    weights = np.random.default_rng(0).normal(size=(*ids.shape, config.vocab_size)).astype(np.float32)
    inputs = dict(input_ids=torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long())
    if task == "seq2seq-lm":
        inputs["decoder_input_ids"] = inputs["input_ids"]
    logits = ref(**inputs).logits
    (logits * torch.as_tensor(weights) * torch.as_tensor(mask)[..., None]).sum().backward()
    model = load_pretrained(tmp_path, task)
    named = torch_layout(model)  # MoE experts: transformers fuses them in memory, not in checkpoints
    want = {n: p.grad.numpy() for n, p in ref.named_parameters() if p.grad is not None and n in named}
    assert "embed" in " ".join(want) or "wte" in " ".join(want) or "shared" in " ".join(want)
    args = (jnp.asarray(ids), jnp.asarray(mask)) + ((jnp.asarray(ids),) if task == "seq2seq-lm" else ())
    graphdef, state = nnx.split(model)

    def loss(state):
        out = nnx.merge(graphdef, state)(*args)
        return (getattr(out, "logits", out)[..., : config.vocab_size] * weights * mask[..., None]).sum()

    assert_gradients_match(model, jax.grad(loss)(state), want)
