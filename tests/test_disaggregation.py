"""Prefill/decode disaggregation, the routing half (docs/disaggregation.md):
roles and deciders in config, the picker's decode-then-prefill pair, the
lease that holds both endpoints, and the ext_proc wire format (the prefill
endpoint in llm-d's ``x-prefiller-host-port``; a client's never trusted)."""

from __future__ import annotations

import json
import pickle
import urllib.request

import grpc
import pytest
from envoy_proxy import shipped_config
from mock_engine import MockEngine
from server_fixtures import (
    SHORT,
    base_config,
    converse,
    free_port,
    in_flight,
    wait_for,
    wait_settled,
)

from routecore import Dispatcher, EndpointPicker, NotInFlightError
from routecore.config import ConfigError, parse_config
from routecore.server.envoy_client import chat_body, header_map, usage_body
from routecore.server.gen import routecore_pb2 as rc
from routecore.server.gen import routecore_pb2_grpc as rc_grpc

KEY = {"x-api-key": "demo-key"}
PREFILLER = "x-prefiller-host-port"
ROLES = {"d0": "decode", "d1": "decode", "p0": "prefill", "p1": "prefill"}


def split_picker(**kw) -> EndpointPicker:
    return EndpointPicker(list(ROLES), "least-request", roles=ROLES, **kw)


def test_pairs_put_decode_on_decoders_and_prefill_on_prefillers_both_counted():
    p = split_picker()
    assert (p.roles, p.decider) == (list(ROLES.values()), "always")
    pairs = [p.pick_pair(input_tokens=10, now=0.0) for _ in range(4)]
    assert {d for d, _ in pairs} == {"d0", "d1"}
    assert {f for _, f in pairs} == {"p0", "p1"}
    assert p.in_flight == [2, 2, 2, 2]
    for d, f in pairs:
        p.completed_prefill(f, 10, now=1.0)
        p.completed(d, 10, 3, now=1.0)
    assert p.in_flight == [0, 0, 0, 0]
    with pytest.raises(NotInFlightError):
        p.completed_prefill("p0", now=2.0)


def test_the_uncached_tokens_decider_splits_only_what_the_decoder_lacks():
    names = ["d", "p"]
    p = EndpointPicker(
        names, "prefix", roles={"p": "prefill"}, decider="uncached-tokens", threshold=8
    )
    prompt = "the same long system prompt " * 8
    first = p.pick_pair(prompt, input_tokens=len(prompt), now=0.0)
    again = p.pick_pair(prompt, input_tokens=len(prompt), now=1.0)
    assert first == ("d", "p")
    assert again == ("d", None), "its prompt is cached on the decoder"
    # A picker without roles pairs its pick with no prefill endpoint.
    assert EndpointPicker(names, "least-request").pick_pair(now=0.0) == ("d", None)


def test_a_split_pickers_snapshot_keeps_its_roles_and_decider():
    p = split_picker(decider="prefill-load", threshold=3)
    p.pick_pair(now=0.0)
    for q in (EndpointPicker.from_bytes(p.to_bytes()), pickle.loads(pickle.dumps(p))):
        assert (q.roles, q.decider, q.in_flight) == (p.roles, "prefill-load", p.in_flight)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"roles": {"a": "decode", "b": "decode"}}, "no prefill endpoint"),
        ({"roles": {"a": "prefill", "b": "prefill"}}, "none can serve"),
        ({"roles": {"c": "prefill"}}, "not an endpoint of the pool"),
        ({"roles": {"a": "prefill-decode"}}, "unknown role"),
        ({"decider": "sometimes"}, "unknown decider"),
        ({"decider": "uncached-tokens"}, "needs a threshold"),
        ({"threshold": 3.0}, "needs a decider"),
    ],
)
def test_bad_roles_and_deciders_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        EndpointPicker(["a", "b"], "least-request", **kw)
    p = EndpointPicker(["a", "b"], "least-request", roles={"b": "prefill"})
    with pytest.raises(ValueError, match="keeps its endpoints"):
        p.add_endpoint("c")


