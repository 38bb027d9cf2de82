"""Prefill/decode disaggregation: what the split costs a pick.
``EndpointPicker.pick_pair`` on a pool of 16 endpoints (8 decode, 8 prefill)
beside ``pick`` on the same endpoints without roles, the default preset and
an 8,192-token prompt (512 blocks), as in bench_pick.py; and ``pick_pair``
(decider ``always``) beside its plain-Python twin
(``routecore._baselines.pd.SplitPicker``), which decides the same pairs
(``test_the_baseline_pairs_like_routecore``).

Run: .venv/bin/python -m pytest benches/bench_pd.py
"""

import numpy as np
import pytest

from benches.bench_pick import TOKENS, names, prompt, scraped, ties_first, warmed
from routecore import EndpointPicker
from routecore._baselines import pd as baseline

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


def split_picker(n=16):
    """routecore's split picker breaking ties to the first, as the twin does."""
    plugins = ties_first("prefix+queue+kv")
    return EndpointPicker(names(n), plugins=plugins, roles=ROLES, decider="always")


def pairs(pick_pair, rc: bool, n=16):
    """16 prompts sharing a 4,096-token system prompt paired, and the next one."""
    system = prompt(1, TOKENS // 2)
    for k in range(n):
        tokens = np.concatenate([system, prompt(100 + k, TOKENS // 2)])
        pick_pair(tokens, input_tokens=TOKENS, now=0.0) if rc else pick_pair(tokens)
    return np.concatenate([system, prompt(999, TOKENS // 2)])


@pytest.mark.benchmark(group="pick_pair always, routecore vs plain Python, 16 endpoints")
def test_pick_pair_always_routecore(benchmark):
    p = scraped(split_picker(), 16)
    tokens = pairs(p.pick_pair, True)
    decode, prefill = benchmark(p.pick_pair, tokens, input_tokens=TOKENS, now=0.0)
    assert (ROLES[decode], ROLES[prefill]) == ("decode", "prefill")


@pytest.mark.benchmark(group="pick_pair always, routecore vs plain Python, 16 endpoints")
def test_pick_pair_always_baseline(benchmark):
    p = scraped(baseline.SplitPicker(names(16), ROLES), 16)
    tokens = pairs(p.pick_pair, False)
    decode, prefill = benchmark(p.pick_pair, tokens)
    assert (ROLES[decode], ROLES[prefill]) == ("decode", "prefill")


def test_the_baseline_pairs_like_routecore():
    n = 16
    rc = scraped(split_picker(n), n)
    py = scraped(baseline.SplitPicker(names(n), ROLES), n)
    system = prompt(1, TOKENS // 2)
    for k in range(60):
        p = np.concatenate([system[: 256 * (k % 9)], prompt(k % 13, 1000)])
        assert rc.pick_pair(p, input_tokens=len(p), now=0.0) == py.pick_pair(p), k
        if k % 20 == 19:
            scraped(rc, n, k)
            scraped(py, n, k)
    assert rc.in_flight == [s["in_flight"] for s in py.states]
