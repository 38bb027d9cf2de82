use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyString;

use super::calibrate::PyCalibrator;
use super::{int_arg, int_view};
use crate::budget::{
    compressible_category, Decision, Pool, Request, TokenBudgetRouter, MAX_TOKENS,
};

/// A pool of model instances sharing one context window.
///
/// ``max_context``: the instances' window (vLLM ``max_model_len``); requests
/// whose estimated L_total exceeds it are never sent here. ``budget``: the
/// largest L_total the pool is meant for (B_short for a short pool; defaults to
/// ``max_context``). ``queue_limit``: while more than this many requests are in
/// flight, requests spill to another pool that can hold them.
#[pyclass(frozen, name = "Pool", module = "routecore")]
pub struct PyPool {
    pub inner: Pool,
}

#[pymethods]
impl PyPool {
    #[new]
    #[pyo3(signature = (name, max_context, budget=None, queue_limit=None))]
    fn new(
        name: &str,
        #[pyo3(from_py_with = int_arg)] max_context: i64,
        #[pyo3(from_py_with = int_arg)] budget: Option<i64>,
        #[pyo3(from_py_with = int_arg)] queue_limit: Option<i64>,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: Pool::new(name, max_context, budget, queue_limit)?,
        })
    }
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn max_context(&self) -> u64 {
        self.inner.max_context
    }
    #[getter]
    fn budget(&self) -> u64 {
        self.inner.budget
    }
    #[getter]
    fn queue_limit(&self) -> Option<u64> {
        self.inner.queue_limit
    }
    fn __repr__(&self) -> String {
        let p = &self.inner;
        let q = p.queue_limit.map_or("None".to_owned(), |q| q.to_string());
        format!(
            "Pool(name={:?}, max_context={}, budget={}, queue_limit={q})",
            p.name, p.max_context, p.budget
        )
    }
}

/// One routing decision.
///
/// ``pool`` is the chosen pool's name (None when rejected) and ``index`` its
/// position in the router's pool list (-1 when rejected). ``est_*_tokens`` are
/// the estimates it was made on; ``spilled`` is True when load moved it off its
/// budget pool; ``reason`` is one of "budget", "largest-context", "spillover",
/// "exceeds-max-context", "compress". ``action`` says what to do: "route"
/// (send as it is), "compress" (compress the prompt to
/// ``compress_target_tokens`` = B - L_out, then send to ``pool``) or "reject".
#[pyclass(frozen, name = "RouteDecision", module = "routecore")]
pub struct PyRouteDecision {
    #[pyo3(get)]
    pool: Option<Py<PyString>>,
    pub(super) decision: Decision,
}

#[pymethods]
impl PyRouteDecision {
    #[getter]
    fn index(&self) -> i64 {
        self.decision.pool.map_or(-1, |i| i as i64)
    }
    #[getter]
    fn rejected(&self) -> bool {
        self.decision.pool.is_none()
    }
    #[getter]
    fn est_input_tokens(&self) -> u64 {
        self.decision.est_input_tokens
    }
    #[getter]
    fn est_output_tokens(&self) -> u64 {
        self.decision.est_output_tokens
    }
    #[getter]
    fn est_total_tokens(&self) -> u64 {
        self.decision.est_total_tokens
    }
    #[getter]
    fn spilled(&self) -> bool {
        self.decision.spilled
    }
    #[getter]
    fn reason(&self) -> &'static str {
        self.decision.reason.as_str()
    }
    #[getter]
    fn action(&self) -> &'static str {
        self.decision.action.as_str()
    }
    #[getter]
    fn compress_target_tokens(&self) -> Option<u64> {
        self.decision.compress_target_tokens
    }
    fn __repr__(&self) -> String {
        let d = &self.decision;
        format!(
            "RouteDecision(pool={}, est_total_tokens={}, spilled={}, reason={:?})",
            d.pool.map_or("None".to_owned(), |i| i.to_string()),
            d.est_total_tokens,
            d.spilled,
            d.reason.as_str()
        )
    }
}

