"""``Dispatcher.acquire`` + the lease's release (route, admit, pick; then give
back all three) from Python: the steps in Rust (``DispatchSteps``, one call
each way), the same steps in Python over the same Rust parts (the Dispatcher
before issue 30's binding), and a plain-Python twin over the plain-Python
router, admission controller and picker, same run.

Run: .venv/bin/python -m pytest benches/bench_dispatch.py
"""

import itertools
import random

import pytest

from routecore import Dispatcher, EndpointPicker, InMemoryAdmission, Pool, TokenBudgetRouter
from routecore._baselines import budget, dispatch, pick
from routecore._baselines.cases import ADMISSION_QUOTAS, ENTITLEMENTS, admission_twin

GROUP = "dispatcher: acquire + release"
POOLS = (("short", 8192), ("long", 65536))
ENDPOINTS = 8


def queue_kv_ties_first() -> list:
    """The ``queue+kv`` preset breaking ties to the first endpoint, as the twin."""
    plugins = EndpointPicker(["x"], preset="queue+kv").plugins
    for p in plugins:
        if p["name"] == "max-score":
            p.pop("seed", None)
            p["ties"] = "first"
    return plugins


def routecore_dispatcher(native: bool = True) -> Dispatcher:
    router = TokenBudgetRouter([Pool(name, ctx) for name, ctx in POOLS])
    pickers = {
        name: EndpointPicker(
            [f"{name}-{i}" for i in range(ENDPOINTS)], plugins=queue_kv_ties_first()
        )
        for name, _ in POOLS
    }
    d = Dispatcher(router, pickers, InMemoryAdmission(ADMISSION_QUOTAS, ENTITLEMENTS))
    assert d._native is not None
    if not native:
        d._native = None  # the steps in Python, as before the binding
    return d


def twin() -> dispatch.Dispatcher:
    router = budget.TokenBudgetRouter([(name, ctx, ctx, None) for name, ctx in POOLS])
    pickers = [
        pick.EndpointPicker([f"{name}-{i}" for i in range(ENDPOINTS)], preset="queue+kv")
        for name, _ in POOLS
    ]
    return dispatch.Dispatcher(router, pickers, admission_twin())


def admission_state(d) -> list:
    """Each entitlement's admission state (in flight, window tokens, served
    rate, debt, burst, priority) of a routecore ``Dispatcher`` or the twin."""
    names = [e.name for e in ENTITLEMENTS]
    if isinstance(d, dispatch.Dispatcher):
        ents = [d.admission.ents[name] for name in names]
        return [
            x
            for e in ents
            for x in (len(e.in_flight), e.window_tokens, e.served_rate, e.debt, e.burst, e.priority)
        ]
    keys = ("in_flight", "window_tokens", "served_tokens_per_s", "debt", "burst", "priority")
    return [d.admission.controller.stats(name)[k] for name in names for k in keys]


def dispatch_beside_the_twin(outages: float = 0.0) -> int:
    """Random sizes (both pools), entitlements, held and released leases, and
    with probability ``outages`` a step that takes a pool's endpoints down or
    brings them back: the same pool, admission status and endpoint at every
    step, on both of routecore's paths, and the same admission state after
    every step. Returns how many requests were refused after admission."""
    rng = random.Random(0)
    runs = [routecore_dispatcher(True), routecore_dispatcher(False)]
    py = twin()
    held: list = []
    no_endpoint = 0

    def same_admission_state(k):
        for d in runs:
            assert admission_state(d) == pytest.approx(admission_state(py), rel=1e-12), k

    for k in range(3000):
        same_admission_state(k)  # after the step before
        now = k * 0.01
        if outages and rng.random() < outages:
            pool, healthy = rng.randrange(len(POOLS)), rng.random() < 0.5
            for i, endpoint in enumerate(py.pickers[pool].endpoints):
                py.pickers[pool].states[i]["healthy"] = healthy
                for d in runs:
                    d.pickers[POOLS[pool][0]].set_state(endpoint, healthy=healthy)
            continue
        if held and rng.random() < 0.45:
            leases, lease = held.pop(rng.randrange(len(held)))
            usage = (rng.randrange(1, 3000), rng.randrange(1, 300))
            for lease_rc in leases:
                lease_rc.release(*usage, now=now)
            py.release(lease, *usage, now)
            continue
        size = rng.choice([400, 4000, 40_000, 200_000])
        ent = rng.choice(["copilot", "synth"])
        got = []
        for d in runs:
            try:
                lease_rc = d.acquire(
                    prompt_bytes=size, max_output_tokens=256, entitlement=ent, now=now
                )
            except Exception as e:
                got.append((type(e).__name__, getattr(e, "step", None), getattr(e, "status", 0)))
                continue
            got.append(lease_rc)
        try:
            lease = py.acquire(size, "prose", 256, ent, now)
            want = (lease[0], lease[2])
        except dispatch.Refused as e:
            want = ("RequestRefused", e.step, e.status)
            no_endpoint += e.step == "endpoint"
        for g in got:
            have = g if isinstance(g, tuple) else ([p for p, _ in POOLS].index(g.pool), g.endpoint)
            assert have == want, k
        if not isinstance(got[0], tuple):
            held.append((got, lease))
    same_admission_state("end")
    return no_endpoint


def test_the_twin_dispatches_like_routecore():
    """Healthy endpoints: every request the twin admits reaches an endpoint."""
    assert dispatch_beside_the_twin() == 0


def test_the_twin_keeps_routecore_admission_state_after_refusals():
    """Requests refused after admission (their pool's endpoints down) give
    their ticket back learning nothing, in the twin as in routecore."""
    assert dispatch_beside_the_twin(outages=0.02) > 100


def acquire_release(acquire, release):
    """One acquire + release at an advancing explicit clock; returns the lease."""
    clock = itertools.count()

    def run():
        now = next(clock) * 1e-3
        lease = acquire(now)
        release(lease, now)
        return lease

    return run


def routecore_run(native: bool):
    """Acquire + release on a routecore Dispatcher (``native``: its Rust steps)."""
    d = routecore_dispatcher(native)

    def acquire(now):
        return d.acquire(prompt_bytes=400, max_output_tokens=64, entitlement="copilot", now=now)

    return acquire_release(acquire, lambda lease, now: lease.release(100, 64, now=now))


@pytest.mark.benchmark(group=GROUP)
def test_acquire_release_routecore_rust_steps(benchmark):
    assert benchmark(routecore_run(native=True)).released


@pytest.mark.benchmark(group=GROUP)
def test_acquire_release_routecore_python_steps(benchmark):
    assert benchmark(routecore_run(native=False)).released


@pytest.mark.benchmark(group=GROUP)
def test_acquire_release_plain_python(benchmark):
    d = twin()
    run = acquire_release(
        lambda now: d.acquire(400, "prose", 64, "copilot", now),
        lambda lease, now: d.release(lease, 100, 64, now),
    )
    assert benchmark(run) is not None
