"""``Dispatcher.acquire`` in Rust (``DispatchSteps``: the data plane's step
order over the router, the in-memory admission and the pickers, in one call)
gives the leases and leaves the parts exactly as the Python path does, step by
step; a refused request leaves no trace; bad input holds nothing."""

from __future__ import annotations

import math
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
from routecore._core import DispatchSteps

POOLS = ("short", "long", "xl")
#: Plugins that learn (prefix blocks, VTC counts, sessions), as the data plane's.
PLUGINS = [
    {"name": "healthy"},
    {"name": "prefix", "block_size": 4},
    {"name": "vtc"},
    {"name": "session-affinity"},
    {"name": "max-score", "ties": "first"},
]
#: Prompts by size: short pool, long pool, xl (a pool without a picker: the
#: KeyError of a pool the pickers do not know) and too long for any (413).
SIZES = (40, 120, 600, 3000, 40_000)


def parts(native: bool, long_down: bool = False) -> Dispatcher:
    """Three pools (short and long with pickers), two entitlements: ``open``
    and ``capped`` (one request at a time)."""
    router = TokenBudgetRouter([Pool("short", 64), Pool("long", 256), Pool("xl", 4096)])
    pickers = {
        "short": EndpointPicker(["s0", "s1"], plugins=PLUGINS),
        "long": EndpointPicker(["l0", "l1"], plugins=PLUGINS),
    }
    if long_down:
        for e in ("l0", "l1"):
            pickers["long"].set_state(e, healthy=False)
    admission = InMemoryAdmission(
        [Quota("q", 1e9, 2**40, 1000)],
        [
            Entitlement("open", "t", "q", "guaranteed", 100.0, 1e9, 2**40, 1000),
            Entitlement("capped", "c", "q", "guaranteed", 300.0, 1e9, 2**40, 1),
        ],
    )
    d = Dispatcher(router, pickers, admission)
    assert d._native is not None
    if not native:
        d._native = None  # the Python path over the same kind of parts
    return d


def prompt(size: int, k: int) -> str:
    """A prompt of ``size`` bytes sharing its first blocks with others of key ``k``."""
    return (f"sys-{k}:" + "x" * size)[:size]


def state(d: Dispatcher) -> tuple:
    """Everything the parts keep: pool counts, every picker's snapshot (states,
    prefix index, VTC counts, sessions), admission's snapshot."""
    assert d.router is not None and isinstance(d.pickers, dict)
    assert isinstance(d.admission, InMemoryAdmission)
    return (
        [d.router.in_flight(p) for p in POOLS],
        {name: p.to_bytes() for name, p in d.pickers.items()},
        d.admission.controller.to_bytes(),
    )


def learned(d: Dispatcher) -> tuple:
    """What a request teaches the parts, without admission's ticket counter and
    clock: pool counts, the pickers' snapshots, each entitlement's stats and the
    quota's count."""
    assert isinstance(d.admission, InMemoryAdmission)
    c = d.admission.controller
    return (*state(d)[:2], [c.stats(e) for e in ("open", "capped")], c.quota_in_flight("q"))


def fields(lease) -> tuple:
    d, a = lease.decision, lease.admission
    return (
        lease.pool,
        lease.endpoint,
        lease.prefill_endpoint,
        lease.input_tokens,
        lease.max_output_tokens,
        None if d is None else (d.index, d.est_input_tokens, d.est_total_tokens, d.reason),
        None
        if a is None
        else (a.admitted, a.status, a.reason, a.retry_after_s, a.ticket, a.priority),
    )


#: A bad argument: the keyword it changes.
BAD = {
    "nan-now": {"now": math.nan},
    "inf-now": {"now": math.inf},
    "negative-input": {"input_tokens": -1},
    "negative-output": {"max_output_tokens": -5},
    "negative-bytes": {"prompt_bytes": -1},
    "empty-user": {"fairness_id": ""},  # refused by the picker, after route and admit
}


def acquire(d: Dispatcher, t: float, tenant: str, size: int, k: int, bad: str | None = None):
    """One request; its lease, or what it raised (refusal or error) as a tuple."""
    kw = {
        "max_output_tokens": 10,
        "tokens": prompt(SIZES[size], k),
        "entitlement": tenant,
        "fairness_id": f"u{k}",
        "session": f"s{k}",
        "now": t,
    }
    kw.update(BAD.get(bad or "", {}))
    try:
        return d.acquire(**kw)
    except RequestRefused as e:
        return ("refused", e.step, e.status, e.reason, e.retry_after_s)
    except (ValueError, KeyError) as e:
        return ("error", type(e).__name__, str(e))


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("acquire"),
            st.sampled_from(["open", "open", "capped"]),
            st.integers(0, len(SIZES) - 1),
            st.integers(0, 3),
            st.sampled_from([None] * 6 + sorted(BAD)),
        ),
        st.tuples(
            st.just("end"),
            st.integers(0, 9),
            st.sampled_from(["answered", "failed", "cancelled", "twice"]),
        ),
        st.tuples(st.just("health"), st.sampled_from(["s0", "s1", "l0", "l1"]), st.booleans()),
    ),
    max_size=50,
)


