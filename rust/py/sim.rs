use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::Duration;

use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::pick::plugin_spec;
use super::{float_array, hash_array, int_arg, int_array, size_arg, TokenArg};
use crate::pick::{preset_specs, PluginSpec};
use crate::prefix::Tokens;
use crate::sim::engine::blocks_for;
use crate::sim::prefix_workload::{generate, PrefixWorkload, PrefixWorkloadConfig};
use crate::sim::timing::LinearTiming;
use crate::sim::{
    make_router, percentile, set_arrivals, simulate as run_simulation, Arrivals, Category,
    PoolConfig, PoolReport, RequestBlocks, RouterKind, SimConfig, SimReport, SimRequest,
};

/// A pool of identical simulated endpoints (vLLM engines).
///
/// ``max_num_seqs``: sequence slots per endpoint. ``kv_blocks``: KV blocks of
/// 16 tokens per endpoint; by default ``max_num_seqs * ceil(max_context / 16)``,
/// which can never preempt. ``chunk``: prefill tokens per iteration (C_chunk).
/// ``w`` and ``h`` (seconds): the timing model ``t_iter = w + h * n_active``
/// (defaults: Llama-3-70B on A100, 8 ms and 0.65 ms). ``budget``: the
/// token-budget router's budget for the pool (defaults to ``max_context``).
#[pyclass(frozen, name = "SimPool", module = "routecore")]
pub struct PySimPool {
    pub(crate) inner: PoolConfig,
    w: f64,
    h: f64,
}

#[pymethods]
impl PySimPool {
    #[new]
    #[pyo3(signature = (name, endpoints, max_context, max_num_seqs, kv_blocks=None, chunk=512,
                        w=0.008, h=0.00065, gpus_per_endpoint=1, budget=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        #[pyo3(from_py_with = int_arg)] endpoints: i64,
        #[pyo3(from_py_with = int_arg)] max_context: i64,
        #[pyo3(from_py_with = int_arg)] max_num_seqs: i64,
        #[pyo3(from_py_with = int_arg)] kv_blocks: Option<i64>,
        #[pyo3(from_py_with = int_arg)] chunk: i64,
        w: f64,
        h: f64,
        #[pyo3(from_py_with = int_arg)] gpus_per_endpoint: i64,
        #[pyo3(from_py_with = int_arg)] budget: Option<i64>,
    ) -> PyResult<Self> {
        let timing = Arc::new(LinearTiming::new(w, h)?);
        let kv_blocks = kv_blocks.unwrap_or_else(|| {
            max_num_seqs.saturating_mul(blocks_for(max_context.max(0) as u64) as i64)
        });
        let inner = PoolConfig::new(
            name,
            endpoints,
            max_context,
            max_num_seqs,
            kv_blocks,
            chunk,
            gpus_per_endpoint,
            budget,
            timing,
        )?;
        Ok(Self { inner, w, h })
    }
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn endpoints(&self) -> usize {
        self.inner.endpoints
    }
    #[getter]
    fn max_context(&self) -> u64 {
        self.inner.max_context
    }
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.max_num_seqs
    }
    #[getter]
    fn kv_blocks(&self) -> u64 {
        self.inner.kv_blocks
    }
    #[getter]
    fn gpus(&self) -> u64 {
        self.inner.endpoints as u64 * self.inner.gpus_per_endpoint
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let me = slf.get();
        let p = &me.inner;
        let args = (
            p.name.clone(),
            p.endpoints,
            p.max_context,
            p.max_num_seqs,
            p.kv_blocks,
            p.chunk,
            me.w,
            me.h,
            p.gpus_per_endpoint,
            p.budget,
        );
        Ok((
            slf.get_type().into_any(),
            args.into_pyobject(slf.py())?.into_any(),
        ))
    }
    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "SimPool(name={:?}, endpoints={}, max_context={}, max_num_seqs={}, kv_blocks={}, \
             chunk={}, w={}, h={}, gpus_per_endpoint={}, budget={})",
            p.name,
            p.endpoints,
            p.max_context,
            p.max_num_seqs,
            p.kv_blocks,
            p.chunk,
            self.w,
            self.h,
            p.gpus_per_endpoint,
            p.budget
        )
    }
}

