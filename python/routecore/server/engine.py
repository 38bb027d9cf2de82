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
replicas share wall-clock time). The engine is used from one event loop thread;
a backend that blocks (Redis) is called on a bounded thread pool
(:data:`ADMISSION_THREADS`), so one slow call never holds the event loop:
routing awaits the decision, and a completion is handed to the pool and not
waited for.

Every path that ends a request ends in :meth:`Engine.finish`, which releases
what the lease holds exactly once (lease table, the router's in-flight count,
the endpoint chooser, the in-flight gauge, the admission ticket) even when one
of those steps fails. Usage that cannot be real (above ``MAX_TOKENS``) is not
learned from: it is logged and counted (``routecore_absurd_usage_total``) and
the ticket is completed with the estimate.

A SIGHUP reload builds a new engine that takes over the learned calibrator;
leases handed out before the reload are finished by the engine that issued
them, so open streams run to completion. When the admission section is
unchanged the new engine keeps the running admission backend (so an in-memory
backend keeps its tickets in flight); a changed one starts a new backend, and
an in-memory one takes a ticket for each request still in flight (Redis keeps
its state in Redis).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from routecore._core import Admission, Calibrator, Compressor, RouteDecision, TokenBudgetRouter
from routecore.admission import (
    MAX_TOKENS,
    AdmissionBackend,
    InMemoryAdmission,
    admission_from_config,
)
from routecore.config import Config, TenantConfig, find_tenant
from routecore.server.endpoints import POLICIES, Request
from routecore.server.logs import log
from routecore.server.metrics import Metrics

