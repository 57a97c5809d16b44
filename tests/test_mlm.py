"""``jaxseq mlm`` and ``jaxseq t5-mlm``: masking statistics against transformers' DataCollatorForLanguageModeling,
the masked-LM loss against BertForMaskedLM (perturbed weights), span corruption against a reference written
here from run_t5_mlm_flax.py's published algorithm, and both jobs run as a user runs them (a fresh process, one
CPU device): the MiniLM export loads in AutoModelForMaskedLM with jaxseq's logits and the fill-mask pipeline
runs on it; the T5 run logs its span lengths."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from tests.conftest import shared_asset
from tests.reference import padded_batch, perturb, scaled_diff, torch_forward

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from jaxseq.data.masking import IGNORE, mask_examples  # noqa: E402
from jaxseq.data.spans import SpanCorruption, compute_input_and_target_lengths  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.train import pretraining  # noqa: E402
from jaxseq.train.pretraining import MaskedLM  # noqa: E402

ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
JAXSEQ = Path(sys.executable).with_name("jaxseq")


def run_jaxseq(*args, timeout=600):
    """The installed ``jaxseq`` command as a user runs it: a fresh process, one CPU device, offline."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([str(JAXSEQ), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def jaxseq(*args, timeout=600):
    code = "import sys; from jaxseq.commands import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def minilm():
    folder = shared_asset("models/all-MiniLM-L6-v2")
    return folder, transformers.AutoTokenizer.from_pretrained(folder)


def text_lines(count: int, start: int = 0) -> list[str]:
    lines = shared_asset("data/text/botchan.txt").read_text().splitlines()
    return [line.strip() for line in lines[start:] if line.strip()][:count]


# --------------------------------------------------------------------------- masking


def test_masking_rates_match_data_collator(minilm):
    """Over many draws, the share of tokens chosen, and of the chosen the shares turned into [MASK], into another
    token and kept, equal DataCollatorForLanguageModeling's within binomial tolerance; special tokens and
    padding are never chosen by either."""
    _, tokenizer = minilm
    encoded = tokenizer(text_lines(64), truncation=True, max_length=48, padding="max_length", return_tensors="np")
    ids, attention = encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(np.int32)
    special = np.isin(ids, tokenizer.all_special_ids) | (attention == 0)
    assert special.any() and (attention == 0).any()
    objective = MaskedLM(0.15, tokenizer.mask_token_id, tokenizer.all_special_ids, len(tokenizer))
    mask = jax.jit(objective.mask)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="np")
    examples = [{"input_ids": row, "attention_mask": m} for row, m in zip(ids, attention)]

    def rates(draws):
        chosen = mask_ = random = kept = candidates = 0
        for inputs, labels in draws:
            inputs, labels = np.asarray(inputs), np.asarray(labels)
            picked = labels != IGNORE
            assert not (picked & special).any(), "a special token or padding was masked"
            assert (labels[picked] == ids[picked]).all() and (inputs[~picked] == ids[~picked]).all()
            candidates += (~special).sum()
            chosen += picked.sum()
            mask_ += (picked & (inputs == tokenizer.mask_token_id)).sum()
            kept += (picked & (inputs == ids)).sum()
            random += (picked & (inputs != ids) & (inputs != tokenizer.mask_token_id)).sum()
        return np.array([chosen / candidates, mask_ / chosen, random / chosen, kept / chosen]), (candidates, chosen)

    torch.manual_seed(0)
    theirs, (n_theirs, m_theirs) = rates((b["input_ids"], b["labels"]) for b in (collator(examples) for _ in range(60)))
    batch = {"input_ids": ids, "attention_mask": attention}
    ours, (n_ours, m_ours) = rates(mask(jax.random.key(i), batch) for i in range(60))
    p = np.array([0.15, 0.8, 0.1, 0.1])
    sizes = np.array([[n_ours, n_theirs], [m_ours, m_theirs]])[[0, 1, 1, 1]]
    tolerance = 4.5 * np.sqrt(p * (1 - p) * (1 / sizes[:, 0] + 1 / sizes[:, 1]))
    assert (np.abs(ours - theirs) <= tolerance).all(), (ours, theirs, tolerance)
    assert (np.abs(ours - p) <= tolerance).all(), (ours, p)


