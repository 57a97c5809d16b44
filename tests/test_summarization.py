"""`jaxseq seq2seq` as transformers' run_summarization.py: a fresh process fine-tunes a tiny T5 (the botchan
SentencePiece model as its tokenizer) on text/summary rows, evaluates and predicts with beam search; its
predictions are transformers' generate(num_beams=4) on the exported folder, and its ROUGE is rouge_score's."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")

from jaxseq.commands.seq2seq import Seq2SeqDataConfig, load_data, search_settings  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.test_seq2seq import tiny_t5, tokenizer, tokenizer_dir  # noqa: E402, F401

PREFIX = "summarize: "
SOURCE_LEN, TARGET_LEN = 48, 24


def botchan_rows(tok, n):
    """text: three consecutive sentences of botchan; summary: the first two, where they survive tokenizing
    whole (so the references the job scores are these strings)."""
    text = " ".join(shared_asset("data/text/botchan.txt").read_text().split())
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if 3 <= len(s.split()) <= 8]
    rows = []
    for i in range(len(sentences) - 2):
        summary = " ".join(sentences[i : i + 2])
        ids = tok(summary)["input_ids"]
        if len(ids) <= TARGET_LEN and tok.decode(ids, skip_special_tokens=True) == summary:
            rows.append({"text": " ".join(sentences[i : i + 3]), "summary": summary})
    assert len(rows) >= n
    return rows[:n]


def scorer_rouge(predictions, references):
    """rouge_score directly: mean F-measure x100 (4 places), rougeLsum over Punkt-split lines."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    lines = lambda s: "\n".join(PunktSentenceTokenizer().tokenize(s.strip()))
    keys = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
    scorer = rouge_scorer.RougeScorer(keys, use_stemmer=True)
    scores = [scorer.score(lines(r), lines(p)) for p, r in zip(predictions, references)]
    return {k: round(float(np.mean([s[k].fmeasure for s in scores])) * 100, 4) for k in keys}


def test_beam_evaluation_and_prediction_are_transformers_generate_and_rouge_is_rouge_scores(
    tmp_path,
    tokenizer_dir,  # noqa: F811 (the fixtures of test_seq2seq)
    tokenizer,  # noqa: F811
):
    model_dir = tmp_path / "model"
    ref = transformers.T5ForConditionalGeneration(tiny_t5(tokenizer, dropout_rate=0.0))
    with torch.no_grad():  # perturbed: predictions vary with the source and share some words with the summaries
        ref.shared.weight[tokenizer(" the", add_special_tokens=False)["input_ids"]] *= 3.0
    ref.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = botchan_rows(tokenizer, 44)
    for name, part in (("train", rows[:32]), ("dev", rows[32:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    dev = rows[32:]
    out = tmp_path / "out"
    args = [
        "--model_name_or_path", model_dir, "--train_file", tmp_path / "train.jsonl",
        "--validation_file", tmp_path / "dev.jsonl", "--test_file", tmp_path / "dev.jsonl", "--do_predict",
        "--text_column", "text", "--summary_column", "summary", "--source_prefix", PREFIX,
        "--max_source_length", SOURCE_LEN, "--max_target_length", 16, "--val_max_target_length", TARGET_LEN,
        "--num_beams", 4, "--per_device_train_batch_size", 8, "--per_device_eval_batch_size", 4,
        "--max_steps", 30, "--optimizer", "adafactor", "--learning_rate", 1e-2,
        "--output_dir", out, "--report_to", "none",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run([sys.executable, "-m", "jaxseq", "seq2seq", *map(str, args)], capture_output=True,
                            text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    predictions = (out / "generated_predictions.txt").read_text().splitlines()
    assert len(predictions) == len(dev)

    trained = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    encoded = tokenizer([PREFIX + r["text"] for r in dev], max_length=SOURCE_LEN, truncation=True,
                        padding=True, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        sequences = trained.generate(**encoded, num_beams=4, max_new_tokens=TARGET_LEN, do_sample=False)
    expected = [t.strip() for t in tokenizer.batch_decode(sequences, skip_special_tokens=True)]
    assert predictions == expected
    assert len(set(predictions)) > len(dev) // 2

    results = json.loads((out / "eval_results.json").read_text())
    rouge = scorer_rouge(predictions, [r["summary"] for r in dev])
    assert 0 < rouge["rouge1"] < 100, (predictions, rouge)  # 30 Adafactor steps: the summaries' common words
    assert {k: results[f"eval_{k}"] for k in rouge} == rouge
    gen_len = np.mean([np.count_nonzero(s != tokenizer.pad_token_id) for s in sequences.numpy()])
    assert results["eval_gen_len"] == pytest.approx(gen_len)
    predicted = json.loads((out / "predict_results.json").read_text())
    assert predicted["predict_samples"] == len(dev)
    assert {k: predicted[f"predict_{k}"] for k in (*rouge, "gen_len")} == {**rouge, "gen_len": results["eval_gen_len"]}


def test_beams_default_to_the_models_generation_config(tmp_path):
    assert search_settings(tmp_path, None) == {"num_beams": 1, "length_penalty": 1.0, "early_stopping": False}
    transformers.GenerationConfig(num_beams=3, length_penalty=0.6, early_stopping=True).save_pretrained(tmp_path)
    assert search_settings(tmp_path, None) == {"num_beams": 3, "length_penalty": 0.6, "early_stopping": True}
    assert search_settings(tmp_path, 2)["num_beams"] == 2


def test_missing_files_stop_in_one_line(tmp_path):
    with pytest.raises(JaxseqError, match="--do_predict needs --test_file"):
        load_data(Seq2SeqDataConfig(), (False, False, True))
    with pytest.raises(JaxseqError, match="pass --train_file, --validation_file or --do_predict"):
        load_data(Seq2SeqDataConfig())
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "a b.", "summary": "a."}) + "\n")
    with pytest.raises(JaxseqError, match="lacks column"):
        load_data(Seq2SeqDataConfig(validation_file=str(tmp_path / "a.jsonl"), summary_column="highlights"))
    data = Seq2SeqDataConfig(validation_file=str(tmp_path / "a.jsonl"), text_column="text", summary_column="summary")
    assert load_data(data) == {"eval": [("a b.", "a.")]}


def test_rouge_is_rouge_scores_mean_with_stems_and_a_sentence_a_line_for_lsum():
    from jaxseq.metrics import rouge

    predictions = ["The cats were running home. Then it rained!", "a b c d", "nothing here"]
    references = ["Then it rained. The cat runs home quickly.", "a c b d", "the cats"]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    split = ["The cats were running home.\nThen it rained!", "a b c d", "nothing here"]
    split_refs = ["Then it rained.\nThe cat runs home quickly.", "a c b d", "the cats"]
    scores = [scorer.score(r, p) for p, r in zip(split, split_refs)]
    expected = {k: round(float(np.mean([s[k].fmeasure for s in scores])) * 100, 4) for k in scores[0]}
    got = rouge(predictions, references)
    assert got == expected
    assert got["rougeLsum"] > got["rougeL"] > 0 and got["rouge1"] > got["rouge2"] > 0  # stems, sentences: all differ
