"""The FleetOpt planner: the papers' worked numbers, Table 3 under the stated
assumptions, sizing checked against the formulas by hand, the utilization cap
at any scale (the paper model); the engine model by hand, its binding
resources and its errors."""

import math

import numpy as np
import pytest

from routecore import (
    Profile,
    Workload,
    annual_cost_usd,
    g_dual,
    p99_wait,
    plan,
    pool_routing_savings,
)
from routecore.planning import fleetopt_profile, fleetopt_workload, table3_rows

AZURE = Workload.azure_2023()


def paper_plan(*args, **kwargs):
    """``plan`` with FleetOpt's Eq. 3-4 model, whose numbers these tests pin."""
    return plan(*args, model="paper", **kwargs)


def test_closed_forms_worked_numbers():
    # token-budget paper Section 3: alpha = 0.80, rho = 4 -> 60 %
    assert pool_routing_savings(0.80, 4.0) == pytest.approx(0.60, rel=1e-15)
    # Eq. 8 at B_short = 8192: 917/13.5 + 83/0.37 = 68 + 224 = 292
    assert g_dual(0.917, 1000.0, 13.5, 0.37) == pytest.approx(917 / 13.5 + 83 / 0.37)
    assert round(g_dual(0.917, 1000.0, 13.5, 0.37)) == 292
    # FleetOpt Table 3 cost column: 284 GPUs at $2.21 x 8,760 h = $5,498 K
    assert round(annual_cost_usd(284, 2.21) / 1000) == 5498
    assert annual_cost_usd(1, 1.0, 24.0) == 24.0
    for bad in [lambda: pool_routing_savings(-0.1, 2), lambda: pool_routing_savings(0.5, 0)]:
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        g_dual(0.5, 1000, 13.5, float("nan"))
    with pytest.raises(ValueError):
        annual_cost_usd(-1, 2.21)


def test_table3_rows_under_the_implementations_assumptions():
    """FleetOpt Table 3, Azure: homogeneous 284, pool routing 43 + 131 at
    B_short 4096 -- reproduced within 3 % on the trace's CDF with the 80/20
    split and length-scaled H (see routecore.planning)."""
    w = fleetopt_workload(AZURE)
    r = paper_plan(w, 1000.0, 0.5, fleetopt_profile(), b_short=[4096])
    assert r.homogeneous.gpus == pytest.approx(284, rel=0.03)
    pr = r.pool_routing
    assert pr is not None and pr.b_short == 4096 and pr.gamma == 1.0
    assert pr.n_short == pytest.approx(43, rel=0.03)
    assert pr.n_long == pytest.approx(131, rel=0.03)
    assert pr.gpus == pytest.approx(174, rel=0.03)
    # the CDF reduction keeps the trace's alpha and beta (Table 2)
    assert round(pr.alpha, 3) == 0.898
    assert round(r.candidate(4096, 1.5).beta, 3) == 0.078
    rows = dict(table3_rows(r))
    assert rows["FleetOpt optimum"].gpus <= rows["PR + C&R (gamma 1.5)"].gpus <= pr.gpus


def direct_service(w, profile, lo, hi, ctx):
    inp = w.input_tokens.astype(float)
    out = w.output_tokens.astype(float)
    m = (inp + out > lo) & (inp + out <= hi)
    n = profile.slots(ctx)
    k = np.ceil(inp[m] / profile.c_chunk) + out[m]
    s = k * profile.t_iter(n)
    mean = s.mean()
    return n / mean, s.var() / mean**2, m.mean()


def test_sizing_by_hand_on_the_trace():
    """Paper model (Eq. 3-11) on the trace's own split: the homogeneous fleet
    and one pool-routing candidate recomputed from the formulas with NumPy."""
    p = Profile.llama3_70b_a100()
    r = paper_plan(AZURE, 1000.0, 0.5, p, b_short=[32768], gammas=[1.0])
    mu, cs2, _ = direct_service(AZURE, p, 0, math.inf, 65536)
    n = math.ceil(1000.0 / (0.85 * mu))
    h = r.homogeneous
    assert h.n_long == n  # 213: the 'naive reading' number of the issue
    assert h.utilization_long == pytest.approx(1000.0 / (n * mu), rel=1e-12)
    assert h.utilization_long <= 0.85 < 1000.0 / ((n - 1) * mu)
    assert h.p99_wait_long_s == p99_wait(n * 16, mu / 16, cs2, 1000.0)
    c = r.candidate(32768, 1.0)
    mu_s, _, alpha = direct_service(AZURE, p, 0, 32768, 32768)
    assert c.alpha == pytest.approx(alpha)
    assert c.n_short == math.ceil(alpha * 1000.0 / (0.85 * mu_s))
    assert c.n_long == 0  # no request of the trace is above 32K