/// The outcome of ``simulate``: per-request arrays (NaN where a value does not
/// apply: rejected requests, TPOT of one-token outputs) in the order the
/// requests were given, per-pool figures, and percentile summaries over the
/// measured (post-warm-up) requests.
#[pyclass(frozen, name = "SimReport", module = "routecore")]
pub struct PySimReport {
    report: SimReport,
}

impl PySimReport {
    fn measured_values(&self, xs: &[f64]) -> Vec<f64> {
        xs.iter()
            .zip(&self.report.measured)
            .filter(|(_, &m)| m)
            .map(|(&x, _)| x)
            .collect()
    }
}

#[pymethods]
impl PySimReport {
    /// Seconds from arrival to the first output token.
    #[getter]
    fn ttft<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.report.ttft)
    }
    /// Seconds per output token after the first.
    #[getter]
    fn tpot<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.report.tpot)
    }
    /// Seconds from arrival to the last output token.
    #[getter]
    fn e2e<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.report.e2e)
    }
    /// Seconds from arrival to the first admission into a batch.
    #[getter]
    fn queue_wait<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.report.queue_wait)
    }
    /// Prompt tokens served from the endpoint's prefix cache when the request
    /// was first admitted (0 when not served or no block hashes were given).
    #[getter]
    fn cached_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.report.cached_tokens.clone().into_pyarray(py)
    }
    /// Index of the endpoint inside its pool per request; -1 when the request
    /// was not dispatched.
    #[getter]
    fn endpoint<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.report.endpoint.clone().into_pyarray(py)
    }
    /// Pool index per request; -1 when the router rejected it.
    #[getter]
    fn pool<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.report.pool.clone().into_pyarray(py)
    }
    #[getter]
    fn measured<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        PyArray1::from_slice(py, &self.report.measured)
    }
    #[getter]
    fn rejected<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        PyArray1::from_slice(py, &self.report.rejected)
    }
    #[getter]
    fn compressed<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        PyArray1::from_slice(py, &self.report.compressed)
    }
    /// Requests no pool could hold by the router's estimate.
    #[getter]
    fn router_rejections(&self) -> u64 {
        self.report.router_rejections
    }
    /// The measurement window (first measured arrival, last arrival), seconds.
    #[getter]
    fn window(&self) -> (f64, f64) {
        self.report.window
    }
    /// Simulated time at which the last request finished.
    #[getter]
    fn makespan(&self) -> f64 {
        self.report.makespan
    }
    /// One dict per pool: name, endpoints, gpus, max_context, requests
    /// (measured, served), utilization_simulated (share of slot-time held, the
    /// planner's ``utilization``), utilization_model (the planner's engine
    /// model at the pool's measured rate over its served requests),
    /// prefill_utilization_simulated / prefill_utilization_model (prompt
    /// tokens over the prefill budget), preemptions, rejections, compressed.
    #[getter]
    fn pools<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.report.pools.iter().map(|p| pool_dict(py, p)).collect()
    }
    /// ``{metric: {"p50", "p90", "p99", "mean"}}`` for ttft, tpot, e2e and
    /// queue_wait over the measured requests that were served.
    fn summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let r = &self.report;
        for (name, xs) in [
            ("ttft", &r.ttft),
            ("tpot", &r.tpot),
            ("e2e", &r.e2e),
            ("queue_wait", &r.queue_wait),
        ] {
            let xs = self.measured_values(xs);
            let finite: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
            let d = PyDict::new(py);
            for q in [50, 90, 99] {
                d.set_item(format!("p{q}"), percentile(&finite, q as f64))?;
            }
            let mean = if finite.is_empty() {
                f64::NAN
            } else {
                finite.iter().sum::<f64>() / finite.len() as f64
            };
            d.set_item("mean", mean)?;
            out.set_item(name, d)?;
        }
        Ok(out)
    }
    fn __repr__(&self) -> String {
        let r = &self.report;
        let served = r.e2e.iter().filter(|x| x.is_finite()).count();
        format!(
            "SimReport(requests={}, served={served}, pools={}, makespan={:.3})",
            r.e2e.len(),
            r.pools.len(),
            r.makespan
        )
    }
}

