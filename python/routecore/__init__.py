"""routecore: the hot path of LLM request routing, in Rust, driven from Python.

Token-budget pool routing with a self-calibrating bytes-per-token estimate
(Chen et al. 2026), and the pieces a router around it needs.
"""

from routecore._core import (
    BatchScheduler,
    Calibrator,
    Instance,
    KnnEstimator,
    Pool,
    PrefixCacheRouter,
    PrefixIndex,
    RouteDecision,
    TokenBudgetRouter,
    VtcRouter,
    __version__,
    assign_eval,
    block_hashes,
    block_hashes_many,
    classify,
    parse_openai_request,
)

__all__ = [
    "BatchScheduler",
    "Calibrator",
    "Instance",
    "KnnEstimator",
    "Pool",
    "RouteDecision",
    "TokenBudgetRouter",
    "__version__",
    "assign_eval",
    "classify",
    "parse_openai_request",
    "PrefixCacheRouter",
    "PrefixIndex",
    "block_hashes",
    "block_hashes_many",
    "VtcRouter",
]
