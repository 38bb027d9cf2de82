"""The endpoint picker: routecore.EndpointPicker.pick beside the plain-Python
twin, same run, with the GIE's default scorers (queue + KV use), with prefix
match added (the default preset), and with the precise prefix scorer reading
a KvEventIndex fed by mock engines' KV events.

Run: .venv/bin/python -m pytest benches/bench_pick.py
"""

import numpy as np
import pytest

from routecore import EndpointPicker, KvEventIndex
from routecore._baselines import pick as baseline
from routecore._baselines.prefix import block_hashes
from tests.mock_kv_publisher import MockKvPublisher, subscribe, synced, wait_for

TOKENS = 8192
BLOCK = 16  # 512 blocks


def names(n):
    return [f"vllm-{i}" for i in range(n)]


def prompt(seed=0, n=TOKENS):
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint32)


def scraped(picker, n, seed=0):
    """Every endpoint with a scraped queue, running count and KV use."""
    rng = np.random.default_rng(seed)
    for e in names(n):
        picker.set_state(
            e,
            waiting=float(rng.integers(0, 4)),
            running=float(rng.integers(0, 32)),
            kv_usage=float(rng.uniform(0.1, 0.7)),
        )
    return picker


def ties_first(preset, kv=None):
    """A routecore picker equal to `preset` but breaking ties to the first, as
    the plain-Python twin does (for the decision check); `kv`: a precise
    preset's KvEventIndex."""
    plugins = EndpointPicker(["x"], preset=preset, kv_index=kv).plugins
    for p in plugins:
        if p["name"] == "max-score" and p["ties"] == "random":
            p.pop("seed", None)
            p["ties"] = "first"
    return plugins