/// Token-budget pool routing (Chen et al. 2026, Algorithm 1) over N pools.
///
/// ``L_total = ceil(prompt_bytes / c*) + max_output_tokens`` with ``c*`` the
/// calibrator's conservative bytes-per-token ratio for the category. The
/// request goes to the smallest pool whose budget holds L_total; a pool whose
/// max_context is below L_total is never chosen; a request no pool holds is
/// rejected. When the chosen pool has more than ``queue_limit`` requests in
/// flight, the request spills to the least loaded pool that holds it and is
/// not overloaded. ``route`` counts the request in flight on its pool;
/// ``complete`` ends it.
///
/// ``compress_band`` (gamma >= 1) turns on compress-and-route (FleetOpt
/// section 5.1): a request of any category but "code" whose L_total is in
/// (B, gamma * B] of the pool with the largest budget B below it gets action
/// "compress", pool that pool, and ``compress_target_tokens`` = B - L_out.
/// ``route_request`` parses, routes and compresses an OpenAI body in one call.
///
/// >>> router = TokenBudgetRouter([Pool("short", 8192), Pool("long", 65536)])
/// >>> router.route(800, "prose", 8192).pool   # 200 prompt tokens + 8192 out
/// 'long'
#[pyclass(frozen, name = "TokenBudgetRouter", module = "routecore")]
pub struct PyTokenBudgetRouter {
    pub(super) inner: TokenBudgetRouter,
    calibrator: Py<PyCalibrator>,
    pools: Vec<Py<PyPool>>,
    names: Vec<Py<PyString>>,
}

impl PyTokenBudgetRouter {
    fn pool_arg(&self, pool: &Bound<'_, PyAny>) -> PyResult<usize> {
        if let Ok(name) = pool.extract::<&str>() {
            return Ok(self.inner.pool_index(name)?);
        }
        let i: i64 = int_arg(pool)?;
        if i < 0 || i as usize >= self.names.len() {
            return Err(PyValueError::new_err(format!(
                "pool index {i} out of range"
            )));
        }
        Ok(i as usize)
    }

    pub(super) fn decision(&self, py: Python<'_>, decision: Decision) -> PyRouteDecision {
        PyRouteDecision {
            pool: decision.pool.map(|i| self.names[i].clone_ref(py)),
            decision,
        }
    }

    /// `route`'s decision (the request counted in its pool), not yet a
    /// Python object.
    pub(super) fn decide(
        &self,
        prompt_bytes: i64,
        category: &str,
        max_output_tokens: i64,
    ) -> PyResult<Decision> {
        let req = Request::new(prompt_bytes, None, max_output_tokens)?;
        let est = self
            .inner
            .read_calibrator()
            .estimate_tokens(req.prompt_bytes, category);
        Ok(self
            .inner
            .route_with(est, req.max_output_tokens, compressible_category(category)))
    }

    /// The pool's name as a Python string (no copy).
    pub(super) fn name(&self, py: Python<'_>, pool: usize) -> Py<PyString> {
        self.names[pool].clone_ref(py)
    }
}

#[pymethods]
impl PyTokenBudgetRouter {
    #[new]
    #[pyo3(signature = (pools, calibrator=None, compress_band=None))]
    fn new(
        py: Python<'_>,
        pools: Vec<Py<PyPool>>,
        calibrator: Option<Py<PyCalibrator>>,
        compress_band: Option<f64>,
    ) -> PyResult<Self> {
        let calibrator = match calibrator {
            Some(c) => c,
            None => Py::new(
                py,
                PyCalibrator {
                    inner: std::sync::Arc::new(std::sync::RwLock::new(
                        crate::calibrate::Calibrator::with_defaults(),
                    )),
                },
            )?,
        };
        let specs = pools.iter().map(|p| p.get().inner.clone()).collect();
        let mut inner = TokenBudgetRouter::new(specs, calibrator.get().inner.clone())?;
        if let Some(gamma) = compress_band {
            inner = inner.with_compress_band(gamma)?;
        }
        let names = inner
            .pools()
            .iter()
            .map(|p| PyString::new(py, &p.name).unbind())
            .collect();
        Ok(Self {
            inner,
            calibrator,
            pools,
            names,
        })
    }

