"""Prefill/decode disaggregation: what the split costs a pick.
``EndpointPicker.pick_pair`` on a pool of 16 endpoints (8 decode, 8 prefill)
beside ``pick`` on the same endpoints without roles, the default preset and
an 8,192-token prompt (512 blocks), as in bench_pick.py. No plain-Python
twin: the figure is the second phase's cost over routecore's own pick.

Run: .venv/bin/python -m pytest benches/bench_pd.py
"""

import pytest

from benches.bench_pick import names, warmed
from routecore import EndpointPicker

ROLES = {e: ("decode" if i % 2 == 0 else "prefill") for i, e in enumerate(names(16))}


@pytest.mark.benchmark(group="pick_pair, prefix+queue+kv, 16 endpoints, 512-block prompt")
def test_pick_without_roles(benchmark):
    p, tokens = warmed(EndpointPicker(names(16)), 16)
    assert benchmark(p.pick, tokens, input_tokens=8192, now=0.0) in names(16)


@pytest.mark.parametrize(("decider", "threshold"), [("always", None), ("uncached-tokens", 512)])
@pytest.mark.benchmark(group="pick_pair, prefix+queue+kv, 16 endpoints, 512-block prompt")
def test_pick_pair(benchmark, decider, threshold):
    picker = EndpointPicker(names(16), roles=ROLES, decider=decider, threshold=threshold)
    p, tokens = warmed(picker, 16)
    decode, _ = benchmark(p.pick_pair, tokens, input_tokens=8192, now=0.0)
    assert ROLES[decode] == "decode"
