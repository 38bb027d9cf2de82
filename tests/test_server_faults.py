"""Fault injection against the routecore server (issue 12): hostile clients,
broken upstreams, failing components and a misbehaving Redis. Everything runs
on 127.0.0.1, started and stopped by the tests. After each fault, every
in-flight count (leases, router, choosers, admission, gauge) is back to zero.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import time

import grpc
import pytest
import redis
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_fixtures import (
    Running,
    admission,
    base_config,
    converse,
    free_port,
    in_flight,
    redis_admission,
    redis_in_flight,
    redis_unread_bytes,
    serve_command,
    stream_all,
    tenants,
    until,
    wait_for,
    wait_redis_settled,
    wait_settled,
)

from routecore.server.envoy_client import (
    buffered,
    chat_body,
    http_headers,
    sse_chunks,
    usage_body,
)
from routecore.server.gen import routecore_pb2 as rc
from routecore.server.gen import routecore_pb2_grpc as rc_grpc

Mode = processing_mode_pb2.ProcessingMode
KEY = {"x-api-key": "demo-key"}
ABSURD = 2**31  # above MAX_TOKENS = 2^30: no response ever used that many tokens


async def hold(stub, text: str = "hold me"):
    """A BUFFERED conversation stopped once routed: the request stays in flight."""
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=http_headers(KEY)))
    await call.read()
    await call.write(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=chat_body(text), end_of_stream=True))
    )
    return call, await call.read()


async def finish_held(call, usage: bytes) -> None:
    await call.write(pb.ProcessingRequest(response_headers=http_headers({":status": "200"})))
    await call.read()
    await call.write(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=usage, end_of_stream=True))
    )
    await call.read()
    await call.done_writing()


def metric(r: Running, name: str, *labels: str) -> float:
    return r.metric(name, *labels)


# -- 1. absurd usage ------------------------------------------------------------


@pytest.mark.parametrize("usage", [(ABSURD, 5), (120, ABSURD), (10**30, 0)])
def test_absurd_usage_completes_the_ticket_and_never_aborts_the_stream(serve, usage):
    s = serve(admission=admission(3), tenants=tenants())
    for _ in range(4):  # more than the 3 slots: a leaked ticket would lock the tenant out
        conv = converse(s.target, KEY, chat_body("hi " * 100), [usage_body(*usage)])
        assert conv.routing is not None
        assert conv.responses[-1].WhichOneof("response") == "response_body"
    assert metric(s, "absurd_usage", "short") == 4
    assert s.run(s.engine.router.calibrator.count, "prose") == 0  # not learned from
    wait_settled(s)


def test_absurd_usage_in_sse_and_feedback_is_ignored(serve):
    s = serve(admission=admission(1), tenants=tenants())
    conv = converse(
        s.target,
        KEY,
        chat_body("stream", stream=True),
        sse_chunks(ABSURD, 1),
        {":status": "200", "content-type": "text/event-stream"},
    )
    assert conv.routing is not None
    wait_settled(s)
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        for _ in range(2):  # one slot: the second Route needs the first ticket back
            resp = stub.Route(rc.RouteRequest(body=chat_body("x" * 400), api_key="demo-key"))
            assert resp.admission.admitted
            stub.Feedback(
                rc.FeedbackRequest(
                    request_id=resp.request_id,
                    prompt_tokens=ABSURD,
                    completion_tokens=ABSURD,
                    api_key="demo-key",
                )
            )
    assert metric(s, "absurd_usage", "short") == 3
    wait_settled(s)


# -- 1. a failure in every phase ----------------------------------------------------


PHASES = ["request_headers", "routing", "admission", "response_headers", "response_body", "finish"]


@pytest.mark.parametrize("mode", ["open", "closed"])
@pytest.mark.parametrize("phase", PHASES)
def test_failure_in_any_phase_releases_everything_and_never_aborts(serve, phase, mode):
    s = serve(admission=admission(3), tenants=tenants(), server={"failure_mode": mode})
    # The data plane fails this phase once (its test hook: the phases of a
    # conversation are Rust, not Python methods to patch).
    s.server.plane.inject_fault(phase)
    conv = converse(s.target, KEY, chat_body("fail " * 30), [usage_body(40, 2)])
    text = b"".join(r.SerializeToString() for r in conv.responses)
    assert b"secret-detail" not in text and b"ZeroDivision" not in text
    if phase == "request_headers" or (phase in ("routing", "admission") and mode == "closed"):
        assert conv.immediate is not None and conv.immediate.status.code == 503
        assert json.loads(conv.immediate.body)["error"]["type"] == "internal-error"
    else:  # routed (open: to the default pool), and the response passes
        assert conv.routing is not None
        assert conv.responses[-1].WhichOneof("response") == "response_body"
    wait_settled(s)
    # The same server serves the next request normally.
    assert converse(s.target, KEY, chat_body("fine"), [usage_body(2, 1)]).routing is not None
    wait_settled(s)


def test_a_failing_release_step_does_not_keep_the_others(serve, capfd):
    s = serve(admission=admission(1), tenants=tenants())
    s.server.plane.inject_fault("finish")  # the learning step of the release fails once
    conv = converse(s.target, KEY, chat_body("hi " * 100), [usage_body(60, 1)])
    assert conv.responses[-1].WhichOneof("response") == "response_body"
    # The ticket, router, choosers, gauge and lease are back all the same.
    wait_settled(s)
    assert s.run(s.engine.router.calibrator.count, "prose") == 0  # only learning was lost
    events = [json.loads(x) for x in capfd.readouterr().err.splitlines() if x.startswith("{")]
    assert any(e["event"] == "release-failed" and e["step"] == "learn" for e in events)


def test_routecore_api_failure_is_internal_without_detail(serve, monkeypatch):
    from routecore.server import service

    s = serve(admission=admission(3), tenants=tenants())
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        monkeypatch.setattr(service.pb, "Admission", None)  # the handler raises (TypeError)
        with pytest.raises(grpc.RpcError) as e:
            stub.Route(rc.RouteRequest(body=chat_body("x"), api_key="wrong-key"))
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert e.value.details() == "internal error"
        monkeypatch.undo()
        s.server.plane.inject_fault("admission")  # a failure while routing: failure_mode (closed)
        resp = stub.Route(rc.RouteRequest(body=chat_body("x"), api_key="demo-key"))
        assert resp.admission.status == 503 and resp.admission.reason == "internal-error"
    wait_settled(s)


# -- one front door: ext_proc and the RouteCore API apply the same rules --------------


def through_extproc(s: Running, key: dict, body: bytes) -> tuple[int, str]:
    """(status, pool or reason) of one ext_proc conversation."""
    conv = converse(s.target, key, body, [usage_body(5, 1)])
    if conv.immediate is not None:
        return conv.immediate.status.code, json.loads(conv.immediate.body)["error"]["type"]
    return 200, conv.routing_headers["x-routecore-pool"]


def through_api(s: Running, key: str, body: bytes) -> tuple[int, str]:
    """(status, pool or reason) of one RouteCore Route (ended at once by a
    Feedback); a bad request's INVALID_ARGUMENT as status 400 and its detail."""
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        try:
            resp = stub.Route(rc.RouteRequest(body=body, api_key=key))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            return 400, e.details()
        if not resp.admission.admitted:
            return resp.admission.status, resp.admission.reason
        stub.Feedback(rc.FeedbackRequest(request_id=resp.request_id, api_key=key))
        return 200, resp.pool


