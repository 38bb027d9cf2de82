"""Token-pool admission with one interface over two backends.

``InMemoryAdmission`` (the default) keeps the state in this process, in the
Rust ``AdmissionController``. ``RedisAdmission`` keeps it in Redis so that
many gateway replicas share one pool without ever over-admitting: every
decision is one Lua script that checks and reserves atomically, with the same
checks, priority, debt and burst as the Rust controller. Choose one with
``admission_from_config``.

Both backends answer::

    admission = backend.admit(entitlement, input_tokens, max_tokens=None, now=None)
    # admission.admitted, .status (200/401/403/413/429/503), .reason,
    # .retry_after_s (seconds or None), .ticket (int or None)
    backend.complete(admission.ticket, actual_input, actual_output, latency_s, now=None)

``now`` defaults to the backend's clock (``time.monotonic`` in memory,
``time.time`` for Redis, which replicas share). ``complete`` returns True when
it released the ticket and False when the ticket is not in flight (None, done
already, or its Redis lease expired): completing twice never counts twice.
Both backends may be called from several threads at once (e.g. a server's
thread pool); bad numbers raise ValueError.

Redis specifics (see ``RedisAdmission``): keys ``{prefix}:{<pool>}:...`` per
pool and entitlement, all of one pool in one hash slot; a reservation whose
replica died mid-request is released after ``lease_s``. Construction never
contacts Redis. Any Redis failure (down, stalled past ``socket_timeout_s``,
an error reply such as OOM) goes through ``failure_mode``: ``"closed"`` (the
default) rejects with 503, ``"open"`` admits without a ticket (unaccounted),
so an outage either sheds load or protects availability, as configured; it is
logged and counted in ``RedisAdmission.failures``, never raised. A reservation
whose reply was lost (a stalled Redis runs the script after the client gave
up) is voided by its request id as soon as Redis answers again.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import operator
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from routecore._core import Admission, AdmissionController, Entitlement, TokenPool
from routecore._extras import require

MAX_TOKENS = 1 << 30
MAX_POOLS = 256
FAILURE_MODES = ("open", "closed")
#: The kinds ``RedisAdmission.failures`` counts: no connection, no answer in
#: time, an error reply (OOM, NOSCRIPT, BUSY, READONLY, ...).
FAILURE_KINDS = ("connection", "timeout", "reply")
URL_SCHEMES = ("redis://", "rediss://", "unix://")
#: The keys of a configuration's ``redis`` mapping (``RedisAdmission`` keywords).
REDIS_OPTIONS = (
    "url",
    "prefix",
    "lease_s",
    "failure_mode",
    "unavailable_retry_s",
    "socket_timeout_s",
)
#: Lost admits and failed completions a pool keeps to settle when Redis answers
#: again; beyond it the oldest are left to their leases.
MAX_PENDING = 10_000
#: How many of them one call settles before its own work.
RECONCILE_BATCH = 256
_INF = float("inf")
_log = logging.getLogger(__name__)


class AdmissionBackend:
    """What a gateway or server needs from an admission backend; both backends
    derive from it and supply ``_admit``, ``_complete`` and the rest."""

    clock: Callable[[], float]
    #: Failures of the shared state by kind (``FAILURE_KINDS``), for a metric;
    #: empty in memory.
    failures: Mapping[str, int] = MappingProxyType({})

    def admit(
        self,
        entitlement: str,
        input_tokens: int,
        max_tokens: int | None = None,
        now: float | None = None,
    ) -> Admission:
        """Decides one request: ``admitted``, ``status`` (200; 401 unknown
        entitlement, 403 not bound, 413 over the whole budget, 429 throttled,
        503 state unreachable), ``reason``, ``retry_after_s``, ``ticket``.
        ``max_tokens=None`` charges the default output bound; ``now`` defaults
        to the backend's clock. Bad numbers raise ValueError."""
        return self._admit(entitlement, input_tokens, max_tokens, self._now(now))

    def complete(
        self,
        ticket: int | None,
        actual_input: int,
        actual_output: int,
        latency_s: float,
        now: float | None = None,
    ) -> bool:
        """Ends an admitted request with what it really used and updates served
        rate, debt, burst and priority. True when this call released the ticket,
        False when it is not in flight (None, done already, lease expired, or
        the state is unreachable): completing twice never counts twice."""
        if ticket is None:
            return False
        return self._complete(ticket, actual_input, actual_output, latency_s, self._now(now))

    def evictions(self, now: float | None = None) -> list[int]:
        """Tickets of preemptible requests to terminate now because protected
        classes need the capacity (lowest priority, then youngest, first).
        Changes nothing: terminate them, then ``complete`` each."""
        return self._evictions(self._now(now))

    def reconcile(self, now: float | None = None) -> bool:
        """Settles in the shared state what failed calls left behind; True when
        nothing is left. Nothing to do in memory."""
        return True

    def pending(self) -> int:
        """Failed calls whose effect is not yet settled in the shared state."""
        return 0

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else float(now)

    def _admit(
        self, entitlement: str, input_tokens: int, max_tokens: int | None, now: float
    ) -> Admission:
        raise NotImplementedError

    def _complete(
        self, ticket: int, actual_input: int, actual_output: int, latency_s: float, now: float
    ) -> bool:
        raise NotImplementedError

    def _evictions(self, now: float) -> list[int]:
        raise NotImplementedError

    def set_capacity(
        self,
        pool: str,
        tokens_per_s: float | None = None,
        kv_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        """Changes a pool's capacity at run time (outage, recovery, scaling)."""
        raise NotImplementedError

    def set_state(self, entitlement: str, state: str) -> None:
        """Moves an entitlement to pending, bound, degraded or expired."""
        raise NotImplementedError

    def pool_in_flight(self, pool: str) -> int:
        """Requests in flight in ``pool``."""
        raise NotImplementedError

    def priority(self, entitlement: str) -> float:
        """The entitlement's priority weight w_e now (equation 1)."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases connections, if any."""


class InMemoryAdmission(AdmissionBackend):
    """The in-process backend (the default): ``AdmissionController`` with a clock."""

    def __init__(
        self,
        pools: Sequence[TokenPool],
        entitlements: Sequence[Entitlement],
        default_max_tokens: int = 4096,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = AdmissionController(
            list(pools), list(entitlements), default_max_tokens, window_s
        )
        self.clock = clock

    def _admit(
        self, entitlement: str, input_tokens: int, max_tokens: int | None, now: float
    ) -> Admission:
        return self.controller.admit(entitlement, input_tokens, max_tokens, now)

    def _complete(
        self, ticket: int, actual_input: int, actual_output: int, latency_s: float, now: float
    ) -> bool:
        try:
            self.controller.complete(ticket, actual_input, actual_output, latency_s, now)
        except KeyError:
            return False
        return True

    def _evictions(self, now: float) -> list[int]:
        return self.controller.evictions(now)

    def set_capacity(
        self,
        pool: str,
        tokens_per_s: float | None = None,
        kv_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        self.controller.set_capacity(pool, tokens_per_s, kv_bytes, concurrency)

    def set_state(self, entitlement: str, state: str) -> None:
        self.controller.set_state(entitlement, state)

    def pool_in_flight(self, pool: str) -> int:
        return self.controller.pool_in_flight(pool)

    def priority(self, entitlement: str) -> float:
        return self.controller.priority(entitlement)


# The Lua below mirrors rust/admission.rs line by line; the equivalence test in
# tests/test_admission_redis.py runs one request sequence through both.
_PRELUDE = """
local P = KEYS[1]
local MIN_RETRY = 0.05
local function f(x) return string.format('%.17g', x) end
local function pool_get()
  local v = redis.call('HMGET', P..':pool', 'tokens_per_s', 'kv_bytes', 'concurrency',
    'kv_per_token', 'mean_slo', 'window_s', 'lease_s', 'in_flight', 'kv_in_flight', 'clock')
  if not v[6] then return nil end -- window_s: written by the configure script only
  return {tps = tonumber(v[1]), kv = tonumber(v[2]), conc = tonumber(v[3]),
    kvpt = tonumber(v[4]), mean = tonumber(v[5]), window = tonumber(v[6]),
    lease = tonumber(v[7]), in_flight = tonumber(v[8]), kv_in_flight = tonumber(v[9]),
    clock = tonumber(v[10])}
end
local function tick(pool, now)
  if pool.clock and pool.clock >= now then return pool.clock end
  redis.call('HSET', P..':pool', 'clock', f(now))
  return now
end
local function weight(e)
  return tonumber(e.weight) / (1 + 2 * tonumber(e.slo) / e.mean)
    / (1 + tonumber(e.burst)) * (1 + 4 * tonumber(e.debt))
end
local function release(seq)
  local info = redis.call('HGET', P..':tickets', seq)
  if not info then return nil end
  local kv, tokens, ent = string.match(info, '^(%d+)|(%d+)|(.*)$')
  local ek = P..':e:'..ent
  redis.call('HDEL', P..':tickets', seq)
  local rid = redis.call('HGET', P..':rid', seq)
  if rid then redis.call('HDEL', P..':rid', seq, rid) end
  redis.call('ZREM', P..':leases', seq)
  redis.call('ZREM', ek..':fl', seq)
  redis.call('HINCRBY', P..':pool', 'in_flight', -1)
  redis.call('HINCRBY', ek, 'tokens_in_flight', '-'..tokens)
  if kv ~= '0' then
    redis.call('HINCRBY', ek, 'kv_in_flight', '-'..kv)
    redis.call('HINCRBY', P..':pool', 'kv_in_flight', '-'..kv)
  end
  return ent
end
local function purge(now)
  redis.call('ZREMRANGEBYSCORE', P..':void', '-inf', f(now))
  local dead = redis.call('ZRANGEBYSCORE', P..':leases', '-inf', f(now))
  for _, seq in ipairs(dead) do release(seq) end
  return #dead
end
local function completion_rate(ek, pool)
  local n = redis.call('ZCARD', ek..':fl')
  if n == 0 then return 0 end
  local v = redis.call('HMGET', ek, 'latency', 'tokens_in_flight')
  local latency
  if v[1] ~= '' then latency = tonumber(v[1])
  else latency = tonumber(v[2]) / n / (pool.tps / pool.conc) end
  return n / math.max(latency, MIN_RETRY)
end
local function refresh()
  local names = redis.call('SMEMBERS', P..':ents')
  table.sort(names)
  local sum, n = 0, 0
  for _, name in ipairs(names) do
    local v = redis.call('HMGET', P..':e:'..name, 'state', 'slo')
    if v[1] == 'bound' then sum = sum + tonumber(v[2]); n = n + 1 end
  end
  local mean = 1
  if n > 0 then mean = sum / n end
  redis.call('HSET', P..':pool', 'mean_slo', f(mean))
  for _, name in ipairs(names) do
    local ek = P..':e:'..name
    local v = redis.call('HMGET', ek, 'weight', 'slo', 'burst', 'debt')
    local w = weight({weight = v[1], slo = v[2], burst = v[3], debt = v[4], mean = mean})
    redis.call('HSET', ek, 'priority', f(w))
  end
end
"""

_CONFIGURE = (
    _PRELUDE
    + """
local cfg = cjson.decode(ARGV[1])
local pk = P..':pool'
redis.call('HSET', pk, 'tokens_per_s', f(cfg.tokens_per_s), 'kv_bytes', f(cfg.kv_bytes),
  'concurrency', f(cfg.concurrency), 'kv_per_token', f(cfg.kv_bytes_per_token),
  'window_s', f(cfg.window_s), 'lease_s', f(cfg.lease_s))
redis.call('HSETNX', pk, 'in_flight', 0)
redis.call('HSETNX', pk, 'kv_in_flight', 0)
redis.call('SET', P..':seq', ARGV[2], 'NX')
for _, e in ipairs(cfg.entitlements) do
  local ek = P..':e:'..e.name
  redis.call('SADD', P..':ents', e.name)
  redis.call('HSET', ek, 'weight', f(e.weight), 'burstable', e.burstable,
    'baseline', e.baseline, 'slo', f(e.slo_target_ms), 'tps', f(e.tokens_per_s),
    'kv', f(e.kv_bytes), 'conc', f(e.concurrency))
  redis.call('HSETNX', ek, 'state', e.state)
  redis.call('HSETNX', ek, 'served_rate', f(e.tokens_per_s))
  for _, k in ipairs({'served_at', 'latency'}) do redis.call('HSETNX', ek, k, '') end
  for _, k in ipairs({'debt', 'burst', 'tokens_in_flight', 'kv_in_flight', 'window_tokens'}) do
    redis.call('HSETNX', ek, k, 0)
  end
end
refresh()
return 1
"""
)

_ADMIT = (
    _PRELUDE
    + """
local pool = pool_get()
if not pool then return {'unconfigured'} end
local ent, tokens = ARGV[1], tonumber(ARGV[2])
local now = tick(pool, tonumber(ARGV[3]))
if purge(now) > 0 then pool = pool_get() end
local ek = P..':e:'..ent
local e = redis.call('HMGET', ek, 'state', 'conc', 'tps', 'burstable', 'priority',
  'window_tokens')
if not e[1] then return {'401', 'unknown-entitlement', '', '', '0'} end
local w = e[5]
local rid = ARGV[4]
local again = redis.call('HGET', P..':rid', rid)
if again then return {'200', 'admitted', '', again, w} end -- a client retry: same ticket
if redis.call('ZSCORE', P..':void', rid) then return {'void'} end -- its client gave up
if e[1] ~= 'bound' then return {'403', e[1], '', '', w} end
local kv = tokens * pool.kvpt
local pool_room = pool.in_flight < pool.conc and pool.kv_in_flight + kv <= pool.kv
local may_burst = pool_room and e[4] == '1'
if redis.call('ZCARD', ek..':fl') >= tonumber(e[2]) and not may_burst then
  local retry = 1 / completion_rate(ek, pool)
  return {'429', 'concurrency', f(math.max(retry, MIN_RETRY)), '', w}
end
local wt = tonumber(e[6])
local old = redis.call('ZRANGEBYSCORE', ek..':win', '-inf', f(now - pool.window))
for _, s in ipairs(old) do
  wt = wt - tonumber(redis.call('HGET', ek..':wtok', s))
  redis.call('HDEL', ek..':wtok', s)
  redis.call('ZREM', ek..':win', s)
end
if #old > 0 then redis.call('HSET', ek, 'window_tokens', wt) end
local limit = tonumber(e[3]) * pool.window
local excess = wt + tokens - limit
if excess > 0 and not may_burst then
  if tokens > limit then return {'413', 'exceeds-token-budget', '', '', w} end
  local charges = redis.call('ZRANGE', ek..':win', 0, -1, 'WITHSCORES')
  local freed, at = 0, now
  for k = 1, #charges, 2 do
    freed = freed + tonumber(redis.call('HGET', ek..':wtok', charges[k]))
    if freed >= excess then at = tonumber(charges[k + 1]); break end
  end
  return {'429', 'token-budget', f(math.max(at + pool.window - now, MIN_RETRY)), '', w}
end
if not pool_room then
  local lowest, rate = math.huge, 0
  for _, name in ipairs(redis.call('SMEMBERS', P..':ents')) do
    local ok = P..':e:'..name
    local r = completion_rate(ok, pool)
    if r > 0 then
      lowest = math.min(lowest, tonumber(redis.call('HGET', ok, 'priority')))
      rate = rate + r
    end
  end
  if tonumber(w) <= lowest then
    local retry = ''
    if rate > 0 then retry = f(math.max(1 / rate, MIN_RETRY)) end
    return {'429', 'pool-contention', retry, '', w}
  end
end
local seq = string.format('%d', redis.call('INCR', P..':seq'))
redis.call('HSET', P..':tickets', seq, string.format('%d|%d|', kv, tokens)..ent)
redis.call('HSET', P..':rid', seq, rid, rid, seq)
redis.call('ZADD', P..':leases', f(now + pool.lease), seq)
redis.call('ZADD', ek..':fl', f(now), seq)
redis.call('ZADD', ek..':win', f(now), seq)
redis.call('HSET', ek..':wtok', seq, tokens)
redis.call('HINCRBY', ek, 'window_tokens', tokens)
redis.call('HINCRBY', ek, 'tokens_in_flight', tokens)
redis.call('HINCRBY', P..':pool', 'in_flight', 1)
if kv > 0 then
  redis.call('HINCRBY', ek, 'kv_in_flight', string.format('%d', kv))
  redis.call('HINCRBY', P..':pool', 'kv_in_flight', string.format('%d', kv))
end
return {'200', 'admitted', '', seq, w}
"""
)

_COMPLETE = (
    _PRELUDE
    + """
local pool = pool_get()
if not pool then return 0 end
local seq, actual, latency = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local info = redis.call('HGET', P..':tickets', seq)
if not info then return 0 end
local now = tick(pool, tonumber(ARGV[4]))
purge(now)
if redis.call('HEXISTS', P..':tickets', seq) == 0 then return 0 end
local ent = string.match(info, '^%d+|%d+|(.*)$')
local ek = P..':e:'..ent
local v = redis.call('HMGET', ek, 'served_rate', 'served_at', 'tps', 'kv', 'conc', 'debt',
  'burst', 'latency', 'baseline', 'weight', 'slo', 'kv_in_flight')
local tps = tonumber(v[3])
local decay = 1
if v[2] ~= '' then decay = math.exp(-(now - tonumber(v[2])) / pool.window) end
local rate = tonumber(v[1]) * decay + actual / pool.window
local function over(used, base) return math.max(used / base - 1, 0) end
local delta = over(rate, tps) + over(tonumber(v[12]), tonumber(v[4]))
  + over(redis.call('ZCARD', ek..':fl'), tonumber(v[5]))
local burst = 0.9 * tonumber(v[7]) + (1 - 0.9) * delta
local debt = tonumber(v[6])
if v[9] == '1' then debt = 0.7 * debt + (1 - 0.7) * (tps - rate) / tps end
if v[8] ~= '' then latency = 0.7 * tonumber(v[8]) + (1 - 0.7) * latency end
local old = redis.call('HGET', ek..':wtok', seq)
if old then
  redis.call('HSET', ek..':wtok', seq, actual)
  redis.call('HINCRBY', ek, 'window_tokens', actual - tonumber(old))
end
release(seq)
local w = weight({weight = v[10], slo = v[11], burst = burst, debt = debt, mean = pool.mean})
redis.call('HSET', ek, 'served_rate', f(rate), 'served_at', f(now), 'burst', f(burst),
  'debt', f(debt), 'latency', f(latency), 'priority', f(w))
return 1
"""
)

_VOID = (
    _PRELUDE
    + """
local pool = pool_get()
if not pool then return 0 end
local now = tick(pool, tonumber(ARGV[1]))
local undone = 0
for k = 2, #ARGV do
  local rid = ARGV[k]
  local seq = redis.call('HGET', P..':rid', rid)
  local ent = seq and release(seq)
  if ent then -- reserved: undo it, window charge included, as if never admitted
    local ek = P..':e:'..ent
    local tokens = redis.call('HGET', ek..':wtok', seq)
    if tokens then
      redis.call('HDEL', ek..':wtok', seq)
      redis.call('ZREM', ek..':win', seq)
      redis.call('HINCRBY', ek, 'window_tokens', '-'..tokens)
    end
    undone = undone + 1
  else -- not (yet) reserved: a script still queued in Redis must not reserve it
    redis.call('ZADD', P..':void', f(now + pool.lease), rid)
  end
end
return undone
"""
)

_SET_STATE = (
    _PRELUDE
    + """
if redis.call('EXISTS', P..':e:'..ARGV[1]) == 0 then return 0 end
redis.call('HSET', P..':e:'..ARGV[1], 'state', ARGV[2])
refresh()
return 1
"""
)

_STATES = ("pending", "bound", "degraded", "expired")
_PROTECTED = ("dedicated", "guaranteed")  # never shrunk (Table 1)
_CLASS = {  # weight, burst rights, has a baseline (accumulates debt): Table 1
    "dedicated": (1000.0, 1, 1),
    "guaranteed": (1000.0, 0, 1),
    "elastic": (100.0, 1, 1),
    "spot": (1.0, 1, 0),
    "preemptible": (0.1, 1, 0),
}


def _count(what: str, value: int, low: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int")
    value = operator.index(value)  # ints and NumPy integers; TypeError for floats
    if not low <= value <= MAX_TOKENS:
        raise ValueError(f"{what} must be in [{low}, {MAX_TOKENS}], got {value}")
    return value


class RedisAdmission(AdmissionBackend):
    """The shared backend: pool state in Redis, one atomic Lua script per decision.

    ``client``: a ``redis.Redis`` (or give ``url``). Keys live under
    ``{prefix}:{<pool>}``, one hash slot per pool. ``lease_s``: a reservation not
    completed within this many seconds (its replica died mid-request) is
    released by the next call on its pool.

    Construction never contacts Redis: each pool's configuration is written on
    its first use (and again whenever Redis comes back empty), so a server
    starts while Redis is down. Every Redis failure (no connection, a timeout
    after ``socket_timeout_s``, an error reply such as OOM, NOSCRIPT, BUSY or
    READONLY) goes through ``failure_mode``: ``"closed"`` rejects with 503
    ``admission-unavailable`` (Retry-After ``unavailable_retry_s``), ``"open"``
    admits without a ticket, unaccounted. ``admit``, ``complete`` and
    ``evictions`` never raise for Redis; the detail is logged (logger
    ``routecore.admission``) and counted in ``failures`` by kind
    (``connection``, ``timeout``, ``reply``). After a timeout, while Redis may
    be stalled, one call at a time asks it and concurrent calls answer by
    ``failure_mode`` at once (not counted in ``failures``), so a stall holds one
    thread for ``socket_timeout_s``, not every caller's.

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
        pools: Sequence[TokenPool],
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
        clock: Callable[[], float] = time.time,
    ) -> None:
        (redis,) = require("redis", "redis")
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # The Rust controller checks the configuration exactly as in memory.
        AdmissionController(list(pools), list(entitlements), default_max_tokens, window_s)
        if failure_mode not in FAILURE_MODES:
            raise ValueError(f"failure_mode must be 'open' or 'closed', got {failure_mode!r}")
        for what, value in (
            ("lease_s", lease_s),
            ("unavailable_retry_s", unavailable_retry_s),
            ("socket_timeout_s", socket_timeout_s),
        ):
            _positive(what, value)
        if url is not None and (not isinstance(url, str) or not url.startswith(URL_SCHEMES)):
            # Not echoed: a URL may hold a password.
            raise ValueError("url must be a redis://, rediss:// or unix:// URL")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
        if len(pools) > MAX_POOLS:
            raise ValueError(f"at most {MAX_POOLS} pools")
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
        self._lock = threading.Lock()
        self._reachable = True
        # After a timeout Redis may be stalled: then one call at a time asks it
        # (holding _probe), the others answer by failure_mode at once.
        self._stalled = False
        self._probe = threading.Lock()
        self._configured: set[str] = set()
        # Per pool: request ids of admits whose reply was lost, and completions
        # that failed, to settle when Redis answers again (oldest first).
        self._voids: dict[str, deque[str]] = {p.name: deque() for p in pools}
        self._replays: dict[str, deque[tuple[int, int, str, str]]] = {
            p.name: deque() for p in pools
        }
        self._rid_prefix = f"r{secrets.token_hex(8)}:"
        self._rids = itertools.count()
        self._pools = [p.name for p in pools]
        self._pool_of = {e.name: e.pool for e in entitlements}
        self._class_of = {e.name: e.service_class for e in entitlements}
        self._keys = {p.name: f"{prefix}:{{{p.name}}}" for p in pools}
        self._config = {
            p.name: json.dumps(
                {
                    "tokens_per_s": p.tokens_per_s,
                    "kv_bytes": p.kv_bytes,
                    "concurrency": p.concurrency,
                    "kv_bytes_per_token": p.kv_bytes_per_token,
                    "window_s": window_s,
                    "lease_s": lease_s,
                    "entitlements": [
                        {
                            "name": e.name,
                            "weight": _CLASS[e.service_class][0],
                            "burstable": _CLASS[e.service_class][1],
                            "baseline": _CLASS[e.service_class][2],
                            "slo_target_ms": e.slo_target_ms,
                            "tokens_per_s": e.tokens_per_s,
                            "kv_bytes": e.kv_bytes,
                            "concurrency": e.concurrency,
                            "state": e.state,
                        }
                        for e in entitlements
                        if e.pool == p.name
                    ],
                }
            )
            for p in pools
        }
        self._configure_script = client.register_script(_CONFIGURE)
        self._admit_script = client.register_script(_ADMIT)
        self._complete_script = client.register_script(_COMPLETE)
        self._void_script = client.register_script(_VOID)
        self._set_state_script = client.register_script(_SET_STATE)

    def _configure(self, pool: str) -> None:
        seq_base = int(time.time() * 1000) * 1024
        self._configure_script(keys=[self._keys[pool]], args=[self._config[pool], seq_base])
        self._configured.add(pool)

    def _ready(self, pool: str, now: float) -> bool:
        """Before a call on ``pool``: settle what failed calls left behind, then
        write this instance's configuration once. Raises the Redis error; see
        ``_settle`` for the result."""
        settled = self._settle(pool, now, RECONCILE_BATCH)
        if pool not in self._configured:
            self._configure(pool)
        return settled

    def _settle(self, pool: str, now: float, limit: int) -> bool:
        """Voids up to ``limit`` lost admits and replays up to ``limit`` failed
        completions of ``pool``; what Redis did not take is kept for later.
        True when all were settled; an error reply is logged and counted
        (False), a connection error or timeout raises: Redis is not there."""
        with self._lock:
            voids = _take(self._voids[pool], limit)
            replays = _take(self._replays[pool], limit)
        if not voids and not replays:
            return True
        key = self._keys[pool]
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
                _keep(self._voids[pool], voids, front=True)
                _keep(self._replays[pool], replays, front=True)
            if self._kind(e) != "reply":
                raise
            self._failed("reconcile", e)
            return False
        return True

    def reconcile(self, now: float | None = None) -> bool:
        """Settles everything failed calls left behind (voids lost admits,
        replays failed completions) on every pool; True when nothing is left.
        The next call on a pool does this too, a batch at a time; a server may
        call this periodically. Never raises for Redis."""
        at = self._now(now)
        try:
            for pool in self._pools:
                while (self._voids[pool] or self._replays[pool]) and self._settle(
                    pool, at, RECONCILE_BATCH
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
        if isinstance(error, self._timeout):
            return "timeout"
        if isinstance(error, self._connection):
            return "connection"
        return "reply"

    def _failed(self, call: str, error: BaseException) -> None:
        kind = self._kind(error)
        with self._lock:
            self.failures[kind] += 1
            was_reachable, self._reachable = self._reachable, False
            if kind == "timeout":
                self._stalled = True
        # The first failure of an outage is a warning, the rest debug: an outage
        # under load must not flood the log.
        _log.log(
            logging.WARNING if was_reachable else logging.DEBUG,
            "redis admission: %s failed (%s: %s: %s); failing %s",
            call,
            kind,
            type(error).__name__,
            error,
            self.failure_mode,
        )

    def _succeeded(self, settled: bool = True) -> None:
        """Redis answered; ``settled``: and nothing failed calls left is stuck."""
        self._stalled = False
        if settled and not self._reachable:
            with self._lock:
                was_reachable, self._reachable = self._reachable, True
            if not was_reachable:
                _log.warning("redis admission: Redis answers again")

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
        pool = self._pool_of.get(entitlement)
        if pool is None:
            return Admission(False, 401, "unknown-entitlement")
        with self._turn() as mine:
            return self._decide(pool, entitlement, tokens, now) if mine else self._unavailable()

    def _decide(self, pool: str, entitlement: str, tokens: int, now: float) -> Admission:
        key = self._keys[pool]
        try:
            settled = self._ready(pool, now)
        except self._redis_errors as e:
            self._failed("admit", e)
            return self._unavailable()
        rid = f"{self._rid_prefix}{next(self._rids):x}"
        args = [entitlement, tokens, repr(now), rid]
        try:
            out = self._admit_script(keys=[key], args=args)
            if out[0] == b"unconfigured":
                self._configure(pool)
                out = self._admit_script(keys=[key], args=args)
            status, reason, retry, seq, priority = (x.decode() for x in out)
            decision = Admission(
                status == "200",
                int(status),
                reason,
                float(retry) if retry else None,
                int(seq) * MAX_POOLS + self._pools.index(pool) if seq else None,
                float(priority),
            )
        except (*self._redis_errors, ValueError) as e:
            # The script may have run (or may yet run, in a stalled Redis) with
            # nobody to complete its ticket: void the id when Redis answers.
            with self._lock:
                _keep(self._voids[pool], [rid])
            self._failed("admit", e)
            return self._unavailable()
        self._succeeded(settled)
        return decision

    def _complete(
        self, ticket: int, actual_input: int, actual_output: int, latency_s: float, now: float
    ) -> bool:
        actual = _count("actual_input", actual_input, 0) + _count("actual_output", actual_output, 0)
        if not latency_s >= 0 or latency_s == float("inf"):
            raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s}")
        seq, index = divmod(ticket, MAX_POOLS)
        if index >= len(self._pools):
            return False
        pool = self._pools[index]
        args = (seq, actual, repr(float(latency_s)), repr(now))
        with self._turn() as mine:
            if mine:
                try:
                    settled = self._settle(pool, now, RECONCILE_BATCH)
                    done = self._complete_script(
                        keys=[self._keys[pool]], args=[str(seq), *args[1:]]
                    )
                except self._redis_errors as e:
                    self._failed("complete", e)
                else:
                    self._succeeded(settled)
                    return bool(done)
        with self._lock:  # replayed when Redis answers; a replay counts once
            _keep(self._replays[pool], [args])
        return False

    def _evictions(self, now: float) -> list[int]:
        """Read in one transaction per pool; [] while Redis is unreachable."""
        with self._turn() as mine:
            return self._victims(now) if mine else []

    def _victims(self, now: float) -> list[int]:
        out: list[int] = []
        settled = True
        for index, pool in enumerate(self._pools):
            key = self._keys[pool]
            ents = [e for e, p in self._pool_of.items() if p == pool]
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(f"{key}:pool", "in_flight", "concurrency")
            for e in ents:
                pipe.zrange(f"{key}:e:{e}:fl", 0, -1, withscores=True)
                pipe.hget(f"{key}:e:{e}", "priority")
            try:
                settled &= self._settle(pool, now, RECONCILE_BATCH)
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
                (priority[e], now - at, int(seq) * MAX_POOLS + index)
                for e in ents
                if self._class_of[e] == "preemptible"
                for seq, at in flights[e]
            )
            out.extend(ticket for _, _, ticket in victims[:over])
        self._succeeded(settled)
        return out

    def set_capacity(
        self,
        pool: str,
        tokens_per_s: float | None = None,
        kv_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        """Changes a pool's capacity for every replica at once (Redis errors raise)."""
        spec = TokenPool(
            pool,
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
            self.client.hset(f"{self._configured_key(pool)}:pool", mapping=fields)

    def _configured_key(self, pool: str) -> str:
        """``pool``'s key prefix, its configuration written by this instance."""
        if pool not in self._keys:
            raise KeyError(f"unknown pool: {pool!r}")
        if pool not in self._configured:
            self._configure(pool)
        return self._keys[pool]

    def set_state(self, entitlement: str, state: str) -> None:
        """Moves an entitlement to ``state`` for every replica at once (Redis errors raise)."""
        if state not in _STATES:
            raise ValueError(f"state must be one of {', '.join(_STATES)}; got {state!r}")
        pool = self._pool_of.get(entitlement)
        if pool is None:
            raise KeyError(f"unknown entitlement: {entitlement!r}")
        key = self._configured_key(pool)
        if not self._set_state_script(keys=[key], args=[entitlement, state]):
            self._configure(pool)  # Redis came back empty
            self._set_state_script(keys=[key], args=[entitlement, state])

    def priority(self, entitlement: str) -> float:
        pool = self._pool_of.get(entitlement)
        if pool is None:
            raise KeyError(f"unknown entitlement: {entitlement!r}")
        key = self._configured_key(pool)
        return float(self.client.hget(f"{key}:e:{entitlement}", "priority"))

    def pool_in_flight(self, pool: str) -> int:
        value = self.client.hget(f"{self._configured_key(pool)}:pool", "in_flight")
        return int(value or 0)

    def close(self) -> None:
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


def admission_from_config(config: Mapping[str, Any]) -> InMemoryAdmission | RedisAdmission:
    """A backend from a configuration mapping (e.g. parsed YAML/JSON)::

    {"backend": "memory" | "redis",          # default "memory"
     "pools": [{"name", "tokens_per_s", "kv_bytes", "concurrency",
                "kv_bytes_per_token"?}],
     "entitlements": [{"name", "tenant", "pool", "service_class",
                       "slo_target_ms", "tokens_per_s", "kv_bytes",
                       "concurrency", "state"?}],
     "default_max_tokens"?: 4096, "window_s"?: 60.0,
     "redis"?: {"url", "prefix", "lease_s", "failure_mode": "open" | "closed",
                "unavailable_retry_s", "socket_timeout_s"}}
    """
    pools = [TokenPool(**p) for p in config.get("pools", [])]
    entitlements = [Entitlement(**e) for e in config.get("entitlements", [])]
    common = {
        "default_max_tokens": config.get("default_max_tokens", 4096),
        "window_s": config.get("window_s", 60.0),
    }
    backend = config.get("backend", "memory")
    if backend == "memory":
        return InMemoryAdmission(pools, entitlements, **common)
    if backend == "redis":
        options = config.get("redis", {})
        if not isinstance(options, Mapping):
            raise ValueError(f"redis: expected a mapping, got {type(options).__name__}")
        for key in options:
            if key not in REDIS_OPTIONS:
                raise ValueError(f"redis.{key}: unknown key (expected one of {REDIS_OPTIONS})")
        return RedisAdmission(pools, entitlements, **common, **options)
    raise ValueError(f"backend must be 'memory' or 'redis', got {backend!r}")
