"""VTC (vtc-basic) routing: routecore beside the plain-Python version, same run.

Run: .venv/bin/python -m pytest benches/bench_vtc.py
"""

import itertools
from collections import deque

import pytest

from benches.baselines import vtc as baseline
from routecore import VtcRouter

ENDPOINTS = [f"endpoint-{i}" for i in range(16)]
USERS = [f"user-{i}" for i in range(1000)]


def warmed(router_cls):
    """A router with 1,000 users active in the window."""
    r = router_cls(ENDPOINTS)
    for k, u in enumerate(USERS):
        r.route(u, 100 + k, 50, now=1.0)
    return r


def route_next(r):
    users = itertools.cycle(USERS)
    return lambda: r.route(next(users), 500, 200, now=2.0)


@pytest.mark.benchmark(group="VtcRouter.route: 16 endpoints, 1,000 active users")
def test_route_routecore(benchmark):
    assert benchmark(route_next(warmed(VtcRouter))) in ENDPOINTS


@pytest.mark.benchmark(group="VtcRouter.route: 16 endpoints, 1,000 active users")
def test_route_plain_python(benchmark):
    assert benchmark(route_next(warmed(baseline.VtcRouter))) in ENDPOINTS


def test_the_baseline_decides_like_routecore():
    rc, py = VtcRouter(ENDPOINTS[:4]), baseline.VtcRouter(ENDPOINTS[:4])
    for k in range(300):
        args = (USERS[k % 7 if k % 3 else 0], 100 * (k % 5), 40 * (k % 4))
        assert rc.route(*args, now=float(k)) == py.route(*args, now=float(k))


FULL = 100_000  # VtcRouter's default max_users


def full_table(router_cls):
    """A router whose `FULL` users (the default max_users) are all active."""
    r = router_cls(ENDPOINTS, max_users=FULL)
    if router_cls is VtcRouter:
        n = FULL
        r.route_many([f"old-{i}" for i in range(n)], [100] * n, [50] * n, now=1.0)
    else:  # filled directly: routing 100,000 users one by one takes hours
        r.users = {f"old-{i}": deque([[0, 200.0]]) for i in range(FULL)}
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
