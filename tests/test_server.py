"""End to end: the routecore server on 127.0.0.1 with real gRPC clients."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import subprocess
import urllib.request

import grpc
import pytest
import yaml
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_fixtures import (
    LONG,
    SHORT,
    Running,
    admission,
    base_config,
    converse,
    free_port,
    serve_command,
    stream_all,
    tenants,
    wait_for,
    wait_settled,
)

from routecore import Profile, Workload, plan
from routecore._core import DataPlane
from routecore.planning import plan_json
from routecore.server.envoy_client import (
    buffered,
    chat_body,
    header_map,
    http_headers,
    sse_chunks,
    usage_body,
)
from routecore.server.gen import routecore_pb2 as rc
from routecore.server.gen import routecore_pb2_grpc as rc_grpc

Mode = processing_mode_pb2.ProcessingMode
KEY = {"x-api-key": "demo-key"}


@pytest.fixture
def server(serve) -> Running:
    return serve()


async def hold(stub: pb_grpc.ExternalProcessorStub, text: str):
    """Starts a BUFFERED conversation and stops once it is routed: the request
    stays in flight. Returns the call and the routing answer."""
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=http_headers(KEY)))
    await call.read()
    body = pb.HttpBody(body=chat_body(text), end_of_stream=True)
    await call.write(pb.ProcessingRequest(request_body=body))
    return call, await call.read()


async def finish_held(call, usage: bytes) -> list[pb.ProcessingResponse]:
    """Sends the response of a held conversation (headers, then a JSON body)."""
    await call.write(pb.ProcessingRequest(response_headers=http_headers({":status": "200"})))
    out = [await call.read()]
    await call.write(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=usage, end_of_stream=True))
    )
    out.append(await call.read())
    await call.done_writing()
    return out


def settled(server: Running) -> None:
    """Nothing left in flight anywhere (streams end on the server a little
    after the client sees their end)."""
    wait_settled(server)


def test_buffered_chat_conversation_routes_and_learns(server):
    text = "hello world " * 50  # 600 bytes of prose
    conv = converse(server.target, KEY, chat_body(text, 100), [usage_body(120, 20)])
    routing = conv.routing
    assert routing is not None and routing.WhichOneof("response") == "request_body"
    headers = conv.routing_headers
    assert headers["x-routecore-pool"] == "short"
    # The chosen endpoint, then its fallback.
    assert sorted(conv.endpoints) == SHORT
    assert routing.request_body.response.clear_route_cache
    lb = routing.dynamic_metadata.fields["envoy.lb"].struct_value
    assert (
        lb.fields["x-gateway-destination-endpoint"].string_value
        == (headers["x-gateway-destination-endpoint"])
    )
    assert not routing.request_body.response.HasField("body_mutation")
    # The first observation sets the category's ratio: 600 bytes / 120 tokens.
    assert server.run(server.engine.router.calibrator.ratio, "prose") == pytest.approx(5.0)
    assert server.run(server.engine.router.calibrator.count, "prose") == 1
    settled(server)


def test_long_prompt_goes_to_long_pool(server):
    # ceil(40,000 / 4.0) + 100 = 10,100 tokens > 8,192: only the long pool holds it.
    conv = converse(server.target, KEY, chat_body("a" * 40_000, 100), [usage_body(10_000, 1)])
    assert conv.routing_headers == {
        "x-gateway-destination-endpoint": LONG[0],
        "x-routecore-pool": "long",
    }
    settled(server)


def test_full_duplex_streamed_request_and_sse_response(server):
    body = chat_body("stream me please " * 30, 50, stream=True)  # 510 bytes of text
    chunks = [body[i : i + 100] for i in range(0, len(body), 100)]
    duplex = pb.ProtocolConfiguration(
        request_body_mode=Mode.FULL_DUPLEX_STREAMED, response_body_mode=Mode.FULL_DUPLEX_STREAMED
    )
    sse = sse_chunks(170, 3)
    messages = [pb.ProcessingRequest(request_headers=http_headers(KEY), protocol_config=duplex)]
    messages += [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
        for i, c in enumerate(chunks)
    ]
    messages.append(
        pb.ProcessingRequest(
            response_headers=http_headers({":status": "200", "content-type": "text/event-stream"})
        )
    )
    messages += [
        pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=i == len(sse) - 1))
        for i, c in enumerate(sse)
    ]
    out = stream_all(server.target, messages)
    kinds = [r.WhichOneof("response") for r in out]
    # Headers wait for the body; then the body comes back whole, then the response passes.
    assert kinds == ["request_headers", "request_body", "response_headers"] + [
        "response_body"
    ] * len(sse)
    routing = out[0].request_headers.response
    assert header_map(routing.header_mutation)["x-routecore-pool"] == "short"
    assert routing.clear_route_cache
    listed = (
        out[0]
        .dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )
    assert sorted(listed.split(",")) == SHORT
    echoed = out[1].request_body.response.body_mutation.streamed_response
    assert echoed.body == body and echoed.end_of_stream
    back = [r.response_body.response.body_mutation.streamed_response for r in out[3:]]
    assert b"".join(s.body for s in back) == b"".join(sse)
    assert [s.end_of_stream for s in back] == [False] * (len(sse) - 1) + [True]
    # Usage from the last SSE event: 510 bytes / 170 tokens = 3.0.
    assert server.run(server.engine.router.calibrator.ratio, "prose") == pytest.approx(3.0)
    settled(server)


def test_duplex_body_ended_by_trailers_is_routed(server):
    duplex = pb.ProtocolConfiguration(request_body_mode=Mode.FULL_DUPLEX_STREAMED)
    body = chat_body("trailers end this body")
    out = stream_all(
        server.target,
        [
            pb.ProcessingRequest(request_headers=http_headers(KEY), protocol_config=duplex),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body)),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        ],
    )
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert header_map(out[0].request_headers.response.header_mutation)["x-routecore-pool"] == (
        "short"
    )
    assert out[1].request_body.response.body_mutation.streamed_response.body == body
    settled(server)


def test_buffered_request_with_streamed_sse_response(server):
    text = "tell me a story " * 25  # 400 bytes
    sse = sse_chunks(80, 7)
    conv = converse(
        server.target,
        KEY,
        chat_body(text, 50, stream=True),
        sse,
        {":status": "200", "content-type": "text/event-stream; charset=utf-8"},
    )
    assert conv.routing_headers["x-routecore-pool"] == "short"
    # Every chunk is answered (and passes unchanged): headers, body, then one per chunk.
    assert [r.WhichOneof("response") for r in conv.responses[2:]] == (
        ["response_headers"] + ["response_body"] * len(sse)
    )
    assert all(not r.response_body.HasField("response") for r in conv.responses[3:])
    # Usage from the SSE event: 400 bytes / 80 tokens.
    assert server.run(server.engine.router.calibrator.count, "prose") == 1
    assert server.run(server.engine.router.calibrator.ratio, "prose") == pytest.approx(5.0)
    settled(server)


def test_streamed_request_body_routes_on_last_chunk(server):
    body = chat_body("chunked " * 40, 20)
    half = len(body) // 2
    messages = [
        pb.ProcessingRequest(
            request_headers=http_headers(KEY),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=Mode.STREAMED),
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body[:half])),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body[half:], end_of_stream=True)),
    ]
    out = stream_all(server.target, messages)
    assert [r.WhichOneof("response") for r in out] == ["request_headers"] + ["request_body"] * 2
    assert not out[1].request_body.response.HasField("header_mutation")
    assert header_map(out[2].request_body.response.header_mutation)["x-routecore-pool"] == "short"
    settled(server)


@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [
        ({}, 401, "unknown-key"),
        ({"x-api-key": "not-a-real-key"}, 401, "unknown-key"),
        ({"x-api-key": "demo-key-but-longer"}, 401, "unknown-key"),
        ({"x-api-key": "expired-key"}, 403, "expired-key"),
    ],
)
def test_unknown_or_expired_key_is_refused_and_never_logged(server, capfd, headers, status, reason):
    DataPlane.set_log_level(logging.DEBUG)  # the data plane logs to stderr
    try:
        conv = converse(server.target, headers, chat_body("hi"), [usage_body(1, 1)])
    finally:
        DataPlane.set_log_level(logging.WARNING)
    imm = conv.immediate
    assert imm is not None and imm.status.code == status
    assert json.loads(imm.body)["error"]["type"] == reason
    assert len(conv.responses) == 1  # refused at the headers: the body is never read
    err = capfd.readouterr().err
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(e["event"] == "refused" and e["status"] == status for e in events)
    # (the test key "expired-key" is also a reason name: reasons are not keys)
    logged = [str(v) for e in events for k, v in e.items() if k != "reason"]
    for key in headers.values():
        assert not any(key in v for v in logged)
    settled(server)


def test_body_without_headers_is_refused_when_keys_are_required(server):
    # An Envoy configured with request_header_mode SKIP never shows the key.
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=chat_body("hi"), end_of_stream=True))
    out = stream_all(server.target, [body])
    assert len(out) == 1 and out[0].immediate_response.status.code == 401
    settled(server)


def test_malformed_and_oversize_bodies_do_not_break_the_server(server):
    for body, status, reason in [
        (b"{not json", 400, "malformed-body"),
        (b'{"messages": 3}', 400, "malformed-body"),
        (chat_body("x" * 300_000), 413, "body-too-large"),
        (chat_body("a" * 190_000, 60_000), 400, "exceeds-max-context"),
    ]:
        conv = converse(server.target, KEY, body, [usage_body(1, 1)])
        assert conv.immediate is not None, reason
        assert conv.immediate.status.code == status
        assert json.loads(conv.immediate.body)["error"]["type"] == reason
    # The same server still routes.
    assert converse(server.target, KEY, chat_body("fine"), [usage_body(3, 1)]).routing
    settled(server)


def test_oversize_streamed_body_is_refused_mid_stream(server):
    duplex = pb.ProtocolConfiguration(request_body_mode=Mode.FULL_DUPLEX_STREAMED)
    chunk = b"x" * 90_000
    out = stream_all(
        server.target,
        [pb.ProcessingRequest(request_headers=http_headers(KEY), protocol_config=duplex)]
        + [pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk)) for _ in range(3)],
    )
    assert len(out) == 1 and out[0].immediate_response.status.code == 413
    settled(server)


def test_no_endpoint_is_503(serve):
    config = base_config()
    config["pools"][1]["endpoints"] = []
    s = serve(pools=config["pools"])
    conv = converse(s.target, KEY, chat_body("a" * 40_000), [usage_body(1, 1)])
    assert conv.immediate.status.code == 503
    assert json.loads(conv.immediate.body)["error"]["type"] == "no-endpoint"
    settled(s)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_failure_mode(serve, mode):
    s = serve(server={"failure_mode": mode, "default_pool": "long"})
    s.server.plane.inject_fault("routing")  # the endpoint choice fails once
    conv = converse(s.target, KEY, chat_body("hi"), [usage_body(1, 1)])
    if mode == "open":
        assert conv.routing_headers["x-routecore-pool"] == "long"
    else:
        assert conv.immediate.status.code == 503
    settled(s)


def test_bodyless_request_goes_to_default_pool(server):
    conv = converse(server.target, KEY, None)
    routing = conv.routing
    assert routing.WhichOneof("response") == "request_headers"
    assert conv.routing_headers["x-routecore-pool"] == "short"


def test_request_that_never_returns_is_released_by_timeout(serve):
    s = serve(limits={"request_timeout_s": 0.2})

    async def scenario():
        async with grpc.aio.insecure_channel(s.target) as channel:
            call, routed = await hold(pb_grpc.ExternalProcessorStub(channel), "hi")
            assert routed.request_body.response.clear_route_cache
            assert s.run(s.engine.router.in_flight, "short") == 1
            # The stream stays open; the reaper releases it (a tick after 0.2 s,
            # later on a loaded machine).
            wait_for(lambda: s.run(s.engine.router.in_flight, "short") == 0, 5, "the reaper")
            call.cancel()

    asyncio.run(scenario())
    settled(s)
    assert s.metric("timeouts", "short") == 1


def test_least_request_spreads_held_requests(serve):
    server = serve(router={"policy": "least-request"})
    engine = server.engine

    async def route_three():
        return [await engine.route_fields(400, "prose", 10, None, None, 0.0) for _ in range(3)]

    leases = server.call(route_three())
    assert [lease.endpoint for lease in leases] == [SHORT[0], SHORT[1], SHORT[0]]
    server.run(engine.finish, leases[0], None, None, 1.0)
    server.run(engine.finish, leases[0], None, None, 1.0)  # idempotent
    assert engine.choosers["short"].load == {SHORT[0]: 1, SHORT[1]: 1}
    for lease in leases[1:]:
        server.run(engine.finish, lease, None, None, 1.0)
    settled(server)


def test_many_concurrent_streams(server):
    n = 200

    async def go():
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            return await asyncio.gather(
                *(
                    buffered(stub, KEY, chat_body(f"request {i} " * 20), [usage_body(50, 5)])
                    for i in range(n)
                )
            )

    convs = asyncio.run(go())
    pools = [c.routing_headers.get("x-routecore-pool") for c in convs]
    assert pools == ["short"] * n
    assert server.metric("decisions", "short") == n
    assert server.run(server.engine.router.calibrator.count, "prose") == n
    settled(server)


def test_health_and_metrics(server):
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in (
            "",
            "envoy.service.ext_proc.v3.ExternalProcessor",
            "routecore.v1.RouteCore",
        ):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    converse(server.target, KEY, chat_body("metrics"), [usage_body(2, 1)])
    converse(server.target, {"x-api-key": "expired-key"}, chat_body("x"), [])
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'routecore_decisions_total{pool="short"} 1.0' in text
    assert 'routecore_rejections_total{reason="expired-key",service_class="none"} 1.0' in text
    assert 'routecore_calibration_ratio{category="prose"} 3.5' in text  # 7 bytes / 2 tokens
    assert "routecore_decision_seconds_count 1\n" in text
    assert 'routecore_in_flight{endpoint="127.0.0.1:8001",pool="short"} 0.0' in text


def test_routecore_service(server):
    with grpc.insecure_channel(server.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        resp = stub.Route(rc.RouteRequest(body=chat_body("x" * 400, 50), api_key="demo-key"))
        assert resp.admission.admitted and resp.admission.status == 200
        assert resp.pool == "short" and resp.endpoint in SHORT
        # Cold start 4 bytes/token: ceil(400 / 4) = 100 input tokens + 50 output.
        assert (resp.est_input_tokens, resp.est_output_tokens) == (100, 50)
        assert resp.est_total_tokens == 150 and resp.reason == "budget"
        assert server.run(server.engine.router.in_flight, "short") == 1
        done = rc.FeedbackRequest(request_id=resp.request_id, prompt_tokens=80, api_key="demo-key")
        stub.Feedback(done)
        assert server.run(server.engine.router.calibrator.ratio, "prose") == 5.0
        with pytest.raises(grpc.RpcError) as e:
            stub.Feedback(done)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

        measured = rc.MeasuredRequest(prompt_bytes=0, category="code", max_output_tokens=9000)
        resp = stub.Route(rc.RouteRequest(measured=measured, api_key="demo-key"))
        assert resp.pool == "long" and resp.endpoint == LONG[0]
        tokens = rc.MeasuredRequest(prompt_tokens=8100, max_output_tokens=100)  # 8,200 > 8,192
        resp2 = stub.Route(rc.RouteRequest(measured=tokens, api_key="demo-key"))
        assert resp2.pool == "long" and resp2.est_input_tokens == 8100
        for r in (resp, resp2):
            stub.Feedback(rc.FeedbackRequest(request_id=r.request_id, api_key="demo-key"))

        refused = stub.Route(rc.RouteRequest(body=chat_body("x"), api_key="wrong-key"))
        assert not refused.admission.admitted and refused.admission.status == 401
        assert refused.pool == "" and refused.request_id == ""
        for bad in (
            rc.RouteRequest(body=b"{oops", api_key="demo-key"),
            rc.RouteRequest(api_key="demo-key"),
            rc.RouteRequest(
                measured=rc.MeasuredRequest(category="klingon", max_output_tokens=5),
                api_key="demo-key",
            ),
            rc.RouteRequest(measured=rc.MeasuredRequest(category="prose"), api_key="demo-key"),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.Route(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for bad in [
            "{}",
            "[1]",
            "{oops",
            '{"arrival_rate": 1, "slo_ttft_s": 1, "colour": 1}',
            '{"arrival_rate": 1, "slo_ttft_s": 1, "profile": "tpu"}',
            '{"arrival_rate": -1, "slo_ttft_s": 0.5, "workload": "azure-2023"}',
        ]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Plan(rc.PlanRequest(params_json=bad), metadata=list(KEY.items()))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    settled(server)


def test_plan_through_grpc_equals_the_library(server):
    params = {
        "workload": {"input_tokens": [900, 100, 3000], "output_tokens": [100, 50, 1000]},
        "arrival_rate": 10.0,
        "slo_ttft_s": 0.5,
        "profile": "llama3_70b_a100",
    }
    with grpc.insecure_channel(server.api_target) as channel:
        resp = rc_grpc.RouteCoreStub(channel).Plan(
            rc.PlanRequest(params_json=json.dumps(params)), metadata=list(KEY.items())
        )
    got = json.loads(resp.plan_json)
    direct = plan(Workload([900, 100, 3000], [100, 50, 1000]), 10.0, 0.5, Profile.llama3_70b_a100())
    # One serialisation for the API and `routecore plan --json`.
    assert got == json.loads(json.dumps(plan_json(direct)))
    assert got["homogeneous"]["gpus"] == direct.homogeneous.gpus
    assert got["best"]["gpus"] <= got["homogeneous"]["gpus"]


def test_state_file_keeps_the_calibrator_across_restarts(tmp_path):
    state = tmp_path / "routecore.state"
    config = base_config(server={"state_file": str(state)})
    first = Running(tmp_path / "a.yaml", config)
    try:
        converse(first.target, KEY, chat_body("x" * 600), [usage_body(120, 1)])
    finally:
        first.stop()
    second = Running(tmp_path / "b.yaml", config)
    try:
        assert second.run(second.engine.router.calibrator.count, "prose") == 1
        assert second.run(second.engine.router.calibrator.ratio, "prose") == 5.0
    finally:
        second.stop()
    state.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="state_file"):
        Running(tmp_path / "c.yaml", config)


def test_serve_command_sighup_reload_keeps_open_streams_and_stops_gracefully(tmp_path):
    path = tmp_path / "routecore.yaml"
    path.write_text(yaml.safe_dump(base_config()))
    port = free_port()
    target = f"127.0.0.1:{port}"
    cmd = serve_command(str(path), port, free_port())
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)

    async def scenario():
        async with grpc.aio.insecure_channel(target) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stub = pb_grpc.ExternalProcessorStub(channel)
            held, first = await hold(stub, "before reload " * 10)  # in flight across the reload
            listed = header_map(first.request_body.response.header_mutation)
            assert sorted(listed["x-gateway-destination-endpoint"].split(",")) == SHORT

            config = base_config()
            config["pools"][0]["endpoints"] = ["127.0.0.1:9101"]
            path.write_text(yaml.safe_dump(config))
            proc.send_signal(signal.SIGHUP)
            for _ in range(100):
                conv = await buffered(stub, KEY, chat_body("after"), [usage_body(1, 1)])
                if conv.endpoints == ["127.0.0.1:9101"]:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("reload not applied")

            path.write_text("pools: [oops")  # a broken file: the running config stays
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.3)
            conv = await buffered(stub, KEY, chat_body("still"), [usage_body(1, 1)])
            assert conv.endpoints == ["127.0.0.1:9101"]

            # The held stream finishes normally on the engine that routed it.
            answers = await finish_held(held, usage_body(40, 2))
            assert [a.WhichOneof("response") for a in answers] == [
                "response_headers",
                "response_body",
            ]

            # Graceful shutdown: a stream open at SIGTERM still finishes (grace_s = 1).
            last, _ = await hold(stub, "at shutdown")
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            answers = await finish_held(last, usage_body(3, 1))
            assert answers[-1].HasField("response_body")

    try:
        asyncio.run(scenario())
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [
        json.loads(line)["event"]
        for line in proc.stderr.read().splitlines()
        if line.startswith("{")
    ]
    assert events[0] == "started" and events[-1] == "stopped"
    assert "reloaded" in events and "reload-failed" in events


def distinct_sentences(n: int) -> str:
    words = ["river", "engine", "quiet", "market", "silver", "garden", "planet", "winter"]
    return " ".join(
        f"Sentence {i} talks about the {words[i % 8]} and the {words[(i * 3 + 1) % 8]} "
        f"near place number {i * 7}."
        for i in range(n)
    )


def test_compress_rewrites_body_and_content_length(serve):
    s = serve(router={"compress_band": 1.5})
    text = distinct_sentences(450)  # ~34 KB: ceil(bytes / 4) + 100 is in (8192, 1.5 * 8192]
    est = math.ceil(len(text.encode()) / 4.0) + 100
    assert 8192 < est <= 1.5 * 8192
    question = "Summarise the document."
    est += math.ceil(len(question) / 4.0)  # about 8,420
    # The document is an earlier turn (the last user message is never compressed).
    body = json.dumps(
        {
            "messages": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": "Read."},
                {"role": "user", "content": question},
            ],
            "max_tokens": 100,
        }
    ).encode()
    conv = converse(s.target, KEY, body, [usage_body(7000, 100)])
    headers = conv.routing_headers
    assert headers["x-routecore-pool"] == "short"
    new_body = conv.routing.request_body.response.body_mutation.body
    assert len(new_body) < len(body)
    assert headers["content-length"] == str(len(new_body))
    messages = json.loads(new_body)["messages"]
    content = messages[0]["content"]
    assert messages[1:] == [
        {"role": "assistant", "content": "Read."},
        {"role": "user", "content": question},
    ]
    # Compressed to B - L_out = 8,092 tokens at 4 bytes a token, by whole sentences.
    prompt_bytes = sum(len(m["content"].encode()) for m in messages)
    assert math.ceil(prompt_bytes / 4.0) <= 8192 - 100
    assert content.endswith(".") and len(content) < len(text)
    assert content.startswith("Sentence 0 ")  # primacy kept
    # The compressed prompt is not the one the calibrator would count: not learned.
    assert s.run(s.engine.router.calibrator.count, "prose") == 0
    with grpc.insecure_channel(s.api_target) as channel:
        resp = rc_grpc.RouteCoreStub(channel).Route(rc.RouteRequest(body=body, api_key="demo-key"))
    assert resp.pool == "short" and resp.compress_target_tokens == 8092
    assert json.loads(resp.compressed_body)["messages"][0]["content"] == content
    s.run(s.engine.finish, s.engine.lease(resp.request_id), None, None, 0.0)
    settled(s)


def test_admission_rejects_with_429_and_retry_after_then_admits_after_completion(serve):
    s = serve(admission=admission(1, tokens_per_s=1000.0), tenants=tenants())

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            # The first request takes the entitlement's one concurrency slot.
            held, routed = await hold(stub, "first")
            assert routed.request_body.response.clear_route_cache
            refused = await buffered(stub, KEY, chat_body("second"), [usage_body(1, 1)])
            imm = refused.immediate
            assert imm.status.code == 429
            assert json.loads(imm.body)["error"]["type"] == "concurrency"
            assert int(header_map(imm.headers)["retry-after"]) >= 1
            # The refused request left nothing counted in flight.
            assert s.run(s.engine.router.in_flight, "short") == 1
            await finish_held(held, usage_body(2, 1))
            again = await buffered(stub, KEY, chat_body("third"), [usage_body(2, 1)])
            assert again.routing is not None

    asyncio.run(go())
    assert s.metric("rejections", "guaranteed", "concurrency") == 1
    assert s.run(s.engine.admission.quota_in_flight, "gpu") == 0
    settled(s)


@pytest.mark.parametrize("policy", ["prefix", "vtc", "prefix+queue+kv"])
def test_prefix_and_vtc_policies_route_and_release(serve, policy):
    s = serve(router={"policy": policy, "prefix_block_size": 16})
    system = "You are a careful assistant. " * 20
    convs = [
        converse(s.target, KEY, chat_body(system + f"question {i}"), [usage_body(160, 5)])
        for i in range(6)
    ]
    endpoints = {c.endpoints[0] for c in convs}
    assert endpoints <= set(SHORT)
    if policy.startswith("prefix"):
        # Requests share a long prefix and none are in flight together: one endpoint holds it.
        assert len(endpoints) == 1
    chooser = s.engine.choosers["short"]
    assert s.run(lambda: list(chooser.load.values())) == [0, 0]
    settled(s)


def test_grpc_message_size_limit(serve):
    s = serve(limits={"max_message_bytes": 4096})
    big = pb.ProcessingRequest(
        request_body=pb.HttpBody(body=chat_body("x" * 8000), end_of_stream=True)
    )
    with pytest.raises(grpc.RpcError) as e:
        stream_all(s.target, [pb.ProcessingRequest(request_headers=http_headers(KEY)), big])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server is unharmed and nothing was left in flight.
    assert converse(s.target, KEY, chat_body("small"), [usage_body(2, 1)]).routing
    settled(s)


def test_admission_in_redis_is_shared_by_two_servers(serve, redis_server):
    shared = admission(1, tokens_per_s=1000.0, backend="redis", redis={"url": redis_server.url})
    a = serve(admission=shared, tenants=tenants())
    b = serve(admission=shared, tenants=tenants())

    async def go():
        async with (
            grpc.aio.insecure_channel(a.target) as ca,
            grpc.aio.insecure_channel(b.target) as cb,
        ):
            held, routed = await hold(pb_grpc.ExternalProcessorStub(ca), "replica a")
            assert routed.request_body.response.clear_route_cache
            # The one concurrency slot is taken on replica a: replica b refuses.
            other = await buffered(pb_grpc.ExternalProcessorStub(cb), KEY, chat_body("b"), [])
            assert other.immediate.status.code == 429
            await finish_held(held, usage_body(3, 1))
            again = await buffered(
                pb_grpc.ExternalProcessorStub(cb), KEY, chat_body("b"), [usage_body(1, 1)]
            )
            assert again.routing is not None

    asyncio.run(go())
    settled(a)
    settled(b)
