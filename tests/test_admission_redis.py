"""The Redis admission backend against a real redis-server on 127.0.0.1
(tests/conftest.py starts and stops it): the same decisions as the Rust
controller, lease expiry, processes hammering one quota, and a Redis crash."""

from __future__ import annotations

import multiprocessing
import random
import time

import pytest
import redis

from routecore import (
    Entitlement,
    InMemoryAdmission,
    NotInFlightError,
    Quota,
    RedisAdmission,
    admission_from_config,
)
from routecore.config import ConfigError, parse_config

QUOTAS = [Quota("p", 240.0, 2_000_000, 6, kv_bytes_per_token=1000)]
ENTS = [
    Entitlement("g", "t1", "p", "guaranteed", 1000.0, 10.0, 200_000, 2),
    Entitlement("fast", "t2", "p", "elastic", 500.0, 30.0, 300_000, 3),
    Entitlement("slow", "t3", "p", "elastic", 30_000.0, 30.0, 300_000, 3),
    Entitlement("s", "t4", "p", "spot", 1000.0, 1000.0, 10**9, 4),
    Entitlement("pre", "t5", "p", "preemptible", 1000.0, 1000.0, 10**9, 4, "pending"),
]


def _same(a, b):
    assert (a.admitted, a.status, a.reason, a.ticket is None) == (
        b.admitted,
        b.status,
        b.reason,
        b.ticket is None,
    )
    assert (a.retry_after_s is None) == (b.retry_after_s is None)
    if a.retry_after_s is not None:
        assert a.retry_after_s == pytest.approx(b.retry_after_s, rel=1e-9)
    assert a.priority == pytest.approx(b.priority, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_redis_decides_as_the_rust_controller(redis_server, seed):
    rng = random.Random(seed)
    mem = InMemoryAdmission(QUOTAS, ENTS, default_max_tokens=40, window_s=10.0)
    red = RedisAdmission(
        QUOTAS, ENTS, url=redis_server.url, prefix=f"eq{seed}", default_max_tokens=40, window_s=10.0
    )
    names = [e.name for e in ENTS] + ["nobody"]
    live: list[tuple[int, int, int]] = []  # memory ticket, redis ticket, tokens
    now = 0.0
    for _ in range(150):
        now += rng.choice([0.0, 0.5, 1.0, 2.5])
        op = rng.random()
        if op < 0.6:
            name, inp = rng.choice(names), rng.randint(0, 200)
            out = rng.choice([None, rng.randint(1, 200)])
            a, b = mem.admit(name, inp, out, now=now), red.admit(name, inp, out, now=now)
            _same(a, b)
            if a.admitted:
                live.append((a.ticket, b.ticket, inp + (out or 40)))
        elif op < 0.9 and live:
            ta, tb, tokens = live.pop(rng.randrange(len(live)))
            used, latency = rng.randint(0, tokens), rng.choice([0.2, 1.0, 4.0])
            if rng.random() < 0.25:  # never served (refused by a later step): nothing learned
                assert mem.release(ta, now=now)
                assert red.release(tb, now=now)
            else:
                assert mem.complete(ta, used, 0, latency, now=now)
                assert red.complete(tb, used, 0, latency, now=now)
        elif op < 0.95:
            name, state = rng.choice(names[:-1]), rng.choice(["bound", "bound", "degraded"])
            mem.set_state(name, state)
            red.set_state(name, state)
        else:
            slots = rng.randint(2, 8)
            mem.set_capacity("p", concurrency=slots)
            red.set_capacity("p", concurrency=slots)
        assert mem.quota_in_flight("p") == red.quota_in_flight("p")
        to_mem = {tb: ta for ta, tb, _ in live}
        assert [to_mem[t] for t in red.evictions(now=now)] == mem.evictions(now=now)
        for e in ENTS:
            assert red.priority(e.name) == pytest.approx(mem.priority(e.name))
    red.close()


def test_evictions_as_in_memory(redis_server):
    quotas = [Quota("p", 100.0, 2**30, 2)]
    ents = [
        Entitlement("g", "t", "p", "guaranteed", 100.0, 1e6, 2**20, 4),
        Entitlement("pre", "t", "p", "preemptible", 100.0, 1e6, 2**20, 4),
    ]
    red = RedisAdmission(quotas, ents, url=redis_server.url, prefix="evict")
    p1 = red.admit("pre", 10, 40, now=0.0).ticket
    p2 = red.admit("pre", 10, 40, now=1.0).ticket
    assert red.evictions(now=1.0) == []
    assert red.admit("g", 10, 40, now=2.0).admitted  # over capacity by one
    assert red.evictions(now=2.0) == [p2]  # the youngest preemptible
    assert red.complete(p2, 10, 5, 1.0, now=2.5)
    assert red.evictions(now=2.5) == [] and p1 is not None
    redis_server.kill()
    assert red.evictions(now=3.0) == []


def test_leaked_reservations_expire(redis_server):
    red = RedisAdmission(QUOTAS, ENTS, url=redis_server.url, lease_s=5.0)
    leaked = red.admit("s", 10, 10, now=100.0)
    assert leaked.admitted and red.quota_in_flight("p") == 1
    # The replica that held it died; 5 s later the next call on the quota frees it.
    assert red.admit("s", 10, 10, now=104.0).admitted and red.quota_in_flight("p") == 2
    fresh = red.admit("s", 10, 10, now=105.5)
    assert fresh.admitted and red.quota_in_flight("p") == 2
    with pytest.raises(NotInFlightError):  # its lease released it: never twice
        red.complete(leaked.ticket, 10, 10, 1.0, now=106.0)
    assert red.complete(fresh.ticket, 10, 10, 1.0, now=106.0) is True
    assert red.quota_in_flight("p") == 1
    red.close()


def _hammer(url: str, seed: int, target: int) -> tuple[int, int, int]:
    """One gateway replica: admit, hold briefly, complete, until ``target``
    requests were admitted (at most 50 attempts each, so it always stops);
    counts what it saw. How many attempts that takes depends on how the
    processes share the cores, so the test counts admissions, not attempts."""
    red = RedisAdmission(HAMMER_QUOTAS, HAMMER_ENTS, url=url, prefix="hammer")
    probe = redis.Redis.from_url(url)
    rng = random.Random(seed)
    admitted, worst_g, worst_s = 0, 0, 0
    for _ in range(50 * target):
        if admitted == target:
            break
        name = rng.choice(["g", "s"])
        a = red.admit(name, 10, 10)
        if not a.admitted:
            continue
        admitted += 1
        seen = probe.incr(f"seen:{name}")
        if name == "g":
            worst_g = max(worst_g, seen)
        else:
            worst_s = max(worst_s, seen)
        time.sleep(rng.uniform(0.0, 0.003))
        probe.decr(f"seen:{name}")
        assert red.complete(a.ticket, 10, 10, 0.002)
    return admitted, worst_g, worst_s


HAMMER_QUOTAS = [Quota("shared", 1e6, 2**40, 4)]
HAMMER_ENTS = [
    Entitlement("g", "t", "shared", "guaranteed", 100.0, 1e6, 2**30, 2),
    Entitlement("s", "t", "shared", "spot", 100.0, 1e6, 2**30, 50),
]


@pytest.mark.slow
def test_processes_hammering_one_quota_never_over_admit(redis_server):
    RedisAdmission(HAMMER_QUOTAS, HAMMER_ENTS, url=redis_server.url, prefix="hammer")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(6) as workers:
        results = workers.starmap(_hammer, [(redis_server.url, k, 60) for k in range(6)])
    assert [r[0] for r in results] == [60] * 6  # every replica got all its requests in
    # Guaranteed never above its concurrency; spot (may burst) never above the quota.
    assert max(r[1] for r in results) <= 2
    assert max(r[2] for r in results) <= 4
    assert max(r[2] for r in results) >= 2  # there was real contention
    red = RedisAdmission(HAMMER_QUOTAS, HAMMER_ENTS, url=redis_server.url, prefix="hammer")
    assert red.quota_in_flight("shared") == 0


def test_redis_crash_fail_open_or_closed_and_no_double_count(redis_server):
    kw = {"url": redis_server.url, "socket_timeout_s": 0.2, "unavailable_retry_s": 2.0}
    closed = RedisAdmission(QUOTAS, ENTS, failure_mode="closed", **kw)
    opened = RedisAdmission(QUOTAS, ENTS, failure_mode="open", **kw)
    before = [closed.admit("s", 10, 10, now=1.0), opened.admit("s", 10, 10, now=1.0)]
    assert all(a.admitted for a in before) and closed.quota_in_flight("p") == 2

    redis_server.kill()
    a = closed.admit("s", 10, 10, now=2.0)
    assert (a.admitted, a.status, a.reason, a.retry_after_s) == (
        False,
        503,
        "admission-unavailable",
        2.0,
    )
    b = opened.admit("s", 10, 10, now=2.0)
    assert (b.admitted, b.status, b.reason, b.ticket) == (True, 200, "fail-open", None)
    assert closed.complete(before[0].ticket, 10, 10, 1.0, now=2.0) is False  # deferred
    with pytest.raises(NotInFlightError):  # fail-open: admitted without a ticket
        opened.complete(b.ticket, 10, 10, 1.0, now=2.0)

    redis_server.start()  # back, empty: the configuration is written again on use
    after = closed.admit("s", 10, 10, now=3.0)
    assert after.admitted and after.ticket not in {t.ticket for t in before}
    assert opened.quota_in_flight("p") == 1
    # Tickets from before the crash match nothing: no double release.
    for old in before:
        with pytest.raises(NotInFlightError):
            opened.complete(old.ticket, 10, 10, 1.0, now=3.0)
    assert closed.quota_in_flight("p") == 1
    assert opened.complete(after.ticket, 10, 10, 1.0, now=3.0) is True
    assert closed.quota_in_flight("p") == 0


def test_redis_bad_input(redis_server):
    red = RedisAdmission(QUOTAS, ENTS, url=redis_server.url)
    for call in [
        lambda: red.admit("s", -1, 1),
        lambda: red.admit("s", 1, 0),
        lambda: red.admit("s", 1, 1, now=float("nan")),
        lambda: red.complete(1, 1, 1, -1.0),
        lambda: red.set_state("s", "gone"),
        lambda: red.set_capacity("p", concurrency=0),
        lambda: RedisAdmission(QUOTAS, ENTS, url=redis_server.url, failure_mode="maybe"),
        lambda: RedisAdmission(QUOTAS, ENTS, url=redis_server.url, lease_s=0.0),
    ]:
        with pytest.raises(ValueError):
            call()
    for call in [lambda: red.set_state("x", "bound"), lambda: red.set_capacity("q", 1.0)]:
        with pytest.raises(KeyError):
            call()
    assert red.admit("nobody", 1, 1).status == 401
    assert red.quota_in_flight("p") == 0


ADMISSION = {
    "backend": "redis",
    "quotas": [{"name": "p", "tokens_per_s": 100.0, "kv_bytes": 2**20, "concurrency": 2}],
    "entitlements": [
        {
            "name": "e",
            "tenant": "t",
            "quota": "p",
            "service_class": "spot",
            "slo_target_ms": 1000.0,
            "tokens_per_s": 10.0,
            "kv_bytes": 1,
            "concurrency": 1,
        }
    ],
}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("url", 5),
        ("url", "http://127.0.0.1:6379"),
        ("prefix", ""),
        ("prefix", 7),
        ("lease_s", "abc"),
        ("lease_s", 0),
        ("lease_s", float("nan")),
        ("failure_mode", "maybe"),
        ("unavailable_retry_s", -1.0),
        ("unavailable_retry_s", True),
        ("socket_timeout_s", float("nan")),
        ("socket_timeout_s", float("inf")),
        ("socket_timeout_s", [0.5]),
        ("max_window_entries", 0),
        ("max_window_entries", 2.5),
        ("max_window_entries_per_quota", (1 << 24) + 1),
        ("max_void_markers", -1),
        ("max_void_markers", "many"),
        ("flush_timeout_s", -0.5),
        ("flush_timeout_s", 3601),
    ],
)
def test_redis_config_values_are_checked_by_name(key, value):
    redis_section = {"url": "redis://127.0.0.1:1/0", key: value}
    raw = {"pools": [{"name": "gpu", "max_context": 8192}]}
    with pytest.raises(ConfigError, match=rf"^admission\.redis\.{key}: "):
        parse_config({**raw, "admission": {**ADMISSION, "redis": redis_section}})
    with pytest.raises(ValueError, match=rf"^{key} "):  # the Python API, same check
        admission_from_config({**ADMISSION, "redis": redis_section})


