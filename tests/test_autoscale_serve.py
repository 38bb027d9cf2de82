"""Autoscaling in ``routecore serve`` (issue 26, docs/autoscale.md "In
routecore serve"): the ``autoscale`` section checked, every ended request
observed, a sizing step every period published on the metrics port and
through the RouteCore API, and the HPA / KEDA examples."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from server_fixtures import Spawned, admission, base_config, tenants

from routecore import cli
from routecore._core import load
from routecore.config import ConfigError, parse_config
from routecore.server.gen import routecore_pb2 as rc
from routecore.server.gen import routecore_pb2_grpc as rc_grpc

ROOT = Path(__file__).resolve().parent.parent
KEY = [("x-api-key", "demo-key")]
PERIOD_S = 0.2
DELAY_S = 1.0


def autoscale(**pool) -> dict:
    """Pool ``short`` scaled within [1, 12] on a fast loop: a step every
    0.2 s over a 2 s window, down after 1 s."""
    return {
        "period_s": PERIOD_S,
        "window_s": 2.0,
        "sub_windows": 4,
        "scale_down_delay_s": DELAY_S,
        "pools": [
            {
                "name": "short",
                "min_endpoints": 1,
                "max_endpoints": 12,
                "slo_ttft_s": 2.0,
                "profile": "llama3_70b_a100",
                **pool,
            }
        ],
    }


def documented_gauges() -> dict[str, set[str]]:
    """The gauges docs/autoscale.md's table lists, with their labels."""
    rows = re.findall(
        r"^\| `(routecore_pool_\w+)` \| ([\w, ]+) \|",
        (ROOT / "docs/autoscale.md").read_text(),
        re.M,
    )
    return {name: set(labels.split(", ")) for name, labels in rows}


def config(**pool) -> dict:
    return base_config(autoscale=autoscale(**pool))


# -- the section ---------------------------------------------------------------


def test_the_section_reaches_the_data_plane_with_the_pools_context_and_promised_rate():
    raw = config(entitlements=["demo-std"])
    raw["admission"] = admission(tokens_per_s=5000.0)
    raw["tenants"] = tenants()
    cfg = parse_config(raw)
    spec = cfg.autoscale.spec()
    (pool,) = spec["config"]["pools"]
    assert pool["context"] == 8192 and "profile" not in pool
    assert spec["profiles"][0]["name"] == "llama3-70b-a100"
    assert spec["promised_tokens_per_s"] == [5000.0]
    assert parse_config(base_config()).autoscale is None, "off without the section"


def with_pool(key, value):
    raw = config()
    raw["autoscale"]["pools"][0][key] = value
    return raw


def with_top(**values):
    raw = config()
    raw["autoscale"].update(values)
    return raw


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (with_pool("min_endpoints", 13), "autoscale.pools[0].min_endpoints (13) is above max"),
        (with_top(period_s=0), "autoscale.period_s must be > 0, got 0"),
        (with_top(period_s=-1.0), "autoscale.period_s must be > 0"),
        (with_top(window_s=math.nan), "autoscale.window_s: expected a finite number, got nan"),
        (with_top(period_s="10s"), "autoscale.period_s: expected a finite number"),
        (with_pool("slo_ttft_s", -0.5), "autoscale.pools[0].slo_ttft_s must be > 0"),
        (with_pool("slo_tpot_s", math.inf), "autoscale.pools[0].slo_tpot_s: expected a finite"),
        (with_pool("max_endpoints", 0), "autoscale.pools[0].max_endpoints must be in [1,"),
        (with_pool("max_endpoints", 3.5), "autoscale.pools[0].max_endpoints: expected an integer"),
        (with_pool("name", "nope"), "autoscale.pools[0].name: expected one of"),
        (with_pool("profile", "h100"), "autoscale.pools[0].profile: expected one of"),
        (with_pool("profile", {"preset": "llama3_70b_a100", "w_s": -1}), "pools[0].profile"),
        (with_pool("entitlements", ["gold"]), "'gold' is not an admission entitlement"),
        (with_pool("colour", 1), "autoscale.pools[0].colour: unknown key"),
        (with_top(pools=[]), "autoscale.pools: name at least one pool"),
        (with_top(tempo=1), "autoscale.tempo: unknown key"),
        (with_top(max_step_up=0, max_step_up_percent=0), "autoscale.max_step_up"),
    ],
)
def test_a_bad_section_names_the_key(raw, message):
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert message in str(e.value)


