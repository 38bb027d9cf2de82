use std::sync::{Arc, RwLock};

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use super::{int_arg, int_array, real_array, reduce};
use crate::assign::eval::{evaluate, EvalConfig};
use crate::assign::knn::{check_k, KnnIndex};
use crate::assign::{
    Batch, BatchScheduler, BudgetFallback, Endpoint, Load, LptKey, Weights, PRESETS,
};
use crate::error::invalid;

/// One serving endpoint of a model: decode speed, per-token prices, slots.
///
/// ``tpot_s``: seconds per output token. ``price_in_per_mtok`` /
/// ``price_out_per_mtok``: USD per million input / output tokens.
/// ``max_batch``: decode slots. ``prefill_s_per_token``: seconds of prefill
/// per prompt token (default ``tpot_s / 200``).
///
/// >>> Endpoint("72b-0", "qwen2.5-72b", 0.0416, 0.38, 0.40, 16).cost(1000, 500)
/// 0.00058
#[pyclass(frozen, name = "Endpoint", module = "routecore")]
pub struct PyEndpoint {
    inner: Endpoint,
}

#[pymethods]
impl PyEndpoint {
    #[new]
    #[pyo3(signature = (name, model, tpot_s, price_in_per_mtok, price_out_per_mtok, max_batch, prefill_s_per_token=None))]
    fn new(
        name: &str,
        model: &str,
        tpot_s: f64,
        price_in_per_mtok: f64,
        price_out_per_mtok: f64,
        #[pyo3(from_py_with = int_arg)] max_batch: i64,
        prefill_s_per_token: Option<f64>,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: Endpoint::new(
                name,
                model,
                tpot_s,
                price_in_per_mtok,
                price_out_per_mtok,
                max_batch,
                prefill_s_per_token,
            )?,
        })
    }
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn model(&self) -> &str {
        &self.inner.model
    }
    #[getter]
    fn tpot_s(&self) -> f64 {
        self.inner.tpot_s
    }
    #[getter]
    fn price_in_per_mtok(&self) -> f64 {
        self.inner.price_in_per_mtok
    }
    #[getter]
    fn price_out_per_mtok(&self) -> f64 {
        self.inner.price_out_per_mtok
    }
    #[getter]
    fn max_batch(&self) -> u64 {
        self.inner.max_batch
    }
    #[getter]
    fn prefill_s_per_token(&self) -> f64 {
        self.inner.prefill_s_per_token
    }
    /// Predicted cost in USD: ``(in_tokens * price_in + out_len * price_out) / 1e6``.
    fn cost(&self, in_tokens: f64, out_len: f64) -> f64 {
        self.inner.cost(in_tokens, out_len)
    }
    /// Predicted latency in seconds: ``in_tokens * prefill_s_per_token +
    /// out_len * tpot_s``, plus ``pending_decode / max(batch_size, 1) *
    /// tpot_s`` when ``batch_size >= max_batch`` (no free decode slot).
    fn latency(
        &self,
        in_tokens: f64,
        out_len: f64,
        pending_decode: f64,
        #[pyo3(from_py_with = int_arg)] batch_size: u64,
    ) -> f64 {
        self.inner
            .latency(in_tokens, out_len, pending_decode, batch_size)
    }
    fn __repr__(&self) -> String {
        let i = &self.inner;
        format!(
            "Endpoint(name={:?}, model={:?}, tpot_s={}, price_in_per_mtok={}, price_out_per_mtok={}, max_batch={}, prefill_s_per_token={})",
            i.name, i.model, i.tpot_s, i.price_in_per_mtok, i.price_out_per_mtok, i.max_batch, i.prefill_s_per_token
        )
    }
}

fn weights_arg(weights: Option<&Bound<'_, PyAny>>) -> PyResult<Weights> {
    let Some(w) = weights else {
        return Ok(Weights::preset("balanced")?);
    };
    if let Ok(name) = w.extract::<&str>() {
        return Ok(Weights::preset(name)?);
    }
    let (q, l, c): (f64, f64, f64) = w.extract().map_err(|_| {
        PyValueError::new_err("weights must be a preset name or (quality, latency, cost)")
    })?;
    Ok(Weights::new(q, l, c)?)
}

