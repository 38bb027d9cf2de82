"""The endpoint picker: presets, plugins, single vs batched, snapshots, bad input,
and the precise-prefix scorer on a KvEventIndex fed by a mock engine's KV events."""

import math
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mock_kv_publisher import MockKvPublisher, subscribe, synced
from server_fixtures import wait_for

from routecore import EndpointPicker, KvEventIndex, NotInFlightError, PrefixCacheRouter, VtcRouter

NAMES = ["e0", "e1", "e2", "e3"]
# The prompt the mock engine of "e2" holds (4 blocks of 16 tokens): the head of
# the shared prefixes of `batch`.
HELD = np.arange(64, dtype=np.uint32)


@pytest.fixture(scope="module")
def kv() -> Iterator[KvEventIndex]:
    """A KV-event index where e2's engine publishes and holds HELD; the other
    endpoints have no event stream (their prefix scores are approximate)."""
    engine = MockKvPublisher(block_size=16)
    index = KvEventIndex(block_size=16)
    try:
        subscribe(index, "e2", engine)
        engine.serve(HELD.tolist())
        wait_for(synced(index, "e2", engine), what="e2's blocks indexed")
        yield index
    finally:
        index.close()
        engine.close()


def picker(preset: str, kv: KvEventIndex, **kwargs) -> EndpointPicker:
    """A picker of `preset` over NAMES; the precise presets read `kv`."""
    if "precise" in preset:
        kwargs["kv_index"] = kv
    return EndpointPicker(NAMES, preset=preset, **kwargs)


def test_presets_and_the_default():
    assert EndpointPicker.presets() == [
        "random",
        "round-robin",
        "least-request",
        "queue+kv",
        "prefix",
        "prefix+queue+kv",
        "precise-prefix",
        "precise-prefix+queue+kv",
        "vtc",
    ]
    p = EndpointPicker(NAMES)
    assert p.preset == "prefix+queue+kv"
    names = [s["name"] for s in p.plugins]
    assert names == [
        "healthy",
        "subset-hint",
        "serves-adapter",
        "saturation",
        "prefix",
        "queue-depth",
        "kv-usage",
        "max-score",
    ]
    weights = {s["name"]: s["weight"] for s in p.plugins}
    assert (weights["prefix"], weights["queue-depth"], weights["kv-usage"]) == (3.0, 2.0, 2.0)
    assert repr(p) == 'EndpointPicker(endpoints=["e0", "e1", "e2", "e3"], preset="prefix+queue+kv")'


def test_least_request_counts_starts_and_completions():
    p = EndpointPicker(NAMES[:3], preset="least-request")
    assert [p.pick(now=0.0) for _ in range(4)] == ["e0", "e1", "e2", "e0"]
    assert p.in_flight == [2, 1, 1]
    p.completed("e0", now=1.0)
    p.completed("e0", now=1.0)
    assert p.pick(now=1.0) == "e0"
    with pytest.raises(NotInFlightError, match="no request in flight"):
        p.completed("e0", now=1.0) or p.completed("e0", now=1.0)
    assert p.in_flight == [0, 1, 1]


def test_unhealthy_endpoints_are_never_chosen_and_none_healthy_is_none():
    p = EndpointPicker(NAMES[:3], preset="least-request")
    p.set_state("e0", healthy=False)
    assert {p.pick(now=0.0) for _ in range(6)} == {"e1", "e2"}
    p.set_state("e1", healthy=False)
    p.set_state("e2", healthy=False)
    assert p.pick(now=0.0) is None
    assert p.rank(now=0.0) == []
    p.set_state("e0", healthy=True)
    assert p.pick(now=0.0) == "e0"


def test_queue_and_kv_follow_the_scraped_state():
    p = EndpointPicker(NAMES[:3], preset="queue+kv", seed=1)
    p.set_state("e0", waiting=3, running=4, kv_usage=0.5)
    p.set_state("e1", waiting=0, running=4, kv_usage=0.1)
    p.set_state("e2", waiting=1, running=4, kv_usage=0.9)  # saturated (KV > 0.8)
    # Totals: e0 2 * (0 + 0.5) = 1, e1 2 * (1 + 0.9) = 3.8; e2 filtered out.
    assert p.rank(now=0.0) == ["e1", "e0"]
    # Own dispatches count in the queue until the next scrape.
    for _ in range(4):
        assert p.pick(now=0.0) == "e1"
    assert p.state("e1")["dispatched_since_scrape"] == 4
    assert p.pick(now=0.0) == "e0"  # e1's queue 4 > e0's 3
    p.set_state("e1", waiting=0)
    assert p.state("e1")["dispatched_since_scrape"] == 0
    assert p.pick(now=0.0) == "e1"
    # Everything saturated: the soft filter steps aside.
    for e in NAMES[:3]:
        p.set_state(e, waiting=50)
    assert len(p.rank(now=0.0)) == 3