def test_serve_refuses_a_bad_section_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(with_pool("min_endpoints", 13)))
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("routecore serve: error:") and "min_endpoints (13)" in err


# -- end to end ------------------------------------------------------------------


def series(text: str) -> dict[tuple[str, frozenset], float]:
    """The metric lines of an exposition text by (name, labels)."""
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m[2]))
            out[(m[1], labels)] = float(m[3])
    return out


def pools(s: Spawned) -> list:
    with grpc.insecure_channel(s.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)
        return list(stub.Autoscale(rc.AutoscaleRequest(), metadata=KEY).pools)


def wait_for(s: Spawned, pred, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pools(s)
        if got and pred(got[0]):
            return got[0]
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout} s: {got}")


@pytest.fixture
def spawned(tmp_path):
    started = []

    def start(raw: dict) -> Spawned:
        s = Spawned(tmp_path / "autoscale.yaml", raw, "--log-level", "info")
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def test_the_desired_count_follows_the_load_up_then_down_after_the_delay(spawned):
    s = spawned(config())
    # No traffic: min endpoints, from the first step at start.
    p = wait_for(s, lambda p: p.reason == "no-traffic")
    assert (p.desired_endpoints, p.model_endpoints) == (1, 0)
    report = {}

    def run():
        report.update(load(s.target, requests=10**9, concurrency=16, rate=150.0, duration_s=3.0))

    loader = threading.Thread(target=run)
    loader.start()
    # (asked at, answered by, desired, target) until back at min after the load.
    timeline: list[tuple[float, float, int, int]] = []
    peak, text = None, ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        asked = time.monotonic()
        p = pools(s)[0]
        timeline.append((asked, time.monotonic(), p.desired_endpoints, p.target_endpoints))
        if peak is None and p.desired_endpoints > 1:
            peak, text = p, s_metrics(s)
        if peak and not loader.is_alive() and p.reason == "no-traffic" and p.desired_endpoints == 1:
            break
        time.sleep(0.05)
    loader.join()
    assert report["errors"] == 0 and report["requests"] > 100
    assert peak is not None, timeline
    assert timeline[-1][2] == 1, timeline
    # The load client's usage: 300 prompt and 50 completion tokens a request,
    # each percentile at most 3.125 % above the exact one.
    assert 300 <= peak.prompt_tokens_p50 <= 300 * 1.03125
    assert 50 <= peak.output_tokens_p99 <= 50 * 1.03125
    assert peak.observed_rate > 0 and peak.reason in ("model", "max")
    metrics = series(text)
    shown = {name: {k for k, _ in labels} for name, labels in metrics if "_pool_" in name}
    assert shown == documented_gauges() and len(shown) == 8
    assert metrics[("routecore_pool_desired_endpoints", frozenset({("pool", "short")}))] > 1
    # Every fall came at least the scale-down delay after the run of lower
    # targets that allowed it began: that run's first step ran after the
    # last sample without it was asked for; the fall was answered before
    # its own sample came back.
    falls = [i for i in range(1, len(timeline)) if timeline[i][2] < timeline[i - 1][2]]
    assert falls, timeline
    for i in falls:
        j = i - 1
        while timeline[j][3] < timeline[j][2]:
            j -= 1
        assert timeline[i][1] - timeline[j][0] >= DELAY_S, (i, j, timeline)


def s_metrics(s: Spawned) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics") as r:
        return r.read().decode()


def test_an_slo_no_fleet_meets_says_max_and_warns_once_naming_the_binding(spawned):
    s = spawned(config(slo_ttft_s=1e-6, max_endpoints=5))
    report = load(s.target, requests=200, concurrency=8)
    assert report["errors"] == 0
    p = wait_for(s, lambda p: p.reason == "slo-unreachable" and p.desired_endpoints == 5)
    assert p.target_endpoints == 5 and p.binding != "none"
    # More steps, same state: still one warning.
    time.sleep(4 * PERIOD_S)
    assert pools(s)[0].reason == "slo-unreachable"
    text = s.stop()
    warnings = [line for line in text.splitlines() if '"autoscale-at-max"' in line]
    assert len(warnings) == 1, warnings
    assert f'"binding":"{p.binding}"' in warnings[0] and '"pool":"short"' in warnings[0]


