"""One request in flight as one lease.

A request that is routed to a token-budget pool, sent to an endpoint and
admitted against a quota holds three things: the pool's in-flight count
(``TokenBudgetRouter``), the endpoint's (``EndpointPicker``) and the admission
reservation (``AdmissionBackend``). ``Dispatcher.acquire`` takes all three in
one call and returns a ``Lease`` that gives them back together, exactly once:
on leaving its ``with`` block (normally or by an exception) or on
``release()``. A second ``release()`` raises ``NotInFlightError``, the error
every ``complete`` raises for the same mistake.

If a step refuses (the router rejects, admission throttles, no endpoint is
healthy), what the earlier steps took is given back and ``RequestRefused``
says which step refused, with the HTTP status a gateway would answer.

Flow control in process (``acquire(..., wait=seconds)``): a request that
admission refuses with 429 (a quota or an entitlement at its limit) or that
finds no endpoint (503) holds nothing and waits in the dispatcher's
``FlowQueue`` (the Rust discipline of the data plane and the simulator:
bands per service class, fairness across entitlements, a TTL) instead of
being refused; each lease released dispatches the next waiter by the
discipline, which runs the steps again. After ``wait`` seconds (or the
band's TTL, or when a higher band displaces it from a full queue) it is
refused with ``step="queue"``, 429 and a Retry-After. A waiter that is
interrupted (KeyboardInterrupt, any exception in its thread) leaves the
queue and holds nothing. ``acquire_async(..., wait=seconds)`` is the same
for asyncio: it waits without blocking the loop, and a cancelled task leaves
the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import operator
import threading
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

from routecore._core import (
    Admission,
    DispatchSteps,
    EndpointPicker,
    FlowQueue,
    NotInFlightError,
    RouteDecision,
    TokenBudgetRouter,
    monotonic,
)
from routecore.admission import MAX_TOKENS
from routecore.admission.backend import AdmissionBackend
from routecore.admission.memory import InMemoryAdmission


class RequestRefused(Exception):
    """A step of ``Dispatcher.acquire`` refused the request; nothing is held.

    ``step``: ``"route"`` (no pool holds it, 413), ``"admission"`` (the
    admission decision's status: 401, 403, 413, 429 or 503, with
    ``retry_after_s``), ``"endpoint"`` (no endpoint passes the health and
    subset filters, 503) or ``"queue"`` (``acquire(wait=...)``: 429 with
    ``retry_after_s`` after waiting its time, its band's TTL, or displaced;
    or the queue's refusal when it is full)."""

    def __init__(
        self, step: str, status: int, reason: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{step} refused the request: {status} {reason}")
        self.step = step
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


class _Ask(NamedTuple):
    """One request's arguments to the steps (``acquire``'s keywords but
    ``wait`` and ``service_class``), gathered once by each driver (a tuple:
    a frozen dataclass costs a microsecond per request)."""

    max_output_tokens: int
    prompt_bytes: int | None
    category: str
    input_tokens: int | None
    entitlement: str | None
    tokens: Any
    fairness_id: str | None
    session: str | None
    now: float | None


@dataclass
class _Held:
    """What one request holds (filled as ``acquire``'s steps succeed) and the
    estimates its release corrects."""

    max_output_tokens: int
    fairness_id: str | None
    now: float | None
    input_tokens: int = 0
    decision: RouteDecision | None = None
    admission: Admission | None = None
    endpoint: str | None = None
    prefill_endpoint: str | None = None


class Lease:
    """What one request holds, released together exactly once.

    ``decision`` / ``pool``: the token-budget decision and pool (None without
    a router); ``endpoint``: the chosen endpoint (None without a picker), the
    decode endpoint of a request split by its picker's roles, whose prefill
    endpoint is ``prefill_endpoint`` (None when not split; both are released
    together);
    ``admission``: the admission decision (None without admission);
    ``input_tokens`` / ``max_output_tokens``: the estimates it was taken with.
    Report what the request really used with ``record_usage`` (or pass it to
    ``release``); without it the release charges ``input_tokens`` and no
    output. Use it as a context manager, or call ``release`` once; both may
    be called from any thread."""

    def __init__(self, dispatcher: Dispatcher, held: _Held) -> None:
        self._dispatcher = dispatcher
        self._held = held
        self._started_at = monotonic()
        self._usage: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._released = False

    @property
    def decision(self) -> RouteDecision | None:
        return self._held.decision

    @property
    def pool(self) -> str | None:
        return None if self._held.decision is None else self._held.decision.pool

    @property
    def endpoint(self) -> str | None:
        return self._held.endpoint

    @property
    def prefill_endpoint(self) -> str | None:
        return self._held.prefill_endpoint

    @property
    def admission(self) -> Admission | None:
        return self._held.admission

    @property
    def input_tokens(self) -> int:
        return self._held.input_tokens

    @property
    def max_output_tokens(self) -> int:
        return self._held.max_output_tokens

    @property
    def released(self) -> bool:
        return self._released

    def record_usage(self, input_tokens: int, output_tokens: int) -> None:
        """What the request really used (``usage.prompt_tokens`` and
        ``usage.completion_tokens``), charged when the lease is released.
        ValueError for counts outside [0, MAX_TOKENS]."""
        self._usage = (
            _tokens("input_tokens", input_tokens),
            _tokens("output_tokens", output_tokens),
        )

    def release(
        self,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        now: float | None = None,
    ) -> None:
        """Gives back the endpoint, the admission reservation and the pool
        (every part is attempted; the first error is raised after).
        ``input_tokens`` / ``output_tokens`` override ``record_usage``.
        ``now`` is passed to the parts (None: their clocks); the admission
        latency is the time since ``acquire`` on ``routecore.monotonic``, or
        on the explicit clock when both calls were given ``now``.
        ``NotInFlightError`` when already released; bad counts raise
        ValueError first, with everything still held."""
        if input_tokens is not None and output_tokens is not None:
            self.record_usage(input_tokens, output_tokens)
        if now is not None and not math.isfinite(now):
            raise ValueError(f"now must be a finite number, got {now}")
        with self._lock:
            if self._released:
                raise NotInFlightError("release: the lease is released already")
            self._released = True
        usage = self._usage or (self._held.input_tokens, 0)
        if now is None or self._held.now is None:
            latency = monotonic() - self._started_at
        else:
            latency = now - self._held.now
        self._dispatcher._give_back(self._held, usage, max(latency, 0.0), now)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:
            done = self._released
        if not done:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        prefill = self.prefill_endpoint
        split = "" if prefill is None else f", prefill_endpoint={prefill!r}"
        return f"Lease(pool={self.pool!r}, endpoint={self.endpoint!r}{split}, {state})"


class Dispatcher:
    """Routes, chooses and admits a request in one call (``acquire``).

    ``router``: a ``TokenBudgetRouter`` choosing the pool; ``pickers``: one
    ``EndpointPicker`` for every request, or a mapping from pool name to the
    picker of that pool's endpoints; ``admission``: an ``AdmissionBackend``
    (``InMemoryAdmission``, ``RedisAdmission``). Each part is optional; give
    at least one. ``flow``: the queue of ``acquire(wait=...)``, the data
    plane's ``flow`` mapping (bands, fairness, ordering, limits, TTL); None:
    one band per service class with the paper's weights as shares and the
    token-pool debt fairness.

    The parts are fixed at construction (``router``, ``pickers`` and
    ``admission`` are read-only). When every part given is routecore's own
    (a ``TokenBudgetRouter``, ``EndpointPicker`` objects, an
    ``InMemoryAdmission``), ``acquire`` and a lease's release run in Rust, one
    call each (the data plane's step order, ``DispatchSteps``); with a
    ``RedisAdmission`` or any other Python object the same steps run in
    Python. Both give the same leases and leave the parts in the same
    state."""

    def __init__(
        self,
        router: TokenBudgetRouter | None = None,
        pickers: EndpointPicker | Mapping[str, EndpointPicker] | None = None,
        admission: AdmissionBackend | None = None,
        flow: Mapping[str, Any] | None = None,
    ) -> None:
        if router is None and pickers is None and admission is None:
            raise ValueError("give a router, pickers or admission")
        if isinstance(pickers, Mapping):
            if router is None:
                raise ValueError("pickers per pool need a router to choose the pool")
            pools = [p.name for p in router.pools]
            unknown = [name for name in pickers if name not in pools]
            if unknown:
                raise KeyError(f"pickers for pools the router has not: {unknown} (pools: {pools})")
        self._router = router
        self._pickers = pickers
        self._admission = admission
        # Sorted out once (an isinstance on an ABC costs a microsecond per call).
        self._by_pool: Mapping[str, EndpointPicker] | None = None
        self._for_all: EndpointPicker | None = None
        if isinstance(pickers, Mapping):
            self._by_pool = pickers
        else:
            self._for_all = pickers
        self._native = _native_steps(router, pickers, admission)
        self.queue = FlowQueue(flow)
        # Guards the queue's waiters and the count of leases held.
        self._turns = threading.Condition()
        self._leases = 0
        self._turning = 0  # waiters dispatched whose try is not over

    @property
    def router(self) -> TokenBudgetRouter | None:
        return self._router

    @property
    def pickers(self) -> EndpointPicker | Mapping[str, EndpointPicker] | None:
        return self._pickers

    @property
    def admission(self) -> AdmissionBackend | None:
        return self._admission

    def acquire(
        self,
        *,
        max_output_tokens: int,
        prompt_bytes: int | None = None,
        category: str = "prose",
        input_tokens: int | None = None,
        entitlement: str | None = None,
        tokens: Any = None,
        fairness_id: str | None = None,
        session: str | None = None,
        now: float | None = None,
        wait: float | None = None,
        service_class: str | None = None,
    ) -> Lease:
        """Routes (``prompt_bytes``, ``category``, ``max_output_tokens``), admits
        (``entitlement`` with the input estimate and ``max_output_tokens``) and
        picks the endpoint (``tokens`` for prefix affinity, ``fairness_id``,
        ``session``), in that order. ``prompt_bytes`` defaults to the UTF-8
        length of ``tokens`` when it is ``str`` or ``bytes``; ``input_tokens``
        to the router's estimate (needed for admission without a router).
        Raises ``RequestRefused`` (nothing held) when a step refuses, and bad
        arguments raise as each part does, also with nothing held.

        ``wait`` (seconds, > 0; needs ``now`` None): when admission refuses
        with 429 or no endpoint is found, wait up to that long in the
        dispatcher's queue (see the module docs) in the band of
        ``service_class`` (a service class or objective; None: the default
        band), the entitlement (else ``fairness_id``) as its flow, weighted by
        the entitlement's priority; blocks the calling thread."""
        ask = _Ask(
            max_output_tokens,
            prompt_bytes,
            category,
            input_tokens,
            entitlement,
            tokens,
            fairness_id,
            session,
            now,
        )
        if wait is None:
            return self._acquire_now(ask)
        steps = self._waiting(ask, wait, service_class)
        try:
            waiter = next(steps)
            while True:
                try:
                    with self._turns:
                        while not self._poll(waiter):
                            self._turns.wait(POLL_S)
                except BaseException as e:  # KeyboardInterrupt: leave the queue
                    waiter = steps.throw(e)
                else:
                    waiter = next(steps)
        except StopIteration as done:
            lease: Lease = done.value
            return lease

    async def acquire_async(
        self,
        *,
        max_output_tokens: int,
        wait: float,
        prompt_bytes: int | None = None,
        category: str = "prose",
        input_tokens: int | None = None,
        entitlement: str | None = None,
        tokens: Any = None,
        fairness_id: str | None = None,
        session: str | None = None,
        service_class: str | None = None,
    ) -> Lease:
        """``acquire(..., wait=wait)`` for asyncio: waits in the same queue
        without blocking the event loop; a cancelled task (``task.cancel()``,
        ``asyncio.timeout``) leaves the queue and holds nothing."""
        ask = _Ask(
            max_output_tokens,
            prompt_bytes,
            category,
            input_tokens,
            entitlement,
            tokens,
            fairness_id,
            session,
            None,
        )
        loop = asyncio.get_running_loop()
        steps = self._waiting(ask, wait, service_class)
        try:
            waiter = next(steps)
            while True:
                woken = asyncio.Event()
                waiter.wake = functools.partial(loop.call_soon_threadsafe, woken.set)
                try:
                    while True:
                        with self._turns:
                            if self._poll(waiter):
                                break
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(woken.wait(), POLL_S)
                except BaseException as e:  # cancelled: leave the queue
                    waiter = steps.throw(e)
                else:
                    waiter = next(steps)
        except StopIteration as done:
            lease: Lease = done.value
            return lease

    def _waiting(
        self, ask: _Ask, wait: float, service_class: str | None
    ) -> Generator[_Waiter, None, Lease]:
        """The loop of ``acquire(wait=...)``, for a blocking or an asyncio
        driver: tries the steps and, while they refuse for capacity, yields the
        waiter it queued for the driver to wait on (``_poll`` says when it has
        left the queue); an exception thrown in leaves the queue; returns the
        lease."""
        if isinstance(wait, bool) or not (isinstance(wait, (int, float)) and 0 < wait < math.inf):
            raise ValueError(f"wait must be a finite number of seconds > 0, got {wait!r}")
        if ask.now is not None:
            raise ValueError("wait needs now=None: waiting runs on routecore.monotonic")
        band = self.queue.band_of(service_class)
        deadline = monotonic() + wait
        with self._turns:  # others waiting: queue behind them, not past them
            behind = len(self.queue) > 0 or self._turning > 0
        turn = False  # dispatched from the queue, its try not over yet
        while True:
            try:
                if not behind:
                    return self._acquire_now(ask)
            except RequestRefused as refused:
                if not _may_wait(refused):
                    raise
            finally:
                if turn:
                    turn = False
                    with self._turns:
                        self._turning -= 1
            behind = False
            entitlement = ask.entitlement
            cost = float(max((ask.input_tokens or 0) + ask.max_output_tokens, 1))
            weight = 1.0
            if self.admission is not None and entitlement is not None:
                weight = max(self.admission.priority(entitlement), MIN_WEIGHT)
            flow = entitlement or ask.fairness_id or "default"
            waiter = _Waiter(deadline)
            with self._turns:
                ticket, status, retry, displaced = self.queue.enqueue(
                    band, flow, waiter, cost=cost, weight=weight
                )
                self._settle(displaced)
            if ticket is None:
                raise RequestRefused("queue", 429, status, retry)
            waiter.ticket = ticket
            try:
                yield waiter
            except BaseException:
                with self._turns:
                    if waiter.outcome is None:
                        self.queue.cancel(ticket)
                    elif waiter.outcome == "dispatched":
                        self._turning -= 1
                        self._dispatch_next()  # its turn goes to the next waiter
                raise
            if waiter.outcome != "dispatched":
                raise RequestRefused(
                    "queue", 429, str(waiter.outcome), self.queue.retry_after_s(band)
                )
            turn = True

    def _poll(self, waiter: _Waiter) -> bool:
        """Under ``_turns``: whether ``waiter`` has left the queue, after
        expiring what is due, ending its wait at its deadline and, when no
        lease is held (nothing will release), giving the next waiter its turn."""
        if waiter.outcome is None:
            self._settle(self.queue.expire())
        if waiter.outcome is None and monotonic() >= waiter.deadline:
            self.queue.cancel(waiter.ticket)
            waiter.outcome = "expired"
        if waiter.outcome is None and self._leases == self._turning == 0:
            self._dispatch_next()
        return waiter.outcome is not None

    def _settle(self, left: list[Any]) -> None:
        """Tells the waiters that left the queue (dispatched, expired,
        displaced) why, and wakes them."""
        for _, _, outcome, waiter, _ in left:
            waiter.outcome = outcome
            self._turning += outcome == "dispatched"
            if waiter.wake is not None:
                waiter.wake()
        if left:
            self._turns.notify_all()

    def _dispatch_next(self) -> None:
        """Gives the next waiter by the discipline its turn (under ``_turns``)."""
        left = self.queue.dispatch()
        if left is not None:
            self._settle([left])

    def _acquire_now(self, ask: _Ask) -> Lease:
        """The steps once, at once (``acquire`` without ``wait``)."""
        if self._admission is not None and ask.entitlement is None:
            raise ValueError("entitlement is needed with admission")
        # Checked before any step, on either path: a bad argument holds nothing.
        if ask.now is not None and not math.isfinite(ask.now):
            raise ValueError(f"now must be a finite number, got {ask.now}")
        _tokens("max_output_tokens", ask.max_output_tokens)
        if ask.input_tokens is not None:
            _tokens("input_tokens", ask.input_tokens)
        native = self._native
        if native is None:
            held = self._steps(ask)
        else:
            held = _Held(
                ask.max_output_tokens,
                ask.fairness_id,
                ask.now,
                *native.acquire(*ask),  # the same arguments, in the same order
            )
        with self._turns:
            self._leases += 1
        return Lease(self, held)

    def _steps(self, ask: _Ask) -> _Held:
        """The steps in Python, for parts that are Python objects (the same
        order and the same give-back as ``DispatchSteps``)."""
        max_output_tokens, entitlement, now = ask.max_output_tokens, ask.entitlement, ask.now
        prompt_bytes, input_tokens = ask.prompt_bytes, ask.input_tokens
        held = _Held(max_output_tokens, ask.fairness_id, now)
        try:
            if self._router is not None:
                if prompt_bytes is None:
                    prompt_bytes = _text_length(ask.tokens)
                decision = self._router.route(prompt_bytes, ask.category, max_output_tokens)
                if decision.rejected:
                    raise RequestRefused("route", 413, decision.reason)
                held.decision = decision
                if input_tokens is None:
                    input_tokens = decision.est_input_tokens
            if input_tokens is None and self._admission is not None:
                raise ValueError("input_tokens is needed for admission without a router")
            held.input_tokens = input_tokens or 0
            if self._admission is not None and entitlement is not None:
                admission = self._admission.admit(
                    entitlement, held.input_tokens, max_output_tokens, now
                )
                if not admission.admitted:
                    raise RequestRefused(
                        "admission", admission.status, admission.reason, admission.retry_after_s
                    )
                held.admission = admission
            picker = self._picker(held.decision)
            if picker is not None:
                pair = picker.pick_pair(
                    ask.tokens,
                    fairness_id=ask.fairness_id,
                    session=ask.session,
                    input_tokens=held.input_tokens,
                    output_tokens=max_output_tokens,
                    now=now,
                )
                if pair is None:
                    raise RequestRefused("endpoint", 503, "no-endpoint")
                held.endpoint, held.prefill_endpoint = pair
        except BaseException:
            self._release_parts(held, None, 0.0, now)
            raise
        return held

    def _picker(self, decision: RouteDecision | None) -> EndpointPicker | None:
        if self._by_pool is None:
            return self._for_all
        if decision is None or decision.pool is None:
            return None
        return self._by_pool[decision.pool]

    def _give_back(
        self, held: _Held, usage: tuple[int, int], latency_s: float, now: float | None
    ) -> None:
        """Releases what a lease's ``held`` holds (endpoint, prefill endpoint,
        admission, pool), every part attempted, the first error raised after;
        then gives the next waiter of the queue its turn."""
        try:
            native = self._native
            if native is None:
                self._release_parts(held, usage, latency_s, now)
            else:
                native.release(
                    held.decision,
                    held.admission,
                    held.endpoint,
                    held.prefill_endpoint,
                    held.fairness_id,
                    held.input_tokens,
                    held.max_output_tokens,
                    usage[0],
                    usage[1],
                    latency_s,
                    now,
                )
        finally:
            with self._turns:
                self._leases -= 1
                if len(self.queue):
                    self._dispatch_next()

    def _release_parts(
        self, held: _Held, usage: tuple[int, int] | None, latency_s: float, now: float | None
    ) -> None:
        """The Python path's give-back: ``usage`` None for a request that was
        never served (a step refused it): admission is released, nothing
        learned."""
        steps: list[Callable[[], object]] = []
        # Looked up only for a request placed (a pool without a picker is the
        # KeyError that refused it).
        placed = held.endpoint is not None or held.prefill_endpoint is not None
        picker = self._picker(held.decision) if placed else None
        endpoint = held.endpoint
        if picker is not None and endpoint is not None and usage is not None:
            served = usage
            steps.append(
                lambda: picker.completed(
                    endpoint,
                    served[0],
                    served[1],
                    fairness_id=held.fairness_id,
                    est_input_tokens=held.input_tokens,
                    est_output_tokens=held.max_output_tokens,
                    now=now,
                )
            )
        prefill = held.prefill_endpoint
        if picker is not None and prefill is not None:
            steps.append(lambda: picker.completed_prefill(prefill, held.input_tokens, now=now))
        backend = self._admission
        ticket = None if held.admission is None else held.admission.ticket
        if backend is not None and ticket is not None:
            if usage is None:
                steps.append(lambda: backend.release(ticket, now))
            else:
                served = usage
                steps.append(lambda: backend.complete(ticket, *served, latency_s, now))
        router = self._router
        if router is not None and held.decision is not None:
            index = held.decision.index
            steps.append(lambda: router.complete(index))
        first: Exception | None = None
        for step in steps:
            try:
                step()
            except Exception as e:  # every part is given back, whatever one raises
                first = first or e
        if first is not None:
            raise first


#: The longest a waiter sleeps before it checks the TTLs and, when no lease
#: is held (nothing will release), tries the next request itself.
POLL_S = 0.05
#: The queue's weight floor (one constant in Rust: ``flow::MIN_WEIGHT``).
MIN_WEIGHT = FlowQueue.MIN_WEIGHT


class _Waiter:
    """One ``acquire(wait=...)`` in the queue; ``outcome`` is set (under the
    dispatcher's ``_turns``) when it leaves: dispatched, expired, displaced;
    ``wake`` (an asyncio driver's) is called then."""

    __slots__ = ("deadline", "outcome", "ticket", "wake")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.ticket = 0
        self.outcome: str | None = None
        self.wake: Callable[[], object] | None = None


def _native_steps(
    router: TokenBudgetRouter | None,
    pickers: EndpointPicker | Mapping[str, EndpointPicker] | None,
    admission: AdmissionBackend | None,
) -> DispatchSteps | None:
    """The steps in Rust over these parts when each is routecore's own (not a
    subclass, whose methods Python may override); None otherwise."""
    if router is not None and type(router) is not TokenBudgetRouter:
        return None
    each = pickers.values() if isinstance(pickers, Mapping) else [pickers]
    if any(p is not None and type(p) is not EndpointPicker for p in each):
        return None
    if admission is not None and type(admission) is not InMemoryAdmission:
        return None
    controller = None if admission is None else admission.controller
    clock = None if admission is None or admission.clock is monotonic else admission.clock
    return DispatchSteps(RequestRefused, router, pickers, controller, clock)


def _may_wait(refused: RequestRefused) -> bool:
    """A refusal that capacity appearing can lift: admission's 429 (a quota
    or entitlement at its limit) or no endpoint (503)."""
    return (refused.step, refused.status) in (("admission", 429), ("endpoint", 503))


def _tokens(what: str, value: int) -> int:
    """A token count every part accepts, checked before anything is released."""
    if isinstance(value, bool) or not 0 <= operator.index(value) <= MAX_TOKENS:
        raise ValueError(f"{what} must be an int in [0, {MAX_TOKENS}], got {value!r}")
    return operator.index(value)


def _text_length(tokens: Any) -> int:
    if isinstance(tokens, str):
        return len(tokens.encode())
    if isinstance(tokens, (bytes, bytearray)):
        return len(tokens)
    raise ValueError("prompt_bytes is needed unless tokens is str or bytes")
