"""Flow control: one enqueue + one dispatch per request, with nothing else
waiting and with 10,000 requests waiting, routecore's queue (Rust from
Python) beside its plain-Python twin (deques and dicts, the same discipline:
WDRR across three bands with the paper's class weights, round robin across
100 flows, FCFS inside a flow; ``routecore._baselines.flow``), same run.

Run: .venv/bin/python -m pytest benches/bench_flow.py
The Rust-only figure: cargo test --release --lib -- --ignored --nocapture flow_timing
"""

import random

import pytest

from routecore._baselines import flow as twin
from routecore._core import FlowQueue

BANDS = [("guaranteed", 1000), ("elastic", 100), ("spot", 1)]
CONFIG = {
    "bands": [{"name": n, "share": s} for n, s in BANDS],
    "max_requests": 20_000,
    "ttl_s": 1e9,
}
WAITING = 10_000


def workload(n, seed=0):
    """``n`` requests: (band, flow, cost in tokens), 30% guaranteed, 50%
    elastic, 20% spot, 100 tenants."""
    rng = random.Random(seed)
    bands = rng.choices([b for b, _ in BANDS], weights=[3, 5, 2], k=n)
    return [(b, f"tenant-{rng.randrange(100)}", float(rng.randrange(100, 4000))) for b in bands]


REQUESTS = workload(50_000)


def pair(enqueue, dispatch, waiting):
    """Prefills ``waiting`` requests; the bench's call enqueues one more and
    dispatches one, cycling through the workload."""
    for k in range(waiting):
        band, flow, cost = REQUESTS[k]
        enqueue(band, flow, k, cost=cost, now=0.0)
    k = waiting

    def run():
        nonlocal k
        band, flow, cost = REQUESTS[k % len(REQUESTS)]
        enqueue(band, flow, k, cost=cost, now=0.0)
        k += 1
        return dispatch(now=0.0)

    return run


def test_the_twin_dispatches_like_routecore():
    """The bench's own traffic, 10,000 waiting then 20,000 enqueue + dispatch
    pairs, then the backlog drained by dispatches: the same requests leave
    from the same bands in the same order."""
    rc, py = FlowQueue(CONFIG), twin.FlowQueue(BANDS)
    a, b = pair(rc.enqueue, rc.dispatch, WAITING), pair(py.enqueue, py.dispatch, WAITING)
    for _ in range(20_000):
        x, y = a(), b()
        assert x[1:] == y[1:]
    while len(rc):
        assert rc.dispatch(now=0.0)[1:] == py.dispatch(now=0.0)[1:]
    assert len(py) == 0


@pytest.mark.parametrize("waiting", [0, WAITING])
@pytest.mark.benchmark(group="flow: enqueue + dispatch")
def test_routecore(benchmark, waiting):
    q = FlowQueue(CONFIG)
    assert benchmark(pair(q.enqueue, q.dispatch, waiting)) is not None
    assert len(q) == waiting


@pytest.mark.parametrize("waiting", [0, WAITING])
@pytest.mark.benchmark(group="flow: enqueue + dispatch")
def test_plain_python(benchmark, waiting):
    q = twin.FlowQueue(BANDS)
    assert benchmark(pair(q.enqueue, q.dispatch, waiting)) is not None
    assert len(q) == waiting
