"""The precise prefix index fed by KV-event subscribers (KvEventIndex), end to
end against mock vLLM publishers on 127.0.0.1 (tests/mock_kv_publisher.py)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from mock_kv_publisher import MockKvPublisher, removed, stored, subscribe, synced
from server_fixtures import wait_for

import routecore

BS = 4


@pytest.fixture
def pub() -> Iterator[MockKvPublisher]:
    p = MockKvPublisher(block_size=BS, capacity_blocks=32)
    yield p
    p.close()


@pytest.fixture
def index() -> Iterator[routecore.KvEventIndex]:
    idx = routecore.KvEventIndex(block_size=BS)
    yield idx
    idx.close()


def serve_synced(idx: routecore.KvEventIndex, name: str, p: MockKvPublisher, prompt) -> int:
    """Serves `prompt` on `p` until the subscriber has it (the first batches
    may race the subscription: those come back through replay)."""
    hits = p.serve(prompt)
    wait_for(synced(idx, name, p), what="the batch applied")
    return hits


def prompt(head: int, n_blocks: int, tail: int = 0) -> list[int]:
    return [head] * BS + [tail + i for i in range(BS * (n_blocks - 1))]


def test_stored_blocks_score_the_leading_prompt_blocks(index, pub):
    subscribe(index, "e0", pub)
    serve_synced(index, "e0", pub, prompt(1, 3))
    assert index.leading_blocks(prompt(1, 3)) == {"e0": 3}
    longer = prompt(1, 3) + [99] * (2 * BS) + [5]
    assert index.leading_blocks(longer) == {"e0": 3}
    assert index.leading_blocks(prompt(1, 3, tail=50)) == {"e0": 1}
    assert index.leading_blocks(prompt(2, 3)) == {"e0": 0}
    # A LoRA adapter's blocks are its own.
    assert index.leading_blocks(prompt(1, 3), adapter="sql") == {"e0": 0}
    pub.serve(prompt(1, 3), lora="sql")
    wait_for(synced(index, "e0", pub))
    assert index.leading_blocks(prompt(1, 3), adapter="sql") == {"e0": 3}
    # A NumPy array of token ids, read in place or converted, answers alike.
    for ids in (np.array(prompt(1, 3), np.uint32), np.array(prompt(1, 3) + [7])[::1]):
        assert index.leading_blocks(ids) == {"e0": 3}
    assert index.leading_blocks(np.array(prompt(1, 3), np.uint32)[::2]) == {"e0": 0}
    for bad in ([-1], [2**32], np.array([2**32])):
        with pytest.raises(ValueError, match="outside"):
            index.leading_blocks(bad)
    with pytest.raises(TypeError, match="not text"):
        index.leading_blocks("hello")
    s = index.stats("e0")
    assert s["blocks"] == 6 and s["gaps"] in (0, 1) and s["skipped"] == 0


def test_the_index_keys_blocks_by_routecore_hashes_of_their_tokens(index):
    p = MockKvPublisher(block_size=BS, bytes_hashes=True)
    try:
        subscribe(index, "e0", p)
        serve_synced(index, "e0", p, prompt(3, 2))
        expected = sorted(int(h) for h in routecore.block_hashes(prompt(3, 2), BS))
        assert index.blocks("e0") == expected
    finally:
        p.close()


def test_a_gap_is_recovered_by_replay(index, pub):
    subscribe(index, "e0", pub)
    serve_synced(index, "e0", pub, prompt(1, 2))
    before = index.stats("e0")
    pub.serve(prompt(2, 2), drop=True)
    pub.serve(prompt(3, 2))
    wait_for(synced(index, "e0", pub), what="replayed")
    s = index.stats("e0")
    assert s["gaps"] == before["gaps"] + 1
    assert s["replays"] == before["replays"] + 1
    assert s["unrecovered"] == 0
    assert index.leading_blocks(prompt(2, 2)) == {"e0": 2}, "the dropped batch came back"
    assert pub.replay_requests[-1] == pub.seq - 2


def test_a_gap_without_replay_clears_the_endpoint(index, pub):
    subscribe(index, "e0", pub, replay=False)
    # The subscription may miss the first batches: publish until one arrives.
    deadline = time.monotonic() + 10
    while index.stats("e0")["batches"] == 0 and time.monotonic() < deadline:
        pub.publish([])
        time.sleep(0.02)
    serve_synced(index, "e0", pub, prompt(1, 2))
    unrecovered = index.stats("e0")["unrecovered"]
    pub.serve(prompt(2, 2), drop=True)
    pub.serve(prompt(3, 2))
    wait_for(synced(index, "e0", pub))
    s = index.stats("e0")
    assert s["unrecovered"] == unrecovered + 1
    # Cleared, then the batch after the gap applied: only its blocks remain.
    assert index.leading_blocks(prompt(1, 2)) == {"e0": 0}
    assert index.leading_blocks(prompt(3, 2)) == {"e0": 2}


def test_duplicates_garbage_frames_and_bad_events_change_nothing(index, pub):
    subscribe(index, "e0", pub)
    serve_synced(index, "e0", pub, prompt(1, 2))
    blocks = index.blocks("e0")
    before = index.stats("e0")
    pub.resend_last()
    pub.send_frames([b"kv", b"short"])
    pub.send_frames([b"kv"])
    pub.publish(
        [
            {"type": "BlockMoved", "block_hashes": [1]},
            stored([7], None, [1, 2, 3], 3),  # another block size
            stored([8], 12345, [1, 2, 3, 4], BS),  # a parent never stored
            stored([9], None, [1, 2, 3, 4], BS, medium="CPU"),
            removed([424242]),  # never stored
            "not an event",
        ]
    )
    wait_for(synced(index, "e0", pub), what="the bad batch applied")
    s = index.stats("e0")
    assert index.blocks("e0") == blocks
    assert s["duplicates"] == before["duplicates"] + 1
    assert s["garbage"] == before["garbage"] + 2
    assert s["skipped"] == before["skipped"] + 6
    assert s["gaps"] == before["gaps"] and s["clears"] == before["clears"]
    # The stream still works.
    serve_synced(index, "e0", pub, prompt(2, 1))
    assert index.leading_blocks(prompt(2, 1)) == {"e0": 1}


def test_a_batch_that_cannot_be_read_clears_the_endpoint_and_is_no_gap(index, pub):
    """What an unreadable batch said (removals too) is unknown: the index
    forgets the endpoint's blocks rather than claim one the engine dropped."""
    subscribe(index, "e0", pub)
    serve_synced(index, "e0", pub, prompt(1, 2))
    before = index.stats("e0")
    pub.publish_payload(b"\xc1 not msgpack")
    wait_for(synced(index, "e0", pub), what="the garbage batch seen")
    s = index.stats("e0")
    assert index.blocks("e0") == []
    assert (s["garbage"], s["clears"]) == (before["garbage"] + 1, before["clears"] + 1)
    assert (s["gaps"], s["unrecovered"]) == (before["gaps"], before["unrecovered"])
    serve_synced(index, "e0", pub, prompt(2, 1))
    assert index.leading_blocks(prompt(2, 1)) == {"e0": 1}


