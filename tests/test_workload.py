"""Workload: the shipped Azure trace's published facts, exact range moments
against direct NumPy sums, CSV loading and its errors, from_cdf."""

import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import Profile, Workload

AZURE = Workload.azure_2023()


def test_azure_trace_published_facts():
    # The facts in the trace's README (and FleetOpt Section 7.1 / Table 2).
    assert len(AZURE) == 28_185
    total = AZURE.total_tokens
    assert round(total.mean()) == 1_588
    assert AZURE.mean_tokens() == pytest.approx(total.mean(), rel=1e-12)
    assert AZURE.quantile(0.99) == 7_445
    assert AZURE.quantile(0.5) == 1_417
    assert AZURE.quantile(1.0) == 14_089
    assert round(AZURE.cdf(4096), 3) == 0.898  # alpha
    assert round(AZURE.cdf(6144) - AZURE.cdf(4096), 3) == 0.078  # beta at gamma 1.5
    assert round(AZURE.cdf(2048), 3) == 0.780
    cats = AZURE.categories
    assert cats is not None
    assert (cats == "code").sum() == 8_819
    assert (cats == "conversation").sum() == 19_366
    arrival = AZURE.arrival_s
    assert arrival is not None
    assert arrival[0] == 0.0
    assert np.all(np.diff(arrival) >= 0)
    # the trace spans about an hour (18:15:46 to 19:14:19)
    assert 3500 < arrival[-1] < 3600


def direct_moments(w, profile, lo, hi, max_context):
    """E[S] and Cs^2 by direct NumPy sums over the requests in (lo, hi]."""
    inp = w.input_tokens.astype(float)
    out = w.output_tokens.astype(float)
    total = inp + out
    wt = w.weights
    m = (total > lo) & (total <= hi)
    n = profile.slots(max_context)
    k = np.ceil(inp[m] / profile.c_chunk) + out[m]
    if profile.h_ref_tokens is None:
        s = k * (profile.w_s + profile.h_s * n)
    else:
        s = k * (profile.w_s + profile.h_s * total[m] / profile.h_ref_tokens * n)
    mean = np.average(s, weights=wt[m])
    var = np.average((s - mean) ** 2, weights=wt[m])
    return mean, var / mean**2, wt[m].sum() / wt.sum()


@pytest.mark.parametrize("h_ref", [None, 8192])
@pytest.mark.parametrize(
    "lo,hi,ctx", [(0, 4096, 4096), (4096, 1e9, 65536), (0, 1e9, 65536), (6144, 8192, 8192)]
)
def test_range_moments_equal_direct_sums(lo, hi, ctx, h_ref):
    p = Profile.llama3_70b_a100().replace(h_ref_tokens=h_ref)
    s = p.service(AZURE, ctx, lo, hi)
    mean, cs2, frac = direct_moments(AZURE, p, lo, hi, ctx)
    assert s.mean_s == pytest.approx(mean, rel=1e-11)
    assert s.cs2 == pytest.approx(cs2, rel=1e-9)
    assert s.fraction == pytest.approx(frac, rel=1e-12)
    assert s.mu_gpu == pytest.approx(p.slots(ctx) / mean, rel=1e-11)


def test_prefill_p99_is_the_ranges_p99_chunk_count():
    p = Profile.llama3_70b_a100()
    s = p.service(AZURE, 4096, 0, 4096)
    inp = AZURE.input_tokens[AZURE.total_tokens <= 4096]
    chunks = np.sort(np.ceil(inp / 512))
    p99 = chunks[int(np.ceil(0.99 * len(chunks))) - 1]
    assert s.prefill_p99_s == pytest.approx(p99 * s.t_iter_s, rel=1e-12)
    assert s.t_iter_s == pytest.approx(0.008 + 0.00065 * 256)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5000), st.integers(1, 2000), st.sampled_from(["a", "b"])),
        min_size=1,
        max_size=60,
    ),
    st.integers(0, 8000),
    st.integers(0, 8000),
)
def test_moments_property(rows, lo, width):
    inp, out, cats = zip(*rows)
    w = Workload(np.array(inp), np.array(out), categories=list(cats))
    p = Profile.llama3_70b_a100().replace(h_ref_tokens=4096)
    hi = lo + width
    s = p.service(w, 8192, lo, hi)
    total = np.array(inp) + np.array(out)
    if not ((total > lo) & (total <= hi)).any():
        assert s.fraction == 0 and s.mean_s == 0
        return
    mean, cs2, frac = direct_moments(w, p, lo, hi, 8192)
    assert s.mean_s == pytest.approx(mean, rel=1e-9)
    assert s.cs2 == pytest.approx(cs2, rel=1e-6, abs=1e-9)
    assert s.fraction == pytest.approx(frac)
    # F and its inverse agree: F(quantile(q)) >= q, and nothing smaller reaches q
    for q in (0.0, 0.25, 0.5, 0.99, 1.0):
        x = w.quantile(q)
        assert w.cdf(x) >= q - 1e-12
        assert w.cdf(x - 1) < q or x == total.min()


