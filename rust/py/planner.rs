use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::planner::{self, Candidate, PlanConfig};
use crate::profile::Profile;
use crate::py::profile::PyProfile;
use crate::py::workload::PyWorkload;
use crate::py::{int_arg, set_fields};

/// One fleet of a plan: a short pool at ``b_short`` tokens and a long pool,
/// with C&R at bandwidth ``gamma``. The homogeneous fleet has ``b_short == 0``
/// and every GPU in the long pool. A pool with no traffic has 0 GPUs. A pool
/// that no GPU count lets meet the SLO (its prefill alone breaks the TTFT
/// target, the TPOT target is below W, or no request fits a slot) is marked
/// ``feasible_* = False``; ``best`` and ``pool_routing`` skip infeasible
/// fleets. Per pool: ``utilization_*`` is the share of slot-time held
/// (``occupancy_*``, sequences per GPU, over ``slots_*``: the figure the
/// simulator reports too), ``prefill_utilization_*`` the prefill budget's,
/// ``kv_utilization_*`` the KV cache's (an upper bound), and ``binding_*``
/// the resource that sets the GPU count: ``compute``, ``slot``, ``kv``,
/// ``prefill`` or ``none``. ``as_dict()`` gives every field.
#[pyclass(frozen, get_all, name = "Candidate", module = "routecore")]
pub struct PyCandidate {
    b_short: u64,
    gamma: f64,
    alpha: f64,
    beta: f64,
    alpha_prime: f64,
    n_short: u64,
    n_long: u64,
    gpus: u64,
    feasible: bool,
    feasible_short: bool,
    feasible_long: bool,
    slots_short: u64,
    slots_long: u64,
    context_short: u64,
    context_long: u64,
    arrival_rate_short: f64,
    arrival_rate_long: f64,
    mu_gpu_short: f64,
    mu_gpu_long: f64,
    cs2_short: f64,
    cs2_long: f64,
    utilization_short: f64,
    utilization_long: f64,
    occupancy_short: f64,
    occupancy_long: f64,
    prefill_utilization_short: f64,
    prefill_utilization_long: f64,
    kv_utilization_short: f64,
    kv_utilization_long: f64,
    binding_short: &'static str,
    binding_long: &'static str,
    t_iter_short_s: f64,
    t_iter_long_s: f64,
    prefill_p99_short_s: f64,
    prefill_p99_long_s: f64,
    p99_wait_short_s: f64,
    p99_wait_long_s: f64,
    p99_ttft_short_s: f64,
    p99_ttft_long_s: f64,
    annual_cost_usd: f64,
    savings_vs_homogeneous: Option<f64>,
}

impl From<&Candidate> for PyCandidate {
    fn from(c: &Candidate) -> Self {
        PyCandidate {
            b_short: c.b_short,
            gamma: c.gamma,
            alpha: c.alpha,
            beta: c.beta,
            alpha_prime: c.alpha_prime,
            n_short: c.short.gpus,
            n_long: c.long.gpus,
            gpus: c.gpus,
            feasible: c.feasible,
            feasible_short: c.short.feasible,
            feasible_long: c.long.feasible,
            slots_short: c.short.n_slots,
            slots_long: c.long.n_slots,
            context_short: c.short.context,
            context_long: c.long.context,
            arrival_rate_short: c.short.arrival_rate,
            arrival_rate_long: c.long.arrival_rate,
            mu_gpu_short: c.short.mu_gpu,
            mu_gpu_long: c.long.mu_gpu,
            cs2_short: c.short.cs2,
            cs2_long: c.long.cs2,
            utilization_short: c.short.utilization,
            utilization_long: c.long.utilization,
            occupancy_short: c.short.occupancy,
            occupancy_long: c.long.occupancy,
            prefill_utilization_short: c.short.prefill_utilization,
            prefill_utilization_long: c.long.prefill_utilization,
            kv_utilization_short: c.short.kv_utilization,
            kv_utilization_long: c.long.kv_utilization,
            binding_short: c.short.binding.name(),
            binding_long: c.long.binding.name(),
            t_iter_short_s: c.short.t_iter_s,
            t_iter_long_s: c.long.t_iter_s,
            prefill_p99_short_s: c.short.prefill_p99_s,
            prefill_p99_long_s: c.long.prefill_p99_s,
            p99_wait_short_s: c.short.p99_wait_s,
            p99_wait_long_s: c.long.p99_wait_s,
            p99_ttft_short_s: c.short.p99_ttft_s,
            p99_ttft_long_s: c.long.p99_ttft_s,
            annual_cost_usd: c.annual_cost_usd,
            savings_vs_homogeneous: c.savings_vs_homogeneous,
        }
    }
}

