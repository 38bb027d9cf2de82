"""The routing state behind both gRPC front ends (RouteCore and ext_proc).

One :class:`Engine` is built from one :class:`~routecore.config.Config`. It
authenticates the tenant, parses the request in Rust, chooses the pool with
the core's :class:`~routecore.TokenBudgetRouter` and the endpoint inside it,
and hands out a :class:`Lease` that stays in flight until :meth:`Engine.finish`
(the response came back) or :meth:`Engine.reap` (it never did, and the
request timeout passed). Every method takes the time (``time.monotonic()``
seconds) explicitly. The engine is used from one event loop thread.

A SIGHUP reload builds a new engine that takes over the learned calibrator;
leases handed out before the reload are finished by the engine that issued
them, so open streams run to completion.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from routecore._core import Compressor, RouteDecision, TokenBudgetRouter
from routecore.config import Config, TenantConfig, find_tenant
from routecore.server.metrics import Metrics


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
    #: Prompt bytes and category, to feed the calibrator (category None: token ids).
    prompt_bytes: int
    category: str | None
    est_input_tokens: int
    est_output_tokens: int
    est_total_tokens: int
    spilled: bool
    reason: str
    started: float
    deadline: float
    #: The request body to forward when routing rewrote it (compressed), else None.
    body: bytes | None = None
    #: The prompt size the body was compressed to (0: not compressed).
    compress_target_tokens: int = 0
    released: bool = field(default=False, repr=False)


class Engine:
    def __init__(self, config: Config, metrics: Metrics, previous: Engine | None = None) -> None:
        self.config = config
        self.metrics = metrics
        calibrator = previous.router.calibrator if previous is not None else None
        self.router = TokenBudgetRouter(
            [p.to_pool() for p in config.pools], calibrator, config.router.compress_band
        )
        self.compressor = Compressor()
        self.endpoints = {p.name: list(p.endpoints) for p in config.pools}
        self.endpoint_load = {p.name: dict.fromkeys(p.endpoints, 0) for p in config.pools}
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
        service_class = tenant.service_class if tenant is not None else ""
        self.metrics.rejections.labels(service_class, reason).inc()
        return Reject(status, reason, message, retry_after_s)

    # -- routing ------------------------------------------------------------

    def route_body(self, body: bytes, tenant: TenantConfig | None, now: float) -> Lease | Reject:
        """Routes an OpenAI request body (parse, route, compress: one Rust call).

        A malformed body is a 400. Under ``router.compress_band`` a borderline
        prompt is compressed to the smaller pool's budget and the lease carries
        the rewritten body; the calibrator then does not learn from its usage
        (the prompt it counted is not the one the model read).
        """
        try:
            r = self.router.route_request(
                body, self.compressor, self.config.limits.default_max_tokens
            )
        except ValueError as e:
            return self.refuse(tenant, 400, "malformed-body", f"invalid request body: {e}")
        d = r.decision
        if d.action == "compress":
            return self._place(d, tenant, 0, None, now, r.body)
        return self._place(d, tenant, r.prompt_bytes, r.category, now)

    def route_fields(
        self,
        prompt_bytes: int,
        category: str,
        max_output_tokens: int,
        prompt_tokens: int | None,
        tenant: TenantConfig | None,
        now: float,
    ) -> Lease | Reject:
        """Routes a request given its measured fields (bad values are a 400)."""
        try:
            if prompt_tokens is not None:
                d = self.router.route_tokens(prompt_tokens, max_output_tokens)
            else:
                d = self.router.route(prompt_bytes, category, max_output_tokens)
        except (ValueError, KeyError) as e:
            return self.refuse(tenant, 400, "invalid-request", str(e).strip("'\""))
        return self._place(
            d, tenant, prompt_bytes, category if prompt_tokens is None else None, now
        )

    def _place(
        self,
        d: RouteDecision,
        tenant: TenantConfig | None,
        prompt_bytes: int,
        category: str | None,
        now: float,
        body: bytes | None = None,
    ) -> Lease | Reject:
        """The endpoint for a pool decision, or the refusal."""
        if d.pool is None:
            return self.refuse(
                tenant,
                400,
                d.reason,
                f"request needs {d.est_total_tokens} tokens, more than any pool's context",
            )
        endpoint = self.choose_endpoint(d.pool)
        if endpoint is None:
            self.router.complete(d.pool)
            return self.refuse(tenant, 503, "no-endpoint", f"pool {d.pool!r} has no endpoint")
        if d.spilled:
            self.metrics.spillovers.labels(d.pool).inc()
        lease = self._lease(
            d.pool,
            endpoint,
            tenant,
            prompt_bytes,
            category,
            d.est_input_tokens,
            d.est_output_tokens,
            d.spilled,
            d.reason,
            now,
        )
        lease.body = body
        lease.compress_target_tokens = d.compress_target_tokens or 0
        return lease

    def route_default(self, tenant: TenantConfig | None, now: float) -> Lease | Reject:
        """The default pool's least-loaded endpoint, without a budget decision.

        Used for bodyless requests and, under ``failure_mode: open``, when
        routing failed.
        """
        pool = self.config.server.default_pool
        endpoint = self.choose_endpoint(pool)
        if endpoint is None:
            return self.refuse(tenant, 503, "no-endpoint", f"pool {pool!r} has no endpoint")
        self.router.set_in_flight(pool, self.router.in_flight(pool) + 1)
        return self._lease(pool, endpoint, tenant, 0, None, 0, 0, False, "default", now)

    def choose_endpoint(self, pool: str) -> str | None:
        """The endpoint with the fewest requests in flight (least-request)."""
        load = self.endpoint_load[pool]
        if not load:
            return None
        return min(load, key=load.__getitem__)

    def _lease(
        self, pool, endpoint, tenant, prompt_bytes, category, est_in, est_out, spilled, reason, now
    ) -> Lease:
        self.endpoint_load[pool][endpoint] += 1
        lease = Lease(
            request_id=f"{self._prefix}-{next(self._ids)}",
            pool=pool,
            endpoint=endpoint,
            tenant=tenant,
            prompt_bytes=prompt_bytes,
            category=category,
            est_input_tokens=est_in,
            est_output_tokens=est_out,
            est_total_tokens=est_in + est_out,
            spilled=spilled,
            reason=reason,
            started=now,
            deadline=now + self.config.limits.request_timeout_s,
        )
        self.leases[lease.request_id] = lease
        self.metrics.decisions.labels(pool).inc()
        self.metrics.in_flight.labels(pool, endpoint).inc()
        return lease

    # -- completion -----------------------------------------------------------

    def finish(
        self, lease: Lease, prompt_tokens: int | None, completion_tokens: int | None, now: float
    ) -> None:
        """Releases ``lease`` (idempotent) and learns from the usage, when known."""
        if lease.released:
            return
        lease.released = True
        self.leases.pop(lease.request_id, None)
        self.router.complete(lease.pool)
        load = self.endpoint_load[lease.pool]
        load[lease.endpoint] -= 1
        self.metrics.in_flight.labels(lease.pool, lease.endpoint).dec()
        if prompt_tokens and lease.category is not None and lease.prompt_bytes > 0:
            try:
                self.router.feedback(lease.prompt_bytes, lease.category, prompt_tokens)
            except ValueError:
                return  # absurd usage from a backend: not learned from
            ratio = self.router.calibrator.ratio(lease.category)
            self.metrics.calibration_ratio.labels(lease.category).set(ratio)

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
            self.metrics.timeouts.labels(lease.pool).inc()
            self.finish(lease, None, None, now)
            n += 1
        return n


class EngineHolder:
    """The current engine, swapped on reload, and the retired ones still holding leases."""

    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.metrics = metrics
        self.engine = Engine(config, metrics)
        self.retired: list[Engine] = []

    def reload(self, config: Config) -> None:
        """Routes new requests with ``config``; open leases finish where they began."""
        old = self.engine
        self.engine = Engine(config, self.metrics, previous=old)
        if old.leases:
            self.retired.append(old)

    def reap(self, now: float) -> int:
        n = self.engine.reap(now) + sum(e.reap(now) for e in self.retired)
        self.retired = [e for e in self.retired if e.leases]
        return n
