"""The precise prefix index (issue 28): routecore.KvEventIndex beside its
plain-Python twin (routecore._baselines.kv), same run, on the workload of
benches/kv_workload.py (engines serving 8,192-token prompts on 32 shared
system prompts, 100k blocks stored) at 8, 64 and 256 endpoints:

- apply: every batch of KV events, msgpack as vLLM sends it, to a fresh
  index (routecore: over ZeroMQ to its subscribers, until the index has
  applied the last batch of every endpoint; the twin: msgpack.unpackb and
  apply);
- query: per endpoint the leading blocks its engine holds of an 8,192-token
  prompt (``leading_blocks``, a uint32 array): a new prompt on a shared
  system prompt, and one an engine holds whole;
- EndpointPicker.pick with ``precise-prefix+queue+kv`` at 64 endpoints on a
  prompt one engine holds whole; beside it ``rank`` (starts nothing, so
  records nothing) and the prompt's block hashes for the approximate index
  alone (``block_hashes``), which every started pick records.

The Rust-only side by side with Dynamo's radix trees is benches/kv-dynamo.

Run: .venv/bin/python -m pytest benches/bench_kv.py
"""

from __future__ import annotations

import time
from functools import cache

import msgpack
import numpy as np
import pytest
import zmq

from benches.kv_workload import Workload, generate
from routecore import EndpointPicker, KvEventIndex, block_hashes
from routecore._baselines import kv as baseline
from routecore._baselines import pick as pick_baseline
from tests.mock_kv_publisher import bind, wait_for

FLEETS = [8, 64, 256]
PRECISE = "precise-prefix+queue+kv"


@cache
def workload(n: int) -> tuple[Workload, list[tuple[int, int, bytes]]]:
    """The workload for `n` endpoints and its batches as vLLM's payloads."""
    w = generate(n)
    return w, [(e, seq, msgpack.packb([0.0, events, 0])) for e, seq, events in w.batches]


def topic(e: int) -> bytes:
    # Fixed width: no topic is a prefix of another (ZeroMQ filters by prefix).
    return b"kv%04d" % e


class Feed:
    """A fresh KvEventIndex subscribed, endpoint by endpoint, to one XPUB
    socket that sends each endpoint's batches under a topic of its own."""

    def __init__(self, w: Workload) -> None:
        self.pub = zmq.Context.instance().socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # a burst of batches is never dropped
        self.addr = bind(self.pub, "tcp://127.0.0.1:*")
        self.index = KvEventIndex(block_size=w.block_size)
        self.names = w.endpoints
        for e, name in enumerate(self.names):
            self.index.subscribe(name, self.addr, topic=topic(e).decode())
        subscribed = 0
        deadline = time.monotonic() + 30
        while subscribed < len(self.names):
            assert time.monotonic() < deadline, f"{subscribed} of {len(self.names)} subscribed"
            if self.pub.poll(100, zmq.POLLIN) and self.pub.recv()[:1] == b"\x01":
                subscribed += 1
        for name in self.names:
            wait_for(lambda name=name: self.index.stats(name)["live"], what=f"{name} live")

    def apply(self, batches: list[tuple[int, int, bytes]]) -> None:
        """Sends every batch, returns once the index applied them all."""
        last: dict[str, int] = {}
        for e, seq, payload in batches:
            self.pub.send_multipart([topic(e), seq.to_bytes(8, "big"), payload])
            last[self.names[e]] = seq
        deadline = time.monotonic() + 60
        while last:
            assert time.monotonic() < deadline, f"{len(last)} endpoints behind"
            for name in list(last):
                if self.index.stats(name)["last_seq"] == last[name]:
                    del last[name]
            time.sleep(0.0005)

    def close(self) -> None:
        self.index.close()
        self.pub.close(0)


def twin_apply(w: Workload, batches: list[tuple[int, int, bytes]]) -> baseline.KvIndex:
    kv = baseline.KvIndex(w.endpoints, block_size=w.block_size)
    for e, _, payload in batches:
        kv.apply(w.endpoints[e], msgpack.unpackb(payload)[1])
    return kv


_fed: dict[int, tuple[Feed, baseline.KvIndex]] = {}


def fed(n: int) -> tuple[Feed, baseline.KvIndex]:
    """Both indexes fed the workload of `n` endpoints (kept for the module)."""
    if n not in _fed:
        w, batches = workload(n)
        f = Feed(w)
        f.apply(batches)
        _fed[n] = f, twin_apply(w, batches)
    return _fed[n]


@pytest.fixture(scope="module", autouse=True)
def close_feeds():
    yield
    while _fed:
        _fed.popitem()[1][0].close()