def warmed(picker, n):
    """16 prompts sharing a 4,096-token system prompt seen, and the next one."""
    scraped(picker, n)
    system = prompt(1, TOKENS // 2)
    for k in range(16):
        picker.pick(np.concatenate([system, prompt(100 + k, TOKENS // 2)]))
    return picker, np.concatenate([system, prompt(999, TOKENS // 2)])


@pytest.mark.parametrize("n", [16, 256])
@pytest.mark.benchmark(group="EndpointPicker.pick, queue+kv")
def test_pick_queue_kv_routecore(benchmark, n):
    p = scraped(EndpointPicker(names(n), preset="queue+kv"), n)
    assert benchmark(p.pick, now=0.0) in names(n)


@pytest.mark.parametrize("n", [16, 256])
@pytest.mark.benchmark(group="EndpointPicker.pick, queue+kv")
def test_pick_queue_kv_plain_python(benchmark, n):
    p = scraped(baseline.EndpointPicker(names(n), preset="queue+kv"), n)
    assert benchmark(p.pick) in names(n)


@pytest.mark.parametrize("n", [16, 256])
@pytest.mark.benchmark(group="EndpointPicker.pick, prefix+queue+kv, 512-block prompt")
def test_pick_prefix_queue_kv_routecore(benchmark, n):
    p, tokens = warmed(EndpointPicker(names(n)), n)
    assert benchmark(p.pick, tokens, now=0.0) in names(n)


@pytest.mark.parametrize("n", [16, 256])
@pytest.mark.benchmark(group="EndpointPicker.pick, prefix+queue+kv, 512-block prompt")
def test_pick_prefix_queue_kv_plain_python(benchmark, n):
    p, tokens = warmed(baseline.EndpointPicker(names(n)), n)
    assert benchmark(p.pick, tokens) in names(n)


@pytest.mark.benchmark(group="EndpointPicker.pick, prefix (AIBrix), 512-block prompt")
def test_pick_prefix_routecore(benchmark):
    p, tokens = warmed(EndpointPicker(names(16), preset="prefix"), 16)
    assert benchmark(p.pick, tokens, now=0.0) in names(16)


@pytest.mark.benchmark(group="EndpointPicker.pick, prefix (AIBrix), 512-block prompt")
def test_pick_prefix_plain_python(benchmark):
    p, tokens = warmed(baseline.EndpointPicker(names(16), preset="prefix"), 16)
    assert benchmark(p.pick, tokens) in names(16)


@pytest.mark.parametrize("preset", ["queue+kv", "prefix+queue+kv", "prefix"])
def test_the_baseline_decides_like_routecore(preset):
    n = 16
    rc = scraped(EndpointPicker(names(n), plugins=ties_first(preset)), n)
    py = scraped(baseline.EndpointPicker(names(n), preset=preset), n)
    system = prompt(1, TOKENS // 2)
    for k in range(60):
        p = np.concatenate([system[: 256 * (k % 9)], prompt(k % 13, 1000)])
        assert rc.pick(p, now=0.0) == py.pick(p)
        if k % 20 == 19:
            scraped(rc, n, k)
            scraped(py, n, k)
    assert rc.in_flight == [s["in_flight"] for s in py.states]


PRECISE = "precise-prefix+queue+kv"
ENGINES = 4


@pytest.fixture(scope="module")
def engines():
    """16 endpoints on 4 mock engines publishing KV events (endpoint i reads
    engine i % 4's stream); engine j served the warm-up prompts k = j mod 4 of
    16 sharing a 4,096-token system prompt. Yields the KvEventIndex, each
    endpoint's held block hashes (for the twin) and the warm-up prompts."""
    n = 16
    system = prompt(1, TOKENS // 2)
    warm = [np.concatenate([system, prompt(100 + k, TOKENS // 2)]) for k in range(16)]
    pubs = [MockKvPublisher(block_size=BLOCK, capacity_blocks=4096) for _ in range(ENGINES)]
    index = KvEventIndex(block_size=BLOCK)
    try:
        for i, e in enumerate(names(n)):
            subscribe(index, e, pubs[i % ENGINES])
        for k, w in enumerate(warm):
            pubs[k % ENGINES].serve(w.tolist())
        for i, e in enumerate(names(n)):
            wait_for(synced(index, e, pubs[i % ENGINES]), what=f"{e} synced")
        held = {
            e: {
                h
                for k, w in enumerate(warm)
                if k % ENGINES == i % ENGINES
                for h in block_hashes(w, BLOCK)
            }
            for i, e in enumerate(names(n))
        }
        yield index, held, warm
    finally:
        index.close()
        for p in pubs:
            p.close()


@pytest.mark.benchmark(group="EndpointPicker.pick, precise-prefix+queue+kv, 512-block prompt")
def test_pick_precise_prefix_queue_kv_routecore(benchmark, engines):
    index, _, warm = engines
    p = scraped(EndpointPicker(names(16), preset=PRECISE, kv_index=index), 16)
    assert benchmark(p.pick, warm[5], now=0.0) in names(16)


@pytest.mark.benchmark(group="EndpointPicker.pick, precise-prefix+queue+kv, 512-block prompt")
def test_pick_precise_prefix_queue_kv_plain_python(benchmark, engines):
    _, held, warm = engines
    p = scraped(baseline.EndpointPicker(names(16), preset=PRECISE, held=held), 16)
    assert benchmark(p.pick, warm[5]) in names(16)


def test_the_baseline_decides_like_routecore_precise(engines):
    index, held, warm = engines
    n = 16
    rc = scraped(EndpointPicker(names(n), plugins=ties_first(PRECISE, index), kv_index=index), n)
    py = scraped(baseline.EndpointPicker(names(n), preset=PRECISE, held=held), n)
    for k in range(60):
        p = np.concatenate([warm[k % 16][: 512 * (k % 17)], prompt(k % 13, 1000)])
        assert rc.pick(p, now=0.0) == py.pick(p)
        if k % 20 == 19:
            scraped(rc, n, k)
            scraped(py, n, k)
    assert rc.in_flight == [s["in_flight"] for s in py.states]
