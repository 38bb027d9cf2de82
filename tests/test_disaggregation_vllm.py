"""Prefill/decode disaggregation end to end with real vLLM engines on CPU: a
``kv_producer`` and a ``kv_consumer`` sharing vLLM's ExampleConnector
(KV blocks saved to and loaded from a shared directory), routecore's
ext_proc server placing a request on both, and this test acting as llm-d's
routing sidecar (the prefill with ``max_tokens: 1`` and ``kv_transfer_params``
sent to the endpoint in ``x-prefiller-host-port``, its ``kv_transfer_params``
relayed into the decode request sent to the destination). The decode engine
loads the prompt's KV instead of computing it, and answers as an aggregated
run does (greedy). About 2 to 4 minutes here (two engines load)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from server_fixtures import base_config, converse
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
