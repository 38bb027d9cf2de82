use numpy::PyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::sim::{pool_dict, sim_requests, PySimPool};
use super::{int_arg, set_fields};
use crate::planner::disagg::{plan_disagg, DisaggConfig, DisaggPlan, Transfer};
use crate::planner::{EngineSlo, PoolPlan};
use crate::profile::Profile;
use crate::py::profile::PyProfile;
use crate::py::workload::PyWorkload;
use crate::sim::disagg::{simulate_disagg, Decider, DisaggFleet, DisaggReport};
use crate::sim::{percentile, set_arrivals, Arrivals};

/// A disaggregated fleet (``prefill`` and ``decode`` pools) beside the
/// aggregated one (every endpoint ``both``), from ``plan_disaggregated``.
/// Per pool (suffix ``_prefill``, ``_decode``, ``_aggregated``): ``n_`` GPUs,
/// ``feasible_``, ``binding_`` (the resource that sets its count:
/// ``prefill``, ``compute``, ``slot``, ``kv`` or ``none``), ``t_iter_``
/// (seconds; the decode pool's is the mean TPOT), ``utilization_`` (share of
/// slot-time held), ``prefill_utilization_``, ``kv_utilization_``,
/// ``p99_wait_`` and ``p99_ttft_`` (seconds; the prefill pool's is the whole
/// request's TTFT bound, the decode pool's its side of it: slot wait and
/// first step). ``transfer_q_s``: the KV transfer of the (1 + q) / 2
/// quantile prompt. ``gpus`` is ``n_prefill + n_decode``; ``choice`` is
/// ``"aggregated"`` when the aggregated fleet meets the SLO with no more
/// GPUs (or the disaggregated one does not meet it), else
/// ``"disaggregated"``. ``as_dict()`` gives every field.
#[pyclass(frozen, get_all, name = "DisaggPlan", module = "routecore")]
pub struct PyDisaggPlan {
    n_prefill: u64,
    n_decode: u64,
    n_aggregated: u64,
    gpus: u64,
    feasible: bool,
    choice: &'static str,
    slots: u64,
    context: u64,
    arrival_rate: f64,
    transfer_q_s: f64,
    feasible_prefill: bool,
    feasible_decode: bool,
    feasible_aggregated: bool,
    binding_prefill: &'static str,
    binding_decode: &'static str,
    binding_aggregated: &'static str,
    t_iter_prefill_s: f64,
    t_iter_decode_s: f64,
    t_iter_aggregated_s: f64,
    utilization_prefill: f64,
    utilization_decode: f64,
    utilization_aggregated: f64,
    prefill_utilization_prefill: f64,
    prefill_utilization_decode: f64,
    prefill_utilization_aggregated: f64,
    kv_utilization_prefill: f64,
    kv_utilization_decode: f64,
    kv_utilization_aggregated: f64,
    p99_wait_prefill_s: f64,
    p99_wait_decode_s: f64,
    p99_wait_aggregated_s: f64,
    p99_ttft_prefill_s: f64,
    p99_ttft_decode_s: f64,
    p99_ttft_aggregated_s: f64,
}

impl From<&DisaggPlan> for PyDisaggPlan {
    fn from(d: &DisaggPlan) -> Self {
        let (p, q, a): (&PoolPlan, &PoolPlan, &PoolPlan) = (&d.prefill, &d.decode, &d.aggregated);
        PyDisaggPlan {
            n_prefill: p.gpus,
            n_decode: q.gpus,
            n_aggregated: a.gpus,
            gpus: d.gpus,
            feasible: d.feasible,
            choice: if d.aggregated_cheaper {
                "aggregated"
            } else {
                "disaggregated"
            },
            slots: a.n_slots,
            context: a.context,
            arrival_rate: a.arrival_rate,
            transfer_q_s: d.transfer_q_s,
            feasible_prefill: p.feasible,
            feasible_decode: q.feasible,
            feasible_aggregated: a.feasible,
            binding_prefill: p.binding.name(),
            binding_decode: q.binding.name(),
            binding_aggregated: a.binding.name(),
            t_iter_prefill_s: p.t_iter_s,
            t_iter_decode_s: q.t_iter_s,
            t_iter_aggregated_s: a.t_iter_s,
            utilization_prefill: p.utilization,
            utilization_decode: q.utilization,
            utilization_aggregated: a.utilization,
            prefill_utilization_prefill: p.prefill_utilization,
            prefill_utilization_decode: q.prefill_utilization,
            prefill_utilization_aggregated: a.prefill_utilization,
            kv_utilization_prefill: p.kv_utilization,
            kv_utilization_decode: q.kv_utilization,
            kv_utilization_aggregated: a.kv_utilization,
            p99_wait_prefill_s: p.p99_wait_s,
            p99_wait_decode_s: q.p99_wait_s,
            p99_wait_aggregated_s: a.p99_wait_s,
            p99_ttft_prefill_s: p.p99_ttft_s,
            p99_ttft_decode_s: q.p99_ttft_s,
            p99_ttft_aggregated_s: a.p99_ttft_s,
        }
    }
}

