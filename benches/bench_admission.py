"""Quota admission: one admit + complete pair, routecore (Rust from Python,
the in-memory backend, the Redis backend on loopback) beside plain Python, same run.

Run: .venv/bin/python -m pytest benches/bench_admission.py
The Rust-only figure: cargo test --release -- --ignored --nocapture admit_complete_timing
"""

import time

import pytest

from routecore import AdmissionController, InMemoryAdmission
from routecore._baselines.cases import (
    ADMISSION_QUOTAS,
    ENTITLEMENTS,
    admission_twin,
    admit_complete_pair,
)
from tests.conftest import RedisServer

GROUP = "admission: admit + complete pair"
QUOTAS, ENTS = ADMISSION_QUOTAS, ENTITLEMENTS


@pytest.mark.benchmark(group=GROUP)
def test_pair_routecore_controller(benchmark):
    ctl = AdmissionController(QUOTAS, ENTS)
    run = admit_complete_pair(lambda *a: ctl.admit(*a).ticket, ctl.complete)
    assert benchmark(run) is not None


@pytest.mark.benchmark(group=GROUP)
def test_pair_routecore_in_memory_backend(benchmark):
    backend = InMemoryAdmission(QUOTAS, ENTS)
    run = admit_complete_pair(
        lambda e, i, m, now: backend.admit(e, i, m, now=now).ticket,
        lambda t, i, o, lat, now: backend.complete(t, i, o, lat, now=now),
    )
    assert benchmark(run) is not None


@pytest.mark.benchmark(group=GROUP)
def test_pair_plain_python(benchmark):
    ctl = admission_twin()
    run = admit_complete_pair(lambda *a: ctl.admit(*a)[3], ctl.complete)
    assert benchmark(run) is not None


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer()
    server.start()
    yield server.url
    server.kill()


@pytest.mark.benchmark(group=GROUP)
def test_pair_routecore_redis_loopback(benchmark, redis_url):
    from routecore import RedisAdmission

    backend = RedisAdmission(QUOTAS, ENTS, url=redis_url, prefix="bench")
    run = admit_complete_pair(
        lambda e, i, m, now: backend.admit(e, i, m, now=now).ticket,
        lambda t, i, o, lat, now: backend.complete(t, i, o, lat, now=now),
    )
    assert benchmark.pedantic(run, rounds=3000, warmup_rounds=100) is not None
    # The p99 of each call on its own (pytest-benchmark reports no percentiles).
    admits, completes = [], []
    for k in range(3000):
        t0 = time.perf_counter()
        a = backend.admit("copilot", 64, 64, now=1e4 + k * 1e-3)
        t1 = time.perf_counter()
        assert backend.complete(a.ticket, 64, 64, 0.5, now=1e4 + k * 1e-3)
        admits.append(t1 - t0)
        completes.append(time.perf_counter() - t1)
    for name, xs in (("admit", admits), ("complete", completes)):
        xs.sort()
        p50, p99 = xs[len(xs) // 2] * 1e6, xs[int(0.99 * len(xs))] * 1e6
        benchmark.extra_info[f"{name}_p50_us"] = round(p50, 1)
        benchmark.extra_info[f"{name}_p99_us"] = round(p99, 1)
        print(f"\nredis {name}: p50 {p50:.0f} us, p99 {p99:.0f} us over {len(xs)} calls")
