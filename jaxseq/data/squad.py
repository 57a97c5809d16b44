"""Extractive question answering data (SQuAD v1.1 and v2.0, as transformers' run_qa.py and utils_qa.py):
examples from the official nested JSON or datasets' flat rows; long contexts cut into overlapping windows
(``doc_stride`` tokens shared) with each token's character offsets; answers found back in the context from
the start and end logits of every window; and the official evaluation's exact match and F1."""

from __future__ import annotations

import collections
import json
import re
import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxseq.data.records import read_records
from jaxseq.errors import JaxseqError


def read_squad(path) -> list[dict]:
    """``{id, title, context, question, answers: {text: [...], answer_start: [...]}}`` for every question of
    an official SQuAD file (``{"data": [{"paragraphs": [{"context", "qas"}]}]}``) or of flat rows (datasets'
    squad columns, csv or json(l)); v2's unanswerable questions have no answers."""
    path = Path(path)
    if path.suffix.lower() == ".json" and path.is_file():
        text = path.read_text(encoding="utf-8")
        try:
            nested = json.loads(text) if text.lstrip().startswith("{") else None
        except json.JSONDecodeError:
            nested = None
        if isinstance(nested, dict) and "data" in nested:
            return [
                {
                    "id": str(qa["id"]),
                    "title": article.get("title", ""),
                    "context": paragraph["context"],
                    "question": qa["question"],
                    "answers": {
                        "text": [a["text"] for a in qa.get("answers", [])],
                        "answer_start": [int(a["answer_start"]) for a in qa.get("answers", [])],
                    },
                }
                for article in nested["data"]
                for paragraph in article["paragraphs"]
                for qa in paragraph["qas"]
            ]
    return check_rows(read_records(path), str(path))


def check_rows(rows: Sequence[dict], where: str) -> list[dict]:
    """Flat squad rows, answers read as JSON where a csv cell holds them; one line naming what is missing."""
    out = []
    for i, row in enumerate(rows):
        missing = [c for c in ("id", "context", "question") if c not in row]
        if missing:
            raise JaxseqError(f"{where} row {i} lacks {', '.join(missing)}; give id, context, question and answers")
        answers = row.get("answers") or {"text": [], "answer_start": []}
        if isinstance(answers, str):
            answers = json.loads(answers)
        out.append({**row, "id": str(row["id"]), "answers": answers})
    return out


