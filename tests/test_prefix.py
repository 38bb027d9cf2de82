"""Prefix-cache-aware routing (AIBrix): block hashes, the prefix index, the router."""

import pickle
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import (
    NotInFlightError,
    PrefixCacheRouter,
    PrefixIndex,
    block_hashes,
    block_hashes_many,
)

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=80)


def reference_hashes(tokens, block_size, seed=0):
    """The documented scheme, with the xxhash package."""
    if isinstance(tokens, (bytes, str)):
        data = tokens.encode() if isinstance(tokens, str) else tokens
        unit = 1
    else:
        data = np.asarray(tokens, dtype="<u4").tobytes()
        unit = 4
    out, prev = [], seed
    for b in range(len(data) // unit // block_size):
        block = data[b * block_size * unit : (b + 1) * block_size * unit]
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + block, seed=seed)
        out.append(prev)
    return out


@settings(max_examples=60, deadline=None)
@given(token_lists, st.integers(1, 9), st.integers(0, 2**64 - 1))
def test_hashes_match_the_xxhash_package(tokens, block_size, seed):
    arr = np.array(tokens, dtype=np.uint32)
    got = block_hashes(arr, block_size, seed)
    assert got.dtype == np.uint64
    assert got.tolist() == reference_hashes(tokens, block_size, seed)
    # Lists and other integer dtypes give the same hashes.
    assert block_hashes(tokens, block_size, seed).tolist() == got.tolist()
    assert block_hashes(arr.astype(np.int64), block_size, seed).tolist() == got.tolist()


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_character_tokenizer_hashes_bytes(data, block_size):
    assert block_hashes(data, block_size).tolist() == reference_hashes(data, block_size)


def test_str_is_utf8_bytes():
    text = "héllo wörld, ça va? 你好"
    assert block_hashes(text, 4).tolist() == block_hashes(text.encode(), 4).tolist()


@settings(max_examples=60, deadline=None)
@given(token_lists, token_lists, token_lists, st.integers(1, 8))
def test_equal_prefixes_give_equal_leading_hashes(prefix, a, b, block_size):
    ha = block_hashes(prefix + a, block_size)
    hb = block_hashes(prefix + b, block_size)
    k = len(prefix) // block_size
    assert ha[:k].tolist() == hb[:k].tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80), st.data())
def test_a_changed_token_changes_every_later_hash(tokens, data):
    block_size = data.draw(st.integers(1, len(tokens)))
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + 1) % 2**32
    h1 = block_hashes(tokens, block_size)
    h2 = block_hashes(changed, block_size)
    first = i // block_size
    assert h1[:first].tolist() == h2[:first].tolist()
    assert all(x != y for x, y in zip(h1[first:], h2[first:]))


@settings(max_examples=40, deadline=None)
@given(token_lists, st.integers(1, 8))
def test_partial_tail_blocks_are_ignored(tokens, block_size):
    full = len(tokens) // block_size * block_size
    h = block_hashes(tokens, block_size)
    assert len(h) == len(tokens) // block_size
    assert h.tolist() == block_hashes(tokens[:full], block_size).tolist()


@settings(max_examples=40, deadline=None)
@given(st.lists(token_lists, max_size=8), st.integers(1, 6))
def test_batched_hashes_equal_single(prompts, block_size):
    flat = np.array([t for p in prompts for t in p], dtype=np.uint32)
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    hashes, hash_offsets = block_hashes_many(flat, offsets, block_size, 5)
    assert len(hash_offsets) == len(prompts) + 1
    for i, p in enumerate(prompts):
        one = block_hashes(np.array(p, dtype=np.uint32), block_size, 5)
        assert hashes[hash_offsets[i] : hash_offsets[i + 1]].tolist() == one.tolist()


