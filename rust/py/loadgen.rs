//! `load`: the ext_proc load client (rust/serve/loadgen.rs) from Python.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::py::int_arg;
use crate::serve::loadgen::{self, LoadSpec};

/// Drives ext_proc conversations against ``target`` (``HOST:PORT``) as Envoy
/// holds them and returns what it measured: ``requests``, ``refused``,
/// ``errors``, ``statuses`` (conversations per gRPC status their stream ended
/// with: ``{"OK": n, "UNAVAILABLE": m}``; ``DEADLINE_EXCEEDED``: the client's
/// ``timeout_s``), ``refusals`` (per HTTP status of the immediate response:
/// ``{"429": n}``), ``seconds``, ``throughput_per_s``, added latency ``p50_ms``,
/// ``p99_ms``, ``mean_ms``, and per conversation ``server_cpu_ms`` and
/// ``server_context_switches`` (from /proc/<server_pid>; None without it) and
/// ``client_cpu_ms`` (this process). Closed loop with ``concurrency`` streams,
/// or paced at ``rate`` conversations/s; at most ``requests``, and stops
/// starting new ones after ``duration_s``. Each routed conversation waits
/// ``response_delay_s`` before its response (the upstream's time); each step
/// (the call, an answer, the stream's end) is bounded by ``timeout_s``, so a
/// server that stalls or goes away is reported, never waited on. Runs on
/// ``threads`` threads with the interpreter released.
#[pyfunction]
#[pyo3(signature = (target, requests=200, concurrency=8, rate=None, duration_s=None, body_bytes=1024, api_key="demo-key", server_pid=None, threads=1, response_delay_s=0.0, timeout_s=10.0))]
#[allow(clippy::too_many_arguments)]
pub fn load<'py>(
    py: Python<'py>,
    target: &str,
    #[pyo3(from_py_with = int_arg)] requests: u64,
    #[pyo3(from_py_with = int_arg)] concurrency: usize,
    rate: Option<f64>,
    duration_s: Option<f64>,
    #[pyo3(from_py_with = int_arg)] body_bytes: usize,
    api_key: &str,
    #[pyo3(from_py_with = int_arg)] server_pid: Option<u32>,
    #[pyo3(from_py_with = int_arg)] threads: usize,
    response_delay_s: f64,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyDict>> {
    if !(1..=256).contains(&threads) {
        return Err(PyValueError::new_err(format!(
            "threads must be in [1, 256], got {threads}"
        )));
    }
    let spec = LoadSpec {
        target: target.into(),
        requests,
        concurrency,
        rate,
        duration_s,
        body_bytes,
        api_key: api_key.into(),
        server_pid,
        response_delay_s,
        timeout_s,
    };
    let report = py.detach(|| {
        let mut builder = if threads == 1 {
            tokio::runtime::Builder::new_current_thread()
        } else {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(threads);
            b
        };
        let runtime = builder
            .enable_all()
            .build()
            .map_err(|e| crate::error::invalid(format!("runtime: {e}")))?;
        runtime.block_on(loadgen::run(&spec))
    })?;
    let d = PyDict::new(py);
    d.set_item("requests", report.requests)?;
    d.set_item("refused", report.refused)?;
    d.set_item("errors", report.errors)?;
    d.set_item("statuses", report.statuses)?;
    d.set_item("refusals", report.refusals)?;
    d.set_item("seconds", report.seconds)?;
    d.set_item("throughput_per_s", report.throughput_per_s)?;
    d.set_item("p50_ms", report.p50_ms)?;
    d.set_item("p99_ms", report.p99_ms)?;
    d.set_item("mean_ms", report.mean_ms)?;
    d.set_item("server_cpu_ms", report.server_cpu_ms)?;
    d.set_item("server_context_switches", report.server_context_switches)?;
    d.set_item("client_cpu_ms", report.client_cpu_ms)?;
    Ok(d)
}
