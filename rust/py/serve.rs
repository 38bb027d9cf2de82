use std::collections::HashMap;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::calibrate::Calibrator;
use crate::py::calibrate::PyCalibrator;
use crate::py::int_arg;
use crate::py::tokenize::PyTokenizer;
use crate::serve::config::Spec;
use crate::serve::engine::{Caller, Fields, Hints, Outcome, Reject};
use crate::serve::front::{authenticate_once, feedback_once, route_once, Routing};
use crate::serve::runtime::{DataPlane, Listen};

/// The data plane of ``routecore serve``: Envoy's ext_proc (and
/// ``grpc.health.v1``) served from Rust on a tokio runtime owned by this
/// object, Prometheus metrics on their own port, structured JSON logs on
/// stderr. A conversation never enters the interpreter.
///
/// Python is the control plane: it validates the configuration
/// (``routecore.config``) and hands its JSON spec to :meth:`start` and
/// :meth:`reload`, owns the signals and the state file, and serves the
/// RouteCore API, which routes through :meth:`route_body` /
/// :meth:`route_fields` / :meth:`finish` on the same state (calibrator,
/// leases, admission). Every call that waits releases the interpreter.
#[pyclass(frozen, name = "DataPlane", module = "routecore")]
pub struct PyDataPlane {
    inner: DataPlane,
}

fn outcome_dict<'py>(py: Python<'py>, outcome: Outcome) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match outcome {
        Ok(r) => {
            d.set_item("admitted", true)?;
            d.set_item("request_id", r.request_id)?;
            d.set_item("pool", r.pool)?;
            d.set_item("endpoint", r.endpoint)?;
            d.set_item("prefill_endpoint", r.prefill_endpoint)?;
            d.set_item("est_input_tokens", r.est_input_tokens)?;
            d.set_item("est_output_tokens", r.est_output_tokens)?;
            d.set_item("spilled", r.spilled)?;
            d.set_item("reason", r.reason)?;
            d.set_item("compress_target_tokens", r.compress_target_tokens)?;
            d.set_item("body", r.body.map(|b| PyBytes::new(py, &b)))?;
        }
        Err(rej) => {
            d.set_item("admitted", false)?;
            refusal(&d, rej)?;
        }
    }
    Ok(d)
}

/// A refusal's fields: ``status`` (HTTP), ``bad_request``, ``reason``,
/// ``message``, ``retry_after_s``.
fn refusal(d: &Bound<'_, PyDict>, rej: Reject) -> PyResult<()> {
    d.set_item("status", rej.status)?;
    d.set_item("bad_request", rej.is_bad_request())?;
    d.set_item("reason", rej.reason)?;
    d.set_item("message", rej.message)?;
    d.set_item("retry_after_s", rej.retry_after_s)?;
    Ok(())
}

/// A usage from its counts as given (None: not reported).
fn usage_of(prompt_tokens: Option<u64>, completion_tokens: Option<u64>) -> Option<(u64, u64)> {
    (prompt_tokens.is_some() || completion_tokens.is_some())
        .then(|| (prompt_tokens.unwrap_or(0), completion_tokens.unwrap_or(0)))
}

/// The spec of ``spec_json`` with the models' ``tokenizers`` (name ->
/// Tokenizer), loaded by the caller, handed over.
fn spec_with(
    spec_json: &str,
    tokenizers: Option<HashMap<String, Bound<'_, PyTokenizer>>>,
) -> PyResult<Spec> {
    let loaded = tokenizers
        .unwrap_or_default()
        .into_iter()
        .map(|(name, t)| (name, Arc::clone(&t.get().inner)))
        .collect();
    Ok(Spec::from_json(spec_json)?.with_tokenizers(loaded)?)
}

