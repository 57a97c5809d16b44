"""The newer causal families (gpt-oss, DeepSeek-V3, Gemma 4, Qwen3.5, Qwen3.5-MoE) through the installed
`jaxseq` command in a fresh process, as a user runs them: `jaxseq generate` on prompts of different lengths in
one batch gives transformers' greedy tokens (each family's decoding cache: sinks and a sliding window, MLA's
latent cache, Gemma 4's shared KV layers, Qwen3.5's recurrent state); `jaxseq clm --lora_rank
--lora_export merged` trains with finite losses that move and exports a folder whose logits transformers
reproduces; what is unsupported (QLoRA of the experts, a reward model of a family without a classifier) ends
in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tests.reference import perturb  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

JAXSEQ = Path(sys.executable).with_name("jaxseq")
PROMPTS = ["The capital of France is a city that", "Hi", "One two three four five six seven eight nine ten eleven"]
NEW_TOKENS = 8
# mixed layer kinds where the family has them; a window shorter than the prompts
CONFIGS = {
    "gpt_oss": dict(sliding_window=4),
    "deepseek_v3": dict(num_hidden_layers=3),
    "gemma4_text": dict(
        num_hidden_layers=4,
        num_kv_shared_layers=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    "qwen3_5_text": dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's tiny perturbed model over GPT-2's tokenizer, saved by transformers: model_type -> folder."""
    root = tmp_path_factory.mktemp("families")
    vocab = shared_asset("data/tokenizers/gpt2")
    tok = transformers.GPT2TokenizerFast(vocab=str(vocab / "vocab.json"), merges=str(vocab / "merges.txt"))
    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    out = {}
    for model_type, fields in CONFIGS.items():
        if model_type == "gemma4_text":
            fields = {**fields, "vocab_size_per_layer_input": len(tok)}
        config = tiny_config(model_type, vocab_size=len(tok), max_position_embeddings=128, **ids, **fields)
        torch.manual_seed(0)
        model = perturb(transformers.AutoModelForCausalLM.from_config(config))
        model.save_pretrained(root / model_type)
        tok.save_pretrained(root / model_type)
        out[model_type] = root / model_type
    (root / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    (root / "pairs.jsonl").write_text(json.dumps({"prompt": "Say", "chosen": " yes", "rejected": " no"}) + "\n")
    return out


def jaxseq(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    return subprocess.run([str(JAXSEQ), *map(str, args)], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_generate_gives_transformers_greedy_tokens(folders, tmp_path, model_type):
    folder = folders[model_type]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    run = jaxseq("generate", "--model_name_or_path", folder, "--prompt_file", tmp_path / "prompts.jsonl",
                 "--output_file", tmp_path / "out.jsonl", "--max_new_tokens", NEW_TOKENS,
                 "--batch_size", 3)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    for prompt, record in zip(PROMPTS, records, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert record["completion"] == tok.decode(out[0, ids.shape[1] :]), (prompt, record)


@pytest.mark.parametrize("model_type", ["gemma4_text", "qwen3_5_moe_text"])
def test_lora_merged_export_loads_in_transformers(folders, tmp_path, model_type):
    from jaxseq.models import load_pretrained

    out = tmp_path / "out"
    run = jaxseq("clm", "--model_name_or_path", folders[model_type], "--train_file", folders[model_type].parent /
                 "text.txt", "--block_size", 32, "--do_train", "--max_steps", 3, "--logging_steps", 1,
                 "--per_device_train_batch_size", 2, "--learning_rate", 1e-2, "--lr_scheduler_type", "constant",
                 "--lora_rank", 4, "--lora_export", "merged", "--save_strategy", "no", "--report_to", "none",
                 "--compilation_cache_dir", "", "--output_dir", out)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [json.loads(line)["train/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    ids = np.array([[464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]])
    with torch.no_grad():
        exported = transformers.AutoModelForCausalLM.from_pretrained(out)(torch.tensor(ids)).logits.numpy()
        base = transformers.AutoModelForCausalLM.from_pretrained(folders[model_type])(torch.tensor(ids)).logits
    trained = np.asarray(load_pretrained(out, "causal-lm")(ids).logits)[..., : exported.shape[-1]]
    np.testing.assert_allclose(exported, trained, atol=2e-5)
    assert np.abs(exported - base.numpy()).max() > 1e-2  # the adapters were merged in


def test_unsupported_combinations_end_in_one_line(folders, tmp_path):
    text = folders["gpt_oss"].parent / "text.txt"
    qlora = jaxseq("clm", "--model_name_or_path", folders["gpt_oss"], "--train_file", text, "--block_size", 32,
                   "--per_device_train_batch_size", 2, "--lora_rank", 4, "--quantize", "nf4",
                   "--output_dir", tmp_path / "qlora")  # fmt: skip
    reward = jaxseq("reward", "--model_name_or_path", folders["gemma4_text"], "--train_file",
                    folders["gemma4_text"].parent / "pairs.jsonl", "--output_dir", tmp_path / "reward")  # fmt: skip
    for run, words in ((qlora, ["experts", "gpt_oss"]), (reward, ["gemma4_text", "sequence-classification"])):
        lines = [line for line in run.stderr.splitlines() if line.startswith("error")]
        assert run.returncode == 1 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
        assert all(word in lines[0] for word in words), lines[0]
