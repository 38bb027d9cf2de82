"""Flow control in process (issue 32): ``Dispatcher.acquire(..., wait=...)``
waits in the dispatcher's ``FlowQueue`` (the Rust discipline) when admission
refuses with 429, gets its lease when a release dispatches it, or is refused
by the queue after its time; an interrupted waiter leaves the queue and
holds nothing."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import Dispatcher, Entitlement, InMemoryAdmission, Quota, RequestRefused
from routecore._core import FlowQueue

TENANTS = ("t0", "t1", "t2")
#: Round robin across the tenants of one band: the order depends on the
#: arrivals only (no weight, no cost).
FLOW = {"bands": [{"name": "elastic", "fairness": "round-robin"}]}


def dispatcher(flow=FLOW) -> Dispatcher:
    """One slot: ``holder`` (guaranteed) takes it; the elastic tenants are then
    refused for quota contention (429) until it is released."""
    ents = [Entitlement("holder", "holder", "q", "guaranteed", 100.0, 1e9, 2**40, 1)]
    ents += [Entitlement(t, t, "q", "elastic", 1000.0, 1e9, 2**40, 4) for t in TENANTS]
    return Dispatcher(admission=InMemoryAdmission([Quota("q", 1e9, 2**40, 1)], ents), flow=flow)


def take(d: Dispatcher, who: str, **kw):
    return d.acquire(input_tokens=10, max_output_tokens=10, entitlement=who, **kw)


def in_flight(d: Dispatcher) -> int:
    assert d.admission is not None
    return d.admission.quota_in_flight("q")


def until(condition, timeout: float = 10.0) -> None:
    """Waits for ``condition()`` (a thread reaching a state)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_waiter_gets_the_lease_when_the_holder_releases():
    d = dispatcher()
    holder = take(d, "holder")
    with pytest.raises(RequestRefused) as refused:
        take(d, "t0")  # without wait: refused at once, as before
    assert (refused.value.step, refused.value.status) == ("admission", 429)
    got = []
    waiter = threading.Thread(target=lambda: got.append(take(d, "t0", wait=10.0)))
    waiter.start()
    until(lambda: len(d.queue) == 1)
    assert got == [] and in_flight(d) == 1
    holder.release()
    waiter.join(10)
    (lease,) = got
    assert lease.admission is not None and lease.admission.admitted
    assert len(d.queue) == 0 and in_flight(d) == 1
    lease.release()
    assert in_flight(d) == 0


def test_a_waiter_is_refused_by_the_queue_after_its_wait_and_holds_nothing():
    d = dispatcher()
    holder = take(d, "holder")
    start = time.monotonic()
    with pytest.raises(RequestRefused) as refused:
        take(d, "t1", wait=0.2)
    assert time.monotonic() - start >= 0.2
    r = refused.value
    assert (r.step, r.status, r.reason) == ("queue", 429, "expired")
    assert r.retry_after_s is not None and r.retry_after_s > 0
    assert len(d.queue) == 0 and in_flight(d) == 1
    assert d.queue.stats("elastic")["cancelled"] == 1
    holder.release()
    assert in_flight(d) == 0


def test_the_band_ttl_ends_a_longer_wait():
    d = dispatcher({"bands": [{"name": "elastic", "ttl_s": 0.1}]})
    holder = take(d, "holder")
    with pytest.raises(RequestRefused) as refused:
        take(d, "t2", wait=30.0)
    assert refused.value.reason == "expired"
    assert d.queue.stats("elastic")["expired"] == 1
    holder.release()


def test_refusals_that_no_capacity_lifts_are_not_queued():
    d = dispatcher()
    take(d, "holder")
    with pytest.raises(RequestRefused) as refused:
        take(d, "nobody", wait=5.0)
    assert refused.value.status == 401 and len(d.queue) == 0


@pytest.mark.parametrize("wait", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_waits_are_refused_before_anything_is_taken(wait):
    d = dispatcher()
    with pytest.raises(ValueError, match="wait must be"):
        take(d, "t0", wait=wait)
    assert in_flight(d) == 0


def test_wait_with_an_explicit_clock_is_refused():
    d = dispatcher()
    with pytest.raises(ValueError, match="wait needs now=None"):
        take(d, "t0", wait=1.0, now=5.0)


def test_an_interrupted_waiter_leaves_the_queue_and_holds_nothing(monkeypatch):
    d = dispatcher()
    holder = take(d, "holder")

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(d._turns, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        take(d, "t0", wait=10.0)
    assert len(d.queue) == 0 and d.queue.stats("elastic")["cancelled"] == 1
    assert in_flight(d) == 1
    holder.release()
    assert in_flight(d) == 0


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(TENANTS), min_size=1, max_size=6))
def test_waiters_are_served_in_the_pure_queues_dispatch_order(arrivals):
    """Many threads waiting at once get their leases in the order the same
    arrivals get from a plain FlowQueue (one waiter is the one-element case)."""
    d = dispatcher()
    holder = take(d, "holder")
    served: list[int] = []
    lock = threading.Lock()

    def wait_and_release(k: int, tenant: str) -> None:
        lease = take(d, tenant, wait=30.0)
        with lock:
            served.append(k)
        lease.release()

    threads = []
    for k, tenant in enumerate(arrivals):
        t = threading.Thread(target=wait_and_release, args=(k, tenant))
        t.start()
        threads.append(t)
        until(lambda k=k: len(d.queue) == k + 1)
    holder.release()
    for t in threads:
        t.join(30)
    pure = FlowQueue(FLOW)
    for k, tenant in enumerate(arrivals):
        pure.enqueue("elastic", tenant, k, now=0.0)
    expected = [pure.dispatch(now=1.0)[3] for _ in arrivals]
    assert served == expected
    assert in_flight(d) == 0 and len(d.queue) == 0


def test_acquire_async_waits_without_blocking_the_loop_and_a_cancel_leaves_the_queue():
    async def scenario():
        d = dispatcher()
        holder = take(d, "holder")
        waiting = asyncio.create_task(
            d.acquire_async(input_tokens=10, max_output_tokens=10, entitlement="t0", wait=10.0)
        )
        cancelled = asyncio.create_task(
            d.acquire_async(input_tokens=10, max_output_tokens=10, entitlement="t1", wait=10.0)
        )
        while len(d.queue) < 2:
            await asyncio.sleep(0.005)  # the loop runs while both wait
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert len(d.queue) == 1 and d.queue.stats("elastic")["cancelled"] == 1
        holder.release()  # the waiter gets the slot
        lease = await asyncio.wait_for(waiting, 10)
        assert lease.admission is not None and lease.admission.admitted
        assert in_flight(d) == 1
        lease.release()
        assert in_flight(d) == 0 and len(d.queue) == 0

    asyncio.run(scenario())
