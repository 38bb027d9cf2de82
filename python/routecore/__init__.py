"""routecore: the hot path of LLM request routing, in Rust, driven from Python.

Token-budget pool routing with a self-calibrating bytes-per-token estimate
(Chen et al. 2026), and the pieces a router around it needs.
"""

from routecore._core import (
    Calibrator,
    Pool,
    Profile,
    RouteDecision,
    Service,
    SimPool,
    SimReport,
    TokenBudgetRouter,
    Workload,
    __version__,
    classify,
    parse_openai_request,
    simulate,
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
    "SimPool",
    "SimReport",
    "simulate",
]