/// One pool's figures as a dict (``SimReport.pools``, ``DisaggReport.pools``).
pub(crate) fn pool_dict<'py>(py: Python<'py>, p: &PoolReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &p.name)?;
    d.set_item("endpoints", p.endpoints)?;
    d.set_item("gpus", p.gpus)?;
    d.set_item("max_context", p.max_context)?;
    d.set_item("requests", p.requests)?;
    d.set_item("utilization_simulated", p.utilization_simulated)?;
    d.set_item("utilization_model", p.utilization_model)?;
    d.set_item(
        "prefill_utilization_simulated",
        p.prefill_utilization_simulated,
    )?;
    d.set_item("prefill_utilization_model", p.prefill_utilization_model)?;
    d.set_item("preemptions", p.preemptions)?;
    d.set_item("rejections", p.rejections)?;
    d.set_item("compressed", p.compressed)?;
    Ok(d)
}

/// The simulator's requests from Python arrays of one length: arrival times,
/// prompt and output tokens (each at least `min_tokens`) and, when given,
/// each request's category and session; a bad value or a length that
/// differs is a ValueError naming the argument.
pub fn sim_requests(
    arrival_s: &Bound<'_, PyAny>,
    input_tokens: &Bound<'_, PyAny>,
    output_tokens: &Bound<'_, PyAny>,
    category: Option<&Bound<'_, PyAny>>,
    session: Option<&Bound<'_, PyAny>>,
    min_tokens: u64,
) -> PyResult<Vec<SimRequest>> {
    let times = float_array(arrival_s, "arrival_s")?;
    let inputs = int_array(input_tokens, "input_tokens")?;
    let outputs = int_array(output_tokens, "output_tokens")?;
    let cats = category.map(|c| int_array(c, "category")).transpose()?;
    let sessions = session.map(|s| int_array(s, "session")).transpose()?;
    let n = times.len();
    let lens: Vec<(&str, usize)> = [
        ("arrival_s", Some(n)),
        ("input_tokens", Some(inputs.len())),
        ("output_tokens", Some(outputs.len())),
        ("category", cats.as_ref().map(Vec::len)),
        ("session", sessions.as_ref().map(Vec::len)),
    ]
    .into_iter()
    .filter_map(|(name, len)| Some((name, len?)))
    .collect();
    if lens.iter().any(|&(_, len)| len != n) {
        let and = |xs: Vec<String>| {
            let (last, rest) = xs.split_last().expect("three or more");
            format!("{} and {last}", rest.join(", "))
        };
        let names = lens.iter().map(|(name, _)| name.to_string()).collect();
        let got = lens.iter().map(|(_, len)| len.to_string()).collect();
        return Err(PyValueError::new_err(format!(
            "{} must have one length, got {}",
            and(names),
            and(got)
        )));
    }
    let at_least = |what: &str, v: i64, min: u64| {
        u64::try_from(v)
            .ok()
            .filter(|&v| v >= min)
            .ok_or_else(|| PyValueError::new_err(format!("{what} must be >= {min}, got {v}")))
    };
    (0..n)
        .map(|i| {
            Ok(SimRequest {
                arrival: times[i],
                input_tokens: at_least("input_tokens", inputs[i], min_tokens)?,
                output_tokens: at_least("output_tokens", outputs[i], min_tokens)?,
                category: match &cats {
                    Some(c) => at_least("category", c[i], 0)? as usize,
                    None => 0,
                },
                session: match &sessions {
                    Some(s) => Some(at_least("session", s[i], 0)?),
                    None => None,
                },
            })
        })
        .collect()
}

