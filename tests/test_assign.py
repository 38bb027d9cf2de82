"""Batched model and endpoint assignment (RouteBalance): hand-worked cases,
properties, snapshots, bad input, the kNN estimator and the evaluation."""

import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import BatchScheduler, Endpoint, KnnEstimator, assign_eval
from routecore.cli import main


def inst(name, model, tpot=0.01, price=1.0, max_batch=8):
    return Endpoint(name, model, tpot, price, price, max_batch, 0.0)


def idle(n):
    return np.zeros(n), np.zeros(n, dtype=np.int64)


def test_endpoint_latency_and_cost_by_hand():
    i = Endpoint("a", "m", 0.02, 2.0, 4.0, 2, 0.001)
    # prefill 400 * 0.001 + no free slot: 300 / 2 * 0.02 + decode 50 * 0.02
    assert i.latency(400, 50, 300, 2) == pytest.approx(0.4 + 3.0 + 1.0)
    assert i.latency(400, 50, 300, 1) == pytest.approx(0.4 + 1.0)
    assert i.cost(400, 50) == pytest.approx((400 * 2 + 50 * 4) / 1e6)
    # default prefill: tpot / 200
    assert Endpoint("a", "m", 0.02, 0, 0, 2).prefill_s_per_token == pytest.approx(1e-4)
    assert "tpot_s=0.02" in repr(i)


def test_lpt_order_longest_first_by_each_key():
    lens = np.array([[10.0, 50.0], [80.0, 5.0], [30.0, 30.0]])
    order = {}
    for key in ("max", "mean", "min"):
        s = BatchScheduler([inst("a", "x"), inst("b", "y")], lpt_key=key)
        order[key] = s.lpt_order(lens).tolist()
    # max 50 / 80 / 30; mean 30 / 42.5 / 30 (ties in batch order); min 10 / 5 / 30
    assert order == {"max": [1, 0, 2], "mean": [1, 0, 2], "min": [2, 0, 1]}


def test_lpt_decides_who_gets_the_fast_endpoint():
    # One fast and one slow endpoint of the same model, one slot each. The
    # longer request is scored first and takes the fast endpoint, even when it
    # comes second in the batch.
    s = BatchScheduler(
        [inst("slow", "m", tpot=0.05, max_batch=1), inst("fast", "m", tpot=0.01, max_batch=1)],
        weights=(0.0, 1.0, 0.0),
    )
    got = s.assign([[0.5], [0.5]], [[10.0], [500.0]], [0, 0], None, *idle(2))
    assert got.tolist() == [0, 1]


def test_dead_reckoning_spreads_identical_requests():
    s = BatchScheduler([inst(f"i{k}", "m", max_batch=1) for k in range(4)])
    got = s.assign(np.full((4, 1), 0.5), np.full((4, 1), 100.0), [10] * 4, None, *idle(4))
    assert sorted(got.tolist()) == [0, 1, 2, 3]
    # 8 requests over 4 endpoints with room for 2 each: two apiece
    s = BatchScheduler([inst(f"i{k}", "m", max_batch=2) for k in range(4)])
    got = s.assign(np.full((8, 1), 0.5), np.full((8, 1), 100.0), [10] * 8, None, *idle(4))
    assert np.bincount(got, minlength=4).tolist() == [2, 2, 2, 2]


def test_ties_go_to_smaller_batch_then_least_recently_assigned():
    s = BatchScheduler([inst("a", "m"), inst("b", "m"), inst("c", "m")])
    one = [[0.5]], [[10.0]], [1], None
    # free slots everywhere, equal scores: the smallest batch wins
    assert s.assign(*one, np.zeros(3), [3, 1, 2]).tolist() == [1]
    # equal batches: never assigned counts oldest, so a, then c, then b again
    assert s.assign(*one, np.zeros(3), [0, 0, 0]).tolist() == [0]
    assert s.assign(*one, np.zeros(3), [0, 0, 0]).tolist() == [2]
    assert s.assign(*one, np.zeros(3), [0, 0, 0]).tolist() == [1]


def test_budget_filter_and_fallback():
    fleet = [inst("cheap", "small", price=1.0), inst("dear", "large", price=10.0)]
    q, lens, tokens = [[0.2, 0.9]], [[1000.0, 1000.0]], [1000]
    # cost: cheap (1000 + 1000) * 1 / 1e6 = 0.002, dear 0.02; quality wants dear
    for fallback, budget, want in [
        ("reject", None, 1),
        ("reject", math.inf, 1),
        ("reject", 0.02, 1),
        ("reject", 0.0199, 0),
        ("reject", 0.0019, -1),
        ("cheapest", 0.0019, 0),
    ]:
        s = BatchScheduler(fleet, weights=(1, 0, 0), budget_fallback=fallback)
        b = None if budget is None else [budget]
        assert s.assign(q, lens, tokens, b, *idle(2)).tolist() == [want], (fallback, budget)
        assert s.assign_one(q[0], lens[0], 1000, budget, *idle(2)) == want