#[pymethods]
impl PyCandidate {
    /// Every field as a plain dict (what ``routecore plan --json`` prints).
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        set_fields!(d, self;
            b_short, gamma, alpha, beta, alpha_prime, n_short, n_long, gpus, feasible,
            feasible_short, feasible_long, slots_short, slots_long, context_short,
            context_long, arrival_rate_short, arrival_rate_long, mu_gpu_short, mu_gpu_long,
            cs2_short, cs2_long, utilization_short, utilization_long, occupancy_short,
            occupancy_long, prefill_utilization_short, prefill_utilization_long,
            kv_utilization_short, kv_utilization_long, binding_short, binding_long, t_iter_short_s,
            t_iter_long_s, prefill_p99_short_s, prefill_p99_long_s, p99_wait_short_s,
            p99_wait_long_s, p99_ttft_short_s, p99_ttft_long_s, annual_cost_usd,
            savings_vs_homogeneous,
        );
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "Candidate(b_short={}, gamma={}, n_short={}, n_long={}, gpus={}, annual_cost_usd={:.0}, savings_vs_homogeneous={}, feasible={})",
            self.b_short, self.gamma, self.n_short, self.n_long, self.gpus,
            self.annual_cost_usd,
            self.savings_vs_homogeneous.map_or("None".to_string(), |s| format!("{s:.4}")),
            self.feasible
        )
    }
}

/// The result of ``plan``: ``homogeneous``, ``pool_routing`` (cheapest
/// feasible fleet at gamma = 1), ``best`` (cheapest feasible fleet), each a
/// ``Candidate`` (None when no candidate is feasible), and ``sweep``, every
/// (b_short, gamma) candidate in sweep order.
#[pyclass(frozen, name = "Plan", module = "routecore")]
pub struct PyPlan {
    plan: planner::Plan,
}

#[pymethods]
impl PyPlan {
    #[getter]
    fn homogeneous(&self) -> PyCandidate {
        (&self.plan.homogeneous).into()
    }

    #[getter]
    fn best(&self) -> Option<PyCandidate> {
        self.plan.best.map(|i| (&self.plan.sweep[i]).into())
    }

    #[getter]
    fn pool_routing(&self) -> Option<PyCandidate> {
        self.plan.pool_routing.map(|i| (&self.plan.sweep[i]).into())
    }

    #[getter]
    fn sweep(&self) -> Vec<PyCandidate> {
        self.plan.sweep.iter().map(Into::into).collect()
    }

    /// The sweep's candidate at (``b_short``, ``gamma``); KeyError if absent.
    fn candidate(
        &self,
        #[pyo3(from_py_with = int_arg)] b_short: u64,
        gamma: f64,
    ) -> PyResult<PyCandidate> {
        self.plan
            .candidate(b_short, gamma)
            .map(Into::into)
            .ok_or_else(|| {
                crate::error::unknown("candidate", format!("b_short={b_short}, gamma={gamma}"))
                    .into()
            })
    }

    fn __len__(&self) -> usize {
        self.plan.sweep.len()
    }

    fn __repr__(&self) -> String {
        let best = self.plan.best.map(|i| &self.plan.sweep[i]);
        format!(
            "Plan(candidates={}, homogeneous_gpus={}, best={})",
            self.plan.sweep.len(),
            self.plan.homogeneous.gpus,
            best.map_or("None".to_string(), |c| format!(
                "(b_short={}, gamma={}, gpus={})",
                c.b_short, c.gamma, c.gpus
            ))
        )
    }
}

