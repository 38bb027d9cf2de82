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
    # every category compressible (code too): p_c = 1
    r = paper_plan(AZURE, 1000.0, 0.5, fleetopt_profile(), p_c_by_category={"code": 1.0})
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
    all_c = paper_plan(
        AZURE, 1000.0, 0.5, p, b_short=[2048], gammas=[1.5], p_c_by_category={"code": 1}
    )
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


def quadratic_t_iter(rate, a, prompt, w=0.008, h=0.00065, c=512):
    """The engine model's iteration time: the smaller root of
    t = W + H r (E[a] + r E[L_in] t / (2 C)) t."""
    qa, qb = 0.5 * h * rate * rate * prompt / c, 1 - h * rate * a
    return 2 * w / (qb + math.sqrt(qb * qb - 4 * qa * w))


def test_engine_model_by_hand():
    """One request type, L_in = 1000, L_out = 100, C = 512: a = 2 + 100 - 1 = 101
    active iterations. At rate r per GPU the iteration time solves the
    quadratic t = W + H r (a + rho_p / 2) t, rho_p = r L_in t / C the prefill
    budget's utilization. One endpoint is an open M/G/1 for the budget: prompts
    wait W_p = r L_in^2 (t / C)^2 / (2 (1 - rho_p)) (Pollaczek-Khinchine) and
    the occupancy is r ((a + rho_p / 2) t + W_p). Several endpoints behind
    least-request are closed loops, which wait less (tested exactly in Rust)."""
    w = Workload([1000] * 4, [100] * 4)
    h = plan(w, 2.0, 2.0, long_context=8192, b_short=[4096], gammas=[1.0]).homogeneous
    assert h.n_long == 1
    t = quadratic_t_iter(2.0, 101, 1000)
    rho_p = 2.0 * 1000 * t / 512
    wait = 2.0 * 1000**2 * (t / 512) ** 2 / (2 * (1 - rho_p))
    assert h.t_iter_long_s == pytest.approx(t, rel=1e-12)
    assert h.prefill_utilization_long == pytest.approx(rho_p, rel=1e-12)
    assert h.occupancy_long == pytest.approx(2.0 * ((101 + rho_p / 2) * t + wait), rel=1e-12)
    assert h.utilization_long == pytest.approx(h.occupancy_long / h.slots_long, rel=1e-12)
    assert h.p99_ttft_long_s <= 2.0 and h.feasible
    # 20 req/s needs several endpoints: the same iteration time at r = 20 / n,
    # and a prefill wait below the open queue's.
    h = plan(w, 20.0, 2.0, long_context=8192, b_short=[4096], gammas=[1.0]).homogeneous
    assert h.n_long > 1
    rate = 20.0 / h.n_long
    t = quadratic_t_iter(rate, 101, 1000)
    rho_p = rate * 1000 * t / 512
    open_wait = rate * 1000**2 * (t / 512) ** 2 / (2 * (1 - rho_p))
    assert h.t_iter_long_s == pytest.approx(t, rel=1e-12)
    assert h.prefill_utilization_long == pytest.approx(rho_p, rel=1e-12)
    no_wait = rate * (101 + rho_p / 2) * t
    assert no_wait < h.occupancy_long < no_wait + rate * open_wait


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
    ("workload", "rate"),
    [
        ("azure-conversation", 100.0),
        ("azure-code", 100.0),
        ("lmsys-chat-1m", 100.0),
        ("azure-code", 1000.0),
    ],
)
def test_planned_pools_match_the_smallest_simulated_fleet(workload, rate):
    """A CI-sized part of the fidelity grid (``routecore plan-fidelity``; TTFT
    2 s, TPOT 80 ms, Poisson arrivals, Llama-3-70B / A100, 120 s of them, the
    grid's former default: a fifth of its time, and its former sample,
    the horizon not extended for a small pool): every pool of the
    homogeneous and pool-routing fleets within 3 % or 1 GPU of the smallest
    count the simulator accepts."""
    from routecore.planning import fidelity_markdown, fidelity_scenario

    rows = fidelity_scenario(
        workload, rate, 2.0, "llama3_70b_a100", duration_s=120.0,
        min_pool_requests=0, fleets=("homogeneous", "pool-routing"),
    )  # fmt: skip
    assert {r.fleet for r in rows} == {"homogeneous", "pool-routing"}
    for r in rows:
        assert r.within, fidelity_markdown(rows)