def test_each_preset_pulls_towards_its_corner():
    # A good, slow and dear; B fast; C cheap. out 100, no prompt:
    # latency 4 / 1 / 3 s, cost 100e-6 / 50e-6 / 5e-6 USD.
    fleet = [inst("A", "a", 0.04, 1.0), inst("B", "b", 0.01, 0.5), inst("C", "c", 0.03, 0.05)]
    q, lens = [[0.9, 0.5, 0.4]], [[100.0] * 3]
    presets = dict(BatchScheduler.presets())
    assert presets["balanced"] == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    rel_lat = [1 - 4 / 4, 1 - 1 / 4, 1 - 3 / 4]
    rel_cost = [1 - 100 / 100, 1 - 50 / 100, 1 - 5 / 100]
    for name, want in [("quality", 0), ("latency", 1), ("cost", 2)]:
        wq, wl, wc = presets[name]
        score = [wq * q[0][i] + wl * rel_lat[i] + wc * rel_cost[i] for i in range(3)]
        assert int(np.argmax(score)) == want
        s = BatchScheduler(fleet, weights=name)
        assert s.assign(q, lens, [0], None, *idle(3)).tolist() == [want]
        assert s.weights == pytest.approx(presets[name])


def test_latency_term_sees_queues():
    # Same model twice; endpoint 0 is full with 1000 pending tokens: wait
    # 1000 / 2 * 0.01 = 5 s. The request goes to the idle one.
    s = BatchScheduler([inst("a", "m", max_batch=2), inst("b", "m", max_batch=2)])
    got = s.assign([[0.5]], [[50.0]], [0], None, [1000.0, 0.0], [2, 0])
    assert got.tolist() == [1]


@st.composite
def batches(draw):
    n_inst = draw(st.integers(1, 6))
    n_models = draw(st.integers(1, min(3, n_inst)))
    b = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    fleet = [
        Endpoint(
            f"i{k}",
            f"m{k % n_models}",
            float(rng.uniform(0.005, 0.05)),
            float(rng.uniform(0, 1)),
            float(rng.uniform(0, 1)),
            int(rng.integers(1, 4)),
        )
        for k in range(n_inst)
    ]
    arrays = (
        rng.uniform(0, 1, (b, n_models)),
        rng.integers(1, 400, (b, n_models)).astype(float),
        rng.integers(0, 2000, b),
        np.where(rng.uniform(size=b) < 0.3, rng.uniform(0, 5e-4, b), np.inf),
        rng.integers(0, 500, n_inst).astype(float),
        rng.integers(0, 4, n_inst),
    )
    weights = tuple(rng.uniform(0, 1, 3) + 1e-3)
    return fleet, weights, arrays


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(["reject", "cheapest"]))
def test_batch_equals_one_by_one_with_state_carried(case, fallback):
    fleet, weights, (q, lens, tokens, budget, pending, sizes) = case
    whole = BatchScheduler(fleet, weights=weights, budget_fallback=fallback)
    got = whole.assign(q, lens, tokens, budget, pending, sizes)
    one = BatchScheduler(fleet, weights=weights, budget_fallback=fallback)
    pending, sizes = pending.copy(), sizes.copy()
    want = np.full(len(tokens), -2)
    for r in one.lpt_order(lens):
        i = one.assign_one(q[r], lens[r], int(tokens[r]), float(budget[r]), pending, sizes)
        want[r] = i
        if i >= 0:
            pending[i] += lens[r][one.model_of[i]]
            sizes[i] += 1
    assert got.tolist() == want.tolist()
    assert whole.to_bytes() == one.to_bytes()
    # every assignment respects the budget; -1 only when nothing fits
    for r, i in enumerate(got):
        costs = [f.cost(tokens[r], lens[r][whole.model_of[k]]) for k, f in enumerate(fleet)]
        if i >= 0 and min(costs) <= budget[r]:
            assert costs[i] <= budget[r]
        assert (i == -1) == (fallback == "reject" and min(costs) > budget[r])


