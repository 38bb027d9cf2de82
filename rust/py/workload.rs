use std::sync::Arc;

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::error::invalid;
use crate::py::{float_array, int_arg, int_array};
use crate::workload::{CsvColumns, Workload};

/// Input/output token pairs of a trace, or a weighted distribution from a CDF.
///
/// ``Workload(input_tokens, output_tokens, arrival_s=None, categories=None)``:
/// token counts are integer arrays (each in [0, 2**32], input + output >= 1),
/// ``arrival_s`` optional arrival times in seconds (finite, >= 0,
/// non-decreasing), ``categories`` optional labels such as ``"code"`` or
/// ``"conversation"`` (at most 256 distinct). Bad input raises ValueError.
///
/// ``cdf(x)`` is F(x) over total tokens ``L_total = L_in + L_out``,
/// ``quantile(q)`` its inverse; moments of the service time over any
/// total-token range come exactly from prefix sums over the requests sorted by
/// total (O(log n) per range): see ``Profile.service``. Array properties are
/// fresh copies in the order given.
///
/// >>> w = Workload([900, 100, 3000], [100, 50, 1000])
/// >>> len(w), w.cdf(1000), w.quantile(1.0)
/// (3, 0.6666666666666666, 4000)
#[pyclass(frozen, name = "Workload", module = "routecore")]
pub struct PyWorkload {
    pub inner: Arc<Workload>,
}

impl PyWorkload {
    fn wrap(w: Workload) -> Self {
        Self { inner: Arc::new(w) }
    }
}

fn read_csv(py: Python<'_>, path: &str, cols: &CsvColumns<'_>) -> PyResult<Workload> {
    let bytes = py
        .detach(|| std::fs::read(path))
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("{path}: {e}")))?;
    let bytes: Vec<u8> = if path.ends_with(".gz") {
        py.import("gzip")?
            .call_method1("decompress", (pyo3::types::PyBytes::new(py, &bytes),))?
            .extract()?
    } else {
        bytes
    };
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| invalid(format!("{path}: the CSV is not UTF-8")))?;
    Ok(py.detach(|| Workload::from_csv_text(text, cols))?)
}

#[pymethods]
impl PyWorkload {
    #[new]
    #[pyo3(signature = (input_tokens, output_tokens, arrival_s=None, categories=None))]
    fn new(
        input_tokens: &Bound<'_, PyAny>,
        output_tokens: &Bound<'_, PyAny>,
        arrival_s: Option<&Bound<'_, PyAny>>,
        categories: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let input = int_array(input_tokens, "input_tokens")?;
        let output = int_array(output_tokens, "output_tokens")?;
        let arrival = arrival_s.map(|a| float_array(a, "arrival_s")).transpose()?;
        Ok(Self::wrap(Workload::new(
            &input,
            &output,
            arrival.as_deref(),
            categories.as_deref(),
        )?))
    }

    /// A workload from a CSV file with a header row (``.gz`` is decompressed).
    ///
    /// ``input_column`` and ``output_column`` hold non-negative integers;
    /// ``arrival_column`` (optional) seconds or ``YYYY-MM-DD HH:MM:SS[.f]``
    /// timestamps, rows then ordered by arrival and rebased to 0 s;
    /// ``category_column`` (optional) labels. A missing column, a negative or
    /// non-numeric value raises ValueError naming it; an unreadable file OSError.
    #[staticmethod]
    #[pyo3(signature = (path, input_column="ContextTokens", output_column="GeneratedTokens", arrival_column=None, category_column=None))]
    fn from_csv(
        py: Python<'_>,
        path: std::path::PathBuf,
        input_column: &str,
        output_column: &str,
        arrival_column: Option<&str>,
        category_column: Option<&str>,
    ) -> PyResult<Self> {
        let cols = CsvColumns {
            input: input_column,
            output: output_column,
            arrival: arrival_column,
            category: category_column,
        };
        Ok(Self::wrap(read_csv(py, &path.to_string_lossy(), &cols)?))
    }

    /// The Azure LLM inference trace 2023 shipped with routecore: 28,185
    /// requests (8,819 ``"code"``, 19,366 ``"conversation"``) with arrival
    /// times from the trace's TIMESTAMP. CC-BY-4.0, Microsoft Azure Public
    /// Dataset (Patel et al., "Splitwise", ISCA 2024); see
    /// ``routecore/data/azure-llm-2023/README.md``.
    #[staticmethod]
    fn azure_2023(py: Python<'_>) -> PyResult<Self> {
        let path = py
            .import("importlib.resources")?
            .call_method1("files", ("routecore",))?
            .call_method1("joinpath", ("data/azure-llm-2023/azure_llm_2023.csv.gz",))?
            .str()?
            .to_string();
        let cols = CsvColumns {
            input: "ContextTokens",
            output: "GeneratedTokens",
            arrival: Some("TIMESTAMP"),
            category: Some("category"),
        };
        Ok(Self::wrap(read_csv(py, &path, &cols)?))
    }

