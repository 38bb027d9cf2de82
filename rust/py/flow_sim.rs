//! The binding of the flow-control evaluation (`crate::sim::flow`): one run
//! of one of the token-pool paper's experiments under one policy.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::int_arg;
use crate::sim::flow::{run_flow, FlowPolicy, FlowScenario, GroupSummary};

fn group<'py>(py: Python<'py>, g: &GroupSummary) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &g.name)?;
    d.set_item("requests", g.requests)?;
    d.set_item("served", g.served)?;
    d.set_item("refused", g.refused)?;
    d.set_item("expired", g.expired)?;
    d.set_item("displaced", g.displaced)?;
    d.set_item("p99_ttft_s", g.p99_ttft)?;
    d.set_item("mean_queued_s", g.mean_queued)?;
    Ok(d)
}

/// Runs experiment 1 (cross-class protection) or 2 (SLO-aware fair share)
/// of the token-pool paper under ``policy`` (``"refuse"``, ``"fcfs"`` or
/// ``"token-pool"``; see ``routecore flow-eval --help``), ``scale`` times as
/// long, a request waiting at most ``ttl_s`` in the queue. A dict with
/// ``experiment``, ``name``, ``policy``, ``goodput_tokens_per_s``,
/// ``refused_share``, ``time_to_fairness_s`` (None when never),
/// ``scarcity_jain`` (NaN in experiment 1), ``classes`` and ``tenants``
/// (dicts with ``name``, ``requests``, ``served``, ``refused``, ``expired``,
/// ``displaced``, ``p99_ttft_s``, ``mean_queued_s``) and ``timeline`` (per
/// second: ``t``, ``slots``, ``running``, ``queued``, ``occupancy`` per
/// tenant, ``jain``).
#[pyfunction]
#[pyo3(signature = (experiment, policy, scale=1.0, ttl_s=30.0, seed=0))]
pub fn flow_eval<'py>(
    py: Python<'py>,
    #[pyo3(from_py_with = int_arg)] experiment: i64,
    policy: &str,
    scale: f64,
    ttl_s: f64,
    #[pyo3(from_py_with = int_arg)] seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let policy = FlowPolicy::parse(policy)?;
    let number = u32::try_from(experiment).unwrap_or(0);
    let scenario = FlowScenario::experiment(number, scale, ttl_s, seed)?;
    let (run, summary) = py.detach(|| {
        run_flow(&scenario, policy).map(|run| {
            let summary = run.summary(&scenario);
            (run, summary)
        })
    })?;
    let d = PyDict::new(py);
    d.set_item("experiment", experiment)?;
    d.set_item("name", &scenario.name)?;
    d.set_item("policy", policy.as_str())?;
    d.set_item("goodput_tokens_per_s", summary.goodput)?;
    d.set_item("refused_share", summary.refused_share)?;
    d.set_item("time_to_fairness_s", summary.time_to_fairness)?;
    d.set_item("scarcity_jain", summary.scarcity_jain)?;
    let groups = |gs: &[GroupSummary]| -> PyResult<Vec<Bound<'py, PyDict>>> {
        gs.iter().map(|g| group(py, g)).collect()
    };
    d.set_item("classes", groups(&summary.classes)?)?;
    d.set_item("tenants", groups(&summary.tenants)?)?;
    let timeline = run
        .timeline
        .iter()
        .map(|s| {
            let t = PyDict::new(py);
            t.set_item("t", s.t)?;
            t.set_item("slots", s.slots)?;
            t.set_item("running", s.running)?;
            t.set_item("queued", s.queued)?;
            t.set_item("occupancy", &s.occupancy)?;
            t.set_item("jain", s.jain)?;
            Ok(t)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("timeline", timeline)?;
    Ok(d)
}
