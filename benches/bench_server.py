"""One whole ext_proc conversation over loopback gRPC, the same synchronous
grpcio client for both: routecore's Rust data plane (``routecore.DataPlane``)
beside a plain-Python processor served by grpcio (``routecore/_baselines/server.py``).
The client's own cost is in both figures; the load client of
``routecore client --load`` measures the server alone.

Run: .venv/bin/python -m pytest benches/bench_server.py
"""

import pytest

pytest.importorskip("grpc")

from routecore._baselines.cases import (  # noqa: E402
    conversation_client,
    python_processor,
    routecore_processor,
)


def run_conversations(benchmark, target, size):
    with conversation_client(target, size) as call:
        out = benchmark(call)
    assert len(out) == 4 and out[1].request_body.response.clear_route_cache


@pytest.mark.parametrize("size", [1_000, 40_000])
@pytest.mark.benchmark(group="ext_proc: one whole conversation over loopback gRPC")
def test_conversation_routecore(benchmark, size):
    with routecore_processor() as target:
        run_conversations(benchmark, target, size)


@pytest.mark.parametrize("size", [1_000, 40_000])
@pytest.mark.benchmark(group="ext_proc: one whole conversation over loopback gRPC")
def test_conversation_routecore_autoscaled(benchmark, size):
    """With an ``autoscale`` section: each conversation's end observed into
    its pool's live window (issue 26)."""
    with routecore_processor(autoscale=True) as target:
        run_conversations(benchmark, target, size)


@pytest.mark.parametrize("size", [1_000, 40_000])
@pytest.mark.benchmark(group="ext_proc: one whole conversation over loopback gRPC")
def test_conversation_plain_python(benchmark, size):
    with python_processor() as target:
        run_conversations(benchmark, target, size)
