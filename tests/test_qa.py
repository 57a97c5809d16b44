"""`jaxseq qa` and the question-answering models: BERT's and RoBERTa's start and end logits against
transformers' from perturbed weights (exports round-trip); a long context cut into windows with the answer in
a later one, found back through the offsets; the official SQuAD v1.1 and v2.0 evaluation (reimplemented here
from the published evaluate-v1.1.py and evaluate-v2.0.py) equal to jaxseq's figures; and a short `jaxseq qa`
run (a fresh one-device process) on a hand-written SQuAD v2.0 file with all-MiniLM-L6-v2, whose reported
figures are the official evaluation's of its eval_predictions.json."""

import collections
import json
import os
import re
import string
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.commands import qa as qa_job  # noqa: E402
from jaxseq.data import packing  # noqa: E402
from jaxseq.data.squad import features, postprocess, read_squad, squad_metrics  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from jaxseq.runner import Setup, parse_job  # noqa: E402
from jaxseq.train.objectives import SpanExtraction  # noqa: E402
from tests.conftest import shared_asset  # noqa: E402
from tests.reference import padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402

JAXSEQ = Path(sys.executable).with_name("jaxseq")
TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
CASES = {
    "bert": (transformers.BertConfig(**TINY, max_position_embeddings=32), transformers.BertForQuestionAnswering),
    "roberta": (
        transformers.RobertaConfig(**TINY, max_position_embeddings=34, pad_token_id=1, type_vocab_size=1),
        transformers.RobertaForQuestionAnswering,
    ),
}

# a hand-written SQuAD v2.0 file: three contexts, answerable and unanswerable questions
SQUAD = {
    "version": "v2.0",
    "data": [
        {
            "title": "Rivers",
            "paragraphs": [
                {
                    "context": "The Danube flows through ten countries, more than any other river in the world. "
                    "It rises in the Black Forest in Germany and empties into the Black Sea.",
                    "qas": [
                        {"id": "r1", "question": "Where does the Danube rise?", "is_impossible": False,
                         "answers": [{"text": "the Black Forest", "answer_start": 92},
                                     {"text": "Black Forest in Germany", "answer_start": 96}]},
                        {"id": "r2", "question": "How many countries does the Danube flow through?",
                         "is_impossible": False, "answers": [{"text": "ten", "answer_start": 25}]},
                        {"id": "r3", "question": "Who named the Danube?", "is_impossible": True, "answers": []},
                    ],
                }
            ],
        },
        {
            "title": "Bread",
            "paragraphs": [
                {
                    "context": "Sourdough bread is leavened by wild yeast and lactic acid bacteria. A baker keeps "
                    "a starter alive by feeding it flour and water every day.",
                    "qas": [
                        {"id": "b1", "question": "What leavens sourdough bread?", "is_impossible": False,
                         "answers": [{"text": "wild yeast and lactic acid bacteria", "answer_start": 31}]},
                        {"id": "b2", "question": "What does a baker feed the starter?", "is_impossible": False,
                         "answers": [{"text": "flour and water", "answer_start": 112}]},
                        {"id": "b3", "question": "When was sourdough invented?", "is_impossible": True,
                         "answers": []},
                    ],
                },
                {
                    "context": "The telescope on the hill was built in 1911 by the astronomer Maria Keller.",
                    "qas": [
                        {"id": "t1", "question": "Who built the telescope?", "is_impossible": False,
                         "answers": [{"text": "Maria Keller", "answer_start": 62}]},
                    ],
                },
            ],
        },
    ],
}  # fmt: skip


