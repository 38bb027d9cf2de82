use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{float_array, int_arg, int_array, json_arg, now_or_monotonic};
use crate::autoscale::{AutoscaleConfig, Autoscaler, Desired, LiveWorkload, PoolDemand};
use crate::error::invalid;
use crate::py::profile::PyProfile;

/// The pure autoscaler of issue 26: each pool's desired endpoint count from
/// its live workload (a sliding window of arrival rate and token
/// distributions, per pool and per entitlement), sized by the planner's
/// engine model for the pool's SLO, within ``min_endpoints`` /
/// ``max_endpoints``, damped. For the benches and evaluations, not
/// re-exported from ``routecore`` (the data plane and simulator wiring come
/// later).
///
/// ``config`` is the ``autoscale`` mapping (``period_s``, ``window_s``,
/// ``sub_windows``, ``quantile``, ``scale_down_delay_s``, ``max_step_up``,
/// ``max_step_up_percent``, ``max_step_down``, ``max_step_down_percent``,
/// ``queue_drain_s``, ``forecast_s``, ``max_forecast_ratio``, ``pools``:
/// each with ``name``, ``context``, ``min_endpoints``, ``max_endpoints``,
/// ``slo_ttft_s``, ``slo_tpot_s``, ``entitlements``); ``profiles`` one engine profile per pool. ``now``
/// (seconds) defaults to ``monotonic()``. Bad input raises ValueError (an
/// unknown pool or entitlement KeyError) and changes nothing.
///
///     >>> a = Autoscaler({"pools": [{"name": "p", "context": 8192,
///     ...     "max_endpoints": 50, "slo_ttft_s": 2.0}]},
///     ...     [Profile.llama3_70b_a100()], now=0.0)
///     >>> for i in range(600):
///     ...     a.observe("p", 2000, 200, now=i / 10)
///     >>> a.step(now=60.0)[0]["endpoints"]
///     2
#[pyclass(frozen, name = "Autoscaler", module = "routecore")]
pub struct PyAutoscaler {
    inner: Mutex<Autoscaler>,
}

impl PyAutoscaler {
    fn get(&self) -> MutexGuard<'_, Autoscaler> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn ids(a: &Autoscaler, pool: &str, entitlement: Option<&str>) -> PyResult<(usize, Option<usize>)> {
    let p = a.pool_id(pool)?;
    let e = entitlement.map(|e| a.entitlement_id(p, e)).transpose()?;
    Ok((p, e))
}

fn live_dict<'py>(py: Python<'py>, l: &LiveWorkload) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("requests", l.requests)?;
    d.set_item("span_s", l.span_s)?;
    d.set_item("rate", l.rate)?;
    d.set_item("prompt_mean", l.prompt.mean)?;
    d.set_item("output_mean", l.output_mean)?;
    for (what, p) in [("prompt", l.prompt_tokens), ("output", l.output_tokens)] {
        d.set_item(format!("{what}_p50"), p.p50)?;
        d.set_item(format!("{what}_p90"), p.p90)?;
        d.set_item(format!("{what}_p99"), p.p99)?;
    }
    d.set_item("prefill_chunks_q", l.prefill_chunks_q)?;
    Ok(d)
}

pub(crate) fn desired_dict<'py>(py: Python<'py>, d: &Desired) -> PyResult<Bound<'py, PyDict>> {
    let t = &d.target;
    let out = PyDict::new(py);
    out.set_item("pool", &d.pool)?;
    out.set_item("endpoints", d.endpoints)?;
    out.set_item("target", t.endpoints)?;
    out.set_item("model_endpoints", t.model_endpoints)?;
    out.set_item("reason", t.reason.name())?;
    out.set_item("binding", t.binding.name())?;
    out.set_item("rate", t.rate)?;
    out.set_item("observed_rate", t.observed_rate)?;
    out.set_item("queued_rate", t.queued_rate)?;
    out.set_item("promised_rate", t.promised_rate)?;
    for (what, p) in [("prompt", t.prompt_tokens), ("output", t.output_tokens)] {
        out.set_item(format!("{what}_p50"), p.p50)?;
        out.set_item(format!("{what}_p99"), p.p99)?;
    }
    out.set_item("p99_ttft_s", t.p99_ttft_s)?;
    out.set_item("t_iter_s", t.t_iter_s)?;
    out.set_item("explanation", d.to_string())?;
    Ok(out)
}

