"""Fleet simulator: routecore beside the plain-Python discrete-event simulator
of the same model (routecore/_baselines/sim.py), same trace slice, same run; and
the default ``routecore simulate`` and ``routecore pick-eval`` end to end.

The twin runs twice: stepping every engine iteration (as the papers'
simulators do) and with ``fast_forward`` (routecore's algorithm: runs of
identical decode iterations as one stretch). routecore against the second is
the language; the first against the second is the algorithm.

Run: .venv/bin/python -m pytest benches/bench_sim.py
"""

import numpy as np
import pytest

from routecore import SimPool, Workload, simulate
from routecore._baselines import sim as baseline
from routecore.cli import main
from routecore.commands.simulate import trace_arrays

N = 5_000
RATE = 100.0  # requests/s on 22 endpoints of 16 slots at 64K (~0.8 of capacity)
ENDPOINTS, SLOTS, CONTEXT = 22, 16, 65536


def azure_slice():
    t = trace_arrays(Workload.azure_2023(), N)
    span = t.arrival_s[-1] - t.arrival_s[0]
    # The trace's timestamps scaled to RATE, as simulate(rate=...) does.
    arrival = (t.arrival_s - t.arrival_s[0]) * ((N - 1) / span / RATE)
    return arrival, t.input_tokens, t.output_tokens


def twin_args():
    arrival, inp, out = azure_slice()
    return (arrival.tolist(), inp.tolist(), out.tolist(), ENDPOINTS, SLOTS, CONTEXT)


def routecore_report():
    arrival, inp, out = azure_slice()
    pools = [SimPool("homogeneous", ENDPOINTS, CONTEXT, SLOTS)]
    return simulate(arrival, inp, out, pools, router="homogeneous", warmup=0.0)


@pytest.mark.parametrize("fast_forward", [False, True])
def test_the_twin_gives_routecores_latencies(fast_forward):
    """The same model: the plain-Python simulator, stepping or stretching,
    gives routecore's latency for every request."""
    rep = routecore_report()
    ttft, e2e = baseline.simulate(*twin_args(), fast_forward=fast_forward)
    np.testing.assert_allclose(rep.e2e, e2e, rtol=0, atol=1e-6)
    np.testing.assert_allclose(rep.ttft, ttft, rtol=0, atol=1e-6)


GROUP = "simulate: 5,000 Azure requests, one pool of 22"


@pytest.mark.benchmark(group=GROUP)
def test_simulate_routecore(benchmark):
    arrival, inp, out = azure_slice()
    pools = [SimPool("homogeneous", ENDPOINTS, CONTEXT, SLOTS)]
    rep = benchmark(simulate, arrival, inp, out, pools, router="homogeneous", warmup=0.0)
    assert np.isfinite(rep.e2e).all()


@pytest.mark.benchmark(group=GROUP)
@pytest.mark.parametrize("fast_forward", [False, True], ids=["stepping", "fast-forward"])
def test_simulate_plain_python(benchmark, fast_forward):
    kwargs = {"fast_forward": fast_forward}
    ttft, e2e = benchmark.pedantic(baseline.simulate, twin_args(), kwargs, rounds=3, iterations=1)
    assert np.isfinite(e2e).all()


@pytest.mark.benchmark(group="routecore simulate (default: 3 fleets, 120,000 requests each)")
def test_simulate_command_default(benchmark, capsys):
    code = benchmark.pedantic(main, (["simulate", "--quiet"],), rounds=3, iterations=1)
    assert code == 0
    assert "fleetopt" in capsys.readouterr().out


@pytest.mark.benchmark(group="routecore pick-eval (default: 7 policies, 4,000 requests)")
def test_pick_eval_command_default(benchmark, capsys):
    code = benchmark.pedantic(main, (["pick-eval", "--quiet"],), rounds=3, iterations=1)
    assert code == 0
    assert "| precise-prefix+queue+kv |" in capsys.readouterr().out
