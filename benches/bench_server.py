"""The ext_proc server's per-conversation work, in process (no network):
routecore's ``Conversation`` beside a plain-Python processor, same run.

The network figures (throughput, added latency through gRPC) come from the
load driver: .venv/bin/python -m routecore.server.envoy_client --requests 20000

Run: .venv/bin/python -m pytest benches/bench_server.py
"""

import pytest

from benches.baselines import server as baseline
from routecore.config import parse_config
from routecore.server.engine import EngineHolder
from routecore.server.envoy_client import chat_body, http_headers, usage_body
from routecore.server.extproc import Conversation, pb
from routecore.server.metrics import Metrics

SHORT = ["127.0.0.1:8001", "127.0.0.1:8002"]
LONG = ["127.0.0.1:8011"]
CONFIG = {
    "pools": [
        {"name": "short", "max_context": 8192, "endpoints": SHORT},
        {"name": "long", "max_context": 65536, "endpoints": LONG},
    ],
    "tenants": [{"name": "demo", "api_keys": ["demo-key"]}],
}


def messages(text_bytes):
    return [
        pb.ProcessingRequest(request_headers=http_headers({"x-api-key": "demo-key"})),
        pb.ProcessingRequest(
            request_body=pb.HttpBody(
                body=chat_body("Summarise this. " * (text_bytes // 16), 200), end_of_stream=True
            )
        ),
        pb.ProcessingRequest(response_headers=http_headers({":status": "200"})),
        pb.ProcessingRequest(
            response_body=pb.HttpBody(body=usage_body(300, 50), end_of_stream=True)
        ),
    ]


def run_without_loop(coro):
    """Runs a coroutine that never waits to its end, without an event loop:
    ``Conversation.handle`` is a coroutine, and with the in-memory admission
    backend it never suspends (the server's grpc.aio task drives it the same
    way), so the bench measures the conversation's work, not a loop's."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the conversation waited on something")


@pytest.mark.parametrize("size", [1_000, 40_000])
@pytest.mark.benchmark(group="ext_proc: one whole conversation, in process")
def test_conversation_routecore(benchmark, size):
    holder = EngineHolder(parse_config(CONFIG), Metrics())
    msgs = messages(size)

    async def conversation():
        conv = Conversation(holder)
        out = [r for m in msgs for r in await conv.handle(m)]
        conv.close()
        return out

    out = benchmark(lambda: run_without_loop(conversation()))
    holder.close()
    assert len(out) == 4 and out[1].request_body.response.clear_route_cache


@pytest.mark.parametrize("size", [1_000, 40_000])
@pytest.mark.benchmark(group="ext_proc: one whole conversation, in process")
def test_conversation_plain_python(benchmark, size):
    pools = [("short", 8192, 8192, None), ("long", 65536, 65536, None)]
    p = baseline.Processor(pools, {"short": SHORT, "long": LONG}, {"demo-key": "demo"})
    msgs = messages(size)
    out = benchmark(p.conversation, msgs)
    assert len(out) == 4 and out[1].request_body.response.clear_route_cache