/// Simulates a fleet of pools serving a workload, with a router in front.
///
/// The workload: ``arrival_s`` (seconds, sorted), ``input_tokens``,
/// ``output_tokens`` and ``category`` (indices into ``categories``, default all
/// 0) as equal-length arrays; ``session``, optionally, the conversation of
/// each request (integers, e.g. ``PrefixWorkload.session``), the key of the
/// picker's session-affinity plugin. ``categories``: ``(name, bytes_per_token,
/// compressible)`` per category (default one English-prose category, 4.48).
/// ``arrivals``: "trace" keeps the given times (scaled to mean ``rate``
/// requests/s when ``rate`` is given), "poisson" draws a Poisson process at
/// ``rate``. ``router``: "homogeneous" (one pool), "token-budget" or
/// "compress-and-route" (band ``(B, gamma * B]``). ``dispatch``: the endpoint
/// picker inside every pool, an ``EndpointPicker`` preset name
/// ("least-request", the default, "round-robin", "random", "queue+kv", "prefix",
/// "prefix+queue+kv", "vtc") or a list of plugin specs (dicts with "name",
/// optional "weight", and the plugin's parameters); it sees each endpoint's
/// waiting and running requests and KV-cache use, read at every decision or,
/// with ``scrape_interval`` seconds > 0, scraped at multiples of it (the
/// picker adding its own dispatches since). ``warmup``: leading fraction of
/// requests left out of the figures. ``blocks``: ``(hashes, offsets)`` as
/// ``block_hashes_many`` returns them for 16-token blocks of each request's
/// prompt followed by its output (``PrefixWorkload.blocks``): request ``i``'s
/// block hashes are ``hashes[offsets[i]:offsets[i + 1]]``; each endpoint keeps
/// an LRU prefix cache of ``kv_blocks`` blocks and a prompt's cached leading
/// blocks skip their prefill. ``block_tokens``: those blocks' token ids, 16
/// per hash (``PrefixWorkload.block_tokens``: block ``j``'s are
/// ``block_tokens[16 * j:16 * (j + 1)]``); with them each endpoint's cache
/// publishes vLLM's KV-cache events (``BlockStored``, ``BlockRemoved``) into
/// the precise prefix index the ``precise-prefix`` scorer reads, and the
/// picker gets each prompt's token ids; without them that scorer falls back
/// to the approximate index. ``progress(done, total)`` is called about
/// ten times a second from this thread while the simulation runs without the
/// interpreter lock.
#[pyfunction]
#[pyo3(signature = (arrival_s, input_tokens, output_tokens, pools, *, category=None,
                    session=None, categories=None, router="token-budget", gamma=1.5,
                    dispatch=None, arrivals="trace", rate=None, seed=0,
                    warmup=0.2, blocks=None, block_tokens=None, scrape_interval=0.0,
                    progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn simulate(
    py: Python<'_>,
    arrival_s: &Bound<'_, PyAny>,
    input_tokens: &Bound<'_, PyAny>,
    output_tokens: &Bound<'_, PyAny>,
    pools: Vec<PyRef<'_, PySimPool>>,
    category: Option<&Bound<'_, PyAny>>,
    session: Option<&Bound<'_, PyAny>>,
    categories: Option<Vec<(String, f64, bool)>>,
    router: &str,
    gamma: f64,
    dispatch: Option<&Bound<'_, PyAny>>,
    arrivals: &str,
    rate: Option<f64>,
    #[pyo3(from_py_with = int_arg)] seed: u64,
    warmup: f64,
    blocks: Option<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
    block_tokens: Option<&Bound<'_, PyAny>>,
    scrape_interval: f64,
    progress: Option<Py<PyAny>>,
) -> PyResult<PySimReport> {
    let mut requests = sim_requests(arrival_s, input_tokens, output_tokens, category, session, 0)?;
    let n = requests.len();
    let has_blocks = blocks.is_some();
    let blocks = match blocks {
        None => RequestBlocks::none(n),
        Some((hashes, offsets)) => {
            let offsets = int_array(&offsets, "block offsets")?
                .into_iter()
                .map(|o| size_arg(o, "block offset"))
                .collect::<PyResult<Vec<_>>>()?;
            RequestBlocks::new(hash_array(&hashes)?, offsets, n)?
        }
    };
    let blocks = match block_tokens {
        None => blocks,
        Some(_) if !has_blocks => return Err(PyValueError::new_err("block_tokens needs blocks")),
        Some(t) => match TokenArg::new(t, "block_tokens")?.tokens()? {
            Tokens::Ids(ids) => blocks.with_tokens(ids.to_vec())?,
            Tokens::Bytes(_) => {
                return Err(PyValueError::new_err(
                    "block_tokens must be an array of token ids, not text",
                ))
            }
        },
    };
    let categories = categories
        .unwrap_or_else(|| vec![("prose".to_owned(), 4.48, true)])
        .into_iter()
        .map(|(name, bytes_per_token, compressible)| Category {
            name,
            bytes_per_token,
            compressible,
        })
        .collect();
    let config = SimConfig {
        pools: pools.iter().map(|p| p.inner.clone()).collect(),
        categories,
        picker: picker_specs(dispatch)?,
        seed,
        warmup,
        fast_forward: true,
        scrape_interval,
    };
    let kind = RouterKind::parse(router, gamma)?;
    let arrivals = match (arrivals, rate) {
        ("trace", None) => Arrivals::AsGiven,
        ("trace", Some(r)) => Arrivals::Scaled(r),
        ("poisson", Some(r)) => Arrivals::Poisson(r),
        ("poisson", None) => return Err(PyValueError::new_err("poisson arrivals need a rate")),
        (other, _) => {
            return Err(PyValueError::new_err(format!(
                "arrivals must be \"trace\" or \"poisson\", got {other:?}"
            )))
        }
    };
    let report = with_progress(py, n as u64, progress.as_ref(), |done| {
        set_arrivals(&mut requests, arrivals, seed)?;
        let mut router = make_router(kind, &config)?;
        run_simulation(&requests, &blocks, &config, router.as_mut(), done)
    })?;
    Ok(PySimReport { report })
}