def test_evictions_cleared_caches_and_restarts_remove_entries(index):
    p = MockKvPublisher(block_size=BS, capacity_blocks=4)
    try:
        subscribe(index, "e0", p)
        serve_synced(index, "e0", p, prompt(1, 3))
        serve_synced(index, "e0", p, prompt(2, 2))  # evicts prompt 1's oldest block
        assert index.leading_blocks(prompt(1, 3)) == {"e0": 0}
        assert index.leading_blocks(prompt(2, 2)) == {"e0": 2}
        p.clear()
        wait_for(synced(index, "e0", p))
        assert index.blocks("e0") == []
        serve_synced(index, "e0", p, prompt(3, 2))
        restarts = index.stats("e0")["restarts"]
        p.restart()
        p.serve(prompt(4, 1))
        wait_for(lambda: index.stats("e0")["restarts"] == restarts + 1, what="the restart")
        wait_for(synced(index, "e0", p))
        assert index.leading_blocks(prompt(3, 2)) == {"e0": 0}
        assert index.leading_blocks(prompt(4, 1)) == {"e0": 1}
    finally:
        p.close()


def test_an_idle_engine_that_answers_stays_live_and_a_hung_one_falls_back(pub):
    """An idle engine sends no events: it stays precise while its replay socket
    answers (asked when silent for half of stale_after_s); one that answers
    nothing falls back, and comes back when it answers again."""
    idx = routecore.KvEventIndex(block_size=BS, stale_after_s=0.3)
    try:
        subscribe(idx, "e0", pub)
        serve_synced(idx, "e0", pub, prompt(1, 2))
        asked = len(pub.replay_requests)
        time.sleep(1.5)  # five times stale_after_s, no event
        assert idx.stats("e0")["live"], "an idle engine is not stale"
        assert idx.leading_blocks(prompt(1, 2)) == {"e0": 2}
        assert len(pub.replay_requests) > asked
        assert pub.replay_requests[-1] == pub.seq, "asked from the batch after its last"
        pub.replay_paused = True
        wait_for(lambda: not idx.stats("e0")["live"], what="stale")
        assert idx.leading_blocks(prompt(1, 2)) == {"e0": None}
        pub.replay_paused = False
        wait_for(lambda: idx.stats("e0")["live"], what="live again")
        assert idx.leading_blocks(prompt(1, 2)) == {"e0": 2}
    finally:
        idx.close()


