"""Erlang B/C and the P99 wait against mpmath, hypothesis properties, errors."""

import math
import pickle

import mpmath as mp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import ErlangScan, erlang_b, erlang_c, erlang_c_many, p99_wait

mp.mp.dps = 60


def ref_b(c, a):
    """Erlang B = Poisson pmf(c) / cdf(c), in 60-digit arithmetic."""
    a = mp.mpf(a)
    pmf = mp.e ** (-a + c * mp.log(a) - mp.loggamma(c + 1))
    return pmf / mp.gammainc(c + 1, a, mp.inf, regularized=True)


def ref_c(c, a):
    b = ref_b(c, a)
    rho = mp.mpf(a) / c
    return b / (1 - rho * (1 - b))


POINTS = [
    (c, rho)
    for c in (1, 2, 5, 16, 100, 1000, 32_768, 1_000_000)
    for rho in (0.05, 0.5, 0.85, 0.99, 0.999, 0.9999)
]


@pytest.mark.parametrize("c,rho", POINTS)
def test_erlang_c_matches_mpmath(c, rho):
    a = rho * c
    got = erlang_c(c, a)
    if c * (rho - 1 - math.log(rho)) > 720:
        # ln P(X = c) < -720: C < 2 P(X = c) / (1 - rho) is below f64's range
        assert 0 <= got < 1e-290
        return
    ref = ref_c(c, a)
    if ref < mp.mpf("1e-300"):
        assert got < 1e-290  # below f64's normal range: underflows, stays finite
    else:
        assert got == pytest.approx(float(ref), rel=1e-12)
    assert erlang_b(c, a) == pytest.approx(float(ref_b(c, a)), rel=1e-12, abs=1e-300)


def test_by_hand():
    # M/M/1: C = rho. M/M/2 at A = 1: B = (1/2) / (1 + 1 + 1/2) = 0.2, C = 1/3.
    assert erlang_c(1, 0.3) == pytest.approx(0.3, rel=1e-14)
    assert erlang_b(2, 1.0) == pytest.approx(0.2, rel=1e-14)
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3, rel=1e-14)
    # Erlang B above the server count (A >= c + 1): B = (A^2/2) / (1 + A + A^2/2)
    assert erlang_b(2, 10.0) == pytest.approx(50 / (1 + 10 + 50), rel=1e-14)
    assert erlang_b(10**6, 2e6) == pytest.approx(float(ref_b(10**6, 2e6)), rel=1e-12)
    # p99_wait answers beyond MAX_SERVERS in the many-server regime
    assert p99_wait(2**50, 1.0, 1.0, 0.5 * 2**50) == 0.0
    assert erlang_c(10, 0.0) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.floats(0.01, 0.995))
def test_monotone_and_in_unit_interval(c, rho):
    a = rho * c
    v = erlang_c(c, a)
    assert 0 <= v < 1
    if v > 1e-280:
        assert 0 < v
        assert erlang_c(c + 1, a) <= v  # more servers, less waiting
        assert erlang_c(c, a * 0.99) <= v  # less load, less waiting
        # C >= B always (a waiting arrival would have been blocked)
        assert v >= erlang_b(c, a) * (1 - 1e-12)


def test_scan_equals_fresh_evaluations():
    s = ErlangScan(10, 40.0)
    assert s.erlang_c == 1.0  # load above the servers
    for _ in range(200):
        s.advance()
        fresh = erlang_b(s.servers, 40.0)
        assert s.erlang_b == pytest.approx(fresh, rel=1e-11, abs=1e-300)
        if s.servers > 40:
            assert s.erlang_c == pytest.approx(erlang_c(s.servers, 40.0), rel=1e-11, abs=1e-300)
    s.advance(1000)
    assert s.servers == 1210
    big = ErlangScan(32_000, 31_900.0)
    big.advance(100)
    assert big.erlang_c == pytest.approx(erlang_c(32_100, 31_900.0), rel=1e-10)


def test_p99_wait_kimura_by_hand():
    # M/M/1, mu = 1, lambda = 0.5, cs2 = 1: C = 0.5,
    # W99 = ln(0.5 / 0.01) * (1 + 1) / (2 * (1 - 0.5)) = 2 ln 50.
    assert p99_wait(1, 1.0, 1.0, 0.5) == pytest.approx(2 * math.log(50), rel=1e-14)
    # deterministic service (cs2 = 0) halves it
    assert p99_wait(1, 1.0, 0.0, 0.5) == pytest.approx(math.log(50), rel=1e-14)
    c = erlang_c(20, 18.0)
    assert p99_wait(20, 2.0, 0.5, 36.0) == pytest.approx(
        math.log(c / 0.01) * 1.5 / (2 * (40 - 36)), rel=1e-12
    )
    assert p99_wait(100, 1.0, 1.0, 50.0) == 0.0  # C <= 0.01
    assert p99_wait(2, 1.0, 1.0, 2.0) == math.inf


@pytest.mark.parametrize(
    "call",
    [
        lambda: erlang_c(0, 1.0),
        lambda: erlang_c(10, 10.0),
        lambda: erlang_c(10, 11.0),
        lambda: erlang_c(10, float("nan")),
        lambda: erlang_c(10, -1.0),
        lambda: erlang_b(10, float("inf")),
        lambda: p99_wait(0, 1.0, 1.0, 0.5),
        lambda: p99_wait(1, 0.0, 1.0, 0.5),
        lambda: p99_wait(1, 1.0, -0.1, 0.5),
        lambda: p99_wait(1, 1.0, 1.0, float("nan")),
        lambda: ErlangScan(0, 1.0),
        lambda: ErlangScan(1, 0.0),
        lambda: erlang_c(2**40 + 1, 1.0),
        lambda: ErlangScan(10, 1.0).advance(2**33),
    ],
)
def test_bad_input_raises(call):
    with pytest.raises(ValueError):
        call()
    with pytest.raises(ValueError):
        erlang_c(-1, 1.0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40_000), st.floats(0.0, 0.999)), min_size=0, max_size=30))
def test_many_equals_single(pairs):
    cs = [c for c, _ in pairs]
    loads = [rho * c for c, rho in pairs]
    got = erlang_c_many(np.array(cs, dtype=np.int64), np.array(loads, dtype=np.float64))
    assert got.tolist() == [erlang_c(c, a) for c, a in zip(cs, loads)]


def test_many_errors():
    with pytest.raises(ValueError):
        erlang_c_many([1, 2], [0.5])
    with pytest.raises(ValueError):
        erlang_c_many([1, 0], [0.5, 0.5])
    with pytest.raises(ValueError):
        erlang_c_many([1.5], [0.5])
    with pytest.raises(ValueError):
        erlang_c_many([2], [2.0])


def test_scan_snapshot_round_trip():
    s = ErlangScan(100, 90.0)
    s.advance(57)
    for back in (ErlangScan.from_bytes(s.to_bytes()), pickle.loads(pickle.dumps(s))):
        assert back.servers == 157 and back.erlang_c == s.erlang_c
        back.advance()
        assert s.servers == 157  # the copy is independent
    data = s.to_bytes()
    for bad in (b"", data[:-1], data + b"x", b"XXXX" + data[4:]):
        with pytest.raises(ValueError):
            ErlangScan.from_bytes(bad)