def test_autoscale_is_refused_over_the_api_when_off(spawned):
    s = spawned(base_config())
    with pytest.raises(grpc.RpcError) as e:
        pools(s)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "routecore_pool_desired_endpoints{" not in s_metrics(s)
    with grpc.insecure_channel(s.api_target) as channel:
        with pytest.raises(grpc.RpcError) as e:
            rc_grpc.RouteCoreStub(channel).Autoscale(rc.AutoscaleRequest())
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- the Kubernetes examples -------------------------------------------------------


def yaml_blocks(path: Path) -> list:
    text = path.read_text()
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def test_the_hpa_and_keda_examples_parse_and_read_the_documented_gauge():
    docs = {d.get("kind"): d for d in yaml_blocks(ROOT / "docs/autoscale.md") if "kind" in d}
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "routecore_pool_desired_endpoints"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    keda = docs["ScaledObject"]
    assert keda["apiVersion"] == "keda.sh/v1alpha1"
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    assert "routecore_pool_desired_endpoints{" in trigger["metadata"]["query"]
    # The section the docs show is a valid one.
    blocks = yaml_blocks(ROOT / "docs/autoscale.md")
    (section,) = [d["autoscale"] for d in blocks if "autoscale" in d]
    raw = base_config(autoscale=section)
    raw["admission"] = admission()
    raw["admission"]["entitlements"][0]["name"] = "team-a-std"
    raw["tenants"] = tenants()
    raw["tenants"][0]["entitlement"] = "team-a-std"
    assert parse_config(raw).autoscale.config["pools"][0]["max_endpoints"] == 40


def test_requests_waiting_in_flow_control_are_the_sizings_queued_demand(serve):
    # Flow control's example (test_flow_serve): two requests placed fill the
    # short pool; three more wait in its queue.
    from test_flow_serve import GOLD, flow_config, placed, queued, run

    server = serve(**flow_config(), autoscale=autoscale())
    plane = server.server.plane

    async def go():
        async with grpc.aio.insecure_channel(server.target) as ch:
            full = await placed(ch, 2)
            waiting = [await queued(server, ch, GOLD) for _ in range(3)]
            deadline = time.monotonic() + 10
            while (p := plane.autoscale()[0])["queued_rate"] != 3 / PERIOD_S:
                assert time.monotonic() < deadline, p
                await asyncio.sleep(0.05)
            assert p["rate"] >= p["queued_rate"]
            for s in full:
                await s.finish()
            for s in waiting:
                await s.read()
                await s.finish()

    run(go())


def test_the_example_configs_autoscale_section_is_served():
    """examples/routecore.yaml's ``autoscale`` section: parsed, and the data
    plane started from it publishes its first step (no traffic: the pool's
    minimum) under the documented gauge."""
    from routecore import DataPlane
    from routecore.config import load_config

    cfg = load_config(ROOT / "examples/routecore.yaml")
    assert cfg.autoscale is not None
    (pool,) = cfg.autoscale.spec()["config"]["pools"]
    assert (pool["name"], pool["context"], pool["max_endpoints"]) == ("short", 8192, 40)
    assert cfg.autoscale.profiles[0].name == "llama3-70b-a100"
    plane = DataPlane.start(cfg.spec_json(), port=0, metrics_port=0)
    try:
        deadline = time.monotonic() + 20
        while not plane.autoscale() and time.monotonic() < deadline:
            time.sleep(0.05)
        (step,) = plane.autoscale()
        assert (step["pool"], step["endpoints"], step["reason"]) == ("short", 1, "no-traffic")
        text = plane.metrics_text()
        assert 'routecore_pool_desired_endpoints{pool="short"} 1.0' in text.splitlines()
    finally:
        plane.drain(0.0)