def test_subset_adapter_and_session():
    plugins = [
        {"name": "healthy"},
        {"name": "subset-hint"},
        {"name": "serves-adapter"},
        {"name": "least-request", "weight": 1.0},
        {"name": "session-affinity", "weight": 2.0},
        {"name": "max-score", "ties": "first"},
    ]
    p = EndpointPicker(NAMES, plugins=plugins)
    assert p.preset is None
    assert p.pick(subset=["e2", "e3"], now=0.0) == "e2"
    p.set_state("e3", adapters=["sql"])
    assert p.pick(adapter="sql", now=0.0) == "e3"
    assert p.pick(adapter="other", now=0.0) == "e0"  # nobody serves it: anyone
    assert p.pick(session="s", now=0.0) == "e1"
    for _ in range(2):
        assert p.pick(session="s", now=0.0) == "e1"  # affinity (2) beats load (1)
    with pytest.raises(KeyError):
        p.pick(subset=["nope"], now=0.0)


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=30),
    running=st.lists(st.integers(0, 30), min_size=4, max_size=4),
)
def test_prefix_preset_decides_as_prefix_cache_router(prompts, running):
    router = PrefixCacheRouter(NAMES, block_size=4, imbalance_abs_count=8)
    picker = EndpointPicker(
        NAMES,
        plugins=[
            {"name": "healthy"},
            {"name": "prefix", "block_size": 4, "imbalance_abs_count": 8},
            {"name": "max-score", "ties": "least-request"},
        ],
    )
    router.set_running(running)
    for e, r in zip(NAMES, running):
        for _ in range(r):
            picker.started(e, now=0.0)
    for shared, tail in prompts:
        tokens = np.concatenate(
            [np.arange(shared * 16, dtype=np.uint32), np.arange(1000, 1000 + tail, dtype=np.uint32)]
        )
        assert picker.pick(tokens, now=1.0) == router.route(tokens, now=1.0)[0]
    assert picker.in_flight == router.running


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.sampled_from("abcdh"), st.integers(0, 3000), st.integers(0, 1000)),
        min_size=1,
        max_size=30,
    )
)
def test_vtc_preset_decides_as_vtc_router(requests):
    router = VtcRouter(NAMES)
    picker = EndpointPicker(NAMES, preset="vtc")
    for k, (user, i, o) in enumerate(requests):
        now = float(k)
        chosen = router.route(user, i, o, now=now)
        assert picker.pick(fairness_id=user, input_tokens=i, output_tokens=o, now=now) == chosen
        if k % 3 == 0:
            router.complete(chosen, user, i, o, i // 2, o * 2, now=now)
            picker.completed(
                chosen,
                i // 2,
                o * 2,
                fairness_id=user,
                est_input_tokens=i,
                est_output_tokens=o,
                now=now,
            )
    assert picker.in_flight == router.running


def batch(seed, n):
    rng = np.random.default_rng(seed)
    prompts = [
        np.concatenate(
            [
                np.arange(int(rng.integers(0, 4)) * 32, dtype=np.uint32),
                rng.integers(0, 50_000, int(rng.integers(0, 40)), dtype=np.uint32),
            ]
        )
        for _ in range(n)
    ]
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    return prompts, np.concatenate(prompts), offsets


@settings(max_examples=25, deadline=None)
@given(
    preset=st.sampled_from(EndpointPicker.presets()),
    seed=st.integers(0, 2**32),
    n=st.integers(1, 40),
)
def test_pick_many_equals_pick_one_by_one(kv, preset, seed, n):
    prompts, flat, offsets = batch(seed, n)
    users = [f"u{i % 3}" for i in range(n)]
    sessions = [f"s{i % 5}" for i in range(n)]
    ins = np.arange(n) * 10
    one = picker(preset, kv, seed=seed)
    many = picker(preset, kv, seed=seed)
    for p in (one, many):
        p.set_state("e1", waiting=2, running=1, kv_usage=0.4)
        p.set_state("e3", healthy=False)
    singles = [
        NAMES.index(
            one.pick(t, fairness_id=u, session=s, input_tokens=int(i), output_tokens=5, now=3.0)
        )
        for t, u, s, i in zip(prompts, users, sessions, ins)
    ]
    got = many.pick_many(
        flat,
        offsets,
        fairness_ids=users,
        sessions=sessions,
        input_tokens=ins,
        output_tokens=np.full(n, 5),
        now=3.0,
    )
    assert got.tolist() == singles
    assert one.to_bytes() == many.to_bytes()


def test_precise_prefix_scores_what_the_engines_hold(kv):
    """Token ids (an array, a list, a Tokenizer's output) key the KV-event
    index; text, an adapter's blocks and endpoints without an event stream
    score from the approximate index (what the picker routed)."""
    p = EndpointPicker(NAMES, preset="precise-prefix", kv_index=kv)
    longer = np.concatenate([HELD, np.arange(500, 532, dtype=np.uint32)])
    assert p.rank(HELD, now=0.0)[0] == "e2"
    assert p.rank(longer.tolist(), now=0.0)[0] == "e2"
    # No load guard on what the engine holds: e2 stays first when busier.
    p.set_state("e2", waiting=30, running=8)
    assert p.rank(longer, now=0.0)[0] == "e2"
    p.set_state("e2", waiting=0, running=0)
    # Nothing routed yet: text, or the adapter's own blocks, tie at 0 and go
    # to the least loaded (e0).
    assert p.rank("a prompt as text " * 10, now=0.0)[0] == "e0"
    assert p.rank(HELD, adapter="sql", now=0.0)[0] == "e0"
    # e1 has no event stream: its score comes from the approximate index,
    # which learns what was started there.
    other = np.arange(1000, 1064, dtype=np.uint32)
    assert p.rank(other, now=0.0)[0] == "e0"
    p.started("e1", other, now=0.0)
    assert p.rank(other, now=0.0)[0] == "e1"
    # e2's stream is live and e2 does not hold `other`: 0 for e2, whatever was
    # started there.
    p.completed("e1", now=0.0)
    p.started("e2", other, now=0.0)
    assert p.rank(other, now=0.0)[0] == "e1"
    # Scored like PrefixCacheRouter when no endpoint has live events.
    approx = EndpointPicker(NAMES, preset="prefix")
    approx.started("e1", other, now=0.0)
    assert approx.rank(other, now=0.0)[0] == "e1"


def test_precise_prefix_needs_a_kv_index_which_snapshots_do_not_hold(kv):
    for kwargs in ({"preset": "precise-prefix"}, {"plugins": [{"name": "precise-prefix"}]}):
        with pytest.raises(ValueError, match="needs kv_index"):
            EndpointPicker(NAMES, **kwargs)
    with pytest.raises(ValueError, match="precise-prefix scorer only"):
        EndpointPicker(NAMES, preset="prefix+queue+kv", kv_index=kv)
    with pytest.raises(TypeError):
        EndpointPicker(NAMES, preset="precise-prefix", kv_index="tcp://127.0.0.1:5557")
    p = picker("precise-prefix+queue+kv", kv, seed=3)
    p.pick(HELD, now=0.0)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(p)
    data = p.to_bytes()
    with pytest.raises(ValueError, match="needs kv_index"):
        EndpointPicker.from_bytes(data)
    q = EndpointPicker.from_bytes(data, kv_index=kv)
    assert q.to_bytes() == data
    assert [q.pick(HELD, now=1.0) for _ in range(3)] == [p.pick(HELD, now=1.0) for _ in range(3)]


def test_rank_starts_nothing_and_leads_with_the_pick():
    p = EndpointPicker(NAMES, preset="least-request")
    p.started("e0", now=0.0)
    p.started("e2", now=0.0)
    assert p.rank(now=0.0) == ["e1", "e3", "e0", "e2"]
    assert p.in_flight == [1, 0, 1, 0]
    assert p.pick(now=0.0) == "e1"


def test_snapshots_and_pickling_continue_identically():
    p = EndpointPicker(NAMES, seed=9)
    prompts, _, _ = batch(5, 30)
    p.set_state("e2", waiting=3, running=2, kv_usage=0.3, adapters=["x"])
    for t in prompts[:15]:
        p.pick(t, now=1.0)
    for q in (pickle.loads(pickle.dumps(p)), EndpointPicker.from_bytes(p.to_bytes())):
        assert q.to_bytes() == p.to_bytes()
        assert q.state("e2") == p.state("e2")
    q = pickle.loads(pickle.dumps(p))
    assert [p.pick(t, now=2.0) for t in prompts[15:]] == [q.pick(t, now=2.0) for t in prompts[15:]]
    data = p.to_bytes()
    for cut in (0, 5, len(data) // 2, len(data) - 1):
        with pytest.raises(ValueError):
            EndpointPicker.from_bytes(data[:cut])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"preset": "nope"}, "unknown preset"),
        ({"plugins": [{"name": "nope"}]}, "unknown plugin"),
        ({"plugins": [{"name": "least-request", "weight": -1.0}]}, "must be >= 0"),
        ({"plugins": [{"name": "least-request", "weight": math.nan}]}, "finite"),
        (
            {"plugins": [{"name": "healthy"}, {"name": "prefix", "blok_size": 4}]},
            r'plugins\[1\] "prefix": blok_size: unknown parameter; expected one of `block_size`',
        ),
        ({"plugins": [{"name": "prefix", "block_size": "4"}]}, "block_size: invalid type"),
        ({"plugins": [{"weight": 1.0}]}, "name"),
        ({"plugins": [{"name": "max-score", "ties": "sideways"}]}, "ties"),
        ({"plugins": [{"name": "saturation", "max_kv_usage": 2.0}]}, "max_kv_usage"),
        ({"preset": "vtc", "plugins": []}, "not both"),
    ],
)
def test_bad_construction_is_a_clear_error(kwargs, error):
    with pytest.raises(ValueError, match=error):
        EndpointPicker(NAMES, **kwargs)


