"""Prefix-cache-aware routing: routecore beside the plain-Python version, same run.

Run: .venv/bin/python -m pytest benches/bench_prefix.py
"""

import numpy as np
import pytest

from benches.baselines import prefix as baseline
from routecore import PrefixCacheRouter, block_hashes

TOKENS = 8192
BLOCK = 16  # 512 blocks
ENDPOINTS = [f"endpoint-{i}" for i in range(16)]


def prompt(seed=0, n=TOKENS):
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint32)


@pytest.mark.benchmark(group="block_hashes: 8,192 tokens, block 16")
def test_block_hashes_routecore(benchmark):
    p = prompt()
    out = benchmark(block_hashes, p, BLOCK)
    assert out.tolist() == baseline.block_hashes(p, BLOCK)


@pytest.mark.benchmark(group="block_hashes: 8,192 tokens, block 16")
def test_block_hashes_plain_python(benchmark):
    out = benchmark(baseline.block_hashes, prompt(), BLOCK)
    assert len(out) == TOKENS // BLOCK


def warmed(router_cls):
    """A router that has seen 16 prompts sharing a 4,096-token system prompt."""
    r = router_cls(ENDPOINTS, block_size=BLOCK)
    system = prompt(1, TOKENS // 2)
    for k in range(16):
        r.route(np.concatenate([system, prompt(100 + k, TOKENS // 2)]))
    return r, np.concatenate([system, prompt(999, TOKENS // 2)])


@pytest.mark.benchmark(group="PrefixCacheRouter.route: 16 endpoints, 512-block prompt")
def test_route_routecore(benchmark):
    r, p = warmed(PrefixCacheRouter)
    endpoint, fraction = benchmark(r.route, p)
    assert endpoint in ENDPOINTS and fraction >= 0.5


@pytest.mark.benchmark(group="PrefixCacheRouter.route: 16 endpoints, 512-block prompt")
def test_route_plain_python(benchmark):
    r, p = warmed(baseline.PrefixCacheRouter)
    endpoint, fraction = benchmark(r.route, p)
    assert endpoint in ENDPOINTS and fraction >= 0.5


def test_the_baseline_decides_like_routecore():
    rc, _ = warmed(PrefixCacheRouter)
    py, _ = warmed(baseline.PrefixCacheRouter)
    system = prompt(1, TOKENS // 2)
    for k in range(40):
        p = np.concatenate([system[: 64 * (k % 9)], prompt(k % 13, 1000)])
        assert rc.route(p) == py.route(p)
    assert rc.running == py.running


BATCH = 64


def batch():
    system = prompt(1, 1024)
    prompts = [np.concatenate([system, prompt(k, 1024)]) for k in range(BATCH)]
    return prompts, np.concatenate(prompts), np.cumsum([0] + [len(p) for p in prompts])


@pytest.mark.benchmark(group="route_many: 64 prompts of 2,048 tokens")
def test_route_many_routecore(benchmark):
    _, flat, offsets = batch()

    def run():
        return PrefixCacheRouter(ENDPOINTS, block_size=BLOCK).route_many(flat, offsets)

    endpoints, _ = benchmark(run)
    assert len(endpoints) == BATCH


@pytest.mark.benchmark(group="route_many: 64 prompts of 2,048 tokens")
def test_route_many_plain_python_loop(benchmark):
    prompts, _, _ = batch()

    def run():
        r = baseline.PrefixCacheRouter(ENDPOINTS, block_size=BLOCK)
        return [r.route(p) for p in prompts]

    assert len(benchmark(run)) == BATCH