    /// Routes one request and counts it in flight on the chosen pool.
    fn route(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = int_arg)] prompt_bytes: i64,
        category: &str,
        #[pyo3(from_py_with = int_arg)] max_output_tokens: i64,
    ) -> PyResult<PyRouteDecision> {
        let decision = self.decide(prompt_bytes, category, max_output_tokens)?;
        Ok(self.decision(py, decision))
    }

    /// The compress-and-route band gamma, or None when off.
    #[getter]
    fn compress_band(&self) -> Option<f64> {
        self.inner.compress_band()
    }

    /// Routes a request whose prompt length in tokens is known exactly (a
    /// prompt given as token ids): no estimate, the calibrator is not read.
    fn route_tokens(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = int_arg)] prompt_tokens: i64,
        #[pyo3(from_py_with = int_arg)] max_output_tokens: i64,
    ) -> PyResult<PyRouteDecision> {
        if prompt_tokens < 0 || prompt_tokens as u64 > MAX_TOKENS {
            return Err(PyValueError::new_err(format!(
                "prompt_tokens must be in [0, {MAX_TOKENS}], got {prompt_tokens}"
            )));
        }
        let req = Request::new(0, None, max_output_tokens)?;
        Ok(self.decision(
            py,
            self.inner
                .route_estimated(prompt_tokens as u64, req.max_output_tokens),
        ))
    }

    /// Routes a batch exactly as ``route`` one by one would (in-flight counts
    /// included). Arrays of any integer dtype; ``category_ids`` come from
    /// ``category_id``. Returns pool indices as int64, -1 for rejected.
    /// Contiguous int64 arrays are read in place with the interpreter
    /// released (others are converted first): do not write to them from
    /// another thread until the call returns.
    fn route_many<'py>(
        &self,
        py: Python<'py>,
        prompt_bytes: &Bound<'py, PyAny>,
        category_ids: &Bound<'py, PyAny>,
        max_output_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let bytes = int_view(prompt_bytes, "prompt_bytes")?;
        let cats = int_view(category_ids, "category_ids")?;
        let outs = int_view(max_output_tokens, "max_output_tokens")?;
        let (bytes, cats, outs) = (bytes.as_slice()?, cats.as_slice()?, outs.as_slice()?);
        let result = py.detach(|| self.inner.route_arrays(bytes, cats, outs))?;
        Ok(result.into_pyarray(py))
    }

    /// The dense id of a category name for ``route_many`` (registered if new).
    fn category_id(&self, name: &str) -> PyResult<usize> {
        Ok(self.inner.write_calibrator().intern(name)?)
    }

    /// Feeds a response's ``usage.prompt_tokens`` to the calibrator.
    fn feedback(
        &self,
        #[pyo3(from_py_with = int_arg)] prompt_bytes: i64,
        category: &str,
        #[pyo3(from_py_with = int_arg)] prompt_tokens: i64,
    ) -> PyResult<()> {
        Ok(self
            .inner
            .write_calibrator()
            .observe(category, prompt_bytes, prompt_tokens)?)
    }

    /// Ends one in-flight request on ``pool`` (name or index);
    /// ``NotInFlightError`` when none is in flight there.
    fn complete(&self, pool: &Bound<'_, PyAny>) -> PyResult<()> {
        Ok(self.inner.complete(self.pool_arg(pool)?)?)
    }

    /// Requests in flight on ``pool`` (name or index).
    fn in_flight(&self, pool: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.inner.in_flight(self.pool_arg(pool)?)?)
    }

    /// Telemetry: overwrite ``pool``'s in-flight count with a measured value.
    fn set_in_flight(
        &self,
        pool: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = int_arg)] count: i64,
    ) -> PyResult<()> {
        if count < 0 {
            return Err(PyValueError::new_err(format!(
                "count must be >= 0, got {count}"
            )));
        }
        Ok(self
            .inner
            .set_in_flight(self.pool_arg(pool)?, count as u64)?)
    }

    /// The pools, in the order given.
    #[getter]
    fn pools(&self, py: Python<'_>) -> Vec<Py<PyPool>> {
        self.pools.iter().map(|p| p.clone_ref(py)).collect()
    }

    /// The shared calibrator (the object passed in, if any).
    #[getter]
    fn calibrator(&self, py: Python<'_>) -> Py<PyCalibrator> {
        self.calibrator.clone_ref(py)
    }

    fn __repr__(&self) -> String {
        let names: Vec<&str> = self.inner.pools().iter().map(|p| p.name.as_str()).collect();
        format!("TokenBudgetRouter(pools={names:?})")
    }
}
