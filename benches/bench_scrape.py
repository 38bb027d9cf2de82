"""The cost of knowing the engines' state: 200 endpoints scraped every 50 ms,
each answering vLLM 0.32's full page as captured from a real engine
(``tests/fixtures/vllm/metrics.txt``: 644 lines, 55 KB; vLLM ignores the
``name[]`` filter). routecore's Rust
scraper (on its own thread, ``routecore-scrape``; its CPU time is read from
/proc) beside the plain-Python twin (aiohttp + prometheus_client's parser,
``routecore/_baselines/scrape.py``). The pages come from a separate process,
so its CPU is not counted.

Figures: CPU seconds per second of scraping (1.0 = one core), scrapes per
second achieved, and CPU per scrape; the goal is < 0.10 core at 200 x 20/s.
``ROUTECORE_SCRAPE_SECONDS`` sets the measured window (default 2 s).

Run: .venv/bin/python -m pytest benches/bench_scrape.py -s
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from routecore import DataPlane
from routecore._baselines import scrape as baseline
from routecore.config import parse_config

N = 200
INTERVAL = 0.05
SECONDS = float(os.environ.get("ROUTECORE_SCRAPE_SECONDS", "2"))
ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "tests/fixtures/vllm/metrics.txt"


@pytest.fixture(scope="module")
def pages():
    proc = subprocess.Popen(
        [sys.executable, "-m", "routecore._baselines.scrape", str(N), str(PAGE)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    ports = proc.stdout.readline().split()
    yield [f"127.0.0.1:{p}" for p in ports]
    proc.stdin.close()
    proc.wait(timeout=10)


def dp_cpu_s() -> float:
    """CPU seconds of this process's data-plane threads (the shards and the scraper)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name.startswith("routecore-"):
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def report(benchmark, cpu_s: float, scrapes: float, seconds: float) -> None:
    figures = {
        "cores": round(cpu_s / seconds, 4),
        "scrapes_per_s": round(scrapes / seconds),
        "cpu_us_per_scrape": round(1e6 * cpu_s / max(scrapes, 1), 1),
        "cores_at_4000_per_s": round(4000 * cpu_s / max(scrapes, 1), 4),
    }
    benchmark.extra_info.update(figures)
    print(figures)


def test_page_is_vllm_sized_and_read_alike():
    page = PAGE.read_bytes()
    assert 55_000 < len(page) < 56_000 and page.count(b"\n") == 644
    values = baseline.read_page(page)
    assert values["vllm:num_requests_waiting"] == 0.0
    assert values["vllm:kv_cache_usage_perc"] == 0.0


@pytest.mark.benchmark(group="scrape: 200 endpoints every 50 ms, vLLM-sized pages")
def test_scrape_routecore(benchmark, pages):
    config = {
        "scrape": {"interval_s": INTERVAL},
        "pools": [{"name": "p", "max_context": 8192, "endpoints": pages}],
    }
    plane = DataPlane.start(parse_config(config).spec_json(), worker_threads=1)

    def ok() -> float:
        return sum(plane.metric("scrapes", e, "ok") or 0.0 for e in pages)

    try:
        time.sleep(0.5)  # connections opened, every endpoint scraped
        assert all(s["healthy"] for s in plane.endpoints()["p"].values())

        def window():
            cpu0, n0, t0 = dp_cpu_s(), ok(), time.monotonic()
            time.sleep(SECONDS)
            return dp_cpu_s() - cpu0, ok() - n0, time.monotonic() - t0

        cpu, scrapes, seconds = benchmark.pedantic(window, rounds=1, iterations=1)
        assert scrapes > 0
        assert plane.endpoints()["p"][pages[0]]["kv_usage"] == 0.0
        report(benchmark, cpu, scrapes, seconds)
    finally:
        plane.drain(0.0)


@pytest.mark.benchmark(group="scrape: 200 endpoints every 50 ms, vLLM-sized pages")
def test_scrape_python(benchmark, pages):
    def window():
        cpu0, t0 = time.process_time(), time.monotonic()
        n = asyncio.run(baseline.scrape_all(pages, INTERVAL, SECONDS))
        return time.process_time() - cpu0, n, time.monotonic() - t0

    cpu, scrapes, seconds = benchmark.pedantic(window, rounds=1, iterations=1)
    assert scrapes > 0
    report(benchmark, cpu, scrapes, seconds)
