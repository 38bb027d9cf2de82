use std::sync::{Arc, Mutex, MutexGuard};

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use super::{
    detach_if, hash_array, int_arg, int_array, now_or_monotonic, reduce, size_arg, TokenArg,
    DETACH_TOKENS,
};
use crate::pick::PrefixCacheRouter;
use crate::prefix::{
    block_hashes as core_block_hashes, block_hashes_many as core_block_hashes_many, PrefixConfig,
    PrefixIndex, DEFAULT_CAPACITY_BLOCKS,
};

/// Two NumPy arrays returned together.
type ArrayPair<'py, A, B> = (Bound<'py, PyArray1<A>>, Bound<'py, PyArray1<B>>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The chained xxh3-64 hashes of a prompt's full blocks, as uint64.
///
/// ``tokens``: a NumPy uint32 array of token ids (other integer arrays and
/// lists are converted), or ``bytes`` / ``str`` for the character tokenizer
/// (blocks of ``block_size`` bytes of UTF-8). A partial tail block is ignored.
/// With ``le8(x)`` the 8 little-endian bytes of x and token ids as
/// little-endian u32::
///
///     h_0 = xxh3_64(le8(seed)    + block_0, seed)
///     h_i = xxh3_64(le8(h_{i-1}) + block_i, seed)
///
///     >>> block_hashes(b"abcdefgh", 4).shape
///     (2,)
#[pyfunction]
#[pyo3(signature = (tokens, block_size, seed=0))]
pub fn block_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = int_arg)] block_size: i64,
    #[pyo3(from_py_with = int_arg)] seed: u64,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let block_size = size_arg(block_size, "block_size")?;
    let arg = TokenArg::new(tokens, "tokens")?;
    let t = arg.tokens()?;
    let hashes = detach_if(py, t.len() >= DETACH_TOKENS, || {
        core_block_hashes(t, block_size, seed)
    })?;
    Ok(hashes.into_pyarray(py))
}

/// ``block_hashes`` over many prompts in one flat array (ragged batch).
///
/// Prompt ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``; ``offsets`` starts
/// at 0, never decreases and ends at ``len(tokens)``. Returns ``(hashes,
/// hash_offsets)``: prompt ``i``'s hashes are
/// ``hashes[hash_offsets[i]:hash_offsets[i + 1]]``.
#[pyfunction]
#[pyo3(signature = (tokens, offsets, block_size, seed=0))]
pub fn block_hashes_many<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = int_arg)] block_size: i64,
    #[pyo3(from_py_with = int_arg)] seed: u64,
) -> PyResult<ArrayPair<'py, u64, i64>> {
    let block_size = size_arg(block_size, "block_size")?;
    let offsets = int_array(offsets, "offsets")?;
    let arg = TokenArg::new(tokens, "tokens")?;
    let t = arg.tokens()?;
    let (hashes, out) = py.detach(|| core_block_hashes_many(t, &offsets, block_size, seed))?;
    Ok((hashes.into_pyarray(py), out.into_pyarray(py)))
}

// The signature's default is written as a literal (for the text signature).
const _: () = assert!(DEFAULT_CAPACITY_BLOCKS == 200_000);

/// Block hash -> the endpoints that hold it, for prefix-cache-aware routing.
///
/// Holds at most ``capacity_blocks`` hashes, evicting the least recently
/// recorded; with ``ttl_s`` a hash not recorded for longer than ``ttl_s``
/// seconds is dropped. ``now`` (seconds) defaults to ``monotonic()``. A prompt's first
/// block is recorded last, so shared prefixes are evicted last. Endpoints get one
/// of 4,096 ids; when all are taken, the ids of endpoints that hold no block any
/// more are reused (those endpoints leave ``endpoints``), so any number of distinct endpoints
/// may pass through. Thread-safe; share one index between routers by passing
/// it to ``PrefixCacheRouter``.
///
///     >>> ix = PrefixIndex(1000)
///     >>> h = block_hashes(b"system prompt, then a question", 8)
///     >>> ix.record(h, "endpoint-a")
///     >>> ix.match_prefix(h[:2])
///     {'endpoint-a': 2}

#[pyclass(frozen, name = "PrefixIndex", module = "routecore")]
pub struct PyPrefixIndex {
    inner: Arc<Mutex<PrefixIndex>>,
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    #[pyo3(signature = (capacity_blocks=200_000, ttl_s=None))]
    fn new(
        #[pyo3(from_py_with = int_arg)] capacity_blocks: i64,
        ttl_s: Option<f64>,
    ) -> PyResult<Self> {
        let capacity = size_arg(capacity_blocks, "capacity_blocks")?;
        Ok(Self {
            inner: Arc::new(Mutex::new(PrefixIndex::new(capacity, ttl_s)?)),
        })
    }