def test_paper_model_makes_short_pools_miss_the_slo():
    """With t_iter = W + H n_max, a 4K pool iterates every 174 ms, so a 3K-token
    prompt's chunked prefill alone takes > 1 s: infeasible at 500 ms."""
    r = paper_plan(AZURE, 1000.0, 0.5, Profile.llama3_70b_a100(), b_short=[4096], gammas=[1.0])
    c = r.candidate(4096, 1.0)
    assert c.t_iter_short_s == pytest.approx(0.008 + 0.00065 * 256)
    assert c.prefill_p99_short_s > 0.5
    assert not c.feasible_short and not c.feasible
    assert c.n_short == math.ceil(c.arrival_rate_short / (0.85 * c.mu_gpu_short))
    assert r.best is None and r.pool_routing is None


def test_real_split_plan_is_consistent():
    r = paper_plan(AZURE, 1000.0, 0.5, fleetopt_profile())
    assert len(r) == len(r.sweep) == 15 * 11
    best, pr, homo = r.best, r.pool_routing, r.homogeneous
    assert best is not None and pr is not None
    assert best.annual_cost_usd <= pr.annual_cost_usd <= homo.annual_cost_usd
    feasible = [c for c in r.sweep if c.feasible]
    assert best.annual_cost_usd == min(c.annual_cost_usd for c in feasible)
    for c in r.sweep:
        assert c.gpus == c.n_short + c.n_long
        assert c.annual_cost_usd == pytest.approx(c.gpus * 2.21 * 8760)
        assert c.savings_vs_homogeneous == pytest.approx(
            1 - c.annual_cost_usd / homo.annual_cost_usd
        )
        assert c.alpha_prime == pytest.approx(c.alpha + c.beta)  # p_c = 1
        if c.feasible:
            assert c.p99_ttft_short_s <= 0.5 and c.p99_ttft_long_s <= 0.5
    # at a fixed B_short, more compression moves more traffic to the short pool
    for b in (1024, 4096):
        ap = [r.candidate(b, g / 10).alpha_prime for g in range(10, 21)]
        assert ap == sorted(ap)


def test_utilization_cap_holds_at_any_scale():
    """A million requests per second: tens of thousands of GPUs, millions of
    slots, and every pool of every candidate at or below rho_max and minimal."""
    r = paper_plan(AZURE, 1_000_000.0, 0.5, fleetopt_profile())
    assert r.homogeneous.gpus > 10_000
    for c in [r.homogeneous, *r.sweep]:
        for n, u, lam, mu in [
            (c.n_short, c.utilization_short, c.arrival_rate_short, c.mu_gpu_short),
            (c.n_long, c.utilization_long, c.arrival_rate_long, c.mu_gpu_long),
        ]:
            if lam > 0 and n > 0:
                assert u <= 0.85
                assert u == pytest.approx(lam / (n * mu), rel=1e-12)
                if n > 1:
                    assert lam / ((n - 1) * mu) > 0.85  # W99 = 0 here: the cap binds
    slots = r.homogeneous.n_long * r.homogeneous.slots_long
    assert slots > 100_000


def test_small_fleet_where_the_slo_binds():
    """One slow request type, a tight SLO: Erlang-C sizing needs more GPUs than
    the cap, and exactly the fewest that meet W99 <= budget."""
    w = Workload([4000] * 10, [2000] * 10)
    p = Profile.llama3_70b_a100()
    r = paper_plan(w, 0.5, 1.5, p, b_short=[8192], gammas=[1.0])
    c = r.candidate(8192, 1.0)
    mu_slot = c.mu_gpu_short / c.slots_short
    budget = 1.5 - c.prefill_p99_short_s - c.t_iter_short_s
    cap = math.ceil(0.5 / (0.85 * c.mu_gpu_short))
    assert c.n_short >= cap
    assert p99_wait(c.n_short * c.slots_short, mu_slot, 0.0, 0.5) <= budget
    if c.n_short > cap:
        assert p99_wait((c.n_short - 1) * c.slots_short, mu_slot, 0.0, 0.5) > budget