def simulated_attainment(rate, slo_tpot_s, gpus, duration_s=200.0):
    """A compute-bound pool in the simulator: short prompts (20-99 tokens),
    geometric outputs of mean 40, one 4K pool of the planned size (the
    pool-routing fleet at B 4,096 holds every request), Poisson arrivals for
    ``duration_s`` seconds (the first 20 % left out; each decode lasts about
    3 s, the pool settles within a minute). Returns the planned count and, for
    each of ``gpus`` (offsets from it), the share of measured requests meeting
    TTFT 2 s and the TPOT target."""
    import argparse

    from routecore.commands import simulate as sim

    rng = np.random.default_rng(7)
    w = Workload(rng.integers(20, 100, 20_000), np.maximum(rng.geometric(1 / 40, 20_000), 1))
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    args = parser.parse_args(
        ["--rate", str(rate), "--slo-ttft", "2", "--slo-tpot", str(slo_tpot_s), "--seed", "3",
         "--arrivals", "poisson", "--duration", str(duration_s), "--b-short", "4096",
         "--fleet", "pool-routing", "--quiet"]
    )  # fmt: skip
    (fleet,) = sim.plan_fleets(w, Profile.llama3_70b_a100(), args)
    (pool,) = fleet.pools
    assert (pool.max_context, pool.binding) == (4096, "compute")
    trace = sim.trace_arrays(w, int(rate * duration_s), "poisson", 3)
    planned, out = pool.gpus, []
    for offset in gpus:
        pool.gpus = planned + offset
        report = sim.run_fleet(fleet, trace, Profile.llama3_70b_a100(), args)
        out.append(float(sim.slo_met(report, args)[report.measured].mean()))
    return planned, out


@pytest.mark.slow
def test_a_pool_sized_on_each_requests_mean_tpot_meets_it_in_simulation():
    """Issue 27: the TPOT constraint is on each request's mean TPOT over its
    decode (docs/planner.md). A pool it binds meets both SLOs for 99 % of the
    requests in the simulator at the planned count, and two GPUs fewer do not
    (one fewer may: the fidelity goal's tolerance of one GPU)."""
    planned, (at, fewer) = simulated_attainment(1500.0, 0.08, [0, -2])
    assert planned == 45
    assert at >= 0.99 > fewer, (at, fewer)


def _long_pool_planned_and_two_fewer(workload, fleet_kind, seed):
    """Plan ``fleet_kind`` for ``workload`` at 1,000 req/s, TTFT 0.5 s, TPOT
    80 ms, then simulate 600 s of Poisson arrivals (``seed``) with its long
    pool at the planned count and at two GPUs fewer. Returns the long pool,
    the fleet's short boundary, the planned count and the long pool's two
    attainments."""
    import argparse

    from routecore.commands import simulate as sim
    from routecore.planning import fidelity_workload

    rate, duration = 1000.0, 600.0
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    args = parser.parse_args(
        ["--rate", str(rate), "--slo-ttft", "0.5", "--slo-tpot", "0.08", "--seed", str(seed),
         "--arrivals", "poisson", "--duration", str(duration), "--fleet", fleet_kind, "--quiet"]
    )  # fmt: skip
    w = fidelity_workload(workload)
    profile = Profile.llama3_70b_a100()
    (fleet,) = sim.plan_fleets(w, profile, args)
    long = fleet.pools[-1]
    trace = sim.trace_arrays(w, int(rate * duration), "poisson", seed)
    planned, met = long.gpus, []
    for gpus in (planned, planned - 2):
        long.gpus = gpus
        met.append(sim.pool_attainment(sim.run_fleet(fleet, trace, profile, args), args)[-1])
    return long, fleet.b_short, planned, met


