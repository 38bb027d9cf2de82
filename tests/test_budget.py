"""Token-budget pool routing (Chen et al. 2026, Algorithm 1), worked by hand."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import Calibrator, NotInFlightError, Pool, TokenBudgetRouter
from routecore._baselines.budget import NumpyRouter


def two_pools(short_budget=None, short_limit=None, long_limit=None):
    return TokenBudgetRouter(
        [Pool("short", 8192, short_budget, short_limit), Pool("long", 65536, None, long_limit)]
    )


def test_total_budget_not_prompt_length():
    r = two_pools()
    # 800 bytes of prose at the cold-start 4.0 bytes/token: 200 prompt tokens.
    d = r.route(800, "prose", 8192)
    assert (d.pool, d.index, d.est_input_tokens, d.est_total_tokens) == ("long", 1, 200, 8392)
    d = r.route(800, "prose", 7992)
    assert (d.pool, d.est_total_tokens, d.reason) == ("short", 8192, "budget")


def test_estimate_rounds_up():
    r = two_pools()
    assert r.route(4001, "prose", 1).est_input_tokens == 1001
    assert r.route(0, "prose", 1).est_input_tokens == 0


def test_hard_constraint_and_rejection():
    r = TokenBudgetRouter([Pool("long", 16384), Pool("short", 8192, budget=4096)])
    assert r.route(8000, "prose", 3000).pool == "long"  # 5000 > budget 4096, fits 8192
    assert r.route(4000, "prose", 3000).pool == "short"  # 4000 <= 4096
    d = r.route(4 * 16384, "prose", 1)
    assert d.rejected and d.pool is None and d.index == -1
    assert d.reason == "exceeds-max-context"
    assert d.est_total_tokens == 16385
    assert r.in_flight("long") == 1 and r.in_flight("short") == 1


def test_largest_context_when_no_budget_holds():
    r = TokenBudgetRouter([Pool("a", 8192, budget=2048), Pool("b", 32768, budget=4096)])
    d = r.route(4 * 6000, "prose", 100)
    assert (d.pool, d.reason) == ("b", "largest-context")


def test_spillover_up_and_down_only_when_the_target_holds():
    r = two_pools(short_budget=4096, short_limit=2, long_limit=2)
    assert [r.route(400, "prose", 100).pool for _ in range(3)] == ["short"] * 3
    d = r.route(400, "prose", 100)  # short has 3 > 2 in flight
    assert (d.pool, d.spilled, d.reason) == ("long", True, "spillover")
    r.set_in_flight("short", 0)
    r.set_in_flight("long", 3)
    d = r.route(24_000, "prose", 100)  # 6,100 tokens: over short's budget, inside its window
    assert (d.pool, d.spilled) == ("short", True)
    d = r.route(40_000, "prose", 100)  # 10,100 tokens: only long can hold it
    assert (d.pool, d.spilled, d.reason) == ("long", False, "budget")
    r.set_in_flight("short", 3)
    d = r.route(24_000, "prose", 100)  # both overloaded: stays on its target
    assert (d.pool, d.spilled) == ("long", False)


def test_spillover_picks_the_least_loaded_of_many():
    r = TokenBudgetRouter(
        [Pool("s", 4096, queue_limit=0), Pool("m", 16384, queue_limit=5), Pool("l", 65536)]
    )
    r.set_in_flight("s", 1)
    r.set_in_flight("m", 4)
    r.set_in_flight("l", 2)
    d = r.route(400, "prose", 100)
    assert (d.pool, d.spilled) == ("l", True)
    assert r.in_flight("l") == 3


def test_complete_and_in_flight():
    r = two_pools()
    with pytest.raises(NotInFlightError, match="no request in flight"):
        r.complete("short")
    d = r.route(100, "prose", 10)
    assert r.in_flight(d.index) == 1
    r.complete(d.pool)
    assert r.in_flight("short") == 0
    with pytest.raises(KeyError):
        r.complete("medium")
    with pytest.raises(ValueError):
        r.complete(7)
    with pytest.raises(ValueError):
        r.set_in_flight("short", -1)


def test_route_tokens_uses_the_exact_count():
    r = two_pools()
    d = r.route_tokens(8000, 192)
    assert (d.pool, d.est_input_tokens, d.est_total_tokens) == ("short", 8000, 8192)
    assert r.route_tokens(8000, 193).pool == "long"
    with pytest.raises(ValueError):
        r.route_tokens(-1, 10)


@pytest.mark.parametrize(
    "args",
    [(-1, "prose", 10), (10, "prose", 0), (10, "prose", -5), (10, "prose", 2**31), (2**41, "p", 1)],
)
def test_bad_requests_raise_and_change_nothing(args):
    r = two_pools()
    with pytest.raises(ValueError):
        r.route(*args)
    assert r.in_flight("short") == 0 and r.in_flight("long") == 0


def test_bad_pools():
    for args in [("x", 0), ("x", 100, 200), ("", 100), ("x", 100, None, -1), ("x", -3)]:
        with pytest.raises(ValueError):
            Pool(*args)
    with pytest.raises(ValueError, match="duplicate"):
        TokenBudgetRouter([Pool("a", 10), Pool("a", 20)])
    with pytest.raises(ValueError):
        TokenBudgetRouter([])


def test_feedback_reaches_the_shared_calibrator():
    cal = Calibrator()
    r = TokenBudgetRouter([Pool("short", 8192), Pool("long", 65536)], calibrator=cal)
    assert r.calibrator is cal
    # CJK at 2 bytes/token: 16,000 bytes are 8,000 tokens, not the cold-start 4,000.
    assert r.route(16_000, "cjk", 100).pool == "short"
    for _ in range(30):
        r.feedback(2000, "cjk", 1000)
    assert cal.ratio("cjk") == pytest.approx(2.0)
    assert r.route(16_000, "cjk", 500).pool == "long"
    with pytest.raises(ValueError):
        r.feedback(2000, "cjk", 0)
    assert cal.count("cjk") == 30


def test_route_many_dtypes_and_errors():
    r = two_pools()
    prose = r.category_id("prose")
    assert r.category_id("prose") == prose
    for dtype in [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]:
        out = r.route_many(
            np.array([40, 100], dtype=dtype),
            np.array([prose, prose], dtype=dtype),
            np.array([10, 127], dtype=dtype),
        )
        assert out.dtype == np.int64 and out.tolist() == [0, 0]
    assert r.route_many([], [], []).tolist() == []
    before = (r.in_flight(0), r.in_flight(1))
    bad = [
        ([1.5], [prose], [10]),  # float dtype
        ([[1]], [[prose]], [[10]]),  # 2-D
        ([1, 2], [prose], [10, 10]),  # length mismatch
        ([1], [99], [10]),  # unknown category id
        ([1, -1], [prose, prose], [10, 10]),  # negative size in the middle
        ([1, 1], [prose, prose], [10, 0]),  # zero output bound
        (np.array([2**64 - 1], dtype=np.uint64), [prose], [1]),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            r.route_many(*args)
    assert (r.in_flight(0), r.in_flight(1)) == before


def make_router(limits):
    pools = [
        Pool("s", 4096, 2048, limits[0]),
        Pool("m", 16384, None, limits[1]),
        Pool("l", 131072, None, limits[2]),
    ]
    cal = Calibrator()
    for cat, b, t in [("prose", 4500, 1000), ("code", 3500, 1000), ("cjk", 2000, 1000)]:
        cal.observe(cat, b, t)
    return TokenBudgetRouter(pools, cal)


@settings(max_examples=60, deadline=None)
@given(
    limits=st.tuples(*[st.one_of(st.none(), st.integers(0, 5))] * 3),
    reqs=st.lists(
        st.tuples(st.integers(0, 600_000), st.integers(0, 2), st.integers(1, 40_000)),
        max_size=80,
    ),
)
def test_route_many_equals_route_one_by_one(limits, reqs):
    one, many = make_router(limits), make_router(limits)
    names = ["prose", "code", "cjk"]
    ids = [many.category_id(n) for n in names]
    singles = [one.route(b, names[c], o).index for b, c, o in reqs]
    arr = np.array(reqs, dtype=np.int64).reshape(-1, 3)
    batched = many.route_many(arr[:, 0], np.array(ids)[arr[:, 1]], arr[:, 2])
    assert batched.tolist() == singles
    assert [one.in_flight(i) for i in range(3)] == [many.in_flight(i) for i in range(3)]


pool_shapes = st.lists(
    st.tuples(st.integers(1, 200_000), st.integers(1, 200_000)).map(lambda t: (max(t), min(t))),
    min_size=1,
    max_size=5,
)


@settings(max_examples=80, deadline=None)
@given(
    shapes=pool_shapes,
    reqs=st.lists(
        st.tuples(st.integers(0, 900_000), st.integers(0, 2), st.integers(1, 40_000)),
        max_size=200,
    ),
    near=st.lists(st.integers(-3, 3), max_size=200),
)
def test_route_many_equals_the_numpy_twin(shapes, reqs, near):
    """Without queue limits or a compress band, routecore's batch decides and
    counts as the NumPy router of ``routecore._baselines`` (the bench's twin),
    also for prompts within a few bytes of a pool's budget."""
    pools = [(f"p{i}", ctx, budget, None) for i, (ctx, budget) in enumerate(shapes)]
    r = make_router([None] * 3)
    r = TokenBudgetRouter([Pool(*p) for p in pools], r.calibrator)
    names = ["prose", "code", "cjk"]
    ids = [r.category_id(n) for n in names]
    ratios = [r.calibrator.conservative_ratio(n) for n in r.calibrator.categories]
    # Prompts at a pool's budget: bytes = (budget - output) * ratio, nudged.
    edges = [
        (max(0, int((shapes[k % len(shapes)][1] - o) * ratios[ids[c]]) + d), c, o)
        for k, ((_, c, o), d) in enumerate(zip(reqs, near))
    ]
    arr = np.array(reqs + edges, dtype=np.int64).reshape(-1, 3)
    cats = np.array(ids)[arr[:, 1]]
    twin = NumpyRouter(pools, ratios)
    assert r.route_many(arr[:, 0], cats, arr[:, 2]).tolist() == (
        twin.route_many(arr[:, 0], cats, arr[:, 2]).tolist()
    )
    assert [r.in_flight(i) for i in range(len(pools))] == twin.in_flight.tolist()


def test_repr_and_properties():
    r = two_pools(short_limit=3)
    assert [p.name for p in r.pools] == ["short", "long"]
    assert r.pools[0].queue_limit == 3 and r.pools[1].budget == 65536
    assert "short" in repr(r) and "Pool(" in repr(r.pools[0])
    assert "RouteDecision(" in repr(r.route(1, "prose", 1))


def test_the_cores_constants_are_what_it_does():
    # Exported once from the core (never re-typed in Python), and true of it.
    from routecore._core import CATEGORIES, MAX_TOKENS, classify

    samples = ["Plain prose.", "def f(x):\n    return x + 1\n", "日本語の文章です。", "mix 日本"]
    assert {classify(s) for s in samples} == set(CATEGORIES)
    cal = Calibrator()
    assert cal.estimate_tokens(4000, "unseen") == -(-4000 // Calibrator.DEFAULT_COLD_START)
    router = TokenBudgetRouter([Pool("only", MAX_TOKENS)], cal)
    assert router.route(100, "prose", MAX_TOKENS - 100).pool == "only"
    with pytest.raises(ValueError, match=str(MAX_TOKENS)):
        router.route(100, "prose", MAX_TOKENS + 1)
