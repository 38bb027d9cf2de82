"""The flow-control queue from Python (``routecore._core.FlowQueue``, the Rust
discipline; the properties themselves are tested in rust/flow/tests.rs):
the binding's answers, its errors, and the plain-Python twin of the benches
giving the same order on random traffic."""

import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import NotInFlightError
from routecore._baselines import flow as twin
from routecore._core import FlowQueue

BANDS = [("guaranteed", 1000), ("elastic", 100), ("spot", 1)]
CONFIG = {
    "bands": [{"name": n, "share": s} for n, s in BANDS],
    "max_requests": 100_000,
    "ttl_s": 1e9,
}


def test_the_docstring_example_runs():
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(FlowQueue, globs={"FlowQueue": FlowQueue}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    assert runner.summarize(verbose=False).attempted >= 2


def test_outcomes_counts_and_errors():
    q = FlowQueue(
        {
            "bands": [{"name": "hi", "max_requests": 1}, {"name": "lo"}],
            "classes": {"guaranteed": "hi"},
            "max_requests": 2,
            "ttl_s": 5,
        }
    )
    assert (q.bands, q.band_of("guaranteed"), q.band_of("spot"), q.band_of()) == (
        ["hi", "lo"],
        "hi",
        "lo",
        "lo",
    )
    t1, status, retry, displaced = q.enqueue("lo", "a", "r1", bytes=10, now=0.0)
    assert (status, retry, displaced) == ("accepted", None, [])
    t2 = q.enqueue("lo", "b", "r2", bytes=20, now=1.0)[0]
    # A full pool: hi displaces lo's newest request, which comes back.
    t3, status, _, displaced = q.enqueue("hi", "c", "r3", now=2.0)
    assert status == "accepted"
    assert displaced == [(t2, "lo", "displaced", "r2", 1.0)]
    # hi is full (1 request): refused with the TTL as Retry-After (no
    # dispatch seen yet).
    assert q.enqueue("hi", "c", "r4", now=2.0) == (None, "band-full", 5.0, [])
    assert (len(q), q.bytes) == (2, 10)
    assert q.dispatch(now=3.0) == (t3, "hi", "dispatched", "r3", 1.0)
    assert q.next_expiry() == 5.0
    assert q.expire(now=6.0) == [(t1, "lo", "expired", "r1", 6.0)]
    assert q.dispatch(now=6.0) is None
    assert q.stats("lo") == {
        "requests": 0,
        "bytes": 0,
        "flows": 0,
        "accepted": 2,
        "refused": 0,
        "dispatched": 0,
        "expired": 1,
        "displaced": 1,
        "cancelled": 0,
        "drained": 0,
    }
    t5 = q.enqueue("lo", "a", "r5", now=7.0)[0]
    assert q.cancel(t5, now=8.0) == (t5, "lo", "cancelled", "r5", 1.0)
    with pytest.raises(NotInFlightError):
        q.cancel(t5)
    t6 = q.enqueue("lo", "a", "r6", now=9.0)[0]
    assert t6 != t5, "a reused slot has a new ticket"
    assert q.drain(now=9.5) == [(t6, "lo", "drained", "r6", 0.5)]
    assert len(q) == 0 and q.stats("lo")["drained"] == 1


def test_bad_input_raises_and_changes_nothing():
    q = FlowQueue(CONFIG)
    q.enqueue("spot", "a", "kept", now=0.0)
    for kwargs in (
        {"band": "gold"},
        {"flow": ""},
        {"flow": "x" * 257},
        {"bytes": -1},
        {"cost": 0.0},
        {"weight": float("nan")},
        {"deadline": float("inf")},
        {"now": float("nan")},
    ):
        args = {"band": "spot", "flow": "a", "item": "new", **kwargs}
        with pytest.raises(KeyError if "band" in kwargs else ValueError):
            q.enqueue(**args)
    assert len(q) == 1 and q.stats("spot")["accepted"] == 1
    for config, says in (
        ({"bands": [{"name": "a"}], "max_requests": 0}, "flow.max_requests must be >= 1"),
        ({"bands": [{"name": "a", "ttl_s": 0}]}, r"flow.bands\[0\].ttl_s"),
        (
            {"bands": [{"name": "a"}], "classes": {"spot": "b"}},
            'flow.classes.spot: unknown band "b"',
        ),
        ({"bands": [{"name": "a"}], "default_band": "b"}, "flow.default_band"),
        ({"bands": [{"name": "a", "fairness": "lottery"}]}, "lottery"),
        ({"bands": [{"name": "a"}], "ttl": 3}, "unknown field `ttl`"),
        ({"bands": [{"name": "a"}], "max_bytes": {1}}, "JSON-serializable"),
    ):
        with pytest.raises(ValueError, match=says):
            FlowQueue(config)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["enqueue", "enqueue", "dispatch", "cancel"]),
            st.integers(0, 2),  # band
            st.integers(0, 4),  # flow
            st.sampled_from([1.0, 3.0, 150.0, 700.0, 2500.0]),  # cost
            st.integers(0, 10**6),  # which waiting request to cancel
        ),
        max_size=300,
    )
)
def test_the_twin_gives_routecores_order(ops):
    """Random enqueues (costs small and far above the shares), dispatches and
    cancels: the plain-Python twin sends the same requests in the same order
    as routecore's queue."""
    rc, py = FlowQueue(CONFIG), twin.FlowQueue(BANDS)
    waiting = []  # (routecore ticket, twin ticket)
    for n, (op, band, flow, cost, pick) in enumerate(ops):
        if op == "enqueue":
            name, f = BANDS[band][0], f"t{flow}"
            t = rc.enqueue(name, f, n, cost=cost, now=float(n))[0]
            waiting.append((t, py.enqueue(name, f, n, cost=cost, now=float(n))))
        elif op == "dispatch":
            a, b = rc.dispatch(now=float(n)), py.dispatch(now=float(n))
            assert (a is None) == (b is None)
            if a is not None:
                assert a[1:] == b[1:]
                waiting.remove((a[0], b[0]))
        elif waiting:
            t, u = waiting.pop(pick % len(waiting))
            assert rc.cancel(t, now=float(n))[1:] == py.cancel(u, now=float(n))[1:]
        assert len(rc) == len(py) == len(waiting)