def test_redis_config_unknown_key_is_a_value_error():
    with pytest.raises(ValueError, match=r"^redis\.host: unknown key"):
        admission_from_config({**ADMISSION, "redis": {"host": "x"}})


def test_redis_config_accepts_good_values_without_contacting_redis():
    redis_section = {
        "url": "redis://127.0.0.1:1/0",  # nothing listens there
        "prefix": "rc",
        "lease_s": 30,
        "failure_mode": "open",
        "unavailable_retry_s": 0.5,
        "socket_timeout_s": 0.1,
        "max_window_entries": 64,
        "max_window_entries_per_quota": 256,
        "max_void_markers": 32,
        "flush_timeout_s": 0,
    }
    raw = {"pools": [{"name": "gpu", "max_context": 8192}]}
    config = parse_config({**raw, "admission": {**ADMISSION, "redis": redis_section}})
    assert config.admission.backend == "redis"
    backend = admission_from_config(config.admission.spec)
    assert isinstance(backend, RedisAdmission)
    assert backend.admit("e", 1, 1).reason == "fail-open"


def test_the_old_pool_keys_are_a_value_error_naming_the_new_ones():
    quotas = ADMISSION["quotas"]
    with pytest.raises(ValueError, match=r"^pools: renamed to 'quotas'"):
        admission_from_config({"backend": "memory", "pools": quotas})
    old = [{**ADMISSION["entitlements"][0], "pool": "p"}]
    with pytest.raises(ValueError, match=r"^entitlements\[0\]\.pool: renamed to 'quota'"):
        admission_from_config({"backend": "memory", "quotas": quotas, "entitlements": old})