def test_without_replay_only_a_lost_stream_falls_back(pub):
    idx = routecore.KvEventIndex(block_size=BS, stale_after_s=0.3)
    try:
        subscribe(idx, "e0", pub, replay=False)
        deadline = time.monotonic() + 10
        while idx.stats("e0")["batches"] == 0 and time.monotonic() < deadline:
            pub.publish([])
            time.sleep(0.02)
        serve_synced(idx, "e0", pub, prompt(1, 2))
        time.sleep(1.5)
        assert idx.leading_blocks(prompt(1, 2)) == {"e0": 2}, "idle, connected: precise"
        pub.close()
        wait_for(lambda: not idx.stats("e0")["live"], what="the stream lost")
    finally:
        idx.close()


def test_a_late_subscriber_learns_an_idle_engines_cache_by_replay(index, pub):
    """A replica started after the engine (a restart, a scale-out) asks the
    replay socket from 0 at once: it learns what the engine caches without
    waiting for the engine's next event."""
    pub.serve(prompt(1, 3))
    pub.serve(prompt(2, 2))
    subscribe(index, "e0", pub)
    wait_for(synced(index, "e0", pub), what="replayed from 0")
    assert pub.replay_requests[0] == 0
    assert index.leading_blocks(prompt(1, 3)) == {"e0": 3}
    assert index.leading_blocks(prompt(2, 2)) == {"e0": 2}
    s = index.stats("e0")
    assert (s["batches"], s["gaps"], s["unrecovered"]) == (2, 0, 0)


def test_a_late_subscriber_learns_what_the_engine_still_buffers():
    """The engine keeps only its last batches: a late subscriber follows from
    the oldest it still has (what came before is under-reported, never
    over-reported: replica and engine agree on every block learned)."""
    p = MockKvPublisher(block_size=BS, capacity_blocks=64, buffer_steps=3)
    idx = routecore.KvEventIndex(block_size=BS)
    try:
        for head in range(1, 6):
            p.serve(prompt(head, 1))
        subscribe(idx, "e0", p)
        wait_for(synced(idx, "e0", p), what="replayed")
        got = idx.leading_blocks
        assert [got(prompt(h, 1))["e0"] for h in range(1, 6)] == [0, 0, 1, 1, 1]
        p.wait_subscribed(1)
        p.serve(prompt(6, 1))
        wait_for(synced(idx, "e0", p))
        assert got(prompt(6, 1)) == {"e0": 1}
        assert idx.stats("e0")["gaps"] == 0
    finally:
        idx.close()
        p.close()