/// A 1-D array-like of non-negative integers; an int64 array is read directly.
fn u64s(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    let values = match obj.extract::<numpy::PyReadonlyArray1<'_, i64>>() {
        Ok(a) => a.as_array().to_vec(),
        Err(_) => int_array(obj, what)?,
    };
    values
        .into_iter()
        .map(|v| u64::try_from(v).map_err(|_| invalid(format!("{what} must be >= 0, got {v}"))))
        .collect::<crate::error::Result<_>>()
        .map_err(PyErr::from)
}

/// RouteBalance's batched assignment of requests to model endpoints.
///
/// ``weights``: a preset name (``"quality"`` (0.8, 0.1, 0.1), ``"latency"``
/// (0.1, 0.8, 0.1), ``"cost"`` (0.1, 0.1, 0.8), ``"balanced"`` (1/3 each,
/// the default)) or a (quality, latency, cost) triple, normalised to sum 1.
/// The columns of ``quality`` and ``out_len`` are ``models``: the distinct
/// endpoint models in order of first appearance.
///
/// ``assign`` orders the batch longest predicted output first (LPT, key
/// ``lpt_key`` over models: "max", "mean" or "min"), drops endpoints whose
/// predicted cost exceeds the request's budget, and picks the endpoint with
/// the best ``w_q * quality + w_l * (1 - latency / max latency) + w_c * (1 -
/// cost / max cost)`` (maxima over the remaining candidates; latency and cost
/// as in ``Endpoint.latency`` / ``Endpoint.cost``). Ties go to the smaller
/// batch, then to the endpoint assigned least recently. After each choice
/// the chosen endpoint's pending decode grows by the request's predicted
/// length and its batch by one (dead reckoning). A request whose budget no
/// endpoint fits gets -1 with ``budget_fallback="reject"`` (default), or the
/// cheapest endpoint with ``"cheapest"`` (enforce the budget at dispatch with
/// a ``max_tokens`` clamp).
#[pyclass(frozen, name = "BatchScheduler", module = "routecore")]
pub struct PyBatchScheduler {
    inner: BatchScheduler,
}

impl PyBatchScheduler {
    /// Converts and checks the shared inputs of `assign` and `assign_one`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        quality: &Bound<'_, PyAny>,
        out_len: &Bound<'_, PyAny>,
        in_tokens: Vec<u64>,
        budget: Option<Vec<f64>>,
        pending_decode: &Bound<'_, PyAny>,
        batch_size: &Bound<'_, PyAny>,
        ndim: usize,
    ) -> PyResult<Vec<i64>> {
        let (q, q_shape) = real_array::<f64>(quality, ndim, "float64", "quality")?;
        let (l, l_shape) = real_array::<f64>(out_len, ndim, "float64", "out_len")?;
        if q_shape != l_shape {
            return Err(PyValueError::new_err(format!(
                "quality {q_shape:?} and out_len {l_shape:?} differ in shape"
            )));
        }
        let load = Load {
            pending: real_array::<f64>(pending_decode, 1, "float64", "pending_decode")?.0,
            batch: u64s(batch_size, "batch_size")?,
        };
        let batch = Batch {
            quality: &q,
            out_len: &l,
            in_tokens: &in_tokens,
            budget: budget.as_deref(),
        };
        Ok(py.detach(|| self.inner.assign(&batch, &load))?)
    }
}

