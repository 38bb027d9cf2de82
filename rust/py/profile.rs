use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::error::invalid;
use crate::profile::Profile;
use crate::py::workload::PyWorkload;
use crate::py::{int_arg, set_fields};

/// A model on a GPU type: KV memory, slots and iteration timing.
///
/// KV bytes per token ``= 2 * layers * kv_heads * head_dim * dtype_bytes``
/// (per GPU: ``ceil(kv_heads / tensor_parallel)`` heads);
/// ``slots(C) = floor((gpu_memory_bytes * utilization - model_memory_bytes) /
/// (kv_bytes_per_token_per_gpu * C))``; ``t_iter(n) = w_s + h_s * n``; service
/// time ``S = (ceil(L_in / c_chunk) + L_out) * t_iter``. With ``h_ref_tokens``
/// set, the per-slot cost scales with each request's total length:
/// ``t_iter = w_s + h_s * (L_total / h_ref_tokens) * n`` (the slot model of
/// FleetOpt's public implementation). Memory is per GPU, in bytes. Invalid
/// fields raise ValueError.
///
/// >>> p = Profile.llama3_70b_a100()
/// >>> p.kv_bytes_per_token, p.slots(65536), p.slots(4096)
/// (327680.0, 16, 256)
#[pyclass(frozen, name = "Profile", module = "routecore")]
pub struct PyProfile {
    pub inner: Profile,
}

/// One pool's service of a workload range (see ``Profile.service``).
#[pyclass(frozen, name = "Service", module = "routecore", get_all)]
pub struct PyService {
    /// Slots per GPU at the pool's context window.
    n_slots: u64,
    /// Fraction of the workload in the range.
    fraction: f64,
    /// E[S], seconds.
    mean_s: f64,
    /// Var[S] / E[S]^2.
    cs2: f64,
    /// n_slots / E[S], requests per second per GPU.
    mu_gpu: f64,
    /// Iteration time at full occupancy (range's mean length), seconds.
    t_iter_s: f64,
    /// Prefill time at the quantile asked for (P99 by default), seconds.
    prefill_p99_s: f64,
}

#[pymethods]
impl PyService {
    fn __repr__(&self) -> String {
        format!(
            "Service(n_slots={}, fraction={:.6}, mean_s={:.6}, cs2={:.6}, mu_gpu={:.6}, t_iter_s={:.6}, prefill_p99_s={:.6})",
            self.n_slots, self.fraction, self.mean_s, self.cs2, self.mu_gpu, self.t_iter_s, self.prefill_p99_s
        )
    }
}

