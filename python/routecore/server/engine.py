"""A Python view of the data plane's routing state, for the control plane and tests.

The state itself lives in Rust (:class:`routecore.DataPlane`): the calibrator,
the leases of requests in flight, the endpoint choosers and admission. This
module only reads it and forwards the few calls the RouteCore API and the
tests make, under the names the Python server used.
"""

from __future__ import annotations

from dataclasses import dataclass

from routecore._core import Calibrator, DataPlane


@dataclass(frozen=True)
class Lease:
    """One routed request, in flight on ``pool`` / ``endpoint``."""

    request_id: str
    pool: str
    endpoint: str
    est_input_tokens: int
    est_output_tokens: int
    spilled: bool
    reason: str
    compress_target_tokens: int
    #: The request body to forward when routing rewrote it (compressed), else None.
    body: bytes | None


@dataclass(frozen=True)
class Reject:
    """A request refused: the HTTP status a gateway answers and why."""

    status: int
    reason: str
    message: str
    retry_after_s: float = 0.0


def outcome(d: dict) -> Lease | Reject:
    """A :class:`Lease` or :class:`Reject` from a ``DataPlane.route_*`` result."""
    if d["admitted"]:
        return Lease(**{k: d[k] for k in Lease.__dataclass_fields__})
    return Reject(d["status"], d["reason"], d["message"], d["retry_after_s"])


class RouterView:
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    @property
    def calibrator(self) -> Calibrator:
        return self.plane.calibrator

    def in_flight(self, pool: str) -> int:
        return self.plane.in_flight()["router"].get(pool, 0)


class ChooserView:
    def __init__(self, plane: DataPlane, pool: str) -> None:
        self.plane, self.pool = plane, pool

    @property
    def load(self) -> dict[str, int]:
        return dict(self.plane.in_flight()["chooser"].get(self.pool, {}))


class AdmissionView:
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def quota_in_flight(self, quota: str) -> int:
        """Tickets in flight (the in-memory backend's, summed over its quotas)."""
        return self.plane.in_flight()["admission"]


class Engine:
    """The routing state of one running data plane, read through ``plane``."""

    def __init__(self, plane: DataPlane, pools: list[str]) -> None:
        self.plane = plane
        self.router = RouterView(plane)
        self.choosers = {p: ChooserView(plane, p) for p in pools}
        self.admission = AdmissionView(plane)

    @property
    def leases(self) -> dict[str, None]:
        return dict.fromkeys(self.plane.leases())

    def lease(self, request_id: str) -> str | None:
        return request_id if request_id in self.plane.leases() else None

    async def route_fields(
        self,
        prompt_bytes: int,
        category: str,
        max_output_tokens: int,
        prompt_tokens: int | None = None,
        tenant: None = None,
        now: float = 0.0,
    ) -> Lease | Reject:
        """Routes by measured fields without a tenant (a trusted caller)."""
        return outcome(
            self.plane.route_fields(prompt_bytes, category, max_output_tokens, prompt_tokens)
        )

    def finish(
        self,
        lease: Lease | str | None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        now: float = 0.0,
    ) -> bool:
        """Releases ``lease`` (idempotent: False when it was released already)."""
        if lease is None:
            return False
        request_id = lease if isinstance(lease, str) else lease.request_id
        return self.plane.finish(request_id, prompt_tokens, completion_tokens)
