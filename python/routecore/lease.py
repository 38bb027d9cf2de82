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
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from routecore._core import (
    Admission,
    EndpointPicker,
    NotInFlightError,
    RouteDecision,
    TokenBudgetRouter,
    monotonic,
)
from routecore.admission import MAX_TOKENS
from routecore.admission.backend import AdmissionBackend


class RequestRefused(Exception):
    """A step of ``Dispatcher.acquire`` refused the request; nothing is held.

    ``step``: ``"route"`` (no pool holds it, 413), ``"admission"`` (the
    admission decision's status: 401, 403, 413, 429 or 503, with
    ``retry_after_s``) or ``"endpoint"`` (no endpoint passes the health and
    subset filters, 503)."""

    def __init__(
        self, step: str, status: int, reason: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{step} refused the request: {status} {reason}")
        self.step = step
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


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
    at least one."""

    def __init__(
        self,
        router: TokenBudgetRouter | None = None,
        pickers: EndpointPicker | Mapping[str, EndpointPicker] | None = None,
        admission: AdmissionBackend | None = None,
    ) -> None:
        if router is None and pickers is None and admission is None:
            raise ValueError("give a router, pickers or admission")
        if isinstance(pickers, Mapping) and router is None:
            raise ValueError("pickers per pool need a router to choose the pool")
        self.router = router
        self.pickers = pickers
        self.admission = admission
        # Sorted out once (an isinstance on an ABC costs a microsecond per call).
        self._by_pool: Mapping[str, EndpointPicker] | None = None
        self._for_all: EndpointPicker | None = None
        if isinstance(pickers, Mapping):
            self._by_pool = pickers
        else:
            self._for_all = pickers

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
    ) -> Lease:
        """Routes (``prompt_bytes``, ``category``, ``max_output_tokens``), admits
        (``entitlement`` with the input estimate and ``max_output_tokens``) and
        picks the endpoint (``tokens`` for prefix affinity, ``fairness_id``,
        ``session``), in that order. ``prompt_bytes`` defaults to the UTF-8
        length of ``tokens`` when it is ``str`` or ``bytes``; ``input_tokens``
        to the router's estimate (needed for admission without a router).
        Raises ``RequestRefused`` (nothing held) when a step refuses, and bad
        arguments raise as each part does, also with nothing held."""
        if self.admission is not None and entitlement is None:
            raise ValueError("entitlement is needed with admission")
        held = _Held(max_output_tokens, fairness_id, now)
        try:
            if self.router is not None:
                if prompt_bytes is None:
                    prompt_bytes = _text_length(tokens)
                decision = self.router.route(prompt_bytes, category, max_output_tokens)
                if decision.rejected:
                    raise RequestRefused("route", 413, decision.reason)
                held.decision = decision
                if input_tokens is None:
                    input_tokens = decision.est_input_tokens
            if input_tokens is None and self.admission is not None:
                raise ValueError("input_tokens is needed for admission without a router")
            held.input_tokens = input_tokens or 0
            if self.admission is not None and entitlement is not None:
                admission = self.admission.admit(
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
                    tokens,
                    fairness_id=fairness_id,
                    session=session,
                    input_tokens=held.input_tokens,
                    output_tokens=max_output_tokens,
                    now=now,
                )
                if pair is None:
                    raise RequestRefused("endpoint", 503, "no-endpoint")
                held.endpoint, held.prefill_endpoint = pair
        except BaseException:
            self._give_back(held, (0, 0), 0.0, now)
            raise
        return Lease(self, held)

    def _picker(self, decision: RouteDecision | None) -> EndpointPicker | None:
        if self._by_pool is None:
            return self._for_all
        if decision is None or decision.pool is None:
            return None
        return self._by_pool[decision.pool]

    def _give_back(
        self, held: _Held, usage: tuple[int, int], latency_s: float, now: float | None
    ) -> None:
        """Releases what ``held`` holds (endpoint, prefill endpoint, admission,
        pool), every part
        attempted, the first error raised after."""
        steps: list[Callable[[], object]] = []
        picker = self._picker(held.decision)
        endpoint = held.endpoint
        if picker is not None and endpoint is not None:
            steps.append(
                lambda: picker.completed(
                    endpoint,
                    usage[0],
                    usage[1],
                    fairness_id=held.fairness_id,
                    est_input_tokens=held.input_tokens,
                    est_output_tokens=held.max_output_tokens,
                    now=now,
                )
            )
        prefill = held.prefill_endpoint
        if picker is not None and prefill is not None:
            steps.append(lambda: picker.completed_prefill(prefill, held.input_tokens, now=now))
        backend = self.admission
        ticket = None if held.admission is None else held.admission.ticket
        if backend is not None and ticket is not None:
            steps.append(lambda: backend.complete(ticket, usage[0], usage[1], latency_s, now))
        router = self.router
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
