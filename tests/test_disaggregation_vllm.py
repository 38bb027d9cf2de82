"""Prefill/decode disaggregation end to end with real vLLM engines on CPU: a
``kv_producer`` and a ``kv_consumer`` sharing vLLM's ExampleConnector
(KV blocks saved to and loaded from a shared directory), routecore's
ext_proc server placing a request on both, and this test acting as llm-d's
routing sidecar (the prefill with ``max_tokens: 1`` and ``kv_transfer_params``
sent to the endpoint in ``x-prefiller-host-port``, its ``kv_transfer_params``
relayed into the decode request sent to the destination). The decode engine
loads the prompt's KV instead of computing it, and answers as an aggregated
run does (greedy). Then routecore sends the prefill itself
(``disaggregation.handoff: vllm``) behind a real Envoy, and falls back to an
aggregated request when the prefill engine is killed. About 2 to 4 minutes
here (two engines load, once for the module)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from envoy_proxy import shipped_config
from server_fixtures import base_config, converse, free_port, wait_settled
from tiny_model import MODEL_NAME, build
from vllm_engine import VllmEngine, engine_installed, start_all

from routecore.server.envoy_client import chat_body

pytestmark = [pytest.mark.realstack, pytest.mark.slow]

KEY = {"x-api-key": "demo-key"}
PREFILLER = "x-prefiller-host-port"
#: The log line of the ExampleConnector when a request's KV is found stored.
HIT = "External Cache Hit"


class KvEngine(VllmEngine):
    """A vLLM engine with the ExampleConnector in ``role`` over ``store``."""

    def __init__(self, model_dir: Path, workdir: Path, role: str, store: Path) -> None:
        self.kv_config = {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
        super().__init__(model_dir, workdir)

    def command(self) -> list[str]:
        return [*super().command(), "--kv-transfer-config", json.dumps(self.kv_config)]

    def hits(self) -> int:
        return self.log.read_text(errors="replace").count(HIT)


def complete(engine: VllmEngine, body: dict) -> dict:
    req = urllib.request.Request(
        f"{engine.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    if not engine_installed():
        pytest.fail("vLLM is not installed: run scripts/setup (scripts/setup-engine)")
    work = tmp_path_factory.mktemp("pd-vllm")
    model = build(work / "model")
    store = work / "kv"
    store.mkdir()
    pair = [
        KvEngine(model, work / "prefill", "kv_producer", store),
        KvEngine(model, work / "decode", "kv_consumer", store),
    ]
    try:
        start_all(pair)
        yield pair
    finally:
        for e in pair:
            e.stop()


def test_a_split_request_is_prefilled_on_one_engine_and_decoded_on_the_other(engines, serve):
    prefill, decode = engines
    pools = base_config()["pools"]
    pools[0].update(
        endpoints=[prefill.address, decode.address],
        roles={prefill.address: "prefill", decode.address: "decode"},
    )
    r = serve(pools=pools)
    text = "Tell me about the routing of prefill and decode. " * 8
    conv = converse(r.target, KEY, chat_body(text, max_tokens=12))
    assert conv.endpoints == [decode.address]
    assert conv.routing_headers[PREFILLER] == prefill.address
    # The sidecar's two requests, as llm-d's routing sidecar sends them.
    request = json.loads(chat_body(text, max_tokens=12))
    request.update(model=MODEL_NAME, temperature=0)
    first = complete(
        prefill,
        {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    before = decode.hits()
    answer = complete(decode, {**request, "kv_transfer_params": first.get("kv_transfer_params")})
    assert decode.hits() == before + 1, "the decode engine loaded the prompt's KV"
    aggregated = complete(prefill, request)
    assert answer["choices"][0]["message"] == aggregated["choices"][0]["message"]
    assert answer["usage"]["completion_tokens"] == 12


def routecore_sends(serve, prefill: KvEngine, decode: KvEngine):
    """routecore serve sending the prefill itself (``handoff: vllm``). The
    ExampleConnector hands the KV over through its store, so its prefill
    answer carries no ``kv_transfer_params``: they are not required here
    (NIXL's are: docs/disaggregation.md)."""
    pools = base_config()["pools"]
    pools[0].update(
        endpoints=[prefill.address, decode.address],
        roles={prefill.address: "prefill", decode.address: "decode"},
        disaggregation={
            "decider": "always",
            "handoff": "vllm",
            "require_kv_transfer_params": False,
        },
    )
    return serve(pools=pools)


def through(url: str, body: dict) -> dict:
    """POSTs ``body`` to the gateway at ``url`` with the tenant's key."""
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **KEY},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


FALLBACK_REASONS = ("connect", "status", "timeout", "bad-answer", "no-params")


def test_routecore_sends_the_prefill_and_the_decode_engine_loads_its_kv(engines, serve, envoy):
    prefill, decode = engines
    r = routecore_sends(serve, prefill, decode)
    addresses = [prefill.address, decode.address]
    gw = envoy(shipped_config("envoy.yaml", free_port(), [r.target], addresses))
    text = "routecore sends the prefill itself, then Envoy the decode. " * 8
    request = {**json.loads(chat_body(text, max_tokens=12)), "model": MODEL_NAME, "temperature": 0}
    generated = prefill.metric("vllm:generation_tokens_total")
    prompts = prefill.metric("vllm:prompt_tokens_total")
    decoded = decode.metric("vllm:generation_tokens_total")
    hits = decode.hits()
    answer = through(gw.url, request)
    # The prefill engine ran the prompt for one token (max_tokens 1) ...
    assert prefill.metric("vllm:generation_tokens_total") - generated == 1
    assert prefill.metric("vllm:prompt_tokens_total") - prompts == answer["usage"]["prompt_tokens"]
    # ... and the decode engine loaded its KV and decoded the answer.
    assert decode.hits() == hits + 1, "the decode engine loaded the prompt's KV"
    assert decode.metric("vllm:generation_tokens_total") - decoded == 12
    assert answer["usage"]["completion_tokens"] == 12
    assert all(r.metric("pd_fallbacks", "short", why) == 0 for why in FALLBACK_REASONS)
    assert not any(wait_settled(r).values()), "both endpoints given back"
    aggregated = complete(prefill, request)
    assert answer["choices"][0]["message"] == aggregated["choices"][0]["message"]


def test_a_killed_prefill_engine_leaves_the_request_aggregated_and_counted(engines, serve, envoy):
    """Last in the module: the prefill engine stays dead."""
    prefill, decode = engines
    r = routecore_sends(serve, prefill, decode)
    addresses = [prefill.address, decode.address]
    gw = envoy(shipped_config("envoy.yaml", free_port(), [r.target], addresses))
    text = "a prefill engine that dies leaves its requests to the decoder. " * 8
    request = {**json.loads(chat_body(text, max_tokens=8)), "model": MODEL_NAME, "temperature": 0}
    reference = complete(prefill, request)
    prefill.kill()
    decoded = decode.metric("vllm:generation_tokens_total")
    answer = through(gw.url, request)
    assert answer["choices"][0]["message"] == reference["choices"][0]["message"]
    assert decode.metric("vllm:generation_tokens_total") - decoded == 8
    assert r.metric("pd_fallbacks", "short", "connect") == 1
    assert not any(wait_settled(r).values()), "both endpoints given back"
