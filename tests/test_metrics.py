"""Our numpy metrics equal scikit-learn's and scipy's on random and edge-case inputs."""

import numpy as np
import pytest

from jaxseq import metrics

sklearn_metrics = pytest.importorskip("sklearn.metrics")
stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("seed", range(5))
def test_classification_metrics_match_sklearn(seed):
    rng = np.random.RandomState(seed)
    labels, predictions = rng.randint(0, 2, 200), rng.randint(0, 2, 200)
    assert metrics.accuracy(predictions, labels) == pytest.approx(sklearn_metrics.accuracy_score(labels, predictions))
    assert metrics.f1(predictions, labels) == pytest.approx(sklearn_metrics.f1_score(labels, predictions))
    assert metrics.matthews_correlation(predictions, labels) == pytest.approx(
        sklearn_metrics.matthews_corrcoef(labels, predictions)
    )
    labels3, predictions3 = rng.randint(0, 3, 200), rng.randint(0, 3, 200)
    assert metrics.matthews_correlation(predictions3, labels3) == pytest.approx(
        sklearn_metrics.matthews_corrcoef(labels3, predictions3)
    )


def test_degenerate_cases_match_sklearn():
    ones = np.ones(10, int)
    zeros = np.zeros(10, int)
    assert metrics.matthews_correlation(ones, ones) == sklearn_metrics.matthews_corrcoef(ones, ones)
    assert metrics.f1(zeros, zeros) == sklearn_metrics.f1_score(zeros, zeros, zero_division=0.0)


@pytest.mark.parametrize("seed", range(5))
def test_correlations_match_scipy(seed):
    rng = np.random.RandomState(seed)
    x = rng.randn(300)
    y = x + rng.randn(300)
    y_tied = np.round(y * 2) / 2  # STS-B style scores with many ties
    assert metrics.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0])
    assert metrics.spearmanr(x, y_tied) == pytest.approx(stats.spearmanr(x, y_tied)[0])
    assert metrics.spearmanr(np.round(x), y_tied) == pytest.approx(stats.spearmanr(np.round(x), y_tied)[0])


def test_perplexity():
    assert metrics.perplexity(np.log(50.0)) == pytest.approx(50.0)