/// Runs `work` on its own thread without the interpreter lock, calling
/// ``progress(done, total)`` about ten times a second from this thread with
/// the count `work` stores in its counter, and once at the end. A callback
/// that raises stops the reports; its error is raised after the work.
pub(crate) fn with_progress<T: Send>(
    py: Python<'_>,
    total: u64,
    progress: Option<&Py<PyAny>>,
    work: impl FnOnce(&AtomicU64) -> crate::error::Result<T> + Send,
) -> PyResult<T> {
    let done = AtomicU64::new(0);
    let (result, callback_error) = py.detach(|| {
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel();
            let done = &done;
            s.spawn(move || {
                // The receiver outlives this thread inside the scope.
                let _ = tx.send(work(done));
            });
            let mut callback_error = None;
            loop {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(result) => return (result, callback_error),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        let lost = crate::error::invalid("the simulation thread panicked");
                        return (Err(lost), callback_error);
                    }
                }
                if let (Some(cb), None) = (progress, &callback_error) {
                    let d = done.load(Ordering::Relaxed);
                    callback_error = Python::attach(|py| cb.call1(py, (d, total)).err());
                }
            }
        })
    });
    let out = result?;
    if let Some(e) = callback_error {
        return Err(e);
    }
    if let Some(cb) = progress {
        cb.call1(py, (total, total))?;
    }
    Ok(out)
}

/// An endpoint picker's plugin specs: a preset name (default
/// "least-request") or a list of ``{"name": ..., "weight": ..., **params}``.
pub(crate) fn picker_specs(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<PluginSpec>> {
    let Some(obj) = obj else {
        return Ok(preset_specs("least-request")?);
    };
    if let Ok(name) = obj.extract::<&str>() {
        return Ok(preset_specs(name)?);
    }
    let items: Vec<Bound<'_, PyAny>> = obj.extract().map_err(|_| {
        PyValueError::new_err("dispatch must be a preset name or a list of plugin spec dicts")
    })?;
    items.iter().map(plugin_spec).collect()
}

/// A seeded workload with shared prefixes (multi-turn sessions and shared
/// system prompts), for evaluating endpoint pickers in ``simulate``.
///
/// ``sessions`` conversations are open at a time; a request picks one
/// uniformly, appends a user message of ``user_tokens`` tokens (uniform in the
/// range) and sends the whole context; the reply of ``output_tokens`` tokens
/// joins the context, so each turn extends the previous prompt and reply.
/// After ``turns`` turns a session closes and a new one opens. A new session
/// starts with a system prompt of ``system_tokens`` tokens: with probability
/// ``shared_fraction`` one of ``system_prompts`` shared prompts, else a
/// private one. Arrivals are Poisson at ``rate`` requests/s. Token ids are
/// random, so texts share blocks only where one extends the other. The same
/// seed gives the same workload.
///
/// >>> w = PrefixWorkload(requests=100, seed=1)
/// >>> len(w), int(w.block_offsets[-1]) == len(w.block_hashes)
/// (100, True)
#[pyclass(frozen, name = "PrefixWorkload", module = "routecore")]
pub struct PyPrefixWorkload {
    inner: PrefixWorkload,
    config: PrefixWorkloadConfig,
}

