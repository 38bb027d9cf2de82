"""One composite call (``Dispatcher.acquire``) takes the pool, the endpoint and
the admission reservation; its ``Lease`` gives them back exactly once, on
exit, on an exception or on ``release``; a refusal gives back what earlier
steps took."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import (
    Dispatcher,
    EndpointPicker,
    Entitlement,
    InMemoryAdmission,
    NotInFlightError,
    Pool,
    Quota,
    RequestRefused,
    TokenBudgetRouter,
)

POOLS = ("short", "long")


def parts(concurrency: int = 2, admission_concurrency: int = 3):
    router = TokenBudgetRouter([Pool("short", 8192), Pool("long", 65536)])
    pickers = {
        "short": EndpointPicker(["s0", "s1"], preset="least-request"),
        "long": EndpointPicker(["l0"], preset="least-request"),
    }
    admission = InMemoryAdmission(
        [Quota("q", 1e9, 2**40, admission_concurrency)],
        [Entitlement("e", "t", "q", "guaranteed", 100.0, 1e9, 2**40, concurrency)],
    )
    return Dispatcher(router, pickers, admission)


def counts(d: Dispatcher) -> list[int]:
    """Every count a lease holds: per pool, per endpoint, admission."""
    assert d.router is not None and d.admission is not None and isinstance(d.pickers, dict)
    held = [d.router.in_flight(p) for p in POOLS]
    for picker in d.pickers.values():
        held.extend(picker.in_flight)
    held.append(d.admission.quota_in_flight("q"))
    return held


def acquire(d: Dispatcher, size: int = 400, **kw):
    return d.acquire(
        prompt_bytes=size, max_output_tokens=100, entitlement="e", now=kw.pop("now", 0.0), **kw
    )


def test_acquire_holds_all_three_and_exit_releases_them():
    d = parts()
    with acquire(d) as lease:
        assert (lease.pool, lease.endpoint) == ("short", "s0")
        assert lease.admission is not None and lease.admission.admitted
        assert lease.input_tokens == 100  # 400 bytes at the cold-start 4 bytes/token
        assert counts(d) == [1, 0, 1, 0, 0, 1]
        lease.record_usage(90, 42)
    assert lease.released and counts(d) == [0] * 6
    # The usage reached admission: 90 + 42 tokens in the window.
    assert d.admission.controller.stats("e")["window_tokens"] == 132  # type: ignore[union-attr]


def test_an_exception_in_the_block_releases_once_and_propagates():
    d = parts()
    with pytest.raises(RuntimeError, match="engine down"), acquire(d) as lease:
        raise RuntimeError("engine down")
    assert lease.released and counts(d) == [0] * 6


def test_a_second_release_is_the_not_in_flight_error():
    d = parts()
    lease = acquire(d)
    lease.release(10, 5)
    with pytest.raises(NotInFlightError, match="released already"):
        lease.release()
    assert counts(d) == [0] * 6
    with acquire(d) as other:
        other.release()  # explicit release inside the block: the exit adds nothing
    assert counts(d) == [0] * 6


def test_bad_usage_raises_before_anything_is_released():
    d = parts()
    lease = acquire(d)
    for bad in ((-1, 5), (5, 2**40), (True, 1)):
        with pytest.raises(ValueError):
            lease.release(*bad)
        with pytest.raises(ValueError):
            lease.record_usage(*bad)
    with pytest.raises(ValueError):
        lease.release(now=float("nan"))
    assert not lease.released and counts(d) == [1, 0, 1, 0, 0, 1]
    lease.release(10, 5)
    assert counts(d) == [0] * 6


def test_a_refusing_step_gives_back_what_earlier_steps_took():
    d = parts(concurrency=1)
    held = acquire(d)
    with pytest.raises(RequestRefused) as refused:
        acquire(d)  # routed, then the entitlement's one slot is taken
    assert (refused.value.step, refused.value.status) == ("admission", 429)
    assert refused.value.retry_after_s is not None
    assert counts(d) == [1, 0, 1, 0, 0, 1]  # only the first request's
    with pytest.raises(RequestRefused) as too_big:
        d.acquire(prompt_bytes=10**6, max_output_tokens=100, entitlement="e", now=0.0)
    assert (too_big.value.step, too_big.value.status) == ("route", 413)
    held.release()
    assert counts(d) == [0] * 6


def test_no_healthy_endpoint_refuses_after_releasing_route_and_admission():
    d = parts()
    assert isinstance(d.pickers, dict)
    for name in ("s0", "s1"):
        d.pickers["short"].set_state(name, healthy=False)
    with pytest.raises(RequestRefused) as refused:
        acquire(d)
    assert (refused.value.step, refused.value.status, refused.value.reason) == (
        "endpoint",
        503,
        "no-endpoint",
    )
    assert counts(d) == [0] * 6


def test_bad_arguments_hold_nothing():
    d = parts()
    with pytest.raises(ValueError):
        acquire(d, fairness_id="")  # the picker refuses it after route and admit
    assert counts(d) == [0] * 6
    with pytest.raises(ValueError):
        d.acquire(prompt_bytes=10, max_output_tokens=10)  # admission needs an entitlement
    with pytest.raises(ValueError):
        Dispatcher()


def test_parts_are_optional_and_a_single_picker_serves_every_pool():
    picker = EndpointPicker(["a", "b"], preset="least-request")
    only_picker = Dispatcher(pickers=picker)
    with only_picker.acquire(max_output_tokens=10, tokens=b"hello") as lease:
        assert (lease.pool, lease.endpoint, lease.admission) == (None, "a", None)
        assert picker.in_flight == [1, 0]
    assert picker.in_flight == [0, 0]
    router = TokenBudgetRouter([Pool("short", 8192)])
    only_router = Dispatcher(router)
    lease = only_router.acquire(max_output_tokens=10, tokens="héllo")  # 6 UTF-8 bytes
    assert lease.decision is not None and lease.decision.est_input_tokens == 2
    lease.release()
    assert router.in_flight("short") == 0


def test_concurrent_releases_release_once():
    d = parts()
    lease = acquire(d)

    def release() -> bool:
        try:
            lease.release()
        except NotInFlightError:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        released = [f.result() for f in [pool.submit(release) for _ in range(8)]]
    assert sorted(released) == [False] * 7 + [True] and counts(d) == [0] * 6


OPS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "acquire-long", "release", "release-twice", "raise"]),
        st.integers(0, 7),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_any_sequence_of_acquire_release_and_exceptions_leaves_nothing_held(ops):
    d = parts(concurrency=3, admission_concurrency=4)
    leases = []
    for op, k in ops:
        if op.startswith("acquire"):
            size = 40_000 if op == "acquire-long" else 400
            try:
                leases.append(acquire(d, size, now=float(k)))
            except RequestRefused:
                pass
        elif op == "raise":
            try:
                with acquire(d, now=float(k)):
                    raise KeyError(k)
            except (KeyError, RequestRefused):
                pass
        elif leases:
            lease = leases.pop(k % len(leases))
            lease.release(k, k, now=float(k) + 1.0)
            if op == "release-twice":
                with pytest.raises(NotInFlightError):
                    lease.release()
    for lease in leases:
        lease.release()
    assert counts(d) == [0] * 6