@pytest.mark.parametrize("n", FLEETS)
@pytest.mark.benchmark(group="KV index apply: 100k blocks stored")
def test_apply_routecore(benchmark, n):
    w, batches = workload(n)
    feeds: list[Feed] = []

    def setup():
        for f in feeds:
            f.close()
        feeds[:] = [Feed(w)]
        return (batches,), {}

    try:
        benchmark.pedantic(lambda b: feeds[0].apply(b), setup=setup, rounds=3)
        stats = [feeds[0].index.stats(e) for e in w.endpoints]
        assert sum(s["skipped"] for s in stats) == 0 and sum(s["blocks"] for s in stats) > 0
    finally:
        for f in feeds:
            f.close()


@pytest.mark.parametrize("n", FLEETS)
@pytest.mark.benchmark(group="KV index apply: 100k blocks stored")
def test_apply_plain_python(benchmark, n):
    w, batches = workload(n)
    kv = benchmark.pedantic(twin_apply, (w, batches), rounds=3)
    assert kv.holders


def query(n: int, kind: str) -> np.ndarray:
    """`shared`: the new prompt (of 32, one per system prompt) the fleet
    holds most of; `served`: the last prompt served (one engine holds it
    whole)."""
    w = workload(n)[0]
    if kind == "served":
        return w.served[-1]
    twin = fed(n)[1]
    return max(w.queries, key=lambda q: max(twin.leading_blocks(q).values()))


QUERIES = [(n, kind) for n in FLEETS for kind in ("shared", "served")]


@pytest.mark.parametrize(("n", "kind"), QUERIES)
@pytest.mark.benchmark(group="KV index query: 8,192-token prompt")
def test_query_routecore(benchmark, n, kind):
    f, _ = fed(n)
    held = benchmark(f.index.leading_blocks, query(n, kind))
    assert max(v or 0 for v in held.values()) > 0


@pytest.mark.parametrize(("n", "kind"), QUERIES)
@pytest.mark.benchmark(group="KV index query: 8,192-token prompt")
def test_query_plain_python(benchmark, n, kind):
    _, kv = fed(n)
    held = benchmark(kv.leading_blocks, query(n, kind))
    assert max(held.values()) > 0


@pytest.mark.parametrize("n", FLEETS)
def test_the_twin_answers_like_routecore_and_the_engines(n):
    """Same blocks held per endpoint, and for every query the answers the
    engines' own caches give."""
    f, kv = fed(n)
    w = workload(n)[0]
    for p, name in enumerate(w.endpoints):
        assert f.index.blocks(name) == sorted(kv.names_of[p])
        assert len(kv.names_of[p]) == len(w.engines[p].cache)
    for q in [*w.queries, *w.served]:
        truth = w.truth(q)
        assert f.index.leading_blocks(q) == truth
        assert kv.leading_blocks(q) == truth


def scraped(picker, names):
    rng = np.random.default_rng(0)
    for e in names:
        picker.set_state(
            e,
            waiting=float(rng.integers(0, 4)),
            running=float(rng.integers(0, 32)),
            kv_usage=float(rng.uniform(0.1, 0.7)),
        )
    return picker


@pytest.mark.benchmark(group="EndpointPicker.pick, precise-prefix+queue+kv, 64 endpoints, 8K")
def test_pick_precise_64_routecore(benchmark):
    f, _ = fed(64)
    w = workload(64)[0]
    p = scraped(EndpointPicker(w.endpoints, preset=PRECISE, kv_index=f.index), w.endpoints)
    assert benchmark(p.pick, w.served[-1], now=0.0) in w.endpoints


@pytest.mark.benchmark(group="EndpointPicker.pick, precise-prefix+queue+kv, 64 endpoints, 8K")
def test_pick_precise_64_rank_routecore(benchmark):
    f, _ = fed(64)
    w = workload(64)[0]
    p = scraped(EndpointPicker(w.endpoints, preset=PRECISE, kv_index=f.index), w.endpoints)
    assert len(benchmark(p.rank, w.served[-1], now=0.0)) == len(w.endpoints)


@pytest.mark.benchmark(group="EndpointPicker.pick, precise-prefix+queue+kv, 64 endpoints, 8K")
def test_pick_precise_64_hashing_routecore(benchmark):
    w = workload(64)[0]
    assert len(benchmark(block_hashes, w.served[-1], 16)) == len(w.served[-1]) // 16


@pytest.mark.benchmark(group="EndpointPicker.pick, precise-prefix+queue+kv, 64 endpoints, 8K")
def test_pick_precise_64_plain_python(benchmark):
    _, kv = fed(64)
    w = workload(64)[0]
    held = {name: set(kv.names_of[p]) for p, name in enumerate(w.endpoints)}
    p = scraped(pick_baseline.EndpointPicker(w.endpoints, preset=PRECISE, held=held), w.endpoints)
    assert benchmark(p.pick, w.served[-1]) in w.endpoints
