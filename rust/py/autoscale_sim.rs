//! The autoscaling simulation (issue 26): rate profiles and one run of a
//! pool under a policy ([`crate::sim::autoscale`]).

use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::profile::PyProfile;
use super::sim::{picker_specs, sim_requests, with_progress};
use super::{float_array, int_arg, json_arg};
use crate::autoscale::AutoscaleConfig;
use crate::error::invalid;
use crate::sim::autoscale::policy::{
    Fixed, Hindsight, ModelBased, Saturation, SaturationRule, Sizer,
};
use crate::sim::autoscale::{run, Policy, ScaleConfig, ScaleReport};
use crate::sim::engine::blocks_for;
use crate::sim::profile::RateProfile;
use crate::sim::timing::LinearTiming;
use crate::sim::PoolConfig;

/// A request rate over time, from a spec: ``"step:500@0,2000@600"`` (500
/// req/s from 0 s, 2,000 from 600 s), ``"diurnal:low=500,high=2000,period=1200"``
/// (a day-shaped curve from its trough at 0 to its peak at ``period / 2``)
/// or ``"burst:base=500,peak=2000,at=300,length=60[,every=600]"``. A bad
/// spec raises ValueError saying what is wrong.
///
///     >>> p = RateProfile("step:500@0,2000@600")
///     >>> p.rate(599.0), p.rate(600.0), p.cumulative(700.0)
///     (500.0, 2000.0, 500000.0)
#[pyclass(frozen, name = "RateProfile", module = "routecore")]
pub struct PyRateProfile {
    inner: RateProfile,
    spec: String,
}

#[pymethods]
impl PyRateProfile {
    #[new]
    fn new(spec: &str) -> PyResult<Self> {
        Ok(Self {
            inner: RateProfile::parse(spec)?,
            spec: spec.to_owned(),
        })
    }

    /// The spec it was made from.
    #[getter]
    fn spec(&self) -> &str {
        &self.spec
    }

    /// The rate at ``t`` seconds, requests per second.
    fn rate(&self, t: f64) -> f64 {
        self.inner.rate(t)
    }

    /// The expected requests in ``[0, t]``: the integral of the rate.
    fn cumulative(&self, t: f64) -> f64 {
        self.inner.cumulative(t)
    }

    /// The highest rate in ``[0, until]``.
    fn peak(&self, until: f64) -> f64 {
        self.inner.peak(until)
    }

    /// The times in ``(0, until)`` where the rate jumps up (steps, bursts).
    fn rises(&self, until: f64) -> Vec<f64> {
        self.inner.rises(until)
    }

    /// Arrival times in ``[0, duration_s]``: a Poisson process following the
    /// rate (seeded), or with ``trace_s`` a trace's own timestamps scaled to
    /// it (shifted to 0, scaled to a mean rate of 1, repeated end to end,
    /// mapped through the profile: its burstiness kept). Timestamps that go
    /// backwards raise ValueError naming the row.
    #[pyo3(signature = (duration_s, *, seed=0, trace_s=None))]
    fn arrivals<'py>(
        &self,
        py: Python<'py>,
        duration_s: f64,
        #[pyo3(from_py_with = int_arg)] seed: u64,
        trace_s: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let trace = trace_s.map(|t| float_array(t, "trace_s")).transpose()?;
        let inner = &self.inner;
        let times = py.detach(|| match &trace {
            Some(t) => inner.scaled_trace(t, duration_s),
            None => inner.poisson(duration_s, seed),
        })?;
        Ok(times.into_pyarray(py))
    }

    fn __repr__(&self) -> String {
        format!("RateProfile({:?})", self.spec)
    }
}

/// The four policies by name: ``static`` (the engine model's count at the
/// profile's peak rate), ``hindsight``, ``saturation``, ``routecore``.
pub const POLICIES: [&str; 4] = ["static", "hindsight", "saturation", "routecore"];

