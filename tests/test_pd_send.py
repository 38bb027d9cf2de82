"""routecore sends a split request's two upstream requests itself
(``disaggregation.handoff``, docs/disaggregation.md "Who sends the two
upstream requests"): SGLang's one step against a mock that speaks SGLang's
documented PD protocol (tests/sglang_mock.py, checked against the
documented bodies in tests/fixtures/sglang/pd.json), the fallback when the
prefill endpoint is down, and the config's checks. vLLM's two steps run
against real engines in test_disaggregation_vllm.py."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from server_fixtures import base_config, converse
from sglang_mock import FIXTURE, Rooms, SglangServer, check_request

from routecore.config import ConfigError, parse_config

KEY = {"x-api-key": "demo-key"}
PREFILLER = "x-prefiller-host-port"
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def post(address: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://{address}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def sglang():
    rooms = Rooms(meet_s=5.0)
    pair = SglangServer("prefill", rooms), SglangServer("decode", rooms)
    yield pair
    for s in pair:
        s.stop()


def both(prefill: SglangServer, decode: SglangServer, body: dict) -> list[tuple[int, dict]]:
    """Sends ``body`` to both servers at once, as SGLang's router does."""
    out: list = [None, None]

    def send(i: int, s: SglangServer) -> None:
        out[i] = post(s.address, body)

    threads = [threading.Thread(target=send, args=(i, s)) for i, s in enumerate((prefill, decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_the_mock_speaks_the_documented_protocol(sglang):
    prefill, decode = sglang
    documented = {**FIXTURE["client_request"], "bootstrap_host": "127.0.0.1"}
    documented |= {"bootstrap_port": None, "bootstrap_room": 2**63 - 1}
    assert check_request(documented) is None
    answers = both(prefill, decode, documented)
    assert answers == [(200, FIXTURE["prefill_response"]), (200, FIXTURE["decode_response"])]
    # Without the bootstrap fields (or with a bad one) SGLang cannot pair them.
    for field, bad in [("bootstrap_room", None), ("bootstrap_room", -1), ("bootstrap_host", "")]:
        status, answer = post(decode.address, {**documented, field: bad})
        assert status == 400 and field in answer["error"]
    status, _ = post(decode.address, FIXTURE["client_request"])
    assert status == 400


def sglang_server(serve, prefill: str, decode: str, **handoff):
    pools = base_config()["pools"]
    pools[0].update(
        endpoints=[prefill, decode],
        roles={prefill: "prefill", decode: "decode"},
        disaggregation={"decider": "always", "handoff": "sglang", **handoff},
    )
    return serve(pools=pools)


def replaced_body(conv) -> bytes | None:
    for r in conv.responses:
        if r.WhichOneof("response") == "request_body":
            m = r.request_body.response.body_mutation
            if m.WhichOneof("mutation") == "body":
                return m.body
    return None


def test_sglang_handoff_sends_the_same_body_to_both_with_one_room(serve, sglang):
    prefill, decode = sglang
    r = sglang_server(serve, prefill.address, decode.address, bootstrap_port=8998)
    client = FIXTURE["client_request"]
    conv = converse(r.target, KEY, json.dumps(client).encode())
    assert conv.endpoints == [decode.address]
    assert PREFILLER not in conv.routing_headers, "routecore sent the prefill: no sidecar"
    body = replaced_body(conv)
    assert body is not None and conv.routing_headers["content-length"] == str(len(body))
    # Envoy's part: the decode request, with routecore's body, to the destination.
    assert post(decode.address, json.loads(body)) == (200, FIXTURE["decode_response"])
    (p,), (d,) = prefill.received, decode.received
    assert p["body"] == d["body"] == json.loads(body), "one body, one room, on both"
    fields = {k: d["body"][k] for k in BOOTSTRAP}
    assert fields["bootstrap_host"] == "127.0.0.1" and fields["bootstrap_port"] == 8998
    assert {k: v for k, v in d["body"].items() if k not in BOOTSTRAP} == client
    assert "x-api-key" not in {k.lower() for k in p["headers"]}, "the key never reaches an engine"
    assert r.metric("pd_fallbacks", "short", "connect") == 0
    # A second request draws another room.
    conv = converse(r.target, KEY, json.dumps(client).encode())
    again = json.loads(replaced_body(conv))
    assert post(decode.address, again)[0] == 200
    assert again["bootstrap_room"] != fields["bootstrap_room"]


def test_a_dead_sglang_prefill_endpoint_is_served_aggregated_and_counted(serve, sglang):
    _, decode = sglang
    r = sglang_server(serve, "127.0.0.1:9", decode.address)
    for n in (1, 2):
        conv = converse(r.target, KEY, json.dumps(FIXTURE["client_request"]).encode())
        assert conv.endpoints == [decode.address]
        assert replaced_body(conv) is None, "the body goes as it came"
        assert PREFILLER not in conv.routing_headers
        assert r.metric("pd_fallbacks", "short", "connect") == n


def pool(**keys) -> dict:
    endpoints = ["127.0.0.1:8001", "127.0.0.1:8002"]
    return {
        "name": "short",
        "max_context": 8192,
        "endpoints": endpoints,
        "role": "decode",
        "roles": {endpoints[1]: "prefill"},
        **keys,
    }


@pytest.mark.parametrize(
    ("disaggregation", "message"),
    [
        ({"handoff": "nixl"}, r"disaggregation\.handoff: expected one of"),
        ({"prefill_timeout_s": 0}, r"disaggregation\.prefill_timeout_s: expected a number"),
        ({"prefill_timeout_s": 1e9}, r"disaggregation\.prefill_timeout_s: expected a number"),
        ({"require_kv_transfer_params": "yes"}, r"require_kv_transfer_params: expected true"),
        ({"bootstrap_port": 70000}, r"disaggregation\.bootstrap_port: expected an integer"),
    ],
)
def test_bad_handoff_config_names_the_key(disaggregation, message):
    raw = base_config(pools=[pool(disaggregation={"decider": "always", **disaggregation})])
    raw["server"]["default_pool"] = "short"
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_the_handoff_config_reaches_the_data_plane():
    raw = base_config(pools=[pool(disaggregation={"decider": "always", "handoff": "vllm"})])
    raw["server"]["default_pool"] = "short"
    spec = json.loads(parse_config(raw).spec_json())
    (d,) = [p["disaggregation"] for p in spec["pools"]]
    assert d == {
        "decider": "always",
        "threshold": None,
        "handoff": "vllm",
        "prefill_timeout_s": 30.0,
        "require_kv_transfer_params": True,
        "bootstrap_port": None,
    }
