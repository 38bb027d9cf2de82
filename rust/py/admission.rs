use std::sync::{Arc, Mutex, MutexGuard};

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use super::{int_arg, int_array, now_or_monotonic, reduce};
use crate::admission::{self, AdmissionController, Entitlement, Quota, ServiceClass};

/// Two int64 arrays of one length.
type Int64Pair<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>);

/// A quota's capacity in inference-native units: token throughput
/// (``tokens_per_s``), KV cache (``kv_bytes``) and concurrent sequences
/// (``concurrency``). ``kv_bytes_per_token`` (the paper's ``c = 2 L H_kv d_h
/// b``) turns a request's tokens into KV bytes; 0 leaves KV out of admission.
#[pyclass(frozen, name = "Quota", module = "routecore")]
pub struct PyQuota {
    pub(crate) inner: Quota,
}

#[pymethods]
impl PyQuota {
    #[new]
    #[pyo3(signature = (name, tokens_per_s, kv_bytes, concurrency, kv_bytes_per_token=0))]
    fn new(
        name: &str,
        tokens_per_s: f64,
        #[pyo3(from_py_with = int_arg)] kv_bytes: i64,
        #[pyo3(from_py_with = int_arg)] concurrency: i64,
        #[pyo3(from_py_with = int_arg)] kv_bytes_per_token: i64,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: Quota::new(
                name,
                tokens_per_s,
                kv_bytes,
                concurrency,
                kv_bytes_per_token,
            )?,
        })
    }
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn tokens_per_s(&self) -> f64 {
        self.inner.tokens_per_s
    }
    #[getter]
    fn kv_bytes(&self) -> u64 {
        self.inner.kv_bytes
    }
    #[getter]
    fn concurrency(&self) -> u64 {
        self.inner.concurrency
    }
    #[getter]
    fn kv_bytes_per_token(&self) -> u64 {
        self.inner.kv_bytes_per_token
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let p = &slf.get().inner;
        let args = (
            &p.name,
            p.tokens_per_s,
            p.kv_bytes,
            p.concurrency,
            p.kv_bytes_per_token,
        );
        Ok((
            slf.as_any().get_type().into_any(),
            args.into_pyobject(slf.py())?,
        ))
    }
    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "Quota(name={:?}, tokens_per_s={}, kv_bytes={}, concurrency={}, kv_bytes_per_token={})",
            p.name, p.tokens_per_s, p.kv_bytes, p.concurrency, p.kv_bytes_per_token
        )
    }
}

/// A tenant's baseline share of one quota (``tokens_per_s``, ``kv_bytes``,
/// ``concurrency``) with a service class (dedicated, guaranteed, elastic,
/// spot, preemptible: weights 1000, 1000, 100, 1, 0.1), an SLO target in ms
/// and a state (pending, bound, degraded, expired; only bound is admitted).
#[pyclass(frozen, name = "Entitlement", module = "routecore")]
pub struct PyEntitlement {
    pub(crate) inner: Entitlement,
}

#[pymethods]
impl PyEntitlement {
    #[new]
    #[pyo3(signature = (name, tenant, quota, service_class, slo_target_ms, tokens_per_s, kv_bytes, concurrency, state="bound"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        tenant: &str,
        quota: &str,
        service_class: &str,
        slo_target_ms: f64,
        tokens_per_s: f64,
        #[pyo3(from_py_with = int_arg)] kv_bytes: i64,
        #[pyo3(from_py_with = int_arg)] concurrency: i64,
        state: &str,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: Entitlement::new(
                name,
                tenant,
                quota,
                service_class,
                slo_target_ms,
                tokens_per_s,
                kv_bytes,
                concurrency,
                state,
            )?,
        })
    }
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn tenant(&self) -> &str {
        &self.inner.tenant
    }
    #[getter]
    fn quota(&self) -> &str {
        &self.inner.quota
    }
    #[getter]
    fn service_class(&self) -> &'static str {
        self.inner.service_class.as_str()
    }
    #[getter]
    fn slo_target_ms(&self) -> f64 {
        self.inner.slo_target_ms
    }
    #[getter]
    fn tokens_per_s(&self) -> f64 {
        self.inner.tokens_per_s
    }
    #[getter]
    fn kv_bytes(&self) -> u64 {
        self.inner.kv_bytes
    }
    #[getter]
    fn concurrency(&self) -> u64 {
        self.inner.concurrency
    }
    #[getter]
    fn state(&self) -> &'static str {
        self.inner.state.as_str()
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let e = &slf.get().inner;
        let args = (
            &e.name,
            &e.tenant,
            &e.quota,
            e.service_class.as_str(),
            e.slo_target_ms,
            e.tokens_per_s,
            e.kv_bytes,
            e.concurrency,
            e.state.as_str(),
        );
        Ok((
            slf.as_any().get_type().into_any(),
            args.into_pyobject(slf.py())?,
        ))
    }
    fn __repr__(&self) -> String {
        let e = &self.inner;
        format!(
            "Entitlement(name={:?}, quota={:?}, service_class={:?}, state={:?})",
            e.name,
            e.quota,
            e.service_class.as_str(),
            e.state.as_str()
        )
    }
}