    /// Records that ``endpoint`` holds every block of ``hashes`` (uint64) at ``now``.
    #[pyo3(signature = (hashes, endpoint, now=None))]
    fn record(&self, hashes: &Bound<'_, PyAny>, endpoint: &str, now: Option<f64>) -> PyResult<()> {
        let hashes = hash_array(hashes)?;
        Ok(lock(&self.inner).record(&hashes, endpoint, now_or_monotonic(now))?)
    }

    /// ``{endpoint: leading blocks of hashes it holds}``, endpoints with none left out.
    #[pyo3(signature = (hashes, now=None))]
    fn match_prefix<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
        now: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hashes = hash_array(hashes)?;
        let matched = lock(&self.inner).match_prefix(&hashes, now_or_monotonic(now))?;
        let d = PyDict::new(py);
        for (endpoint, n) in matched {
            d.set_item(endpoint, n)?;
        }
        Ok(d)
    }

    /// Forgets ``endpoint`` (KeyError if unknown); returns how many blocks it held.
    fn remove_endpoint(&self, endpoint: &str) -> PyResult<usize> {
        Ok(lock(&self.inner).remove_endpoint(endpoint)?)
    }

    /// Drops hashes idle longer than ``ttl_s`` at ``now``; returns how many.
    #[pyo3(signature = (now=None))]
    fn expire(&self, now: Option<f64>) -> PyResult<usize> {
        Ok(lock(&self.inner).expire(now_or_monotonic(now))?)
    }

    fn __len__(&self) -> usize {
        lock(&self.inner).len()
    }

    #[getter]
    fn capacity_blocks(&self) -> usize {
        lock(&self.inner).capacity()
    }

    #[getter]
    fn ttl_s(&self) -> Option<f64> {
        lock(&self.inner).ttl()
    }

    /// Names of the endpoints the index knows.
    #[getter]
    fn endpoints(&self) -> Vec<String> {
        lock(&self.inner).endpoints()
    }

    /// A snapshot (hashes, endpoints, LRU order, times); ``from_bytes`` restores it.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &lock(&self.inner).to_bytes())
    }

    /// Restores a snapshot written by ``to_bytes``; ValueError if invalid.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(Self {
            inner: Arc::new(Mutex::new(PrefixIndex::from_bytes(data)?)),
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce(slf, slf.get().to_bytes(slf.py()))
    }

    fn __repr__(&self) -> String {
        let ix = lock(&self.inner);
        format!(
            "PrefixIndex(capacity_blocks={}, ttl_s={}, len={})",
            ix.capacity(),
            ix.ttl().map_or("None".to_owned(), |t| t.to_string()),
            ix.len()
        )
    }
}

/// Prefix-cache-aware routing (the AIBrix algorithm) over named endpoints.
///
/// If ``max - min`` running requests exceeds ``imbalance_abs_count``, the
/// least-loaded endpoint. Otherwise the prompt's block hashes are matched from the
/// first block on, per endpoint, up to each endpoint's first miss; endpoints with a match are
/// ordered by matched blocks (descending), then running requests (ascending),
/// and the first whose running count is at or below ``mean + std_factor *
/// std`` (over all endpoints) wins; else the least-loaded endpoint (first on ties). The
/// prompt's blocks are then recorded in the index for the chosen endpoint, and it
/// counts one more running request until ``complete(endpoint)``.
///
/// ``running``, where accepted, overwrites every endpoint's count first (one per
/// endpoint, in ``endpoints`` order) for callers that measure load themselves. Use
/// ``block_size=16`` for token ids and 128 for bytes (AIBrix's defaults).
///
///     >>> r = PrefixCacheRouter(["a", "b"], block_size=4)
///     >>> r.route(b"You are helpful. Hi!")
///     ('a', 0.0)
///     >>> r.route(b"You are helpful. Bye", running=[0, 0])
///     ('a', 0.8)
#[pyclass(frozen, name = "PrefixCacheRouter", module = "routecore")]
pub struct PyPrefixCacheRouter {
    config: PrefixConfig,
    inner: Mutex<PrefixCacheRouter>,
}

impl PyPrefixCacheRouter {
    fn router(&self) -> MutexGuard<'_, PrefixCacheRouter> {
        lock(&self.inner)
    }
}