impl PyDataPlane {
    /// One request through the data plane's front door (`serve::front`):
    /// the key, the body limit, the routing under the failure mode, timed.
    fn route<'py>(
        &self,
        py: Python<'py>,
        api_key: Option<&[u8]>,
        routing: Routing<'_>,
        hints: &Hints,
    ) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.inner.engine();
        let shared = Arc::clone(&self.inner.shared);
        let outcome = py.detach(|| {
            self.inner
                .block_on(route_once(engine, shared, api_key, routing, hints))
        })?;
        outcome_dict(py, outcome)
    }
}

#[pymethods]
impl PyDataPlane {
    /// Starts serving ``spec_json`` (the JSON ``routecore.config`` produces) on
    /// ``host:port`` (0: a free port) with metrics on ``metrics_port`` (None:
    /// none), ``worker_threads`` threads (each runs its own event loop and
    /// serves the connections given to it, a new one to the thread with the
    /// fewest open), the learned ``calibrator``
    /// state (``Calibrator.to_bytes()``, None: cold start) and logs at the
    /// Python logging level ``log_level``. ``tokenizers`` hands over the
    /// spec's models' tokenizers already loaded (model name -> Tokenizer:
    /// ``Config.tokenizers()``), so their files are read once; a model not
    /// given is loaded from its spec. ``unix_socket``: ext_proc is served on
    /// this Unix socket path too (a stale socket there is replaced; the file
    /// gets ``unix_socket_mode``, 0o600 or 0o660, and is removed at the
    /// drain). ValueError for a bad spec, a port or socket that cannot be
    /// bound.
    #[staticmethod]
    #[pyo3(signature = (spec_json, host="127.0.0.1", port=0, metrics_port=None, worker_threads=2, calibrator=None, log_level=20, *, tokenizers=None, unix_socket=None, unix_socket_mode=0o600))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        py: Python<'_>,
        spec_json: &str,
        host: &str,
        #[pyo3(from_py_with = int_arg)] port: u16,
        #[pyo3(from_py_with = int_arg)] metrics_port: Option<u16>,
        #[pyo3(from_py_with = int_arg)] worker_threads: usize,
        calibrator: Option<&[u8]>,
        #[pyo3(from_py_with = int_arg)] log_level: u8,
        tokenizers: Option<HashMap<String, Bound<'_, PyTokenizer>>>,
        unix_socket: Option<std::path::PathBuf>,
        #[pyo3(from_py_with = int_arg)] unix_socket_mode: u32,
    ) -> PyResult<Self> {
        if !(1..=256).contains(&worker_threads) {
            return Err(crate::error::invalid(format!(
                "worker_threads must be in [1, 256], got {worker_threads}"
            ))
            .into());
        }
        crate::serve::logs::set_level(log_level);
        let spec = spec_with(spec_json, tokenizers)?;
        let calibrator = match calibrator {
            Some(b) => Calibrator::from_bytes(b)?,
            None => Calibrator::with_defaults(),
        };
        let listen = Listen {
            host: host.into(),
            port,
            metrics_port,
            worker_threads,
            unix_socket: unix_socket.map(|p| (p, unix_socket_mode)),
        };
        let inner = py.detach(|| DataPlane::start(spec, calibrator, &listen))?;
        Ok(Self { inner })
    }

    /// The gRPC port (ext_proc and health).
    #[getter]
    fn port(&self) -> u16 {
        self.inner.port
    }

    /// The metrics port, or None.
    #[getter]
    fn metrics_port(&self) -> Option<u16> {
        self.inner.metrics_port
    }

    /// Whether the data plane reports ``readiness`` SERVING on its gRPC
    /// health service (what Envoy asks): every endpoint's state synced and
    /// the admission backend warm (a fail-closed Redis admission stays not
    /// ready while Redis is down); False again from the start of a drain.
    #[getter]
    fn ready(&self) -> bool {
        self.inner.ready()
    }

    /// Blocks, the GIL released, until the data plane is :attr:`ready`
    /// (True), or until ``timeout_s`` passes (None: no limit) or a drain
    /// stops it first (False): woken by the change, never polling. Run it
    /// in a thread from asyncio (``await asyncio.to_thread(plane.wait_ready)``).
    /// ValueError for a negative or NaN ``timeout_s``.
    #[pyo3(signature = (timeout_s=None))]
    fn wait_ready(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        let timeout = match timeout_s {
            Some(t) if t.is_nan() || t < 0.0 => {
                return Err(crate::error::invalid(format!(
                    "timeout_s must be a number >= 0, got {t}"
                ))
                .into())
            }
            Some(t) => Some(std::time::Duration::from_secs_f64(t.min(1e9))),
            None => None,
        };
        Ok(py.detach(|| self.inner.wait_ready(timeout)))
    }

    /// Swaps in a new configuration atomically: new streams use it, open
    /// ones finish on the one they started with; in-memory admission keeps
    /// its in-flight state. ``tokenizers`` as in :meth:`start`. ValueError
    /// (and nothing changes) for a bad spec.
    #[pyo3(signature = (spec_json, *, tokenizers=None))]
    fn reload(
        &self,
        py: Python<'_>,
        spec_json: &str,
        tokenizers: Option<HashMap<String, Bound<'_, PyTokenizer>>>,
    ) -> PyResult<()> {
        let spec = spec_with(spec_json, tokenizers)?;
        Ok(py.detach(|| self.inner.reload(spec))?)
    }

    /// Stops taking new streams, gives open ones ``grace_s`` seconds to
    /// finish, then ends the rest (releasing what they hold) and stops.
    fn drain(&self, py: Python<'_>, grace_s: f64) {
        py.detach(|| self.inner.drain(grace_s));
    }

    /// Sets the log level (a Python logging level number).
    #[staticmethod]
    fn set_log_level(#[pyo3(from_py_with = int_arg)] level: u8) {
        crate::serve::logs::set_level(level);
    }

    /// The learned calibrator, live (shared with the data plane).
    #[getter]
    fn calibrator(&self) -> PyCalibrator {
        PyCalibrator {
            inner: Arc::clone(&self.inner.shared.calibrator),
        }
    }

    /// Routes an OpenAI request body; ``api_key`` (bytes) authenticates the
    /// tenant (None: no tenant, for trusted callers). Returns a dict:
    /// ``admitted`` True with ``request_id, pool, endpoint, est_input_tokens,
    /// est_output_tokens, spilled, reason, compress_target_tokens, body``
    /// (the compressed body or None), or False with ``status`` (the HTTP
    /// status Envoy's client would get), ``bad_request`` (True for 400 and
    /// 413: the request itself is bad), ``reason, message, retry_after_s``.
    /// The rules are ext_proc's: the key, ``limits.max_body_bytes`` (413),
    /// ``server.failure_mode`` when routing fails. ``token_ids``: the
    /// prompt's, from the caller; they key the prefix policies in place of
    /// the body's prompt (not a compressed one's).
    #[pyo3(signature = (body, api_key=None, token_ids=None))]
    fn route_body<'py>(
        &self,
        py: Python<'py>,
        body: &[u8],
        api_key: Option<&[u8]>,
        #[pyo3(from_py_with = int_arg)] token_ids: Option<Vec<u32>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hints = Hints {
            token_ids,
            ..Hints::default()
        };
        self.route(py, api_key, Routing::Body(body), &hints)
    }

    /// Routes a request by its measured fields (``prompt_tokens`` when known
    /// exactly, else ``prompt_bytes`` of ``category``); ``token_ids`` key the
    /// prefix policy. Same result as :meth:`route_body`.
    #[pyo3(signature = (prompt_bytes, category, max_output_tokens, prompt_tokens=None, api_key=None, token_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn route_fields<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = int_arg)] prompt_bytes: u64,
        category: &str,
        #[pyo3(from_py_with = int_arg)] max_output_tokens: u64,
        #[pyo3(from_py_with = int_arg)] prompt_tokens: Option<u64>,
        api_key: Option<&[u8]>,
        #[pyo3(from_py_with = int_arg)] token_ids: Option<Vec<u32>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let fields = Fields {
            prompt_bytes,
            category,
            max_output_tokens,
            prompt_tokens,
            token_ids: token_ids.as_deref(),
        };
        self.route(py, api_key, Routing::Fields(fields), &Hints::default())
    }

    /// Releases the request ``request_id`` with its usage (None or 0 prompt
    /// tokens: unknown, not learned from; usage that cannot be real, more
    /// tokens than its pool's context, is ignored and counted), for a
    /// trusted caller: any request in flight. False when it is not in
    /// flight (released already or unknown).
    #[pyo3(signature = (request_id, prompt_tokens=None, completion_tokens=None))]
    fn finish(
        &self,
        py: Python<'_>,
        request_id: &str,
        #[pyo3(from_py_with = int_arg)] prompt_tokens: Option<u64>,
        #[pyo3(from_py_with = int_arg)] completion_tokens: Option<u64>,
    ) -> bool {
        let usage = usage_of(prompt_tokens, completion_tokens);
        py.detach(|| {
            self.inner
                .shared
                .release_request(request_id, Caller::Trusted, usage)
        })
    }

    /// The RouteCore API's Feedback through the front door: ``api_key``
    /// authenticates the caller as :meth:`route_body` does, and only a
    /// request its tenant routed through :meth:`route_body` /
    /// :meth:`route_fields` is released, with its usage as in
    /// :meth:`finish`. Returns ``{"done": True}``, or ``{"done": False}``
    /// with the refusal's ``status`` (401 / 403: the key; 400: an id longer
    /// than 64 bytes; 404: no request of the caller's in flight under this
    /// id), ``bad_request, reason, message, retry_after_s``. The id is
    /// never echoed.
    #[pyo3(signature = (request_id, api_key, prompt_tokens=None, completion_tokens=None))]
    fn feedback<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        api_key: &[u8],
        #[pyo3(from_py_with = int_arg)] prompt_tokens: Option<u64>,
        #[pyo3(from_py_with = int_arg)] completion_tokens: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let usage = usage_of(prompt_tokens, completion_tokens);
        let engine = self.inner.engine();
        let shared = Arc::clone(&self.inner.shared);
        let done = py.detach(|| feedback_once(engine, shared, api_key, request_id, usage));
        let d = PyDict::new(py);
        d.set_item("done", done.is_ok())?;
        if let Err(rej) = done {
            refusal(&d, rej)?;
        }
        Ok(d)
    }

    /// Authenticates a RouteCore call that routes nothing (``Plan``) by
    /// ``api_key``, as :meth:`route_body` does. Returns ``{"authenticated":
    /// True, "tenant": name}`` (None: no tenants configured), or
    /// ``{"authenticated": False}`` with the refusal's fields (401, 403).
    fn authenticate<'py>(&self, py: Python<'py>, api_key: &[u8]) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.inner.engine();
        let shared = Arc::clone(&self.inner.shared);
        let d = PyDict::new(py);
        match authenticate_once(engine, shared, api_key) {
            Ok(tenant) => {
                d.set_item("authenticated", true)?;
                d.set_item("tenant", tenant)?;
            }
            Err(rej) => {
                d.set_item("authenticated", false)?;
                refusal(&d, rej)?;
            }
        }
        Ok(d)
    }

    /// Releases every request past its deadline now; returns how many.
    fn reap(&self, py: Python<'_>) -> usize {
        py.detach(|| self.inner.shared.reap())
    }

    /// The request ids in flight.
    fn leases(&self) -> Vec<String> {
        self.inner.shared.lease_ids()
    }

    /// Everything requests in flight hold, summed over the live engines
    /// (the current one and those open streams still use): ``{"leases": n,
    /// "router": {pool: n}, "chooser": {pool: {endpoint: n}}, "admission": n}``.
    fn in_flight<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut router: HashMap<String, u64> = HashMap::new();
        let mut chooser: HashMap<String, HashMap<String, u64>> = HashMap::new();
        let mut admission = 0u64;
        let mut seen = Vec::new();
        for engine in self.inner.shared.engines() {
            for (i, p) in engine.spec.pools.iter().enumerate() {
                *router.entry(p.name.clone()).or_default() +=
                    engine.router().in_flight(i).unwrap_or(0);
                let load = engine.choosers[i].loads();
                let endpoints = engine.choosers[i].endpoints();
                let per = chooser.entry(p.name.clone()).or_default();
                for (e, n) in endpoints.iter().zip(load) {
                    *per.entry(e.clone()).or_default() += n;
                }
            }
            if let Some(a) = engine.admission.as_ref() {
                let ptr = Arc::as_ptr(a);
                if !seen.contains(&ptr) {
                    seen.push(ptr);
                    admission += a.in_flight();
                }
            }
        }
        let d = PyDict::new(py);
        d.set_item("leases", self.inner.shared.lease_count())?;
        d.set_item("router", router)?;
        d.set_item("chooser", chooser)?;
        d.set_item("admission", admission)?;
        Ok(d)
    }

    /// What the endpoint picker of the current engine knows of each endpoint:
    /// ``{pool: {endpoint: {"healthy", "in_flight", "dispatched_since_scrape",
    /// "waiting", "running", "kv_usage", "adapters"}}}`` (None: unknown or stale).
    fn endpoints<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.inner.engine();
        let out = PyDict::new(py);
        for (p, chooser) in engine.spec.pools.iter().zip(&engine.choosers) {
            let pool = PyDict::new(py);
            for (name, s) in chooser.endpoints().iter().zip(chooser.states()) {
                pool.set_item(name, super::pick::state_dict(py, &s)?)?;
            }
            out.set_item(&p.name, pool)?;
        }
        Ok(out)
    }

    /// The current value of a metric by its name without the ``routecore_``
    /// prefix (e.g. ``"decisions"``) and its label values in order; None
    /// for an unknown name.
    #[pyo3(signature = (name, *labels))]
    fn metric(&self, name: &str, labels: Vec<String>) -> Option<f64> {
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        self.inner.shared.metrics.value(name, &labels)
    }

    /// The autoscaler's last sizing step (``autoscale`` of the
    /// configuration), one dict a scaled pool as ``Autoscaler.step`` returns
    /// them (``endpoints`` is the desired count, damped); None when
    /// autoscaling is off, ``[]`` before the first step.
    fn autoscale<'py>(&self, py: Python<'py>) -> PyResult<Option<Vec<Bound<'py, PyDict>>>> {
        let Some(s) = self.inner.engine().autoscale.clone() else {
            return Ok(None);
        };
        s.last()
            .iter()
            .map(|d| super::autoscale::desired_dict(py, d))
            .collect::<PyResult<_>>()
            .map(Some)
    }

    /// The Prometheus exposition text (what the metrics port serves).
    fn metrics_text(&self) -> String {
        self.inner.shared.metrics.text()
    }

    /// Makes one phase of the next request fail (``request_headers``,
    /// ``routing``, ``admission``, ``response_headers``, ``response_body``,
    /// ``finish``): for tests of the failure paths.
    fn inject_fault(&self, phase: &str) -> PyResult<()> {
        Ok(self.inner.shared.inject_fault(phase)?)
    }

    fn __repr__(&self) -> String {
        format!("DataPlane(port={})", self.inner.port)
    }
}

impl Drop for PyDataPlane {
    fn drop(&mut self) {
        // A data plane dropped without drain() stops at once (a no-op after drain).
        self.inner.drain(0.0);
    }
}
