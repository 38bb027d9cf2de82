"""Flow control in ``routecore serve``: requests wait in their pool's queue
while it has no room, over real ext_proc streams (docs/server.md, "Flow
control").

The short pool's two endpoints each hold one request (the concurrency
detector, nothing scraped), so two requests are placed and the next ones
wait. ``demo`` is guaranteed and ``cheap`` spot.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy_proxy import shipped_config
from mock_engine import MockEngine
from server_fixtures import (
    Running,
    Spawned,
    admission,
    base_config,
    entitlement,
    free_port,
    redis_admission,
    redis_in_flight,
    wait_redis_settled,
    wait_settled,
)

from routecore.server.envoy_client import (
    chat_body,
    header_map,
    http_headers,
    is_timeout_override,
    usage_body,
)

GOLD = {"x-api-key": "demo-key"}
SPOT = {"x-api-key": "cheap-key"}
TTL = 30.0


def flow_config(adm: dict | None = None, cheap: int = 8, **flow) -> dict:
    """``base_config`` with flow control on (``flow`` over the defaults),
    admission ``adm`` (in memory, 8 slots by default) and ``cheap``'s
    concurrency."""
    adm = adm or admission(concurrency=8)
    adm["entitlements"].append({**entitlement("cheap", cheap, 1e6), "service_class": "spot"})
    return base_config(
        admission=adm,
        tenants=[
            {"name": "demo", "api_keys": ["demo-key"], "entitlement": "demo-std"},
            {"name": "cheap", "api_keys": ["cheap-key"], "entitlement": "cheap-std"},
        ],
        flow_control={
            "ttl_s": TTL,
            "saturation": {"detector": "concurrency", "max_in_flight": 1},
            **flow,
        },
    )


class Stream:
    """One BUFFERED ext_proc conversation held open: Envoy's side of it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = pb_grpc.ExternalProcessorStub(channel).Process()
        #: The message timeouts routecore asked for, in seconds.
        self.overrides: list[float] = []

    async def read(self) -> pb.ProcessingResponse:
        while True:
            resp = await self.call.read()
            assert resp is not grpc.aio.EOF, "the stream ended"
            if not is_timeout_override(resp):
                return resp
            self.overrides.append(resp.override_message_timeout.ToTimedelta().total_seconds())

    async def send(self, key: dict[str, str]) -> None:
        """The request's headers (answered at once) and body (answered once routed)."""
        await self.call.write(pb.ProcessingRequest(request_headers=http_headers(key)))
        await self.read()
        body = pb.HttpBody(body=chat_body("hello"), end_of_stream=True)
        await self.call.write(pb.ProcessingRequest(request_body=body))

    async def finish(self) -> None:
        """The engine's answer passes: the request ends."""
        await self.call.write(
            pb.ProcessingRequest(response_headers=http_headers({":status": "200"}))
        )
        await self.read()
        body = pb.HttpBody(body=usage_body(10, 5), end_of_stream=True)
        await self.call.write(pb.ProcessingRequest(response_body=body))
        await self.read()
        await self.call.done_writing()


def status(resp: pb.ProcessingResponse) -> tuple[int, dict[str, str]]:
    """The HTTP status of an answer (200: routed) and, refused, its headers."""
    if resp.HasField("immediate_response"):
        im = resp.immediate_response
        return im.status.code, header_map(im.headers)
    return 200, {}


def flow_metric(server: Running, name: str, *labels: str) -> float:
    return server.metric(name, "short", *labels)


def waiting(server: Running) -> float:
    return sum(flow_metric(server, "flow_queue_requests", band) for band in ("guaranteed", "spot"))


async def placed(channel, n: int) -> list[Stream]:
    """``n`` guaranteed requests, each routed at once."""
    out = []
    for _ in range(n):
        s = Stream(channel)
        await s.send(GOLD)
        assert status(await s.read())[0] == 200
        out.append(s)
    return out


async def queued(server: Running, channel, key: dict[str, str]) -> Stream:
    """A request that waits in the queue (once it is there)."""
    before = waiting(server)
    s = Stream(channel)
    await s.send(key)
    await until(lambda: waiting(server) == before + 1, "the request to wait")
    # Waiting, it asks Envoy to wait longer for the answer, first thing.
    resp = await asyncio.wait_for(s.call.read(), 5)
    assert is_timeout_override(resp), resp
    s.overrides.append(resp.override_message_timeout.ToTimedelta().total_seconds())
    return s


async def until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def run(coro):
    return asyncio.run(coro)


def test_a_waiting_request_goes_on_when_capacity_appears_higher_band_first(serve):
    server = serve(**flow_config())

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            full = await placed(ch, 2)
            spot = await queued(server, ch, SPOT)
            gold = await queued(server, ch, GOLD)
            # Envoy is asked to wait a TTL and a second for each answer.
            assert gold.overrides == [TTL + 1] and spot.overrides == [TTL + 1]
            assert flow_metric(server, "flow_queue_requests", "spot") == 1
            # A request ends: its room goes to the guaranteed request first.
            await full[0].finish()
            assert status(await gold.read())[0] == 200
            await full[1].finish()
            assert status(await spot.read())[0] == 200
            for s in (gold, spot):
                await s.finish()

    run(go())
    wait_settled(server)
    assert waiting(server) == 0
    assert flow_metric(server, "flow_queue_bytes", "spot") == 0
    assert flow_metric(server, "flow_outcomes", "guaranteed", "dispatched") == 1
    assert flow_metric(server, "flow_outcomes", "spot", "dispatched") == 1