def test_an_engine_restarted_while_the_stream_was_down_is_seen_at_reconnect(index):
    """The engine restarts (new sockets on the same ports, an empty cache) and
    stays idle: on reconnect the subscriber asks from its last batch, the
    engine does not have it, and the endpoint is cleared, not left claiming
    blocks the engine lost."""
    p = MockKvPublisher(block_size=BS)
    try:
        subscribe(index, "e0", p)
        serve_synced(index, "e0", p, prompt(1, 2))
        restarts = index.stats("e0")["restarts"]
        p.restart(sockets=True)
        wait_for(lambda: index.stats("e0")["restarts"] == restarts + 1, what="the restart")
        assert index.blocks("e0") == []
        wait_for(lambda: index.stats("e0")["live"], what="reconnected")
        p.wait_subscribed(1)
        serve_synced(index, "e0", p, prompt(2, 1))
        assert index.leading_blocks(prompt(2, 1)) == {"e0": 1}
    finally:
        p.close()


def test_a_lost_stream_falls_back(index):
    p = MockKvPublisher(block_size=BS)
    subscribe(index, "e0", p)
    serve_synced(index, "e0", p, prompt(1, 2))
    p.close()
    wait_for(lambda: not index.stats("e0")["live"], what="the stream lost")
    assert index.leading_blocks(prompt(1, 2)) == {"e0": None}


def test_replicas_subscribed_to_the_same_engines_converge():
    """Two indexes (two routecore replicas) on the same three engines hold the
    same blocks, and exactly the blocks each engine's cache holds."""
    engines = [MockKvPublisher(block_size=BS, capacity_blocks=12) for _ in range(3)]
    replicas = [routecore.KvEventIndex(block_size=BS) for _ in range(2)]
    try:
        for r in replicas:
            for i, p in enumerate(engines):
                subscribe(r, f"e{i}", p)
        rng = random.Random(5)
        for _ in range(150):
            i = rng.randrange(3)
            n = rng.randint(1, 4)
            engines[i].serve(
                [rng.randrange(3)] * BS + [rng.randrange(4) for _ in range(BS * (n - 1))],
                drop=rng.random() < 0.05,
            )
        for p in engines:
            p.publish([])  # a last batch, so a dropped one at the end is seen as a gap
        for r in replicas:
            for i, p in enumerate(engines):
                wait_for(synced(r, f"e{i}", p), what="replica synced")
        for i, p in enumerate(engines):
            truth = sorted(
                int(routecore.block_hashes(list(prefix), BS)[-1]) for prefix in p.cache.values()
            )
            assert replicas[0].blocks(f"e{i}") == truth
            assert replicas[1].blocks(f"e{i}") == truth
        probe = engines[0].cache[next(reversed(engines[0].cache))]
        assert replicas[0].leading_blocks(list(probe)) == replicas[1].leading_blocks(list(probe))
    finally:
        for r in replicas:
            r.close()
        for p in engines:
            p.close()