#[pymethods]
impl PyDisaggPlan {
    /// Every field as a plain dict (what ``routecore plan --disaggregated
    /// --json`` prints).
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        set_fields!(d, self;
            n_prefill, n_decode, n_aggregated, gpus, feasible, choice, slots, context,
            arrival_rate, transfer_q_s, feasible_prefill, feasible_decode, feasible_aggregated,
            binding_prefill, binding_decode, binding_aggregated, t_iter_prefill_s,
            t_iter_decode_s, t_iter_aggregated_s, utilization_prefill, utilization_decode,
            utilization_aggregated, prefill_utilization_prefill, prefill_utilization_decode,
            prefill_utilization_aggregated, kv_utilization_prefill, kv_utilization_decode,
            kv_utilization_aggregated, p99_wait_prefill_s, p99_wait_decode_s,
            p99_wait_aggregated_s, p99_ttft_prefill_s, p99_ttft_decode_s, p99_ttft_aggregated_s,
        );
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "DisaggPlan(n_prefill={}, n_decode={}, gpus={}, n_aggregated={}, choice={:?}, \
             feasible={})",
            self.n_prefill, self.n_decode, self.gpus, self.n_aggregated, self.choice, self.feasible
        )
    }
}

/// Plans a prefill/decode disaggregated fleet for ``workload`` at
/// ``arrival_rate`` requests/s with P(TTFT <= ``slo_ttft_s``) >= ``quantile``
/// and TPOT <= ``slo_tpot_s`` (None: no target), every endpoint at
/// ``context`` tokens, and the aggregated fleet beside it (docs/planner.md,
/// "Disaggregated fleets"). The KV transfer takes ``latency_s +
/// bytes_per_token * L_in / bandwidth_bytes_s`` (``bytes_per_token``
/// defaults to the profile's KV bytes per token per GPU). ValueError for a
/// rate, SLO, bandwidth or latency that is not a finite number in range
/// (bandwidth > 0), and for requests longer than ``context``.
///
/// >>> d = plan_disaggregated(Workload([900, 3000], [100, 50]), 10.0, 1.0, slo_tpot_s=0.05)
/// >>> d.gpus == d.n_prefill + d.n_decode
/// True
#[pyfunction]
#[pyo3(signature = (
    workload, arrival_rate, slo_ttft_s, profile=None, *, slo_tpot_s=None, quantile=0.99,
    context=65536, bytes_per_token=None, bandwidth_bytes_s=25e9,
    latency_s=0.002
))]
#[allow(clippy::too_many_arguments)]
pub fn plan_disaggregated(
    py: Python<'_>,
    workload: &PyWorkload,
    arrival_rate: f64,
    slo_ttft_s: f64,
    profile: Option<&PyProfile>,
    slo_tpot_s: Option<f64>,
    quantile: f64,
    #[pyo3(from_py_with = int_arg)] context: u64,
    bytes_per_token: Option<f64>,
    bandwidth_bytes_s: f64,
    latency_s: f64,
) -> PyResult<PyDisaggPlan> {
    let profile = profile.map_or_else(Profile::llama3_70b_a100, |p| p.inner.clone());
    let bytes = bytes_per_token.unwrap_or_else(|| profile.kv_bytes_per_token_per_gpu());
    let cfg = DisaggConfig {
        arrival_rate,
        slo: EngineSlo {
            ttft_s: slo_ttft_s,
            tpot_s: slo_tpot_s,
            quantile,
        },
        context,
        transfer: Transfer::new(bytes, bandwidth_bytes_s, latency_s)?,
    };
    let w = workload.inner.clone();
    let d = py.detach(|| plan_disagg(&w, &profile, &cfg))?;
    Ok(PyDisaggPlan::from(&d))
}

/// What ``simulate_disaggregated`` measured: per request ``ttft``, ``tpot``,
/// ``e2e`` (seconds, NaN where it does not apply), ``disaggregated`` (prefilled
/// on a prefill endpoint) and ``measured`` (after the warm-up); ``pools``,
/// one dict per pool (the prefill pool first when there is one), as
/// ``SimReport.pools`` gives them (the model columns NaN); ``summary()``.
#[pyclass(frozen, name = "DisaggReport", module = "routecore")]
pub struct PyDisaggReport {
    report: DisaggReport,
}

