"""Evaluation metrics in numpy (the GLUE set plus perplexity); tests check them against scikit-learn/scipy."""

from __future__ import annotations

import math

import numpy as np


def accuracy(predictions, labels) -> float:
    return float(np.mean(np.asarray(predictions) == np.asarray(labels)))


def f1(predictions, labels, positive: int = 1) -> float:
    """Binary F1 of the ``positive`` class (0.0 when there are no true or predicted positives)."""
    p, y = np.asarray(predictions) == positive, np.asarray(labels) == positive
    tp = np.sum(p & y)
    denominator = np.sum(p) + np.sum(y)
    return float(2 * tp / denominator) if denominator else 0.0


def matthews_correlation(predictions, labels) -> float:
    """Matthews correlation for any number of classes (Gorodkin's R_K, as scikit-learn computes it)."""
    p, y = np.asarray(predictions), np.asarray(labels)
    classes = np.union1d(p, y)
    confusion = np.zeros((len(classes), len(classes)), dtype=np.float64)
    np.add.at(confusion, (np.searchsorted(classes, y), np.searchsorted(classes, p)), 1)
    t_sum, p_sum = confusion.sum(axis=1), confusion.sum(axis=0)
    n, correct = confusion.sum(), np.trace(confusion)
    cov_yp = correct * n - t_sum @ p_sum
    cov_yy = n * n - t_sum @ t_sum
    cov_pp = n * n - p_sum @ p_sum
    denominator = math.sqrt(cov_yy * cov_pp)
    return float(cov_yp / denominator) if denominator else 0.0


def pearson(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float(x @ x) * float(y @ y))
    return float(x @ y / denominator) if denominator else 0.0


def _ranks(x) -> np.ndarray:
    """1-based ranks with ties given their average rank."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.r_[True, sorted_x[1:] != sorted_x[:-1]]
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    last = np.r_[first[1:], len(x)] - 1
    ranks = np.empty(len(x), np.float64)
    ranks[order] = (first[group] + last[group]) / 2 + 1
    return ranks


def spearmanr(x, y) -> float:
    return pearson(_ranks(x), _ranks(y))


def perplexity(mean_loss: float) -> float:
    return float(math.exp(min(mean_loss, 700.0)))


def seqeval(references: list[list[str]], predictions: list[list[str]], entity_level: bool = False) -> dict[str, float]:
    """Entity-level ``precision``, ``recall``, ``f1`` (micro averages over entities, seqeval's default scheme)
    and token ``accuracy`` of tag sequences, as run_ner.py computes them through ``evaluate``'s seqeval;
    ``entity_level`` adds ``<type>_precision``, ``_recall``, ``_f1`` and ``_number`` for each entity type."""
    from seqeval.metrics import accuracy_score, classification_report

    report = classification_report(references, predictions, output_dict=True, zero_division=0)  # 0, unwarned
    for average in ("macro avg", "weighted avg"):
        report.pop(average)
    overall = report.pop("micro avg")
    results = {
        "precision": float(overall["precision"]),
        "recall": float(overall["recall"]),
        "f1": float(overall["f1-score"]),
        "accuracy": float(accuracy_score(references, predictions)),
    }
    if entity_level:
        for name, score in report.items():
            for key, field in (("precision", "precision"), ("recall", "recall"), ("f1", "f1-score")):
                results[f"{name}_{key}"] = float(score[field])
            results[f"{name}_number"] = int(score["support"])
    return results


ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def summary_sentences(text: str) -> str:
    """``text`` stripped, a sentence a line (run_summarization's postprocess_text, for rougeLsum): nltk's Punkt
    algorithm with default parameters, as its English model (punkt_tab) is a download outside pip."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return "\n".join(PunktSentenceTokenizer().tokenize(text.strip()))


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """``rouge1``, ``rouge2``, ``rougeL``, ``rougeLsum``: rouge_score's F-measures (use_stemmer=True, rougeLsum
    over ``summary_sentences``) averaged over the pairs, x100 and rounded to 4 places as run_summarization.
    The script's ``evaluate`` reports the median of 1000 random bootstrap means; this is the mean itself."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    scores = [scorer.score(summary_sentences(r), summary_sentences(p)) for p, r in zip(predictions, references)]
    return {k: round(float(np.mean([s[k].fmeasure for s in scores])) * 100, 4) if scores else 0.0 for k in ROUGE_KEYS}