def test_bad_arguments_are_value_errors(index):
    with pytest.raises(ValueError, match="block_size"):
        routecore.KvEventIndex(block_size=0)
    with pytest.raises(ValueError, match="stale_after_s"):
        routecore.KvEventIndex(stale_after_s=-1.0)
    with pytest.raises(ValueError, match="kv_events.zmq"):
        index.subscribe("e0", "localhost:5557")
    with pytest.raises(ValueError, match="kv_events.replay"):
        index.subscribe("e0", "tcp://127.0.0.1:5557", replay="nope")
    # vLLM's bind address is not one to connect to.
    with pytest.raises(ValueError, match="bind address"):
        index.subscribe("e0", "tcp://*:5557")
    with pytest.raises(ValueError, match="max_message_bytes"):
        routecore.KvEventIndex(max_message_bytes=10)
    with pytest.raises(ValueError, match="max_batch_blocks"):
        routecore.KvEventIndex(max_batch_blocks=0)
    assert index.endpoints() == []
    with pytest.raises(KeyError):
        index.stats("e0")
    with pytest.raises(ValueError):
        index.leading_blocks([-1])


def test_a_closed_index_refuses_to_subscribe():
    idx = routecore.KvEventIndex()
    idx.close()
    idx.close()
    with pytest.raises(RuntimeError, match="closed"):
        idx.subscribe("e0", "tcp://127.0.0.1:1")


FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


def captured() -> list[list[bytes]]:
    """The KV-event messages a real vLLM 0.32 engine sent (see its README)."""
    return msgpack.unpackb((FIXTURES / "kv_events.msgpack").read_bytes())


def shapes(payloads: list[bytes]) -> tuple[set[tuple], dict[str, list[str]], dict[tuple, set]]:
    """What the bytes of some batches look like: the batch's element types,
    each event type's keys in order, and the value types seen per key."""
    batch: set[tuple] = set()
    keys: dict[str, list[str]] = {}
    types: dict[tuple, set] = {}

    def kind(v) -> str:
        if isinstance(v, list):
            return "list[" + ",".join(sorted({kind(x) for x in v})) + "]"
        return type(v).__name__

    for payload in payloads:
        b = msgpack.unpackb(payload)
        batch.add(tuple(kind(x) if not isinstance(x, list) else "list" for x in b))
        for e in b[1]:
            keys.setdefault(e["type"], list(e))
            assert list(e) == keys[e["type"]], "one key order per event type"
            for k, v in e.items():
                types.setdefault((e["type"], k), set()).add(kind(v))
    return batch, keys, types


