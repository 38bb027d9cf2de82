"""Hostile tenants and callers against ``routecore serve`` (issue 22, items 1,
10, 12, 14, 15, 16): every RouteCore call authenticates, only the tenant that
routed a request can end or charge it, ids are not guessable, usage is
bounded the same way whoever reports it, the tenant's key never reaches an
engine, and a flood of refusals is one log line."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from server_fixtures import base_config, converse, entitlement, stream_all, wait_settled

from routecore._core import DataPlane
from routecore.server.envoy_client import buffered, chat_body, http_headers, usage_body
from routecore.server.gen import routecore_pb2 as rc
from routecore.server.gen import routecore_pb2_grpc as rc_grpc

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
Mode = processing_mode_pb2.ProcessingMode
OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def two_tenants(concurrency: int = 4, tokens_per_s: float = 1e6) -> dict:
    """Tenants a (no entitlement) and b (``concurrency`` requests at once,
    ``tokens_per_s``), and the config overrides that serve them."""
    return {
        "admission": {
            "quotas": [
                {"name": "gpu", "tokens_per_s": 1e9, "kv_bytes": 10**13, "concurrency": 1000}
            ],
            "entitlements": [entitlement("b", concurrency, tokens_per_s)],
        },
        "tenants": [
            {"name": "a", "api_keys": [KEY_A]},
            {"name": "b", "api_keys": [KEY_B], "entitlement": "b-std"},
        ],
    }


async def hold(stub, key: str):
    """A BUFFERED conversation stopped once answered: routed, it stays in flight."""
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=http_headers({"x-api-key": key})))
    await call.read()
    body = pb.HttpBody(body=chat_body("hold me"), end_of_stream=True)
    await call.write(pb.ProcessingRequest(request_body=body))
    return call, await call.read()


def route(stub, key: str) -> rc.RouteResponse:
    return stub.Route(rc.RouteRequest(body=chat_body("x" * 400), api_key=key))


def feedback_code(stub, request_id: str, key: str | None = None, **usage) -> grpc.StatusCode:
    """The status a Feedback ends with (``key`` in the metadata; None: no key)."""
    metadata = [("x-api-key", key)] if key is not None else []
    try:
        stub.Feedback(rc.FeedbackRequest(request_id=request_id, **usage), metadata=metadata)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# -- item 1: Feedback authenticates and ends only its own tenant's requests ----------


def test_a_tenant_cannot_release_its_envoy_streams_to_exceed_its_concurrency(serve):
    s = serve(**two_tenants(concurrency=4))

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            held = [await hold(stub, KEY_B) for _ in range(4)]
            assert all(answer.HasField("request_body") for _, answer in held)
            # The ids of b's own streams (sequential before: the Route answers told them).
            ids = s.server.plane.leases()
            assert len(ids) == 4
            with grpc.insecure_channel(s.api_target) as api:
                stub_api = rc_grpc.RouteCoreStub(api)
                for request_id in ids:
                    code = feedback_code(stub_api, request_id, KEY_B, prompt_tokens=1)
                    assert code == grpc.StatusCode.NOT_FOUND
            assert sorted(s.server.plane.leases()) == sorted(ids)
            fifth = await buffered(stub, {"x-api-key": KEY_B}, chat_body("fifth"))
            assert fifth.immediate is not None and fifth.immediate.status.code == 429
            for call, _ in held:
                call.cancel()

    asyncio.run(go())
    wait_settled(s)


def test_a_caller_without_the_owners_key_cannot_release_a_tenants_requests(serve):
    s = serve(**two_tenants(concurrency=4))
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        routed = [route(stub, KEY_B) for _ in range(4)]
        assert all(r.admission.admitted for r in routed)
        for r in routed:
            assert feedback_code(stub, r.request_id) == grpc.StatusCode.UNAUTHENTICATED
            assert feedback_code(stub, r.request_id, "wrong-key") == grpc.StatusCode.UNAUTHENTICATED
            assert feedback_code(stub, r.request_id, KEY_A) == grpc.StatusCode.NOT_FOUND
        refused = route(stub, KEY_B)
        assert not refused.admission.admitted and refused.admission.status == 429
        # The owner, by the key in the metadata or in the message.
        assert feedback_code(stub, routed[0].request_id, KEY_B) == grpc.StatusCode.OK
        stub.Feedback(rc.FeedbackRequest(request_id=routed[1].request_id, api_key=KEY_B))
        assert route(stub, KEY_B).admission.admitted
    assert s.metric("rejections", "none", "unknown-key") == 8
    assert s.metric("rejections", "none", "not-in-flight") == 4


def test_request_ids_are_random_128_bit(serve):
    s = serve(**two_tenants(concurrency=100))
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        ids = [route(stub, KEY_A).request_id for _ in range(64)]
        for r in ids:
            assert re.fullmatch("[0-9a-f]{32}", r), r
            assert feedback_code(stub, r, KEY_A) == grpc.StatusCode.OK
    # Consecutive ids share no structure: about half their 128 bits differ
    # (for random ids, 64 +- 5.7; below 30 has probability under 1e-9).
    flips = [bin(int(x, 16) ^ int(y, 16)).count("1") for x, y in zip(ids, ids[1:], strict=False)]
    assert min(flips) > 30 and 54 < sum(flips) / len(flips) < 74, flips


def test_usage_of_2_30_neither_locks_a_tenant_out_nor_is_charged(serve):
    # 1,000 tokens/s: one charge of 2^31 would hold b's budget for weeks.
    s = serve(**two_tenants(concurrency=10, tokens_per_s=1000.0))
    huge = {"prompt_tokens": 2**30, "completion_tokens": 2**30}
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        r = route(stub, KEY_B)
        assert feedback_code(stub, r.request_id, **huge) == grpc.StatusCode.UNAUTHENTICATED
        assert route(stub, KEY_B).admission.admitted
        # Even b's own: more tokens than the pool's context, not real.
        assert feedback_code(stub, r.request_id, KEY_B, **huge) == grpc.StatusCode.OK
        again = route(stub, KEY_B)
        assert again.admission.admitted, again.admission.reason
    assert s.metric("absurd_usage", "short") == 1


# -- item 14: the id is bounded and never echoed --------------------------------------


def test_feedback_bounds_the_id_and_never_echoes_it(serve):
    s = serve(**two_tenants(), limits={"max_message_bytes": 8 << 20})
    with grpc.insecure_channel(
        s.api_target, options=[("grpc.max_receive_message_length", 8 << 20)]
    ) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        for request_id, code in [
            ("x" * 8192, grpc.StatusCode.INVALID_ARGUMENT),
            ("y" * (4 << 20), grpc.StatusCode.INVALID_ARGUMENT),
            ("z" * 64, grpc.StatusCode.NOT_FOUND),
            ("0" * 32, grpc.StatusCode.NOT_FOUND),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Feedback(
                    rc.FeedbackRequest(request_id=request_id), metadata=[("x-api-key", KEY_A)]
                )
            assert e.value.code() == code, len(request_id)
            assert request_id[:16] not in e.value.details() and len(e.value.details()) < 100


# -- item 15: usage without prompt tokens is checked too -----------------------------


def test_absurd_completion_without_prompt_tokens_is_counted(serve):
    s = serve(**two_tenants())
    absurd = b'{"usage": {"prompt_tokens": 0, "completion_tokens": 1099511627776}}'
    conv = converse(s.target, {"x-api-key": KEY_A}, chat_body("hi"), [absurd])
    assert conv.routing is not None
    assert s.metric("absurd_usage", "short") == 1
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        r = route(stub, KEY_A)
        assert feedback_code(stub, r.request_id, KEY_A, completion_tokens=2**40) == (
            grpc.StatusCode.OK
        )
    assert s.metric("absurd_usage", "short") == 2
    assert s.run(s.engine.router.calibrator.count, "prose") == 0
    wait_settled(s)


# -- item 1: Plan authenticates too ----------------------------------------------------


def test_plan_needs_a_key_when_tenants_are_configured(serve):
    s = serve(**two_tenants())
    params = rc.PlanRequest(params_json=json.dumps({"arrival_rate": 1, "slo_ttft_s": 1}))
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        for metadata in ([], [("x-api-key", "nope")]):
            with pytest.raises(grpc.RpcError) as e:
                stub.Plan(params, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert json.loads(stub.Plan(params, metadata=[("x-api-key", KEY_A)]).plan_json)["best"]


def test_without_tenants_the_id_is_the_only_capability(serve):
    s = serve(tenants=[])
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        r = stub.Route(rc.RouteRequest(body=chat_body("x")))
        assert r.admission.admitted
        assert feedback_code(stub, "0" * 32) == grpc.StatusCode.NOT_FOUND
        assert feedback_code(stub, r.request_id) == grpc.StatusCode.OK

    # An Envoy stream's lease is never ended by Feedback, with or without tenants.
    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            call, answer = await hold(pb_grpc.ExternalProcessorStub(channel), "any")
            assert answer.HasField("request_body")
            (request_id,) = s.server.plane.leases()
            with grpc.insecure_channel(s.api_target) as api:
                code = feedback_code(rc_grpc.RouteCoreStub(api), request_id)
            assert code == grpc.StatusCode.NOT_FOUND
            assert s.server.plane.leases() == [request_id]
            call.cancel()

    asyncio.run(go())
    wait_settled(s)


# -- item 10: a reload never refuses what the old configuration let in ------------------


def test_reload_removing_an_entitlement_lets_open_streams_finish_on_theirs(serve):
    s = serve(**two_tenants())

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            opened = []
            for _ in range(3):  # authenticated under the first configuration
                call = stub.Process()
                await call.write(
                    pb.ProcessingRequest(request_headers=http_headers({"x-api-key": KEY_B}))
                )
                assert (await call.read()).HasField("request_headers")
                opened.append(call)
            config = base_config(**two_tenants())
            config["admission"]["entitlements"][0]["name"] = "b-new"  # b-std is gone
            config["tenants"][1]["entitlement"] = "b-new"
            s.path.write_text(yaml.safe_dump(config))
            assert s.run(s.server.reload)
            for call in opened:
                body = pb.HttpBody(body=chat_body("after the reload"), end_of_stream=True)
                await call.write(pb.ProcessingRequest(request_body=body))
                answer = await call.read()
                assert answer.HasField("request_body"), answer
                await call.write(
                    pb.ProcessingRequest(response_headers=http_headers({":status": "200"}))
                )
                await call.read()
                last = pb.HttpBody(body=usage_body(5, 1), end_of_stream=True)
                await call.write(pb.ProcessingRequest(response_body=last))
                await call.read()
                await call.done_writing()
            # New streams are admitted under the new entitlement.
            new = await buffered(stub, {"x-api-key": KEY_B}, chat_body("new"), [usage_body(1, 1)])
            assert new.routing is not None

    asyncio.run(go())
    wait_settled(s)


# -- item 12: the tenant's key never reaches an engine --------------------------------


def removed(answer: pb.ProcessingResponse) -> list[str]:
    kind = answer.WhichOneof("response")
    return list(getattr(answer, kind).response.header_mutation.remove_headers)


#: What every request's header mutation removes: the key header, the listed
#: headers, and llm-d's sidecar header (routecore's own, set only on a
#: request its pool splits: docs/disaggregation.md).
STRIPPED = ["x-api-key", "x-internal-trace", "x-routecore-pool", "x-prefiller-host-port"]


@pytest.mark.parametrize("mode", ["buffered", "duplex"])
def test_the_key_header_and_the_listed_headers_are_removed_before_the_engine(serve, mode):
    s = serve(
        **two_tenants(),
        server={"strip_headers": ["X-Internal-Trace", "x-routecore-pool"]},
    )
    headers = {
        "x-api-key": KEY_A,
        "x-internal-trace": "t",
        # A client's own routing header is replaced, never added to.
        "x-gateway-destination-endpoint": "203.0.113.9:80",
    }
    if mode == "buffered":
        conv = converse(s.target, headers, chat_body("hi"), [usage_body(1, 1)])
        first, routing = conv.responses[0], conv.routing
        assert first.HasField("request_headers")
        assert removed(first) == STRIPPED
    else:
        config = pb.ProcessingRequest(
            request_headers=http_headers(headers),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=Mode.FULL_DUPLEX_STREAMED),
        )
        body = pb.ProcessingRequest(
            request_body=pb.HttpBody(body=chat_body("hi"), end_of_stream=True)
        )
        routing = stream_all(s.target, [config, body])[0]
        assert routing.HasField("request_headers")
    assert removed(routing) == STRIPPED
    kind = routing.WhichOneof("response")
    set_headers = getattr(routing, kind).response.header_mutation.set_headers
    assert [h.header.key for h in set_headers] == ["x-gateway-destination-endpoint"]
    assert all(h.append_action == OVERWRITE for h in set_headers)
    wait_settled(s)


def test_the_key_header_is_removed_by_default(serve):
    s = serve(
        server={"key_header": "authorization"},
        tenants=[{"name": "demo", "api_keys": ["Bearer demo-key"]}],
    )
    conv = converse(s.target, {"Authorization": "Bearer demo-key"}, chat_body("hi"), [])
    assert removed(conv.responses[0]) == ["authorization", "x-prefiller-host-port"]
    assert removed(conv.routing) == ["authorization", "x-prefiller-host-port"]
    assert "x-routecore-pool" in conv.routing_headers
    wait_settled(s)


# -- item 16: a flood of refusals is one log line per reason ---------------------------


def test_a_flood_of_refusals_logs_one_line_per_reason_and_counts_all(serve, capfd):
    s = serve(**two_tenants())
    DataPlane.set_log_level(logging.INFO)
    try:
        for _ in range(30):
            conv = converse(s.target, {"x-api-key": "stolen-key"}, chat_body("hi"))
            assert conv.immediate.status.code == 401
        for _ in range(10):
            conv = converse(s.target, {"x-api-key": KEY_A}, b"{not json")
            assert conv.immediate.status.code == 400
    finally:
        DataPlane.set_log_level(logging.WARNING)
    events = [json.loads(x) for x in capfd.readouterr().err.splitlines() if x.startswith("{")]
    refused = [e for e in events if e["event"] == "refused"]
    assert [e["reason"] for e in refused] == ["unknown-key", "malformed-body"]
    assert [e["suppressed"] for e in refused] == [0, 0]
    assert s.metric("rejections", "none", "unknown-key") == 30
    assert s.metric("rejections", "none", "malformed-body") == 10
    wait_settled(s)
