"""A bounded load test: ext_proc conversations driven as Envoy would, against
``routecore serve`` in its own process. Speed is reported, never asserted;
the full 20,000-request run is recorded in benches/RESULTS.md."""

from __future__ import annotations

import pytest
from server_fixtures import example_without_engines

from routecore.server.envoy_client import load_report


@pytest.mark.slow
def test_load_every_conversation_is_routed(tmp_path):
    report = load_report(
        str(example_without_engines(tmp_path)), requests=3000, concurrency=32, rate=500.0
    )
    for name, run in report.items():
        print(name, {k: round(v, 3) for k, v in run.items()})
        assert run["errors"] == 0, name
        assert run["requests"] == 3000
        assert 0 < run["p50_ms"] <= run["p99_ms"]
        assert run["server_cpu_ms_per_request"] > 0
