"""VTC fairness routing (AIBrix vtc-basic), worked by hand and in a small
processor-sharing model of a fleet."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import NotInFlightError, VtcRouter


def test_scores_worked_by_hand():
    r = VtcRouter(["p0", "p1", "p2"])
    # No active user: bucket = max(1000, (1000 + 8000) / 2), x = 0 -> p0.
    assert r.route("a", 100, 200, now=0.0) == "p0"
    assert r.user_tokens("a", now=0.0) == 100 * 1.0 + 200 * 2.0
    # Only a (500) active: bucket = max(1000, 500) = 1000, x = 0.5;
    # p0 scores 0.5 + 1/100, p1 0.5 + 0: p1.
    assert r.route("a", 100, 200, now=1.0) == "p1"
    # b has nothing: x = 0, p0 (0 + 0.01) beats p1 (1 + 0.01).
    assert r.route("b", 100, 200, now=2.0) == "p0"
    assert r.running == [2, 1, 0]
    assert r.users == 2
    # A heavy user lands on the last endpoint: x = min(20500 / 10500, 2) = 1.95.
    r.route("h", 20_000, 0, now=3.0)
    assert r.route("h", 0, 0, now=4.0) == "p2"


def test_utilization_moves_requests_off_a_full_endpoint():
    r = VtcRouter(["p0", "p1"], utilization_weight=2.0)
    # p0: 0 + 2 * 60/100 = 1.2; p1: |1 - 0| + 0 = 1.0.
    assert r.route("z", 0, 0, running=[60, 0]) == "p1"
    # p0: 2 * 40/100 = 0.8 < 1.0.
    assert r.route("z", 0, 0, running=[40, 0]) == "p0"
    # Utilization saturates at max_endpoint_load: 2 * min(500/100, 1) = 2 < 1 + 2 * 0.99.
    assert r.route("z", 0, 0, running=[500, 99]) == "p0"


def test_window_and_completion():
    r = VtcRouter(["p0", "p1"], window_s=100.0)  # buckets of 10 s
    r.route("a", 100, 100, now=0.0)
    assert r.user_tokens("a", 99.9) == 300.0
    assert r.user_tokens("a", 100.0) == 0.0  # bucket [0, 10) has left the window
    assert r.users == 0
    endpoint = r.route("a", 100, 100, now=101.0)
    r.complete(endpoint, "a", 100, 100, 150, 400, now=102.0)  # +50 + 2 * 300
    assert r.user_tokens("a", 102.0) == 950.0
    endpoint = r.route("a", 0, 0, now=103.0)
    r.complete(endpoint, "a", 0, 5000, 0, 0, now=103.0)
    assert r.user_tokens("a", 103.0) == 0.0  # never below zero


def test_bounded_users():
    r = VtcRouter(["p0"], max_users=3)
    for i in range(10):
        r.route(f"u{i}", 10, 0, now=float(i))
        assert r.users <= 3
    assert [r.user_tokens(f"u{i}", 9.0) for i in range(10)] == [0.0] * 7 + [10.0] * 3


def test_bad_input_leaves_state_unchanged():
    r = VtcRouter(["p0", "p1"])
    r.route("a", 10, 10)
    before = r.to_bytes()
    bad = [
        lambda: r.route("", 1, 1),
        lambda: r.route("a" * 257, 1, 1),
        lambda: r.route("a", -1, 1),
        lambda: r.route("a", 1, 2**31),
        lambda: r.route("a", 1, 1, now=float("nan")),
        lambda: r.route("a", 1, 1, running=[1]),
        lambda: r.route("a", 1, 1, running=[1, -1]),
        lambda: r.route_many(["a", "b"], [1, 1], [1]),
        lambda: r.route_many(["a", ""], [1, 1], [1, 1]),
        lambda: r.complete("p0", "a", 1, -1, 1, 1),
        lambda: r.add_endpoint("p0"),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(NotInFlightError):
        r.complete("p1", "a", 1, 1, 1, 1)  # nothing running on p1
    with pytest.raises(KeyError):
        r.complete("nope", "a", 1, 1, 1, 1)
    with pytest.raises(KeyError):
        r.remove_endpoint("nope")
    assert r.to_bytes() == before
    for kwargs in (
        {"window_s": 0.0},
        {"output_weight": -1.0},
        {"min_tokens": 0.0},
        {"max_tokens": 10.0},
        {"max_endpoint_load": float("inf")},
        {"max_users": 0},
        {"max_users": -1},
    ):
        with pytest.raises(ValueError):
            VtcRouter(["p0"], **kwargs)
    with pytest.raises(ValueError):
        VtcRouter([]).route("a", 1, 1)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("hablc"), st.integers(0, 5000), st.integers(0, 2000)),
        min_size=1,
        max_size=30,
    ),
    st.lists(st.integers(0, 50), min_size=3, max_size=3),
)
def test_route_many_equals_route_one_by_one(requests, running):
    one, many = VtcRouter(["p0", "p1", "p2"]), VtcRouter(["p0", "p1", "p2"])
    singles = [
        one.route(u, i, o, running if k == 0 else None, 5.0) for k, (u, i, o) in enumerate(requests)
    ]
    users, ins, outs = zip(*requests)
    idx = many.route_many(list(users), np.array(ins), np.array(outs), running, 5.0)
    assert [many.endpoints[i] for i in idx] == singles
    assert one.to_bytes() == many.to_bytes()


def test_snapshot_round_trip_continues_identically():
    r = VtcRouter(["p0", "p1", "p2"], window_s=60.0)
    for k in range(40):
        r.route(f"u{k % 7}", 100 * (k % 5), 50 * (k % 3), now=float(k))
    back = pickle.loads(pickle.dumps(r))
    assert back.to_bytes() == r.to_bytes()
    for k in range(40, 60):
        args = (f"u{k % 9}", 100 * (k % 4), 30, None, float(k))
        assert back.route(*args) == r.route(*args)
    data = r.to_bytes()
    for bad in (data[:-1], data + b"\0", b"RCVT\x01\x00"):
        with pytest.raises(ValueError):
            VtcRouter.from_bytes(bad)


def light_share(policy, steps=400, endpoints=4, heavy_requests=24, light_users=6, rate=100.0):
    """Closed-loop processor sharing: each endpoint serves ``rate`` output tokens a
    second, split equally among its running requests; every request wants 200
    output tokens. The heavy user keeps ``heavy_requests`` requests open, each
    light user one. Returns the light users' share of the tokens served."""
    names = [f"p{i}" for i in range(endpoints)]
    vtc = VtcRouter(names)
    running = []  # [user, endpoint, tokens left]
    served = {"heavy": 0.0, "light": 0.0}

    def submit(user, now):
        counts = [sum(1 for r in running if r[1] == p) for p in range(endpoints)]
        if policy == "vtc":
            endpoint = names.index(vtc.route(user, 100, 200, running=counts, now=now))
        else:
            endpoint = int(np.argmin(counts))
        running.append([user, endpoint, 200.0])

    for _ in range(heavy_requests):
        submit("heavy", 0.0)
    for k in range(light_users):
        submit(f"light{k}", 0.0)
    for t in range(1, steps + 1):
        for p in range(endpoints):
            here = [r for r in running if r[1] == p]
            for r in here:
                r[2] -= rate / len(here)
                served["heavy" if r[0] == "heavy" else "light"] += rate / len(here)
        for r in [r for r in running if r[2] <= 0]:
            running.remove(r)
            if policy == "vtc":
                vtc.complete(names[r[1]], r[0], 100, 200, 100, 200, now=float(t))
            submit(r[0], float(t))
    return served["light"] / (served["light"] + served["heavy"])


