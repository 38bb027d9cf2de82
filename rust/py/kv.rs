//! `KvEventIndex`: the precise prefix index and its KV-event subscribers on a
//! runtime of their own, for tests, notebooks and routers outside `serve`
//! (which runs the same subscribers on the data plane's runtime).

use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::watch;

use crate::kv::{KvConfig, KvIndex};
use crate::prefix::Tokens;
use crate::py::{int_arg, TokenArg};
use crate::serve::kv_events::subscriber::{spawn, PeerLimits};
use crate::serve::kv_events::KvSourceSpec;

/// The precise prefix index: what each endpoint's engine holds in its KV
/// cache, built from the engine's KV-cache events (vLLM's ZeroMQ publisher:
/// ``--kv-events-config``), keyed by routecore's own chained block hashes of
/// the events' token ids (``block_hashes`` with ``block_size`` and ``seed``;
/// a LoRA adapter's blocks chain from a seed of their own).
///
/// ``subscribe`` starts a subscriber (a tokio task of this object) on an
/// engine's PUB socket; with ``replay`` (its ROUTER socket) the subscriber
/// learns what the engine already caches when it starts, and fills sequence
/// gaps. Each endpoint keeps at most ``capacity_blocks`` blocks. An endpoint
/// whose stream is down, or (with ``replay``) whose engine neither publishes
/// nor answers a replay for ``stale_after_s`` seconds, is not live:
/// ``leading_blocks`` answers None for it (a router then uses its
/// approximate prefix index); an idle engine that answers stays live.
///
/// A peer's message over ``max_message_bytes`` cuts its connection before
/// anything of that size is allocated (then it reconnects); a batch of more
/// than ``max_batch_events`` events or ``max_batch_blocks`` block hashes is
/// refused whole and clears the endpoint (counted as garbage).
#[pyclass(frozen, name = "KvEventIndex", module = "routecore")]
pub struct PyKvEventIndex {
    index: Arc<KvIndex>,
    limits: PeerLimits,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    stop: watch::Sender<bool>,
}