@pytest.mark.parametrize("capacity", ["masked", "overflow"])
def test_masked_lm_loss_equals_bert_for_masked_lm(tmp_path, capacity, monkeypatch):
    """The loss of one masked batch (padding, special tokens, perturbed weights) equals BertForMaskedLM's with
    the same inputs and labels, for a training batch masked in the loss and an evaluation batch masked once;
    the head scoring only the masked positions, or (``overflow``: more masked tokens than its capacity) every
    position. Its gradients are those of the head over every position."""
    if capacity == "overflow":
        monkeypatch.setattr(pretraining, "masked_capacity", lambda tokens, probability: 8)
    config = transformers.BertConfig(
        vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    reference = perturb(transformers.BertForMaskedLM(config), std=0.1)
    reference.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "masked-lm")
    ids, attention = padded_batch(120, lengths=(40, 31, 17, 40), low=5)
    ids[:, 0], ids[np.arange(4), attention.sum(1) - 1] = 2, 3  # [CLS] ... [SEP]
    special = (0, 2, 3, 4)
    objective = MaskedLM(0.3, 4, special, 120)
    batch = {"input_ids": ids, "attention_mask": attention}
    key = jax.random.key(7)
    inputs, labels = objective.mask(nnx.Rngs(dropout=key).dropout(), batch)
    assert np.asarray(labels != IGNORE).sum() > 10
    want = torch_forward(reference, input_ids=np.asarray(inputs), attention_mask=attention, labels=np.asarray(labels))
    trained = objective.loss(model, batch, nnx.Rngs(dropout=key))  # masks with the step's key
    assert abs(float(trained) - float(want.loss)) <= 1e-5 * float(want.loss)
    evaluated = mask_examples(batch, 3, special, probability=0.3, mask_token_id=4, vocab_size=120)
    want = torch_forward(reference, **evaluated)
    assert abs(float(objective.loss(model, evaluated, None)) - float(want.loss)) <= 1e-5 * float(want.loss)
    outputs = jax.tree.map(np.asarray, objective.predict(model, evaluated))
    assert abs(objective.metrics(outputs)["loss"] - float(want.loss)) <= 1e-5 * float(want.loss)
    assert pretraining.masked_capacity(ids.size, 0.3) < ids.size  # the head sees some positions only
    graphdef, params = nnx.split(model)

    class EveryPosition:  # the model without hidden_states/logits: the loss takes its logits everywhere
        def __init__(self, model):
            self.model, self.config = model, model.config

        def __call__(self, *args, **kwargs):
            return self.model(*args, **kwargs)

    def grads(wrap):
        loss = lambda p: objective.loss(wrap(nnx.merge(graphdef, p)), batch, nnx.Rngs(dropout=key))
        return jax.tree.leaves(jax.grad(loss)(params))

    for got, expected in zip(grads(lambda m: m), grads(EveryPosition)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------- span corruption
# A reference written from run_t5_mlm_flax.py's published algorithm (compute_input_and_target_lengths,
# random_spans_noise_mask, create_sentinel_ids, filter_input_ids), in numpy, independent of jaxseq's code.


def reference_lengths(inputs_length, noise_density, mean_noise_span_length):
    def lengths(tokens_length):
        num_noise_tokens = int(round(tokens_length * noise_density))  # noqa: RUF046 (the script's words)
        num_nonnoise_tokens = tokens_length - num_noise_tokens
        num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))  # noqa: RUF046
        return num_nonnoise_tokens + num_noise_spans + 1, num_noise_tokens + num_noise_spans + 1

    tokens_length = inputs_length
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    inputs_length, targets_length = lengths(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def reference_noise_span_counts(length, noise_density, mean_noise_span_length):
    num_noise_tokens = int(np.round(length * noise_density))
    num_nonnoise_tokens = length - num_noise_tokens
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = int(np.round(min(num_noise_tokens, num_nonnoise_tokens) / mean_noise_span_length))
    return num_noise_tokens, max(num_noise_spans, 1)


def reference_create_sentinel_ids(mask_indices, vocab_size):
    start_indices = mask_indices - np.roll(mask_indices, 1, axis=-1) * mask_indices
    start_indices[:, 0] = mask_indices[:, 0]
    sentinel_ids = np.where(start_indices != 0, np.cumsum(start_indices, axis=-1), start_indices)
    sentinel_ids = np.where(sentinel_ids != 0, (vocab_size - sentinel_ids), 0)
    sentinel_ids -= mask_indices - start_indices
    return sentinel_ids


def reference_filter_input_ids(input_ids, sentinel_ids, eos_token_id):
    batch_size = input_ids.shape[0]
    input_ids_full = np.where(sentinel_ids != 0, sentinel_ids, input_ids)
    input_ids = input_ids_full[input_ids_full >= 0].reshape((batch_size, -1))
    return np.concatenate([input_ids, np.full((batch_size, 1), eos_token_id, dtype=np.int32)], axis=-1)


def spans_of(mask):
    """Lengths of the runs of True, and of False, in a bool row."""
    edges = np.flatnonzero(np.diff(np.concatenate([[-1], mask.astype(int), [-1]]))) if mask.size else []
    runs = np.diff(edges)
    values = mask[edges[:-1]]
    return runs[values], runs[~values]


@pytest.mark.parametrize("inputs_length", [512, 128, 57, 1024])
def test_span_corruption_matches_run_t5_mlm_flax(inputs_length):
    """568 raw tokens -> 512 input + 114 target tokens (and other lengths) as the script computes them; the
    noise mask has the script's counts of noise tokens and spans, alternating, kept tokens first; on that same
    mask the inputs and targets equal create_sentinel_ids + filter_input_ids (sentinels from the top of the
    vocabulary)."""
    raw, targets = compute_input_and_target_lengths(inputs_length, 0.15, 3.0)
    assert (raw, targets) == reference_lengths(inputs_length, 0.15, 3.0)
    if inputs_length == 512:
        assert (raw, targets) == (568, 114)
    vocab, eos = 32100, 1
    corruption = SpanCorruption(raw, 0.15, 3.0, vocab, eos)
    assert corruption.lengths == (inputs_length, targets)
    noise, spans = reference_noise_span_counts(raw, 0.15, 3.0)
    rows = np.random.RandomState(inputs_length).randint(2, 32000, (4, raw)).astype(np.int32)
    for i, row in enumerate(rows):
        key = jax.random.key(i)
        mask = np.asarray(corruption.noise_mask(key))
        noise_runs, kept_runs = spans_of(mask)
        assert mask.sum() == noise and len(noise_runs) == spans and not mask[0]
        assert len(kept_runs) in (spans, spans + 1) and (noise_runs >= 1).all()
        got = jax.tree.map(np.asarray, corruption.corrupt(key, row))
        mask = mask[None].astype(np.int8)
        want_inputs = reference_filter_input_ids(row[None], reference_create_sentinel_ids(mask, vocab), eos)
        want_labels = reference_filter_input_ids(row[None], reference_create_sentinel_ids(1 - mask, vocab), eos)
        assert want_inputs.shape[1] == inputs_length and want_labels.shape[1] == targets
        np.testing.assert_array_equal(got["input_ids"], want_inputs[0])
        np.testing.assert_array_equal(got["labels"], want_labels[0])
        assert got["labels"][0] == vocab - 1 and sorted(
            set(got["input_ids"]) & set(range(vocab - spans, vocab))
        ) == list(range(vocab - spans, vocab))


# --------------------------------------------------------------------------- the jobs, as a user runs them


def test_mlm_on_minilm_exports_a_fill_mask_model(minilm, tmp_path):
    """`jaxseq mlm` keeps training all-MiniLM-L6-v2 on a few lines of text: eval_loss and perplexity reported,
    and the exported folder loads in AutoModelForMaskedLM (its decoder tied to the embeddings, as the
    checkpoint's config ties them) with jaxseq's logits, and transformers' fill-mask pipeline runs on it."""
    folder, tokenizer = minilm
    (tmp_path / "train.txt").write_text("\n".join(text_lines(120)) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(text_lines(30, start=2000)) + "\n")
    out = tmp_path / "out"
    result = jaxseq(
        "mlm", "--model_name_or_path", folder, "--train_file", tmp_path / "train.txt",
        "--validation_file", tmp_path / "valid.txt", "--max_seq_length", 32, "--per_device_train_batch_size", 4,
        "--max_steps", 3, "--learning_rate", 1e-3, "--scan_layers", "true", "--output_dir", out,
        "--data_cache_dir", tmp_path / "cache",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "of 32 tokens, 0.15 of them masked" in result.stdout
    results = json.loads((out / "eval_results.json").read_text())
    assert results["perplexity"] == pytest.approx(np.exp(results["eval_loss"]), rel=1e-6)
    assert 0 < results["eval_loss"] < 20
    exported = transformers.AutoModelForMaskedLM.from_pretrained(out)
    assert type(exported).__name__ == "BertForMaskedLM"
    decoder, words = exported.cls.predictions.decoder.weight, exported.bert.embeddings.word_embeddings.weight
    assert decoder.data_ptr() == words.data_ptr()
    encoded = tokenizer(text_lines(3, start=500), padding=True, return_tensors="np")
    ids, attention = encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(np.int32)
    want = torch_forward(exported, input_ids=ids, attention_mask=attention).logits.numpy()
    got = np.asarray(load_pretrained(out, "masked-lm")(ids, attention))
    assert scaled_diff(attention, got, want) <= 1e-5
    fill = transformers.pipeline("fill-mask", model=str(out), tokenizer=str(out), device="cpu")
    answers = fill(f"I went to the {tokenizer.mask_token} to buy some bread.")
    assert len(answers) == 5 and all(a["token_str"] and 0 <= a["score"] <= 1 for a in answers)


def test_t5_mlm_logs_its_span_lengths_and_trains(tmp_path):
    """`jaxseq t5-mlm` on a tiny T5 with a SentencePiece tokenizer (T5's 100 sentinels): the run logs
    `span corruption: 568 tokens -> 512 input + 114 target` and reports eval_loss and perplexity."""
    spm = shared_asset("data/tokenizers/sentencepiece/botchan_en_unigram_1000.model")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "spiece.model").write_bytes(spm.read_bytes())
    tokenizer = transformers.T5Tokenizer.from_pretrained(tmp_path / "tokenizer", extra_ids=100)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    transformers.T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    ).save_pretrained(tmp_path / "config")  # fmt: skip
    out = tmp_path / "out"
    result = jaxseq(
        "t5-mlm", "--config_name", tmp_path / "config", "--tokenizer_name", tmp_path / "tokenizer",
        "--train_file", shared_asset("data/text/botchan.txt"), "--max_seq_length", 512,
        "--per_device_train_batch_size", 2, "--max_steps", 3, "--max_eval_samples", 4, "--output_dir", out,
        "--data_cache_dir", tmp_path / "cache",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "span corruption: 568 tokens -> 512 input + 114 target" in result.stdout
    results = json.loads((out / "eval_results.json").read_text())
    assert results["perplexity"] == pytest.approx(np.exp(results["eval_loss"]), rel=1e-6)
    assert np.log(len(tokenizer)) - 1 < results["eval_loss"] < np.log(len(tokenizer)) + 2  # 3 steps from random


@pytest.mark.slow
def test_mlm_line_by_line_scores_each_line_as_transformers_does(minilm, tmp_path):
    """`jaxseq mlm --line_by_line --validation_file` on a tiny BERT with MiniLM's tokenizer finishes (its
    evaluation, in batches cut to their lines' length, once broke on labels left at full width); eval_loss is
    BertForMaskedLM's loss of the exported model on the validation lines, each masked once as the run masks
    them (--seed, --mlm_probability): the labels stayed beside their tokens."""
    _, tokenizer = minilm
    tokenizer.save_pretrained(tmp_path / "model")
    transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path / "model")  # fmt: skip
    valid = text_lines(37, start=2000)
    valid[3] = " ".join(valid[3:9])  # one line longer than --max_seq_length: truncated
    (tmp_path / "train.txt").write_text("\n\n".join(text_lines(40)) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(valid) + "\n")
    out = tmp_path / "out"
    done = run_jaxseq(
        "mlm", "--config_name", tmp_path / "model", "--tokenizer_name", tmp_path / "model", "--line_by_line",
        "--train_file", tmp_path / "train.txt", "--validation_file", tmp_path / "valid.txt", "--max_seq_length", 64,
        "--mlm_probability", 0.3, "--seed", 3, "--per_device_train_batch_size", 8, "--per_device_eval_batch_size", 4,
        "--max_steps", 2, "--learning_rate", 1e-3, "--output_dir", out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "40 training / 37 validation lines of 64 tokens, 0.3 of them masked" in done.stdout
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_samples"] == 37
    assert results["perplexity"] == pytest.approx(np.exp(results["eval_loss"]), rel=1e-6)
    lines = [line.strip() for line in valid]
    encoded = tokenizer(lines, truncation=True, max_length=64, padding="max_length", return_tensors="np")
    arrays = {k: encoded[k].astype(np.int32) for k in ("input_ids", "attention_mask")}
    assert arrays["attention_mask"][3].all() and arrays["attention_mask"].sum(1).max() > 32 > np.median(
        arrays["attention_mask"].sum(1)
    )  # the eval batches are cut to several widths
    masked = mask_examples(
        arrays, 3, tokenizer.all_special_ids, probability=0.3, mask_token_id=tokenizer.mask_token_id,
        vocab_size=len(tokenizer),
    )  # fmt: skip
    labels = masked["labels"]
    chosen = labels != IGNORE
    assert 0.2 < chosen.sum() / (arrays["attention_mask"].sum() - 2 * len(lines)) < 0.4
    exported = transformers.AutoModelForMaskedLM.from_pretrained(out)
    want = torch_forward(exported, **masked)
    assert results["eval_loss"] == pytest.approx(float(want.loss), rel=1e-5)
    assert np.log(len(tokenizer)) - 1 < results["eval_loss"] < np.log(len(tokenizer)) + 1  # 2 steps from random