def test_a_lease_holds_both_endpoints_and_releases_both_once():
    picker = split_picker()
    d = Dispatcher(pickers=picker)
    lease = d.acquire(max_output_tokens=5, input_tokens=20, now=0.0)
    assert lease.endpoint in ("d0", "d1")
    assert lease.prefill_endpoint in ("p0", "p1")
    assert "prefill_endpoint=" in repr(lease)
    assert sum(picker.in_flight) == 2
    lease.release(20, 5, now=1.0)
    assert picker.in_flight == [0, 0, 0, 0]
    with pytest.raises(NotInFlightError):
        lease.release()
    with Dispatcher(pickers=EndpointPicker(["a"], "least-request")).acquire(
        max_output_tokens=5, input_tokens=1
    ) as plain:
        assert plain.prefill_endpoint is None


def pool(**keys) -> dict:
    return {"name": "short", "max_context": 8192, "endpoints": list(SHORT), **keys}


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"role": "decode"}, r"pools\[0\]: decode endpoints and no prefill endpoint"),
        ({"role": "prefill"}, r"pools\[0\]: every endpoint is a prefill endpoint"),
        ({"role": "mixed"}, r"pools\[0\]\.role: expected one of"),
        ({"roles": {"10.0.0.9:1": "prefill"}}, r"pools\[0\]\.roles: '10.0.0.9:1' is not an"),
        ({"roles": {SHORT[0]: "p"}}, r"pools\[0\]\.roles\.127.0.0.1:8001: expected one of"),
        ({"disaggregation": {"decider": "x"}}, r"disaggregation\.decider: expected one of"),
        ({"disaggregation": {"decider": "prefill-load"}}, "needs a threshold"),
        ({"disaggregation": {"decider": "always", "k": 1}}, r"disaggregation\.k: unknown key"),
    ],
)
def test_bad_disaggregation_config_names_the_key(keys, message):
    raw = base_config(pools=[pool(**keys)])
    raw["server"]["default_pool"] = "short"
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def split_server(serve, decider: dict | None = None):
    keys = {"role": "decode", "roles": {SHORT[1]: "prefill"}}
    if decider is not None:
        keys["disaggregation"] = decider
    pools = base_config()["pools"]
    pools[0].update(keys)
    return serve(pools=pools)


def test_envoy_gets_the_decode_endpoint_and_the_prefill_one_in_the_sidecar_header(serve):
    r = split_server(serve)
    headers = {**KEY, PREFILLER: "10.6.6.6:1"}
    conv = converse(r.target, headers, chat_body("hi"), [usage_body(10, 2)])
    routed = conv.routing_headers
    assert conv.endpoints == [SHORT[0]]
    assert routed[PREFILLER] == SHORT[1], "the client's value is overwritten"
    assert r.metric("disaggregated", "short") == 1
    assert not any(wait_settled(r).values())


def test_an_unsplit_request_has_a_clients_sidecar_header_removed(serve):
    r = split_server(serve, {"decider": "never"})
    headers = {**KEY, PREFILLER: "10.6.6.6:1"}
    conv = converse(r.target, headers, chat_body("hi"), [usage_body(10, 2)])
    assert conv.endpoints == [SHORT[0]]
    removed = set()
    for resp in conv.responses:
        kind = resp.WhichOneof("response")
        if kind in ("request_headers", "request_body"):
            mutation = getattr(resp, kind).response.header_mutation
            assert PREFILLER not in header_map(mutation)
            removed.update(mutation.remove_headers)
    assert PREFILLER in removed
    assert r.metric("disaggregated", "short") == 0


def test_a_split_request_cut_off_releases_both_endpoints(serve):
    """A stream that ends before the response (the prefill endpoint died
    mid-handoff and the sidecar gave up, or the client left) releases the
    decode and the prefill endpoint once."""
    r = split_server(serve)
    converse(r.target, KEY, chat_body("hi"))  # no response: the stream is cut
    assert not any(wait_settled(r).values()), in_flight(r)