@pytest.mark.parametrize("mode", ["open", "closed"])
@pytest.mark.parametrize("phase", ["routing", "admission"])
def test_failure_mode_applies_identically_through_both_front_ends(serve, phase, mode):
    s = serve(admission=admission(3), tenants=tenants(), server={"failure_mode": mode})
    body = chat_body("x" * 40_000)  # the long pool when routing works
    expected = (200, "short") if mode == "open" else (503, "internal-error")  # short: default
    s.server.plane.inject_fault(phase)
    assert through_extproc(s, KEY, body) == expected
    s.server.plane.inject_fault(phase)
    assert through_api(s, "demo-key", body) == expected
    assert metric(s, "failures", mode) == 2
    assert through_api(s, "demo-key", body) == through_extproc(s, KEY, body) == (200, "long")
    wait_settled(s)


def test_key_and_body_limit_refusals_are_the_same_through_both_front_ends(serve):
    s = serve(admission=admission(3), tenants=tenants())
    body = chat_body("hi " * 2000)  # about 6 KB
    refusals = [("wrong-key", (401, "unknown-key")), ("expired-key", (403, "expired-key"))]
    for key, expected in refusals:
        assert through_extproc(s, {"x-api-key": key}, body) == expected
        assert through_api(s, key, body) == expected
    # The limit is the running configuration's: a reload to 4 KB applies to both.
    config = base_config(admission=admission(3), tenants=tenants())
    config["limits"]["max_body_bytes"] = 4096
    s.path.write_text(yaml.safe_dump(config))
    assert s.run(s.server.reload)
    assert through_extproc(s, KEY, body) == (413, "body-too-large")
    assert through_api(s, "demo-key", body) == (400, "request body exceeds 4096 bytes")
    refused = s.server.plane.route_body(body, b"demo-key")
    assert (refused["status"], refused["bad_request"]) == (413, True)
    assert metric(s, "rejections", "guaranteed", "body-too-large") == 3
    wait_settled(s)