def test_a_client_gone_while_queued_leaves_at_once_and_holds_nothing(serve):
    server = serve(**flow_config())

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            full = await placed(ch, 2)
            gone = await queued(server, ch, SPOT)
            # Waiting, it holds no quota: only dispatched requests do.
            assert server.server.plane.in_flight()["admission"] == 2
            gone.call.cancel()
            await until(lambda: waiting(server) == 0, "the queue to empty")
            assert server.server.plane.in_flight()["admission"] == 2
            assert flow_metric(server, "flow_outcomes", "spot", "cancelled") == 1
            # The next request takes the room, not the one that left.
            nxt = await queued(server, ch, GOLD)
            await full[0].finish()
            assert status(await nxt.read())[0] == 200
            for s in (full[1], nxt):
                await s.finish()

    run(go())
    wait_settled(server)
    assert flow_metric(server, "flow_outcomes", "spot", "dispatched") == 0


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_quota_at_its_limit_waits_and_goes_on_when_its_entitlement_releases(
    serve, backend, request
):
    if backend == "redis":
        url = request.getfixturevalue("redis_server").url
        adm = redis_admission(url, "closed", concurrency=1)
    else:
        adm = admission(concurrency=1)
    # The quota holds one request; the pool has room for two.
    server = serve(**flow_config(adm, cheap=1))

    def quota_in_flight() -> int:
        if backend == "redis":
            return redis_in_flight(url)
        return server.server.plane.in_flight()["admission"]

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            first = Stream(ch)
            await first.send(SPOT)
            assert status(await first.read())[0] == 200
            # Its quota full: it waits (no 429 quota-contention), holding none.
            second = await queued(server, ch, SPOT)
            assert quota_in_flight() == 1
            await first.finish()
            assert status(await second.read())[0] == 200
            await second.finish()

    run(go())
    wait_settled(server)
    assert waiting(server) == 0
    assert server.metric("rejections", "spot", "quota-contention") == 0
    if backend == "redis":
        wait_redis_settled(url)


def test_ttl_expiry_is_the_refusal_it_would_have_had_with_retry_after(serve):
    server = serve(**flow_config(ttl_s=0.3))

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            full = await placed(ch, 2)
            late = await queued(server, ch, SPOT)
            code, headers = status(await late.read())
            assert code == 429 and headers["retry-after"] == "1"
            assert late.overrides == [pytest.approx(1.3)]
            for s in full:
                await s.finish()

    run(go())
    wait_settled(server)
    assert flow_metric(server, "flow_outcomes", "spot", "expired") == 1
    assert server.metric("rejections", "spot", "saturated") == 1


def test_a_higher_band_displaces_a_lower_one_at_a_full_queue(serve):
    server = serve(**flow_config(max_requests=1))

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            full = await placed(ch, 2)
            spot = await queued(server, ch, SPOT)
            gold = Stream(ch)
            await gold.send(GOLD)
            code, headers = status(await spot.read())
            assert code == 429 and int(headers["retry-after"]) >= 1
            # Full of a higher band: a spot request is refused at once.
            more = Stream(ch)
            await more.send(SPOT)
            assert status(await more.read())[0] == 429
            await full[0].finish()
            assert status(await gold.read())[0] == 200
            for s in (full[1], gold):
                await s.finish()

    run(go())
    wait_settled(server)
    assert flow_metric(server, "flow_outcomes", "spot", "displaced") == 1
    assert flow_metric(server, "flow_outcomes", "spot", "refused") == 1
    assert server.metric("rejections", "spot", "displaced") == 1


def test_a_reload_leaves_waiting_requests_in_the_discipline_that_admitted_them(serve):
    server = serve(**flow_config())

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            full = await placed(ch, 2)
            spot = await queued(server, ch, SPOT)
            # The new configuration: one band, a TTL of 0.2 s.
            config = flow_config(ttl_s=0.2, bands=[{"name": "all"}])
            server.path.write_text(yaml.safe_dump(config))
            assert server.run(server.server.reload)
            await asyncio.sleep(0.5)  # past the new TTL: the old one (30 s) holds
            assert flow_metric(server, "flow_queue_requests", "spot") == 1
            await full[0].finish()
            assert status(await spot.read())[0] == 200
            for s in (full[1], spot):
                await s.finish()

    run(go())
    wait_settled(server)