@pytest.mark.slow
def test_a_slot_bound_long_pool_meets_its_slo_at_steady_state():
    """Issue 27: the LMSYS-like workload at 1,000 req/s, TTFT 0.5 s, the
    FleetOpt fleet's long pool (64K, 16 slots an endpoint, slot-bound, its
    requests held for 15 s on average and up to minutes), 600 s of Poisson
    arrivals: its TTFT misses come in bursts when every slot of the pool is
    held, which the held slots' count reaches far more often than a Poisson
    count (Erlang C) says: its variance is `t / W` times its mean
    (``count_peakedness`` in rust/planner/engine.rs). The planned count meets
    both SLOs for 99 % of the pool's requests, and two GPUs fewer do not (one
    fewer may: the goal's tolerance). Before, Erlang C on the Poisson count
    planned this fleet at gamma 1.7 with a long pool of 43 GPUs, which meets
    them for 98.7 % (44 needed); now gamma 1.8, 76 + 41 GPUs, the long pool
    99.1 % at 41 and 91.9 % at 39 (its simulated minimum 41)."""
    long, _, planned, met = _long_pool_planned_and_two_fewer("lmsys-chat-1m", "fleetopt", 42)
    assert (long.name, long.max_context, long.binding) == ("long", 65536, "slot")
    assert met[0] >= 0.99 > met[1], (planned, met)


@pytest.mark.slow
def test_a_prefill_bound_long_pool_is_planned_at_its_simulated_minimum():
    """Issue 27: Azure conversation at 1,000 req/s, TTFT 0.5 s, the
    pool-routing fleet's long pool (B 2,048, prefill-bound: prompts of 3,500
    tokens on average, alike), 600 s of Poisson arrivals, the grid's seed 0:
    a prompt that finds the prefill budget in use waits for the rest of the
    prompt being prefilled, then for the few queued before it, a wait far
    less spread than one exponential of the same mean (``Wait::prefill`` in
    rust/planner/engine.rs). The planned count meets both SLOs for 99 % of
    the pool's requests, and two GPUs fewer do not. Before, the exponential
    tail planned 22 GPUs where 20 meet them (99.36 %; 19: 97.35 %)."""
    long, b_short, planned, met = _long_pool_planned_and_two_fewer(
        "azure-conversation", "pool-routing", 0
    )
    assert (long.name, b_short, long.binding) == ("long", 2048, "prefill")
    assert met[0] >= 0.99 > met[1], (planned, met)


# --- the defects of issue 27 ------------------------------------------------------


def test_rho_max_is_the_paper_models_cap_and_refused_by_the_engine_model():
    """The engine model sizes by the SLO and took rho_max silently (0.5, 0.85
    and 0.99 gave the same fleet): now an error naming the paper model. The
    paper model honours it, exactly."""
    for rho in (0.5, 0.85, 0.99):
        with pytest.raises(ValueError, match='rho_max is the paper model.*model="paper"'):
            plan(AZURE, 1000.0, 2.0, rho_max=rho)
    sizes = []
    for rho in (0.5, 0.85, 0.99):
        h = paper_plan(AZURE, 100_000.0, 2.0, rho_max=rho, b_short=[4096], gammas=[1.0]).homogeneous
        assert h.utilization_long <= rho
        sizes.append(h.n_long)
    assert sizes[0] > sizes[1] > sizes[2]
    default = paper_plan(AZURE, 100_000.0, 2.0, b_short=[4096], gammas=[1.0]).homogeneous
    assert default.n_long == sizes[1]  # FleetOpt's 0.85


# 97% short requests, 3% of 40,000 tokens whose prefill alone (79 chunks of
# 512 at W = 8 ms: 0.63 s) breaks a 500 ms TTFT: no homogeneous fleet and no
# pool-routing fleet meets it, but compress-and-route at B = 24,576, gamma 2
# cuts them to 48 chunks in the short pool and empties the long pool.
LONG_TAIL = Workload([400] * 97 + [39_900] * 3, [100] * 100)


