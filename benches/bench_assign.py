"""Batched model+endpoint assignment (RouteBalance): routecore beside the
plain-Python scheduler, and KnnEstimator.predict beside the same computation
in NumPy, same run.

Run: .venv/bin/python -m pytest benches/bench_assign.py
"""

import numpy as np
import pytest

from benches.baselines import assign as baseline
from routecore import BatchScheduler, Endpoint, KnnEstimator

# RouteBalance's fleet (Table 1): model, TPOT, price in/out per Mtok, endpoints
FLEET = [
    ("qwen2.5-3b", 0.0102, 0.06, 0.06, 3),
    ("qwen2.5-7b", 0.0196, 0.07, 0.07, 5),
    ("qwen2.5-14b", 0.0139, 0.15, 0.15, 3),
    ("qwen2.5-72b", 0.0416, 0.38, 0.40, 2),
]
B, MAX_BATCH = 256, 16


def endpoints():
    return [
        Endpoint(f"{m}-{k}", m, tpot, p_in, p_out, MAX_BATCH)
        for m, tpot, p_in, p_out, n in FLEET
        for k in range(n)
    ]


def batch(seed=0):
    rng = np.random.default_rng(seed)
    n = sum(f[4] for f in FLEET)
    return (
        rng.uniform(0, 1, (B, 4)),
        rng.integers(16, 1024, (B, 4)).astype(np.float64),
        rng.integers(8, 4096, B),
        np.where(rng.uniform(size=B) < 0.2, rng.uniform(1e-5, 4e-4, B), np.inf),
        rng.integers(0, 8000, n).astype(np.float64),
        rng.integers(0, MAX_BATCH + 1, n),
    )


@pytest.mark.benchmark(group="assign: 256 requests x 13 endpoints x 4 models")
def test_assign_routecore(benchmark):
    s = BatchScheduler(endpoints(), weights="balanced")
    args = batch()
    got = benchmark(s.assign, *args)
    assert (got >= 0).sum() > B // 2


@pytest.mark.benchmark(group="assign: 256 requests x 13 endpoints x 4 models")
def test_assign_plain_python(benchmark):
    fleet = endpoints()
    s = BatchScheduler(fleet, weights="balanced")
    plain_fleet = [
        (
            s.model_of[i],
            f.tpot_s,
            f.price_in_per_mtok,
            f.price_out_per_mtok,
            f.max_batch,
            f.prefill_s_per_token,
        )
        for i, f in enumerate(fleet)
    ]
    q, lens, tokens, budget, pending, sizes = batch()
    rows = (
        q.tolist(),
        lens.tolist(),
        tokens.tolist(),
        budget.tolist(),
        pending.tolist(),
        sizes.tolist(),
    )
    plain = baseline.BatchScheduler(plain_fleet, s.weights)
    got = benchmark(plain.assign, *rows)
    # the twin computes the same assignment (fresh recency on both sides)
    fresh = baseline.BatchScheduler(plain_fleet, s.weights)
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