def test_sigterm_with_a_full_queue_refuses_each_waiting_request_and_leaks_nothing(tmp_path):
    config = flow_config()
    config["server"]["grace_s"] = 2
    server = Spawned(tmp_path / "routecore.yaml", config)
    waiting_n = 5

    def queue_len() -> float:
        return server.metric("routecore_flow_queue_requests", pool="short")

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            full = []
            for _ in range(2):
                s = Stream(ch)
                await s.send(GOLD)
                assert status(await s.read())[0] == 200
                full.append(s)
            held = []
            for i in range(waiting_n):
                s = Stream(ch)
                await s.send(SPOT if i % 2 else GOLD)
                held.append(s)
            await until(lambda: queue_len() == waiting_n, "the queue to fill")
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            answers = [status(await s.read()) for s in held]
            assert time.monotonic() - start < 1.5, "refused before the grace ends"
            assert [a[0] for a in answers] == [503] * waiting_n
            assert all(a[1]["retry-after"] == "1" for a in answers)
            for s in full:
                await s.finish()

    try:
        run(go())
        assert server.proc.wait(timeout=30) == 0
    finally:
        log = server.stop()
    assert "queue-drained" in log
    assert "release-failed" not in log


def test_flow_control_section_errors_name_the_key(tmp_path):
    from routecore.config import ConfigError, parse_config

    for flow, says in [
        ({"max_requests": 0}, "flow_control.max_requests must be >= 1, got 0"),
        ({"max_bytes": -1}, "flow_control.max_bytes must be >= 1, got -1"),
        ({"ttl_s": 0}, "flow_control.ttl_s must be a finite number > 0, got 0"),
        (
            {"bands": [{"name": "a"}, {"name": "b", "max_requests": -3}]},
            "flow_control.bands[1].max_requests must be >= 1, got -3",
        ),
        ({"classes": {"batch": "gold"}}, 'flow_control.classes.batch: unknown band "gold"'),
        ({"default_band": "gold"}, 'flow_control.default_band: unknown band "gold"'),
        ({"enabled": "yes"}, "flow_control.enabled: expected true or false"),
        ({"saturation": {"detector": "vibes"}}, "flow_control.saturation.detector"),
        ({"saturation": {"max_kv_usage": 2}}, "flow_control.saturation.max_kv_usage"),
        ({"queue": 1}, "flow_control.queue: unknown key"),
    ]:
        config = flow_config(**flow)
        with pytest.raises(ConfigError) as e:
            parse_config(config)
        assert says in str(e.value), (flow, str(e.value))
    # Utilization needs the scraped metrics.
    config = flow_config(saturation={"detector": "utilization"})
    with pytest.raises(ConfigError, match="flow_control.saturation.detector: utilization"):
        parse_config(config)
    # Off: no queue in the data plane's spec.
    off = parse_config(flow_config(enabled=False))
    assert '"flow_control": null' in off.spec_json()
    assert parse_config(base_config()).flow_control.queue is None


def test_behind_envoy_a_wait_outlasts_its_message_timeout_and_a_hang_up_leaves_the_queue(
    serve, envoy
):
    """A real Envoy (the shipped envoy.yaml, its message timeout cut to 0.5 s)
    before one mock engine that takes 1.5 s an answer: a request that waits
    longer than Envoy's message timeout is served (routecore extended it),
    and one whose client hangs up while it waits leaves the queue at once."""
    engine = MockEngine(service_s=1.5).start()
    try:
        config = flow_config()
        config["pools"] = [{"name": "short", "max_context": 8192, "endpoints": [engine.address]}]
        server = serve(**config)
        proxy = shipped_config("envoy.yaml", free_port(), [server.target], [engine.address])
        (listener,) = proxy["static_resources"]["listeners"]
        filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        (ext_proc,) = [f for f in filters if f["name"] == "envoy.filters.http.ext_proc"]
        ext_proc["typed_config"]["message_timeout"] = "0.5s"
        url = envoy(proxy).url + "/v1/chat/completions"
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})

        def post(key: dict[str, str], timeout: float) -> int:
            headers = {**key, "content-type": "application/json"}
            req = urllib.request.Request(url, body.encode(), headers)
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        statuses: list[int] = []
        threads = [threading.Thread(target=lambda: statuses.append(post(GOLD, 30)))]
        threads[0].start()
        wait_until(lambda: engine_busy(server) == 1)
        threads.append(threading.Thread(target=lambda: statuses.append(post(GOLD, 30))))
        threads[1].start()
        wait_until(lambda: waiting(server) == 1)
        # A client that gives up while its request waits.
        with pytest.raises(OSError):
            post(SPOT, 0.3)
        wait_until(lambda: flow_metric(server, "flow_outcomes", "spot", "cancelled") == 1)
        assert flow_metric(server, "flow_queue_requests", "spot") == 0
        for t in threads:
            t.join(timeout=30)
        assert statuses == [200, 200]
        assert flow_metric(server, "flow_outcomes", "guaranteed", "dispatched") == 1
        wait_settled(server)
    finally:
        engine.close()


def engine_busy(server: Running) -> int:
    return sum(sum(loads.values()) for loads in server.server.plane.in_flight()["chooser"].values())


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