/// One autoscaled run: a pool of ``profile``'s engines, each ``context``
/// tokens of context (``config["pools"][0]``: its bounds and SLO), under
/// ``policy`` (see ``POLICIES``), the requests arriving at ``arrival_s``
/// (sorted, within ``horizon_s``). Endpoints take ``startup_s`` to start and
/// drain before they stop; the pool starts with the engine model's count
/// for the rate at 0 s (``static``: at the peak), ready. ``config`` is the
/// ``autoscale`` mapping (``period_s``, window, damping, ``pools``); the
/// ``saturation`` mapping sets the saturation rule's thresholds (``up``,
/// ``queue_up``, ``down``, ``step_percent``). ``rate_profile`` is the true
/// rate (the hindsight policy's knowledge; its rises mark the start-up delays
/// left out of the attainment). Returns a dict: per request ``ttft``,
/// ``tpot``, ``e2e``, ``met``, ``excluded``, ``endpoint``; per decision
/// ``ticks`` (``time``, ``desired``, ``ready``, ``starting``, ``draining``,
/// ``waiting``); ``gpu_hours``, ``attainment``, ``initial_endpoints``,
/// ``peak_endpoints``, ``started``, ``stopped``.
#[pyfunction]
#[pyo3(signature = (arrival_s, input_tokens, output_tokens, profile, config, *,
                    rate_profile, policy, horizon_s, startup_s=60.0, saturation=None,
                    dispatch=None, progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn autoscale_simulate<'py>(
    py: Python<'py>,
    arrival_s: &Bound<'py, PyAny>,
    input_tokens: &Bound<'py, PyAny>,
    output_tokens: &Bound<'py, PyAny>,
    profile: PyRef<'py, PyProfile>,
    config: &Bound<'py, PyAny>,
    rate_profile: PyRef<'py, PyRateProfile>,
    policy: &str,
    horizon_s: f64,
    startup_s: f64,
    saturation: Option<&Bound<'py, PyAny>>,
    dispatch: Option<&Bound<'py, PyAny>>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let requests = sim_requests(arrival_s, input_tokens, output_tokens, None, None, 0)?;
    let cfg = AutoscaleConfig::from_value(json_arg(config, "config")?)?;
    let rule: SaturationRule = match saturation {
        Some(s) => serde_json::from_value(json_arg(s, "saturation")?)
            .map_err(|e| invalid(format!("saturation: {e}")))?,
        None => SaturationRule::default(),
    };
    let picker = picker_specs(dispatch)?;
    let profile = profile.inner.clone();
    let rates = rate_profile.inner.clone();
    if !POLICIES.contains(&policy) {
        return Err(PyValueError::new_err(format!(
            "policy must be one of {}, got {policy:?}",
            POLICIES.join(", ")
        )));
    }
    let n = requests.len() as u64;
    let (report, initial) = with_progress(py, n, progress.as_ref(), |done| {
        let Some(scaling) = cfg.pools.first().cloned() else {
            return Err(invalid("autoscale: one pool is needed"));
        };
        if cfg.pools.len() != 1 {
            return Err(invalid(format!(
                "autoscale: the simulator scales one pool, got {}",
                cfg.pools.len()
            )));
        }
        profile.validate()?;
        let slots = profile.slots(scaling.context)?;
        let mut sizer = Sizer::new(&cfg, &profile, &requests)?;
        let start = if policy == "static" {
            sizer.endpoints(rates.peak(horizon_s))?
        } else {
            sizer.endpoints(rates.rate(0.0))?
        };
        let timing = std::sync::Arc::new(LinearTiming::new(profile.w_s, profile.h_s)?);
        let kv_blocks = slots.saturating_mul(blocks_for(scaling.context));
        let pool = PoolConfig::new(
            &scaling.name,
            start as i64,
            scaling.context as i64,
            slots as i64,
            kv_blocks as i64,
            profile.c_chunk as i64,
            1,
            None,
            timing,
        )?;
        let lead = startup_s + cfg.period_s;
        let mut chosen: Box<dyn Policy> = match policy {
            "static" => Box::new(Fixed(start)),
            "hindsight" => Box::new(Hindsight::new(sizer, rates.clone(), lead)?),
            "saturation" => Box::new(Saturation::new(rule, &cfg, start)?),
            _ => Box::new(ModelBased::new(cfg.clone(), profile.clone(), start)?),
        };
        let sc = ScaleConfig {
            pool,
            scaling,
            period_s: cfg.period_s,
            startup_s,
            horizon_s,
            picker,
            rises: rates.rises(horizon_s),
        };
        Ok((run(&requests, &sc, chosen.as_mut(), done)?, start))
    })?;
    report_dict(py, policy, &report, initial)
}

fn report_dict<'py>(
    py: Python<'py>,
    policy: &str,
    r: &ScaleReport,
    initial: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("policy", policy)?;
    d.set_item("ttft", r.ttft.clone().into_pyarray(py))?;
    d.set_item("tpot", r.tpot.clone().into_pyarray(py))?;
    d.set_item("e2e", r.e2e.clone().into_pyarray(py))?;
    d.set_item("met", r.met.clone().into_pyarray(py))?;
    d.set_item("excluded", r.excluded.clone().into_pyarray(py))?;
    d.set_item("endpoint", r.endpoint.clone().into_pyarray(py))?;
    let ticks = PyDict::new(py);
    let col = |f: fn(&crate::sim::autoscale::Tick) -> f64| -> Vec<f64> {
        r.ticks.iter().map(f).collect()
    };
    ticks.set_item("time", col(|t| t.time).into_pyarray(py))?;
    for (name, f) in [
        (
            "desired",
            (|t| t.desired) as fn(&crate::sim::autoscale::Tick) -> u64,
        ),
        ("ready", |t| t.ready),
        ("starting", |t| t.starting),
        ("draining", |t| t.draining),
        ("waiting", |t| t.waiting),
    ] {
        let v: Vec<u64> = r.ticks.iter().map(f).collect();
        ticks.set_item(name, v.into_pyarray(py))?;
    }
    d.set_item("ticks", ticks)?;
    d.set_item("gpu_hours", r.gpu_seconds / 3600.0)?;
    d.set_item("attainment", r.attainment)?;
    d.set_item("initial_endpoints", initial)?;
    d.set_item("peak_endpoints", r.peak_endpoints)?;
    d.set_item("started", r.started)?;
    d.set_item("stopped", r.stopped)?;
    Ok(d)
}
