"""Compress-and-route: a 12,000-token prose prompt (48,000 bytes of the GPL
texts Debian ships, estimated at 4 bytes per token) compressed by 15% to
10,200 tokens, by routecore and by the plain-Python twin of the same pipeline
(routecore/_baselines/compress.py). Goal from issue 8: p99 under 2 ms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routecore import Compressor, Pool, TokenBudgetRouter
from routecore._baselines import compress as baseline

LICENSES = Path("/usr/share/common-licenses")
PROMPT_BYTES = 48_000
BUDGET = 10_200

pytestmark = pytest.mark.skipif(
    not (LICENSES / "GPL-3").exists(), reason="needs /usr/share/common-licenses"
)


def prompt() -> str:
    text = "".join((LICENSES / name).read_text(encoding="utf-8") for name in ("GPL-3", "GPL-2"))
    return text.encode()[:PROMPT_BYTES].decode("utf-8", errors="ignore")


@pytest.fixture(scope="module")
def text() -> str:
    t = prompt()
    # Both implementations keep the same sentences: the bench compares like with like.
    r = Compressor().compress(t, BUDGET, category="prose", bytes_per_token=4.0)
    assert r.status == "compressed"
    assert baseline.compress(t, BUDGET) == (r.text, r.kept_sentence_indices)
    return t


@pytest.mark.benchmark(group="compress-12k-tokens")
def test_routecore_compress(benchmark, text):
    c = Compressor()
    r = benchmark(c.compress, text, BUDGET, "prose", 4.0)
    assert r.tokens_after <= BUDGET


@pytest.mark.benchmark(group="compress-12k-tokens")
def test_routecore_compress_classify(benchmark, text):
    c = Compressor()
    r = benchmark(c.compress, text, BUDGET)
    assert r.tokens_after <= BUDGET


@pytest.mark.benchmark(group="compress-12k-tokens")
def test_python_compress(benchmark, text):
    out, _ = benchmark(baseline.compress, text, BUDGET)
    assert len(out.encode()) <= BUDGET * 4


@pytest.mark.benchmark(group="route-request-12k-tokens")
def test_routecore_route_request(benchmark, text):
    """Parse, classify, route, compress and re-serialise a chat body whose
    document makes L_total 12,300 tokens, into a 10,500-token short pool."""
    router = TokenBudgetRouter([Pool("short", 10_500), Pool("long", 65_536)], compress_band=1.5)
    body = json.dumps(
        {
            "messages": [
                {"role": "system", "content": "Answer from the document."},
                {"role": "tool", "content": text},
                {"role": "user", "content": "Which section covers patents?"},
            ],
            "max_tokens": 300,
        }
    ).encode()
    routed = benchmark(router.route_request, body)
    assert routed.decision.action == "compress"