@pytest.mark.parametrize(
    "tokens, block_size",
    [
        ([1, 2], 0),
        ([1, 2], -1),
        ([1, 2], 1 << 17),
        ([-1, 2], 1),
        ([2**32], 1),
        (np.zeros((2, 2), dtype=np.uint32), 1),
        (np.array([1.0, 2.0]), 1),
        (None, 1),
    ],
)
def test_bad_hash_input_is_refused(tokens, block_size):
    with pytest.raises(ValueError):
        block_hashes(tokens, block_size)


def test_bad_offsets_are_refused():
    t = np.arange(10, dtype=np.uint32)
    for offsets in ([1, 10], [0, 9], [0, 6, 4, 10], []):
        with pytest.raises(ValueError):
            block_hashes_many(t, offsets, 2)


def test_non_contiguous_arrays_are_read_correctly():
    t = np.arange(40, dtype=np.uint32)
    assert block_hashes(t[::2], 4).tolist() == block_hashes(t[::2].copy(), 4).tolist()


def h(*xs):
    return np.array(xs, dtype=np.uint64)


def test_index_lru_order_ttl_and_remove_endpoint():
    ix = PrefixIndex(3, ttl_s=10.0)
    ix.record(h(1, 2), "a", 0.0)  # recorded last to first: 1 is more recent than 2
    ix.record(h(3), "b", 1.0)
    ix.record(h(4), "b", 2.0)  # full: evicts 2, the least recent
    assert len(ix) == 3
    assert ix.match_prefix(h(1, 2), now=2.0) == {"a": 1}
    assert ix.match_prefix(h(3, 4), now=2.0) == {"b": 2}
    assert ix.match_prefix(h(2, 1), now=2.0) == {}  # matching stops at the first miss
    ix.record(h(1), "b", 5.0)
    assert ix.match_prefix(h(1), 5.0) == {"a": 1, "b": 1}
    assert ix.expire(12.5) == 2  # 3 (t=1) and 4 (t=2) idle > 10 s; 1 (t=5) is not
    assert ix.match_prefix(h(1), 15.1) == {}  # idle 10.1 s: a miss, dropped
    assert len(ix) == 0
    ix.record(h(7, 8), "c", 20.0)
    assert ix.remove_endpoint("c") == 2 and len(ix) == 0
    with pytest.raises(KeyError):
        ix.remove_endpoint("c")
    assert sorted(ix.endpoints) == ["a", "b"]


def test_index_memory_is_bounded_by_capacity():
    ix = PrefixIndex(1000)
    rng = np.random.default_rng(0)
    for endpoint in range(5):
        ix.record(rng.integers(0, 2**63, 3000, dtype=np.uint64), f"p{endpoint}")
    assert len(ix) == 1000
    # The most recent 1000 remain: the last prompt's first 1000 blocks.
    last = rng.integers(0, 2**63, 3000, dtype=np.uint64)
    ix.record(last, "p0")
    assert ix.match_prefix(last) == {"p0": 1000}


def test_index_errors_change_nothing_and_snapshots_round_trip():
    ix = PrefixIndex(100, ttl_s=30.0)
    ix.record(h(1, 2, 3), "a", 1.0)
    ix.record(h(1, 2), "b", 2.0)
    before = ix.to_bytes()
    with pytest.raises(TypeError):
        ix.record([1, 2], "a")  # not uint64 hashes
    with pytest.raises(ValueError):
        ix.record(h(9), "", 0.0)
    with pytest.raises(ValueError):
        ix.record(h(9), "a", float("nan"))
    assert ix.to_bytes() == before
    back = pickle.loads(pickle.dumps(ix))
    assert back.to_bytes() == before
    assert back.match_prefix(h(1, 2, 3), 3.0) == {"a": 3, "b": 2}
    for bad in (b"", b"RCPX", before[:-1], before + b"\0", b"XXXX" + before[4:]):
        with pytest.raises(ValueError):
            PrefixIndex.from_bytes(bad)
    for args in ((0,), (-5,), (10, 0.0), (10, -1.0), (10, float("nan"))):
        with pytest.raises(ValueError):
            PrefixIndex(*args)


def prompt(n, start=0):
    return np.arange(start, start + n, dtype=np.uint32)


