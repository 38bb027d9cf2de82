use std::sync::{Mutex, MutexGuard};

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::{int_arg, int_array, now_or_monotonic, reduce, size_arg};
use crate::pick::VtcRouter;
use crate::vtc::{VtcConfig, DEFAULT_MAX_USERS};

// The signature's default is written as a literal (for the text signature).
const _: () = assert!(DEFAULT_MAX_USERS == 100_000);

/// VTC fairness routing (AIBrix ``vtc-basic``, after Sheng et al.).
///
/// Each user's service is ``input_weight * input + output_weight * output``
/// tokens over a sliding window of ``window_s`` seconds (10 buckets; old
/// buckets expire), charged with the estimate at ``route`` and corrected with
/// actual usage at ``complete``. With ``lo``/``hi`` the smallest/largest count
/// over active users (``min_tokens``/``max_tokens`` while none), ``bucket =
/// max(min_tokens, (lo + hi) / 2)`` and ``x = min(count / bucket, n - 1)``,
/// endpoint ``i`` scores ``fairness_weight * |i - x| + utilization_weight *
/// min(running_i / max_endpoint_load, 1)``; the lowest score wins (lowest index on
/// ties). At most ``max_users`` users are held: a new user beyond that
/// forgets the least recently active one (oldest latest charge bucket, then
/// smallest name), in O(log users). ``now`` (seconds) defaults to
/// ``monotonic()``, so the window moves on its own; an explicit ``now``
/// earlier than one already seen counts as the latest. ``running``, where
/// accepted, first overwrites every endpoint's count. ``complete`` on an
/// endpoint with nothing running raises ``NotInFlightError``.
///
///     >>> r = VtcRouter(["p0", "p1"])
///     >>> r.route("alice", 100, 200)
///     'p0'
///     >>> r.user_tokens("alice")
///     500.0

#[pyclass(frozen, name = "VtcRouter", module = "routecore")]
pub struct PyVtcRouter {
    inner: Mutex<VtcRouter>,
}

