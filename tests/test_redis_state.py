"""Redis admission's own state (issue 22 items 5, 6 and the Redis part of 16),
against real redis-servers on 127.0.0.1 (started by the tests): a shutdown
leaves no reservation behind, the keys routecore writes stay within their
configured bounds, a Redis full to ``maxmemory`` still takes releases and
purges and recovers on its own, and an outage is one warning and a metric.
"""

from __future__ import annotations

import itertools
import json
import signal
import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import Spawned, base_config, redis_admission, tenants, wait_for
from test_load_faults import background, check, routed

from routecore import Entitlement, Quota, RedisAdmission
from routecore._core import admission_lua, load

_prefixes = itertools.count()


def _reservations(url: str) -> dict[str, int]:
    """What Redis holds for requests in flight, summed over the quotas: the
    in-flight counters and the tickets, leases and request ids behind them."""
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        out = {"in_flight": 0, "tickets": 0, "leases": 0, "rids": 0}
        for key in client.keys("*:quota"):
            quota = key.decode().removesuffix(":quota")
            out["in_flight"] += int(client.hget(key, "in_flight") or 0)
            out["tickets"] += client.hlen(f"{quota}:tickets")
            out["leases"] += client.zcard(f"{quota}:leases")
            out["rids"] += client.hlen(f"{quota}:rid")
        return out
    finally:
        client.close()


# -- item 5: bounded keys ------------------------------------------------------------

WINDOW_S = 2.0