#[pymethods]
impl PyBatchScheduler {
    #[new]
    #[pyo3(signature = (endpoints, weights=None, lpt_key="max", budget_fallback="reject"))]
    fn new(
        endpoints: Vec<PyRef<'_, PyEndpoint>>,
        weights: Option<&Bound<'_, PyAny>>,
        lpt_key: &str,
        budget_fallback: &str,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: BatchScheduler::new(
                endpoints.iter().map(|i| i.inner.clone()).collect(),
                weights_arg(weights)?,
                LptKey::from_name(lpt_key)?,
                BudgetFallback::from_name(budget_fallback)?,
            )?,
        })
    }

    /// Assigns a batch: ``quality`` and ``out_len`` ``[B, M]``, ``in_tokens``
    /// ``[B]``, ``budget`` ``[B]`` USD or None (``inf`` = no budget),
    /// ``pending_decode`` and ``batch_size`` ``[I]`` (the endpoints' telemetry).
    /// Returns the endpoint index per request (int64, batch order), -1 when
    /// no endpoint fits its budget. The arrays are copied first; bad input
    /// raises ValueError and changes nothing.
    #[pyo3(signature = (quality, out_len, in_tokens, budget, pending_decode, batch_size))]
    #[allow(clippy::too_many_arguments)] // the signature, plus `self` and `py`
    fn assign<'py>(
        &self,
        py: Python<'py>,
        quality: &Bound<'py, PyAny>,
        out_len: &Bound<'py, PyAny>,
        in_tokens: &Bound<'py, PyAny>,
        budget: Option<&Bound<'py, PyAny>>,
        pending_decode: &Bound<'py, PyAny>,
        batch_size: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let tokens = u64s(in_tokens, "in_tokens")?;
        let budget = match budget {
            Some(b) if !b.is_none() => Some(real_array::<f64>(b, 1, "float64", "budget")?.0),
            _ => None,
        };
        let got = self.run(
            py,
            quality,
            out_len,
            tokens,
            budget,
            pending_decode,
            batch_size,
            2,
        )?;
        Ok(got.into_pyarray(py))
    }

    /// Assigns one request (``quality`` and ``out_len`` ``[M]``): the same as
    /// ``assign`` over a batch of one.
    #[pyo3(signature = (quality, out_len, in_tokens, budget, pending_decode, batch_size))]
    #[allow(clippy::too_many_arguments)] // as `assign`
    fn assign_one(
        &self,
        py: Python<'_>,
        quality: &Bound<'_, PyAny>,
        out_len: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = int_arg)] in_tokens: i64,
        budget: Option<f64>,
        pending_decode: &Bound<'_, PyAny>,
        batch_size: &Bound<'_, PyAny>,
    ) -> PyResult<i64> {
        let tokens = u64::try_from(in_tokens)
            .map_err(|_| invalid(format!("in_tokens must be >= 0, got {in_tokens}")))?;
        let got = self.run(
            py,
            quality,
            out_len,
            vec![tokens],
            budget.map(|b| vec![b]),
            pending_decode,
            batch_size,
            1,
        )?;
        Ok(got[0])
    }

    /// The LPT order ``assign`` takes the batch in: request indices, longest
    /// ``lpt_key`` output first, equal keys in batch order.
    fn lpt_order<'py>(
        &self,
        py: Python<'py>,
        out_len: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let (l, shape) = real_array::<f64>(out_len, 2, "float64", "out_len")?;
        if shape[1] != self.inner.models().len() {
            return Err(invalid(format!(
                "out_len must have {} columns (one per model)",
                self.inner.models().len()
            ))
            .into());
        }
        if let Some(x) = l.iter().find(|x| x.is_nan()) {
            return Err(invalid(format!("out_len must not be NaN, got {x}")).into());
        }
        let order: Vec<i64> = self
            .inner
            .lpt_order(&l)
            .into_iter()
            .map(|i| i as i64)
            .collect();
        Ok(order.into_pyarray(py))
    }

    /// The preset weight vectors, name -> (quality, latency, cost).
    #[staticmethod]
    fn presets() -> Vec<(&'static str, (f64, f64, f64))> {
        PRESETS
            .iter()
            .map(|(n, [q, l, c])| (*n, (*q, *l, *c)))
            .collect()
    }

    #[getter]
    fn endpoints(&self) -> Vec<PyEndpoint> {
        self.inner
            .endpoints()
            .iter()
            .map(|i| PyEndpoint { inner: i.clone() })
            .collect()
    }
    /// The models, in column order of ``quality`` and ``out_len``.
    #[getter]
    fn models(&self) -> Vec<String> {
        self.inner.models().to_vec()
    }
    /// The model column of each endpoint.
    #[getter]
    fn model_of(&self) -> Vec<usize> {
        self.inner.model_of().to_vec()
    }
    /// (quality, latency, cost), normalised to sum 1.
    #[getter]
    fn weights(&self) -> (f64, f64, f64) {
        let w = self.inner.weights();
        (w.quality, w.latency, w.cost)
    }
    #[getter]
    fn lpt_key(&self) -> &'static str {
        self.inner.lpt_key().as_str()
    }
    #[getter]
    fn budget_fallback(&self) -> &'static str {
        self.inner.budget_fallback().as_str()
    }

    /// A snapshot of the configuration and the tie-break recency state.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }

    /// Restores a snapshot written by ``to_bytes``; ValueError if invalid.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(Self {
            inner: BatchScheduler::from_bytes(data)?,
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce(slf, slf.get().to_bytes(slf.py()))
    }

    fn __repr__(&self) -> String {
        let (q, l, c) = self.weights();
        format!(
            "BatchScheduler(endpoints={}, models={:?}, weights=({q:.3}, {l:.3}, {c:.3}), lpt_key={:?}, budget_fallback={:?})",
            self.inner.endpoints().len(),
            self.inner.models(),
            self.inner.lpt_key().as_str(),
            self.inner.budget_fallback().as_str()
        )
    }
}