def test_the_mock_sends_what_vllm_032_sends():
    """The mock's bytes have the captured engine's shape: an array batch of
    map events with the same keys in the same order and values of the same
    types (u64 hashes past 2^63 included), and replay answers of the same
    four frames and end marker."""
    real = shapes([m[2] for m in captured()])
    p = MockKvPublisher(block_size=BS, capacity_blocks=4)
    try:
        for head in range(40):
            p.serve(prompt(head, 2))
            p.serve(prompt(head, 3))
        p.clear()
        mock = shapes([payload for _, payload in p._buffer])
        assert mock[0] == real[0] == {("float", "list", "int")}
        assert mock[1] == real[1]
        for key, seen in mock[2].items():
            assert seen <= real[2][key], key

        def high(payloads) -> bool:
            events = [e for payload in payloads for e in msgpack.unpackb(payload)[1]]
            return max(h for e in events for h in e.get("block_hashes", [])) >= 1 << 63

        assert high(m[2] for m in captured()) and high(b for _, b in p._buffer)

        exchange = msgpack.unpackb((FIXTURES / "replay.msgpack").read_bytes())
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(p.replay)
        dealer.send_multipart(exchange["request"])
        answers = []
        while not answers or answers[-1][2] != (-1).to_bytes(8, "big", signed=True):
            assert dealer.poll(5000), "the mock's replay answered"
            answers.append(dealer.recv_multipart())
        dealer.close(0)

        def frames(answer: list[bytes]) -> list:
            empty, topic, seq, payload = answer
            return [empty, bool(topic), len(seq), bool(payload)]

        for got in (answers, exchange["answers"]):
            assert [frames(a) for a in got[:-1]] == [[b"", True, 8, True]] * (len(got) - 1)
            assert got[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert int.from_bytes(answers[0][2], "big") == 1
    finally:
        p.close()


def engine_blocks(messages: list[list[bytes]]) -> set[int]:
    """The engine hashes a cache holds after ``messages`` (from the events)."""
    held: set[int] = set()
    for _, _, payload in messages:
        for e in msgpack.unpackb(payload)[1]:
            if e["type"] == "BlockStored":
                held.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                held.difference_update(e["block_hashes"])
            else:
                held.clear()
    return held


def test_a_captured_vllm_stream_is_indexed_by_a_late_subscriber():
    """The real engine's batches (block size 32), buffered for replay before
    anyone subscribes: a late subscriber learns them all from replay and holds
    exactly as many blocks as the engine's cache, through its evictions and
    its AllBlocksCleared."""
    messages = captured()
    p = MockKvPublisher(block_size=32, topic="kv-events")
    idx = routecore.KvEventIndex(block_size=32)
    try:
        for _topic, seq, payload in messages[:-1]:
            assert p.publish_payload(payload, drop=True) == int.from_bytes(seq, "big")
        idx.subscribe("e0", p.zmq, topic="kv-events", replay=p.replay)
        wait_for(synced(idx, "e0", p), what="replayed")
        s = idx.stats("e0")
        assert len(engine_blocks(messages[:-1])) == s["blocks"] > 0
        # The removals of blocks stored before the capture began are the only skips.
        assert (s["garbage"], s["skipped"], s["gaps"]) == (0, 3, 0)
        p.wait_subscribed(1)
        p.publish_payload(messages[-1][2])  # AllBlocksCleared, then one block
        wait_for(synced(idx, "e0", p), what="the last batch")
        assert idx.stats("e0")["blocks"] == len(engine_blocks(messages)) == 1
    finally:
        idx.close()
        p.close()


def test_block_hashes_over_the_whole_u64_range_are_stored_and_removed(index):
    p = MockKvPublisher(block_size=BS, capacity_blocks=8)
    try:
        subscribe(index, "e0", p)
        for head in range(30):
            serve_synced(index, "e0", p, prompt(head, 2))
        assert any(h >= 1 << 63 for h in p.cache), "the engine used high hashes"
        truth = sorted(int(routecore.block_hashes(list(b), BS)[-1]) for b in p.cache.values())
        assert index.blocks("e0") == truth
        s = index.stats("e0")
        assert s["skipped"] == 0 and s["blocks"] == 8
    finally:
        p.close()


# -- the serve configuration and the data plane ----------------------------------

POOLS = [{"name": "short", "max_context": 8192, "endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}]


def kv_config(kv_events) -> dict:
    return {"pools": POOLS, "kv_events": kv_events}


def test_kv_events_config_reaches_the_data_plane_spec():
    from routecore.config import parse_config

    cfg = parse_config(
        kv_config(
            {
                "block_size": 4,
                "stale_after_s": 2,
                "endpoints": {
                    "127.0.0.1:8001": {
                        "zmq": "tcp://127.0.0.1:5557",
                        "topic": "kv",
                        "replay": "tcp://127.0.0.1:5558",
                    }
                },
            }
        )
    )
    spec = json.loads(cfg.spec_json())["kv_events"]
    assert spec == {
        "block_size": 4,
        "seed": 0,
        "capacity_blocks": 1 << 18,
        "stale_after_s": 2.0,
        "max_message_bytes": 16 << 20,
        "max_batch_events": 1 << 17,
        "max_batch_blocks": 1 << 18,
        "sources": [
            {
                "endpoint": "127.0.0.1:8001",
                "zmq": "tcp://127.0.0.1:5557",
                "topic": "kv",
                "replay": "tcp://127.0.0.1:5558",
            }
        ],
    }
    assert json.loads(parse_config({"pools": POOLS}).spec_json())["kv_events"] is None


@pytest.mark.parametrize(
    ("kv_events", "message"),
    [
        (
            {"endpoints": {"10.9.9.9:1": {"zmq": "tcp://h:1"}}},
            r"kv_events.endpoints\['10.9.9.9:1'\]: not an endpoint",
        ),
        (
            {"endpoints": {"127.0.0.1:8001": {"zmq": "h:1"}}},
            r"kv_events.endpoints\['127.0.0.1:8001'\].zmq",
        ),
        ({"endpoints": {"127.0.0.1:8001": {}}}, r"\.zmq: expected a ZeroMQ address"),
        (
            {"endpoints": {"127.0.0.1:8001": {"zmq": "tcp://h:1", "replay": "tcp://h:0"}}},
            r"\.replay: expected a ZeroMQ address",
        ),
        (
            {"endpoints": {"127.0.0.1:8001": {"zmq": "tcp://h:1", "port": 1}}},
            r"\.port: unknown key",
        ),
        ({"endpoints": ["127.0.0.1:8001"]}, r"kv_events.endpoints: expected a mapping"),
        ({"block_size": 0}, r"kv_events.block_size"),
        ({"capacity_blocks": -1}, r"kv_events.capacity_blocks"),
        ({"stale_after_s": 0}, r"kv_events.stale_after_s"),
        ({"max_message_bytes": 100}, r"kv_events.max_message_bytes"),
        ({"max_message_bytes": 1 << 31}, r"kv_events.max_message_bytes"),
        ({"max_batch_events": 0}, r"kv_events.max_batch_events"),
        ({"max_batch_blocks": True}, r"kv_events.max_batch_blocks"),
        ({"bloc_size": 16}, r"kv_events.bloc_size: unknown key"),
    ],
)
def test_bad_kv_events_config_names_the_key(kv_events, message):
    from routecore.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(kv_config(kv_events))


def test_the_data_plane_subscribes_and_reports_kv_metrics(pub):
    from routecore.config import parse_config

    endpoint = "127.0.0.1:8001"
    cfg = parse_config(
        kv_config(
            {
                "block_size": BS,
                "endpoints": {endpoint: {"zmq": pub.zmq, "topic": "kv", "replay": pub.replay}},
            }
        )
    )
    plane = routecore.DataPlane.start(cfg.spec_json())
    try:

        def metric(name: str) -> float | None:
            for line in plane.metrics_text().splitlines():
                if line.startswith(f'{name}{{endpoint="{endpoint}"}}'):
                    return float(line.rsplit(" ", 1)[1])
            return None

        wait_for(lambda: metric("routecore_kv_events_live") == 1.0, what="live")
        pub.wait_subscribed(pub.subscriptions + 1)
        pub.serve(prompt(1, 3))
        pub.serve(prompt(2, 1), drop=True)
        pub.serve(prompt(3, 1))
        wait_for(lambda: metric("routecore_kv_blocks") == 5.0, what="blocks indexed")
        assert metric("routecore_kv_event_replays_total") >= 1
        assert metric("routecore_kv_event_unrecovered_total") == 0
        pub.close()
        wait_for(lambda: metric("routecore_kv_events_live") == 0.0, what="fallback")
    finally:
        plane.drain(0.1)


def test_serve_routes_a_stored_prompt_to_its_engine_then_by_load_after_a_clear():
    """The data plane `routecore serve` runs, three engines publishing KV events:
    a prompt (token ids in a completions body, or given beside a chat body)
    goes to the engine that stored it, whatever the load elsewhere; once that
    engine clears its cache, the next requests go by load (one per idle
    endpoint)."""
    from routecore.config import parse_config

    endpoints = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]
    pubs = [MockKvPublisher(block_size=BS, capacity_blocks=64) for _ in endpoints]
    cfg = parse_config(
        {
            "router": {"policy": "precise-prefix+queue+kv"},
            "scrape": {"enabled": False},
            "pools": [{"name": "short", "max_context": 8192, "endpoints": endpoints}],
            "kv_events": {
                "block_size": BS,
                "endpoints": {
                    e: {"zmq": p.zmq, "topic": "kv", "replay": p.replay}
                    for e, p in zip(endpoints, pubs, strict=True)
                },
            },
        }
    )
    plane = routecore.DataPlane.start(cfg.spec_json())

    def metric(name: str, endpoint: str) -> float | None:
        for line in plane.metrics_text().splitlines():
            if line.startswith(f'{name}{{endpoint="{endpoint}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return None

    def blocks(endpoint: str) -> float | None:
        return metric("routecore_kv_blocks", endpoint)

    warmups = iter(range(1000, 2000))

    def subscribed(k: int) -> bool:
        """A new warm-up block reached engine k's subscriber (a SUB socket
        misses what is published before its subscription lands)."""
        pubs[k].serve(prompt(next(warmups), 1))
        time.sleep(0.02)
        return (metric("routecore_kv_event_batches_total", endpoints[k]) or 0) > 0

    def route(ids: list[int]) -> dict:
        body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 16}).encode()
        routed = plane.route_body(body)
        assert routed["admitted"], routed
        return routed

    try:
        for k in range(len(endpoints)):
            wait_for(lambda k=k: subscribed(k), what=f"engine {k} subscribed")
        ids = prompt(7, 8)
        before = blocks(endpoints[1]) or 0.0
        pubs[1].serve(ids)
        wait_for(lambda: blocks(endpoints[1]) == before + 8, what="blocks indexed")
        held = [route(ids) for _ in range(4)]  # held open: the holder gets busier
        assert [r["endpoint"] for r in held] == [endpoints[1]] * 4
        # A chat body (text: no prefix match, and the holder is the busiest) with
        # the caller's token ids, as the RouteCore API's Route takes them.
        chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        held.append(plane.route_body(chat.encode(), token_ids=ids))
        assert held[-1]["endpoint"] == endpoints[1]
        for r in held:
            plane.finish(r["request_id"])
        pubs[1].clear()
        wait_for(lambda: blocks(endpoints[1]) == 0.0, what="cleared")
        pubs[0].clear()
        pubs[2].clear()
        wait_for(lambda: blocks(endpoints[0]) == blocks(endpoints[2]) == 0.0, what="all cleared")
        held = [route(ids) for _ in range(3)]
        assert sorted(r["endpoint"] for r in held) == endpoints
        for r in held:
            plane.finish(r["request_id"])
        assert plane.in_flight()["leases"] == 0
    finally:
        plane.drain(0.1)
        for p in pubs:
            p.close()


def test_route_keys_a_body_with_the_callers_token_ids(tmp_path):
    """The RouteCore API's Route: `token_ids` beside a body key the prefix
    policy in place of the body's prompt (two different texts, one prefix)."""
    import grpc
    from server_fixtures import SHORT, Running, base_config

    from routecore.server.envoy_client import chat_body
    from routecore.server.gen import routecore_pb2 as rc
    from routecore.server.gen import routecore_pb2_grpc as rc_grpc

    config = base_config(router={"policy": "prefix", "prefix_block_size": BS})
    server = Running(tmp_path / "routecore.yaml", config)
    ids = prompt(7, 8)
    try:
        with grpc.insecure_channel(server.api_target) as channel:
            stub = rc_grpc.RouteCoreStub(channel)
            routed = [
                stub.Route(
                    rc.RouteRequest(body=chat_body(text, 16), api_key="demo-key", token_ids=ids)
                )
                for text in ("first question", "another question entirely")
            ]
            # Held open: without the ids the second would go to the idle endpoint.
            assert [r.endpoint for r in routed] == [SHORT[0], SHORT[0]]
            for r in routed:
                stub.Feedback(rc.FeedbackRequest(request_id=r.request_id, api_key="demo-key"))
    finally:
        server.stop()
