"""The in-process admission backend (the default)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from routecore._core import Admission, AdmissionController, Entitlement, Quota, monotonic
from routecore.admission.backend import AdmissionBackend


class InMemoryAdmission(AdmissionBackend):
    """The in-process backend (the default): ``AdmissionController`` with a
    clock, ``routecore.monotonic`` unless given."""

    def __init__(
        self,
        quotas: Sequence[Quota],
        entitlements: Sequence[Entitlement],
        default_max_tokens: int = 4096,
        window_s: float = 60.0,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.controller = AdmissionController(
            list(quotas), list(entitlements), default_max_tokens, window_s
        )
        self.clock = clock

    def _admit(
        self, entitlement: str, input_tokens: int, max_tokens: int | None, now: float
    ) -> Admission:
        return self.controller.admit(entitlement, input_tokens, max_tokens, now)

    def _complete(
        self, ticket: int, actual_input: int, actual_output: int, latency_s: float, now: float
    ) -> bool:
        self.controller.complete(ticket, actual_input, actual_output, latency_s, now)
        return True

    def _release(self, ticket: int, now: float) -> bool:
        self.controller.release(ticket, now)
        return True

    def _evictions(self, now: float) -> list[int]:
        return self.controller.evictions(now)

    def set_capacity(
        self,
        quota: str,
        tokens_per_s: float | None = None,
        kv_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        self.controller.set_capacity(quota, tokens_per_s, kv_bytes, concurrency)

    def set_state(self, entitlement: str, state: str) -> None:
        self.controller.set_state(entitlement, state)

    def quota_in_flight(self, quota: str) -> int:
        return self.controller.quota_in_flight(quota)

    def priority(self, entitlement: str) -> float:
        return self.controller.priority(entitlement)