/// One admission decision: ``admitted``; the HTTP ``status`` (200 admitted,
/// 401 unknown entitlement, 403 not bound, 413 larger than the whole token
/// budget, 429 throttled, 503 admission state unreachable and failing
/// closed); ``reason``; ``retry_after_s`` (seconds, from the state; None when
/// retrying cannot help); ``ticket`` for ``complete`` (None when rejected);
/// ``priority``, the entitlement's weight w_e when decided.
#[pyclass(frozen, name = "Admission", module = "routecore")]
pub struct PyAdmission {
    #[pyo3(get)]
    admitted: bool,
    #[pyo3(get)]
    status: u16,
    #[pyo3(get)]
    reason: String,
    #[pyo3(get)]
    retry_after_s: Option<f64>,
    #[pyo3(get)]
    pub(super) ticket: Option<u64>,
    #[pyo3(get)]
    priority: f64,
}

impl From<admission::Admission> for PyAdmission {
    fn from(a: admission::Admission) -> Self {
        Self {
            admitted: a.admitted,
            status: a.status,
            reason: a.reason.to_owned(),
            retry_after_s: a.retry_after_s,
            ticket: a.ticket,
            priority: a.priority,
        }
    }
}

#[pymethods]
impl PyAdmission {
    /// Built by the controllers; public so other backends (Redis) return the
    /// same type.
    #[new]
    #[pyo3(signature = (admitted, status, reason, retry_after_s=None, ticket=None, priority=0.0))]
    fn new(
        admitted: bool,
        #[pyo3(from_py_with = int_arg)] status: u16,
        reason: String,
        retry_after_s: Option<f64>,
        #[pyo3(from_py_with = int_arg)] ticket: Option<u64>,
        priority: f64,
    ) -> Self {
        Self {
            admitted,
            status,
            reason,
            retry_after_s,
            ticket,
            priority,
        }
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let a = slf.get();
        let args = (
            a.admitted,
            a.status,
            &a.reason,
            a.retry_after_s,
            a.ticket,
            a.priority,
        );
        Ok((
            slf.as_any().get_type().into_any(),
            args.into_pyobject(slf.py())?,
        ))
    }
    fn __repr__(&self) -> String {
        let opt = |x: Option<String>| x.unwrap_or_else(|| "None".to_owned());
        format!(
            "Admission(admitted={}, status={}, reason={:?}, retry_after_s={}, ticket={})",
            if self.admitted { "True" } else { "False" },
            self.status,
            self.reason,
            opt(self.retry_after_s.map(|r| r.to_string())),
            opt(self.ticket.map(|t| t.to_string())),
        )
    }
}

/// The priority weight w_e of equation 1: ``w_class / (1 + 2 * slo /
/// quota_mean_slo) / (1 + burst) * (1 + 4 * debt)``.
#[pyfunction]
#[pyo3(signature = (service_class, slo_target_ms, quota_mean_slo_ms, burst=0.0, debt=0.0))]
pub fn priority_weight(
    service_class: &str,
    slo_target_ms: f64,
    quota_mean_slo_ms: f64,
    burst: f64,
    debt: f64,
) -> PyResult<f64> {
    let class = ServiceClass::parse(service_class)?;
    crate::error::positive("slo_target_ms", slo_target_ms)?;
    crate::error::positive("quota_mean_slo_ms", quota_mean_slo_ms)?;
    crate::error::non_negative("burst", burst)?;
    crate::error::finite("debt", debt)?;
    Ok(admission::priority_weight(
        class,
        slo_target_ms,
        quota_mean_slo_ms,
        burst,
        debt,
    ))
}