    /// The distribution of a piecewise-linear CDF of total tokens.
    ///
    /// ``points``: ``(tokens, F)`` breakpoints, tokens strictly increasing
    /// integers >= 1, F non-decreasing in [0, 1] and ending at 1, F(0) = 0.
    /// Each bucket's mass spreads uniformly over its integer lengths (linear
    /// interpolation), one weighted request per length; a length L splits into
    /// ``L_in = max(1, floor(input_fraction * L))`` and ``L_out = L - L_in``.
    #[staticmethod]
    #[pyo3(signature = (points, input_fraction=0.8))]
    fn from_cdf(
        py: Python<'_>,
        #[pyo3(from_py_with = int_arg)] points: Vec<(i64, f64)>,
        input_fraction: f64,
    ) -> PyResult<Self> {
        Ok(Self::wrap(
            py.detach(|| Workload::from_cdf(&points, input_fraction))?,
        ))
    }

    /// ``n`` requests drawn with replacement in proportion to their weights
    /// (seeded), unit weights, categories kept, no arrival times: a trace-like
    /// sample of a ``from_cdf`` distribution, or a bootstrap of a trace.
    #[pyo3(signature = (n, seed=0))]
    fn sample(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = int_arg)] n: usize,
        #[pyo3(from_py_with = int_arg)] seed: u64,
    ) -> PyResult<Self> {
        let w = self.inner.clone();
        Ok(Self::wrap(py.detach(|| w.sample(n, seed))?))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// F(x): the (weighted) fraction of requests with total tokens <= x.
    fn cdf(&self, x: f64) -> PyResult<f64> {
        if x.is_nan() {
            return Err(invalid("x must not be NaN").into());
        }
        Ok(self.inner.cdf(x))
    }

    /// The smallest total-token count x in the workload with F(x) >= q.
    fn quantile(&self, q: f64) -> PyResult<u64> {
        Ok(self.inner.quantile(q)?)
    }

    /// Weighted mean total tokens of the requests with ``lo < L_total <= hi``.
    #[pyo3(signature = (lo=0.0, hi=f64::INFINITY))]
    fn mean_tokens(&self, lo: f64, hi: f64) -> PyResult<f64> {
        if lo.is_nan() || hi.is_nan() {
            return Err(invalid("lo and hi must not be NaN").into());
        }
        Ok(self.inner.mean_tokens(self.inner.span(lo, hi)))
    }

    #[getter]
    fn input_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.input_tokens().to_vec().into_pyarray(py)
    }

    #[getter]
    fn output_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.output_tokens().to_vec().into_pyarray(py)
    }

    #[getter]
    fn total_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        let w = &self.inner;
        let t: Vec<u64> = w
            .input_tokens()
            .iter()
            .zip(w.output_tokens())
            .map(|(a, b)| a + b)
            .collect();
        t.into_pyarray(py)
    }

    /// Request weights: 1.0 for trace rows; the CDF mass per length for ``from_cdf``.
    #[getter]
    fn weights<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        self.inner.weights().to_vec().into_pyarray(py)
    }

    /// Arrival times in seconds, or None when the workload has none.
    #[getter]
    fn arrival_s<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyArray1<f64>>> {
        self.inner.arrival_s().map(|a| a.to_vec().into_pyarray(py))
    }

    /// Per-request category labels as a NumPy str array, or None.
    #[getter]
    fn categories<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let w = &self.inner;
        if w.category_names().is_empty() {
            return Ok(None);
        }
        let labels: Vec<&str> = w
            .category_ids()
            .iter()
            .map(|&i| w.category_names()[i as usize].as_str())
            .collect();
        Ok(Some(
            py.import("numpy")?.call_method1("asarray", (labels,))?,
        ))
    }

    /// Distinct category labels in first-seen order (empty when none).
    #[getter]
    fn category_names(&self) -> Vec<String> {
        self.inner.category_names().to_vec()
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let w = slf.get();
        let cls = slf.get_type();
        if w.inner.weights().iter().any(|&x| x != 1.0) {
            return Err(invalid(
                "a weighted (from_cdf) workload does not pickle; rebuild it with from_cdf",
            )
            .into());
        }
        let args = PyTuple::new(
            py,
            [
                w.input_tokens(py).into_any(),
                w.output_tokens(py).into_any(),
                w.arrival_s(py)
                    .map_or(py.None().into_bound(py), |a| a.into_any()),
                match w.categories(py)? {
                    Some(c) => c.call_method0("tolist")?,
                    None => py.None().into_bound(py),
                },
            ],
        )?;
        PyTuple::new(py, [cls.into_any(), args.into_any()])
    }

    fn __repr__(&self) -> String {
        let w = &self.inner;
        format!(
            "Workload(requests={}, mean_total_tokens={:.1}, arrivals={}, categories={:?})",
            w.len(),
            w.mean_tokens(w.span(f64::NEG_INFINITY, f64::INFINITY)),
            w.arrival_s().is_some(),
            w.category_names()
        )
    }
}