def test_snapshot_and_pickle_round_trip():
    s = BatchScheduler([inst("a", "m"), inst("b", "n", 0.02)], weights=(0.2, 0.3, 0.5))
    s.assign([[0.5, 0.1]], [[10.0, 9.0]], [1], None, *idle(2))
    data = s.to_bytes()
    for back in (BatchScheduler.from_bytes(data), pickle.loads(pickle.dumps(s))):
        assert back.to_bytes() == data
        assert back.models == ["m", "n"] and back.weights == pytest.approx((0.2, 0.3, 0.5))
        # the recency state came along: the next tie goes to the same endpoint
        args = [[0.5, 0.5]], [[10.0, 10.0]], [1], None, *idle(2)
        assert back.assign(*args).tolist() == BatchScheduler.from_bytes(data).assign(*args).tolist()
    with pytest.raises(ValueError):
        BatchScheduler.from_bytes(data[:-1])
    with pytest.raises(ValueError):
        BatchScheduler.from_bytes(b"nope" + data)


def test_bad_input_raises_and_changes_nothing():
    s = BatchScheduler([inst("a", "m"), inst("b", "m")])
    s.assign([[0.5]], [[10.0]], [1], None, *idle(2))
    before = s.to_bytes()
    good = dict(
        quality=[[0.5]],
        out_len=[[10.0]],
        in_tokens=[1],
        budget=None,
        pending_decode=[0.0, 0.0],
        batch_size=[0, 0],
    )
    bad = [
        dict(quality=[[0.5, 0.5]]),
        dict(quality=[[math.nan]]),
        dict(quality=[0.5]),
        dict(quality=[["x"]]),
        dict(out_len=[[-1.0]]),
        dict(out_len=[[math.inf]]),
        dict(in_tokens=[-1]),
        dict(in_tokens=[1.5]),
        dict(in_tokens=[1, 2]),
        dict(budget=[math.nan]),
        dict(budget=[-1.0]),
        dict(budget=[1.0, 2.0]),
        dict(pending_decode=[0.0]),
        dict(pending_decode=[-1.0, 0.0]),
        dict(batch_size=[0, -1]),
        dict(batch_size=[0, 0, 0]),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            s.assign(**{**good, **change})
    assert s.to_bytes() == before
    with pytest.raises(KeyError):
        BatchScheduler([inst("a", "m")], weights="fastest")
    for kwargs in [
        dict(weights=(0, 0, 0)),
        dict(weights=(-1, 1, 1)),
        dict(weights=(1, 1)),
        dict(lpt_key="median"),
        dict(budget_fallback="maybe"),
    ]:
        with pytest.raises(ValueError):
            BatchScheduler([inst("a", "m")], **kwargs)
    with pytest.raises(ValueError):
        BatchScheduler([])
    with pytest.raises(ValueError):
        BatchScheduler([inst("a", "m"), inst("a", "n")])
    for args in [
        ("a", "m", 0.0, 1, 1, 1),
        ("a", "m", math.nan, 1, 1, 1),
        ("a", "m", 0.01, -1, 1, 1),
        ("a", "m", 0.01, 1, 1, 0),
        ("", "m", 0.01, 1, 1, 1),
    ]:
        with pytest.raises(ValueError):
            Endpoint(*args)


def test_knn_by_hand():
    s = math.sqrt(0.5)
    est = KnnEstimator(k=2)
    est.fit(
        np.array([[1, 0], [0, 2], [s, s]], dtype=np.float32),
        [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]],
        [[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]],
    )
    # query at 30 degrees: cos 0.966 to row 2 (15 deg), 0.866 to row 0, 0.5 to row 1
    q, lens = est.predict([[math.cos(math.pi / 6), math.sin(math.pi / 6)]])
    wa = 1 / (1 - math.cos(math.pi / 12) + 1e-6)
    wb = 1 / (1 - math.cos(math.pi / 6) + 1e-6)
    assert lens[0, 0] == pytest.approx((wa * 50 + wb * 10) / (wa + wb), rel=1e-4)
    assert q[0, 1] == pytest.approx((wa * 0.5 + wb * 0.0) / (wa + wb), rel=1e-4)
    assert q.shape == lens.shape == (1, 2)


def test_knn_matches_brute_force():
    rng = np.random.default_rng(5)
    emb = rng.normal(size=(200, 16)).astype(np.float32)
    quality, lens = rng.uniform(size=(200, 3)), rng.uniform(10, 500, (200, 3))
    queries = rng.normal(size=(7, 16)).astype(np.float32)
    est = KnnEstimator(k=5)
    est.fit(emb, quality, lens)
    got_q, got_l = est.predict(queries)
    # one query at a time gives exactly the batched rows
    for j in range(len(queries)):
        one_q, one_l = est.predict(queries[j : j + 1])
        assert np.array_equal(one_q[0], got_q[j]) and np.array_equal(one_l[0], got_l[j])
    for j, x in enumerate(queries):
        sims = [float(np.dot(e, x) / np.linalg.norm(e) / np.linalg.norm(x)) for e in emb]
        top = sorted(range(len(emb)), key=lambda r: -sims[r])[:5]
        w = [1 / (1 - sims[r] + 1e-6) for r in top]
        for c in range(3):
            want_q = sum(wi * quality[r, c] for wi, r in zip(w, top)) / sum(w)
            want_l = sum(wi * lens[r, c] for wi, r in zip(w, top)) / sum(w)
            assert got_q[j, c] == pytest.approx(want_q, rel=1e-4)
            assert got_l[j, c] == pytest.approx(want_l, rel=1e-4)


