"""routecore: the hot path of LLM request routing, in Rust, driven from Python.

Token-budget pool routing with a self-calibrating bytes-per-token estimate
(Chen et al. 2026), and the pieces a router around it needs.
"""

from routecore._core import (
    Calibrator,
    Candidate,
    ErlangScan,
    Plan,
    Pool,
    Profile,
    RouteDecision,
    Service,
    TokenBudgetRouter,
    Workload,
    __version__,
    annual_cost_usd,
    classify,
    erlang_b,
    erlang_c,
    erlang_c_many,
    g_dual,
    p99_wait,
    parse_openai_request,
    plan,
    pool_routing_savings,
)
from routecore.profiles import load_profile

__all__ = [
    "Calibrator",
    "Pool",
    "RouteDecision",
    "TokenBudgetRouter",
    "__version__",
    "classify",
    "parse_openai_request",
    "Profile",
    "Service",
    "Workload",
    "load_profile",
    "Candidate",
    "ErlangScan",
    "Plan",
    "annual_cost_usd",
    "erlang_b",
    "erlang_c",
    "erlang_c_many",
    "g_dual",
    "p99_wait",
    "plan",
    "pool_routing_savings",
]