#[pymethods]
impl PyProfile {
    #[new]
    #[pyo3(signature = (
        name, *, layers, kv_heads, head_dim, dtype_bytes, gpu_memory_bytes, model_memory_bytes,
        w_s, h_s, utilization=0.9, tensor_parallel=1, c_chunk=512, price_per_gpu_hour=0.0,
        h_ref_tokens=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: String,
        #[pyo3(from_py_with = int_arg)] layers: u32,
        #[pyo3(from_py_with = int_arg)] kv_heads: u32,
        #[pyo3(from_py_with = int_arg)] head_dim: u32,
        dtype_bytes: f64,
        gpu_memory_bytes: f64,
        model_memory_bytes: f64,
        w_s: f64,
        h_s: f64,
        utilization: f64,
        #[pyo3(from_py_with = int_arg)] tensor_parallel: u32,
        #[pyo3(from_py_with = int_arg)] c_chunk: u64,
        price_per_gpu_hour: f64,
        #[pyo3(from_py_with = int_arg)] h_ref_tokens: Option<u64>,
    ) -> PyResult<Self> {
        let p = Profile {
            name,
            layers,
            kv_heads,
            head_dim,
            dtype_bytes,
            tensor_parallel,
            gpu_memory_bytes,
            utilization,
            model_memory_bytes,
            w_s,
            h_s,
            c_chunk,
            price_per_gpu_hour,
            h_ref_tokens,
        };
        p.validate()?;
        Ok(Self { inner: p })
    }

    /// Llama-3-70B (BF16) on A100-80GB at TP=8, FleetOpt's evaluation profile:
    /// W = 8 ms, H = 0.65 ms/slot, C_chunk = 512, $2.21/GPU-hour (FleetOpt
    /// Section 7.1); 320 KiB/token of KV (40 KiB per GPU); 80 GiB at 0.90 minus
    /// 32 GiB leaves 40 GiB of KV: 16 slots at 64K, 256 at 4K.
    #[staticmethod]
    fn llama3_70b_a100() -> Self {
        Self {
            inner: Profile::llama3_70b_a100(),
        }
    }

    /// Qwen3-235B-A22B FP8 on MI300X (192 GB) at TP=8, the token-budget
    /// paper's case study (Section 4.7): 23.5 KiB/token/GPU, 133.4 GB of KV
    /// (676 slots at 8K, 169 at 32K), $3.67/GPU-hour. W = 3 ms and H = 0.25 ms
    /// are bandwidth-scaled from the A100 values (the paper gives none).
    #[staticmethod]
    fn qwen3_235b_mi300x() -> Self {
        Self {
            inner: Profile::qwen3_235b_mi300x(),
        }
    }

    /// A copy with some fields changed (keyword arguments as in the constructor).
    #[pyo3(signature = (**changes))]
    fn replace(&self, py: Python<'_>, changes: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let kwargs = self.fields(py)?;
        if let Some(c) = changes {
            for (k, v) in c.iter() {
                if !kwargs.contains(&k)? {
                    return Err(invalid(format!("Profile has no field {k}")).into());
                }
                kwargs.set_item(k, v)?;
            }
        }
        let name = kwargs
            .get_item("name")?
            .ok_or_else(|| invalid("Profile fields have no name"))?;
        kwargs.del_item("name")?;
        let cls = py.get_type::<PyProfile>();
        let obj = cls.call((name,), Some(&kwargs))?;
        let p: PyRef<'_, PyProfile> = obj.extract()?;
        Ok(Self {
            inner: p.inner.clone(),
        })
    }

    /// The constructor's keyword arguments, as a dict (``name`` included).
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = &self.inner;
        let d = PyDict::new(py);
        set_fields!(d, p;
            name, layers, kv_heads, head_dim, dtype_bytes, gpu_memory_bytes,
            model_memory_bytes, w_s, h_s, utilization, tensor_parallel, c_chunk,
            price_per_gpu_hour, h_ref_tokens,
        );
        Ok(d)
    }

    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn layers(&self) -> u32 {
        self.inner.layers
    }
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }
    #[getter]
    fn dtype_bytes(&self) -> f64 {
        self.inner.dtype_bytes
    }
    #[getter]
    fn gpu_memory_bytes(&self) -> f64 {
        self.inner.gpu_memory_bytes
    }
    #[getter]
    fn model_memory_bytes(&self) -> f64 {
        self.inner.model_memory_bytes
    }
    #[getter]
    fn utilization(&self) -> f64 {
        self.inner.utilization
    }
    #[getter]
    fn tensor_parallel(&self) -> u32 {
        self.inner.tensor_parallel
    }
    #[getter]
    fn w_s(&self) -> f64 {
        self.inner.w_s
    }
    #[getter]
    fn h_s(&self) -> f64 {
        self.inner.h_s
    }
    #[getter]
    fn c_chunk(&self) -> u64 {
        self.inner.c_chunk
    }
    #[getter]
    fn price_per_gpu_hour(&self) -> f64 {
        self.inner.price_per_gpu_hour
    }
    #[getter]
    fn h_ref_tokens(&self) -> Option<u64> {
        self.inner.h_ref_tokens
    }

    /// ``2 * layers * kv_heads * head_dim * dtype_bytes`` (whole model).
    #[getter]
    fn kv_bytes_per_token(&self) -> f64 {
        self.inner.kv_bytes_per_token()
    }

    /// KV bytes per token on one GPU under tensor parallelism.
    #[getter]
    fn kv_bytes_per_token_per_gpu(&self) -> f64 {
        self.inner.kv_bytes_per_token_per_gpu()
    }

    /// Concurrent sequences per GPU at a context window of ``max_context`` tokens.
    fn slots(&self, #[pyo3(from_py_with = int_arg)] max_context: u64) -> PyResult<u64> {
        Ok(self.inner.slots(max_context)?)
    }

    /// ``w_s + h_s * n``, seconds.
    fn t_iter(&self, n: f64) -> PyResult<f64> {
        crate::error::non_negative("n", n)?;
        Ok(self.inner.t_iter(n))
    }

    /// Service of the requests with ``lo < L_total <= hi`` on GPUs with a
    /// context window of ``max_context`` tokens: E[S], Cs^2, mu_gpu and the
    /// prefill time at ``prefill_quantile``, exact over the workload.
    #[pyo3(signature = (workload, max_context, lo=0.0, hi=f64::INFINITY, prefill_quantile=0.99))]
    fn service(
        &self,
        py: Python<'_>,
        workload: &PyWorkload,
        #[pyo3(from_py_with = int_arg)] max_context: u64,
        lo: f64,
        hi: f64,
        prefill_quantile: f64,
    ) -> PyResult<PyService> {
        if lo.is_nan() || hi.is_nan() {
            return Err(invalid("lo and hi must not be NaN").into());
        }
        if !(0.0..=1.0).contains(&prefill_quantile) {
            return Err(invalid(format!(
                "prefill_quantile must be in [0, 1], got {prefill_quantile}"
            ))
            .into());
        }
        let w = workload.inner.clone();
        let s = py.detach(|| {
            self.inner
                .service(&w, w.span(lo, hi), max_context, prefill_quantile)
        })?;
        Ok(PyService {
            n_slots: s.n_slots,
            fraction: s.fraction,
            mean_s: s.mean_s,
            cs2: s.cs2,
            mu_gpu: s.mu_gpu,
            t_iter_s: s.t_iter_s,
            prefill_p99_s: s.prefill_p99_s,
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let fields = slf.get().fields(py)?;
        let name = fields
            .get_item("name")?
            .ok_or_else(|| invalid("Profile fields have no name"))?;
        fields.del_item("name")?;
        // functools.partial(Profile, **fields)(name) rebuilds it exactly.
        let partial = py
            .import("functools")?
            .getattr("partial")?
            .call((slf.get_type(),), Some(&fields))?;
        PyTuple::new(
            py,
            [partial.into_any(), PyTuple::new(py, [name])?.into_any()],
        )
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .extract::<PyRef<'_, PyProfile>>()
            .is_ok_and(|o| o.inner == self.inner)
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "Profile({:?}, layers={}, kv_heads={}, head_dim={}, dtype_bytes={}, tensor_parallel={}, gpu_memory_bytes={}, utilization={}, model_memory_bytes={}, w_s={}, h_s={}, c_chunk={}, price_per_gpu_hour={}, h_ref_tokens={:?})",
            p.name, p.layers, p.kv_heads, p.head_dim, p.dtype_bytes, p.tensor_parallel,
            p.gpu_memory_bytes, p.utilization, p.model_memory_bytes, p.w_s, p.h_s, p.c_chunk,
            p.price_per_gpu_hour, p.h_ref_tokens
        )
    }
}