# -- 6. protocol misuse -----------------------------------------------------------


def test_repeated_request_headers_end_the_stream_and_release_everything(serve):
    s = serve(admission=admission(3), tenants=tenants())
    bodyless = pb.ProcessingRequest(request_headers=http_headers(KEY, end_of_stream=True))
    with pytest.raises(grpc.RpcError) as e:
        stream_all(s.target, [bodyless] * 3)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "request_headers" in e.value.details()
    assert metric(s, "protocol_errors") == 1
    wait_settled(s)
    with pytest.raises(grpc.RpcError) as e:
        stream_all(
            s.target,
            [
                pb.ProcessingRequest(request_headers=http_headers(KEY)),
                pb.ProcessingRequest(
                    request_body=pb.HttpBody(body=chat_body("x"), end_of_stream=True)
                ),
                pb.ProcessingRequest(response_headers=http_headers({":status": "200"})),
                pb.ProcessingRequest(response_headers=http_headers({":status": "200"})),
            ],
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    wait_settled(s)


# -- 7. API keys as raw bytes ---------------------------------------------------------


def test_utf8_api_key_is_accepted_in_raw_value_and_in_value(serve):
    key = "clé-ünïcode-🔑"
    s = serve(tenants=[{"name": "demo", "api_keys": [key]}])
    raw = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key="x-api-key", raw_value=key.encode())]
        )
    )
    text = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-api-key", value=key)])
    )
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=chat_body("hi"), end_of_stream=True))
    for headers in (raw, text):
        out = stream_all(s.target, [pb.ProcessingRequest(request_headers=headers), body])
        assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    wrong = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key="x-api-key", raw_value=key.encode("utf-16"))]
        )
    )
    out = stream_all(s.target, [pb.ProcessingRequest(request_headers=wrong), body])
    assert out[0].immediate_response.status.code == 401
    wait_settled(s)


# -- 8. the SSE usage reader ------------------------------------------------------------


