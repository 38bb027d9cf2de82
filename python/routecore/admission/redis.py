"""The shared admission backend: quota state in Redis, one atomic Lua script
per decision (see ``RedisAdmission``)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from routecore._core import (
    MAX_TOKENS,
    Admission,
    AdmissionController,
    Entitlement,
    NotInFlightError,
    Quota,
    admission_lua,
    admission_redis_config,
)
from routecore._extras import require
from routecore.admission.backend import FAILURE_KINDS, AdmissionBackend

MAX_QUOTAS = 256
FAILURE_MODES = ("open", "closed")
URL_SCHEMES = ("redis://", "rediss://", "unix://")
#: The keys of a configuration's ``redis`` mapping (``RedisAdmission`` keywords).
REDIS_OPTIONS = (
    "url",
    "prefix",
    "lease_s",
    "failure_mode",
    "unavailable_retry_s",
    "socket_timeout_s",
    "max_window_entries",
    "max_window_entries_per_quota",
    "max_void_markers",
    "flush_timeout_s",
)
#: Lost admits and failed completions a quota keeps to settle when Redis answers
#: again; beyond it the oldest are left to their leases.
MAX_PENDING = 10_000
#: How many of them one call settles before its own work.
RECONCILE_BATCH = 256
#: While Redis is full, how often an admit may sweep its quota (seconds).
SWEEP_EVERY_S = 0.1
#: The largest value of the ``max_*`` bounds (``Bounds`` in rust/serve/admission/scripts.rs).
MAX_BOUND = 1 << 24
_INF = float("inf")
# The logger the docs name (``routecore.admission``), whichever module logs.
_log = logging.getLogger("routecore.admission")


# One script per operation, the same text and constants as the data plane's
# Redis backend (rust/serve/admission/*.lua); the equivalence test in
# tests/test_admission_redis.py runs one request sequence through it and the
# Rust controller.
_LUA = admission_lua()
#: The latency that tells the complete script a request was never served
#: (``release``): its charge is given back, nothing learned (the data plane's
#: ``UNSERVED`` in rust/serve/admission/redis.rs).
UNSERVED = -1.0

_STATES = ("pending", "bound", "degraded", "expired")
_PROTECTED = ("dedicated", "guaranteed")  # never shrunk (Table 1)


def _count(what: str, value: int, low: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int")
    value = operator.index(value)  # ints and NumPy integers; TypeError for floats
    if not low <= value <= MAX_TOKENS:
        raise ValueError(f"{what} must be in [{low}, {MAX_TOKENS}], got {value}")
    return value


class RedisAdmission(AdmissionBackend):
    """The shared backend: quota state in Redis, one atomic Lua script per decision.

    ``client``: a ``redis.Redis`` (or give ``url``). Keys live under
    ``{prefix}:{<quota>}``, one hash slot per quota. ``lease_s``: a reservation not
    completed within this many seconds (its replica died mid-request) is
    released by the next call on its quota.

    Construction never contacts Redis: each quota's configuration is written on
    its first use (and again whenever Redis comes back empty), so a server
    starts while Redis is down. Every Redis failure (no connection, a timeout
    after ``socket_timeout_s``, an error reply such as OOM, NOSCRIPT, BUSY or
    READONLY) goes through ``failure_mode``: ``"closed"`` rejects with 503
    ``admission-unavailable`` (Retry-After ``unavailable_retry_s``), ``"open"``
    admits without a ticket, unaccounted. ``admit``, ``complete`` and
    ``evictions`` never raise for Redis; the detail is logged (logger
    ``routecore.admission``: the first failure of an outage as a warning, the
    rest at debug, and one warning with their count when it ends) and counted
    in ``failures`` by kind (``connection``, ``timeout``, ``reply``, ``oom``).
    After a timeout, while Redis may be stalled, one call at a time asks it and
    concurrent calls answer by ``failure_mode`` at once (not counted in
    ``failures``), so a stall holds one thread for ``socket_timeout_s``, not
    every caller's.

    Redis full (over ``maxmemory`` with ``noeviction``; Redis 7 or later):
    admits are refused whole (counted as ``oom``, with a warning of their own
    and one when Redis takes writes again) while completions and voids still
    run, so nothing held is stuck. An admit refused so first sweeps its quota
    (at most every ``SWEEP_EVERY_S``: expired leases, void markers and every
    entitlement's expired window charges) and tries once more, so a Redis
    filled by this state recovers by itself as it expires. What the scripts
    keep is bounded: ``max_window_entries`` window entries per entitlement and
    ``max_window_entries_per_quota`` for all a quota's entitlements together
    (an equal share each, at least one; past half its bound an entitlement's
    charges close in time share an entry, which may leave the window up to
    ``window_s / (bound - bound // 2)`` early), ``max_void_markers`` void
    markers per quota (the oldest dropped first); reservations by the
    concurrency limits. ``close`` first gives what failed calls left
    behind up to ``flush_timeout_s`` to reach Redis.

    ``now`` defaults to ``clock``, the wall clock (``time.time``), not
    ``routecore.monotonic``: the state is shared by processes, possibly on
    several hosts, whose monotonic clocks do not agree. ``complete`` on a
    ticket Redis no longer holds (completed already, lease expired, or issued
    before Redis lost its data) raises ``NotInFlightError``.

    No reservation whose reply was lost can leak: every admit carries a request
    id chosen here, so when the call fails (its script may still run in a
    stalled Redis) the id is voided as soon as Redis answers again, releasing
    the reservation or refusing it if the script has not run yet; a completion
    that failed is replayed then too (it counts once). Redis is asked again on
    the next call (or ``reconcile()``). If Redis comes back empty, tickets
    restart from the clock (ms * 1024), so no old ticket can match a new one.
    All methods may be called from several threads at once.
    """

    def __init__(
        self,
        quotas: Sequence[Quota],
        entitlements: Sequence[Entitlement],
        *,
        url: str | None = None,
        client: Any = None,
        prefix: str = "routecore",
        default_max_tokens: int = 4096,
        window_s: float = 60.0,
        lease_s: float = 300.0,
        failure_mode: str = "closed",
        unavailable_retry_s: float = 1.0,
        socket_timeout_s: float = 0.5,
        max_window_entries: int = 1024,
        max_window_entries_per_quota: int = 16384,
        max_void_markers: int = 1024,
        flush_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        (redis,) = require("redis", "redis")
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # The Rust controller checks the configuration exactly as in memory.
        AdmissionController(list(quotas), list(entitlements), default_max_tokens, window_s)
        if failure_mode not in FAILURE_MODES:
            raise ValueError(f"failure_mode must be 'open' or 'closed', got {failure_mode!r}")
        for what, value in (
            ("lease_s", lease_s),
            ("unavailable_retry_s", unavailable_retry_s),
            ("socket_timeout_s", socket_timeout_s),
        ):
            _positive(what, value)
        for what, value in (
            ("max_window_entries", max_window_entries),
            ("max_window_entries_per_quota", max_window_entries_per_quota),
            ("max_void_markers", max_void_markers),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BOUND:
                raise ValueError(f"{what} must be an integer in [1, {MAX_BOUND}], got {value!r}")
        if (
            isinstance(flush_timeout_s, bool)
            or not isinstance(flush_timeout_s, (int, float))
            or not 0 <= flush_timeout_s <= 3600
        ):
            raise ValueError(f"flush_timeout_s must be in [0, 3600], got {flush_timeout_s!r}")
        if url is not None and (not isinstance(url, str) or not url.startswith(URL_SCHEMES)):
            # Not echoed: a URL may hold a password.
            raise ValueError("url must be a redis://, rediss:// or unix:// URL")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
        if len(quotas) > MAX_QUOTAS:
            raise ValueError(f"at most {MAX_QUOTAS} quotas")
        if client is None:
            # No retries inside the client: one call waits at most one timeout,
            # and what a lost reply leaves behind is voided (see the class doc).
            client = redis.Redis.from_url(
                url or "redis://127.0.0.1:6379/0",
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        self.client = client
        self.failure_mode = failure_mode
        self.unavailable_retry_s = float(unavailable_retry_s)
        self.default_max_tokens = default_max_tokens
        self.clock = clock
        #: Redis failures since construction, by kind; read it for a metric.
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_KINDS, 0)
        self._redis_errors = (redis.exceptions.RedisError, OSError)
        self._timeout = redis.exceptions.TimeoutError
        self._connection = (redis.exceptions.ConnectionError, OSError)
        self._oom = redis.exceptions.OutOfMemoryError
        self._lock = threading.Lock()
        # Per fault under way ("unreachable", "full"): the failures not logged
        # as a warning since it began; absent when none is under way.
        self._quiet: dict[str, int] = {}
        self._swept: dict[str, float] = {}
        self._flush_timeout_s = float(flush_timeout_s)
        # After a timeout Redis may be stalled: then one call at a time asks it
        # (holding _probe), the others answer by failure_mode at once.
        self._stalled = False
        self._probe = threading.Lock()
        self._configured: set[str] = set()
        # Per quota: request ids of admits whose reply was lost, and completions
        # that failed, to settle when Redis answers again (oldest first).
        self._voids: dict[str, deque[str]] = {p.name: deque() for p in quotas}
        self._replays: dict[str, deque[tuple[int, int, str, str]]] = {
            p.name: deque() for p in quotas
        }
        self._rid_prefix = f"r{secrets.token_hex(8)}:"
        self._rids = itertools.count()
        self._quotas = [p.name for p in quotas]
        self._quota_of = {e.name: e.quota for e in entitlements}
        self._class_of = {e.name: e.service_class for e in entitlements}
        self._keys = {p.name: f"{prefix}:{{{p.name}}}" for p in quotas}
        self._config = admission_redis_config(
            list(quotas),
            list(entitlements),
            window_s,
            lease_s,
            max_window_entries,
            max_window_entries_per_quota,
            max_void_markers,
        )
        self._configure_script = client.register_script(_LUA["configure"])
        self._admit_script = client.register_script(_LUA["admit"])
        self._complete_script = client.register_script(_LUA["complete"])
        self._void_script = client.register_script(_LUA["void"])
        self._set_state_script = client.register_script(_LUA["set_state"])
        self._sweep_script = client.register_script(_LUA["sweep"])

    def _configure(self, quota: str) -> None:
        seq_base = int(time.time() * 1000) * 1024
        self._configure_script(keys=[self._keys[quota]], args=[self._config[quota], seq_base])
        self._configured.add(quota)

    def _ready(self, quota: str, now: float) -> bool:
        """Before a call on ``quota``: settle what failed calls left behind, then
        write this instance's configuration once. Raises the Redis error; see
        ``_settle`` for the result."""
        settled = self._settle(quota, now, RECONCILE_BATCH)
        if quota not in self._configured:
            self._configure(quota)
        return settled

    def _settle(self, quota: str, now: float, limit: int) -> bool:
        """Voids up to ``limit`` lost admits and replays up to ``limit`` failed
        completions of ``quota``; what Redis did not take is kept for later.
        True when all were settled; an error reply is logged and counted
        (False), a connection error or timeout raises: Redis is not there."""
        with self._lock:
            voids = _take(self._voids[quota], limit)
            replays = _take(self._replays[quota], limit)
        if not voids and not replays:
            return True
        key = self._keys[quota]
        try:
            if voids:
                self._void_script(keys=[key], args=[repr(now), *voids])
                voids = []
            if replays:
                pipe = self.client.pipeline(transaction=False)
                for seq, actual, latency, at in replays:
                    self._complete_script(
                        keys=[key], args=[str(seq), actual, latency, at], client=pipe
                    )
                pipe.execute()
        except self._redis_errors as e:
            with self._lock:
                _keep(self._voids[quota], voids, front=True)
                _keep(self._replays[quota], replays, front=True)
            if self._kind(e) in ("connection", "timeout"):
                raise
            self._failed("reconcile", e)
            return False
        return True

    def reconcile(self, now: float | None = None) -> bool:
        """Settles everything failed calls left behind (voids lost admits,
        replays failed completions) on every quota; True when nothing is left.
        The next call on a quota does this too, a batch at a time; a server may
        call this periodically. Never raises for Redis."""
        at = self._now(now)
        try:
            for quota in self._quotas:
                while (self._voids[quota] or self._replays[quota]) and self._settle(
                    quota, at, RECONCILE_BATCH
                ):
                    pass
        except self._redis_errors as e:
            self._failed("reconcile", e)
            return False
        if self.pending():
            return False
        self._succeeded()
        return True

    def pending(self) -> int:
        """Lost admits and failed completions not yet settled in Redis."""
        with self._lock:
            return sum(map(len, self._voids.values())) + sum(map(len, self._replays.values()))

    def _kind(self, error: BaseException) -> str:
        if isinstance(error, self._oom):
            return "oom"
        if isinstance(error, self._timeout):
            return "timeout"
        if isinstance(error, self._connection):
            return "connection"
        return "reply"

    def _failed(self, call: str, error: BaseException) -> None:
        kind = self._kind(error)
        # Redis full is a fault of its own: releases still reach Redis meanwhile,
        # which ends an outage but not that.
        fault = "full" if kind == "oom" else "unreachable"
        with self._lock:
            self.failures[kind] += 1
            quiet = self._quiet.get(fault)
            self._quiet[fault] = 0 if quiet is None else quiet + 1
            if kind == "timeout":
                self._stalled = True
        # The first failure of an outage is a warning, the rest debug: an outage
        # under load must not flood the log.
        _log.log(
            logging.WARNING if quiet is None else logging.DEBUG,
            "redis admission: %s failed (%s: %s: %s); failing %s",
            call,
            kind,
            type(error).__name__,
            error,
            self.failure_mode,
        )

    def _ended(self, fault: str, message: str) -> None:
        """``fault`` is over: one warning with the count of failures logged at debug."""
        with self._lock:
            quiet = self._quiet.pop(fault, None)
        if quiet is not None:
            _log.warning("redis admission: %s (%d more failures logged at debug)", message, quiet)

    def _succeeded(self, settled: bool = True) -> None:
        """Redis answered; ``settled``: and nothing failed calls left is stuck."""
        self._stalled = False
        if settled:
            self._ended("unreachable", "Redis answers again")

    def _may_sweep(self, quota: str) -> bool:
        """Whether an admit refused because Redis is full may sweep ``quota`` now
        (at most every ``SWEEP_EVERY_S``); marks it swept."""
        at = time.monotonic()
        with self._lock:
            if at - self._swept.get(quota, -_INF) < SWEEP_EVERY_S:
                return False
            self._swept[quota] = at
        return True

    def _run_admit(self, quota: str, args: list[Any], now: float) -> Any:
        """The admit script; refused because Redis is full (so it did not run),
        the quota is swept and it is tried once more. Raises the Redis error."""
        key = self._keys[quota]
        try:
            return self._admit_script(keys=[key], args=args)
        except self._oom:
            if not self._may_sweep(quota):
                raise
        self._sweep_script(keys=[key], args=[repr(now)])
        return self._admit_script(keys=[key], args=args)

    @contextlib.contextmanager
    def _turn(self) -> Iterator[bool]:
        """Whether this call may ask Redis. While it may be stalled (its last
        call timed out), one call at a time asks; the others get False at once,
        so a stall holds one caller's thread for a timeout, not every caller's."""
        if not self._stalled:
            yield True
        elif self._probe.acquire(blocking=False):
            try:
                yield True
            finally:
                self._probe.release()
        else:
            yield False

    def _unavailable(self) -> Admission:
        if self.failure_mode == "open":
            return Admission(True, 200, "fail-open")
        return Admission(False, 503, "admission-unavailable", self.unavailable_retry_s)

    def _admit(
        self, entitlement: str, input_tokens: int, max_tokens: int | None, now: float
    ) -> Admission:
        tokens = _count("input_tokens", input_tokens, 0) + (
            self.default_max_tokens if max_tokens is None else _count("max_tokens", max_tokens, 1)
        )
        if now != now or now in (float("inf"), float("-inf")):
            raise ValueError(f"now must be a finite number, got {now}")
        quota = self._quota_of.get(entitlement)
        if quota is None:
            return Admission(False, 401, "unknown-entitlement")
        with self._turn() as mine:
            return self._decide(quota, entitlement, tokens, now) if mine else self._unavailable()

    def _decide(self, quota: str, entitlement: str, tokens: int, now: float) -> Admission:
        try:
            settled = self._ready(quota, now)
        except self._redis_errors as e:
            self._failed("admit", e)
            return self._unavailable()
        rid = f"{self._rid_prefix}{next(self._rids):x}"
        args = [entitlement, tokens, repr(now), rid]
        try:
            out = self._run_admit(quota, args, now)
            if out[0] == b"unconfigured":
                self._configure(quota)
                out = self._run_admit(quota, args, now)
            status, reason, retry, seq, priority = (x.decode() for x in out)
            decision = Admission(
                status == "200",
                int(status),
                reason,
                float(retry) if retry else None,
                int(seq) * MAX_QUOTAS + self._quotas.index(quota) if seq else None,
                float(priority),
            )
        except self._oom as e:  # refused at its start: it never ran, nothing to void
            self._failed("admit", e)
            return self._unavailable()
        except (*self._redis_errors, ValueError) as e:
            # The script may have run (or may yet run, in a stalled Redis) with
            # nobody to complete its ticket: void the id when Redis answers.
            with self._lock:
                _keep(self._voids[quota], [rid])
            self._failed("admit", e)
            return self._unavailable()
        self._succeeded(settled)
        self._ended("full", "Redis takes writes again")
        return decision

    def _complete(
        self, ticket: int, actual_input: int, actual_output: int, latency_s: float, now: float
    ) -> bool:
        actual = _count("actual_input", actual_input, 0) + _count("actual_output", actual_output, 0)
        if not latency_s >= 0 or latency_s == float("inf"):
            raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s}")
        return self._finish("complete", ticket, actual, float(latency_s), now)

    def _release(self, ticket: int, now: float) -> bool:
        return self._finish("release", ticket, 0, UNSERVED, now)

    def _finish(self, call: str, ticket: int, actual: int, latency_s: float, now: float) -> bool:
        """The complete script for ``ticket`` (``latency_s`` ``UNSERVED``: a
        release), or its replay kept while Redis is unreachable."""
        seq, index = divmod(ticket, MAX_QUOTAS)
        if index >= len(self._quotas):
            raise NotInFlightError(f"{call}: ticket {ticket} is not in flight")
        quota = self._quotas[index]
        args = (seq, actual, repr(latency_s), repr(now))
        with self._turn() as mine:
            if mine:
                try:
                    settled = self._settle(quota, now, RECONCILE_BATCH)
                    done = self._complete_script(
                        keys=[self._keys[quota]], args=[str(seq), *args[1:]]
                    )
                except self._redis_errors as e:
                    self._failed(call, e)
                else:
                    self._succeeded(settled)
                    if not done:  # completed already, or its lease expired
                        raise NotInFlightError(f"{call}: ticket {ticket} is not in flight")
                    return True
        with self._lock:  # replayed when Redis answers; a replay counts once
            _keep(self._replays[quota], [args])
        return False

    def _evictions(self, now: float) -> list[int]:
        """Read in one transaction per quota; [] while Redis is unreachable."""
        with self._turn() as mine:
            return self._victims(now) if mine else []

    def _victims(self, now: float) -> list[int]:
        out: list[int] = []
        settled = True
        for index, quota in enumerate(self._quotas):
            key = self._keys[quota]
            ents = [e for e, p in self._quota_of.items() if p == quota]
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(f"{key}:quota", "in_flight", "concurrency")
            for e in ents:
                pipe.zrange(f"{key}:e:{e}:fl", 0, -1, withscores=True)
                pipe.hget(f"{key}:e:{e}", "priority")
            try:
                settled &= self._settle(quota, now, RECONCILE_BATCH)
                (in_flight, concurrency), *rest = pipe.execute()
                over = int(in_flight or 0) - int(float(concurrency or 0))
                flights = dict(zip(ents, rest[0::2]))
                priority = {e: float(w or 0) for e, w in zip(ents, rest[1::2])}
            except (*self._redis_errors, ValueError) as e:
                self._failed("evictions", e)
                return []
            protected = any(flights[e] for e in ents if self._class_of[e] in _PROTECTED)
            if over <= 0 or not protected:
                continue
            victims = sorted(
                (priority[e], now - at, int(seq) * MAX_QUOTAS + index)
                for e in ents
                if self._class_of[e] == "preemptible"
                for seq, at in flights[e]
            )
            out.extend(ticket for _, _, ticket in victims[:over])
        self._succeeded(settled)
        return out

    def set_capacity(
        self,
        quota: str,
        tokens_per_s: float | None = None,
        kv_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        """Changes a quota's capacity for every replica at once (Redis errors raise)."""
        spec = Quota(
            quota,
            1.0 if tokens_per_s is None else tokens_per_s,
            1 if kv_bytes is None else kv_bytes,
            1 if concurrency is None else concurrency,
        )
        fields: dict[str, str] = {}
        if tokens_per_s is not None:
            fields["tokens_per_s"] = repr(spec.tokens_per_s)
        if kv_bytes is not None:
            fields["kv_bytes"] = str(spec.kv_bytes)
        if concurrency is not None:
            fields["concurrency"] = str(spec.concurrency)
        if fields:
            self.client.hset(f"{self._configured_key(quota)}:quota", mapping=fields)

    def _configured_key(self, quota: str) -> str:
        """``quota``'s key prefix, its configuration written by this instance."""
        if quota not in self._keys:
            raise KeyError(f"unknown quota: {quota!r}")
        if quota not in self._configured:
            self._configure(quota)
        return self._keys[quota]

    def set_state(self, entitlement: str, state: str) -> None:
        """Moves an entitlement to ``state`` for every replica at once (Redis errors raise)."""
        if state not in _STATES:
            raise ValueError(f"state must be one of {', '.join(_STATES)}; got {state!r}")
        quota = self._quota_of.get(entitlement)
        if quota is None:
            raise KeyError(f"unknown entitlement: {entitlement!r}")
        key = self._configured_key(quota)
        if not self._set_state_script(keys=[key], args=[entitlement, state]):
            self._configure(quota)  # Redis came back empty
            self._set_state_script(keys=[key], args=[entitlement, state])

    def priority(self, entitlement: str) -> float:
        quota = self._quota_of.get(entitlement)
        if quota is None:
            raise KeyError(f"unknown entitlement: {entitlement!r}")
        key = self._configured_key(quota)
        return float(self.client.hget(f"{key}:e:{entitlement}", "priority"))

    def quota_in_flight(self, quota: str) -> int:
        value = self.client.hget(f"{self._configured_key(quota)}:quota", "in_flight")
        return int(value or 0)

    def close(self) -> None:
        """Gives what failed calls left behind (``pending``) up to
        ``flush_timeout_s`` to reach Redis, then closes the client."""
        deadline = time.monotonic() + self._flush_timeout_s
        while not self.reconcile() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.client.close()


def _positive(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < _INF:
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")


def _take(queue: deque[Any], limit: int) -> list[Any]:
    return [queue.popleft() for _ in range(min(limit, len(queue)))]


def _keep(queue: deque[Any], items: Sequence[Any], *, front: bool = False) -> None:
    """Queues ``items`` to settle later (``front``: ones taken back, oldest
    first); beyond MAX_PENDING the oldest are dropped (their leases release
    them)."""
    if front:
        queue.extendleft(reversed(items))
    else:
        queue.extend(items)
    while len(queue) > MAX_PENDING:
        queue.popleft()