fn tokens(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    int_array(obj, what)?
        .into_iter()
        .map(|v| {
            u64::try_from(v).map_err(|_| invalid(format!("{what} must be >= 0, got {v}")).into())
        })
        .collect()
}

#[pymethods]
impl PyAutoscaler {
    #[new]
    #[pyo3(signature = (config, profiles, now=None))]
    fn new(
        config: &Bound<'_, PyAny>,
        profiles: Vec<PyRef<'_, PyProfile>>,
        now: Option<f64>,
    ) -> PyResult<Self> {
        let cfg = AutoscaleConfig::from_value(json_arg(config, "config")?)?;
        let profiles = profiles.iter().map(|p| p.inner.clone()).collect();
        Ok(Self {
            inner: Mutex::new(Autoscaler::new(cfg, profiles, now_or_monotonic(now))?),
        })
    }

    /// Counts a finished request of ``prompt_tokens`` and ``output_tokens``
    /// in pool ``pool`` (and in ``entitlement``'s window).
    #[pyo3(signature = (pool, prompt_tokens, output_tokens, entitlement=None, now=None))]
    fn observe(
        &self,
        pool: &str,
        #[pyo3(from_py_with = int_arg)] prompt_tokens: u64,
        #[pyo3(from_py_with = int_arg)] output_tokens: u64,
        entitlement: Option<&str>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let mut a = self.get();
        let (p, e) = ids(&a, pool, entitlement)?;
        Ok(a.observe(p, e, now_or_monotonic(now), prompt_tokens, output_tokens)?)
    }

    /// ``observe`` for arrays of equal length (``now`` in seconds), all
    /// checked before any is counted.
    #[pyo3(signature = (pool, prompt_tokens, output_tokens, now, entitlement=None))]
    fn observe_many(
        &self,
        py: Python<'_>,
        pool: &str,
        prompt_tokens: &Bound<'_, PyAny>,
        output_tokens: &Bound<'_, PyAny>,
        now: &Bound<'_, PyAny>,
        entitlement: Option<&str>,
    ) -> PyResult<()> {
        let prompt = tokens(prompt_tokens, "prompt_tokens")?;
        let output = tokens(output_tokens, "output_tokens")?;
        let now = float_array(now, "now")?;
        let (p, e) = ids(&self.get(), pool, entitlement)?;
        py.detach(|| self.get().observe_many(p, e, &now, &prompt, &output))?;
        Ok(())
    }

    /// The live workload of ``pool`` (or of its ``entitlement``): requests,
    /// span_s, rate, prompt_mean, output_mean, prompt and output p50 / p90 /
    /// p99 (each at most 3.125 % above the exact one), prefill_chunks_q.
    #[pyo3(signature = (pool, entitlement=None, now=None))]
    fn live<'py>(
        &self,
        py: Python<'py>,
        pool: &str,
        entitlement: Option<&str>,
        now: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut a = self.get();
        let (p, e) = ids(&a, pool, entitlement)?;
        let l = a.live(p, e, now_or_monotonic(now))?;
        live_dict(py, &l)
    }

    /// One sizing step: per pool, its damped ``endpoints`` and what explains
    /// it (target, model_endpoints, reason, binding, the rates, token
    /// percentiles, p99_ttft_s, t_iter_s, explanation). ``queued``: requests
    /// flow control holds per pool; ``promised``: the entitlements' promised
    /// tokens per second per pool (a floor).
    #[pyo3(signature = (now=None, queued=None, promised=None))]
    fn step<'py>(
        &self,
        py: Python<'py>,
        now: Option<f64>,
        queued: Option<HashMap<String, f64>>,
        promised: Option<HashMap<String, f64>>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let mut a = self.get();
        let names: Vec<String> = a.config().pools.iter().map(|p| p.name.clone()).collect();
        for m in [&queued, &promised].into_iter().flatten() {
            if let Some(k) = m.keys().find(|k| !names.contains(k)) {
                return Err(crate::error::unknown("pool", k.clone()).into());
            }
        }
        let get = |m: &Option<HashMap<String, f64>>, n: &String| {
            m.as_ref().and_then(|m| m.get(n)).copied().unwrap_or(0.0)
        };
        let demand: Vec<PoolDemand> = names
            .iter()
            .map(|n| PoolDemand {
                queued_requests: get(&queued, n),
                promised_tokens_per_s: get(&promised, n),
                busy_endpoints: 0.0,
                ready_endpoints: None,
            })
            .collect();
        let out = a.step(now_or_monotonic(now), &demand)?;
        out.iter().map(|d| desired_dict(py, d)).collect()
    }
}
