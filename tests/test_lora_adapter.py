"""``--lora_adapter``: an adapter exported by a LoRA run loads back with the same logits (merged into the
weights, and as the start of further training, bit for bit the saved weights), its merge equals PEFT's
``merge_and_unload`` of the same folder, and a folder that is no adapter of the model is one line."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import from_config, load_pretrained, save_pretrained  # noqa: E402
from jaxseq.train.lora import LoraConfig, merge_adapter  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from jaxseq.train.results import export_model  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.test_lora import RANK, arrays, host, lora_logits, make_trainer, tiny  # noqa: E402

TASKS = {"bert": "sequence-classification", "gpt2": "causal-lm"}
AUTO = {"bert": transformers.AutoModelForSequenceClassification, "gpt2": transformers.AutoModelForCausalLM}


def exported_adapter(tmp_path, family, mesh, model=None, tokenizer=None):
    """A base model folder and the adapter a LoRA run on it exports (trained two steps, then every adapter
    and head tensor moved at random, B included, so each one matters); the run's trainer."""
    model = model or tiny(TASKS[family], family, mesh=mesh)
    save_pretrained(model, tmp_path / "base", tokenizer=tokenizer)
    objective = None if family == "bert" else CausalLM()
    lora = LoraConfig(lora_rank=RANK, lora_alpha=8.0, lora_export="adapter")
    trainer = make_trainer(tmp_path / "run", model, mesh, lora=lora, objective=objective, steps=2)
    trainer.train()
    leaves, treedef = jax.tree.flatten(trainer.state.params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    moved = [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    trainer.state = dataclasses.replace(trainer.state, params=jax.tree.unflatten(treedef, moved))
    export_model(trainer, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    trainer.close()
    return trainer


def logits_of(model, batch):
    out = model(batch["input_ids"], batch["attention_mask"])
    return np.asarray(getattr(out, "logits", out))


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_merged_adapter_gives_the_runs_logits_and_equals_peft_merge_and_unload(tmp_path, family):
    mesh = make_mesh("dp=8")
    trainer = exported_adapter(tmp_path, family, mesh)
    batch = arrays(5, seed=4)
    want = lora_logits(trainer, batch)

    merged = merge_adapter(load_pretrained(tmp_path / "base", TASKS[family], mesh=mesh), tmp_path / "adapter")
    np.testing.assert_allclose(logits_of(merged, batch), want, atol=1e-5)

    save_pretrained(merged, tmp_path / "merged")
    ours = AUTO[family].from_pretrained(tmp_path / "merged").state_dict()
    base = AUTO[family].from_pretrained(tmp_path / "base").state_dict()
    peft_model = peft.PeftModel.from_pretrained(AUTO[family].from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    theirs = peft_model.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    moved = 0
    for name, tensor in theirs.items():
        np.testing.assert_allclose(ours[name].numpy(), tensor.numpy(), atol=1e-6, err_msg=name)
        moved += not torch.equal(tensor, base[name])
    # query and value (GPT-2: c_attn) of both layers, and BERT's head (weight, bias)
    assert moved == {"bert": 6, "gpt2": 2}[family]


def test_training_goes_on_from_the_adapter(tmp_path):
    mesh = make_mesh("dp=8")
    first = exported_adapter(tmp_path, "bert", mesh)
    batch = arrays(5, seed=4)
    model = load_pretrained(tmp_path / "base", "sequence-classification", mesh=mesh)
    second = make_trainer(tmp_path / "again", model, mesh, lora=LoraConfig(lora_adapter=str(tmp_path / "adapter")))
    assert (second.training.lora.rank, second.training.lora.scale) == (RANK, 8.0 / RANK)
    saved, loaded = host(first.state.params), host(second.state.params)
    assert saved.keys() == loaded.keys() and all(np.array_equal(saved[k], loaded[k]) for k in saved)
    np.testing.assert_allclose(lora_logits(second, batch), lora_logits(first, batch), atol=1e-6)
    assert second.evaluate() == pytest.approx(first.evaluate(), abs=1e-6)
    second.train()
    second.close()
    trained = host(second.state.params)
    assert all(not np.array_equal(trained[k], saved[k]) for k in saved if "lora_A" in k)
    export_model(second, tmp_path / "again-merged")  # --lora_export merged: plain weights
    merged = load_pretrained(tmp_path / "again-merged", "sequence-classification")
    np.testing.assert_allclose(logits_of(merged, batch), lora_logits(second, batch), atol=1e-5)


def test_a_folder_that_is_no_adapter_of_the_model_is_one_line(tmp_path):
    mesh = make_mesh("dp=8")
    exported_adapter(tmp_path, "bert", mesh)
    gpt2 = tiny("causal-lm", "gpt2")
    cases = [
        (gpt2, tmp_path / "adapter", "which is no parameter of this model"),
        (tiny(), tmp_path / "base", "holds no adapter_config.json and adapter_model.safetensors"),
    ]
    for model, folder, message in cases:
        with pytest.raises(JaxseqError, match=message) as e:
            merge_adapter(model, folder)
        assert "\n" not in str(e.value)
    with pytest.raises(JaxseqError, match=r"--lora_rank 8 differs from the rank 4 of --lora_adapter"):
        make_trainer(tmp_path / "r", tiny(), mesh, lora=LoraConfig(lora_rank=8, lora_adapter=str(tmp_path / "adapter")))


def test_generate_script_with_the_adapter_matches_peft_generate(tmp_path, capsys):
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=len(tokenizer))
    mesh = make_mesh("dp=8")
    model = from_config(config, "causal-lm", mesh=mesh, seed=0)
    exported_adapter(tmp_path, "gpt2", mesh, model=model, tokenizer=tokenizer)
    path = Path(__file__).resolve().parents[1] / "scripts" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_script", path)
    sys.modules[spec.name] = script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prompts = ["To be, or not to be", "The king said"]
    args = ["--model_name_or_path", tmp_path / "base", "--lora_adapter", tmp_path / "adapter", "--max_new_tokens", 8]
    args += ["--output_file", tmp_path / "out.jsonl", "--compilation_cache_dir", ""]
    args += [x for p in prompts for x in ("--prompt", p)]
    assert script.main([str(a) for a in args]) == 0, capsys.readouterr().err
    completions = [json.loads(line)["completion"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]

    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    reference = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = reference.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert completion == tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        ids = tokenizer(prompts[0], return_tensors="pt")
        out = plain.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert completions[0] != tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