def _window(client: redis.Redis, key: str, ent: str) -> tuple[int, int, int]:
    """An entitlement's window in Redis: entries, window_tokens, and the sum
    of the entries' charges."""
    ek = f"{key}:e:{ent}"
    charges = sum(int(v) for v in client.hvals(f"{ek}:wtok"))
    return client.zcard(f"{ek}:win"), int(client.hget(ek, "window_tokens")), charges


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bound=st.integers(1, 24),
    ops=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.2, 0.7]),  # time step
            st.integers(1, 500),  # tokens charged
            st.one_of(st.none(), st.integers(0, 800)),  # completed at once with this use
        ),
        min_size=1,
        max_size=120,
    ),
)
def test_window_entries_stay_within_their_bound_and_count_what_is_due(redis_server, bound, ops):
    """Past half its bound an entitlement's charges close in time share an
    entry: never more entries than the bound, every token charged counted
    while it is due (at most window_s / (bound - bound // 2) early)."""
    prefix = f"w{next(_prefixes)}"
    red = RedisAdmission(
        [Quota("p", 1e9, 2**40, 10**6)],
        [Entitlement("a", "t", "p", "guaranteed", 100.0, 1e9, 2**40, 10**6)],
        url=redis_server.url,
        prefix=prefix,
        window_s=WINDOW_S,
        max_window_entries=bound,
    )
    client = redis.Redis.from_url(redis_server.url)
    early = WINDOW_S / (bound - bound // 2)
    charged: list[tuple[float, int, int]] = []  # time, least and most it may count
    now = 1000.0
    try:
        for step, tokens, used in ops:
            now += step
            a = red.admit("a", tokens, 1, now=now)
            assert a.admitted, a
            est = tokens + 1
            if used is not None:  # its own entry counts the use, a shared one the estimate
                red.complete(a.ticket, used, 0, 0.01, now=now)
                charged.append((now, min(est, used), max(est, used)))
            else:
                charged.append((now, est, est))
            entries, window_tokens, charges = _window(client, f"{prefix}:{{p}}", "a")
            assert 1 <= entries <= bound
            assert window_tokens == charges
            due_surely = sum(lo for t, lo, _ in charged if t > now - WINDOW_S + early)
            due = sum(hi for t, _, hi in charged if t > now - WINDOW_S)
            assert due_surely <= window_tokens <= due
    finally:
        client.close()
        red.close()


@pytest.mark.parametrize(("per_quota", "most"), [(40, 10), (4096, 200)])
def test_a_quota_shares_its_window_entries(redis_server, per_quota, most):
    """Four entitlements, 200 charges each: each keeps at most its share of
    the quota's bound (40 / 4), or all 200 when that share is larger."""
    ents = [Entitlement(n, n, "p", "guaranteed", 100.0, 1e9, 2**40, 10**6) for n in "abcd"]
    red = RedisAdmission(
        [Quota("p", 1e9, 2**40, 10**6)],
        ents,
        url=redis_server.url,
        window_s=60.0,
        max_window_entries=1024,
        max_window_entries_per_quota=per_quota,
    )
    client = redis.Redis.from_url(redis_server.url)
    for i in range(200):
        for e in ents:
            assert red.admit(e.name, 10, 10, now=1000.0 + i * 0.01).admitted
    counts = [_window(client, "routecore:{p}", e.name) for e in ents]
    assert max(n for n, _, _ in counts) <= most
    assert all(tokens == charges == 200 * 20 for _, tokens, charges in counts)
    if most == 200:
        assert [n for n, _, _ in counts] == [200] * 4
    client.close()
    red.close()


def test_void_markers_stay_within_their_bound(redis_server):
    red = RedisAdmission(
        [Quota("p", 1e9, 2**40, 10**6)],
        [Entitlement("a", "t", "p", "guaranteed", 100.0, 1e9, 2**40, 10**6)],
        url=redis_server.url,
        max_void_markers=20,
    )
    assert red.admit("a", 1, 1, now=1000.0).admitted  # configures the quota
    client = redis.Redis.from_url(redis_server.url)
    void = client.register_script(admission_lua()["void"])
    ids = [f"lost-{i}" for i in range(50)]
    for i, rid in enumerate(ids):  # ids never reserved: refused in advance
        assert void(keys=["routecore:{p}"], args=[1000.0 + i, rid]) == 0
    kept = [m.decode() for m in client.zrange("routecore:{p}:void", 0, -1)]
    assert kept == ids[-20:]  # the oldest went first
    client.close()
    red.close()


# -- item 5: Redis full ----------------------------------------------------------------


def _fill_limit(client: redis.Redis, room: int) -> None:
    """Redis full ``room`` bytes above what it uses now (noeviction)."""
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", client.info("memory")["used_memory"] + room)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_filled_by_admission_state_recovers_by_itself(redis_server, mode):
    """Tenant ``a``'s load fills a small Redis (noeviction) with its window
    charges. Meanwhile releases still reach Redis; once the load stops,
    within the window (plus a sweep), tenant ``b``, never under load, is
    admitted again and its concurrency limit enforced: no operator."""
    window_s = 3.0
    quota = Quota("p", 1e9, 2**40, 10**6)
    ents = [
        Entitlement("a", "ta", "p", "guaranteed", 100.0, 1e9, 2**40, 10**6),
        Entitlement("b", "tb", "p", "guaranteed", 100.0, 1e9, 2**40, 2),
    ]
    red = RedisAdmission(
        [quota],
        ents,
        url=redis_server.url,
        failure_mode=mode,
        window_s=window_s,
        max_window_entries=1 << 20,
        max_window_entries_per_quota=1 << 20,
    )
    client = redis.Redis.from_url(redis_server.url)
    held = [red.admit("a", 10, 10) for _ in range(20)]
    assert all(a.ticket is not None for a in held)
    _fill_limit(client, 400_000)
    deadline = time.monotonic() + 60
    while not red.failures["oom"]:  # the load: admitted, completed, charged
        assert time.monotonic() < deadline, "Redis never filled up"
        a = red.admit("a", 10, 10)
        if a.ticket is not None:
            red.complete(a.ticket, 10, 10, 0.01)
    stopped = time.monotonic()
    assert red.failures["reply"] == red.failures["connection"] == 0
    # Full: releases still go through, so nothing stays held.
    assert all(red.complete(a.ticket, 10, 10, 0.01) for a in held)
    assert _reservations(redis_server.url)["in_flight"] == 0
    # Within the window and a sweep of the load's end, b is decided again.
    while not (b1 := red.admit("b", 10, 10)).ticket:
        assert time.monotonic() - stopped < window_s + 2, "never recovered"
        time.sleep(0.05)
    print(f"recovered {time.monotonic() - stopped:.2f} s after the load stopped")
    b2 = red.admit("b", 10, 10)
    b3 = red.admit("b", 10, 10)
    assert b2.ticket is not None
    assert (b3.admitted, b3.status, b3.reason) == (False, 429, "concurrency")
    assert red.complete(b1.ticket, 10, 10, 0.01) and red.complete(b2.ticket, 10, 10, 0.01)
    assert _reservations(redis_server.url)["in_flight"] == 0
    client.close()
    red.close()


# -- item 6: SIGTERM leaves no reservation in Redis ------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stall_s", [0.0, 1.0], ids=["redis-up", "redis-stalls-at-the-grace"])
def test_sigterm_with_streams_open_past_the_grace_leaves_no_reservation(
    tmp_path, redis_server, stall_s
):
    streams, grace = 50, 0.5
    config = base_config(
        admission=redis_admission(redis_server.url, "closed", concurrency=64),
        tenants=tenants(),
        server={"grace_s": grace},
    )
    server = Spawned(tmp_path / "serve.yaml", config)
    try:
        # Streams held 5 s each: still open when the grace runs out.
        run = background(
            server.target,
            requests=streams,
            concurrency=streams,
            response_delay_s=5.0,
            timeout_s=30.0,
        )
        wait_for(
            lambda: _reservations(redis_server.url)["in_flight"] == streams,
            20,
            f"{streams} reservations",
        )
        server.proc.send_signal(signal.SIGTERM)
        if stall_s:
            # Redis stops answering just before the grace ends, past the
            # socket timeout: the releases wait for it (flush_timeout_s).
            time.sleep(grace - 0.2)
            redis_server.stop()
            time.sleep(stall_s)
            redis_server.cont()
        assert server.proc.wait(timeout=grace + 15) == 0
        check(run.result(timeout=30), allowed={"UNAVAILABLE", "CANCELLED"})
        # Right after the exit, long before lease_s: nothing held in Redis.
        assert _reservations(redis_server.url) == dict.fromkeys(
            ("in_flight", "tickets", "leases", "rids"), 0
        )
    finally:
        log = server.stop()
    assert "Traceback" not in log


# -- item 16: an outage is one warning, a recovery line and a metric per failed call ---


def _events(log: str, event: str) -> list[dict]:
    lines = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return [e for e in lines if e.get("event") == event]


@pytest.mark.parametrize(
    ("fault", "kind", "down", "up"),
    [
        ("killed", "connection", "redis-unavailable", "redis-recovered"),
        ("full", "oom", "redis-full", "redis-writable"),
    ],
)
def test_a_redis_outage_is_one_warning_a_recovery_line_and_counted(
    tmp_path, redis_server, fault, kind, down, up
):
    server = Spawned(
        tmp_path / "serve.yaml",
        base_config(admission=redis_admission(redis_server.url, "closed"), tenants=tenants()),
    )
    try:
        assert routed(server.target)
        # Its release reaches Redis after the answer: before the fault, so
        # every failure counted below is a refused request's.
        wait_for(lambda: _reservations(redis_server.url)["in_flight"] == 0, 10, "the release")
        probe = redis.Redis.from_url(redis_server.url)
        if fault == "killed":
            redis_server.kill()
        else:
            probe.config_set("maxmemory-policy", "noeviction")
            probe.config_set("maxmemory", "1")
        report = check(load(server.target, requests=300, concurrency=8), {"OK"})
        refused = report["refusals"]["503"]
        assert refused == report["requests"] == 300
        # One count per failed call to Redis, of the fault's kind only.
        faults = {
            k: server.metric("routecore_faults_total", source="redis", kind=k)
            for k in ("connection", "timeout", "reply", "oom")
        }
        assert faults == {**dict.fromkeys(faults, 0.0), kind: float(refused)}
        if fault == "killed":
            redis_server.start()
        else:
            probe.config_set("maxmemory", "0")
        assert routed(server.target)
        # Every failure of the run until Redis answered again: the refused
        # requests', and any call that met the restarting Redis (a full
        # Redis is a run of its own; any other kind ends an outage's).
        run = ("oom",) if kind == "oom" else ("connection", "timeout", "reply")
        failed = sum(server.metric("routecore_faults_total", source="redis", kind=k) for k in run)
        assert failed >= refused
        probe.close()
    finally:
        log = server.stop()
    warned, ended = _events(log, down), _events(log, up)
    assert len(warned) == 1 and warned[0]["level"] == "warning", warned
    assert (warned[0]["kind"], warned[0]["failure_mode"], warned[0]["suppressed"]) == (
        kind,
        "closed",
        0,
    )
    # The recovery line counts what was not written: every other failure.
    assert len(ended) == 1 and ended[0]["suppressed"] == failed - 1, ended
    assert redis_server.url not in log


@pytest.mark.slow
def test_sigterm_while_redis_stalls_exits_within_the_flush_timeout(tmp_path, redis_server):
    """What cannot reach Redis at shutdown is waited for at most
    flush_timeout_s, then logged and left to lease_s: the exit is bounded."""
    grace, flush = 0.5, 1.5
    admission = redis_admission(redis_server.url, "closed", concurrency=64)
    admission["redis"]["flush_timeout_s"] = flush
    server = Spawned(
        tmp_path / "serve.yaml",
        base_config(admission=admission, tenants=tenants(), server={"grace_s": grace}),
    )
    try:
        run = background(
            server.target, requests=10, concurrency=10, response_delay_s=5.0, timeout_s=30.0
        )
        wait_for(lambda: _reservations(redis_server.url)["in_flight"] == 10, 20, "reservations")
        redis_server.stop()
        try:
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(timeout=grace + flush + 10) == 0
            took = time.monotonic() - sent
        finally:
            redis_server.cont()
        print(f"exited {took:.2f} s after SIGTERM (grace {grace} s, flush {flush} s)")
        assert flush <= took < grace + flush + 3
        check(run.result(timeout=30), allowed={"UNAVAILABLE", "CANCELLED"})
    finally:
        log = server.stop()
    assert len(_events(log, "admission-unsettled")) == 1


def test_close_gives_what_is_owed_its_flush_timeout(redis_server):
    red = RedisAdmission(
        [Quota("p", 1e9, 2**40, 10**6)],
        [Entitlement("a", "t", "p", "guaranteed", 100.0, 1e9, 2**40, 10**6)],
        url=redis_server.url,
        flush_timeout_s=0.5,
    )
    held = red.admit("a", 1, 1)
    probe = redis.Redis.from_url(redis_server.url)
    probe.replicaof("127.0.0.1", "1")  # READONLY: the completion is owed as a replay
    assert red.complete(held.ticket, 1, 1, 0.01) is False and red.pending() == 1
    probe.replicaof("NO", "ONE")
    red.close()  # settles it before closing
    assert red.pending() == 0 and _reservations(redis_server.url)["in_flight"] == 0
    # Redis gone: close waits no longer than its flush timeout.
    red = RedisAdmission(
        [Quota("p", 1e9, 2**40, 10**6)],
        [Entitlement("a", "t", "p", "guaranteed", 100.0, 1e9, 2**40, 10**6)],
        url=redis_server.url,
        flush_timeout_s=0.5,
        socket_timeout_s=0.2,
    )
    held = red.admit("a", 1, 1)
    redis_server.kill()
    assert red.complete(held.ticket, 1, 1, 0.01) is False
    start = time.monotonic()
    red.close()
    assert 0.5 <= time.monotonic() - start < 2.0 and red.pending() == 1
    probe.close()
