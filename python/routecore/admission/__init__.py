"""Quota admission with one interface over two backends.

``InMemoryAdmission`` (the default) keeps the state in this process, in the
Rust ``AdmissionController``. ``RedisAdmission`` keeps it in Redis so that
many gateway replicas share one quota without ever over-admitting: every
decision is one Lua script that checks and reserves atomically, with the same
checks, priority, debt and burst as the Rust controller. Choose one with
``admission_from_config``.

Both backends answer::

    admission = backend.admit(entitlement, input_tokens, max_tokens=None, now=None)
    # admission.admitted, .status (200/401/403/413/429/503), .reason,
    # .retry_after_s (seconds or None), .ticket (int or None)
    backend.complete(admission.ticket, actual_input, actual_output, latency_s, now=None)
    backend.release(admission.ticket, now=None)  # instead, when never served: nothing learned

``now`` defaults to the backend's clock (``routecore.monotonic`` in memory,
``time.time`` for Redis, which replicas on several hosts share). ``complete``
on a ticket that is not in flight (None, done already, or its Redis lease
expired) raises ``NotInFlightError`` and changes nothing: completing twice
never counts twice. It returns True when it released the ticket, False only
while Redis is unreachable (the completion is replayed when it answers). Both
backends may be called from several threads at once (e.g. a server's thread
pool); bad numbers raise ValueError.

The package: ``backend`` (the interface and shared checks), ``memory``
(``InMemoryAdmission``), ``redis`` (``RedisAdmission``); the Lua lives once
in ``rust/serve/admission/*.lua``.

Redis specifics (see ``RedisAdmission``): keys ``{prefix}:{<quota>}:...`` per
quota and entitlement, all of one quota in one hash slot; a reservation whose
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

from collections.abc import Mapping
from typing import Any

from routecore._core import Entitlement, Quota
from routecore.admission.backend import (
    FAILURE_KINDS,
    RENAMED_KEYS,
    AdmissionBackend,
    check_renamed,
)
from routecore.admission.memory import InMemoryAdmission
from routecore.admission.redis import (
    FAILURE_MODES,
    MAX_BOUND,
    MAX_PENDING,
    MAX_QUOTAS,
    MAX_TOKENS,
    RECONCILE_BATCH,
    REDIS_OPTIONS,
    URL_SCHEMES,
    RedisAdmission,
)

__all__ = [
    "FAILURE_KINDS",
    "FAILURE_MODES",
    "MAX_BOUND",
    "MAX_PENDING",
    "MAX_QUOTAS",
    "MAX_TOKENS",
    "RECONCILE_BATCH",
    "REDIS_OPTIONS",
    "RENAMED_KEYS",
    "URL_SCHEMES",
    "AdmissionBackend",
    "InMemoryAdmission",
    "RedisAdmission",
    "admission_from_config",
    "check_renamed",
]


def admission_from_config(config: Mapping[str, Any]) -> InMemoryAdmission | RedisAdmission:
    """A backend from a configuration mapping (e.g. parsed YAML/JSON)::

    {"backend": "memory" | "redis",          # default "memory"
     "quotas": [{"name", "tokens_per_s", "kv_bytes", "concurrency",
                "kv_bytes_per_token"?}],
     "entitlements": [{"name", "tenant", "quota", "service_class",
                       "slo_target_ms", "tokens_per_s", "kv_bytes",
                       "concurrency", "state"?}],
     "default_max_tokens"?: 4096, "window_s"?: 60.0,
     "redis"?: {"url", "prefix", "lease_s", "failure_mode": "open" | "closed",
                "unavailable_retry_s", "socket_timeout_s", "max_window_entries",
                "max_window_entries_per_quota", "max_void_markers",
                "flush_timeout_s"}}

    The keys ``pools`` and an entitlement's ``pool`` (before quotas had their
    own name) are a ValueError naming the new key.
    """
    check_renamed(config)
    for i, e in enumerate(config.get("entitlements", [])):
        if isinstance(e, Mapping):
            check_renamed(e, f"entitlements[{i}].")
    quotas = [Quota(**p) for p in config.get("quotas", [])]
    entitlements = [Entitlement(**e) for e in config.get("entitlements", [])]
    common = {
        "default_max_tokens": config.get("default_max_tokens", 4096),
        "window_s": config.get("window_s", 60.0),
    }
    backend = config.get("backend", "memory")
    if backend == "memory":
        return InMemoryAdmission(quotas, entitlements, **common)
    if backend == "redis":
        options = config.get("redis", {})
        if not isinstance(options, Mapping):
            raise ValueError(f"redis: expected a mapping, got {type(options).__name__}")
        for key in options:
            if key not in REDIS_OPTIONS:
                raise ValueError(f"redis.{key}: unknown key (expected one of {REDIS_OPTIONS})")
        return RedisAdmission(quotas, entitlements, **common, **options)
    raise ValueError(f"backend must be 'memory' or 'redis', got {backend!r}")