fn running_arg(running: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<i64>>> {
    running.map(|r| int_array(r, "running")).transpose()
}

#[pymethods]
impl PyPrefixCacheRouter {
    #[new]
    #[pyo3(signature = (endpoints, block_size=16, imbalance_abs_count=16, std_factor=2.0, index=None, seed=0))]
    fn new(
        endpoints: Vec<String>,
        #[pyo3(from_py_with = int_arg)] block_size: i64,
        #[pyo3(from_py_with = int_arg)] imbalance_abs_count: i64,
        std_factor: f64,
        index: Option<&PyPrefixIndex>,
        #[pyo3(from_py_with = int_arg)] seed: u64,
    ) -> PyResult<Self> {
        let config = PrefixConfig::new(
            size_arg(block_size, "block_size")?,
            imbalance_abs_count,
            std_factor,
            seed,
        )?;
        let index = match index {
            Some(ix) => Arc::clone(&ix.inner),
            None => Arc::new(Mutex::new(PrefixIndex::new(DEFAULT_CAPACITY_BLOCKS, None)?)),
        };
        Ok(Self {
            config,
            inner: Mutex::new(PrefixCacheRouter::new(&endpoints, config, index)?),
        })
    }

    /// Routes one prompt: ``(endpoint, match_fraction)``, the fraction of the
    /// prompt's full blocks the chosen endpoint held (0.0 below one block).
    #[pyo3(signature = (tokens, running=None, now=None))]
    fn route(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        running: Option<&Bound<'_, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<(String, f64)> {
        let running = running_arg(running)?;
        let now = now_or_monotonic(now);
        let arg = TokenArg::new(tokens, "tokens")?;
        let t = arg.tokens()?;
        let c = self.config;
        let out = detach_if(py, t.len() >= DETACH_TOKENS, || {
            let hashes = core_block_hashes(t, c.block_size, c.seed)?;
            let mut router = self.router();
            let d = router.route_hashes(&hashes, running.as_deref(), now)?;
            Ok::<_, crate::error::Error>((
                router.endpoints()[d.endpoint].clone(),
                d.match_fraction(),
            ))
        })?;
        Ok(out)
    }

    /// Routes a ragged batch (``tokens`` flat, prompt ``i`` is
    /// ``tokens[offsets[i]:offsets[i + 1]]``) exactly as ``route`` one by one
    /// would, ``running`` applied before the first. Returns ``(endpoint indices
    /// into endpoints, match fractions)``.
    #[pyo3(signature = (tokens, offsets, running=None, now=None))]
    fn route_many<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
        running: Option<&Bound<'py, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<ArrayPair<'py, i64, f64>> {
        let running = running_arg(running)?;
        let now = now_or_monotonic(now);
        let offsets = int_array(offsets, "offsets")?;
        let arg = TokenArg::new(tokens, "tokens")?;
        let t = arg.tokens()?;
        let c = self.config;
        let decisions = py.detach(|| {
            let (hashes, hash_offsets) = core_block_hashes_many(t, &offsets, c.block_size, c.seed)?;
            self.router()
                .route_many_hashes(&hashes, &hash_offsets, running.as_deref(), now)
        })?;
        let chosen: Vec<i64> = decisions.iter().map(|d| d.endpoint as i64).collect();
        let fractions: Vec<f64> = decisions.iter().map(|d| d.match_fraction()).collect();
        Ok((chosen.into_pyarray(py), fractions.into_pyarray(py)))
    }

    /// Ends one running request on ``endpoint``; ``NotInFlightError`` when
    /// none is running there.
    fn complete(&self, endpoint: &str) -> PyResult<()> {
        Ok(self.router().complete(endpoint)?)
    }

    /// Overwrites every endpoint's running count (one per endpoint, in ``endpoints`` order).
    fn set_running(&self, counts: &Bound<'_, PyAny>) -> PyResult<()> {
        let counts = int_array(counts, "running")?;
        Ok(self.router().set_running(&counts)?)
    }

    /// Adds a endpoint (no running requests, nothing cached).
    fn add_endpoint(&self, endpoint: &str) -> PyResult<()> {
        Ok(self.router().add_endpoint(endpoint)?)
    }

    /// Removes a endpoint and its blocks from the index (KeyError if unknown).
    fn remove_endpoint(&self, endpoint: &str) -> PyResult<()> {
        Ok(self.router().remove_endpoint(endpoint)?)
    }

    /// The endpoints, in order (the indices ``route_many`` returns).
    #[getter]
    fn endpoints(&self) -> Vec<String> {
        self.router().endpoints().to_vec()
    }

    /// Running requests per endpoint, in ``endpoints`` order.
    #[getter]
    fn running(&self) -> Vec<u64> {
        self.router().running()
    }

    /// The router's prefix index (shared, not a copy).
    #[getter]
    fn index(&self) -> PyPrefixIndex {
        PyPrefixIndex {
            inner: Arc::clone(self.router().index()),
        }
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.config.block_size
    }

    #[getter]
    fn imbalance_abs_count(&self) -> u64 {
        self.config.imbalance_abs_count
    }

    #[getter]
    fn std_factor(&self) -> f64 {
        self.config.std_factor
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.config.seed
    }

    /// A snapshot: settings, endpoints, running counts and the whole index.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.router().to_bytes())
    }

    /// Restores a snapshot written by ``to_bytes`` (with its own index).
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        let router = PrefixCacheRouter::from_bytes(data)?;
        Ok(Self {
            config: *router.config(),
            inner: Mutex::new(router),
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce(slf, slf.get().to_bytes(slf.py()))
    }

    fn __repr__(&self) -> String {
        let c = self.config;
        format!(
            "PrefixCacheRouter(endpoints={:?}, block_size={}, imbalance_abs_count={}, std_factor={})",
            self.router().endpoints(),
            c.block_size,
            c.imbalance_abs_count,
            c.std_factor
        )
    }
}