def test_savings_are_not_counted_against_a_homogeneous_fleet_that_misses_the_slo():
    """With no homogeneous fleet meeting the SLO there is no baseline: savings
    are None. They were counted against the homogeneous fleet sized at its
    stability bound (an agent-heavy mix at 1,000 req/s and 500 ms printed a
    9,245-GPU optimum at -870% savings)."""
    r = plan(LONG_TAIL, 1000.0, 0.5, slo_tpot_s=0.08, b_short=[24576], gammas=[1.0, 2.0])
    assert not r.homogeneous.feasible and r.homogeneous.binding_long == "prefill"
    assert not r.candidate(24576, 1.0).feasible
    best = r.best
    assert (best.b_short, best.gamma, best.n_long) == (24576, 2.0, 0) and best.feasible
    assert all(c.savings_vs_homogeneous is None for c in [r.homogeneous, *r.sweep])
    # with a baseline, savings are 1 - cost / its cost
    ok = plan(AZURE, 1000.0, 2.0, slo_tpot_s=0.08)
    assert ok.homogeneous.feasible and ok.homogeneous.savings_vs_homogeneous == 0.0
    b = ok.best
    assert b.savings_vs_homogeneous == pytest.approx(
        1 - b.annual_cost_usd / ok.homogeneous.annual_cost_usd, rel=1e-12
    )


def test_a_pool_met_only_as_the_iteration_time_tends_to_w_is_infeasible():
    """An agent-heavy mix at 500 ms: the long pool of B = 8,192 holds prompts
    whose prefill meets the target only as t_iter tends to W, with ever more
    GPUs. The search stopped with "fleet size overflows" for the whole plan;
    now the pool is infeasible, the rest of the sweep planned."""
    from routecore.planning import agent_heavy_workload

    r = plan(agent_heavy_workload(), 1000.0, 0.5, slo_tpot_s=0.08)
    assert r.best is not None and r.best.feasible
    assert any(not c.feasible_long and c.binding_long == "prefill" for c in r.sweep)


def test_code_is_not_compressed_unless_asked():
    """FleetOpt excludes code from compress-and-route (section 5.2) and so does
    the router: by default only the non-code share of the borderline band
    moves to the short pool (it was all of it, p_c = 1 for code)."""
    total = AZURE.total_tokens
    band = (total > 2048) & (total <= 3072)
    code = AZURE.categories == "code"
    default = plan(AZURE, 1000.0, 2.0, b_short=[2048], gammas=[1.5]).candidate(2048, 1.5)
    assert default.alpha_prime == pytest.approx(default.alpha + (band & ~code).mean(), rel=1e-9)
    asked = plan(
        AZURE, 1000.0, 2.0, b_short=[2048], gammas=[1.5], p_c_by_category={"code": 1.0}
    ).candidate(2048, 1.5)
    assert asked.alpha_prime == pytest.approx(asked.alpha + band.mean(), rel=1e-9)
    from routecore._core import INCOMPRESSIBLE_CATEGORIES

    assert INCOMPRESSIBLE_CATEGORIES == ("code",)


def test_plan_json_is_strict_json():
    """A pool no GPU count serves has unbounded waits (+inf): plan_json
    writes them as null and says why under "nulls"; the result passes
    json.dumps(allow_nan=False), which it failed."""
    import json

    from routecore.planning import plan_json

    r = plan(LONG_TAIL, 1000.0, 0.5, slo_tpot_s=0.08, b_short=[24576], gammas=[1.0, 2.0])
    data = plan_json(r)
    text = json.dumps(data, allow_nan=False)
    assert data["nulls"], "an infeasible pool has non-finite figures"
    for path, why in data["nulls"].items():
        node = json.loads(text)
        for key in path.split("/"):
            node = node[int(key)] if isinstance(node, list) else node[key]
        assert node is None and why.startswith(("+inf", "-inf", "NaN"))
