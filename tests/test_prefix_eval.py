"""The prefix-eval workload generator and LRU cache model, and its command."""

import numpy as np
import pytest

from routecore.cli import main
from routecore.prefix_eval import evaluate, generate_workload


@pytest.fixture(scope="module")
def workload():
    return generate_workload(requests=400, apps=4, users=40, concurrency=16, seed=3)


def test_workload_is_seeded_and_has_prefix_structure(workload):
    again = generate_workload(requests=400, apps=4, users=40, concurrency=16, seed=3)
    assert np.array_equal(workload.tokens, again.tokens)
    other = generate_workload(requests=400, apps=4, users=40, concurrency=16, seed=4)
    assert not np.array_equal(workload.tokens[:100], other.tokens[:100])
    assert np.all(np.diff(workload.arrival_s) > 0)
    # Each turn's prompt extends the previous turn's prompt and reply.
    extended = 0
    for conv in np.unique(workload.conversation):
        turns = np.flatnonzero(workload.conversation == conv)
        for a, b in zip(turns, turns[1:]):
            prev = workload.tokens[workload.offsets[a] : workload.offsets[a + 1]]
            nxt = workload.prompt(b)
            assert len(nxt) > len(prev) and np.array_equal(nxt[: len(prev)], prev)
            extended += 1
    assert extended > 100
    # Requests of one app share its system prompt (at least 512 tokens).
    for app in range(4):
        first = [workload.prompt(i)[:512] for i in np.flatnonzero(workload.app == app)[:5]]
        assert all(np.array_equal(first[0], p) for p in first)


def test_prefix_routing_raises_the_hit_rate(workload):
    results = {
        p: evaluate(workload, p, pods=4, cache_blocks=2048)
        for p in ("prefix-cache", "least-request", "random", "consistent-hash")
    }
    assert results["prefix-cache"].hit_rate > results["least-request"].hit_rate + 0.1
    assert results["prefix-cache"].hit_rate > results["random"].hit_rate + 0.1
    for r in results.values():
        assert 0.0 <= r.hit_rate <= 1.0 and r.load_max_over_mean >= 1.0
    # Least-request balances load best, by construction.
    assert results["least-request"].load_max_over_mean == min(
        r.load_max_over_mean for r in results.values()
    )


def test_bad_settings_are_refused(workload):
    with pytest.raises(ValueError):
        generate_workload(requests=0)
    with pytest.raises(ValueError):
        generate_workload(turns=(3, 2))
    with pytest.raises(ValueError):
        evaluate(workload, "round-robin")
    with pytest.raises(ValueError):
        evaluate(workload, "random", pods=0)


def test_command_prints_the_table(capsys):
    assert main(["prefix-eval", "--requests", "200", "--pods", "4", "--users", "30"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| policy | prefix hit rate |")
    for policy in ("prefix-cache", "least-request", "random", "consistent-hash"):
        assert f"| {policy} |" in out
    assert main(["prefix-eval", "--requests", "0"]) == 2
