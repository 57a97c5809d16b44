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
