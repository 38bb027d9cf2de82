"""VTC (vtc-basic) routing: routecore beside the plain-Python version, same run.

Run: .venv/bin/python -m pytest benches/bench_vtc.py
"""

import itertools
import random

import pytest

from routecore import VtcRouter
from routecore._baselines import vtc as baseline
from routecore._baselines.cases import ENDPOINTS, USERS, vtc_route_next, vtc_warmed


@pytest.mark.benchmark(group="VtcRouter.route: 16 endpoints, 1,000 active users")
def test_route_routecore(benchmark):
    assert benchmark(vtc_route_next(vtc_warmed(VtcRouter))) in ENDPOINTS


@pytest.mark.benchmark(group="VtcRouter.route: 16 endpoints, 1,000 active users")
def test_route_plain_python(benchmark):
    assert benchmark(vtc_route_next(vtc_warmed(baseline.VtcRouter))) in ENDPOINTS


def test_the_baseline_decides_like_routecore():
    rc, py = VtcRouter(ENDPOINTS[:4]), baseline.VtcRouter(ENDPOINTS[:4])
    for k in range(300):
        args = (USERS[k % 7 if k % 3 else 0], 100 * (k % 5), 40 * (k % 4))
        assert rc.route(*args, now=float(k)) == py.route(*args, now=float(k))


def test_the_baseline_decides_like_routecore_on_random_traffic():
    """Users come and go, time jumps across buckets and whole windows, and the
    table is bounded: the cached twin decides like routecore throughout."""
    rng = random.Random(5)
    rc = VtcRouter(ENDPOINTS[:6], max_users=20)
    py = baseline.VtcRouter(ENDPOINTS[:6], max_users=20)
    now = 0.0
    for k in range(5000):
        now += rng.choice([0.0] * 30 + [0.5, 7.0, 31.0, 400.0]) * rng.random()
        # The active users drift, so heavy ones go quiet and are forgotten.
        u = (k // 200 + rng.randrange(25)) % 40
        tokens = rng.choice([0, 10, 500, 4000]) * (1 + u % 7)
        args = (f"u{u}", tokens, rng.randrange(3) * 300)
        assert rc.route(*args, now=now) == py.route(*args, now=now)


def test_the_baseline_decides_like_routecore_on_the_bench_input():
    rc, py = vtc_route_next(vtc_warmed(VtcRouter)), vtc_route_next(vtc_warmed(baseline.VtcRouter))
    assert [rc() for _ in range(3 * len(USERS))] == [py() for _ in range(3 * len(USERS))]


FULL = 100_000  # VtcRouter's default max_users


def full_table(router_cls):
    """A router whose `FULL` users (the default max_users) are all active."""
    r = router_cls(ENDPOINTS, max_users=FULL)
    old = [f"old-{i}" for i in range(FULL)]
    if router_cls is VtcRouter:
        r.route_many(old, [100] * FULL, [50] * FULL, now=1.0)
    else:
        for user in old:
            r.route(user, 100, 50, now=1.0)
    return r


def route_new_users(r):
    fresh = (f"new-{i}" for i in itertools.count())
    return lambda: r.route(next(fresh), 500, 200, now=2.0)


@pytest.mark.benchmark(group="VtcRouter.route: a new user into a full table of 100,000")
def test_new_user_into_full_table_routecore(benchmark):
    r = full_table(VtcRouter)
    assert benchmark(route_new_users(r)) in ENDPOINTS
    assert r.users == FULL


@pytest.mark.benchmark(group="VtcRouter.route: a new user into a full table of 100,000")
def test_new_user_into_full_table_plain_python(benchmark):
    r = full_table(baseline.VtcRouter)
    assert benchmark.pedantic(route_new_users(r), rounds=5) in ENDPOINTS
    assert len(r.users) == FULL


@pytest.mark.benchmark(group="VtcRouter.route_many: 100,000 new users into a full table")
def test_route_many_new_users_into_full_table_routecore(benchmark):
    users = [f"new-{i}" for i in range(FULL)]

    def setup():
        return (full_table(VtcRouter),), {}

    def run(r):
        r.route_many(users, [500] * FULL, [200] * FULL, now=2.0)
        assert r.users == FULL and r.user_tokens("old-0", 2.0) == 0.0

    benchmark.pedantic(run, setup=setup, rounds=3)


def test_the_baseline_forgets_like_routecore():
    rc, py = VtcRouter(ENDPOINTS[:4], max_users=5), baseline.VtcRouter(ENDPOINTS[:4], max_users=5)
    for k in range(300):
        args = (f"u{(k * 7) % 11}", 100 + k % 3, 10)
        assert rc.route(*args, now=float(k)) == py.route(*args, now=float(k))