#: The VTC user of requests from no tenant (when no tenants are configured).
ANONYMOUS = "anonymous"
#: Threads that call a blocking admission backend (Redis): at most this many
#: calls wait on it at once; more queue for a thread.
ADMISSION_THREADS = 32


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
    #: Tickets taken for this request in newer in-memory backends (see :meth:`Engine.adopt`).
    adopted: list[tuple[AdmissionBackend, int]] = field(default_factory=list, repr=False)
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
    """``admission``: a running backend to share (a reload with an unchanged
    admission section); by default one is built from the configuration.
    ``executor``: the thread pool for a blocking backend's calls."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        calibrator: Calibrator | None = None,
        admission: AdmissionBackend | None = None,
        executor: concurrent.futures.Executor | None = None,
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
        if admission is None and config.admission.entitlements:
            admission = admission_from_config(config.admission.spec)
        self.admission = admission
        #: Whether :meth:`close` closes the backend (False once a newer engine shares it).
        self.owns_admission = True
        self.executor = executor
        #: Completions handed to the thread pool and not done yet.
        self.pending: set[concurrent.futures.Future] = set()
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

    async def decide(
        self, tenant: TenantConfig | None, route: Callable[[], Awaitable[Lease | Reject]]
    ) -> Lease | Reject:
        """Runs a routing call under ``server.failure_mode``: when it fails, open
        sends the request to the default pool (not put to admission again: the
        failure is handled once), closed refuses with 503. The client never sees
        the failure's detail; it is logged as ``route-failed``."""
        try:
            return await route()
        except Exception:
            mode = self.config.server.failure_mode
            self.metrics.child(self.metrics.failures, mode).inc()
            log(logging.ERROR, "route-failed", exc_info=True, failure_mode=mode)
            if mode == "open":
                try:
                    return await self.route_default(tenant, time.monotonic(), admit=False)
                except Exception:
                    log(logging.ERROR, "route-failed", exc_info=True, failure_mode=mode)
            return self.refuse(tenant, 503, "internal-error", "routing failed")

    async def route_body(
        self, body: bytes, tenant: TenantConfig | None, now: float
    ) -> Lease | Reject:
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
            return await self._place(d, tenant, 0, None, now, r.body, r.body)
        # The usage of image and audio parts is not text: such requests are not learned from.
        learn = None if r.media_tokens else r.category
        return await self._place(d, tenant, r.prompt_bytes, learn, now, body)

    async def route_fields(
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
        return await self._place(d, tenant, prompt_bytes, learn, now, token_ids)

    async def route_default(
        self, tenant: TenantConfig | None, now: float, admit: bool = True
    ) -> Lease | Reject:
        """The default pool, without a budget decision (nothing is known of the request).

        Used for bodyless requests and, under ``failure_mode: open``, when
        routing failed; then ``admit=False``: the request is not put to
        admission again (it goes unaccounted, as a Redis backend's fail-open).
        """
        pool = self.config.server.default_pool
        self.router.set_in_flight(pool, self.router.in_flight(pool) + 1)
        req = self._request(None, tenant, 1, 1)
        return await self._admit(pool, req, tenant if admit else None, 0, None, now, tenant)

    @staticmethod
    def _request(key, tenant: TenantConfig | None, est_in: int, est_out: int) -> Request:
        return Request(key, tenant.name if tenant is not None else ANONYMOUS, est_in, est_out)

    async def _place(
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
        lease = await self._admit(d.pool, req, tenant, prompt_bytes, category, now)
        if isinstance(lease, Lease):
            lease.spilled, lease.reason, lease.body = d.spilled, d.reason, body
            lease.compress_target_tokens = d.compress_target_tokens or 0
            if d.spilled:
                self.metrics.child(self.metrics.spillovers, d.pool).inc()
        return lease

    async def _admit(
        self,
        pool: str,
        req: Request,
        tenant: TenantConfig | None,
        prompt_bytes: int,
        category: str | None,
        now: float,
        owner: TenantConfig | None = None,
    ) -> Lease | Reject:
        """Chooses the endpoint and runs admission for ``tenant`` (the router
        counted the request in ``pool`` already); on refusal, failure or
        cancellation undoes both counts. ``owner``: the lease's tenant when it
        is not put to admission."""
        chooser = self.choosers[pool]
        try:
            endpoint = chooser.choose(req, now)
        except BaseException:
            self.router.complete(pool)
            raise
        if endpoint is None:
            self.router.complete(pool)
            return self.refuse(tenant, 503, "no-endpoint", f"pool {pool!r} has no endpoint")
        try:
            a = await self._admission(tenant, req)
        except BaseException:
            chooser.release(endpoint, req, None, now)
            self.router.complete(pool)
            raise
        if a is not None and not a.admitted:
            chooser.release(endpoint, req, None, now)
            self.router.complete(pool)
            return self.refuse(
                tenant, a.status, a.reason, f"not admitted: {a.reason}", a.retry_after_s or 0.0
            )
        lease = Lease(
            request_id=f"{self._prefix}-{next(self._ids)}",
            pool=pool,
            endpoint=endpoint,
            tenant=tenant if tenant is not None else owner,
            request=req,
            prompt_bytes=prompt_bytes,
            category=category,
            spilled=False,
            reason="default",
            started=now,
            deadline=now + self.config.limits.request_timeout_s,
            ticket=a.ticket if a is not None else None,
        )
        self.leases[lease.request_id] = lease
        self.metrics.child(self.metrics.decisions, pool).inc()
        self.metrics.child(self.metrics.in_flight, pool, endpoint).inc()
        return lease

    async def _admission(self, tenant: TenantConfig | None, req: Request) -> Admission | None:
        """The admission decision for ``tenant`` (None: not under admission).

        A blocking backend is called on the thread pool. If the caller is
        cancelled while the call runs, the ticket it comes back with is
        completed at once: nothing is left reserved.
        """
        admission = self.admission
        if admission is None or tenant is None or not tenant.entitlement:
            return None
        entitlement = tenant.entitlement

        def call() -> Admission:
            return admission.admit(entitlement, req.est_input_tokens, req.est_output_tokens)

        if not self.blocking:
            return call()
        fut = asyncio.get_running_loop().run_in_executor(self.executor, call)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: self._abandoned(f, req))
            raise

    def _abandoned(self, fut: asyncio.Future, req: Request) -> None:
        """Completes the ticket of an admission whose request went away meanwhile."""
        if fut.cancelled() or fut.exception() is not None:
            return
        ticket = fut.result().ticket
        if ticket is not None:
            self._complete_ticket(ticket, req.est_input_tokens, 0, 0.0)

    @property
    def blocking(self) -> bool:
        """Whether admission calls may block (anything but the in-memory backend)."""
        return self.executor is not None and not isinstance(
            self.admission, (InMemoryAdmission, type(None))
        )

    # -- completion -----------------------------------------------------------

    def finish(
        self, lease: Lease, prompt_tokens: int | None, completion_tokens: int | None, now: float
    ) -> None:
        """Releases ``lease`` (idempotent) and learns from the usage when known:
        the calibrator, the endpoint chooser's state and the admission ticket.

        Each release step runs even when another one fails (the failure is
        logged as ``release-failed``); usage that cannot be real is ignored.
        """
        if lease.released:
            return
        lease.released = True
        usage = self._usage(lease, prompt_tokens, completion_tokens)
        req = lease.request
        steps: tuple[Callable[[], object], ...] = (
            lambda: self.leases.pop(lease.request_id, None),
            lambda: self.router.complete(lease.pool),
            lambda: self.choosers[lease.pool].release(lease.endpoint, req, usage, now),
            lambda: self.metrics.child(self.metrics.in_flight, lease.pool, lease.endpoint).dec(),
            lambda: self._complete_lease_ticket(lease, usage, now),
            lambda: self._learn(lease, usage),
        )
        for step in steps:
            try:
                step()
            except Exception:
                log(logging.ERROR, "release-failed", exc_info=True, request_id=lease.request_id)

    def _usage(
        self, lease: Lease, prompt_tokens: int | None, completion_tokens: int | None
    ) -> tuple[int, int] | None:
        """The usage to learn from: None when not reported (0 prompt tokens) or
        when it cannot be real (logged and counted)."""
        if not prompt_tokens:
            return None
        completion = completion_tokens or 0
        if not (0 < prompt_tokens <= MAX_TOKENS and 0 <= completion <= MAX_TOKENS):
            self.metrics.child(self.metrics.absurd_usage, lease.pool).inc()
            log(
                logging.WARNING,
                "absurd-usage",
                request_id=lease.request_id,
                pool=lease.pool,
                endpoint=lease.endpoint,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
            )
            return None
        return prompt_tokens, completion

    def _complete_lease_ticket(
        self, lease: Lease, usage: tuple[int, int] | None, now: float
    ) -> None:
        if lease.ticket is None:
            return
        req = lease.request
        actual_in, actual_out = usage if usage is not None else (req.est_input_tokens, 0)
        latency_s = max(now - lease.started, 0.0)
        self._complete_ticket(lease.ticket, actual_in, actual_out, latency_s)
        for backend, ticket in lease.adopted:  # in memory: never blocks
            backend.complete(ticket, actual_in, actual_out, latency_s)

    def adopt(self, leases: list[Lease]) -> int:
        """Counts requests admitted by older engines in this engine's in-memory
        backend (a reload that changed the admission section): each takes a
        ticket under its entitlement, as far as the new entitlements allow, and
        completes it when its lease ends. Returns how many were adopted."""
        admission = self.admission
        n = 0
        for lease in leases:
            tenant = lease.tenant
            if admission is None or lease.ticket is None or tenant is None:
                continue
            if not tenant.entitlement:
                continue
            req = lease.request
            a = admission.admit(tenant.entitlement, req.est_input_tokens, req.est_output_tokens)
            if a.admitted and a.ticket is not None:
                lease.adopted.append((admission, a.ticket))
                n += 1
        return n

    def _complete_ticket(
        self, ticket: int, actual_in: int, actual_out: int, latency_s: float
    ) -> None:
        """Completes an admission ticket: at once in memory, on the thread pool
        for a blocking backend (not waited for)."""
        admission = self.admission
        if admission is None:
            return

        def call() -> None:
            try:
                admission.complete(ticket, actual_in, actual_out, latency_s)
            except Exception:
                log(logging.ERROR, "admission-complete-failed", exc_info=True)

        if not self.blocking:
            call()
            return
        fut = self.executor.submit(call)
        self.pending.add(fut)
        fut.add_done_callback(self.pending.discard)

    def _learn(self, lease: Lease, usage: tuple[int, int] | None) -> None:
        if not usage or lease.category is None or lease.prompt_bytes <= 0:
            return
        try:
            self.router.feedback(lease.prompt_bytes, lease.category, usage[0])
        except ValueError:
            return  # a ratio the calibrator refuses: not learned from
        ratio = self.router.calibrator.ratio(lease.category)
        self.metrics.child(self.metrics.calibration_ratio, lease.category).set(ratio)

    def drain(self, timeout: float | None = None) -> None:
        """Waits for the completions handed to the thread pool (tests, shutdown)."""
        concurrent.futures.wait(list(self.pending), timeout)

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
        """Closes the admission backend if this engine owns it, once its pending
        completions are done (on the thread pool: the event loop never waits)."""
        admission = self.admission
        if admission is None or not self.owns_admission:
            return
        if not self.blocking:
            admission.close()
            return
        pending = list(self.pending)
        self.executor.submit(lambda: (concurrent.futures.wait(pending), admission.close()))


class EngineHolder:
    """The current engine, swapped on reload, and the retired ones still holding leases.

    The thread pool for blocking admission calls is the holder's, shared by its engines.
    """

    def __init__(
        self, config: Config, metrics: Metrics, calibrator: Calibrator | None = None
    ) -> None:
        self.metrics = metrics
        self.executor = concurrent.futures.ThreadPoolExecutor(
            ADMISSION_THREADS, thread_name_prefix="routecore-admission"
        )
        self.engine = Engine(config, metrics, calibrator, executor=self.executor)
        self.retired: list[Engine] = []

    def reload(self, config: Config) -> None:
        """Routes new requests with ``config``; open leases finish where they began.

        An unchanged admission section keeps the running backend (its
        tickets in flight stay counted); a changed one with the in-memory
        backend adopts the requests in flight (:meth:`Engine.adopt`). Errors
        building the new engine are raised and leave the running one in place.
        """
        old = self.engine
        shared = old.admission if config.admission.spec == old.config.admission.spec else None
        engine = Engine(config, self.metrics, old.router.calibrator, shared, self.executor)
        if shared is not None:
            old.owns_admission = False
        elif isinstance(engine.admission, InMemoryAdmission):
            engine.adopt([lease for e in self.engines for lease in e.leases.values()])
        self.engine = engine
        if old.leases:
            self.retired.append(old)
        else:
            old.close()

    @property
    def engines(self) -> tuple[Engine, ...]:
        return (self.engine, *self.retired)

    def reap(self, now: float) -> int:
        n = self.engine.reap(now) + sum(e.reap(now) for e in self.retired)
        for e in self.retired:
            if not e.leases:
                e.close()
        self.retired = [e for e in self.retired if e.leases]
        return n

    async def reconcile(self) -> None:
        """Settles, on the thread pool, what failed admission calls left behind
        (a Redis backend's lost admits and failed completions) once Redis answers."""
        backends = {id(e.admission): e.admission for e in self.engines if e.admission is not None}
        loop = asyncio.get_running_loop()
        for admission in backends.values():
            if admission.pending():
                await loop.run_in_executor(self.executor, admission.reconcile)

    def close(self) -> None:
        """Closes every engine and the thread pool (at shutdown)."""
        for engine in self.engines:
            engine.close()
        self.executor.shutdown(wait=True)
