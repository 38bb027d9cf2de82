"""Helpers around ``routecore.plan``: the assumptions behind FleetOpt's
published Azure numbers, and the rows of its Table 3.

FleetOpt's Table 3 homogeneous (284 GPUs) and pool-routing (43 + 131 at
B_short = 4,096) rows are what its public Python implementation
(``src/fleet-sim`` in vllm-project/semantic-router) computes, under three
assumptions that the paper does not state:

1. the workload is the trace's CDF of total tokens at 18 breakpoints (64 ...
   65,536 tokens), linearly interpolated inside each bucket;
2. every request splits 80 % input / 20 % output
   (``L_in = max(1, floor(0.8 L))``), not the trace's own split;
3. the per-slot iteration cost scales with the request's length,
   ``t_iter = W + H (L_total / 8192) n_slots`` (H calibrated at 8K), not
   ``W + H n_slots`` as the paper's Eq. 3 reads.

``fleetopt_workload`` and ``fleetopt_profile`` build exactly that; the
implementation estimates the moments from 3,000 Monte Carlo samples where
routecore sums the distribution exactly.
"""

from __future__ import annotations

from routecore._core import Candidate, Plan, Profile, Workload

FLEETOPT_BREAKPOINTS = (
    64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096,
    6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536,
)  # fmt: skip
FLEETOPT_INPUT_FRACTION = 0.8
FLEETOPT_H_REF_TOKENS = 8192


def fleetopt_workload(
    trace: Workload,
    breakpoints: tuple[int, ...] = FLEETOPT_BREAKPOINTS,
    input_fraction: float = FLEETOPT_INPUT_FRACTION,
) -> Workload:
    """The trace reduced to its CDF at ``breakpoints`` (assumptions 1 and 2)."""
    points = [(t, trace.cdf(t)) for t in breakpoints]
    if points[-1][1] < 1.0:
        points.append((trace.quantile(1.0), 1.0))
    return Workload.from_cdf(points, input_fraction)


def fleetopt_profile(profile: Profile | None = None) -> Profile:
    """``profile`` (default Llama-3-70B on A100) with length-scaled H (assumption 3)."""
    base = profile if profile is not None else Profile.llama3_70b_a100()
    return base.replace(h_ref_tokens=FLEETOPT_H_REF_TOKENS)


def table3_rows(result: Plan, gamma_cr: float = 1.5) -> list[tuple[str, Candidate | None]]:
    """FleetOpt Table 3's rows: homogeneous, pool routing (cheapest feasible
    gamma = 1 fleet), pool routing + C&R at ``gamma_cr`` on the same B_short,
    and the optimum over the whole sweep."""
    pr = result.pool_routing
    cr = None
    if pr is not None:
        try:
            cr = result.candidate(pr.b_short, gamma_cr)
        except KeyError:
            cr = None
    return [
        ("Homogeneous", result.homogeneous),
        ("Pool routing (PR)", pr),
        (f"PR + C&R (gamma {gamma_cr:g})", cr),
        ("FleetOpt optimum", result.best),
    ]
