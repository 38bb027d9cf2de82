"""Quota admission: one admit + complete pair, routecore (Rust from Python,
the in-memory backend, the Redis backend on loopback) beside plain Python, same run.

Run: .venv/bin/python -m pytest benches/bench_admission.py
The Rust-only figure: cargo test --release -- --ignored --nocapture admit_complete_timing
"""

import random
import time

import pytest

from routecore import AdmissionController, Entitlement, InMemoryAdmission, Quota
from routecore._baselines import admission
from routecore._baselines.cases import (
    ADMISSION_QUOTAS,
    ENTITLEMENTS,
    admission_twin,
    admit_complete_pair,
)
from tests.conftest import RedisServer

GROUP = "admission: admit + complete pair"
QUOTAS, ENTS = ADMISSION_QUOTAS, ENTITLEMENTS


def test_the_baseline_decides_like_routecore():
    """Random traffic of three service classes on one small quota, completions
    in random order: every status, reason and Retry-After of the plain-Python
    controller is routecore's (admitted, concurrency, token budget, quota
    contention and too large all occur)."""
    rng = random.Random(0)
    pool = (240.0, 2**34, 8)
    ents = [
        ("copilot", "dev", "p", "elastic", 500.0, 75.0, 2**30, 3),
        ("synth", "data", "p", "spot", 30_000.0, 40.0, 2**30, 2),
        ("gold", "g", "p", "guaranteed", 200.0, 100.0, 2**30, 4),
    ]
    rc = AdmissionController([Quota("p", *pool)], [Entitlement(*e) for e in ents])
    py = admission.AdmissionController(
        pool[2], pool[0], [admission.Entitlement(e[0], *e[3:]) for e in ents]
    )
    held, seen, now = [], set(), 0.0
    for _ in range(10_000):
        now += rng.choice([0.0, 0.01, 0.3, 2.0, 20.0]) * rng.random()
        if held and rng.random() < 0.45:
            rc_ticket, py_ticket = held.pop(rng.randrange(len(held)))
            usage = (rng.randrange(1, 3000), rng.randrange(1, 3000), rng.random() * 5)
            rc.complete(rc_ticket, *usage, now=now)
            py.complete(py_ticket, *usage, now)
            continue
        args = (rng.choice(ents)[0], rng.randrange(1, 5000), rng.choice([None, 10, 500, 4000]))
        a, (status, reason, retry, ticket) = rc.admit(*args, now=now), py.admit(*args, now)
        assert (a.status, a.reason) == (status, reason)
        assert a.retry_after_s == (retry if retry is None else pytest.approx(retry, rel=1e-9))
        if a.admitted:
            held.append((a.ticket, ticket))
        seen.add(reason)
    assert len(seen) == 5, seen


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
