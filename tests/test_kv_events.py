"""The precise prefix index fed by KV-event subscribers (KvEventIndex), end to
end against mock vLLM publishers on 127.0.0.1 (tests/mock_kv_publisher.py)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator

import msgpack
import pytest
from mock_kv_publisher import CLEARED, MockKvPublisher, removed, stored, subscribe, synced
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


def test_duplicates_garbage_and_bad_events_change_nothing(index, pub):
    subscribe(index, "e0", pub)
    serve_synced(index, "e0", pub, prompt(1, 2))
    blocks = index.blocks("e0")
    before = index.stats("e0")
    pub.resend_last()
    pub.send_frames([b"kv", b"short"])
    pub.send_frames([b"kv"])
    pub.publish_payload(b"\xc1 not msgpack")
    pub.publish(
        [
            ["BlockMoved", [1]],
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
    assert s["garbage"] == before["garbage"] + 3
    assert s["skipped"] == before["skipped"] + 6
    assert s["gaps"] == before["gaps"] and s["clears"] == before["clears"]
    # The stream still works.
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


def test_a_silent_stream_goes_stale_and_falls_back(pub):
    idx = routecore.KvEventIndex(block_size=BS, stale_after_s=0.3)
    try:
        subscribe(idx, "e0", pub)
        serve_synced(idx, "e0", pub, prompt(1, 2))
        assert idx.leading_blocks(prompt(1, 2)) == {"e0": 2}
        wait_for(lambda: not idx.stats("e0")["live"], what="stale")
        assert idx.leading_blocks(prompt(1, 2)) == {"e0": None}
        serve_synced(idx, "e0", pub, prompt(2, 1))
        assert idx.stats("e0")["live"]
        assert idx.leading_blocks(prompt(1, 2)) == {"e0": 2}
    finally:
        idx.close()


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


def test_mock_batches_are_vllm_event_batches():
    """The mock speaks the wire format the decoder documents."""
    p = MockKvPublisher(block_size=BS)
    try:
        p.serve(prompt(1, 1))
        ts, events, rank = msgpack.unpackb(p._buffer[-1][1])
        assert rank == 0 and isinstance(ts, float)
        tag, hashes, parent, tokens, bs, lora_id, medium, lora_name = events[0]
        assert (tag, parent, tokens, bs, medium) == ("BlockStored", None, prompt(1, 1), BS, "GPU")
        assert CLEARED == ["AllBlocksCleared"]
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