# ------------------------------------------------------------------ the official evaluation, as published
def official_normalize(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def official_v1(dataset, predictions):
    """evaluate-v1.1.py's ``evaluate``."""

    def f1_score(prediction, ground_truth):
        prediction_tokens = official_normalize(prediction).split()
        ground_truth_tokens = official_normalize(ground_truth).split()
        common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
        num_same = sum(common.values())
        if num_same == 0:
            return 0
        precision = 1.0 * num_same / len(prediction_tokens)
        recall = 1.0 * num_same / len(ground_truth_tokens)
        return (2 * precision * recall) / (precision + recall)

    def exact_match_score(prediction, ground_truth):
        return official_normalize(prediction) == official_normalize(ground_truth)

    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                ground_truths = [x["text"] for x in qa["answers"]]
                prediction = predictions[qa["id"]]
                exact_match += max(exact_match_score(prediction, gt) for gt in ground_truths)
                f1 += max(f1_score(prediction, gt) for gt in ground_truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def official_v2(dataset, preds):
    """evaluate-v2.0.py's ``main`` with no na_prob file (every no-answer probability 0, as run_qa passes)."""

    def get_tokens(s):
        return official_normalize(s).split() if s else []

    def compute_f1(a_gold, a_pred):
        gold_toks, pred_toks = get_tokens(a_gold), get_tokens(a_pred)
        common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
        num_same = sum(common.values())
        if len(gold_toks) == 0 or len(pred_toks) == 0:
            return int(gold_toks == pred_toks)
        if num_same == 0:
            return 0
        precision, recall = 1.0 * num_same / len(pred_toks), 1.0 * num_same / len(gold_toks)
        return (2 * precision * recall) / (precision + recall)

    exact_scores, f1_scores, has_ans = {}, {}, {}
    for article in dataset:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                qid = qa["id"]
                has_ans[qid] = bool(qa["answers"])
                gold_answers = [a["text"] for a in qa["answers"] if official_normalize(a["text"])] or [""]
                exact_scores[qid] = max(
                    int(official_normalize(a) == official_normalize(preds[qid])) for a in gold_answers
                )
                f1_scores[qid] = max(compute_f1(a, preds[qid]) for a in gold_answers)

    def make_eval_dict(qids, prefix=""):
        total = len(qids)
        return {
            f"{prefix}exact": 100.0 * sum(exact_scores[k] for k in qids) / total,
            f"{prefix}f1": 100.0 * sum(f1_scores[k] for k in qids) / total,
            f"{prefix}total": total,
        }

    out = make_eval_dict(list(exact_scores))
    for name, want in (("HasAns_", True), ("NoAns_", False)):
        qids = [k for k, v in has_ans.items() if v == want]
        if qids:
            out.update(make_eval_dict(qids, name))
    return out


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("family", list(CASES))
def test_qa_model_matches_transformers_and_round_trips(family, tmp_path):
    config, torch_cls = CASES[family]
    ref = perturb(torch_cls(config)).eval()
    ref.save_pretrained(tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref", "question-answering")
    assert type(model).hf_architecture == torch_cls.__name__
    pad = config.pad_token_id or 0
    ids, mask = padded_batch(config.vocab_size, pad_id=pad, low=pad + 2)
    out = torch_forward(ref, input_ids=ids, attention_mask=mask)
    start, end = nnx.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids), jnp.asarray(mask))
    assert scaled_diff(mask, np.asarray(start), out.start_logits.numpy()) < 1e-5
    assert scaled_diff(mask, np.asarray(end), out.end_logits.numpy()) < 1e-5
    save_pretrained(model, tmp_path / "out")
    back, info = torch_cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values())
    again = torch_forward(back, input_ids=ids, attention_mask=mask)
    assert scaled_diff(mask, again.start_logits.numpy(), out.start_logits.numpy()) < 1e-5


