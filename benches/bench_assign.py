"""Batched model+endpoint assignment (RouteBalance): routecore beside the
plain-Python scheduler, and KnnEstimator.predict beside the same computation
in NumPy, same run.

Run: .venv/bin/python -m pytest benches/bench_assign.py
"""

import numpy as np
import pytest

from routecore import BatchScheduler, KnnEstimator
from routecore._baselines import assign as baseline
from routecore._baselines.cases import ASSIGN_BATCH, assign_batch, assign_twin, endpoints

B = ASSIGN_BATCH


@pytest.mark.benchmark(group="assign: 256 requests x 13 endpoints x 4 models")
def test_assign_routecore(benchmark):
    s = BatchScheduler(endpoints(), weights="balanced")
    args = assign_batch()
    got = benchmark(s.assign, *args)
    assert (got >= 0).sum() > B // 2


@pytest.mark.benchmark(group="assign: 256 requests x 13 endpoints x 4 models")
def test_assign_plain_python(benchmark):
    fleet = endpoints()
    s = BatchScheduler(fleet, weights="balanced")
    q, lens, tokens, budget, pending, sizes = assign_batch()
    rows = (
        q.tolist(),
        lens.tolist(),
        tokens.tolist(),
        budget.tolist(),
        pending.tolist(),
        sizes.tolist(),
    )
    plain = assign_twin(s, fleet)
    got = benchmark(plain.assign, *rows)
    # the twin computes the same assignment (fresh recency on both sides)
    fresh = assign_twin(s, fleet)
    assert fresh.assign(*rows) == s.assign(q, lens, tokens, budget, pending, sizes).tolist()
    assert len(got) == B


N, D, Q, K = 10_000, 384, 32, 8


def knn_data(seed=0):
    rng = np.random.default_rng(seed)
    train = rng.normal(size=(N, D)).astype(np.float32)
    return (
        train,
        rng.uniform(size=(N, 4)),
        rng.uniform(10, 1000, (N, 4)),
        rng.normal(size=(Q, D)).astype(np.float32),
    )


@pytest.mark.benchmark(group="KnnEstimator.predict: 32 queries over 10,000 x 384")
def test_knn_routecore(benchmark):
    train, quality, lens, queries = knn_data()
    est = KnnEstimator(k=K)
    est.fit(train, quality, lens)
    q, ln = benchmark(est.predict, queries)
    want_q, want_l = baseline.Knn(K, train, quality, lens).predict(queries)
    np.testing.assert_allclose(q, want_q, rtol=1e-4)
    np.testing.assert_allclose(ln, want_l, rtol=1e-4)


@pytest.mark.benchmark(group="KnnEstimator.predict: 32 queries over 10,000 x 384")
def test_knn_numpy(benchmark):
    train, quality, lens, queries = knn_data()
    q, _ = benchmark(baseline.Knn(K, train, quality, lens).predict, queries)
    assert q.shape == (Q, 4)