def test_a_dead_prefill_endpoint_leaves_requests_aggregated_on_their_decoder(serve):
    """The prefill engine dies while a split request is in flight: that
    request's end releases both endpoints once, and once the scraper finds
    the engine down, requests are served aggregated on the decode endpoint
    (no sidecar header), never refused."""
    decode, prefill = MockEngine().start(), MockEngine().start()
    try:
        pool = {
            "name": "short",
            "max_context": 8192,
            "endpoints": [decode.address, prefill.address],
            "roles": {decode.address: "decode", prefill.address: "prefill"},
        }
        r = serve(
            scrape={"enabled": True, "interval_s": 0.05, "unhealthy_after": 3},
            pools=[pool, {**base_config()["pools"][1], "endpoints": [decode.address]}],
        )
        wait_for(lambda: r.server.plane.endpoints()["short"][prefill.address]["healthy"])
        held = r.server.plane.route_body(chat_body("hi", max_tokens=10))
        assert held["admitted"]
        prefill.stop()
        state = r.server.plane.endpoints
        wait_for(lambda: not state()["short"][prefill.address]["healthy"], what="unhealthy")
        conv = converse(r.target, KEY, chat_body("hi"), [usage_body(10, 2)])
        assert conv.endpoints == [decode.address]
        assert PREFILLER not in conv.routing_headers
        assert r.metric("disaggregated", "short") == 1
        r.server.plane.finish(held["request_id"], 10, 5)
        assert not any(wait_settled(r).values())
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-full-duplex.yaml"])
def test_through_envoy_the_decode_engine_gets_the_prefill_endpoint_never_a_clients(
    name, serve, envoy
):
    """Through the shipped Envoy files: a split request reaches the decode
    engine (where llm-d's sidecar runs) with routecore's
    ``x-prefiller-host-port``; with the decider ``never`` it reaches it with
    none, whatever the client sent (about 2 s)."""
    decode, prefill = MockEngine().start(), MockEngine().start()
    try:
        for decider, want in (("always", prefill.address), ("never", None)):
            pool = {
                "name": "short",
                "max_context": 8192,
                "endpoints": [decode.address, prefill.address],
                "roles": {prefill.address: "prefill"},
                "disaggregation": {"decider": decider},
            }
            r = serve(pools=[pool])
            config = shipped_config(name, free_port(), [r.target], pool["endpoints"])
            gw = envoy(config)
            body = json.dumps(json.loads(chat_body("hello", max_tokens=4))).encode()
            headers = {**KEY, "content-type": "application/json", PREFILLER: "10.6.6.6:1"}
            req = urllib.request.Request(gw.url + "/v1/chat/completions", body, headers)
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
            seen = decode.requests[-1]
            assert seen.get(PREFILLER) == want, (decider, seen)
            assert prefill.requests == [], "Envoy sends to the decode endpoint only"
    finally:
        decode.close()
        prefill.close()


def test_the_routecore_api_returns_the_prefill_endpoint_and_feedback_releases_both(serve):
    """A caller that sends the upstream requests itself (its own router)
    gets both endpoints from RouteCore.Route; its Feedback releases both."""
    r = split_server(serve)
    with grpc.insecure_channel(r.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        routed = stub.Route(rc.RouteRequest(body=chat_body("hi"), api_key="demo-key"))
        assert (routed.endpoint, routed.prefill_endpoint) == (SHORT[0], SHORT[1])
        assert in_flight(r)["chooser:short"] == 2
        stub.Feedback(
            rc.FeedbackRequest(
                request_id=routed.request_id,
                prompt_tokens=10,
                completion_tokens=2,
                api_key="demo-key",
            )
        )
    assert not any(wait_settled(r).values())
    unsplit = split_server(serve, {"decider": "never"})
    out = unsplit.server.plane.route_body(chat_body("hi"))
    assert (out["endpoint"], out["prefill_endpoint"]) == (SHORT[0], None)