def test_knn_state_errors_and_round_trip():
    est = KnnEstimator(k=3)
    assert not est.is_fitted and "unfitted" in repr(est)
    with pytest.raises(ValueError):
        est.predict(np.ones((1, 4), dtype=np.float32))
    assert pickle.loads(pickle.dumps(est)).k == 3
    emb = np.eye(4, dtype=np.float32) + 0.1
    est.fit(emb, np.eye(4), np.ones((4, 4)))
    for bad in [
        (np.zeros((4, 4)), np.eye(4), np.ones((4, 4))),
        (emb, np.eye(3), np.ones((3, 3))),
        (emb, np.eye(4), -np.ones((4, 4))),
        (emb[:, :, None], np.eye(4), np.ones((4, 4))),
    ]:
        with pytest.raises(ValueError):
            est.fit(*bad)
    with pytest.raises(ValueError):
        est.predict(np.ones((1, 3)))
    with pytest.raises(ValueError):
        est.predict(np.zeros((1, 4)))
    with pytest.raises(ValueError):
        KnnEstimator(k=0)
    want = est.predict(emb)
    for back in (KnnEstimator.from_bytes(est.to_bytes()), pickle.loads(pickle.dumps(est))):
        got = back.predict(emb)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    with pytest.raises(ValueError):
        KnnEstimator.from_bytes(est.to_bytes()[:-3])


def test_evaluation_reproduces_the_papers_finding():
    rows = {r["policy"]: r for r in assign_eval(rate=8.0, requests=1500, seed=1)}
    q, lat, cost = rows["quality"], rows["latency"], rows["cost"]
    # each preset pulls towards its corner
    assert q["quality"] > max(lat["quality"], cost["quality"])
    assert lat["mean_latency_s"] < q["mean_latency_s"]
    assert cost["cost_per_request_usd"] < min(
        q["cost_per_request_usd"], lat["cost_per_request_usd"]
    )
    # quality argmax piles onto the slow 72B tier and pays for it in latency
    argmax = rows["decoupled q=1.00"]
    assert argmax["model_share"]["qwen2.5-72b"] > 0.4
    assert argmax["mean_latency_s"] > 2 * q["mean_latency_s"]
    # pricing latency at selection time: at each quality weight the scheduler
    # is no slower than the decoupled router, and faster in the middle
    for w in ("0.95", "0.90", "0.70", "0.50"):
        sched, dec = rows[f"scheduler q={w}"], rows[f"decoupled q={w}"]
        assert sched["mean_latency_s"] <= dec["mean_latency_s"] * 1.02, w
    assert (
        rows["scheduler q=0.70"]["mean_latency_s"]
        < 0.95 * rows["decoupled q=0.70"]["mean_latency_s"]
    )
    for r in rows.values():
        assert sum(r["model_share"].values()) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        assign_eval(rate=0.0)
    with pytest.raises(ValueError):
        assign_eval(requests=0)


def test_assign_eval_command(capsys, tmp_path):
    png = tmp_path / "frontier.png"
    assert main(["assign-eval", "--requests", "400", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| policy |") and "| round-robin |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["assign-eval", "--rate", "-1"]) == 2


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 400),
    dim=st.integers(8, 96),  # dimensions where exact ties (which NumPy breaks arbitrarily) are rare
    b=st.integers(1, 40),
    k=st.integers(1, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_knn_matches_numpy_and_each_query_alone(n, dim, b, k, seed):
    from routecore._baselines.assign import Knn

    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(n, dim)).astype(np.float32)
    quality, lens = rng.uniform(size=(n, 3)), rng.uniform(10, 500, (n, 3))
    queries = rng.normal(size=(b, dim)).astype(np.float32)
    est = KnnEstimator(k=k)
    est.fit(emb, quality, lens)
    got_q, got_l = est.predict(queries)
    want_q, want_l = Knn(min(k, n), emb, quality, lens).predict(queries)
    np.testing.assert_allclose(got_q, want_q, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-4)
    # the GEMM's rounding depends on the batch; the prediction does not
    for j in range(b):
        one_q, one_l = est.predict(queries[j : j + 1])
        assert np.array_equal(one_q[0], got_q[j]) and np.array_equal(one_l[0], got_l[j])
