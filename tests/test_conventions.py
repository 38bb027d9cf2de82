"""The API conventions every class follows (README "API conventions"): ``now``
optional, defaulting to ``routecore.monotonic``; ending a request that is not
in flight raises ``NotInFlightError`` (a ValueError) and changes nothing."""

from __future__ import annotations

import time

import pytest

from routecore import (
    AdmissionController,
    EndpointPicker,
    Entitlement,
    InMemoryAdmission,
    NotInFlightError,
    Pool,
    PrefixCacheRouter,
    PrefixIndex,
    Quota,
    TokenBudgetRouter,
    VtcRouter,
    block_hashes,
    monotonic,
)

QUOTA = Quota("p", 1e6, 2**40, 4)
ENT = Entitlement("e", "t", "p", "guaranteed", 100.0, 1e6, 2**30, 4)


def test_monotonic_moves_forward_from_a_fixed_epoch():
    a = monotonic()
    time.sleep(0.01)
    b = monotonic()
    assert 0.0 <= a < b and b - a >= 0.009


def test_vtc_without_now_has_a_moving_window():
    r = VtcRouter(["p0", "p1"], window_s=0.5)  # buckets of 50 ms
    r.route("alice", 100, 0)
    assert r.user_tokens("alice") == 100.0
    time.sleep(0.6)
    assert r.user_tokens("alice") == 0.0  # forgetting `now` no longer freezes it
    assert r.users == 0


def test_vtc_explicit_now_earlier_than_the_default_counts_as_the_latest():
    r = VtcRouter(["p0"], window_s=0.5)
    r.route("alice", 100, 0)  # at monotonic()
    time.sleep(0.6)
    # now=0.0 is long before monotonic(): it counts as the latest time seen,
    # so the charge is still in the window there.
    assert r.user_tokens("alice", now=0.0) == 100.0
    assert r.user_tokens("alice") == 0.0


def test_prefix_index_ttl_runs_on_the_default_clock():
    ix = PrefixIndex(100, ttl_s=0.3)
    h = block_hashes(b"abcdefgh", 4)
    ix.record(h, "a")
    assert ix.match_prefix(h) == {"a": 2}
    time.sleep(0.4)
    assert ix.match_prefix(h) == {}


def test_prefix_router_and_picker_take_the_default_clock():
    r = PrefixCacheRouter(["a", "b"], block_size=4)
    assert r.route(b"abcdefgh")[0] == "a"
    assert r.route(b"abcdefgh", running=[0, 0]) == ("a", 1.0)
    p = EndpointPicker(["a", "b"], preset="least-request")
    assert p.pick() == "a"
    p.completed("a")


def test_admission_without_now_reads_monotonic():
    ctl = AdmissionController([QUOTA], [ENT])
    before = monotonic()
    a = ctl.admit("e", 10)  # max_tokens defaults to the output bound
    assert a.admitted and ctl.stats("e")["window_tokens"] == 10 + 4096
    ctl.complete(a.ticket, 10, 5, 0.1)
    assert ctl.evictions() == []
    ids = ctl.admit_many([ctl.entitlement_id("e")], [1])[1]
    ctl.complete(int(ids[0]), 1, 1, 0.0)
    # A later explicit now on the same clock continues the same timeline.
    assert ctl.admit("e", 1, 1, now=monotonic()).admitted
    assert monotonic() >= before


def test_in_memory_admission_defaults_to_the_same_clock():
    backend = InMemoryAdmission([QUOTA], [ENT])
    assert backend.clock is monotonic


def _budget_router():
    r = TokenBudgetRouter([Pool("short", 8192)])
    return r, lambda: r.complete("short"), lambda: r.in_flight("short")


def _prefix_router():
    r = PrefixCacheRouter(["a"], block_size=4)
    return r, lambda: r.complete("a"), lambda: r.to_bytes()


def _vtc_router():
    r = VtcRouter(["a"])
    return r, lambda: r.complete("a", "u", 1, 1, 1, 1, now=1.0), lambda: r.to_bytes()


def _picker():
    p = EndpointPicker(["a"], preset="least-request")
    return p, lambda: p.completed("a", now=1.0), lambda: p.to_bytes()


def _controller():
    c = AdmissionController([QUOTA], [ENT])
    return c, lambda: c.complete(7, 1, 1, 0.1, now=1.0), lambda: c.to_bytes()


def _in_memory():
    b = InMemoryAdmission([QUOTA], [ENT])
    return b, lambda: b.complete(7, 1, 1, 0.1, now=1.0), lambda: b.controller.to_bytes()


@pytest.mark.parametrize(
    "make",
    [_budget_router, _prefix_router, _vtc_router, _picker, _controller, _in_memory],
    ids=[
        "TokenBudgetRouter",
        "PrefixCacheRouter",
        "VtcRouter",
        "EndpointPicker",
        "AdmissionController",
        "InMemoryAdmission",
    ],
)
def test_completing_what_is_not_in_flight_raises_not_in_flight_and_changes_nothing(make):
    _, complete, state = make()
    before = state()
    with pytest.raises(NotInFlightError, match="not in flight|no request in flight"):
        complete()
    assert state() == before
    assert issubclass(NotInFlightError, ValueError)


def test_a_double_complete_raises_after_the_first_succeeds():
    r = TokenBudgetRouter([Pool("short", 8192)])
    r.complete(r.route(100, "prose", 10).index)
    with pytest.raises(NotInFlightError):
        r.complete("short")
    c = AdmissionController([QUOTA], [ENT])
    t = c.admit("e", 1, 1, now=0.0).ticket
    c.complete(t, 1, 1, 0.1, now=1.0)
    with pytest.raises(NotInFlightError):
        c.complete(t, 1, 1, 0.1, now=1.0)