def test_from_cdf_is_linear_interpolation():
    w = Workload.from_cdf([(100, 0.5), (300, 1.0)], input_fraction=0.8)
    assert len(w) == 300
    assert w.cdf(50) == pytest.approx(0.25)
    assert w.cdf(200) == pytest.approx(0.75)
    assert w.quantile(0.5) == 100
    assert w.input_tokens[299] == 240 and w.output_tokens[299] == 60
    assert w.weights.sum() == pytest.approx(1.0)
    # mean of uniform integers 1..100 (mass .5) and 101..300 (mass .5)
    assert w.mean_tokens() == pytest.approx(0.5 * 50.5 + 0.5 * 200.5)


def test_csv_loading_and_errors(tmp_path):
    good = tmp_path / "t.csv"
    good.write_text("in,out,t,kind\n100,10,2.5,code\n200,20,1.0,chat\n")
    w = Workload.from_csv(good, "in", "out", arrival_column="t", category_column="kind")
    assert list(w.input_tokens) == [200, 100]  # ordered by arrival
    assert list(w.arrival_s) == [0.0, 1.5]
    assert list(w.categories) == ["chat", "code"]
    with pytest.raises(ValueError, match="no column"):
        Workload.from_csv(good, "prompt", "out")
    for body, msg in [
        ("in,out\n-5,1\n", "non-negative"),
        ("in,out\nabc,1\n", "non-negative"),
        ("in,out\n", "at least one"),
        ("in,out\n1\n", "fields"),
    ]:
        bad = tmp_path / "bad.csv"
        bad.write_text(body)
        with pytest.raises(ValueError, match=msg):
            Workload.from_csv(bad, "in", "out")
    with pytest.raises(OSError):
        Workload.from_csv(tmp_path / "missing.csv")


def test_bad_arrays_are_refused():
    with pytest.raises(ValueError):
        Workload([], [])
    with pytest.raises(ValueError):
        Workload([1, 2], [1])
    with pytest.raises(ValueError):
        Workload([-1], [1])
    with pytest.raises(ValueError):
        Workload([1.5], [1])
    with pytest.raises(ValueError):
        Workload([1, 1], [1, 1], arrival_s=[2.0, 1.0])
    with pytest.raises(ValueError):
        Workload([1], [1], arrival_s=[float("nan")])
    with pytest.raises(ValueError):
        Workload([1], [1], categories=["a", "b"])
    with pytest.raises(ValueError):
        AZURE.quantile(1.5)
    with pytest.raises(ValueError):
        AZURE.cdf(float("nan"))


def test_pickle_round_trip():
    w = Workload([10, 20], [1, 2], arrival_s=[0.0, 0.5], categories=["x", "y"])
    back = pickle.loads(pickle.dumps(w))
    assert list(back.input_tokens) == [10, 20]
    assert list(back.arrival_s) == [0.0, 0.5]
    assert list(back.categories) == ["x", "y"]


@pytest.mark.parametrize("arrival", [[[1.0]], ["x"], [True], [1 + 2j]])
def test_bad_arrival_arrays_are_refused(arrival):
    with pytest.raises(ValueError, match="arrival_s"):
        Workload([1], [1], arrival_s=arrival)


def test_sample_draws_by_weight_and_is_seeded():
    w = Workload.from_cdf([(1000, 0.9), (8000, 1.0)])
    s = w.sample(50_000, seed=3)
    assert len(s) == 50_000 and s.weights.tolist() == [1.0] * 50_000
    assert s.cdf(1000) == pytest.approx(0.9, abs=0.01)
    assert list(s.input_tokens[:100]) == list(w.sample(50_000, seed=3).input_tokens[:100])
    boot = AZURE.sample(1000, seed=1)
    assert set(boot.categories) <= {"code", "conversation"}
    assert boot.arrival_s is None
    with pytest.raises(ValueError):
        w.sample(0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9000), st.integers(0, 500)), min_size=1, max_size=80),
    st.integers(0, 9000),
    st.floats(0.0, 1.0),
)
def test_prefill_quantile_property(rows, lo, q):
    """The wavelet-matrix range quantile equals a sort of the range's chunk counts."""
    rows = [(i, o) for i, o in rows if i + o > 0] or [(1, 1)]
    inp, out = (np.array(x) for x in zip(*rows))
    w = Workload(inp, out)
    p = Profile.llama3_70b_a100()
    s = p.service(w, 65536, lo, math.inf, prefill_quantile=q)
    m = inp + out > lo
    if not m.any():
        assert s.prefill_p99_s == 0.0
        return
    chunks = np.sort(np.ceil(inp[m] / 512))
    k = max(0, math.ceil(q * len(chunks) - 1e-9) - 1)
    assert s.prefill_p99_s == pytest.approx(chunks[k] * s.t_iter_s, rel=1e-12, abs=1e-15)
