"""T5 seq2seq fine-tuning: data from files, the teacher-forced loss against transformers PyTorch, and
`scripts/finetune_seq2seq.py` learning a copy/reverse task to high exact match."""

import json
import random
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.data.seq2seq import encode_pairs, load_pairs  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.train.objectives import Seq2SeqLM  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402

# each word is a single piece of the botchan unigram model, so reversing words is reversing tokens
WORDS = [
    "tree",
    "fish",
    "house",
    "water",
    "stone",
    "boat",
    "desk",
    "eggs",
    "face",
    "floor",
    "game",
    "girl",
    "hand",
    "head",
    "heart",
    "home",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The real SentencePiece unigram model as a T5 tokenizer folder (with tokenizer.json)."""
    spm = shared_asset("data/tokenizers/sentencepiece/botchan_en_unigram_1000.model")
    raw = tmp_path_factory.mktemp("spm")
    shutil.copy(spm, raw / "spiece.model")
    folder = tmp_path_factory.mktemp("t5-tokenizer")
    transformers.T5Tokenizer.from_pretrained(raw, extra_ids=0).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def toy_pairs(n, seed):
    """'copy: w1 w2 ...' -> 'w1 w2 ...' and 'reverse: w1 w2 ...' -> '... w2 w1'."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(2, 5))
        op = rng.choice(["copy", "reverse"])
        pairs.append((f"{op}: {' '.join(words)}", " ".join(words if op == "copy" else words[::-1])))
    return pairs


def tiny_t5(tokenizer, **kw):
    sizes = dict(
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=32,
    )
    return transformers.T5Config(
        vocab_size=-(-len(tokenizer) // 16) * 16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **{**sizes, **kw},
    )


def test_load_pairs_reads_every_format_and_names_missing_columns(tmp_path):
    pairs = toy_pairs(3, 0)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"src": s, "tgt": t}) + "\n" for s, t in pairs))
    (tmp_path / "a.tsv").write_text("src\ttgt\n" + "".join(f"{s}\t{t}\n" for s, t in pairs))
    (tmp_path / "a.csv").write_text("src,tgt\n" + "".join(f"{s},{t}\n" for s, t in pairs))
    for name in ("a.jsonl", "a.tsv", "a.csv"):
        assert load_pairs(tmp_path / name, "src", "tgt") == pairs
    with pytest.raises(JaxseqError, match=r"lacks column.*target.*it has src, tgt"):
        load_pairs(tmp_path / "a.csv", "src", "target")


def test_teacher_forced_loss_matches_pytorch(tmp_path, tokenizer):
    torch.manual_seed(0)
    ref = transformers.T5ForConditionalGeneration(tiny_t5(tokenizer))
    ref.save_pretrained(tmp_path)
    arrays = encode_pairs(toy_pairs(6, 1), tokenizer, 24, 16, source_prefix="")
    assert arrays["decoder_attention_mask"].sum(1).min() < 16  # some padding to mask
    labels = np.where(arrays["decoder_attention_mask"] > 0, arrays["labels"], -100)
    with torch.no_grad():
        expected = ref.eval()(
            input_ids=torch.as_tensor(arrays["input_ids"]).long(),
            attention_mask=torch.as_tensor(arrays["attention_mask"]).long(),
            labels=torch.as_tensor(labels).long(),
        ).loss.item()
    model = load_pretrained(tmp_path, "seq2seq-lm")
    objective = Seq2SeqLM()
    batch = {k: jnp.asarray(v) for k, v in arrays.items()}
    assert abs(float(objective.loss(model, batch, None)) - expected) < 1e-5
    outputs = {k: np.asarray(v) for k, v in objective.predict(model, batch).items()}
    assert abs(objective.metrics(outputs)["loss"] - expected) < 1e-5


def run_script(*args, devices=8, timeout=600):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "finetune_seq2seq.py"
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


def write_jsonl(path, pairs):
    path.write_text("".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in pairs))
    return path