def test_per_category_compressibility():
    w = fleetopt_workload(AZURE)  # no categories
    with pytest.raises(KeyError):
        paper_plan(w, 1000.0, 0.5, p_c_by_category={"code": 0.0})
    p = fleetopt_profile()
    all_c = paper_plan(AZURE, 1000.0, 0.5, p, b_short=[2048], gammas=[1.5])
    no_code = paper_plan(
        AZURE, 1000.0, 0.5, p, b_short=[2048], gammas=[1.5], p_c_by_category={"code": 0}
    )
    a, b = all_c.candidate(2048, 1.5), no_code.candidate(2048, 1.5)
    cats = AZURE.categories
    total = AZURE.total_tokens
    band = (total > 2048) & (total <= 3072)
    code_band = (band & (cats == "code")).mean()
    assert a.alpha_prime - b.alpha_prime == pytest.approx(code_band, rel=1e-9)
    assert b.n_long >= a.n_long


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arrival_rate": 0.0},
        {"arrival_rate": float("nan")},
        {"slo_ttft_s": -1.0},
        {"rho_max": 1.0},
        {"b_short": [65536]},
        {"b_short": [0]},
        {"gammas": [0.9]},
        {"p_c": 1.5},
        {"phi": 0.0},
        {"prefill_quantile": 2.0},
        {"b_short": list(range(1, 20_000)), "gammas": [1.0, 1.5, 2.0, 1.2, 1.3, 1.4]},
    ],
)
def test_bad_configuration_raises(kwargs):
    args = {"arrival_rate": 1000.0, "slo_ttft_s": 0.5, **kwargs}
    with pytest.raises(ValueError):
        plan(AZURE, args.pop("arrival_rate"), args.pop("slo_ttft_s"), **args)


def test_candidate_lookup_and_dict():
    r = paper_plan(AZURE, 100.0, 0.5, fleetopt_profile(), b_short=[4096], gammas=[1.0, 2.0])
    with pytest.raises(KeyError):
        r.candidate(4096, 1.5)
    d = r.candidate(4096, 2.0).as_dict()
    for key in (
        "b_short", "gamma", "n_short", "n_long", "gpus", "utilization_short",
        "utilization_long", "p99_ttft_short_s", "p99_ttft_long_s", "annual_cost_usd",
        "savings_vs_homogeneous",
    ):  # fmt: skip
        assert key in d
    assert d["gamma"] == 2.0


# --- the engine model (the default) ----------------------------------------------


def test_engine_model_by_hand():
    """One request type, L_in = 1000, L_out = 100, C = 512: a = 2 + 100 - 1 = 101
    active iterations. At rate r per GPU the iteration time solves t = W + H r a t,
    the prefill budget runs at rho_p = r L_in t / C, prompts wait W_p = r L_in^2
    (t / C)^2 / (2 (1 - rho_p)) for it (Pollaczek-Khinchine), and the
    occupancy is r (a t + W_p)."""
    w = Workload([1000] * 4, [100] * 4)
    r = plan(w, 20.0, 2.0, long_context=8192, b_short=[4096], gammas=[1.0])
    h = r.homogeneous
    rate = 20.0 / h.n_long
    t = 0.008 / (1 - 0.00065 * rate * 101)
    rho_p = rate * 1000 * t / 512
    wait = rate * 1000**2 * (t / 512) ** 2 / (2 * (1 - rho_p))
    assert h.t_iter_long_s == pytest.approx(t, rel=1e-12)
    assert h.prefill_utilization_long == pytest.approx(rho_p, rel=1e-12)
    assert h.occupancy_long == pytest.approx(rate * (101 * t + wait), rel=1e-12)
    assert h.utilization_long == pytest.approx(h.occupancy_long / h.slots_long, rel=1e-12)
    assert h.p99_ttft_long_s <= 2.0 and h.feasible


