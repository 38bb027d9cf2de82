"""Admission backends under faults, against a real redis-server on 127.0.0.1
(tests/conftest.py starts, freezes, kills and restarts it): every Redis
failure goes through ``failure_mode`` and never raises, a reply lost in a
stalled Redis leaks no reservation, construction needs no Redis, and both
backends may be called from many threads at once."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from routecore import Entitlement, InMemoryAdmission, NotInFlightError, Quota, RedisAdmission
from routecore.admission import FAILURE_KINDS

QUOTAS = [Quota("p", 1e6, 2**40, 8)]
ENTS = [
    Entitlement("one", "t1", "p", "guaranteed", 100.0, 1e6, 2**30, 1),
    Entitlement("s", "t2", "p", "spot", 100.0, 1e6, 2**30, 8),
]
LEASE_S = 300.0  # every "released" below happens long before a lease would expire


STALL_TIMEOUT_S = 0.5  # the socket timeout of backends that meet a stalled Redis


def _backend(url: str, mode: str, socket_timeout_s: float = 2.0) -> RedisAdmission:
    return RedisAdmission(
        QUOTAS,
        ENTS,
        url=url,
        failure_mode=mode,
        socket_timeout_s=socket_timeout_s,
        unavailable_retry_s=2.0,
        lease_s=LEASE_S,
    )


def _assert_failed_as(a, mode: str) -> None:
    """The decision ``failure_mode`` prescribes, and no Redis detail in it."""
    if mode == "open":
        assert (a.admitted, a.status, a.reason, a.ticket) == (True, 200, "fail-open", None)
    else:
        assert (a.admitted, a.status, a.reason, a.retry_after_s, a.ticket) == (
            False,
            503,
            "admission-unavailable",
            2.0,
            None,
        )


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _oom(probe: redis.Redis) -> None:
    probe.config_set("maxmemory-policy", "noeviction")
    probe.config_set("maxmemory", "1")


def _oom_off(probe: redis.Redis) -> None:
    probe.config_set("maxmemory", "0")


def _readonly(probe: redis.Redis) -> None:
    # A replica of a master that does not exist refuses every write (READONLY).
    probe.config_set("replica-read-only", "yes")
    probe.replicaof("127.0.0.1", "1")


def _readonly_off(probe: redis.Redis) -> None:
    probe.replicaof("NO", "ONE")


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_error_replies_go_through_failure_mode_and_never_raise(redis_server, mode):
    red = _backend(redis_server.url, mode)
    probe = redis.Redis.from_url(redis_server.url)
    held = red.admit("s", 10, 10, now=1.0)
    assert held.admitted and held.ticket is not None

    _readonly(probe)
    a = red.admit("s", 10, 10, now=2.0)
    _assert_failed_as(a, mode)
    assert red.complete(held.ticket, 10, 10, 1.0, now=2.0) is False
    assert red.evictions(now=2.0) == []  # reads still work: nothing to evict
    assert red.failures["reply"] >= 2 and red.failures["connection"] == 0
    assert red.pending() == 2  # the refused admit's id, the failed completion

    _readonly_off(probe)
    # The next call settles both: the completion counts (once), the refused
    # admit reserved nothing; then its own request is accounted.
    b = red.admit("s", 10, 10, now=3.0)
    assert b.admitted and b.ticket is not None and red.pending() == 0
    assert red.quota_in_flight("p") == 1
    with pytest.raises(NotInFlightError):  # the replay counted it: never twice
        red.complete(held.ticket, 10, 10, 1.0, now=3.0)
    assert red.quota_in_flight("p") == 1
    assert red.complete(b.ticket, 10, 10, 1.0, now=3.0) is True
    assert red.quota_in_flight("p") == 0
    red.close()


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_full_redis_refuses_admits_whole_and_still_releases(redis_server, mode):
    red = _backend(redis_server.url, mode)
    probe = redis.Redis.from_url(redis_server.url)
    held = red.admit("s", 10, 10, now=1.0)
    assert held.admitted and held.ticket is not None

    _oom(probe)
    a = red.admit("s", 10, 10, now=2.0)
    _assert_failed_as(a, mode)
    assert red.failures == {"connection": 0, "timeout": 0, "reply": 0, "oom": 1}
    assert red.pending() == 0  # refused at its start: it never ran, nothing to void
    # A release runs although Redis is full (its script may free, never grow).
    assert red.complete(held.ticket, 10, 10, 1.0, now=2.0) is True
    assert red.quota_in_flight("p") == 0
    assert red.evictions(now=2.0) == []

    _oom_off(probe)
    b = red.admit("s", 10, 10, now=3.0)
    assert b.admitted and b.ticket is not None and red.pending() == 0
    assert red.quota_in_flight("p") == 1
    assert red.complete(b.ticket, 10, 10, 1.0, now=3.0) is True
    red.close()


def test_error_reply_detail_is_logged_not_returned(redis_server, caplog):
    red = _backend(redis_server.url, "closed")
    probe = redis.Redis.from_url(redis_server.url)
    red.admit("s", 1, 1, now=1.0)
    _oom(probe)
    with caplog.at_level("DEBUG", logger="routecore.admission"):
        a = red.admit("s", 1, 1, now=2.0)
        red.admit("s", 1, 1, now=2.5)
    assert a.reason == "admission-unavailable" and "memory" not in repr(a)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "OutOfMemoryError" in warnings[0]  # once per outage
    _oom_off(probe)
    caplog.clear()
    with caplog.at_level("WARNING", logger="routecore.admission"):
        assert red.admit("s", 1, 1, now=3.0).admitted
    assert [r.getMessage() for r in caplog.records] == [
        "redis admission: Redis takes writes again (1 more failures logged at debug)"
    ]


def test_busy_redis_goes_through_failure_mode(redis_server):
    red = _backend(redis_server.url, "closed")
    probe = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    held = red.admit("s", 10, 10, now=1.0)
    probe.config_set("busy-reply-threshold", "10")  # ms before others get BUSY

    def block() -> None:
        with pytest.raises(redis.ResponseError):  # ends when killed below
            redis.Redis.from_url(redis_server.url).eval("while true do end", 0)

    blocker = threading.Thread(target=block)
    blocker.start()
    try:
        assert _wait_for(lambda: _busy(probe))
        _assert_failed_as(red.admit("s", 10, 10, now=2.0), "closed")
        assert red.complete(held.ticket, 10, 10, 1.0, now=2.0) is False
        assert red.evictions(now=2.0) == []
        assert red.failures["reply"] >= 3 and red.failures["timeout"] == 0
    finally:
        while blocker.is_alive() and _busy(probe):
            _kill_script(probe)
        blocker.join(timeout=10)
    assert red.admit("s", 10, 10, now=3.0).admitted and red.pending() == 0
    assert red.quota_in_flight("p") == 1  # the held ticket was released by its replay


def _busy(probe: redis.Redis) -> bool:
    try:
        probe.ping()
    except redis.ResponseError as e:
        return str(e).startswith("BUSY")
    return False


def _kill_script(probe: redis.Redis) -> None:
    try:
        probe.script_kill()
    except redis.ResponseError:  # not running (yet, or any more)
        time.sleep(0.01)


def test_flushed_script_cache_is_reloaded(redis_server):
    red = _backend(redis_server.url, "closed")
    assert red.admit("s", 10, 10, now=1.0).admitted
    redis.Redis.from_url(redis_server.url).script_flush()  # NOSCRIPT on the next EVALSHA
    a = red.admit("s", 10, 10, now=2.0)
    assert a.admitted and red.complete(a.ticket, 10, 10, 1.0, now=2.0)
    assert sum(red.failures.values()) == 0


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_killed_redis_goes_through_failure_mode_for_every_call(redis_server, mode):
    red = _backend(redis_server.url, mode)
    held = red.admit("s", 10, 10, now=1.0)
    assert held.admitted
    redis_server.kill()
    _assert_failed_as(red.admit("s", 10, 10, now=2.0), mode)
    assert red.complete(held.ticket, 10, 10, 1.0, now=2.0) is False
    assert red.evictions(now=2.0) == []
    assert red.failures["connection"] == 3 and set(red.failures) == set(FAILURE_KINDS)
    assert red.reconcile(now=2.0) is False  # still down

    redis_server.start()  # back, empty
    assert red.reconcile(now=3.0) is True and red.pending() == 0
    a = red.admit("s", 10, 10, now=3.0)
    assert a.admitted and a.ticket is not None and red.quota_in_flight("p") == 1
    assert red.complete(a.ticket, 10, 10, 1.0, now=3.0) is True
    assert red.quota_in_flight("p") == 0


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_stalled_redis_leaves_no_phantom_reservation(redis_server, mode):
    red = _backend(redis_server.url, mode, STALL_TIMEOUT_S)
    probe = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    first = red.admit("one", 10, 10, now=1.0)  # writes the configuration
    assert red.complete(first.ticket, 10, 10, 0.1, now=1.0)

    redis_server.stop()
    try:
        started = time.monotonic()
        a = red.admit("one", 10, 10, now=2.0)
        assert time.monotonic() - started < 3 * STALL_TIMEOUT_S  # one timeout, no retries
    finally:
        redis_server.cont()
    _assert_failed_as(a, mode)
    assert red.failures["timeout"] == 1
    # Thawed, Redis runs the script the client gave up on: the phantom reservation.
    assert _wait_for(lambda: int(probe.hget("routecore:{p}:quota", "in_flight") or 0) == 1)

    # The next call voids it first: the concurrency-1 tenant gets in at once.
    b = red.admit("one", 10, 10, now=3.0)
    assert b.admitted, b
    assert red.quota_in_flight("p") == 1
    assert red.complete(b.ticket, 10, 10, 0.1, now=3.0) is True
    assert red.quota_in_flight("p") == 0 and red.pending() == 0


def test_stalled_redis_holds_one_caller_at_a_time(redis_server):
    """Once a call timed out, concurrent calls do not all wait out a timeout
    each: one asks Redis, the others answer by failure_mode at once."""
    red = _backend(redis_server.url, "open", STALL_TIMEOUT_S)
    assert red.admit("s", 1, 1, now=1.0).admitted
    redis_server.stop()
    try:
        assert red.admit("s", 1, 1, now=2.0).reason == "fail-open"  # the first timeout

        def timed(k: int) -> float:
            started = time.monotonic()
            assert red.admit("s", 1, 1, now=3.0).reason == "fail-open"
            return time.monotonic() - started

        with ThreadPoolExecutor(16) as quota:
            waits = list(quota.map(timed, range(16)))
    finally:
        redis_server.cont()
    slow = [w for w in waits if w >= STALL_TIMEOUT_S / 2]
    assert 1 <= len(slow) <= 4, waits  # the probe (a late thread may probe again)
    # Thawed: the next call asks Redis and is accounted.
    a = red.admit("s", 1, 1, now=4.0)
    assert a.ticket is not None and red.quota_in_flight("p") == 2


def test_stalled_redis_completion_counts_once(redis_server):
    red = _backend(redis_server.url, "closed", STALL_TIMEOUT_S)
    a = red.admit("one", 10, 10, now=1.0)
    redis_server.stop()
    try:
        assert red.complete(a.ticket, 10, 10, 0.1, now=2.0) is False
    finally:
        redis_server.cont()
    assert red.pending() == 1
    b = red.admit("one", 10, 10, now=3.0)  # the replay (or the late script) freed the slot
    assert b.admitted and red.quota_in_flight("p") == 1 and red.pending() == 0
    assert red.complete(b.ticket, 10, 10, 0.1, now=3.0) is True
    assert red.quota_in_flight("p") == 0


def test_void_before_the_late_script_refuses_it(redis_server):
    """The other order of a stall: the void reaches Redis before the admit it
    voids (white-box: the script is sent by hand with the lost request id)."""
    red = _backend(redis_server.url, "closed")
    assert red.admit("one", 1, 1, now=1.0).admitted  # configured, the slot taken
    red._voids["p"].append("lost-1")
    assert red.reconcile(now=2.0) is True
    late = red._admit_script(keys=["routecore:{p}"], args=["s", 10, "1.5", "lost-1"])
    assert late == [b"void"] and red.quota_in_flight("p") == 1
    # A client retry of a request that did reserve gets the same reservation.
    args = ["s", 10, "2.5", "sent-twice"]
    once = red._admit_script(keys=["routecore:{p}"], args=args)
    assert red._admit_script(keys=["routecore:{p}"], args=args) == once
    assert red.quota_in_flight("p") == 2


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_threads_across_a_stall_leave_nothing_reserved(redis_server, mode):
    """Calls from several threads while Redis freezes for a while: once it
    thaws and the backend has reconciled, nothing is left reserved."""
    red = _backend(redis_server.url, mode, STALL_TIMEOUT_S)
    probe = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    assert red.admit("s", 1, 1).admitted  # configured; held across the stall
    done = threading.Event()

    def client(seed: int) -> int:
        rng = random.Random(seed)
        calls = 0
        while not done.is_set() and calls < 500:
            calls += 1
            a = red.admit("s", 10, 10)
            time.sleep(rng.uniform(0.0, 0.01))
            if a.ticket is not None:  # admitted and accounted
                red.complete(a.ticket, 10, 10, 0.01)
        return calls

    with ThreadPoolExecutor(4) as quota:
        clients = [quota.submit(client, k) for k in range(4)]
        time.sleep(0.2)
        redis_server.stop()
        time.sleep(3 * STALL_TIMEOUT_S)
        redis_server.cont()
        time.sleep(0.2)
        done.set()
        assert all(c.result(timeout=30) > 0 for c in clients)
    assert red.failures["timeout"] > 0  # the stall was felt
    assert _wait_for(lambda: red.reconcile())
    key = "routecore:{p}"
    assert int(probe.hget(f"{key}:quota", "in_flight")) == 1  # only the one held
    assert probe.hlen(f"{key}:tickets") == 1 and probe.hlen(f"{key}:rid") == 2


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_construction_needs_no_redis(redis_server, mode):
    redis_server.kill()  # nothing listens on its port
    red = _backend(redis_server.url, mode)
    _assert_failed_as(red.admit("s", 10, 10, now=1.0), mode)
    assert red.evictions(now=1.0) == [] and red.failures["connection"] == 2
    redis_server.start()
    a = red.admit("s", 10, 10, now=2.0)
    assert a.admitted and a.ticket is not None and red.quota_in_flight("p") == 1
    assert red.complete(a.ticket, 10, 10, 1.0, now=2.0) is True
    assert red.quota_in_flight("p") == 0


HAMMER_QUOTAS = [Quota("shared", 1e6, 2**40, 4)]
HAMMER_ENTS = [
    Entitlement("g", "t", "shared", "guaranteed", 100.0, 1e6, 2**30, 2),
    Entitlement("s", "t", "shared", "spot", 100.0, 1e6, 2**30, 50),
]


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_threads_hammering_one_backend_never_over_admit(redis_server, backend):
    if backend == "memory":
        adm = InMemoryAdmission(HAMMER_QUOTAS, HAMMER_ENTS)
    else:
        adm = RedisAdmission(  # a generous timeout: the cores are shared with builds
            HAMMER_QUOTAS, HAMMER_ENTS, url=redis_server.url, prefix="threads", socket_timeout_s=5.0
        )
    lock = threading.Lock()
    seen = {"g": 0, "s": 0}
    worst = {"g": 0, "s": 0}
    target = 40

    def replica(seed: int) -> tuple[int, int]:
        rng = random.Random(seed)
        admitted = completed = 0
        deadline = time.monotonic() + 60
        for _ in range(1000 * target):  # bounded in count and in time
            if admitted == target or time.monotonic() > deadline:
                break
            name = rng.choice(["g", "s"])
            a = adm.admit(name, 10, 10)
            if not a.admitted:
                time.sleep(0.001)  # a refused client waits a little, as a real one would
                continue
            admitted += 1
            with lock:
                seen[name] += 1
                worst[name] = max(worst[name], seen[name])
            time.sleep(rng.uniform(0.0, 0.002))
            with lock:
                seen[name] -= 1
            completed += adm.complete(a.ticket, 10, 10, 0.002)
        return admitted, completed

    with ThreadPoolExecutor(8) as quota:
        results = list(quota.map(replica, range(8)))
    assert results == [(target, target)] * 8  # all admitted, every ticket released once
    assert worst["g"] <= 2  # guaranteed never above its concurrency
    assert worst["s"] <= 4  # spot (may burst) never above the quota
    assert adm.quota_in_flight("shared") == 0
    adm.close()