/// Per-model quality and output length of a prompt, from its embedding, by
/// distance-weighted cosine k-nearest neighbours (RouteBalance's estimator).
///
/// ``fit(embeddings [N, d], quality [N, M], out_len [N, M])`` stores the
/// labelled training prompts (rows L2-normalised); ``predict(embeddings [B,
/// d])`` returns ``(quality [B, M], out_len [B, M])``, each the mean of the k
/// most cosine-similar training rows weighted by ``1 / (1 - cos + 1e-6)``.
/// Embeddings may come from any sentence-embedding model, e.g.
/// ``SentenceTransformer("all-MiniLM-L6-v2").encode(prompts)``, as long as
/// fit and predict use the same one. The scan is exact and runs in Rust with
/// the interpreter released.
#[pyclass(frozen, name = "KnnEstimator", module = "routecore")]
pub struct PyKnnEstimator {
    k: usize,
    index: RwLock<Option<Arc<KnnIndex>>>,
}

impl PyKnnEstimator {
    fn fitted(&self) -> PyResult<Arc<KnnIndex>> {
        self.index
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| PyValueError::new_err("KnnEstimator is not fitted: call fit first"))
    }
}

type Matrix<'py> = Bound<'py, PyArray2<f64>>;

/// A row-major `[len / cols, cols]` NumPy array.
fn matrix<'py>(py: Python<'py>, v: Vec<f64>, cols: usize) -> PyResult<Matrix<'py>> {
    let rows = v.len() / cols.max(1);
    let a = Array2::from_shape_vec((rows, cols), v)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(a.into_pyarray(py))
}

#[pymethods]
impl PyKnnEstimator {
    #[new]
    #[pyo3(signature = (k=8))]
    fn new(#[pyo3(from_py_with = int_arg)] k: i64) -> PyResult<Self> {
        Ok(Self {
            k: check_k(k)?,
            index: RwLock::new(None),
        })
    }

