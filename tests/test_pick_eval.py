"""The shared-prefix workload, the simulator's per-endpoint prefix caches, and
``routecore pick-eval`` comparing endpoint-picker policies on them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import routecore as rc
from routecore.cli import main
from routecore.commands.pick_eval import POLICIES

SMALL = dict(requests=300, sessions=16, system_tokens=(64, 256))


def session_starts(w: rc.PrefixWorkload) -> dict[int, int]:
    """The first request of every session."""
    first: dict[int, int] = {}
    for i, s in enumerate(w.session.tolist()):
        first.setdefault(s, i)
    return first


def test_prefix_workload_same_seed_same_workload():
    a, b, c = (rc.PrefixWorkload(**SMALL, seed=s) for s in (7, 7, 8))
    for name in ("arrival_s", "input_tokens", "output_tokens", "session", "block_hashes"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.block_hashes, c.block_hashes)
    assert len(a) == 300 and np.all(np.diff(a.arrival_s) > 0)
    hashes, offsets = a.blocks
    assert offsets[0] == 0 and offsets[-1] == len(hashes)
    # Every request carries the hashes of its prompt's and reply's full blocks.
    np.testing.assert_array_equal(np.diff(offsets), (a.input_tokens + a.output_tokens) // 16)


@pytest.mark.parametrize("shared", [0.0, 0.5, 1.0])
def test_prefix_workload_shares_system_prompts_as_configured(shared):
    w = rc.PrefixWorkload(**SMALL, shared_fraction=shared, system_prompts=4, seed=2)
    starts = session_starts(w)
    system = w.system_prompt[list(starts.values())]
    share = float(np.mean(system >= 0))
    assert abs(share - shared) <= (0.15 if 0 < shared < 1 else 0.0), share
    first_block = {s: int(w.block_hashes[w.block_offsets[i]]) for s, i in starts.items()}
    # Sessions of one shared prompt start alike; a private prompt like no other.
    by_block: dict[int, set[int]] = {}
    for s, i in starts.items():
        key = int(w.system_prompt[i]) if w.system_prompt[i] >= 0 else -1 - s
        by_block.setdefault(first_block[s], set()).add(key)
    assert all(len(keys) == 1 for keys in by_block.values())
    assert len(by_block) == len({k for keys in by_block.values() for k in keys})


def test_prefix_workload_turns_extend_the_context():
    w = rc.PrefixWorkload(**SMALL, seed=3)
    last: dict[int, int] = {}
    for i, s in enumerate(w.session.tolist()):
        if s in last:
            p = last[s]
            prev = w.block_hashes[w.block_offsets[p] : w.block_offsets[p + 1]]
            cur = w.block_hashes[w.block_offsets[i] : w.block_offsets[i] + len(prev)]
            np.testing.assert_array_equal(cur, prev)
            assert w.turn[i] == w.turn[p] + 1
        last[s] = i


def test_prefix_workload_block_tokens_hash_to_its_block_hashes():
    w = rc.PrefixWorkload(**SMALL, seed=4)
    tokens = w.block_tokens
    assert tokens.dtype == np.uint32 and tokens.size == 16 * w.block_hashes.size
    for i in (0, 17, len(w) - 1):
        lo, hi = w.block_offsets[i], w.block_offsets[i + 1]
        ids = tokens[16 * lo : 16 * hi]
        np.testing.assert_array_equal(rc.block_hashes(ids, 16), w.block_hashes[lo:hi])


@pytest.mark.parametrize(
    "bad",
    [
        dict(requests=0),
        dict(rate=0.0),
        dict(shared_fraction=-0.1),
        dict(turns=(3, 1)),
        dict(user_tokens=(0, 5)),
        dict(sessions=-1),
    ],
)
def test_prefix_workload_refuses_bad_settings(bad):
    with pytest.raises(ValueError):
        rc.PrefixWorkload(**(SMALL | bad))


def test_a_repeated_prompt_hits_the_endpoint_prefix_cache():
    # 1500 tokens, then the same again after it finished: 93 full blocks hit
    # (1488 tokens), 12 tokens are prefilled in one iteration instead of three.
    hashes = np.concatenate([np.arange(93), np.arange(93)]).astype(np.uint64)
    pools = [rc.SimPool("p", 1, 8192, 16)]
    r = rc.simulate(
        [0.0, 1.0], [1500, 1500], [1, 1], pools, router="homogeneous", warmup=0.0,
        blocks=(hashes, np.array([0, 93, 186])),
    )  # fmt: skip
    assert r.cached_tokens.tolist() == [0, 1488]
    assert r.ttft[1] == pytest.approx(r.ttft[0] / 3)
    assert r.endpoint.tolist() == [0, 0]
    with pytest.raises(ValueError, match="offsets"):
        rc.simulate([0.0], [10], [1], pools, blocks=(hashes, np.array([0, 5])))
    with pytest.raises(TypeError):
        rc.simulate([0.0], [10], [1], pools, blocks=(hashes.astype(np.int64), np.array([0, 186])))


def simulate_prefix(w: rc.PrefixWorkload, dispatch: str, **kw) -> rc.SimReport:
    pool = rc.SimPool("p", 3, 16384, 16, kv_blocks=1024)
    return rc.simulate(
        w.arrival_s, w.input_tokens, w.output_tokens, [pool], router="homogeneous",
        dispatch=dispatch, blocks=w.blocks, **kw,
    )  # fmt: skip


def test_precise_prefix_without_block_tokens_picks_as_the_approximate_prefix():
    # No token ids: the precise scorer's approximate fallback scores alone.
    w = rc.PrefixWorkload(**SMALL, seed=5)
    approx = simulate_prefix(w, "prefix+queue+kv")
    precise = simulate_prefix(w, "precise-prefix+queue+kv")
    np.testing.assert_array_equal(precise.endpoint, approx.endpoint)
    np.testing.assert_array_equal(precise.cached_tokens, approx.cached_tokens)
    # With them, the engines' events decide.
    with_ids = simulate_prefix(w, "precise-prefix+queue+kv", block_tokens=w.block_tokens)
    assert not np.array_equal(with_ids.endpoint, approx.endpoint)


def test_block_tokens_must_match_the_blocks():
    w = rc.PrefixWorkload(**SMALL, seed=6)
    with pytest.raises(ValueError, match="16 token ids per block hash"):
        simulate_prefix(w, "precise-prefix", block_tokens=w.block_tokens[:-1])
    with pytest.raises(ValueError, match="not text"):
        simulate_prefix(w, "precise-prefix", block_tokens=b"abc")
    with pytest.raises(ValueError, match="needs blocks"):
        rc.simulate([0.0], [10], [1], [rc.SimPool("p", 1, 64, 1)], block_tokens=w.block_tokens)


ARGS = ["pick-eval", "--requests", "1500", "--quiet", "--json"]


def run_json(capsys, *extra: str) -> dict:
    assert main([*ARGS, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_pick_eval_json_is_seeded_and_prefix_aware_policies_hit_more(capsys):
    out = run_json(capsys)
    rows = {r["policy"]: r for r in out["policies"]}
    assert list(rows) == list(POLICIES)
    for r in rows.values():
        assert set(r) == {"policy", "hit_rate", "ttft_p50_s", "ttft_p99_s", "imbalance"}
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert 0.0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["imbalance"] >= 1.0
    # The shared-prefix workload rewards routing on prefixes.
    for prefix_aware in ("prefix", "prefix+queue+kv", "precise-prefix", "precise-prefix+queue+kv"):
        assert rows[prefix_aware]["hit_rate"] > rows["random"]["hit_rate"] + 0.1
        assert rows[prefix_aware]["ttft_p50_s"] < rows["random"]["ttft_p50_s"]
    # Under KV-cache pressure the engines evict what the approximate index
    # still counts on; the index fed by their KV events knows what they hold.
    for approximate in ("prefix", "prefix+queue+kv"):
        assert rows[f"precise-{approximate}"]["hit_rate"] > rows[approximate]["hit_rate"]
    assert run_json(capsys) == out
    assert run_json(capsys, "--seed", "1") != out


def test_pick_eval_table_and_plot(capsys, tmp_path):
    png = tmp_path / "pick.png"
    assert main([*ARGS[:-1], "--policy", "random", "--policy", "prefix", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("| policy | prefix hit rate | TTFT p50 (s)")
    assert [line.split(" | ")[0] for line in out.splitlines()[2:]] == ["| random", "| prefix"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_readme_table_is_the_default_run(capsys):
    docs = Path(__file__).resolve().parent.parent / "docs"
    page = (docs / "prefix-and-fairness.md").read_text("utf-8")
    assert main(["pick-eval", "--quiet"]) == 0
    table = capsys.readouterr().out.strip()
    assert table.count("\n") == len(POLICIES) + 1
    assert table in page
