"""The token-budget paper's calibration study (Chen et al. 2026, Table 4).

Synthetic request streams with known bytes-per-token ratios per category are
routed between a short pool (8K) and a long pool (64K) while the calibrator
learns from each response's exact prompt token count, in a closed loop from the
cold start. Measured per category: the learned ratio after 50 observations, and
the mis-route rate (a request sent to the short pool whose true L_total exceeds
the short pool's window), against a global static ratio of 4 bytes/token.

The stream, documented so the numbers can be checked:

- true prompt tokens T_in are log-uniform on [256, 32768], a mix of chat turns
  and long documents that straddles the 8K boundary;
- each request's own bytes-per-token ratio is c_k * exp(e), e ~ N(0, 0.05^2),
  so its byte length is round(T_in * ratio);
- max_output_tokens is drawn from {256, 512, 1024, 2048}.

The static baseline routes the same stream with ratio 4 and no feedback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from routecore._core import Calibrator, Pool, TokenBudgetRouter

#: True bytes-per-token ratios of the paper's Table 4.
TRUE_RATIOS = {"prose": 4.48, "code": 3.52, "cjk": 2.01, "mixed": 3.81}
SHORT_CONTEXT = 8192
LONG_CONTEXT = 65536


@dataclass(frozen=True)
class CategoryResult:
    """One row of the study."""

    category: str
    true_ratio: float
    ratio_at_50: float
    relative_error: float
    misroute_rate: float
    static_misroute_rate: float
    requests: int


def _stream(rng: np.random.Generator, ratio: float, n: int):
    tokens = np.exp(rng.uniform(math.log(256), math.log(32768), n)).astype(np.int64)
    per_request = ratio * np.exp(rng.normal(0.0, 0.05, n))
    prompt_bytes = np.maximum(1, np.rint(tokens * per_request)).astype(np.int64)
    out = rng.choice(np.array([256, 512, 1024, 2048]), n)
    return tokens, prompt_bytes, out


def _misroutes(router: TokenBudgetRouter, category: str, tokens, prompt_bytes, out, learn: bool):
    """Routes the stream in order; returns (misroutes, ratio after 50 observations)."""
    misrouted = 0
    ratio_at_50 = float("nan")
    for i, (t, b, o) in enumerate(zip(tokens.tolist(), prompt_bytes.tolist(), out.tolist())):
        d = router.route(b, category, o)
        router.complete(d.index)
        if d.pool == "short" and t + o > SHORT_CONTEXT:
            misrouted += 1
        if learn:
            router.feedback(b, category, t)
            if i + 1 == 50:
                ratio_at_50 = router.calibrator.ratio(category)
    return misrouted, ratio_at_50


def calibration_study(seed: int = 0, requests: int = 5000) -> list[CategoryResult]:
    """Runs the study; one result per category of ``TRUE_RATIOS``."""
    if requests < 50:
        raise ValueError("requests must be >= 50 (the study reads the ratio at n = 50)")
    rng = np.random.default_rng(seed)
    pools = [Pool("short", SHORT_CONTEXT), Pool("long", LONG_CONTEXT)]
    results = []
    for category, ratio in TRUE_RATIOS.items():
        stream = _stream(rng, ratio, requests)
        learned = TokenBudgetRouter(pools, Calibrator())
        misrouted, at_50 = _misroutes(learned, category, *stream, learn=True)
        static = TokenBudgetRouter(pools, Calibrator(gamma=0.0, cold_start=4.0))
        static_misrouted, _ = _misroutes(static, category, *stream, learn=False)
        results.append(
            CategoryResult(
                category=category,
                true_ratio=ratio,
                ratio_at_50=at_50,
                relative_error=abs(at_50 - ratio) / ratio,
                misroute_rate=misrouted / requests,
                static_misroute_rate=static_misrouted / requests,
                requests=requests,
            )
        )
    return results


def format_table(results: list[CategoryResult]) -> str:
    """The study as a Markdown table, with the static ratio's overall rate."""
    lines = [
        "| category | true c_k | c_hat at n=50 | rel. error | mis-route (calibrated) "
        "| mis-route (static c=4) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.category} | {r.true_ratio:.2f} | {r.ratio_at_50:.2f} "
            f"| {r.relative_error:.1%} | {r.misroute_rate:.2%} | {r.static_misroute_rate:.2%} |"
        )
    overall = sum(r.static_misroute_rate for r in results) / len(results)
    calibrated = sum(r.misroute_rate for r in results) / len(results)
    lines.append(f"| all | | | | {calibrated:.2%} | {overall:.2%} |")
    return "\n".join(lines)