def test_empty_or_repeated_endpoints_are_refused():
    with pytest.raises(ValueError, match="empty"):
        EndpointPicker([])
    with pytest.raises(ValueError, match="already present"):
        EndpointPicker(["a", "a"])


def test_bad_calls_leave_the_state_unchanged():
    p = EndpointPicker(NAMES, preset="vtc")
    p.pick(fairness_id="u", input_tokens=10, now=0.0)
    bad = [
        lambda: p.pick(now=math.nan),
        lambda: p.pick(fairness_id="", now=0.0),
        lambda: p.pick(input_tokens=-1, now=0.0),
        lambda: p.pick(subset=["zz"], now=0.0),
        lambda: p.set_state("zz", waiting=1),
        lambda: p.set_state("e0", waiting=-1),
        lambda: p.set_state("e0", kv_usage=1.5),
        lambda: p.set_state("e0", running=math.nan),
        lambda: p.completed("zz", now=0.0),
        lambda: p.completed("e1", now=0.0),
        lambda: p.started("zz", now=0.0),
        lambda: p.remove_endpoint("zz"),
        lambda: p.add_endpoint("e0"),
        lambda: p.pick_many(input_tokens=[1, 2], fairness_ids=["a"], now=0.0),
        lambda: p.pick_many(input_tokens=[1, -2], now=0.0),
        lambda: p.pick_many(fairness_ids=["a", ""], now=0.0),
        lambda: p.pick_many(np.arange(4, dtype=np.uint32), [0, 5], now=0.0),
    ]
    assert_refused_unchanged(p, bad)


