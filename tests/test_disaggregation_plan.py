"""Prefill/decode disaggregation in the planner and the simulator (issue 25,
planning): ``plan_disaggregated``, ``simulate_disaggregated`` and the
``--disaggregated`` modes of ``routecore plan`` and ``routecore simulate``."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import (
    Profile,
    SimPool,
    Workload,
    plan,
    plan_disaggregated,
    simulate_disaggregated,
)
from routecore.cli import main

PROFILE = Profile.llama3_70b_a100()
LONG_PROMPTS = Workload([8000, 12000] * 10, [300, 200] * 10)
MIXED = Workload([200, 1500, 3000, 6000, 800] * 20, [300, 150, 40, 20, 600] * 20)


def strict_json(text):
    """json.loads refusing NaN and Infinity, as any parser but Python's does."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_the_plan_names_its_pools_and_the_cheaper_fleet():
    d = plan_disaggregated(LONG_PROMPTS, 50.0, 1.0, slo_tpot_s=0.1, context=16384)
    assert d.gpus == d.n_prefill + d.n_decode
    assert (d.binding_prefill, d.binding_decode, d.binding_aggregated) == (
        "prefill",
        "slot",
        "prefill",
    )
    assert d.choice == "disaggregated" and d.gpus < d.n_aggregated
    # The aggregated pool is the engine model's homogeneous fleet.
    homo = plan(LONG_PROMPTS, 50.0, 1.0, slo_tpot_s=0.1, long_context=16384, b_short=[4096])
    assert d.n_aggregated == homo.homogeneous.gpus
    # The TTFT bound holds the transfer of the P99.5 prompt (12,000 tokens in
    # 24 chunks of 512): 2 ms + 40 KiB x 12,288 / 25 GB/s.
    assert d.transfer_q_s == pytest.approx(0.002 + 40960 * 12288 / 25e9, rel=1e-12)
    assert d.p99_ttft_prefill_s <= 1.0
    # At a trickle one aggregated GPU beats a prefill and a decode GPU.
    low = plan_disaggregated(MIXED, 0.5, 2.0, slo_tpot_s=0.08, context=16384)
    assert (low.n_aggregated, low.gpus, low.choice) == (1, 2, "aggregated")
    assert set(d.as_dict()) >= {"n_prefill", "n_decode", "choice", "binding_decode"}


@settings(max_examples=30, deadline=None)
@given(
    rate=st.floats(1.0, 3000.0),
    factor=st.floats(1.05, 4.0),
    bandwidth=st.floats(1e9, 1e11),
)
def test_more_traffic_never_needs_fewer_gpus_and_a_faster_link_never_more(rate, factor, bandwidth):
    def at(r, bw):
        return plan_disaggregated(
            MIXED, r, 1.5, slo_tpot_s=0.06, context=16384, bandwidth_bytes_s=bw
        )

    a, b = at(rate, bandwidth), at(rate * factor, bandwidth)
    assert (b.n_prefill, b.n_decode, b.n_aggregated) >= (a.n_prefill, a.n_decode, a.n_aggregated)
    assert b.n_prefill >= a.n_prefill and b.n_decode >= a.n_decode
    fast = at(rate, bandwidth * 4)
    assert fast.n_prefill <= a.n_prefill and fast.n_decode == a.n_decode


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bandwidth_bytes_s": 0.0}, "bandwidth_bytes_s"),
        ({"bandwidth_bytes_s": -1e9}, "bandwidth_bytes_s"),
        ({"bandwidth_bytes_s": math.nan}, "bandwidth_bytes_s"),
        ({"latency_s": math.nan}, "latency_s"),
        ({"bytes_per_token": -1.0}, "bytes_per_token"),
        ({"quantile": 1.0}, "quantile"),
        ({"context": 4096}, "exceeds the context"),
    ],
)
def test_bad_plans_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_disaggregated(MIXED, 10.0, 1.0, slo_tpot_s=0.08, **kwargs)
    with pytest.raises(ValueError, match="arrival_rate"):
        plan_disaggregated(MIXED, math.nan, 1.0)


def pool(name, n):
    return SimPool(name, n, 8192, 16)


def test_one_request_by_hand():
    """3 prefill iterations of W + H, the transfer, then 10 decode iterations."""
    t = 0.008 + 0.00065
    r = simulate_disaggregated(
        [0.0], [1200], [10], pool("decode", 1), pool("prefill", 1), bytes_per_token=40960.0,
        bandwidth_bytes_s=25e9, latency_s=0.002, warmup=0.0,
    )  # fmt: skip
    transfer = 0.002 + 40960 * 1200 / 25e9
    assert r.ttft[0] == pytest.approx(4 * t + transfer, rel=1e-12)
    assert r.e2e[0] == pytest.approx(13 * t + transfer, rel=1e-12)
    assert bool(r.disaggregated[0]) and [p["name"] for p in r.pools] == ["prefill", "decode"]