def test_engine_model_is_minimal_and_names_what_binds():
    """Tight TPOT binds compute (and a looser one needs fewer GPUs); long
    prompts under a tight TTFT bind the prefill budget. (Minimality, the
    count one GPU fewer failing, is tested in Rust.)"""
    w = Workload([200] * 5 + [6000] * 5, [400] * 5 + [50] * 5)
    tight_tpot = plan(w, 200.0, 5.0, slo_tpot_s=0.02, b_short=[1024], gammas=[1.0])
    c = tight_tpot.candidate(1024, 1.0)
    assert c.binding_short == "compute"
    looser = plan(w, 200.0, 5.0, slo_tpot_s=0.2, b_short=[1024], gammas=[1.0])
    assert looser.candidate(1024, 1.0).n_short < c.n_short
    c = plan(w, 200.0, 1.0, b_short=[1024], gammas=[1.0]).candidate(1024, 1.0)
    assert c.binding_long == "prefill"
    assert c.prefill_utilization_long > c.utilization_long


def test_engine_model_sizes_the_default_scenario_near_the_simulator():
    """The issue's scenario (Azure, 1,000 req/s, TTFT 2 s, TPOT 80 ms): the
    homogeneous fleet within 3 % of the 186 GPUs the simulator needs (the paper
    model plans 213)."""
    r = plan(AZURE, 1000.0, 2.0, slo_tpot_s=0.08)
    assert r.homogeneous.n_long == pytest.approx(186, rel=0.03)
    assert r.homogeneous.binding_long == "slot"
    assert paper_plan(AZURE, 1000.0, 2.0).homogeneous.n_long == 213


@pytest.mark.parametrize(
    ("kwargs", "binding"),
    [
        ({"slo_ttft_s": 0.01}, "prefill"),  # below one iteration of W
        ({"slo_tpot_s": 0.005}, "compute"),  # below W = 8 ms
    ],
)
def test_an_slo_no_fleet_meets_is_an_error_naming_the_binding_constraint(kwargs, binding):
    args = {"slo_ttft_s": 2.0, "slo_tpot_s": 0.08, **kwargs}
    with pytest.raises(ValueError, match=f"no fleet meets the SLO \\(binding: {binding}\\)"):
        plan(AZURE, 1000.0, args.pop("slo_ttft_s"), **args)


@pytest.mark.parametrize("rate", [0.0, -5.0, float("inf")])
def test_zero_or_negative_rates_are_refused(rate):
    with pytest.raises(ValueError, match="arrival_rate"):
        plan(AZURE, rate, 2.0)


def test_requests_longer_than_every_pool_are_refused():
    w = Workload([1000, 70_000], [10, 10])
    with pytest.raises(ValueError, match="exceed long_context = 65536"):
        plan(w, 10.0, 2.0)
    assert plan(w, 10.0, 2.0, long_context=131_072).homogeneous.gpus >= 1


def test_engine_model_refuses_length_scaled_h():
    with pytest.raises(ValueError, match="h_ref_tokens"):
        plan(AZURE, 1000.0, 2.0, fleetopt_profile())
    with pytest.raises(ValueError, match="model"):
        plan(AZURE, 1000.0, 2.0, model="fleetopt")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workload", "rate", "profile"),
    [
        ("azure-code", 100.0, "llama3_70b_a100"),
        ("azure-code", 100.0, "qwen3_235b_mi300x"),
        ("lmsys-chat-1m", 100.0, "llama3_70b_a100"),
        ("lmsys-chat-1m", 100.0, "qwen3_235b_mi300x"),
        ("lmsys-chat-1m", 1000.0, "qwen3_235b_mi300x"),
    ],
)
def test_planned_pools_match_the_smallest_simulated_fleet(workload, rate, profile):
    """A CI-sized part of the README's fidelity grid (TTFT 2 s, TPOT 80 ms,
    Poisson arrivals): every pool of the homogeneous and pool-routing fleets
    within 3 % or 1 GPU of the smallest count the simulator accepts."""
    from routecore.planning import fidelity_markdown, fidelity_scenario

    rows = fidelity_scenario(workload, rate, 2.0, profile)
    assert [(r.fleet, r.pool) for r in rows] == [
        ("homogeneous", "homogeneous"), ("pool-routing", "short"), ("pool-routing", "long")
    ]  # fmt: skip
    for r in rows:
        assert r.within, fidelity_markdown(rows)