def test_bad_precise_calls_leave_the_state_unchanged(kv):
    p = picker("precise-prefix+queue+kv", kv)
    p.pick(HELD, now=0.0)
    bad = [
        lambda: p.pick([-1], now=0.0),
        lambda: p.pick([2**32], now=0.0),
        lambda: p.rank(np.array([0.5, 1.5]), now=0.0),
        lambda: p.pick(HELD, adapter="sql", now=math.nan),
        lambda: p.pick(HELD, hashes=HELD, now=0.0),  # hashes are uint64 block hashes
        lambda: p.pick_many(HELD, [0, 65], now=0.0),
        lambda: p.started("e0", [1, -2], now=0.0),
    ]
    assert_refused_unchanged(p, bad)


def assert_refused_unchanged(p: EndpointPicker, calls) -> None:
    """Each call raises a clear error and leaves `p` as it was."""
    before = p.to_bytes()
    for call in calls:
        with pytest.raises((ValueError, KeyError, TypeError)):
            call()
        assert p.to_bytes() == before


def test_endpoints_come_and_go():
    p = EndpointPicker(["a", "b"], preset="least-request")
    p.pick(now=0.0)
    p.add_endpoint("c")
    assert p.endpoints == ["a", "b", "c"] and p.in_flight == [1, 0, 0]
    p.remove_endpoint("a")
    assert p.endpoints == ["b", "c"] and p.in_flight == [0, 0]
    assert p.pick_many(input_tokens=[0, 0, 0], now=0.0).tolist() == [0, 1, 0]