#[pymethods]
impl PyPrefixWorkload {
    #[new]
    #[pyo3(signature = (*, requests=2000, rate=20.0, sessions=64, turns=(1, 8),
                        system_prompts=8, shared_fraction=0.9, system_tokens=(512, 2048),
                        user_tokens=(20, 300), output_tokens=(50, 400), seed=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        #[pyo3(from_py_with = int_arg)] requests: usize,
        rate: f64,
        #[pyo3(from_py_with = int_arg)] sessions: usize,
        #[pyo3(from_py_with = int_arg)] turns: (u64, u64),
        #[pyo3(from_py_with = int_arg)] system_prompts: usize,
        shared_fraction: f64,
        #[pyo3(from_py_with = int_arg)] system_tokens: (u64, u64),
        #[pyo3(from_py_with = int_arg)] user_tokens: (u64, u64),
        #[pyo3(from_py_with = int_arg)] output_tokens: (u64, u64),
        #[pyo3(from_py_with = int_arg)] seed: u64,
    ) -> PyResult<Self> {
        let config = PrefixWorkloadConfig {
            requests,
            rate,
            sessions,
            turns,
            system_prompts,
            shared_fraction,
            system_tokens,
            user_tokens,
            output_tokens,
            seed,
        };
        let inner = py.detach(|| generate(&config))?;
        Ok(Self { inner, config })
    }
    fn __len__(&self) -> usize {
        self.inner.input_tokens.len()
    }
    /// Arrival times, seconds (sorted).
    #[getter]
    fn arrival_s<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.inner.arrival_s)
    }
    #[getter]
    fn input_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.input_tokens.clone().into_pyarray(py)
    }
    #[getter]
    fn output_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.output_tokens.clone().into_pyarray(py)
    }
    /// Session id per request (sessions numbered as they open).
    #[getter]
    fn session<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.session.clone().into_pyarray(py)
    }
    /// Turn within the session per request, from 0.
    #[getter]
    fn turn<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.turn.clone().into_pyarray(py)
    }
    /// The shared system prompt per request; -1 for a private one.
    #[getter]
    fn system_prompt<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.inner.system_prompt.clone().into_pyarray(py)
    }
    /// Chained hashes of the 16-token blocks of each prompt and its reply.
    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.blocks.hashes.clone().into_pyarray(py)
    }
    /// The token ids of those blocks, 16 per hash: block ``j``'s are
    /// ``block_tokens[16 * j:16 * (j + 1)]`` (the ``block_tokens`` argument of
    /// ``simulate``).
    #[getter]
    fn block_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.inner.blocks.tokens.clone().into_pyarray(py)
    }
    /// Request ``i``'s hashes are ``block_hashes[block_offsets[i]:block_offsets[i + 1]]``.
    #[getter]
    fn block_offsets<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let o: Vec<i64> = self
            .inner
            .blocks
            .offsets
            .iter()
            .map(|&o| o as i64)
            .collect();
        o.into_pyarray(py)
    }
    /// ``(block_hashes, block_offsets)``, the ``blocks`` argument of ``simulate``.
    #[getter]
    fn blocks<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<i64>>) {
        (self.block_hashes(py), self.block_offsets(py))
    }
    fn __repr__(&self) -> String {
        let c = &self.config;
        format!(
            "PrefixWorkload(requests={}, rate={}, sessions={}, turns={:?}, system_prompts={}, \
             shared_fraction={}, system_tokens={:?}, user_tokens={:?}, output_tokens={:?}, \
             seed={})",
            c.requests,
            c.rate,
            c.sessions,
            c.turns,
            c.system_prompts,
            c.shared_fraction,
            c.system_tokens,
            c.user_tokens,
            c.output_tokens,
            c.seed
        )
    }
}