def features(
    examples: Sequence[dict],
    tokenizer,
    *,
    max_seq_length: int,
    doc_stride: int,
) -> dict[str, np.ndarray]:
    """The windows of every example (run_qa's ``prepare_train_features`` and ``prepare_validation_features``
    in one): ``input_ids``, ``attention_mask`` (``token_type_ids``), ``start_positions``/``end_positions``
    (the first answer's tokens, or the [CLS] token where the window does not hold it or there is none),
    ``example_index`` and ``offsets`` ``[n, seq, 2]``: each context token's characters, -1 elsewhere."""
    pad_on_right = tokenizer.padding_side == "right"
    questions = [e["question"].lstrip() for e in examples]
    contexts = [e["context"] for e in examples]
    enc = tokenizer(
        questions if pad_on_right else contexts,
        contexts if pad_on_right else questions,
        truncation="only_second" if pad_on_right else "only_first",
        max_length=max_seq_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )
    context_index = 1 if pad_on_right else 0
    n = len(enc["input_ids"])
    starts, ends = np.zeros(n, np.int32), np.zeros(n, np.int32)
    offsets = np.full((n, max_seq_length, 2), -1, np.int32)
    for i in range(n):
        ids, sequence = enc["input_ids"][i], enc.sequence_ids(i)
        offset = enc["offset_mapping"][i]
        for k, s in enumerate(sequence):
            if s == context_index:
                offsets[i, k] = offset[k]
        cls = next((ids.index(t) for t in (tokenizer.cls_token_id, tokenizer.bos_token_id) if t in ids), 0)
        answers = examples[enc["overflow_to_sample_mapping"][i]]["answers"]
        starts[i] = ends[i] = cls
        if not answers["answer_start"]:
            continue
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])
        first = sequence.index(context_index)
        last = len(sequence) - 1 - sequence[::-1].index(context_index)
        if offset[first][0] <= start_char and offset[last][1] >= end_char:
            while first < len(offset) and offset[first][0] <= start_char:
                first += 1
            while offset[last][1] >= end_char:
                last -= 1
            starts[i], ends[i] = first - 1, last + 1
    arrays = {k: np.asarray(enc[k], np.int32) for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
    return {
        **arrays,
        "start_positions": starts,
        "end_positions": ends,
        "example_index": np.asarray(enc["overflow_to_sample_mapping"], np.int32),
        "offsets": offsets,
    }


def postprocess(
    examples: Sequence[dict],
    example_index: np.ndarray,
    offsets: np.ndarray,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    *,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    version_2_with_negative: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, list[dict]], dict[str, float]]:
    """(answer by id, n-best list by id, null odds by id for v2) from every window's logits, as utils_qa's
    ``postprocess_qa_predictions``: the n-best starts and ends of each window that fall in its context, in
    order, at most ``max_answer_length`` tokens apart, scored by the sum of their logits; v2 answers "" when
    the lowest null score (the [CLS] logits) beats the best span by more than ``null_score_diff_threshold``."""
    windows = collections.defaultdict(list)
    for feature, example in enumerate(example_index):
        windows[int(example)].append(feature)
    answers, nbest, null_odds = {}, {}, {}
    for e, example in enumerate(examples):
        null, prelim = None, []
        for f in windows[e]:
            start, end, offset = start_logits[f], end_logits[f], offsets[f]
            score = float(start[0] + end[0])
            if null is None or null["score"] > score:
                null = {"offsets": (0, 0), "score": score, "start_logit": float(start[0]), "end_logit": float(end[0])}
            best_starts = np.argsort(start)[-1 : -n_best_size - 1 : -1].tolist()
            best_ends = np.argsort(end)[-1 : -n_best_size - 1 : -1].tolist()
            for s in best_starts:
                for t in best_ends:
                    if s >= len(offset) or t >= len(offset) or offset[s][0] < 0 or offset[t][0] < 0:
                        continue
                    if t < s or t - s + 1 > max_answer_length:
                        continue
                    prelim.append(
                        {
                            "offsets": (int(offset[s][0]), int(offset[t][1])),
                            "score": float(start[s] + end[t]),
                            "start_logit": float(start[s]),
                            "end_logit": float(end[t]),
                        }
                    )
        if version_2_with_negative and null is not None:
            prelim.append(null)
        predictions = sorted(prelim, key=lambda p: p["score"], reverse=True)[:n_best_size]
        if version_2_with_negative and null is not None and not any(p["offsets"] == (0, 0) for p in predictions):
            predictions.append(null)
        context = example["context"]
        predictions = [{**p, "text": context[p["offsets"][0] : p["offsets"][1]]} for p in predictions]
        if not predictions or (len(predictions) == 1 and predictions[0]["text"] == ""):
            predictions.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})
        scores = np.array([p["score"] for p in predictions])
        probabilities = np.exp(scores - scores.max())
        probabilities /= probabilities.sum()
        nbest[example["id"]] = [
            {"start_logit": p["start_logit"], "end_logit": p["end_logit"], "text": p["text"], "probability": float(q)}
            for p, q in zip(predictions, probabilities)
        ]
        if not version_2_with_negative:
            answers[example["id"]] = predictions[0]["text"]
            continue
        best = next(p for p in predictions if p["text"] != "")
        diff = null["score"] - best["start_logit"] - best["end_logit"]
        null_odds[example["id"]] = float(diff)
        answers[example["id"]] = "" if diff > null_score_diff_threshold else best["text"]
    return answers, nbest, null_odds


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces: the official script's."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _f1(prediction: str, truth: str, v2: bool) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if v2 and (not pred or not gold):
        return float(pred == gold)
    same = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(examples: Sequence[dict], answers: dict[str, str], version_2: bool = False) -> dict[str, float]:
    """The official evaluation, in percent: v1.1's ``exact_match`` and ``f1`` (the best over the gold answers);
    v2.0's ``exact`` and ``f1`` (an unanswerable question's one gold answer is ""), with ``total`` and the
    ``HasAns_`` and ``NoAns_`` splits."""
    exact, f1, has = [], [], []
    for example in examples:
        truths = [t for t in example["answers"]["text"] if normalize_answer(t)] if version_2 else []
        truths = truths or ([""] if version_2 else example["answers"]["text"])
        prediction = answers[example["id"]]
        exact.append(max(float(normalize_answer(prediction) == normalize_answer(t)) for t in truths))
        f1.append(max(_f1(prediction, t, version_2) for t in truths))
        has.append(bool(example["answers"]["text"]))
    if not version_2:
        return {"exact_match": 100.0 * np.mean(exact), "f1": 100.0 * np.mean(f1)}
    exact, f1, has = np.array(exact), np.array(f1), np.array(has, bool)
    results = {"exact": 100.0 * exact.mean(), "f1": 100.0 * f1.mean(), "total": len(exact)}
    for name, part in (("HasAns", has), ("NoAns", ~has)):
        if part.any():
            results.update({f"{name}_exact": 100.0 * exact[part].mean(), f"{name}_f1": 100.0 * f1[part].mean()})
            results[f"{name}_total"] = int(part.sum())
    return {k: float(v) if isinstance(v, float | np.floating) else v for k, v in results.items()}