/// Multi-tenant admission control over quotas (Cunningham 2026).
///
/// ``admit`` runs the paper's checks in order (state, default output bound,
/// concurrency, token budget over a rolling ``window_s``, quota contention)
/// and returns an ``Admission``; ``complete`` releases the ticket with the
/// real token counts and latency and updates served rate, debt, burst and
/// priority. ``now`` (seconds) defaults to ``monotonic()``; an explicit
/// ``now`` earlier than one already seen counts as the latest. Bad numbers
/// raise ValueError and change nothing; an unknown entitlement is a 401
/// decision; completing a ticket not in flight raises ``NotInFlightError``.
///
/// >>> quota = Quota("p", 240.0, 2**30, 16)
/// >>> e = Entitlement("copilot", "acme", "p", "elastic", 500.0, 75.0, 2**28, 5)
/// >>> ctl = AdmissionController([quota], [e])
/// >>> a = ctl.admit("copilot", 100, 50, now=0.0)
/// >>> a.admitted, a.status
/// (True, 200)
/// >>> ctl.complete(a.ticket, 100, 42, 0.8, now=0.8)
#[pyclass(frozen, name = "AdmissionController", module = "routecore")]
pub struct PyAdmissionController {
    inner: Arc<Mutex<AdmissionController>>,
}