def end(lease, how: str, t: float):
    """Ends a lease as a request ends: answered (its usage), failed (none),
    cancelled (the estimate, no output), or released twice."""
    try:
        if how == "answered":
            lease.release(lease.input_tokens, 7, now=t)
        elif how == "failed":
            lease.release(0, 0, now=t)
        else:
            lease.release(now=t)
            if how == "twice":
                lease.release(now=t)
    except NotInFlightError as e:
        return ("error", str(e))
    return None


@settings(max_examples=80, deadline=None)
@given(OPS)
def test_the_rust_path_gives_the_python_paths_leases_and_state_step_by_step(ops):
    runs = [parts(native=True), parts(native=False)]
    leases: list[list] = [[], []]
    for t, op in enumerate(ops, start=1):
        got = []
        for d, held in zip(runs, leases):
            if op[0] == "acquire":
                out = acquire(d, float(t), *op[1:])
                if not isinstance(out, tuple):
                    held.append(out)
                    out = fields(out)
                got.append(out)
            elif op[0] == "end":
                live = [x for x in held if not x.released]
                got.append(end(live[op[1] % len(live)], op[2], float(t)) if live else None)
            else:
                pool = "short" if op[1].startswith("s") else "long"
                d.pickers[pool].set_state(op[1], healthy=op[2])  # type: ignore[index]
                got.append(None)
        assert got[0] == got[1], op
        assert state(runs[0]) == state(runs[1]), op
    for held in leases:
        for lease in held:
            if not lease.released:
                lease.release(now=float(len(ops) + 1))
    assert state(runs[0]) == state(runs[1])
    assert state(runs[0])[0] == [0, 0, 0]


REQUESTS = st.lists(
    st.tuples(
        st.sampled_from(["open", "open", "capped", "long", "xl", "huge", "bad"]),
        st.integers(0, 3),
        st.sampled_from(["answered", "failed", "cancelled"]),
        st.sampled_from(sorted(BAD)),
    ),
    max_size=30,
)


@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=40, deadline=None)
@given(REQUESTS)
def test_a_refused_request_leaves_no_trace(native, requests):
    """A run with refused requests mixed in (``capped`` held to its one slot:
    refused by admission; the long pool down: refused by the picker after
    admission; ``xl``: a pool without a picker, a KeyError after admission;
    ``huge``: refused by the router; bad arguments) keeps what a run that never
    saw them keeps, while the held request is in flight and after."""
    kept = []
    for skip in (False, True):
        d = parts(native, long_down=True)
        held = acquire(d, 0.0, "capped", 0, 0)
        assert not isinstance(held, tuple)
        refusals = 0
        for t, (kind, k, how, bad) in enumerate(requests, start=1):
            refused_kind = kind not in ("open",)
            if skip and refused_kind:
                continue
            tenant = "capped" if kind == "capped" else "open"
            size = {"long": 2, "xl": 3, "huge": 4}.get(kind, k % 2)
            out = acquire(d, float(t), tenant, size, k, bad if kind == "bad" else None)
            if isinstance(out, tuple):
                assert refused_kind, out
                refusals += 1
                continue
            assert not refused_kind
            end(out, how, float(t) + 0.5)
        mid = learned(d)
        held.release(30, 5, now=100.0)
        kept.append((mid, learned(d), refusals))
    assert kept[0][2] == sum(r[0] != "open" for r in requests)
    assert kept[0][:2] == kept[1][:2]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_each_bad_argument_is_an_error_that_holds_nothing(native, bad):
    d = parts(native)
    before = learned(d)
    out = acquire(d, 1.0, "open", 0, 1, bad)
    assert isinstance(out, tuple) and out[:2] == ("error", "ValueError"), out
    assert learned(d) == before
    if bad != "empty-user":  # checked before any step: admission untouched
        assert state(d) == state(parts(native))


@pytest.mark.parametrize("native", [True, False])
def test_a_pool_without_a_picker_is_a_key_error_that_holds_nothing(native):
    d = parts(native)
    before = learned(d)
    assert acquire(d, 1.0, "open", 3, 0) == ("error", "KeyError", "'xl'")
    assert learned(d) == before
    with pytest.raises(KeyError, match="pools the router has not"):
        Dispatcher(TokenBudgetRouter([Pool("short", 64)]), {"nope": EndpointPicker(["a"])})


def test_the_rust_path_serves_routecore_s_own_parts_and_python_the_rest():
    router = TokenBudgetRouter([Pool("short", 64)])
    picker = EndpointPicker(["a"], preset="least-request")
    assert Dispatcher(router)._native is not None
    assert Dispatcher(pickers=picker)._native is not None
    assert Dispatcher(router, {"short": picker})._native is not None

    class Mine(InMemoryAdmission):
        """A user's backend: its methods may do anything."""

    quota, ent = Quota("q", 1e9, 2**40, 10), Entitlement("e", "t", "q", "spot", 1.0, 1.0, 1, 1)
    assert Dispatcher(router, admission=InMemoryAdmission([quota], [ent]))._native is not None
    assert Dispatcher(router, admission=Mine([quota], [ent]))._native is None


