"""VTC (vtc-basic) routing: routecore beside the plain-Python version, same run.

Run: .venv/bin/python -m pytest benches/bench_vtc.py
"""

import itertools

import pytest

from benches.baselines import vtc as baseline
from routecore import VtcRouter

PODS = [f"pod-{i}" for i in range(16)]
USERS = [f"user-{i}" for i in range(1000)]


def warmed(router_cls):
    """A router with 1,000 users active in the window."""
    r = router_cls(PODS)
    for k, u in enumerate(USERS):
        r.route(u, 100 + k, 50, now=1.0)
    return r


def route_next(r):
    users = itertools.cycle(USERS)
    return lambda: r.route(next(users), 500, 200, now=2.0)


@pytest.mark.benchmark(group="VtcRouter.route: 16 pods, 1,000 active users")
def test_route_routecore(benchmark):
    assert benchmark(route_next(warmed(VtcRouter))) in PODS


@pytest.mark.benchmark(group="VtcRouter.route: 16 pods, 1,000 active users")
def test_route_plain_python(benchmark):
    assert benchmark(route_next(warmed(baseline.VtcRouter))) in PODS


def test_the_baseline_decides_like_routecore():
    rc, py = VtcRouter(PODS[:4]), baseline.VtcRouter(PODS[:4])
    for k in range(300):
        args = (USERS[k % 7 if k % 3 else 0], 100 * (k % 5), 40 * (k % 4))
        assert rc.route(*args, now=float(k)) == py.route(*args, now=float(k))
