"""routecore: the hot path of LLM request routing, in Rust, driven from Python.

Token-budget pool routing with a self-calibrating bytes-per-token estimate
(Chen et al. 2026), and the pieces a router around it needs.
"""

from routecore._core import (
    Admission,
    AdmissionController,
    Calibrator,
    CompressionResult,
    Compressor,
    Entitlement,
    Pool,
    PrefixCacheRouter,
    PrefixIndex,
    RequestCompression,
    RouteDecision,
    RoutedRequest,
    TokenBudgetRouter,
    TokenPool,
    VtcRouter,
    __version__,
    block_hashes,
    block_hashes_many,
    classify,
    parse_openai_request,
    priority_weight,
)
from routecore.admission import InMemoryAdmission, RedisAdmission, admission_from_config

__all__ = [
    "Calibrator",
    "CompressionResult",
    "Compressor",
    "Pool",
    "RequestCompression",
    "RouteDecision",
    "RoutedRequest",
    "TokenBudgetRouter",
    "__version__",
    "classify",
    "parse_openai_request",
    "PrefixCacheRouter",
    "PrefixIndex",
    "block_hashes",
    "block_hashes_many",
    "VtcRouter",
    "Admission",
    "AdmissionController",
    "Entitlement",
    "TokenPool",
    "priority_weight",
    "InMemoryAdmission",
    "RedisAdmission",
    "admission_from_config",
]