#[pymethods]
impl PyDisaggReport {
    #[getter]
    fn ttft<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.report.ttft)
    }
    #[getter]
    fn tpot<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.report.tpot)
    }
    #[getter]
    fn e2e<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.report.e2e)
    }
    #[getter]
    fn disaggregated<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        PyArray1::from_slice(py, &self.report.disaggregated)
    }
    #[getter]
    fn measured<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        PyArray1::from_slice(py, &self.report.measured)
    }
    #[getter]
    fn window(&self) -> (f64, f64) {
        self.report.window
    }
    #[getter]
    fn makespan(&self) -> f64 {
        self.report.makespan
    }
    #[getter]
    fn pools<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.report.pools.iter().map(|p| pool_dict(py, p)).collect()
    }
    /// ``{metric: {"p50", "p90", "p99", "mean"}}`` for ttft, tpot and e2e
    /// over the measured requests.
    fn summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let r = &self.report;
        for (name, xs) in [("ttft", &r.ttft), ("tpot", &r.tpot), ("e2e", &r.e2e)] {
            let finite: Vec<f64> = xs
                .iter()
                .zip(&r.measured)
                .filter(|&(x, &m)| m && x.is_finite())
                .map(|(x, _)| *x)
                .collect();
            let d = PyDict::new(py);
            for q in [50, 90, 99] {
                d.set_item(format!("p{q}"), percentile(&finite, q as f64))?;
            }
            let mean = if finite.is_empty() {
                f64::NAN
            } else {
                finite.iter().sum::<f64>() / finite.len() as f64
            };
            d.set_item("mean", mean)?;
            out.set_item(name, d)?;
        }
        Ok(out)
    }
    fn __repr__(&self) -> String {
        let r = &self.report;
        format!(
            "DisaggReport(requests={}, disaggregated={}, pools={}, makespan={:.3})",
            r.e2e.len(),
            r.disaggregated.iter().filter(|&&d| d).count(),
            r.pools.len(),
            r.makespan
        )
    }
}

/// Simulates a disaggregated fleet: ``decode`` endpoints (which also run the
/// requests the decider keeps aggregated) and ``prefill`` endpoints (None:
/// none, only with ``decider="never"``, the aggregated fleet). ``decider``:
/// ``"always"``, ``"never"`` or ``"conditional"`` (split when the prompt's
/// uncached tokens exceed ``threshold``; no prefix cache is modelled, so all
/// are uncached). A split request is prefilled with one output token, its KV
/// sent in ``latency_s + bytes_per_token * L_in / bandwidth_bytes_s``, then
/// decoded. Dispatch is least-loaded in each pool. The workload and
/// ``arrivals`` / ``rate`` / ``seed`` / ``warmup`` are as ``simulate``'s.
/// ValueError for a fleet with a splitting decider and no prefill pool, a
/// bandwidth that is not > 0, and requests that do not fit a pool.
#[pyfunction]
#[pyo3(signature = (arrival_s, input_tokens, output_tokens, decode, prefill=None, *,
                    decider="always", threshold=0, bytes_per_token=40960.0,
                    bandwidth_bytes_s=25e9,
                    latency_s=0.002, arrivals="trace", rate=None, seed=0,
                    warmup=0.2))]
#[allow(clippy::too_many_arguments)]
pub fn simulate_disaggregated(
    py: Python<'_>,
    arrival_s: &Bound<'_, PyAny>,
    input_tokens: &Bound<'_, PyAny>,
    output_tokens: &Bound<'_, PyAny>,
    decode: PyRef<'_, PySimPool>,
    prefill: Option<PyRef<'_, PySimPool>>,
    decider: &str,
    #[pyo3(from_py_with = int_arg)] threshold: u64,
    bytes_per_token: f64,
    bandwidth_bytes_s: f64,
    latency_s: f64,
    arrivals: &str,
    rate: Option<f64>,
    #[pyo3(from_py_with = int_arg)] seed: u64,
    warmup: f64,
) -> PyResult<PyDisaggReport> {
    let mut requests = sim_requests(arrival_s, input_tokens, output_tokens, None, None, 1)?;
    let arrivals = match (arrivals, rate) {
        ("trace", None) => Arrivals::AsGiven,
        ("trace", Some(r)) => Arrivals::Scaled(r),
        ("poisson", Some(r)) => Arrivals::Poisson(r),
        ("poisson", None) => {
            return Err(PyValueError::new_err("arrivals=\"poisson\" needs a rate"));
        }
        (other, _) => {
            return Err(PyValueError::new_err(format!(
                "arrivals must be \"trace\" or \"poisson\", got {other:?}"
            )));
        }
    };
    set_arrivals(&mut requests, arrivals, seed)?;
    let fleet = DisaggFleet {
        prefill: prefill.map(|p| p.inner.clone()),
        decode: decode.inner.clone(),
        decider: Decider::parse(decider, threshold)?,
        transfer: Transfer::new(bytes_per_token, bandwidth_bytes_s, latency_s)?,
        warmup,
        fast_forward: true,
    };
    let report = py.detach(|| simulate_disagg(&requests, &fleet))?;
    Ok(PyDisaggReport { report })
}