def test_sse_body_without_newlines_is_read_in_bounded_memory_and_later_usage_found(serve):
    # The reader itself (linear time, a line kept up to 64 KiB) is tested in Rust
    # (serve::usage); here a 4 MiB SSE body without newlines passes the server.
    s = serve(limits={"max_body_bytes": 200_000})
    text = "x" * 400
    event = b'data: {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3}}'
    chunks = [b"x" * 65536] * 64 + [b"\n\n" + event[:20], event[20:] + b"\n\ndata: [DONE]\n\n"]
    conv = converse(
        s.target,
        KEY,
        chat_body(text, stream=True),
        chunks,
        {":status": "200", "content-type": "text/event-stream"},
    )
    assert conv.responses[-1].WhichOneof("response") == "response_body"
    # 400 bytes of prose over 100 tokens: learned from the event after the long line.
    assert s.run(s.engine.router.calibrator.ratio, "prose") == pytest.approx(4.0)
    wait_settled(s)


# -- 5. RouteCore API: out-of-range fields and bad Plan parameters --------------------------


def test_routecore_out_of_range_fields_and_deep_plan_params_are_invalid_argument(serve):
    s = serve()
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        for m in (
            rc.MeasuredRequest(prompt_tokens=2**63, max_output_tokens=10),
            rc.MeasuredRequest(prompt_tokens=2**64 - 1, max_output_tokens=10),
            rc.MeasuredRequest(prompt_bytes=2**63, category="prose", max_output_tokens=10),
            rc.MeasuredRequest(prompt_bytes=100, category="prose", max_output_tokens=2**63),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.Route(rc.RouteRequest(measured=m, api_key="demo-key"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "must be" in e.value.details()
        huge = '{"arrival_rate": 1, "slo_ttft_s": 0.5, "workload": '
        huge += '{"input_tokens": [99999999999999999999999], "output_tokens": [1]}}'
        for bad in ("[" * 100_000, '{"a":' * 50_000, huge, '{"arrival_rate": 1e999}'):
            with pytest.raises(grpc.RpcError) as e:
                stub.Plan(rc.PlanRequest(params_json=bad), metadata=list(KEY.items()))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad[:40]
    wait_settled(s)


# -- 9. SIGHUP keeps in-memory tickets ---------------------------------------------------


@pytest.mark.parametrize("changed", [False, True])
def test_reload_keeps_in_memory_tickets_in_flight(serve, changed):
    s = serve(admission=admission(3), tenants=tenants())

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            held = [await hold(stub, f"held {i}") for i in range(3)]
            assert all(routed.HasField("request_body") for _, routed in held)
            if changed:  # other entitlements: a new backend, which adopts the three
                config = base_config(admission=admission(3), tenants=tenants())
                config["admission"]["quotas"][0]["tokens_per_s"] = 2e6
                s.path.write_text(yaml.safe_dump(config))
            assert s.run(s.server.reload)  # SIGHUP
            refused = await buffered(stub, KEY, chat_body("fourth"), [usage_body(1, 1)])
            assert refused.immediate is not None and refused.immediate.status.code == 429
            await finish_held(held[0][0], usage_body(5, 1))  # finished by the old engine
            again = await buffered(stub, KEY, chat_body("fifth"), [usage_body(1, 1)])
            assert again.routing is not None
            for call, _ in held[1:]:
                await finish_held(call, usage_body(5, 1))

    asyncio.run(go())
    wait_settled(s)


def test_reload_into_a_bad_admission_section_logs_reload_failed_and_keeps_serving(serve, caplog):
    s = serve(admission=admission(3), tenants=tenants())
    bad = base_config(
        admission=admission(
            3, backend="redis", redis={"url": "redis://127.0.0.1:1/0", "lease_s": "abc"}
        ),
        tenants=tenants(),
    )
    s.path.write_text(yaml.safe_dump(bad))
    caplog.set_level(logging.INFO, logger="routecore.server")
    assert s.run(s.server.reload) is False
    assert any(r.getMessage() == "reload-failed" for r in caplog.records)
    assert converse(s.target, KEY, chat_body("still"), [usage_body(1, 1)]).routing is not None
    wait_settled(s)


# -- 4 / 10. startup errors: one line, no traceback ---------------------------------------


def run_serve(config: dict, tmp_path, port: int) -> subprocess.CompletedProcess:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        serve_command(str(path), port, free_port()), capture_output=True, text=True, timeout=60
    )


def test_serve_on_a_busy_port_is_one_line_and_nonzero(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        done = run_serve(base_config(), tmp_path, busy.getsockname()[1])
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "Address already in use" in line]
    assert len(errors) == 1, done.stderr


def test_corrupt_state_file_is_a_clear_error(tmp_path):
    state = tmp_path / "routecore.state"
    state.write_bytes(b"\x00garbage" * 10)
    done = run_serve(base_config(server={"state_file": str(state)}), tmp_path, free_port())
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "state_file" in done.stderr and "state-file-invalid" in done.stderr


# -- cancellation in every phase ----------------------------------------------------------


@pytest.mark.parametrize("phase", ["after-headers", "mid-body", "after-routing", "mid-response"])
def test_client_cancel_in_any_phase_releases_everything(serve, phase):
    s = serve(admission=admission(3), tenants=tenants())
    streamed = pb.ProtocolConfiguration(
        request_body_mode=Mode.STREAMED, response_body_mode=Mode.STREAMED
    )
    body = chat_body("cancel me " * 40)

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(
                pb.ProcessingRequest(request_headers=http_headers(KEY), protocol_config=streamed)
            )
            await call.read()
            if phase != "after-headers":
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body[:50])))
                await call.read()
            if phase in ("after-routing", "mid-response"):
                last = pb.HttpBody(body=body[50:], end_of_stream=True)
                await call.write(pb.ProcessingRequest(request_body=last))
                routed = await call.read()
                assert routed.request_body.response.clear_route_cache
                assert in_flight(s)["leases"] == 1
            if phase == "mid-response":
                headers = {":status": "200", "content-type": "text/event-stream"}
                await call.write(pb.ProcessingRequest(response_headers=http_headers(headers)))
                await call.read()
                chunk = pb.HttpBody(body=sse_chunks(10, 1)[0])
                await call.write(pb.ProcessingRequest(response_body=chunk))
                await call.read()
            call.cancel()

    asyncio.run(go())
    wait_settled(s)


