"""Several ``routecore serve`` replicas behind one gateway agree without talking
to each other (README, "Several replicas"): two server processes subscribed to
the same three mock engines (KV events and metrics) and sharing admission in
Redis converge to the same precise prefix index, requests alternating between
them land on the engine that holds their prefix, and a request held on one
replica counts against the quota on the other."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from mock_engine import MockEngine, Served
from mock_kv_publisher import MockKvPublisher
from server_fixtures import (
    Spawned,
    base_config,
    converse,
    redis_admission,
    redis_in_flight,
    tenants,
    wait_for,
    wait_redis_settled,
)

from routecore.server.envoy_client import usage_body
from routecore.server.gen import routecore_pb2 as rc
from routecore.server.gen import routecore_pb2_grpc as rc_grpc

pytestmark = pytest.mark.slow

BS = 4
KEY = {"x-api-key": "demo-key"}


class Engine:
    """A mock vLLM endpoint (metrics, OpenAI API) whose served prompts go
    through its own KV cache, published as vLLM's KV events."""

    def __init__(self) -> None:
        self.kv = MockKvPublisher(block_size=BS, capacity_blocks=64)
        self.http = MockEngine(service_s=0.0)
        self.http.listeners.append(self._served)
        self.http.start()
        self.address = self.http.address

    def _served(self, served: Served) -> None:
        if served.token_ids:
            self.kv.serve(list(served.token_ids))

    def complete(self, body: bytes) -> dict:
        """The request as the gateway forwards it to this engine."""
        req = urllib.request.Request(
            f"http://{self.address}/v1/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def close(self) -> None:
        self.http.close()
        self.kv.close()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started = [Engine() for _ in range(3)]
    yield started
    for e in started:
        e.close()


def replica_config(engines: list[Engine], redis_url: str) -> dict:
    endpoints = [e.address for e in engines]
    return base_config(
        router={"policy": "precise-prefix+queue+kv"},
        scrape={"enabled": True, "interval_s": 0.05},
        pools=[{"name": "short", "max_context": 8192, "endpoints": endpoints}],
        tenants=tenants(),
        admission=redis_admission(redis_url, "closed", concurrency=2),
        kv_events={
            "block_size": BS,
            "endpoints": {
                e.address: {"zmq": e.kv.zmq, "topic": "kv", "replay": e.kv.replay} for e in engines
            },
        },
    )


@pytest.fixture
def replicas(engines, redis_server, tmp_path: Path) -> Iterator[list[Spawned]]:
    config = replica_config(engines, redis_server.url)
    started: list[Spawned] = []
    try:
        for i in range(2):
            started.append(Spawned(tmp_path / f"replica{i}.yaml", config))
        yield started
    finally:
        for r in started:
            r.stop()


def prompt(head: int, n_blocks: int) -> list[int]:
    return [head] * BS + [head + 1 + i for i in range(BS * (n_blocks - 1))]


def body(ids: list[int]) -> bytes:
    return json.dumps({"model": "m", "prompt": ids, "max_tokens": 8}).encode()


def route(replica: Spawned, ids: list[int]) -> str:
    """One whole ext_proc conversation on ``replica``; the endpoint it chose."""
    conv = converse(replica.target, KEY, body(ids), [usage_body(len(ids), 8)])
    assert conv.immediate is None, conv.immediate
    return conv.endpoints[0]


def indexed(replicas: list[Spawned], engines: list[Engine]) -> bool:
    """Every replica's precise index holds, per endpoint, exactly the blocks
    the engine's cache holds, and applied every batch the engine published."""
    return all(
        r.metric("routecore_kv_blocks", endpoint=e.address) == len(e.kv.cache)
        and r.metric("routecore_kv_event_batches_total", endpoint=e.address) == e.kv.seq
        for r in replicas
        for e in engines
    )


def subscribe_all(replicas: list[Spawned], engines: list[Engine]) -> None:
    """Waits until every replica's subscription reached every engine (a SUB
    socket misses what is published before its subscription arrives)."""
    for e in engines:
        e.kv.wait_subscribed(len(replicas), timeout=20)


def test_replicas_converge_and_send_a_prefix_to_its_engine(engines, replicas):
    """Both replicas' precise indexes hold exactly what each engine's cache
    holds after every step; a prompt some engine holds goes to that engine
    from either replica, including prompts neither replica ever routed (the
    approximate index of neither knows them: only the events do)."""
    subscribe_all(replicas, engines)
    by_address = {e.address: e for e in engines}
    heads = [100 * (k + 1) for k in range(6)]
    # Each prompt is first served by the engine the first replica picks (the
    # gateway forwards it there): its blocks are then on that engine only.
    holders = {}
    for k, head in enumerate(heads):
        ids = prompt(head, 6)
        chosen = route(replicas[k % 2], ids)
        by_address[chosen].complete(body(ids))
        holders[head] = chosen
        wait_for(lambda: indexed(replicas, engines), what="both replicas indexed the prompt")
    # Prompts stored on every engine, not one favourite.
    for head, holder in zip(heads[:3], (e.address for e in engines), strict=True):
        ids = prompt(head + 50, 6)
        by_address[holder].complete(body(ids))
        holders[head + 50] = holder
    wait_for(lambda: indexed(replicas, engines), what="both replicas converged")
    assert set(holders.values()) == set(by_address)
    # Follow-ups (the same prefix, a new tail) alternate between the replicas
    # and land on the engine holding their prefix, whichever replica routes them.
    for k, (head, holder) in enumerate(sorted(holders.items())):
        for replica in (replicas[k % 2], replicas[(k + 1) % 2]):
            ids = prompt(head, 6) + [7] * BS
            assert route(replica, ids) == holder, (head, replica.target)
    for r in replicas:
        r.wait_gauge_zero()
        assert r.metric("routecore_kv_events_live") == len(engines)
        assert r.metric("routecore_kv_event_unrecovered_total") == 0


def test_admission_is_shared_between_replicas(engines, replicas, redis_server):
    """Concurrency 2 in Redis: one request held on each replica fills it, so a
    third is refused by either replica until one is released."""

    def call(replica: Spawned, rpc: str, request):
        with grpc.insecure_channel(replica.api_target) as channel:
            stub = rc_grpc.RouteCoreStub(channel)
            return getattr(stub, rpc)(request, timeout=10, metadata=[("x-api-key", "demo-key")])

    def route_api(replica: Spawned, head: int) -> rc.RouteResponse:
        return call(
            replica, "Route", rc.RouteRequest(body=body(prompt(head, 2)), api_key="demo-key")
        )

    held = [route_api(replicas[0], 1), route_api(replicas[1], 2)]
    assert all(r.admission.admitted for r in held)
    assert redis_in_flight(redis_server.url) == 2
    for replica in replicas:
        refused = route_api(replica, 3)
        assert not refused.admission.admitted
        assert refused.admission.status == 429
    call(replicas[0], "Feedback", rc.FeedbackRequest(request_id=held[0].request_id))
    # The release reaches Redis on the data plane's runtime, after the answer.
    wait_for(lambda: redis_in_flight(redis_server.url) == 1, what="the release in Redis")
    again = route_api(replicas[1], 4)
    assert again.admission.admitted
    for r in (held[1], again):  # both on the second replica, which holds their leases
        call(replicas[1], "Feedback", rc.FeedbackRequest(request_id=r.request_id))
    wait_redis_settled(redis_server.url)
