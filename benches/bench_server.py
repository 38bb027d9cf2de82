"""One whole ext_proc conversation over loopback gRPC, the same synchronous
grpcio client for both: routecore's Rust data plane (``routecore.DataPlane``)
beside a plain-Python processor served by grpcio (``baselines/server.py``).
The client's own cost is in both figures; the load client of
``routecore client --load`` measures the server alone.

Run: .venv/bin/python -m pytest benches/bench_server.py
"""

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from benches.baselines import server as baseline
from routecore import DataPlane
from routecore.config import parse_config
from routecore.server.envoy_client import chat_body, http_headers, usage_body

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


def run_conversations(benchmark, target, size):
    msgs = messages(size)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        out = benchmark(lambda: list(stub.Process(iter(msgs))))
    assert len(out) == 4 and out[1].request_body.response.clear_route_cache


@pytest.mark.parametrize("size", [1_000, 40_000])
@pytest.mark.benchmark(group="ext_proc: one whole conversation over loopback gRPC")
def test_conversation_routecore(benchmark, size):
    plane = DataPlane.start(parse_config(CONFIG).spec_json(), worker_threads=1)
    try:
        run_conversations(benchmark, f"127.0.0.1:{plane.port}", size)
    finally:
        plane.drain(0)


@pytest.mark.parametrize("size", [1_000, 40_000])
@pytest.mark.benchmark(group="ext_proc: one whole conversation over loopback gRPC")
def test_conversation_plain_python(benchmark, size):
    pools = [("short", 8192, 8192, None), ("long", 65536, 65536, None)]
    p = baseline.Processor(pools, {"short": SHORT, "long": LONG}, {"demo-key": "demo"})
    server, port = baseline.serve(p)
    try:
        run_conversations(benchmark, f"127.0.0.1:{port}", size)
    finally:
        server.stop(0)