impl PyVtcRouter {
    fn router(&self) -> MutexGuard<'_, VtcRouter> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyVtcRouter {
    #[new]
    #[pyo3(signature = (
        endpoints,
        window_s=300.0,
        input_weight=1.0,
        output_weight=2.0,
        min_tokens=1000.0,
        max_tokens=8000.0,
        fairness_weight=1.0,
        utilization_weight=1.0,
        max_endpoint_load=100.0,
        max_users=100_000,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        endpoints: Vec<String>,
        window_s: f64,
        input_weight: f64,
        output_weight: f64,
        min_tokens: f64,
        max_tokens: f64,
        fairness_weight: f64,
        utilization_weight: f64,
        max_endpoint_load: f64,
        #[pyo3(from_py_with = int_arg)] max_users: i64,
    ) -> PyResult<Self> {
        let max_users = size_arg(max_users, "max_users")?;
        let config = VtcConfig {
            window_s,
            input_weight,
            output_weight,
            min_tokens,
            max_tokens,
            fairness_weight,
            utilization_weight,
            max_endpoint_load,
            max_users,
        };
        Ok(Self {
            inner: Mutex::new(VtcRouter::new(&endpoints, config)?),
        })
    }

    /// Routes one request of ``user`` with estimated token counts; charges
    /// them and counts the request running on the returned endpoint.
    #[pyo3(signature = (user, input_tokens, output_tokens, running=None, now=None))]
    fn route(
        &self,
        user: &str,
        #[pyo3(from_py_with = int_arg)] input_tokens: i64,
        #[pyo3(from_py_with = int_arg)] output_tokens: i64,
        running: Option<&Bound<'_, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<String> {
        let running = running.map(|r| int_array(r, "running")).transpose()?;
        let mut router = self.router();
        let endpoint = router.route(
            user,
            input_tokens,
            output_tokens,
            running.as_deref(),
            now_or_monotonic(now),
        )?;
        Ok(router.endpoints()[endpoint].clone())
    }

    /// Routes a batch exactly as ``route`` one by one would (``running``
    /// applied before the first); returns endpoint indices into ``endpoints``.
    #[pyo3(signature = (users, input_tokens, output_tokens, running=None, now=None))]
    fn route_many<'py>(
        &self,
        py: Python<'py>,
        users: Vec<String>,
        input_tokens: &Bound<'py, PyAny>,
        output_tokens: &Bound<'py, PyAny>,
        running: Option<&Bound<'py, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let ins = int_array(input_tokens, "input_tokens")?;
        let outs = int_array(output_tokens, "output_tokens")?;
        let running = running.map(|r| int_array(r, "running")).transpose()?;
        let now = now_or_monotonic(now);
        let chosen = py.detach(|| {
            self.router()
                .route_many(&users, &ins, &outs, running.as_deref(), now)
        })?;
        Ok(chosen
            .into_iter()
            .map(|p| p as i64)
            .collect::<Vec<i64>>()
            .into_pyarray(py))
    }

    /// Ends a request on ``endpoint`` and corrects ``user``'s charge from the
    /// estimates given to ``route`` to the actual token counts.
    #[pyo3(signature = (endpoint, user, est_input_tokens, est_output_tokens, input_tokens, output_tokens, now=None))]
    #[allow(clippy::too_many_arguments)]
    fn complete(
        &self,
        endpoint: &str,
        user: &str,
        #[pyo3(from_py_with = int_arg)] est_input_tokens: i64,
        #[pyo3(from_py_with = int_arg)] est_output_tokens: i64,
        #[pyo3(from_py_with = int_arg)] input_tokens: i64,
        #[pyo3(from_py_with = int_arg)] output_tokens: i64,
        now: Option<f64>,
    ) -> PyResult<()> {
        Ok(self.router().complete(
            endpoint,
            user,
            est_input_tokens,
            est_output_tokens,
            input_tokens,
            output_tokens,
            now_or_monotonic(now),
        )?)
    }

    /// ``user``'s weighted token count in the window at ``now``.
    #[pyo3(signature = (user, now=None))]
    fn user_tokens(&self, user: &str, now: Option<f64>) -> PyResult<f64> {
        Ok(self.router().user_tokens(user, now_or_monotonic(now))?)
    }

    /// Number of users with a non-empty window.
    #[getter]
    fn users(&self) -> usize {
        self.router().users_len()
    }

    /// Overwrites every endpoint's running count (one per endpoint, in ``endpoints`` order).
    fn set_running(&self, counts: &Bound<'_, PyAny>) -> PyResult<()> {
        let counts = int_array(counts, "running")?;
        Ok(self.router().set_running(&counts)?)
    }

    fn add_endpoint(&self, endpoint: &str) -> PyResult<()> {
        Ok(self.router().add_endpoint(endpoint)?)
    }

    /// Removes a endpoint (KeyError if unknown); later endpoints move down one index.
    fn remove_endpoint(&self, endpoint: &str) -> PyResult<()> {
        Ok(self.router().remove_endpoint(endpoint)?)
    }

    #[getter]
    fn endpoints(&self) -> Vec<String> {
        self.router().endpoints().to_vec()
    }

    #[getter]
    fn running(&self) -> Vec<u64> {
        self.router().running()
    }

    #[getter]
    fn window_s(&self) -> f64 {
        self.router().config().window_s
    }

    #[getter]
    fn max_users(&self) -> usize {
        self.router().config().max_users
    }

    /// A snapshot: settings, endpoints, running counts and every user's buckets.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.router().to_bytes())
    }

    /// Restores a snapshot written by ``to_bytes``; ValueError if invalid.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(Self {
            inner: Mutex::new(VtcRouter::from_bytes(data)?),
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce(slf, slf.get().to_bytes(slf.py()))
    }

    fn __repr__(&self) -> String {
        let r = self.router();
        format!(
            "VtcRouter(endpoints={:?}, window_s={}, users={})",
            r.endpoints(),
            r.config().window_s,
            r.users_len()
        )
    }
}