    /// Stores the training prompts: ``embeddings`` ``[N, d]`` (converted to
    /// float32), ``quality`` and ``out_len`` ``[N, M]``. Replaces any earlier
    /// fit; on error the estimator is unchanged.
    fn fit(
        &self,
        py: Python<'_>,
        embeddings: &Bound<'_, PyAny>,
        quality: &Bound<'_, PyAny>,
        out_len: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (emb, e_shape) = real_array::<f32>(embeddings, 2, "float32", "embeddings")?;
        let (q, q_shape) = real_array::<f64>(quality, 2, "float64", "quality")?;
        let (l, l_shape) = real_array::<f64>(out_len, 2, "float64", "out_len")?;
        if q_shape != l_shape || q_shape[0] != e_shape[0] {
            return Err(PyValueError::new_err(format!(
                "embeddings {e_shape:?}, quality {q_shape:?} and out_len {l_shape:?} must share N (and M)"
            )));
        }
        let k = self.k;
        let index = py.detach(|| KnnIndex::fit(k, emb, e_shape[1], q, l, q_shape[1]))?;
        *self.index.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(index));
        Ok(())
    }

    /// ``(quality [B, M], out_len [B, M])`` for ``embeddings`` ``[B, d]``.
    fn predict<'py>(
        &self,
        py: Python<'py>,
        embeddings: &Bound<'py, PyAny>,
    ) -> PyResult<(Matrix<'py>, Matrix<'py>)> {
        let index = self.fitted()?;
        let (emb, shape) = real_array::<f32>(embeddings, 2, "float32", "embeddings")?;
        if shape[1] != index.dim() {
            return Err(PyValueError::new_err(format!(
                "embeddings must have {} columns like the fitted ones, got {}",
                index.dim(),
                shape[1]
            )));
        }
        let (q, l) = py.detach(|| index.predict(&emb))?;
        let m = index.models();
        Ok((matrix(py, q, m)?, matrix(py, l, m)?))
    }

    #[getter]
    fn k(&self) -> usize {
        self.k
    }
    /// Whether ``fit`` has been called.
    #[getter]
    fn is_fitted(&self) -> bool {
        self.fitted().is_ok()
    }

    /// A snapshot of the fitted index (ValueError before ``fit``).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let index = self.fitted()?;
        let bytes = py.detach(|| index.to_bytes());
        Ok(PyBytes::new(py, &bytes))
    }

    /// Restores a snapshot written by ``to_bytes``; ValueError if invalid.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        let index = py.detach(|| KnnIndex::from_bytes(data))?;
        Ok(Self {
            k: index.k(),
            index: RwLock::new(Some(Arc::new(index))),
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        if slf.get().is_fitted() {
            return reduce(slf, slf.get().to_bytes(py)?);
        }
        let args = PyTuple::new(py, [slf.get().k])?;
        PyTuple::new(py, [slf.get_type().into_any(), args.into_any()])
    }

    fn __repr__(&self) -> String {
        match self.fitted() {
            Ok(i) => format!(
                "KnnEstimator(k={}, n={}, dim={}, models={})",
                self.k,
                i.len(),
                i.dim(),
                i.models()
            ),
            Err(_) => format!("KnnEstimator(k={}, unfitted)", self.k),
        }
    }
}

/// Runs the discrete-event evaluation of ``routecore.assign`` policies on
/// RouteBalance's fleet (see ``routecore assign-eval --help`` and the README):
/// one dict per policy with ``policy``, ``family``, ``quality``,
/// ``mean_latency_s``, ``p95_latency_s``, ``cost_per_request_usd`` and
/// ``model_share`` (model -> share of requests).
#[pyfunction]
#[pyo3(signature = (rate=8.0, requests=3000, seed=0, max_batch=16, interval_s=0.05))]
pub fn assign_eval<'py>(
    py: Python<'py>,
    rate: f64,
    #[pyo3(from_py_with = int_arg)] requests: usize,
    #[pyo3(from_py_with = int_arg)] seed: u64,
    #[pyo3(from_py_with = int_arg)] max_batch: i64,
    interval_s: f64,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let cfg = EvalConfig {
        rate,
        requests,
        seed,
        max_batch,
        interval_s,
    };
    let rows = py.detach(|| evaluate(&cfg))?;
    let models: Vec<&str> = crate::assign::eval::PAPER_FLEET
        .iter()
        .map(|t| t.model)
        .collect();
    rows.into_iter()
        .map(|(name, family, o)| {
            let d = PyDict::new(py);
            d.set_item("policy", name)?;
            d.set_item("family", family)?;
            d.set_item("quality", o.quality)?;
            d.set_item("mean_latency_s", o.mean_latency_s)?;
            d.set_item("p95_latency_s", o.p95_latency_s)?;
            d.set_item("cost_per_request_usd", o.cost_per_request_usd)?;
            let share = PyDict::new(py);
            for (m, s) in models.iter().zip(&o.model_share) {
                share.set_item(m, s)?;
            }
            d.set_item("model_share", share)?;
            Ok(d)
        })
        .collect()
}
