use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{int_arg, json_arg, now_or_monotonic};
use crate::error::invalid;
use crate::flow::{Arrival, Enqueued, FlowConfig, FlowQueue, Left, Ticket};

/// A request that left the queue: ``(ticket, band, outcome, item, waited_s)``.
type PyLeft = (Ticket, String, &'static str, Py<PyAny>, f64);
/// What ``enqueue`` did: ``(ticket, status, retry_after_s, displaced)``.
type PyEnqueued = (Option<Ticket>, &'static str, Option<f64>, Vec<PyLeft>);

/// One pool's flow-control queue (the Rust discipline the data plane and the
/// simulator use), holding any Python objects. Not re-exported from
/// ``routecore``: the in-process API is ``Dispatcher.acquire(wait=...)``; this
/// class serves the benches and evaluations.
///
/// ``config`` is the ``flow`` mapping (bands highest first, each with
/// ``share``, ``max_requests``, ``max_bytes``, ``ttl_s``, ``fairness``:
/// round-robin, least-attained-service or debt, ``ordering``: fcfs or
/// deadline; ``classes``, ``default_band``, ``max_requests``, ``max_bytes``,
/// ``ttl_s``); None: one band per service class with the
/// paper's weights as shares. Across bands: weighted deficit round robin;
/// across flows and inside a flow: the band's policies. ``now`` (seconds)
/// defaults to ``monotonic()``. A request that leaves is ``(ticket, band,
/// outcome, item, waited_s)``, outcome one of dispatched, expired,
/// displaced, cancelled, drained.
///
///     >>> q = FlowQueue({"bands": [{"name": "hi", "share": 10}, {"name": "lo"}]})
///     >>> q.enqueue("lo", "tenant-a", "request 1", now=0.0)[:2]
///     (0, 'accepted')
///     >>> q.dispatch(now=0.5)
///     (0, 'lo', 'dispatched', 'request 1', 0.5)
#[pyclass(frozen, name = "FlowQueue", module = "routecore")]
pub struct PyFlowQueue {
    inner: Mutex<FlowQueue<Py<PyAny>>>,
}

impl PyFlowQueue {
    fn queue(&self) -> MutexGuard<'_, FlowQueue<Py<PyAny>>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn band_name(q: &FlowQueue<Py<PyAny>>, band: usize) -> String {
    let name = q.bands().nth(band).map(|b| b.name.clone());
    name.unwrap_or_default()
}

fn left(q: &FlowQueue<Py<PyAny>>, l: Left<Py<PyAny>>) -> PyLeft {
    (
        l.ticket,
        band_name(q, l.band),
        l.outcome.as_str(),
        l.payload,
        l.waited_s,
    )
}

fn all_left(q: &FlowQueue<Py<PyAny>>, out: Vec<Left<Py<PyAny>>>) -> Vec<PyLeft> {
    out.into_iter().map(|l| left(q, l)).collect()
}

#[pymethods]
impl PyFlowQueue {
    /// The floor of a flow's weight (the token-pool priority `w_e`).
    #[classattr]
    const MIN_WEIGHT: f64 = crate::flow::MIN_WEIGHT;

    #[new]
    #[pyo3(signature = (config=None))]
    fn new(config: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let config = match config.filter(|c| !c.is_none()) {
            Some(c) => FlowConfig::from_value(json_arg(c, "config")?)?,
            None => FlowConfig::service_classes(),
        };
        Ok(Self {
            inner: Mutex::new(FlowQueue::new(&config)?),
        })
    }

    /// The band names, highest priority first.
    #[getter]
    fn bands(&self) -> Vec<String> {
        self.queue().bands().map(|b| b.name.clone()).collect()
    }

    /// The band a request of service class or objective ``key`` waits in
    /// (``classes[key]``, else the band named ``key``, else the default).
    #[pyo3(signature = (key=None))]
    fn band_of(&self, key: Option<&str>) -> String {
        let q = self.queue();
        band_name(&q, q.band_of(key))
    }

    fn __len__(&self) -> usize {
        self.queue().len() as usize
    }

    /// Bytes waiting.
    #[getter]
    fn bytes(&self) -> u64 {
        self.queue().bytes()
    }

    /// Queues ``item`` in ``band`` (a band name: KeyError when unknown) for
    /// ``flow``. Returns ``(ticket, status, retry_after_s, displaced)``:
    /// status "accepted" with its ticket, or the refusal (too-large,
    /// band-full, band-bytes, pool-full, pool-bytes) with
    /// ticket None and the Retry-After in seconds (None: too large, retrying
    /// cannot help); ``displaced``: the lower bands' requests pushed out to
    /// make room. Bad values raise ValueError and change nothing.
    #[pyo3(signature = (band, flow, item, bytes=0, cost=1.0, weight=1.0, deadline=None, now=None))]
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &self,
        band: &str,
        flow: &str,
        item: Py<PyAny>,
        #[pyo3(from_py_with = int_arg)] bytes: i64,
        cost: f64,
        weight: f64,
        deadline: Option<f64>,
        now: Option<f64>,
    ) -> PyResult<PyEnqueued> {
        let bytes = u64::try_from(bytes)
            .map_err(|_| invalid(format!("bytes must be >= 0, got {bytes}")))?;
        let mut q = self.queue();
        let a = Arrival {
            band: q.band_index(band)?,
            flow,
            bytes,
            cost,
            weight,
            deadline,
        };
        let mut displaced = Vec::new();
        let e = q.enqueue(a, item, now_or_monotonic(now), &mut displaced)?;
        let displaced = all_left(&q, displaced);
        Ok(match e {
            Enqueued::Accepted(t) => (Some(t), "accepted", None, displaced),
            Enqueued::Refused {
                reason,
                retry_after_s,
                ..
            } => (None, reason.as_str(), retry_after_s, displaced),
        })
    }

    /// Sends the next request by the discipline; None when none waits.
    #[pyo3(signature = (now=None))]
    fn dispatch(&self, now: Option<f64>) -> PyResult<Option<PyLeft>> {
        let mut q = self.queue();
        let l = q.dispatch(now_or_monotonic(now))?;
        Ok(l.map(|l| left(&q, l)))
    }

    /// Takes a waiting request out; ``NotInFlightError`` when ``ticket`` is
    /// not waiting.
    #[pyo3(signature = (ticket, now=None))]
    fn cancel(
        &self,
        #[pyo3(from_py_with = int_arg)] ticket: u64,
        now: Option<f64>,
    ) -> PyResult<PyLeft> {
        let mut q = self.queue();
        let l = q.cancel(ticket, now_or_monotonic(now))?;
        Ok(left(&q, l))
    }

    /// The requests past their band's TTL, oldest first in each band.
    #[pyo3(signature = (now=None))]
    fn expire(&self, now: Option<f64>) -> PyResult<Vec<PyLeft>> {
        let mut q = self.queue();
        let mut out = Vec::new();
        q.expire(now_or_monotonic(now), &mut out)?;
        Ok(all_left(&q, out))
    }

    /// Every waiting request (shutdown), highest band first.
    #[pyo3(signature = (now=None))]
    fn drain(&self, now: Option<f64>) -> PyResult<Vec<PyLeft>> {
        let mut q = self.queue();
        let mut out = Vec::new();
        q.drain(now_or_monotonic(now), &mut out)?;
        Ok(all_left(&q, out))
    }

    /// When the next request expires; None when none waits.
    fn next_expiry(&self) -> Option<f64> {
        self.queue().next_expiry()
    }

    /// The Retry-After (seconds) of a refusal in ``band`` now: what waits in
    /// it and above over the recent dispatch rate, within [0.05 s, the TTL].
    #[pyo3(signature = (band, now=None))]
    fn retry_after_s(&self, band: &str, now: Option<f64>) -> PyResult<f64> {
        let q = self.queue();
        Ok(q.retry_after_s(q.band_index(band)?, now_or_monotonic(now))?)
    }

    /// ``band``'s counts (requests, bytes, flows waiting) and outcome
    /// counters (accepted, refused, dispatched, expired, displaced,
    /// cancelled, drained).
    fn stats<'py>(&self, py: Python<'py>, band: &str) -> PyResult<Bound<'py, PyDict>> {
        let q = self.queue();
        let s = q.band_stats(q.band_index(band)?)?;
        let o = s.outcomes;
        let d = PyDict::new(py);
        for (k, v) in [
            ("requests", s.requests),
            ("bytes", s.bytes),
            ("flows", s.flows),
            ("accepted", o.accepted),
            ("refused", o.refused),
            ("dispatched", o.dispatched),
            ("expired", o.expired),
            ("displaced", o.displaced),
            ("cancelled", o.cancelled),
            ("drained", o.drained),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let q = self.queue();
        let bands: Vec<&str> = q.bands().map(|b| b.name.as_str()).collect();
        format!("FlowQueue(bands={bands:?}, waiting={})", q.len())
    }
}
