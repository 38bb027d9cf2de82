use std::sync::Mutex;

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::py::{float_array, int_arg, int_array, reduce};
use crate::queueing::{self, ErlangScan};

/// Erlang B: the blocking probability of M/M/c/c (c = ``servers``) at offered
/// load ``A = lambda / mu`` Erlangs, as the Poisson ratio P(X = c) / P(X <= c).
///
/// >>> round(erlang_b(2, 1.0), 12)
/// 0.2
#[pyfunction]
pub fn erlang_b(#[pyo3(from_py_with = int_arg)] servers: u64, offered_load: f64) -> PyResult<f64> {
    Ok(queueing::erlang_b(servers, offered_load)?)
}

/// Erlang C: the probability that an arrival waits in M/M/c (c = ``servers``)
/// at offered load ``A = lambda / mu < c``. Exact to ~1e-12 relative and
/// finite for c up to millions (a Poisson-tail series with a saddle-point
/// log-pmf, never factorials); ValueError when ``A >= c``.
///
/// >>> round(erlang_c(2, 1.0), 12)
/// 0.333333333333
#[pyfunction]
pub fn erlang_c(#[pyo3(from_py_with = int_arg)] servers: u64, offered_load: f64) -> PyResult<f64> {
    Ok(queueing::erlang_c(servers, offered_load)?)
}

/// ``erlang_c`` element-wise over NumPy arrays of server counts and loads
/// (equal lengths), as a float64 array; the first bad pair raises ValueError.
///
/// >>> erlang_c_many([1, 2], [0.3, 1.0]).round(12).tolist()
/// [0.3, 0.333333333333]
#[pyfunction]
pub fn erlang_c_many<'py>(
    py: Python<'py>,
    servers: &Bound<'py, PyAny>,
    offered_load: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let c = int_array(servers, "servers")?;
    let a = float_array(offered_load, "offered_load")?;
    let out = py.detach(|| queueing::erlang_c_many(&c, &a))?;
    Ok(out.into_pyarray(py))
}

/// FleetOpt's Kimura-style two-moment P99 queue wait of M/G/c (Eq. 6, after
/// Kimura 1994): ``W99 = ln(C / 0.01) * (1 + cs2) / (2 * (c * mu - lambda))``,
/// 0 when ``C <= 0.01``, ``inf`` when ``lambda >= c * mu``. ``service_rate``
/// is mu per server, ``cs2`` the squared coefficient of variation of service.
///
/// >>> round(p99_wait(1, 1.0, 1.0, 0.5), 6)  # M/M/1: C = 0.5, ln(50) * 2 / 1
/// 7.824046
#[pyfunction]
pub fn p99_wait(
    #[pyo3(from_py_with = int_arg)] servers: u64,
    service_rate: f64,
    cs2: f64,
    arrival_rate: f64,
) -> PyResult<f64> {
    Ok(queueing::p99_wait(
        servers,
        service_rate,
        cs2,
        arrival_rate,
    )?)
}

/// Erlang B and C while scanning the server count upward, O(1) per step.
///
/// ``ErlangScan(servers, offered_load)`` starts at ``servers``; ``advance(k)``
/// adds k servers by the recursion ``1/B_c = 1 + (c/A) / B_{c-1}`` in the log
/// domain. ``erlang_c`` is 1 while the load is at or above the servers.
///
/// >>> s = ErlangScan(1, 1.0)
/// >>> s.advance()
/// >>> s.servers, round(s.erlang_b, 12), round(s.erlang_c, 12)
/// (2, 0.2, 0.333333333333)
#[pyclass(frozen, name = "ErlangScan", module = "routecore")]
pub struct PyErlangScan {
    inner: Mutex<ErlangScan>,
}

impl PyErlangScan {
    fn get(&self) -> std::sync::MutexGuard<'_, ErlangScan> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyErlangScan {
    #[new]
    fn new(#[pyo3(from_py_with = int_arg)] servers: u64, offered_load: f64) -> PyResult<Self> {
        Ok(Self {
            inner: Mutex::new(ErlangScan::new(servers, offered_load)?),
        })
    }

    /// Adds ``steps`` servers (default 1; at most 2**32 per call).
    #[pyo3(signature = (steps=1))]
    fn advance(&self, py: Python<'_>, #[pyo3(from_py_with = int_arg)] steps: u64) -> PyResult<()> {
        if steps > 1 << 32 {
            return Err(
                crate::error::invalid(format!("steps must be at most 2**32, got {steps}")).into(),
            );
        }
        py.detach(|| {
            let mut s = self.get();
            for _ in 0..steps {
                s.advance();
            }
        });
        Ok(())
    }

    #[getter]
    fn servers(&self) -> u64 {
        self.get().servers()
    }

    #[getter]
    fn offered_load(&self) -> f64 {
        self.get().offered_load()
    }

    #[getter]
    fn erlang_b(&self) -> f64 {
        self.get().erlang_b()
    }

    #[getter]
    fn erlang_c(&self) -> f64 {
        self.get().erlang_c()
    }

    /// The scan's state as bytes; ``from_bytes`` restores it exactly.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.get().to_bytes())
    }

    /// Restores ``to_bytes``; ValueError for anything else.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(Self {
            inner: Mutex::new(ErlangScan::from_bytes(data)?),
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce(slf, slf.get().to_bytes(slf.py()))
    }

    fn __repr__(&self) -> String {
        let s = self.get();
        format!(
            "ErlangScan(servers={}, offered_load={}, erlang_c={})",
            s.servers(),
            s.offered_load(),
            s.erlang_c()
        )
    }
}
