"""What every admission backend answers (``AdmissionBackend``) and the checks
they share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from routecore._core import Admission, NotInFlightError

#: The kinds ``RedisAdmission.failures`` counts: no connection, no answer in
#: time, an error reply (NOSCRIPT, BUSY, READONLY, ...), Redis full (an admit
#: refused over ``maxmemory``).
FAILURE_KINDS = ("connection", "timeout", "reply", "oom")
#: Keys of the admission configuration renamed when its capacities became
#: quotas (the router's context pools keep the name ``pools``): old -> new.
RENAMED_KEYS = {"pools": "quotas", "pool": "quota"}


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
        rate, debt, burst and priority. ``NotInFlightError`` (changing nothing)
        when the ticket is not in flight: None (a fail-open admission has no
        ticket), completed already, or its Redis lease expired. True when this
        call released the ticket; False only while shared state is unreachable:
        the completion is kept and replayed when it answers (counted once)."""
        if ticket is None:
            raise NotInFlightError("complete: ticket None is not in flight (admitted without one)")
        return self._complete(ticket, actual_input, actual_output, latency_s, self._now(now))

    def release(self, ticket: int | None, now: float | None = None) -> bool:
        """Ends an admitted request that was never served (a later step
        refused it, or it left a queue): its slot and its window charge are
        given back and nothing is learned (served rate, debt, burst, latency
        and priority stay as they were). ``NotInFlightError`` and the return
        value as ``complete``."""
        if ticket is None:
            raise NotInFlightError("release: ticket None is not in flight (admitted without one)")
        return self._release(ticket, self._now(now))

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

    def _release(self, ticket: int, now: float) -> bool:
        raise NotImplementedError

    def _evictions(self, now: float) -> list[int]:
        raise NotImplementedError

    def set_capacity(
        self,
        quota: str,
        tokens_per_s: float | None = None,
        kv_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        """Changes a quota's capacity at run time (outage, recovery, scaling)."""
        raise NotImplementedError

    def set_state(self, entitlement: str, state: str) -> None:
        """Moves an entitlement to pending, bound, degraded or expired."""
        raise NotImplementedError

    def quota_in_flight(self, quota: str) -> int:
        """Requests in flight in ``quota``."""
        raise NotImplementedError

    def priority(self, entitlement: str) -> float:
        """The entitlement's priority weight w_e now (equation 1)."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases connections, if any."""


def check_renamed(mapping: Mapping[str, Any], where: str = "") -> None:
    """ValueError naming the new key when ``mapping`` (the admission
    configuration, or one entitlement at ``where``) uses a renamed one."""
    for old, new in RENAMED_KEYS.items():
        if old in mapping:
            raise ValueError(
                f"{where}{old}: renamed to {new!r} (admission capacities are quotas; "
                "pools are the router's)"
            )