def test_the_conditional_decider_splits_long_prompts_only():
    inputs = np.array([3000, 300] * 50)
    arrival = np.arange(100) * 0.05
    r = simulate_disaggregated(
        arrival, inputs, np.full(100, 20), pool("decode", 2), pool("prefill", 1),
        decider="conditional", threshold=1000, warmup=0.0,
    )  # fmt: skip
    assert (r.disaggregated == (inputs > 1000)).all()
    assert np.isfinite(r.e2e).all()
    assert r.pools[0]["requests"] == 50 and r.pools[1]["requests"] == 100


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill": None}, "needs a prefill pool"),
        ({"bandwidth_bytes_s": 0.0}, "bandwidth_bytes_s"),
        ({"decider": "sometimes"}, "decider"),
    ],
)
def test_bad_fleets_are_refused(kwargs, message):
    args = {"prefill": pool("prefill", 1), "warmup": 0.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        simulate_disaggregated([0.0], [100], [10], pool("decode", 1), **args)
    with pytest.raises(ValueError, match="output_tokens"):
        simulate_disaggregated([0.0], [100], [0], pool("decode", 1), pool("prefill", 1))


def test_plan_cli_json_is_strict(capsys):
    args = ["plan", "--disaggregated", "--rate", "200", "--slo-ttft", "1", "--json"]
    assert main(args) == 0
    out = strict_json(capsys.readouterr().out)
    d = plan_disaggregated(Workload.azure_2023(), 200.0, 1.0, slo_tpot_s=0.08)
    assert out["plan"] == strict_json(json.dumps(d.as_dict()))
    assert out["transfer"]["bandwidth_bytes_s"] == 25e9
    assert out["verdict"].startswith(d.choice)


def test_plan_cli_table_names_the_binding_resources(capsys):
    assert main(["plan", "--disaggregated", "--rate", "200", "--kv-bandwidth", "50"]) == 0
    lines = capsys.readouterr().out.splitlines()
    d = plan_disaggregated(
        Workload.azure_2023(), 200.0, 2.0, slo_tpot_s=0.08, bandwidth_bytes_s=50e9
    )
    assert "KV link 50 GB/s" in lines[0]
    prefill, decode = lines[3].split(), lines[4].split()
    assert prefill[:3] == ["prefill", str(d.n_prefill), d.binding_prefill]
    assert decode[:3] == ["decode", str(d.n_decode), d.binding_decode]


@pytest.mark.parametrize(
    "flag",
    [["--kv-bandwidth", "0"], ["--kv-bandwidth", "-5"], ["--kv-bandwidth", "nan"],
     ["--kv-latency", "-1"], ["--kv-latency", "inf"], ["--kv-bytes-per-token", "-1"]],
)  # fmt: skip
def test_plan_cli_refuses_bad_links(flag, capsys):
    assert main(["plan", "--disaggregated", *flag]) == 2
    err = capsys.readouterr().err
    assert flag[0] in err and "expected a finite number" in err


def test_simulate_cli_refuses_a_split_with_no_prefill_endpoint(capsys):
    args = ["simulate", "--disaggregated", "--prefill-gpus", "0", "--decider", "always",
            "--rate", "20", "--duration", "2", "--no-verify", "--quiet"]  # fmt: skip
    assert main(args) == 2
    assert "needs a prefill pool" in capsys.readouterr().err


def planner_against_simulation(capsys, trace, rate, duration, decider="always"):
    """``simulate --disaggregated`` with verification: per pool, planned
    against the smallest count the simulator accepts."""
    args = ["simulate", "--disaggregated", "--trace", trace, "--rate", str(rate),
            "--duration", str(duration), "--slo-ttft", "1", "--decider", decider,
            "--fleet", "homogeneous", "--quiet", "--json"]  # fmt: skip
    assert main(args) == 0
    out = strict_json(capsys.readouterr().out)
    (fleet,) = out["fleets"]
    assert fleet["slo_attainment"] >= 0.99
    return [(p["name"], p["gpus_planned"], p["gpus"]) for p in fleet["pools"]]


def test_the_planned_pd_fleet_is_the_simulated_minimum(capsys):
    """A reduced check of the planner against the simulator (Azure code, 100
    req/s, 30 s): each pool's planned GPUs within 5 % (or one GPU) of the
    smallest count meeting the SLO for 99 % of the requests."""
    for name, planned, verified in planner_against_simulation(capsys, "azure-code", 100, 30):
        assert abs(planned - verified) <= max(1, 0.05 * verified), (name, planned, verified)


@pytest.mark.slow
@pytest.mark.parametrize("trace", ["azure-code", "azure-conversation"])
def test_the_planned_pd_fleet_is_the_simulated_minimum_at_scale(capsys, trace):
    """The same at 1,000 req/s over 120 s (docs/planner.md's table)."""
    for name, planned, verified in planner_against_simulation(capsys, trace, 1000, 120):
        assert abs(planned - verified) <= max(1, 0.05 * verified), (name, planned, verified)


def test_the_defaults_agree():
    """One link default for the planner, the simulator and the command line."""
    from inspect import signature

    from routecore import disaggregation

    for f in (plan_disaggregated, simulate_disaggregated):
        params = signature(f).parameters
        assert params["bandwidth_bytes_s"].default == disaggregation.DEFAULT_BANDWIDTH_GBS * 1e9
        assert params["latency_s"].default == disaggregation.DEFAULT_LATENCY_S


def test_plan_cli_marks_pools_that_miss_the_slo(capsys):
    """A TTFT no fleet meets: every pool is marked, and the verdict says so."""
    assert main(["plan", "--disaggregated", "--slo-ttft", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.endswith("(misses the SLO)") for line in lines[3:6])
    assert lines[-1] == "neither fleet meets the SLO"
    assert main(["plan", "--disaggregated", "--rate", "200"]) == 0
    assert "misses" not in capsys.readouterr().out