#[pymethods]
impl PyKvEventIndex {
    #[new]
    // Literals show in help(): 262144 is crate::kv::index::DEFAULT_CAPACITY_BLOCKS,
    // the limits are crate::serve::kv_events::subscriber::DEFAULT_MAX_* (a test checks they agree).
    #[pyo3(signature = (
        block_size = 16,
        capacity_blocks = 262144,
        seed = 0,
        stale_after_s = None,
        max_message_bytes = 16777216,
        max_batch_events = 131072,
        max_batch_blocks = 262144,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        #[pyo3(from_py_with = int_arg)] block_size: usize,
        #[pyo3(from_py_with = int_arg)] capacity_blocks: usize,
        #[pyo3(from_py_with = int_arg)] seed: u64,
        stale_after_s: Option<f64>,
        #[pyo3(from_py_with = int_arg)] max_message_bytes: u64,
        #[pyo3(from_py_with = int_arg)] max_batch_events: usize,
        #[pyo3(from_py_with = int_arg)] max_batch_blocks: usize,
    ) -> PyResult<Self> {
        let index = KvIndex::new(KvConfig {
            block_size,
            seed,
            capacity_blocks,
            stale_after_s,
        })?;
        let limits = PeerLimits {
            max_message_bytes,
            max_batch_events,
            max_batch_blocks,
        }
        .check()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("routecore-kv")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the runtime: {e}")))?;
        Ok(Self {
            index: Arc::new(index),
            limits,
            runtime: Mutex::new(Some(runtime)),
            stop: watch::channel(false).0,
        })
    }

    /// Subscribes ``endpoint`` to the KV events published at ``zmq`` (e.g.
    /// ``"tcp://127.0.0.1:5557"``) under ``topic``; ``replay`` is the engine's
    /// replay address. The subscriber connects (and reconnects) on its own.
    #[pyo3(signature = (endpoint, zmq, topic = "", replay = None))]
    fn subscribe(
        &self,
        endpoint: &str,
        zmq: &str,
        topic: &str,
        replay: Option<String>,
    ) -> PyResult<()> {
        let guard = self.runtime.lock().unwrap_or_else(|e| e.into_inner());
        let rt = guard
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the KvEventIndex is closed"))?;
        let source = KvSourceSpec {
            endpoint: endpoint.to_owned(),
            zmq: zmq.to_owned(),
            topic: topic.to_owned(),
            replay,
        };
        crate::serve::kv_events::subscriber::check(&source)?;
        // Outside `serve` there is no faults metric: the counters of `stats` show them.
        let faults: crate::serve::kv_events::Faults = Arc::new(|_| {});
        spawn(
            rt.handle(),
            &self.index,
            &[source],
            self.limits,
            &faults,
            &self.stop.subscribe(),
        );
        Ok(())
    }

    /// The endpoints known, sorted.
    fn endpoints(&self) -> Vec<String> {
        self.index.endpoints()
    }

    /// Per endpoint, how many of the prompt's leading blocks (``token_ids``
    /// cut into blocks of ``block_size``) its engine holds; None for an
    /// endpoint that is not live. ``token_ids``: a list of ints or a
    /// uint32 NumPy array (read in place; do not mutate it during the call).
    #[pyo3(signature = (token_ids, adapter = None))]
    fn leading_blocks<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        adapter: Option<&str>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let arg = TokenArg::new(token_ids, "token_ids")?;
        let Tokens::Ids(token_ids) = arg.tokens()? else {
            return Err(PyTypeError::new_err(
                "token_ids must be token ids (a list of ints or a uint32 array), not text",
            ));
        };
        let names = self.index.endpoints();
        let ids = self.index.endpoint_ids(&names);
        let mut held = Vec::with_capacity(names.len());
        self.index.match_prompt(token_ids, adapter, &ids, &mut held);
        let d = PyDict::new(py);
        for (e, h) in names.iter().zip(held) {
            d.set_item(e, h)?;
        }
        Ok(d)
    }

    /// The endpoint's block hashes (routecore's), sorted: two indexes fed the
    /// same events hold the same list.
    fn blocks(&self, endpoint: &str) -> PyResult<Vec<u64>> {
        Ok(self.index.blocks(endpoint)?)
    }

    /// The endpoint's counters: ``batches``, ``events``, ``skipped``,
    /// ``garbage``, ``duplicates``, ``gaps``, ``replays``, ``unrecovered``,
    /// ``restarts``, ``clears``, ``evicted``, ``blocks``, ``last_seq`` (None
    /// before the first batch) and ``live``.
    fn stats<'py>(&self, py: Python<'py>, endpoint: &str) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.index, endpoint)
    }

    /// Stops the subscribers (idempotent).
    fn close(&self, py: Python<'_>) {
        let _ = self.stop.send(true);
        let rt = self
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(rt) = rt {
            py.detach(|| rt.shutdown_timeout(std::time::Duration::from_secs(1)));
        }
    }

    fn __repr__(&self) -> String {
        let c = self.index.config();
        format!(
            "KvEventIndex(block_size={}, capacity_blocks={}, endpoints={})",
            c.block_size,
            c.capacity_blocks,
            self.index.endpoints().len()
        )
    }
}

impl PyKvEventIndex {
    /// The index its subscribers feed (an `EndpointPicker`'s `kv_index`).
    pub(crate) fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }
}

/// One endpoint's `KvStats` as a dict (also the data plane's debug view).
pub fn stats_dict<'py>(
    py: Python<'py>,
    index: &KvIndex,
    endpoint: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let s = index.stats(endpoint)?;
    let d = PyDict::new(py);
    d.set_item("batches", s.batches)?;
    d.set_item("events", s.events)?;
    d.set_item("skipped", s.skipped)?;
    d.set_item("garbage", s.garbage)?;
    d.set_item("duplicates", s.duplicates)?;
    d.set_item("gaps", s.gaps)?;
    d.set_item("replays", s.replays)?;
    d.set_item("unrecovered", s.unrecovered)?;
    d.set_item("restarts", s.restarts)?;
    d.set_item("clears", s.clears)?;
    d.set_item("evicted", s.evicted)?;
    d.set_item("blocks", s.blocks)?;
    d.set_item("last_seq", s.last_seq)?;
    d.set_item("live", s.live)?;
    Ok(d)
}

impl Drop for PyKvEventIndex {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(rt) = self
            .runtime
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            rt.shutdown_background();
        }
    }
}