@pytest.mark.parametrize("family", list(CASES))
def test_packed_windows_are_scored_over_their_own_tokens(family, tmp_path):
    """Windows packed several to a row (as `jaxseq qa` trains): each window's loss is the cross-entropy of
    transformers' start and end logits of that window alone, over its own tokens (its padding left out); the
    gradients are those of that loss on one window a row."""
    config, torch_cls = CASES[family]
    ref = perturb(torch_cls(config)).eval()
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "question-answering")
    pad = config.pad_token_id or 0
    lengths = (12, 5, 9, 4, 7, 3)
    ids, mask = padded_batch(config.vocab_size, lengths, pad_id=pad, low=pad + 2)
    rng = np.random.RandomState(2)
    starts = np.array([rng.randint(0, n) for n in lengths], np.int32)
    ends = np.array([rng.randint(s, n) for s, n in zip(starts, lengths)], np.int32)
    starts[1] = ends[1] = 0  # no answer: the window's [CLS]
    batch = {"input_ids": ids, "attention_mask": mask, "start_positions": starts, "end_positions": ends}
    if family == "bert":  # question, then context
        batch["token_type_ids"] = ((np.arange(ids.shape[1]) >= 2) & (mask > 0)).astype(np.int32)
    packed = packing.pack(batch, packing.rows_needed([batch]), "first")
    assert len(packed["input_ids"]) < len(lengths)
    out = torch_forward(ref, **{k: v for k, v in batch.items() if not k.endswith("_positions")})
    padding = torch.as_tensor(mask == 0)
    want = [
        torch.nn.functional.cross_entropy(logits.masked_fill(padding, -torch.inf), torch.as_tensor(p).long())
        for logits, p in ((out.start_logits, starts), (out.end_logits, ends))
    ]
    objective = SpanExtraction(lambda logits: {}, ())
    graphdef, params = nnx.split(model)

    def loss(p, b):
        return objective.loss(nnx.merge(graphdef, p), {k: jnp.asarray(v) for k, v in b.items()}, None)

    got, got_grads = jax.value_and_grad(loss)(params, packed)
    np.testing.assert_allclose(float(got), float(sum(want)) / 2, rtol=1e-5)

    def unpacked_loss(p):  # one window a row, its padding left out of the softmax
        start, end = nnx.merge(graphdef, p)(
            **{k: jnp.asarray(v) for k, v in batch.items() if not k.endswith("_positions")}
        )
        own = lambda x: jnp.where(jnp.asarray(mask) > 0, x, -jnp.inf)
        ce = optax.softmax_cross_entropy_with_integer_labels
        return ((ce(own(start), starts) + ce(own(end), ends)) / 2).mean()

    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(jax.grad(unpacked_loss)(params))):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_answer_in_a_later_window_is_found_through_the_offsets():
    """A context of ~140 tokens in windows of 64 sharing 16: the answer lies only in a later window, whose
    positions cover exactly its characters (earlier windows point at [CLS]); logits peaking there give back
    the answer's text, and the windows without it do not outvote it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(shared_asset("models/all-MiniLM-L6-v2"))
    filler = " ".join(f"word{i} is plain filler text." for i in range(30))
    context = filler + " The secret password is blue giraffe. " + filler
    start_char = context.index("blue giraffe")
    example = {"id": "x", "question": "What is the password?", "context": context,
               "answers": {"text": ["blue giraffe"], "answer_start": [start_char]}}  # fmt: skip
    w = features([example], tokenizer, max_seq_length=64, doc_stride=16)
    n = len(w["input_ids"])
    assert n >= 3 and (w["example_index"] == 0).all()
    holding = [i for i in range(n) if w["start_positions"][i] > 0]
    assert holding and holding[0] > 0  # not the first window
    for i in range(n):
        s, e = w["start_positions"][i], w["end_positions"][i]
        if i in holding:
            assert context[w["offsets"][i, s, 0] : w["offsets"][i, e, 1]] == "blue giraffe"
        else:
            assert s == e == 0 and w["input_ids"][i, 0] == tokenizer.cls_token_id
    start, end = np.zeros((n, 64), np.float32), np.zeros((n, 64), np.float32)
    i = holding[-1]
    start[i, w["start_positions"][i]] = end[i, w["end_positions"][i]] = 5.0
    answers, nbest, _ = postprocess([example], w["example_index"], w["offsets"], start, end)
    assert answers == {"x": "blue giraffe"} and nbest["x"][0]["probability"] > 0.5


def test_official_evaluation_equals_jaxseqs(tmp_path):
    """Answers right, partly right, wrong, empty and in other case/punctuation: v1.1 over the answerable
    questions and v2.0 over all of them, jaxseq's figures (from the file it reads) equal the scripts'."""
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    examples = read_squad(tmp_path / "squad.json")
    assert [e["id"] for e in examples] == ["r1", "r2", "r3", "b1", "b2", "b3", "t1"]
    for e in examples:
        for text, begin in zip(e["answers"]["text"], e["answers"]["answer_start"]):
            assert e["context"][begin : begin + len(text)] == text
    predictions = {"r1": "Black Forest,", "r2": "ten countries", "r3": "", "b1": "wild yeast", "b2": "The Flour",
                   "b3": "every day", "t1": ""}  # fmt: skip
    answerable = [e for e in examples if e["answers"]["text"]]
    v1_data = [
        {"paragraphs": [{"qas": [qa for qa in p["qas"] if qa["answers"]]} for p in a["paragraphs"]]}
        for a in SQUAD["data"]
    ]
    assert squad_metrics(answerable, predictions) == pytest.approx(official_v1(v1_data, predictions))
    want = official_v2(SQUAD["data"], predictions)
    assert squad_metrics(examples, predictions, version_2=True) == pytest.approx(want)
    assert 0 < want["f1"] < 100 and want["NoAns_total"] == 2


def test_unanswerable_questions_without_the_v2_flag_stop_in_one_line(tmp_path):
    """v1.1's figures need an answer to every question: a v2.0 file without --version_2_with_negative stops
    before anything is loaded or written."""
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    argv = ["--validation_file", tmp_path / "squad.json", "--do_eval", "--output_dir", tmp_path / "out"]
    args = parse_job(qa_job.JOB, list(map(str, argv)))
    with pytest.raises(JaxseqError, match=r"^2 evaluation questions have no answer \(first: r3\).*pass --version_2"):
        qa_job.prepare(Setup(qa_job.JOB, args))
    assert not (tmp_path / "out").exists()


def run_jaxseq(*args, timeout=300):
    """``jaxseq`` as a user runs it: a fresh process, one CPU device, offline."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    return subprocess.run([str(JAXSEQ), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_jaxseq_qa_on_a_squad_v2_file_reports_the_official_figures(tmp_path):
    """A few steps of all-MiniLM-L6-v2 on the hand-written file (windows of 64 sharing 24 tokens), then its
    eval_predictions.json and eval_null_odds.json: one answer (a span of its context, or "") and one odds per
    question, and eval_exact, eval_f1 and the HasAns/NoAns splits are the official v2.0 script's on them."""
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    out = tmp_path / "out"
    done = run_jaxseq(
        "qa", "--model_name_or_path", shared_asset("models/all-MiniLM-L6-v2"),
        "--train_file", tmp_path / "squad.json", "--validation_file", tmp_path / "squad.json",
        "--version_2_with_negative", "--max_seq_length", 64, "--doc_stride", 24, "--max_steps", 4,
        "--per_device_train_batch_size", 4, "--learning_rate", 1e-4, "--output_dir", out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    predictions = json.loads((out / "eval_predictions.json").read_text())
    odds = json.loads((out / "eval_null_odds.json").read_text())
    contexts = {qa["id"]: p["context"] for a in SQUAD["data"] for p in a["paragraphs"] for qa in p["qas"]}
    assert set(predictions) == set(odds) == set(contexts)
    assert all(text in contexts[qid] for qid, text in predictions.items())
    results = json.loads((out / "eval_results.json").read_text())
    want = official_v2(SQUAD["data"], predictions)
    for name, value in want.items():
        assert results[f"eval_{name}"] == pytest.approx(value, abs=1e-9)
    nbest = json.loads((out / "eval_nbest_predictions.json").read_text())
    assert all(0 < len(v) <= 21 for v in nbest.values())