def test_light_users_get_more_service_than_under_least_request():
    vtc, least = light_share("vtc"), light_share("least-request")
    # Least-request mixes everyone: light users hold 6 of 30 requests, about 20%.
    assert least == pytest.approx(0.2, abs=0.05)
    assert vtc > least + 0.15


def test_route_many_of_100k_new_users_into_a_full_table_forgets_the_least_recent():
    # The default max_users, full: each new user forgets the least recently
    # active one (oldest latest bucket, then the smallest name). With a scan
    # per eviction this batch took longer than 300 s.
    n = 100_000
    r = VtcRouter(["p0", "p1"])
    assert r.max_users == n
    old = [f"old-{i:06d}" for i in range(n)]
    r.route_many(old, np.full(n, 10), np.zeros(n, dtype=np.int64), now=0.0)
    # Touched in a later bucket (30 s wide): the 100 most recently active.
    r.route_many(old[-100:], np.full(100, 5), np.zeros(100, dtype=np.int64), now=40.0)
    new = [f"new-{i:06d}" for i in range(n - 100)]
    r.route_many(new, np.full(n - 100, 7), np.zeros(n - 100, dtype=np.int64), now=41.0)
    assert r.users == n
    assert [r.user_tokens(u, 41.0) for u in (old[0], old[n // 2], old[-101])] == [0.0] * 3
    assert [r.user_tokens(u, 41.0) for u in (old[-100], old[-1])] == [15.0, 15.0]
    assert r.user_tokens(new[0], 41.0) == r.user_tokens(new[-1], 41.0) == 7.0
    # One more new user: ties on the latest bucket go by name, so the
    # smallest name among the bucket-1 users is forgotten.
    r.route("zz", 1, 0, now=41.0)
    assert r.users == n
    assert r.user_tokens(new[0], 41.0) == 0.0  # "new-000000" is the smallest
    assert r.user_tokens(new[1], 41.0) == 7.0
    assert r.user_tokens(old[-100], 41.0) == 15.0