/// Plans the cheapest two-pool fleet for ``workload`` at ``arrival_rate``
/// requests/s under a P99 TTFT target ``slo_ttft_s`` (FleetOpt Algorithm 1)
/// and, with the engine model, a TPOT target ``slo_tpot_s`` (None: none).
///
/// ``model="engine"`` (default) sizes each pool with the model of the
/// engine the simulator runs: iteration time ``W + H n_active`` at the
/// occupancy it predicts, one ``C_chunk`` prefill budget per iteration
/// shared by the prefilling prompts, TTFT including the wait for it; see
/// the Rust docs of ``engine_state``. ``model="paper"`` is FleetOpt's Eq. 3-4
/// (full-batch iteration time, Erlang-C / Kimura wait, the cap ``rho_max``),
/// which reproduces the paper's numbers.
///
/// Sweeps ``b_short`` (default: 256 ... 49,152 tokens where a GPU holds more
/// slots than at ``long_context``) and ``gammas`` (default 1.0, 1.1, ..., 2.0).
/// ``p_c`` is the compressibility of borderline requests, overridden per
/// category by ``p_c_by_category`` (e.g. ``{"prose": 0.5}``; KeyError for a
/// category the workload lacks); a ``code`` category is never compressed
/// unless ``p_c_by_category`` says so (FleetOpt excludes code). ``phi`` is
/// the long/short GPU cost ratio; ``rho_max`` the paper model's utilization
/// cap (default FleetOpt's 0.85; a ValueError with the engine model, which
/// sizes by the SLO directly). Each pool gets the fewest GPUs meeting every
/// constraint. Cost is at the profile's $/GPU-hour for 8,760 h/year;
/// ``savings_vs_homogeneous`` is None when the homogeneous fleet misses the
/// SLO (no baseline). ValueError when no fleet meets the SLO (naming the binding
/// constraint), for a non-positive rate, and for a workload with requests
/// longer than ``long_context``.
///
/// >>> p = plan(Workload([900, 100, 3000], [100, 50, 1000]), 10.0, 0.5)
/// >>> p.best.gpus <= p.homogeneous.gpus
/// True
#[pyfunction]
#[pyo3(signature = (
    workload, arrival_rate, slo_ttft_s, profile=None, *, b_short=None, gammas=None,
    p_c=1.0, p_c_by_category=None, phi=1.0, rho_max=None, long_context=65536,
    prefill_quantile=0.99, model="engine", slo_tpot_s=None
))]
#[allow(clippy::too_many_arguments)]
pub fn plan(
    py: Python<'_>,
    workload: &PyWorkload,
    arrival_rate: f64,
    slo_ttft_s: f64,
    profile: Option<&PyProfile>,
    #[pyo3(from_py_with = int_arg)] b_short: Option<Vec<u64>>,
    gammas: Option<Vec<f64>>,
    p_c: f64,
    p_c_by_category: Option<std::collections::BTreeMap<String, f64>>,
    phi: f64,
    rho_max: Option<f64>,
    #[pyo3(from_py_with = int_arg)] long_context: u64,
    prefill_quantile: f64,
    model: &str,
    slo_tpot_s: Option<f64>,
) -> PyResult<PyPlan> {
    let profile = profile.map_or_else(Profile::llama3_70b_a100, |p| p.inner.clone());
    let cfg = PlanConfig {
        arrival_rate,
        slo_ttft_s,
        rho_max,
        b_short: b_short.unwrap_or_default(),
        gammas: gammas.unwrap_or_default(),
        long_context,
        p_c,
        p_c_by_category: p_c_by_category.unwrap_or_default().into_iter().collect(),
        phi,
        prefill_quantile,
        model: planner::ServiceModel::parse(model)?,
        slo_tpot_s,
    };
    let w = workload.inner.clone();
    let plan = py.detach(|| planner::plan(&w, &profile, &cfg))?;
    Ok(PyPlan { plan })
}

/// ``alpha * (1 - 1/rho)``: the GPU fraction pool routing saves (token-budget
/// paper Eq. 7; rho = short/long throughput per GPU).
///
/// >>> round(pool_routing_savings(0.80, 4.0), 12)
/// 0.6
#[pyfunction]
pub fn pool_routing_savings(alpha: f64, rho: f64) -> PyResult<f64> {
    Ok(planner::pool_routing_savings(alpha, rho)?)
}

/// ``alpha * lambda / mu_short + (1 - alpha) * lambda / mu_long``: the
/// corrected dual-pool GPU count (token-budget paper Eq. 8), with mu_long
/// measured on the long pool's own traffic.
///
/// >>> round(g_dual(0.917, 1000.0, 13.5, 0.37))
/// 292
#[pyfunction]
pub fn g_dual(alpha: f64, arrival_rate: f64, mu_short: f64, mu_long: f64) -> PyResult<f64> {
    Ok(planner::g_dual(alpha, arrival_rate, mu_short, mu_long)?)
}

/// ``gpus * price_per_gpu_hour * hours_per_year`` in USD.
///
/// >>> round(annual_cost_usd(284, 2.21) / 1000)
/// 5498
#[pyfunction]
#[pyo3(signature = (gpus, price_per_gpu_hour, hours_per_year=8760.0))]
pub fn annual_cost_usd(gpus: f64, price_per_gpu_hour: f64, hours_per_year: f64) -> PyResult<f64> {
    Ok(planner::annual_cost_usd(
        gpus,
        price_per_gpu_hour,
        hours_per_year,
    )?)
}
