"""The routing state behind both gRPC front ends (RouteCore and ext_proc).

One :class:`Engine` is built from one :class:`~routecore.config.Config`. It
authenticates the tenant, parses the request in Rust, chooses the pool with
the core's :class:`~routecore.TokenBudgetRouter` and the endpoint inside it,
and hands out a :class:`Lease` that stays in flight until :meth:`Engine.finish`
(the response came back) or :meth:`Engine.reap` (it never did, and the
request timeout passed). A tenant with an ``entitlement`` is admitted by the
admission backend (``routecore.admission_from_config``) and its ticket is
completed with the real usage at the end. Every method takes the time (``time.monotonic()``
seconds) explicitly; the admission backend keeps its own clock (Redis
replicas share wall-clock time). The engine is used from one event loop thread.

A SIGHUP reload builds a new engine that takes over the learned calibrator;
leases handed out before the reload are finished by the engine that issued
them, so open streams run to completion. An in-memory admission backend
starts afresh with the new entitlements; a Redis one keeps its state.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from routecore._core import Calibrator, Compressor, RouteDecision, TokenBudgetRouter
from routecore.admission import admission_from_config
from routecore.config import Config, TenantConfig, find_tenant
from routecore.server.endpoints import POLICIES, Request
from routecore.server.metrics import Metrics

#: The VTC user of requests from no tenant (when no tenants are configured).
ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Reject:
    """A request refused: the HTTP status a gateway answers and why."""

    status: int
    reason: str
    message: str
    retry_after_s: float = 0.0


@dataclass
class Lease:
    """One routed request, in flight on ``pool`` / ``endpoint``."""

    request_id: str
    pool: str
    endpoint: str
    tenant: TenantConfig | None
    #: What the endpoint chooser and admission were told.
    request: Request
    #: Prompt bytes and category, to feed the calibrator (category None: not learned from).
    prompt_bytes: int
    category: str | None
    spilled: bool
    reason: str
    started: float
    deadline: float
    #: The admission ticket to complete (None: not under admission control).
    ticket: int | None = None
    #: The request body to forward when routing rewrote it (compressed), else None.
    body: bytes | None = None
    #: The prompt size the body was compressed to (0: not compressed).
    compress_target_tokens: int = 0
    released: bool = field(default=False, repr=False)

    @property
    def est_input_tokens(self) -> int:
        return self.request.est_input_tokens

    @property
    def est_output_tokens(self) -> int:
        return self.request.est_output_tokens

    @property
    def est_total_tokens(self) -> int:
        return self.request.est_input_tokens + self.request.est_output_tokens


class Engine:
    def __init__(
        self, config: Config, metrics: Metrics, calibrator: Calibrator | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.router = TokenBudgetRouter(
            [p.to_pool() for p in config.pools], calibrator, config.router.compress_band
        )
        self.compressor = Compressor()
        chooser = POLICIES[config.router.policy]
        self.choosers = {
            p.name: chooser(list(p.endpoints), config.router.prefix_block_size)
            for p in config.pools
        }
        self.admission = (
            admission_from_config(config.admission.spec) if config.admission.entitlements else None
        )
        self.keys = config.key_index()
        self.leases: OrderedDict[str, Lease] = OrderedDict()
        self._ids = itertools.count(1)
        self._prefix = f"{time.time_ns():x}"

    # -- tenants ------------------------------------------------------------

    def authenticate(
        self, key: str | bytes | None, now_unix: float
    ) -> TenantConfig | Reject | None:
        """The tenant owning ``key`` (None when no tenants are configured).

        A missing or unknown key is a 401, an expired one a 403. The key is
        never part of an error or a log line.
        """
        if not self.config.tenants:
            return None
        tenant = find_tenant(self.keys, key) if key else None
        if tenant is None:
            return self.refuse(None, 401, "unknown-key", "missing or unknown API key")
        if tenant.expires_at is not None and now_unix >= tenant.expires_at:
            return self.refuse(tenant, 403, "expired-key", "API key expired")
        return tenant

    def refuse(
        self,
        tenant: TenantConfig | None,
        status: int,
        reason: str,
        message: str,
        retry_after_s: float = 0.0,
    ) -> Reject:
        service_class = tenant.service_class if tenant is not None else "none"
        self.metrics.child(self.metrics.rejections, service_class, reason).inc()
        return Reject(status, reason, message, retry_after_s)

    # -- routing ------------------------------------------------------------

    def route_body(self, body: bytes, tenant: TenantConfig | None, now: float) -> Lease | Reject:
        """Routes an OpenAI request body (parse, route, compress: one Rust call).

        A malformed body is a 400. Under ``router.compress_band`` a borderline
        prompt is compressed to the smaller pool's budget and the lease carries
        the rewritten body; the calibrator then does not learn from its usage
        (the prompt it counted is not the one the model read).
        """
        limits = self.config.limits
        try:
            r = self.router.route_request(
                body,
                self.compressor,
                limits.default_max_tokens,
                image_tokens=limits.image_tokens,
                audio_tokens=limits.audio_tokens,
            )
        except ValueError as e:
            return self.refuse(tenant, 400, "malformed-body", f"invalid request body: {e}")
        d = r.decision
        if d.action == "compress":
            return self._place(d, tenant, 0, None, now, r.body, r.body)
        # The usage of image and audio parts is not text: such requests are not learned from.
        learn = None if r.media_tokens else r.category
        return self._place(d, tenant, r.prompt_bytes, learn, now, body)

    def route_fields(
        self,
        prompt_bytes: int,
        category: str,
        max_output_tokens: int,
        prompt_tokens: int | None,
        tenant: TenantConfig | None,
        now: float,
        token_ids: np.ndarray | None = None,
    ) -> Lease | Reject:
        """Routes a request given its measured fields (bad values are a 400)."""
        try:
            if prompt_tokens is not None:
                d = self.router.route_tokens(prompt_tokens, max_output_tokens)
            else:
                d = self.router.route(prompt_bytes, category, max_output_tokens)
        except (ValueError, KeyError) as e:
            return self.refuse(tenant, 400, "invalid-request", str(e).strip("'\""))
        learn = category if prompt_tokens is None else None
        return self._place(d, tenant, prompt_bytes, learn, now, token_ids)

    def route_default(self, tenant: TenantConfig | None, now: float) -> Lease | Reject:
        """The default pool, without a budget decision (nothing is known of the request).

        Used for bodyless requests and, under ``failure_mode: open``, when
        routing failed.
        """
        pool = self.config.server.default_pool
        self.router.set_in_flight(pool, self.router.in_flight(pool) + 1)
        return self._admit(pool, self._request(None, tenant, 1, 1), tenant, 0, None, now)

    @staticmethod
    def _request(key, tenant: TenantConfig | None, est_in: int, est_out: int) -> Request:
        return Request(key, tenant.name if tenant is not None else ANONYMOUS, est_in, est_out)

    def _place(
        self,
        d: RouteDecision,
        tenant: TenantConfig | None,
        prompt_bytes: int,
        category: str | None,
        now: float,
        key: bytes | np.ndarray | None,
        body: bytes | None = None,
    ) -> Lease | Reject:
        """Admits a pool decision on an endpoint of its pool, or refuses it."""
        if d.pool is None:
            return self.refuse(
                tenant,
                400,
                d.reason,
                f"request needs {d.est_total_tokens} tokens, more than any pool's context",
            )
        req = self._request(key, tenant, d.est_input_tokens, d.est_output_tokens)
        lease = self._admit(d.pool, req, tenant, prompt_bytes, category, now)
        if isinstance(lease, Lease):
            lease.spilled, lease.reason, lease.body = d.spilled, d.reason, body
            lease.compress_target_tokens = d.compress_target_tokens or 0
            if d.spilled:
                self.metrics.child(self.metrics.spillovers, d.pool).inc()
        return lease

    def _admit(
        self,
        pool: str,
        req: Request,
        tenant: TenantConfig | None,
        prompt_bytes: int,
        category: str | None,
        now: float,
    ) -> Lease | Reject:
        """Chooses the endpoint and runs admission; on refusal undoes both counts."""
        chooser = self.choosers[pool]
        endpoint = chooser.choose(req, now)
        if endpoint is None:
            self.router.complete(pool)
            return self.refuse(tenant, 503, "no-endpoint", f"pool {pool!r} has no endpoint")
        ticket = None
        if self.admission is not None and tenant is not None and tenant.entitlement:
            a = self.admission.admit(
                tenant.entitlement, req.est_input_tokens, req.est_output_tokens
            )
            if not a.admitted:
                chooser.release(endpoint, req, None, now)
                self.router.complete(pool)
                return self.refuse(
                    tenant,
                    a.status,
                    a.reason,
                    f"not admitted: {a.reason}",
                    a.retry_after_s or 0.0,
                )
            ticket = a.ticket
        lease = Lease(
            request_id=f"{self._prefix}-{next(self._ids)}",
            pool=pool,
            endpoint=endpoint,
            tenant=tenant,
            request=req,
            prompt_bytes=prompt_bytes,
            category=category,
            spilled=False,
            reason="default",
            started=now,
            deadline=now + self.config.limits.request_timeout_s,
            ticket=ticket,
        )
        self.leases[lease.request_id] = lease
        self.metrics.child(self.metrics.decisions, pool).inc()
        self.metrics.child(self.metrics.in_flight, pool, endpoint).inc()
        return lease

    # -- completion -----------------------------------------------------------

    def finish(
        self, lease: Lease, prompt_tokens: int | None, completion_tokens: int | None, now: float
    ) -> None:
        """Releases ``lease`` (idempotent) and learns from the usage when known:
        the calibrator, the endpoint chooser's state and the admission ticket."""
        if lease.released:
            return
        lease.released = True
        self.leases.pop(lease.request_id, None)
        self.router.complete(lease.pool)
        req = lease.request
        usage = (prompt_tokens, completion_tokens or 0) if prompt_tokens else None
        self.choosers[lease.pool].release(lease.endpoint, req, usage, now)
        self.metrics.child(self.metrics.in_flight, lease.pool, lease.endpoint).dec()
        if lease.ticket is not None and self.admission is not None:
            actual = usage if usage is not None else (req.est_input_tokens, 0)
            self.admission.complete(lease.ticket, actual[0], actual[1], now - lease.started)
        if usage and lease.category is not None and lease.prompt_bytes > 0:
            try:
                self.router.feedback(lease.prompt_bytes, lease.category, usage[0])
            except ValueError:
                return  # absurd usage from a backend: not learned from
            ratio = self.router.calibrator.ratio(lease.category)
            self.metrics.child(self.metrics.calibration_ratio, lease.category).set(ratio)

    def lease(self, request_id: str) -> Lease | None:
        return self.leases.get(request_id)

    def reap(self, now: float) -> int:
        """Releases every lease whose deadline has passed; returns how many.

        Leases share one timeout, so the oldest are first in ``leases``.
        """
        n = 0
        while self.leases:
            lease = next(iter(self.leases.values()))
            if lease.deadline > now:
                break
            self.metrics.child(self.metrics.timeouts, lease.pool).inc()
            self.finish(lease, None, None, now)
            n += 1
        return n

    def close(self) -> None:
        if self.admission is not None:
            self.admission.close()


class EngineHolder:
    """The current engine, swapped on reload, and the retired ones still holding leases."""

    def __init__(
        self, config: Config, metrics: Metrics, calibrator: Calibrator | None = None
    ) -> None:
        self.metrics = metrics
        self.engine = Engine(config, metrics, calibrator)
        self.retired: list[Engine] = []

    def reload(self, config: Config) -> None:
        """Routes new requests with ``config``; open leases finish where they began."""
        old = self.engine
        self.engine = Engine(config, self.metrics, old.router.calibrator)
        if old.leases:
            self.retired.append(old)
        else:
            old.close()

    def reap(self, now: float) -> int:
        n = self.engine.reap(now) + sum(e.reap(now) for e in self.retired)
        for e in self.retired:
            if not e.leases:
                e.close()
        self.retired = [e for e in self.retired if e.leases]
        return n