# -- Redis faults ----------------------------------------------------------------------


@pytest.mark.slow
def test_stalled_redis_never_blocks_the_event_loop(serve, redis_server):
    s = serve(admission=redis_admission(redis_server.url, "closed", 100), tenants=tenants())
    assert converse(s.target, KEY, chat_body("warm"), [usage_body(2, 1)]).routing is not None
    n = 20

    async def go():
        async with (
            grpc.aio.insecure_channel(s.target) as channel,
            grpc.aio.insecure_channel(s.api_target) as api_channel,
        ):
            stub = pb_grpc.ExternalProcessorStub(channel)
            start = time.monotonic()
            streams = [
                asyncio.ensure_future(buffered(stub, KEY, chat_body(f"s{i}"), [usage_body(2, 1)]))
                for i in range(n)
            ]
            api = rc_grpc.RouteCoreStub(api_channel)
            routes = [
                asyncio.ensure_future(
                    api.Route(rc.RouteRequest(body=chat_body(f"r{i}"), api_key="demo-key"))
                )
                for i in range(5)
            ]
            # Admission calls reached the stopped Redis and wait for its answer.
            await until(lambda: redis_unread_bytes(redis_server.port) > 0, 10, "admits")
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            # The health check is answered while the streams still wait on Redis.
            assert not any(t.done() for t in streams + routes)
            convs = await asyncio.gather(*streams)
            for r in await asyncio.gather(*routes):
                assert r.admission.status == 503 and not r.admission.admitted
            return convs, time.monotonic() - start

    redis_server.stop()
    try:
        convs, elapsed = asyncio.run(go())
    finally:
        redis_server.cont()
    print(f"{n} streams against a stalled Redis: {elapsed:.2f} s")
    assert all(c.immediate.status.code == 503 for c in convs)  # failure_mode closed
    assert all(b"redis" not in c.immediate.body.lower() for c in convs)
    # Each waited one socket timeout (0.5 s) at the same time, not one after another.
    assert elapsed < n * 0.5 / 2
    wait_settled(s)
    wait_redis_settled(redis_server.url)
    assert converse(s.target, KEY, chat_body("back"), [usage_body(2, 1)]).routing is not None
    wait_settled(s)