def test_an_admission_clock_is_read_when_now_is_none():
    ticks = iter([5.0, 6.0])
    admission = InMemoryAdmission(
        [Quota("q", 1e9, 2**40, 10)],
        [Entitlement("e", "t", "q", "guaranteed", 100.0, 1e9, 2**40, 10)],
        clock=lambda: next(ticks),
    )
    d = Dispatcher(TokenBudgetRouter([Pool("short", 64)]), admission=admission)
    assert d._native is not None
    with d.acquire(prompt_bytes=40, max_output_tokens=10, entitlement="e") as lease:
        assert lease.admission is not None and lease.admission.ticket is not None
    # The release read the clock too: the latency from the lease's own clock.
    assert next(ticks, None) is None


def test_dispatch_steps_release_checks_everything_before_giving_back():
    router = TokenBudgetRouter([Pool("short", 64)])
    steps = DispatchSteps(RequestRefused, router)
    n, decision, admission, endpoint, prefill = steps.acquire(
        10, 40, "prose", None, None, None, None, None, 0.0
    )
    assert (n, admission, endpoint, prefill) == (10, None, None, None)
    assert decision is not None and router.in_flight("short") == 1
    for bad in ({"actual_input": -1}, {"latency_s": math.nan}, {"now": math.inf}):
        args = {"actual_input": 0, "latency_s": 0.0, "now": None, **bad}
        with pytest.raises(ValueError):
            steps.release(
                decision, None, None, None, None, n, 10, args["actual_input"], 0,
                args["latency_s"], args["now"],
            )  # fmt: skip
        assert router.in_flight("short") == 1
    steps.release(decision, None, None, None, None, n, 10, 0, 0, 0.0, None)
    assert router.in_flight("short") == 0
    with pytest.raises(NotInFlightError):
        steps.release(decision, None, None, None, None, n, 10, 0, 0, 0.0, None)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4000), st.integers(0, 3)), max_size=30))
def test_a_split_pool_s_pairs_are_the_same_on_both_paths(steps):
    """Prefill/decode roles (``uncached-tokens`` splits long prompts only):
    the same decode and prefill endpoints, both released, on either path."""
    roles = {"d0": "decode", "d1": "decode", "p0": "prefill", "b0": "both"}
    runs = []
    for native in (True, False):
        plugins = [{"name": "subset-hint"}, *PLUGINS]
        picker = EndpointPicker(
            list(roles), plugins=plugins, roles=roles, decider="uncached-tokens", threshold=500
        )
        d = Dispatcher(pickers=picker)
        assert d._native is not None
        if not native:
            d._native = None
        runs.append((d, picker, []))
    for t, (acquire_one, tokens, k) in enumerate(steps, start=1):
        got = []
        for d, picker, held in runs:
            if acquire_one or not held:
                lease = d.acquire(
                    max_output_tokens=8,
                    input_tokens=tokens,
                    tokens=prompt(40, k),
                    fairness_id=f"u{k}",
                    now=float(t),
                )
                held.append(lease)
                got.append(fields(lease))
            else:
                held.pop(k % len(held)).release(tokens, 3, now=float(t))
                got.append(None)
            got.append(picker.to_bytes())
        assert got[:2] == got[2:]
    for d, picker, held in runs:
        for lease in held:
            lease.release(now=100.0)
        assert picker.in_flight == [0, 0, 0, 0]
        long = d.acquire(max_output_tokens=8, input_tokens=4000, now=101.0)
        assert long.prefill_endpoint is not None  # a long prompt is split
        long.release(now=102.0)
    assert runs[0][1].to_bytes() == runs[1][1].to_bytes()


def test_threads_acquiring_and_releasing_at_once_leave_nothing_held():
    """Eight threads through the Rust steps at once (each part locks itself):
    every lease released once, every count back to zero."""
    d = parts(native=True)

    def worker(w: int) -> int:
        served = 0
        for i in range(200):
            out = acquire(d, 1.0, "open", i % 3, w)
            if not isinstance(out, tuple):
                out.release(out.input_tokens, 3, now=2.0)
                served += 1
        return served

    with ThreadPoolExecutor(8) as pool:
        served = sum(pool.map(worker, range(8)))
    assert served == 8 * 200  # short and long prompts: every one served
    assert isinstance(d.admission, InMemoryAdmission) and isinstance(d.pickers, dict)
    assert learned(d)[0] == [0, 0, 0]
    assert [p.in_flight for p in d.pickers.values()] == [[0, 0], [0, 0]]
    assert d.admission.quota_in_flight("q") == 0