impl PyAdmissionController {
    pub(super) fn lock(&self) -> MutexGuard<'_, AdmissionController> {
        // Every core call checks before it changes: a poisoned state is consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyAdmissionController {
    #[new]
    #[pyo3(signature = (quotas, entitlements, default_max_tokens=4096, window_s=60.0))]
    fn new(
        quotas: Vec<Py<PyQuota>>,
        entitlements: Vec<Py<PyEntitlement>>,
        #[pyo3(from_py_with = int_arg)] default_max_tokens: i64,
        window_s: f64,
    ) -> PyResult<Self> {
        let quotas = quotas.iter().map(|p| p.get().inner.clone()).collect();
        let ents = entitlements.iter().map(|e| e.get().inner.clone()).collect();
        let c = AdmissionController::new(quotas, ents, default_max_tokens, window_s)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(c)),
        })
    }

    /// Decides one request. ``max_tokens=None`` charges the default output bound.
    #[pyo3(signature = (entitlement, input_tokens, max_tokens=None, now=None))]
    fn admit(
        &self,
        entitlement: &str,
        #[pyo3(from_py_with = int_arg)] input_tokens: i64,
        #[pyo3(from_py_with = int_arg)] max_tokens: Option<i64>,
        now: Option<f64>,
    ) -> PyResult<PyAdmission> {
        let now = now_or_monotonic(now);
        Ok(self
            .lock()
            .admit(entitlement, input_tokens, max_tokens, now)?
            .into())
    }

    /// ``admit`` for a batch at one instant, in order, exactly as one by one.
    /// ``entitlement_ids`` from ``entitlement_id``; ``max_tokens=None``: all
    /// default. Returns ``(status, ticket)`` int64 arrays, ticket -1 when
    /// rejected. Everything is checked first: an error admits nothing. The
    /// arrays are copied first, so the caller may reuse them at once.
    #[pyo3(signature = (entitlement_ids, input_tokens, max_tokens=None, now=None))]
    fn admit_many<'py>(
        &self,
        py: Python<'py>,
        entitlement_ids: &Bound<'py, PyAny>,
        input_tokens: &Bound<'py, PyAny>,
        max_tokens: Option<&Bound<'py, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<Int64Pair<'py>> {
        let now = now_or_monotonic(now);
        let ids = int_array(entitlement_ids, "entitlement_ids")?;
        let inputs = int_array(input_tokens, "input_tokens")?;
        let maxes = max_tokens.map(|m| int_array(m, "max_tokens")).transpose()?;
        let decided = py.detach(|| self.lock().admit_many(&ids, &inputs, maxes.as_deref(), now))?;
        let status: Vec<i64> = decided.iter().map(|a| i64::from(a.status)).collect();
        let tickets: Vec<i64> = decided
            .iter()
            .map(|a| a.ticket.map_or(-1, |t| t as i64))
            .collect();
        Ok((status.into_pyarray(py), tickets.into_pyarray(py)))
    }

    /// The dense id of an entitlement for ``admit_many``; KeyError if unknown.
    fn entitlement_id(&self, name: &str) -> PyResult<usize> {
        Ok(self.lock().entitlement_id(name)?)
    }

    /// Ends an admitted request with its real token counts and latency.
    /// ``NotInFlightError`` for a ticket that is not in flight (completed
    /// already, or never admitted); nothing changes then.
    #[pyo3(signature = (ticket, actual_input, actual_output, latency_s, now=None))]
    fn complete(
        &self,
        #[pyo3(from_py_with = int_arg)] ticket: u64,
        #[pyo3(from_py_with = int_arg)] actual_input: i64,
        #[pyo3(from_py_with = int_arg)] actual_output: i64,
        latency_s: f64,
        now: Option<f64>,
    ) -> PyResult<()> {
        let now = now_or_monotonic(now);
        Ok(self
            .lock()
            .complete(ticket, actual_input, actual_output, latency_s, now)?)
    }

    /// Ends an admitted request that was never served (a later step refused
    /// it, or it left a queue): its slot and its window charge are given
    /// back and nothing is learned (served rate, debt, burst, latency and
    /// priority stay as they were). ``NotInFlightError`` for a ticket that is
    /// not in flight; nothing changes then.
    #[pyo3(signature = (ticket, now=None))]
    fn release(
        &self,
        #[pyo3(from_py_with = int_arg)] ticket: u64,
        now: Option<f64>,
    ) -> PyResult<()> {
        Ok(self.lock().release(ticket, now_or_monotonic(now))?)
    }

    /// Tickets of preemptible requests to terminate now because protected
    /// classes need the capacity (lowest priority, then youngest first).
    /// Changes nothing: terminate them, then ``complete`` each.
    #[pyo3(signature = (now=None))]
    fn evictions(&self, now: Option<f64>) -> PyResult<Vec<u64>> {
        Ok(self.lock().evictions(now_or_monotonic(now))?)
    }

    /// The entitlement's priority weight w_e now (equation 1).
    fn priority(&self, entitlement: &str) -> PyResult<f64> {
        Ok(self.lock().priority(entitlement)?)
    }

    /// ``in_flight``, ``window_tokens``, ``served_tokens_per_s``, ``debt``,
    /// ``burst`` and ``priority`` of one entitlement.
    fn stats<'py>(&self, py: Python<'py>, entitlement: &str) -> PyResult<Bound<'py, PyDict>> {
        let s = self.lock().stats(entitlement)?;
        let d = PyDict::new(py);
        d.set_item("in_flight", s.in_flight)?;
        d.set_item("window_tokens", s.window_tokens)?;
        d.set_item("served_tokens_per_s", s.served_tokens_per_s)?;
        d.set_item("debt", s.debt)?;
        d.set_item("burst", s.burst)?;
        d.set_item("priority", s.priority)?;
        Ok(d)
    }

    /// Requests in flight in ``quota``.
    fn quota_in_flight(&self, quota: &str) -> PyResult<u64> {
        Ok(self.lock().quota_in_flight(quota)?)
    }

    /// Moves an entitlement to ``state`` (pending, bound, degraded, expired).
    fn set_state(&self, entitlement: &str, state: &str) -> PyResult<()> {
        Ok(self.lock().set_state(entitlement, state)?)
    }

    /// Changes a quota's capacity at run time (outage, recovery, scaling).
    #[pyo3(signature = (quota, tokens_per_s=None, kv_bytes=None, concurrency=None))]
    fn set_capacity(
        &self,
        quota: &str,
        tokens_per_s: Option<f64>,
        #[pyo3(from_py_with = int_arg)] kv_bytes: Option<i64>,
        #[pyo3(from_py_with = int_arg)] concurrency: Option<i64>,
    ) -> PyResult<()> {
        Ok(self
            .lock()
            .set_capacity(quota, tokens_per_s, kv_bytes, concurrency)?)
    }

    /// The quotas with their current capacity.
    #[getter]
    fn quotas(&self) -> Vec<PyQuota> {
        self.lock()
            .quotas()
            .map(|p| PyQuota { inner: p.clone() })
            .collect()
    }

    /// The entitlements with their current state.
    #[getter]
    fn entitlements(&self) -> Vec<PyEntitlement> {
        self.lock()
            .entitlements()
            .map(|e| PyEntitlement { inner: e.clone() })
            .collect()
    }

    #[getter]
    fn default_max_tokens(&self) -> u64 {
        self.lock().default_max_tokens()
    }

    #[getter]
    fn window_s(&self) -> f64 {
        self.lock().window_s()
    }

    /// A snapshot of everything; ``from_bytes`` restores it exactly.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.lock().to_bytes())
    }

    /// Restores a snapshot written by ``to_bytes``; ValueError if invalid.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(Self {
            inner: Arc::new(Mutex::new(AdmissionController::from_bytes(data)?)),
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce(slf, slf.get().to_bytes(slf.py()))
    }

    fn __repr__(&self) -> String {
        let c = self.lock();
        let quotas: Vec<&str> = c.quotas().map(|p| p.name.as_str()).collect();
        let ents: Vec<&str> = c.entitlements().map(|e| e.name.as_str()).collect();
        format!("AdmissionController(quotas={quotas:?}, entitlements={ents:?})")
    }
}