def test_router_worked_by_hand():
    r = PrefixCacheRouter(["a", "b", "c"], block_size=4)
    p1 = prompt(16)  # 4 blocks
    assert r.route(p1, [0, 0, 0]) == ("a", 0.0)  # nothing cached: least-loaded, first
    assert r.route(p1, [2, 2, 2]) == ("a", 1.0)  # equal loads keep prefix matching
    # [3, 0, 0]: mean 1, std sqrt(2), limit 1 + 2 sqrt(2) = 3.83 >= 3.
    assert r.route(p1, [3, 0, 0]) == ("a", 1.0)
    # [6, 0, 0]: limit 2 + 2 * 2.83 = 7.66 >= 6, still a.
    assert r.route(p1, [6, 0, 0])[0] == "a"
    # Imbalance: max - min = 17 > 16 skips matching.
    assert r.route(p1, [17, 0, 1]) == ("b", 0.0)
    # b now holds p1 too; equal matches go to the less loaded.
    assert r.route(p1, [5, 4, 9]) == ("b", 1.0)
    # A half match: the first 2 blocks of p1, then new tokens.
    mixed = np.concatenate([p1[:8], prompt(8, 1000)])
    assert r.route(mixed, [1, 1, 1]) == ("a", 0.5)
    assert r.running == [2, 1, 1]
    # Shorter than a block: no blocks, fraction 0.0, least-loaded.
    assert r.route(prompt(3)) == ("b", 0.0)


def test_hot_spot_guard():
    endpoints = [f"p{i}" for i in range(9)]
    r = PrefixCacheRouter(endpoints, block_size=4)
    p = prompt(8)
    assert r.route(p)[0] == "p0"
    # [5, 0 x 8]: mean 5/9, std 1.571, limit 3.70 < 5: the match is skipped.
    assert r.route(p, [5] + [0] * 8) == ("p1", 0.0)
    # With a larger factor the match is kept: limit 0.56 + 3 * 1.571 = 5.27.
    r3 = PrefixCacheRouter(endpoints, block_size=4, std_factor=3.0)
    r3.route(p)
    assert r3.route(p, [5] + [0] * 8) == ("p0", 1.0)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30)), min_size=1, max_size=25),
    st.lists(st.integers(0, 20), min_size=3, max_size=3),
)
def test_route_many_equals_route_one_by_one(requests, running):
    # Prompts share prefixes: prompt (k, n) is the first n tokens of family k.
    families = [prompt(40, 100 * k) for k in range(4)]
    prompts = [families[k][:n] for k, n in requests]
    one = PrefixCacheRouter(["a", "b", "c"], block_size=4, imbalance_abs_count=4)
    many = PrefixCacheRouter(["a", "b", "c"], block_size=4, imbalance_abs_count=4)
    singles = [one.route(p, running if i == 0 else None, 3.0) for i, p in enumerate(prompts)]
    flat = np.concatenate(prompts)
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    idx, frac = many.route_many(flat, offsets, running, 3.0)
    assert [many.endpoints[i] for i in idx] == [s[0] for s in singles]
    assert frac.tolist() == [s[1] for s in singles]
    assert one.to_bytes() == many.to_bytes()


def test_endpoints_at_run_time_and_complete():
    r = PrefixCacheRouter(["a", "b"], block_size=4)
    p = prompt(12)
    assert r.route(p) == ("a", 0.0)
    r.add_endpoint("c")
    assert r.endpoints == ["a", "b", "c"] and r.running == [1, 0, 0]
    assert r.route(p) == ("a", 1.0)
    r.remove_endpoint("a")
    assert "a" not in r.index.endpoints
    assert r.route(p) == ("b", 0.0)  # a's blocks left with it
    r.complete("b")
    assert r.running == [0, 0]
    with pytest.raises(NotInFlightError):
        r.complete("b")
    with pytest.raises(KeyError):
        r.complete("zz")
    with pytest.raises(KeyError):
        r.remove_endpoint("a")
    with pytest.raises(ValueError):
        r.add_endpoint("b")


