use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::int_arg;
use crate::calibrate::{
    Calibrator, DEFAULT_BETA, DEFAULT_COLD_START, DEFAULT_GAMMA, DEFAULT_MAX_CATEGORIES,
    MAX_PROMPT_BYTES,
};
use crate::error::invalid;

/// Per-category bytes-per-token EMA learned from ``usage.prompt_tokens``.
///
/// ``c_hat <- c_hat + w (c_obs - c_hat)`` with ``c_obs = prompt_bytes /
/// prompt_tokens`` and ``w = max(1/n, 1 - beta)`` (the paper's EMA after a
/// bias-corrected start), and an EMA ``sigma_hat`` of ``|c_obs - c_hat|``.
/// Routing uses ``conservative_ratio = c_hat - gamma * sigma_hat``, never below
/// 0.5 bytes/token. Feedback outside [0.5, 32] bytes/token, zero or negative
/// sizes raise ValueError and change nothing. At most ``max_categories`` names
/// are learned; unseen names estimate with ``cold_start``. The defaults are
/// class attributes (``beta`` the paper's, ``cold_start`` English prose's):
///
/// >>> Calibrator.DEFAULT_BETA, Calibrator.DEFAULT_GAMMA, Calibrator.DEFAULT_COLD_START
/// (0.95, 1.0, 4.0)
///
/// >>> cal = Calibrator()
/// >>> cal.observe("code", 3500, 1000)
/// >>> cal.ratio("code"), cal.estimate_tokens(7000, "code")
/// (3.5, 2000)
#[pyclass(frozen, name = "Calibrator", module = "routecore")]
pub struct PyCalibrator {
    pub inner: Arc<RwLock<Calibrator>>,
}

impl PyCalibrator {
    pub fn read(&self) -> RwLockReadGuard<'_, Calibrator> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }
    pub fn write(&self) -> RwLockWriteGuard<'_, Calibrator> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyCalibrator {
    /// The default ``beta`` (the paper's EMA decay).
    #[classattr]
    const DEFAULT_BETA: f64 = DEFAULT_BETA;
    /// The default ``gamma`` (deviations the conservative ratio subtracts).
    #[classattr]
    const DEFAULT_GAMMA: f64 = DEFAULT_GAMMA;
    /// The default ``cold_start`` (bytes per token of a category not seen yet).
    #[classattr]
    const DEFAULT_COLD_START: f64 = DEFAULT_COLD_START;
    /// The default ``max_categories``.
    #[classattr]
    const DEFAULT_MAX_CATEGORIES: usize = DEFAULT_MAX_CATEGORIES;

    #[new]
    #[pyo3(signature = (beta=DEFAULT_BETA, gamma=DEFAULT_GAMMA, cold_start=DEFAULT_COLD_START, max_categories=DEFAULT_MAX_CATEGORIES))]
    fn new(
        beta: f64,
        gamma: f64,
        cold_start: f64,
        #[pyo3(from_py_with = int_arg)] max_categories: usize,
    ) -> PyResult<Self> {
        let cal = Calibrator::new(beta, gamma, cold_start, max_categories)?;
        Ok(Self {
            inner: Arc::new(RwLock::new(cal)),
        })
    }

    /// Folds one response's ``usage.prompt_tokens`` into ``category``.
    fn observe(
        &self,
        category: &str,
        #[pyo3(from_py_with = int_arg)] prompt_bytes: i64,
        #[pyo3(from_py_with = int_arg)] prompt_tokens: i64,
    ) -> PyResult<()> {
        Ok(self
            .write()
            .observe(category, prompt_bytes, prompt_tokens)?)
    }

    /// ``c_hat``, the learned bytes per token (``cold_start`` if unseen).
    fn ratio(&self, category: &str) -> f64 {
        self.read().stats(category).ratio
    }

    /// ``sigma_hat``, the EMA absolute deviation of the observed ratio.
    fn sigma(&self, category: &str) -> f64 {
        self.read().stats(category).sigma
    }

    /// ``max(c_hat - gamma * sigma_hat, 0.5)``: the ratio routing divides by.
    fn conservative_ratio(&self, category: &str) -> f64 {
        self.read().conservative_ratio(category)
    }

    /// ``ceil(prompt_bytes / conservative_ratio(category))``.
    fn estimate_tokens(
        &self,
        #[pyo3(from_py_with = int_arg)] prompt_bytes: i64,
        category: &str,
    ) -> PyResult<u64> {
        if prompt_bytes < 0 || prompt_bytes as u64 > MAX_PROMPT_BYTES {
            return Err(invalid(format!(
                "prompt_bytes must be in [0, {MAX_PROMPT_BYTES}], got {prompt_bytes}"
            ))
            .into());
        }
        Ok(self.read().estimate_tokens(prompt_bytes as u64, category))
    }

    /// Number of observations folded into ``category``.
    fn count(&self, category: &str) -> u64 {
        self.read().stats(category).count
    }

    /// Names learned so far, in id order.
    #[getter]
    fn categories(&self) -> Vec<String> {
        self.read().categories().to_vec()
    }

    #[getter]
    fn beta(&self) -> f64 {
        self.read().beta()
    }

    #[getter]
    fn gamma(&self) -> f64 {
        self.read().gamma()
    }

    #[getter]
    fn cold_start(&self) -> f64 {
        self.read().cold_start()
    }

    #[getter]
    fn max_categories(&self) -> usize {
        self.read().max_categories()
    }

    /// A snapshot of everything learned; ``from_bytes`` restores it exactly.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.read().to_bytes())
    }

    /// Restores a snapshot written by ``to_bytes``; ValueError if invalid.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(Self {
            inner: Arc::new(RwLock::new(Calibrator::from_bytes(data)?)),
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        super::reduce(slf, slf.get().to_bytes(slf.py()))
    }

    fn __repr__(&self) -> String {
        let c = self.read();
        format!(
            "Calibrator(beta={}, gamma={}, cold_start={}, categories={:?})",
            c.beta(),
            c.gamma(),
            c.cold_start(),
            c.categories()
        )
    }
}