@pytest.mark.slow
def test_script_learns_the_toy_task_and_its_exact_match_agrees_with_pytorch(tmp_path, tokenizer_dir, tokenizer):
    config_dir = tmp_path / "config"
    shutil.copytree(tokenizer_dir, config_dir)
    tiny_t5(tokenizer, d_model=128, d_kv=32, d_ff=256, dropout_rate=0.0).save_pretrained(config_dir)
    dev_pairs = toy_pairs(48, 2)
    dev = write_jsonl(tmp_path / "dev.jsonl", dev_pairs)
    train = write_jsonl(tmp_path / "train.jsonl", [p for p in toy_pairs(8000, 1) if p not in dev_pairs])
    out = tmp_path / "out"
    # Adafactor (T5's own optimizer) solves the held-out dev pairs by ~800 updates, where AdamW (2e-3, 5e-3) still
    # emits the right words in the wrong order; dp=2 runs the same global batch ~2x faster than dp=4,mp=2 on CPU
    result = run_script(
        "--config_name",
        config_dir,
        "--train_file",
        train,
        "--validation_file",
        dev,
        "--output_dir",
        out,
        "--max_source_length",
        12,
        "--max_target_length",
        8,
        "--per_device_train_batch_size",
        16,
        "--per_device_eval_batch_size",
        24,
        "--max_steps",
        1200,
        "--eval_steps",
        400,
        "--logging_steps",
        200,
        "--optimizer",
        "adafactor",
        "--learning_rate",
        1e-2,
        "--warmup_steps",
        20,
        "--mesh",
        "dp=2",
        "--compilation_cache_dir",
        "",
        devices=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    eval_losses = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(eval_losses) == 3 and eval_losses[-1] < eval_losses[0] < np.log(len(tokenizer))
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_samples"] == 48
    assert results["eval_perplexity"] == pytest.approx(np.exp(results["eval_loss"]), rel=1e-6)

    # transformers' own greedy generate() on the exported model scores the same exact match
    ref = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    encoded = tokenizer(
        [s for s, _ in dev_pairs], padding="max_length", truncation=True, max_length=12, return_tensors="pt"
    )
    with torch.no_grad():
        generated = ref.generate(**encoded, max_new_tokens=8, do_sample=False, num_beams=1)
    predictions = [p.strip() for p in tokenizer.batch_decode(generated, skip_special_tokens=True)]
    exact = np.mean([p == t for p, (_, t) in zip(predictions, dev_pairs)])
    assert results["eval_exact_match"] == pytest.approx(exact)
    assert exact >= 0.85, list(zip(predictions, dev_pairs))


def test_evaluation_in_length_buckets_equals_full_rows_in_input_order(tmp_path, tokenizer, monkeypatch):
    from jaxseq.data import batches
    from jaxseq.mesh import make_mesh
    from jaxseq.models import from_config
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.spec import RunSpec
    from jaxseq.train.trainer import Trainer
    from jaxseq.train.trainer_config import TrainerConfig

    monkeypatch.setattr(batches, "BUCKET_BATCHES", 1)  # a program per width, even for 5 batches
    rng = random.Random(5)
    words = [rng.choices(WORDS, k=rng.randint(1, 12)) for _ in range(37)]
    pairs = [(f"copy: {' '.join(w)}", " ".join(w)) for w in words]
    arrays = encode_pairs(pairs, tokenizer, 32, 16)
    objective = Seq2SeqLM(tokenizer, max_new_tokens=6)
    config = TrainerConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=1
    )
    mesh = make_mesh("dp=4,mp=2")
    model = from_config(tiny_t5(tokenizer), "seq2seq-lm", mesh=mesh, seed=0)
    spec = RunSpec(mesh, model.config, "seq2seq-lm", objective, config, OptimizerConfig())
    trainer = Trainer(spec, model, arrays, {"": arrays}, predict_sets={"": arrays})
    shapes = {(b["input_ids"].shape[1], b["labels"].shape[1]) for b, _, _ in trainer.feed.eval_batches("")}
    assert len(shapes) > 1 and shapes <= {(s, t) for s in (8, 16, 32) for t in (8, 16)}
    got = trainer.predict()
    trainer.close()
    # the reference: every full-length row at once, in input order
    expected = objective.predict(trainer.model(), {k: jnp.asarray(v) for k, v in arrays.items()})
    np.testing.assert_array_equal(got["tokens"], np.asarray(expected["tokens"]))
    np.testing.assert_allclose(got["loss_sum"], np.asarray(expected["loss_sum"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["prediction"], np.asarray(expected["prediction"]))
    assert objective.decode(got["references"]) == [target for _, target in pairs]
    assert trainer.program.eval_step._cache_size() == len(shapes)  # one program per bucket
