"""Checkpoint formats, name matching and the errors users see when a checkpoint does not fit."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.hub import resolve  # noqa: E402
from tests.reference import max_diff_on, padded_batch, torch_forward  # noqa: E402


def tiny_gpt2(**kw):
    cfg = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=32, pad_token_id=0)
    return transformers.GPT2Config(**{**cfg, **kw})


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2()).eval()
    ids, mask = padded_batch(101)
    return model, ids, mask, torch_forward(model, input_ids=ids, attention_mask=mask).logits.numpy()


def logits_of(path, ids, mask, **kw):
    return load_pretrained(path, "causal-lm", **kw)(jnp.asarray(ids), jnp.asarray(mask)).logits


def test_sharded_safetensors(reference, tmp_path):
    model, ids, mask, want = reference
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert max_diff_on(mask, logits_of(tmp_path, ids, mask), want) <= 1e-5


def test_pytorch_bin_loads_with_weights_only(reference, tmp_path):
    model, ids, mask, want = reference
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path)
    assert max_diff_on(mask, logits_of(tmp_path, ids, mask), want) <= 1e-5


def test_flax_msgpack(reference, tmp_path):
    """A Flax checkpoint as transformers' Flax classes wrote them: nested dicts, (in, out) kernels,
    ``embedding``/``scale`` leaf names, GPT-2 Conv1D kernels stored (out, in)."""
    from flax import serialization
    from flax.traverse_util import unflatten_dict

    model, ids, mask, want = reference
    flat = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("lm_head") or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        *mod, leaf = name.split(".")
        value = tensor.numpy()
        if mod[-1] in ("wte", "wpe"):
            leaf = "embedding"
        elif mod[-1].startswith("ln_"):
            leaf = "scale" if leaf == "weight" else leaf
        elif leaf == "weight":
            leaf, value = "kernel", value.T
        flat[tuple(mod + [leaf])] = value
    (tmp_path / "flax_model.msgpack").write_bytes(serialization.msgpack_serialize(unflatten_dict(flat)))
    model.config.save_pretrained(tmp_path)
    assert max_diff_on(mask, logits_of(tmp_path, ids, mask), want) <= 1e-5


def test_bfloat16_safetensors_load_exactly(reference, tmp_path):
    _model, *_ = reference
    transformers.GPT2LMHeadModel(tiny_gpt2()).to(torch.bfloat16).save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, "causal-lm")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = theirs.transformer.h[0].attn.c_attn.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(ours.transformer.h[0].attn.c_attn.kernel[...]), want)


def test_missing_weights_are_listed(reference, tmp_path):
    model, *_ = reference
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    with pytest.raises(JaxseqError, match=r"missing transformer\.h\.2\.attn\.c_attn\.bias"):
        load_pretrained(tmp_path, "causal-lm")


def test_unexpected_weights_are_listed(reference, tmp_path):
    model, *_ = reference
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 1}))
    with pytest.raises(JaxseqError, match=r"unexpected transformer\.h\.1\."):
        load_pretrained(tmp_path, "causal-lm")


def test_shape_mismatch_names_the_weight(reference, tmp_path):
    model, *_ = reference
    model.save_pretrained(tmp_path)
    with pytest.raises(JaxseqError, match=r"transformer\.wte\.weight has shape \(101, 32\)"):
        load_pretrained(tmp_path, "causal-lm", vocab_size=200)


def test_truncated_safetensors_is_a_clear_error(reference, tmp_path):
    model, *_ = reference
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(JaxseqError, match="truncated or corrupt"):
        load_pretrained(tmp_path, "causal-lm")


@pytest.mark.parametrize(
    "name, message",
    [
        ("does/not/exist", "is not a folder"),
        ("someone/some-model", "cannot download 'someone/some-model' from the Hugging Face Hub"),
        ("bad id!", "neither a local folder nor a valid Hugging Face Hub id"),
    ],
)
def test_unreachable_models(name, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(JaxseqError, match=message):
        load_pretrained(name, "causal-lm")


def test_bad_task_type_and_override(reference, tmp_path):
    model, *_ = reference
    model.save_pretrained(tmp_path)
    with pytest.raises(JaxseqError, match="unknown task 'translation'"):
        load_pretrained(tmp_path, "translation")
    with pytest.raises(JaxseqError, match="task 'seq2seq-lm' is not available for gpt2"):
        load_pretrained(tmp_path, "seq2seq-lm")
    with pytest.raises(JaxseqError, match="has no field 'n_layers'"):
        load_pretrained(tmp_path, "causal-lm", n_layers=3)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(JaxseqError, match="model_type 'gpt_neox' is not supported"):
        load_pretrained(tmp_path, "causal-lm")


def test_from_config_exports_what_transformers_loads(tmp_path):
    model = from_config(tiny_gpt2(), "causal-lm", seed=3)
    save_pretrained(model, tmp_path)
    theirs, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = padded_batch(101)
    got = model(jnp.asarray(ids), jnp.asarray(mask)).logits
    want = torch_forward(theirs, input_ids=ids, attention_mask=mask).logits.numpy()
    assert max_diff_on(mask, got, want) <= 1e-4
    assert float(np.std(np.asarray(model.transformer.wte.embedding[...]))) == pytest.approx(0.02, rel=0.1)


def test_hub_download_takes_transformers_weights_only(monkeypatch, tmp_path):
    """Of a Mistral-like repository, the config, the tokenizer and the sharded safetensors with their index; not
    the consolidated copy of the same weights beside them, nor Llama 3's ``original/`` checkpoint (huggingface_hub's
    own pattern filter decides, as in ``snapshot_download``)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    repo = [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
        "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "consolidated.safetensors", "original/consolidated.00.pth", "pytorch_model.bin.index.json",
    ]  # fmt: skip
    fetched = []

    def snapshot_download(name, allow_patterns):
        fetched.extend(filter_repo_objects(repo, allow_patterns=allow_patterns))
        (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    resolve("someone/mistral-like")
    assert sorted(fetched) == sorted(set(repo) - {"consolidated.safetensors", "original/consolidated.00.pth"})