@pytest.mark.slow
def test_cancel_while_admission_waits_on_a_stalled_redis_leaks_nothing(serve, redis_server):
    s = serve(admission=redis_admission(redis_server.url, "closed"), tenants=tenants())
    assert converse(s.target, KEY, chat_body("warm"), [usage_body(2, 1)]).routing is not None

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(pb.ProcessingRequest(request_headers=http_headers(KEY)))
            await call.read()
            body = pb.HttpBody(body=chat_body("stalled"), end_of_stream=True)
            await call.write(pb.ProcessingRequest(request_body=body))
            # The admission call reached the stopped Redis and waits for its answer.
            await until(lambda: redis_unread_bytes(redis_server.port) > 0, 10, "the admit")
            redis_server.cont()
            call.cancel()

    redis_server.stop()
    try:
        asyncio.run(go())
    finally:
        redis_server.cont()
    wait_settled(s)
    wait_redis_settled(redis_server.url)


@pytest.mark.slow
def test_reaper_completes_tickets_off_the_event_loop_while_redis_stalls(serve, redis_server):
    s = serve(
        admission=redis_admission(redis_server.url, "closed"),
        tenants=tenants(),
        limits={"request_timeout_s": 0.3},
    )

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            calls = [await hold(pb_grpc.ExternalProcessorStub(channel), f"h{i}") for i in range(3)]
            assert redis_in_flight(redis_server.url) == 3
            redis_server.stop()
            try:
                while metric(s, "timeouts", "short") < 1:  # the reaper is ending the leases
                    await asyncio.sleep(0.01)
                health = health_pb2_grpc.HealthStub(channel)
                start = time.monotonic()
                await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                waited = time.monotonic() - start
                while metric(s, "timeouts", "short") < 3:
                    await asyncio.sleep(0.01)
            finally:
                redis_server.cont()
            for call, _ in calls:
                call.cancel()
            return waited

    waited = asyncio.run(go())
    assert waited < 0.4  # not behind a completion waiting 0.5 s for Redis on the loop
    assert metric(s, "timeouts", "short") == 3
    wait_settled(s)
    wait_redis_settled(redis_server.url)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_killed_and_restarted(serve, redis_server, mode):
    s = serve(admission=redis_admission(redis_server.url, mode), tenants=tenants())
    assert converse(s.target, KEY, chat_body("up"), [usage_body(2, 1)]).routing is not None
    redis_server.kill()
    for with_body in (True, False):
        conv = converse(s.target, KEY, chat_body("down") if with_body else None, [usage_body(2, 1)])
        if mode == "open":
            assert conv.routing is not None
        else:
            assert conv.immediate.status.code == 503
            assert b"Error" not in conv.immediate.body
    wait_settled(s)
    redis_server.start()
    for _ in range(3):  # back: admitted again, with tickets (3 slots, one at a time)
        assert converse(s.target, KEY, chat_body("up"), [usage_body(2, 1)]).routing is not None
    wait_settled(s)
    wait_redis_settled(redis_server.url)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_error_replies_go_through_failure_mode_without_detail(serve, redis_server, mode):
    s = serve(admission=redis_admission(redis_server.url, mode), tenants=tenants())
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")
    try:
        for with_body in (True, False):
            body = chat_body("oom") if with_body else None
            conv = converse(s.target, KEY, body, [usage_body(2, 1)])
            text = b"".join(r.SerializeToString() for r in conv.responses)
            assert b"OOM" not in text and b"sha" not in text.lower()
            if mode == "open":
                assert conv.routing is not None, with_body
            else:
                assert conv.immediate.status.code == 503, with_body
        with grpc.insecure_channel(s.api_target) as channel:
            resp = rc_grpc.RouteCoreStub(channel).Route(
                rc.RouteRequest(body=chat_body("api"), api_key="demo-key")
            )
            assert resp.admission.admitted == (mode == "open")
            if resp.request_id:
                rc_grpc.RouteCoreStub(channel).Feedback(
                    rc.FeedbackRequest(
                        request_id=resp.request_id, prompt_tokens=5, api_key="demo-key"
                    )
                )
        wait_settled(s)
    finally:
        client.config_set("maxmemory", "0")
        client.close()
    assert converse(s.target, KEY, chat_body("ok"), [usage_body(2, 1)]).routing is not None
    wait_settled(s)
    wait_redis_settled(redis_server.url)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_serve_starts_without_redis_and_connects_when_it_comes_back(serve, mode):
    from conftest import RedisServer

    later = RedisServer()  # its port, nothing listening yet
    s = serve(admission=redis_admission(later.url, mode), tenants=tenants())

    def ready() -> bool:
        with grpc.insecure_channel(s.target) as channel:
            request = health_pb2.HealthCheckRequest(service="readiness")
            answer = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
            return answer.status == health_pb2.HealthCheckResponse.SERVING

    def api_ready() -> bool:
        # The RouteCore API's port follows the data plane's readiness.
        with grpc.insecure_channel(s.api_target) as channel:
            request = health_pb2.HealthCheckRequest(service="routecore.v1.RouteCore")
            answer = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
            return answer.status == health_pb2.HealthCheckResponse.SERVING

    conv = converse(s.target, KEY, chat_body("no redis yet"), [usage_body(2, 1)])
    if mode == "open":
        assert conv.routing is not None
        # Ready after its first failed warm-up: it serves, unaccounted.
        wait_for(ready, 30, "ready")
        wait_for(api_ready, 30, "the API ready")
    else:
        assert conv.immediate.status.code == 503
        # Not ready while Redis is down: it could only refuse.
        assert not ready()
        assert not s.server.plane.ready and not api_ready()
        assert s.server.plane.wait_ready(0.2) is False  # timed out
        with pytest.raises(ValueError, match="timeout_s"):
            s.server.plane.wait_ready(-1.0)
    later.start()
    try:
        # Ready (fail-closed) once Redis is warm: retried in the background,
        # a waiter woken by it.
        assert s.server.plane.wait_ready(30) is True
        wait_for(ready, 30, "ready")
        wait_for(api_ready, 30, "the API ready")
        assert s.server.plane.ready

        async def go():
            async with grpc.aio.insecure_channel(s.target) as channel:
                call, routed = await hold(pb_grpc.ExternalProcessorStub(channel))
                assert routed.request_body.response.clear_route_cache
                assert redis_in_flight(later.url) == 1  # admitted with a ticket
                await finish_held(call, usage_body(3, 1))

        asyncio.run(go())
        wait_settled(s)
        wait_redis_settled(later.url)
    finally:
        later.kill()


def test_serve_command_with_redis_unreachable_starts(tmp_path):
    config = base_config(
        admission=redis_admission(f"redis://127.0.0.1:{free_port()}/0", "open"), tenants=tenants()
    )
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        serve_command(str(path), port, free_port()), stderr=subprocess.PIPE, text=True
    )
    try:

        async def go():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await asyncio.wait_for(channel.channel_ready(), 30)
                stub = pb_grpc.ExternalProcessorStub(channel)
                return await buffered(stub, KEY, chat_body("open"), [usage_body(2, 1)])

        assert asyncio.run(go()).routing is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in proc.stderr.read()
