"""routecore: the hot path of LLM request routing, in Rust, driven from Python.

Token-budget pool routing with a self-calibrating bytes-per-token estimate
(Chen et al. 2026), and the pieces a router around it needs.
"""

from routecore._core import (
    Admission,
    AdmissionController,
    BatchScheduler,
    Calibrator,
    Entitlement,
    Instance,
    KnnEstimator,
    Pool,
    RouteDecision,
    TokenBudgetRouter,
    TokenPool,
    __version__,
    assign_eval,
    classify,
    parse_openai_request,
    priority_weight,
)
from routecore.admission import (
    AdmissionBackend,
    InMemoryAdmission,
    RedisAdmission,
    admission_from_config,
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
    "Admission",
    "AdmissionController",
    "Entitlement",
    "TokenPool",
    "priority_weight",
    "AdmissionBackend",
    "InMemoryAdmission",
    "RedisAdmission",
    "admission_from_config",
]