def test_bad_input_leaves_the_router_unchanged():
    r = PrefixCacheRouter(["a", "b"], block_size=4)
    r.route(prompt(12), [1, 2])
    before = r.to_bytes()
    bad_calls = [
        lambda: r.route(prompt(8), [1]),
        lambda: r.route(prompt(8), [1, -1]),
        lambda: r.route(prompt(8), [1, 2**40]),
        lambda: r.route(prompt(8), now=float("inf")),
        lambda: r.route([-3]),
        lambda: r.route_many(prompt(8), [0, 9]),
        lambda: r.route_many(prompt(8), [0, 4, 8], [1, 2, 3]),
        lambda: r.set_running([1, 2, 3]),
        lambda: r.add_endpoint(""),
        lambda: r.add_endpoint("x" * 257),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    assert r.to_bytes() == before
    with pytest.raises(ValueError):
        PrefixCacheRouter([], block_size=4).route(prompt(8))
    for kwargs in ({"block_size": 0}, {"imbalance_abs_count": -1}, {"std_factor": -0.5}):
        with pytest.raises(ValueError):
            PrefixCacheRouter(["a"], **kwargs)
    with pytest.raises(ValueError):
        PrefixCacheRouter(["a", "a"])


def test_snapshot_restores_exactly_and_continues_identically():
    r = PrefixCacheRouter(["a", "b", "c"], block_size=4, imbalance_abs_count=3, seed=9)
    for k in range(20):
        r.route(prompt(4 * (k % 5), 10 * (k % 3)))
    back = pickle.loads(pickle.dumps(r))
    assert back.to_bytes() == r.to_bytes()
    assert (back.block_size, back.imbalance_abs_count, back.seed) == (4, 3, 9)
    for k in range(10):
        assert back.route(prompt(4 * k, 7)) == r.route(prompt(4 * k, 7))
    data = r.to_bytes()
    for bad in (data[:-1], data + b"\0", b"RCPR"):
        with pytest.raises(ValueError):
            PrefixCacheRouter.from_bytes(bad)


def test_shared_index_between_routers():
    ix = PrefixIndex(1000)
    r1 = PrefixCacheRouter(["a", "b"], block_size=4, index=ix)
    r2 = PrefixCacheRouter(["a", "b"], block_size=4, index=ix)
    r1.route(prompt(8), [1, 0])  # b
    assert ix.match_prefix(block_hashes(prompt(8), 4)) == {"b": 2}
    assert r2.route(prompt(8), [0, 0]) == ("b", 1.0)


def test_routing_from_many_threads_counts_every_request():
    r = PrefixCacheRouter([f"p{i}" for i in range(4)], block_size=16)
    prompts = [prompt(5000, 10 * k) for k in range(8)]

    def work():
        for p in prompts:
            r.route(p)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.running) == 32


def test_endpoints_left_without_blocks_free_their_ids_for_new_endpoints():
    # 10,000 distinct endpoints through a 16-block index (at most 4,096 endpoint ids):
    # the ids of endpoints whose blocks were all evicted are reused.
    ix = PrefixIndex(16)
    for i in range(10_000):
        ix.record(h(i, 10**9 + i), f"endpoint-{i}", float(i))
        assert ix.match_prefix(h(i), float(i)) == {f"endpoint-{i}": 1}
    assert len(ix) == 16
    assert {"endpoint-9999", "endpoint-9992"} <= set(ix.endpoints)
    back = PrefixIndex.from_bytes(ix.to_bytes())
    assert back.match_prefix(h(9992)) == {"endpoint-9992": 1}
    # Routers over a shared index whose endpoints are renamed (never removed).
    for i in range(5_000):
        r = PrefixCacheRouter([f"e{i}-a", f"e{i}-b"], block_size=4, index=ix)
        assert r.route(np.arange(i, i + 8, dtype=np.uint32), now=1e4 + i)[0] == f"e{i}-a"
    assert len(ix.endpoints) <= 4096 and len(ix) == 16
