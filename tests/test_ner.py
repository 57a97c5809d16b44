"""`jaxseq ner` and the token-classification models: BERT's and RoBERTa's logits against transformers' from
perturbed weights (exports round-trip); labels on each word's first sub-token, or all of them with B- turned
to I- (run_ner.py's alignment, read from the tokenizer's word ids); and all-MiniLM-L6-v2 fine-tuned on real
CoNLL-2003 sentences by `jaxseq ner` in a fresh one-device process, its reported figures recomputed by seqeval
on predictions.txt against the file's gold tags, and its export tagging the same words in transformers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
seqeval_metrics = pytest.importorskip("seqeval.metrics")

from jaxseq.commands import ner  # noqa: E402
from jaxseq.data import packing  # noqa: E402
from jaxseq.data.tokens import IGNORE, b_to_i, encode  # noqa: E402
from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from jaxseq.runner import Setup, parse_job  # noqa: E402
from jaxseq.train.objectives import TokenClassification  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.reference import padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402

JAXSEQ = Path(sys.executable).with_name("jaxseq")
TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
CASES = {
    "bert": (transformers.BertConfig(**TINY, max_position_embeddings=32), transformers.BertForTokenClassification),
    "roberta": (
        transformers.RobertaConfig(**TINY, max_position_embeddings=34, pad_token_id=1, type_vocab_size=1),
        transformers.RobertaForTokenClassification,
    ),
    "gpt2": (
        transformers.GPT2Config(vocab_size=99, n_embd=64, n_layer=2, n_head=4, n_positions=32),
        transformers.GPT2ForTokenClassification,
    ),
}


@pytest.mark.parametrize("family", list(CASES))
def test_token_classifier_matches_transformers_and_round_trips(family, tmp_path):
    config, torch_cls = CASES[family]
    config.num_labels = 5
    ref = perturb(torch_cls(config)).eval()
    ref.save_pretrained(tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref", "token-classification")
    assert type(model).hf_architecture == torch_cls.__name__
    pad = config.pad_token_id or 0
    ids, mask = padded_batch(config.vocab_size, pad_id=pad, low=pad + 2)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = np.asarray(nnx.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids), jnp.asarray(mask)))
    assert got.shape == want.shape == (3, 12, 5)
    assert scaled_diff(mask, got, want) < 1e-5
    save_pretrained(model, tmp_path / "out")
    back, info = torch_cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values())
    assert scaled_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits.numpy(), want) < 1e-5


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_packed_sentences_keep_each_tokens_tag_and_give_the_unpacked_loss_and_gradients(family, tmp_path):
    """Packing for tagging (``packing.TOKENS``): every real token lands beside its own label, padding is
    never scored, and the loss and every gradient of the packed batch are the unpacked batch's."""
    config, torch_cls = CASES[family]
    config.num_labels = 5
    perturb(torch_cls(config)).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "token-classification")
    lengths = (12, 3, 9, 5, 7, 4, 10, 2)
    ids, mask = padded_batch(config.vocab_size, lengths, pad_id=config.pad_token_id or 0, low=3)
    rng = np.random.RandomState(1)
    labels = np.where(rng.rand(*ids.shape) < 0.6, rng.randint(0, 5, ids.shape), IGNORE).astype(np.int32)
    labels[mask == 0] = IGNORE
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    rows = packing.rows_needed([batch])
    packed = packing.pack(batch, rows + 1, packing.TOKENS)  # a spare row: all padding
    assert rows < len(lengths) and "pool_index" not in packed
    assert packed["labels"].shape == packed["input_ids"].shape == (rows + 1, ids.shape[1])
    real = packed["attention_mask"] > 0
    assert (packed["labels"][~real] == IGNORE).all()
    pairs = lambda ids, tags, keep: sorted(zip(ids[keep].tolist(), tags[keep].tolist()))
    assert pairs(packed["input_ids"], packed["labels"], real) == pairs(ids, labels, mask > 0)
    objective = TokenClassification([f"T{i}" for i in range(5)])
    graphdef, params = nnx.split(model)

    def loss(p, b):
        return objective.loss(nnx.merge(graphdef, p), {k: jnp.asarray(v) for k, v in b.items()}, None)

    want, want_grads = jax.value_and_grad(loss)(params, batch)
    got, got_grads = jax.value_and_grad(loss)(params, packed)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_labels_go_on_first_sub_tokens_or_all_with_b_turned_to_i():
    """A word of several sub-tokens: its tag on the first (then -100), or with label_all_tokens on every one,
    B-X becoming I-X after the first; special tokens and padding -100; words past the length cut."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(shared_asset("models/all-MiniLM-L6-v2"))
    labels = ["B-PER", "I-PER", "O"]
    example = {"tokens": ["Nadim", "Ladki", "arrived"], "tags": ["B-PER", "I-PER", "O"]}
    words = tokenizer(example["tokens"], is_split_into_words=True).word_ids()
    assert words.count(0) > 1  # "Nadim" is several sub-tokens
    kw = dict(text_column="tokens", label_column="tags", label_to_id={n: i for i, n in enumerate(labels)})
    first = encode([example], tokenizer, max_seq_length=16, **kw)["labels"][0]
    every = encode([example], tokenizer, max_seq_length=16, label_all_tokens=True, **kw)["labels"][0]
    for position, word in enumerate(words):
        tag = None if word is None else labels.index(example["tags"][word])
        starts = word is not None and (position == 0 or words[position - 1] != word)
        assert first[position] == (tag if starts else IGNORE)
        assert every[position] == (IGNORE if word is None else tag if starts else b_to_i(labels)[tag])
    assert (first[len(words) :] == IGNORE).all() and b_to_i(labels) == [1, 1, 2]
    cut = encode([example], tokenizer, max_seq_length=4, **kw)["labels"][0]
    assert (cut >= 0).sum() == 1  # [CLS], two pieces of "Nadim", [SEP]: one word left


def run_jaxseq(*args, timeout=300):
    """``jaxseq`` as a user runs it: a fresh process, one CPU device, offline."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    return subprocess.run([str(JAXSEQ), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def assert_export_tags_as_predicted(out, gold, predicted, architecture, **tokenizer_flags):
    """The exported folder loads in transformers as ``architecture`` and tags each word's first sub-token as
    ``predictions.txt`` says."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, **tokenizer_flags)
    model = transformers.AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(model).__name__ == architecture
    for example, tags in zip(gold, predicted):
        enc = tokenizer(example["tokens"], is_split_into_words=True, return_tensors="pt")
        with torch.no_grad():
            ids = model(**enc).logits[0].argmax(-1).tolist()
        words = enc.word_ids()
        firsts = [p for p, w in enumerate(words) if w is not None and (p == 0 or words[p - 1] != w)]
        assert [model.config.id2label[ids[p]] for p in firsts] == tags


def test_seqeval_scores_are_seqevals():
    """A fresh process scores tags through ``jaxseq.metrics.seqeval`` with seqeval's own figures (micro,
    per entity, accuracy); seqeval's warnings are scikit-learn's class, as a user's filters expect."""
    conll = [json.loads(line) for line in shared_asset("data/ner/conll2003-test.json").read_text().splitlines()]
    truth = [example["ner_tags"] for example in conll[:200]]
    rng = np.random.default_rng(0)
    tags = sorted({tag for row in truth for tag in row})
    predicted = [[tag if rng.random() < 0.8 else str(rng.choice(tags)) for tag in row] for row in truth]
    script = (
        "import json, sys; from jaxseq.metrics import seqeval; pairs = json.loads(sys.stdin.read()); "
        "scores = seqeval(*pairs, entity_level=True); import seqeval.metrics.v1 as s; "
        "import sklearn.exceptions as e; "
        "print(json.dumps([scores, s.UndefinedMetricWarning is e.UndefinedMetricWarning]))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps([truth, predicted]), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    scores, sklearns_warning = json.loads(ran.stdout.splitlines()[-1])
    assert sklearns_warning
    report = seqeval_metrics.classification_report(truth, predicted, output_dict=True, zero_division=0)
    assert 0.3 < scores["f1"] < 0.9 and scores["f1"] == pytest.approx(report["micro avg"]["f1-score"], abs=1e-12)
    assert scores["accuracy"] == pytest.approx(seqeval_metrics.accuracy_score(truth, predicted), abs=1e-12)
    for entity in ("PER", "LOC", "ORG", "MISC"):
        assert scores[f"{entity}_f1"] == pytest.approx(report[entity]["f1-score"], abs=1e-12)
        assert scores[f"{entity}_number"] == report[entity]["support"]


@pytest.mark.slow
def test_jaxseq_ner_fine_tunes_minilm_and_its_figures_are_seqevals(tmp_path):
    """Train on 32 CoNLL-2003 sentences for 4 epochs, evaluate and predict them: eval_* and predict_* are seqeval's
    figures on predictions.txt (one tag a word) against the file's own tags; the exported model, loaded by
    AutoModelForTokenClassification, tags each word's first sub-token as predictions.txt says."""
    conll = shared_asset("data/ner/conll2003-test.json").read_text().splitlines()
    (tmp_path / "train.json").write_text("\n".join(conll[:32]) + "\n")
    out = tmp_path / "out"
    done = run_jaxseq(
        "ner", "--model_name_or_path", shared_asset("models/all-MiniLM-L6-v2"),
        "--train_file", tmp_path / "train.json", "--validation_file", tmp_path / "train.json",
        "--test_file", tmp_path / "train.json", "--do_train", "--do_eval", "--do_predict",
        "--max_seq_length", 64, "--max_steps", 16, "--per_device_train_batch_size", 8,
        "--learning_rate", 3e-4, "--warmup_steps", 0, "--output_dir", out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    gold = [json.loads(line) for line in conll[:32]]
    predicted = [line.split() for line in (out / "predictions.txt").read_text().splitlines()]
    assert len(predicted) == len(gold)
    assert all(len(p) == len(g["tokens"]) for p, g in zip(predicted, gold))  # no sentence was cut at 64
    truth = [g["ner_tags"] for g in gold]
    evaluated = json.loads((out / "eval_results.json").read_text())
    predict = json.loads((out / "predict_results.json").read_text())
    want = {
        "precision": seqeval_metrics.precision_score(truth, predicted),
        "recall": seqeval_metrics.recall_score(truth, predicted),
        "f1": seqeval_metrics.f1_score(truth, predicted),
        "accuracy": seqeval_metrics.accuracy_score(truth, predicted),
    }
    assert want["f1"] > 0.2, want  # it learnt some entities: the figures are not all zeros
    for name, value in want.items():
        assert evaluated[f"eval_{name}"] == pytest.approx(value, abs=1e-9)
        assert predict[f"predict_{name}"] == pytest.approx(value, abs=1e-9)

    assert_export_tags_as_predicted(out, gold, predicted, "BertForTokenClassification")


@pytest.mark.slow
def test_packed_training_of_jaxseq_ner_follows_one_sentence_a_row(tmp_path):
    """The same `jaxseq ner` run (dropout off: packed rows draw other dropout masks), packed by default and with
    --no_pack_sequences: the same loss at every step and the same evaluation, from fewer rows."""
    conll = shared_asset("data/ner/conll2003-test.json").read_text().splitlines()
    (tmp_path / "train.json").write_text("\n".join(conll[:40]) + "\n")
    runs = {}
    for name, extra in (("packed", ()), ("rows", ("--no_pack_sequences",))):
        out = tmp_path / name
        done = run_jaxseq(
            "ner", "--model_name_or_path", shared_asset("models/all-MiniLM-L6-v2"),
            "--train_file", tmp_path / "train.json", "--validation_file", tmp_path / "train.json",
            "--max_seq_length", 64, "--max_steps", 4, "--per_device_train_batch_size", 8, "--logging_steps", 1,
            "--learning_rate", 3e-4, "--config_overrides", "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
            "--output_dir", out, *extra,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [r["train/loss"] for r in records if "train/loss" in r]
        runs[name] = losses, json.loads((out / "eval_results.json").read_text()), done.stdout
    assert len(runs["packed"][0]) == 4
    np.testing.assert_allclose(runs["packed"][0], runs["rows"][0], rtol=1e-5)
    for key, value in runs["rows"][1].items():
        assert runs["packed"][1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert "packing 8 examples into" in runs["packed"][2] and "packing" not in runs["rows"][2]
    assert "packing 40 eval examples into 2 batches of 8 rows" in runs["packed"][2]  # evaluated on packed rows


def test_a_datasets_folder_with_int_tags_is_read_with_their_names(tmp_path):
    """A dataset (here a local folder of parquet files, as the Hub serves them) whose tags are ints with
    ClassLabel names: the model's labels are those names in that order, and each word's first sub-token holds
    its int tag."""
    datasets = pytest.importorskip("datasets")
    names = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]  # CoNLL-2003's order
    conll = [json.loads(line) for line in shared_asset("data/ner/conll2003-test.json").read_text().splitlines()[:24]]
    features = datasets.Features(
        {
            "tokens": datasets.Sequence(datasets.Value("string")),
            "ner_tags": datasets.Sequence(datasets.ClassLabel(names=names)),
        }
    )
    for split, part in (("train", conll[:16]), ("validation", conll[16:])):
        rows = {
            "tokens": [e["tokens"] for e in part],
            "ner_tags": [[names.index(t) for t in e["ner_tags"]] for e in part],
        }
        datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "data" / f"{split}.parquet")
    argv = ["--model_name_or_path", shared_asset("models/all-MiniLM-L6-v2"), "--dataset_name", tmp_path / "data",
            "--max_seq_length", 64, "--output_dir", tmp_path / "out"]  # fmt: skip
    setup = Setup(ner.JOB, parse_job(ner.JOB, list(map(str, argv))))
    prepared = ner.prepare(setup)
    assert setup.config.id2label == dict(enumerate(names))
    tokenizer = transformers.AutoTokenizer.from_pretrained(shared_asset("models/all-MiniLM-L6-v2"))
    labels = prepared.evals[""].take(np.arange(8))["labels"]
    for example, row in zip(conll[16:24], labels):
        words = tokenizer(example["tokens"], is_split_into_words=True).word_ids()
        firsts = [p for p, w in enumerate(words) if w is not None and (p == 0 or words[p - 1] != w)]
        assert row[firsts].tolist() == [names.index(t) for t in example["ner_tags"]]
        assert (np.delete(row, firsts) == IGNORE).all()


@pytest.mark.slow
def test_jaxseq_ner_fine_tunes_a_gpt2_decoder_that_transformers_loads(tmp_path):
    """A GPT-style decoder tags words too (run_ner's GPT-2: its BPE with a prefix space before each word, padded
    with EOS): the exported folder loads as GPT2ForTokenClassification and tags each word's first sub-token as
    predictions.txt says."""
    gpt2 = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(gpt2 / "vocab.json"), merges=str(gpt2 / "merges.txt"))
    tokenizer.save_pretrained(tmp_path / "gpt2")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    conll = shared_asset("data/ner/conll2003-test.json").read_text().splitlines()
    (tmp_path / "train.json").write_text("\n".join(conll[:32]) + "\n")
    out = tmp_path / "out"
    done = run_jaxseq(
        "ner", "--model_name_or_path", tmp_path / "gpt2", "--train_file", tmp_path / "train.json",
        "--validation_file", tmp_path / "train.json", "--test_file", tmp_path / "train.json", "--do_train",
        "--do_eval", "--do_predict", "--max_seq_length", 64, "--max_steps", 8, "--output_dir", out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    gold = [json.loads(line) for line in conll[:32]]
    predicted = [line.split() for line in (out / "predictions.txt").read_text().splitlines()]
    assert [len(p) for p in predicted] == [len(g["tokens"]) for g in gold]
    assert_export_tags_as_predicted(out, gold, predicted, "GPT2ForTokenClassification", add_prefix_space=True)
