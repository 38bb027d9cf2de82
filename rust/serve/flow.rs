//! Flow control on the data plane: the thin actor around the pure
//! [`FlowQueue`](crate::flow::FlowQueue) of each pool (`flow_control` of the
//! configuration).
//!
//! A request admitted into a pool that has room (its saturation detector
//! says so and nothing waits before it) goes on at once, touching no queue.
//! Otherwise it waits in its pool's queue (`dispatch::Steps::queue`), in the
//! band of its objective or service class, as the flow of its fairness id
//! or tenant, until one of:
//!
//! - capacity appears: a lease released, a scrape showing room, an endpoint
//!   turning healthy (the ticker, every [`TICK`] while a request waits in
//!   a queue, asleep otherwise): the queue lets requests out in its
//!   discipline's order while the pool has room, counting those let out but
//!   not yet placed as landed ([`PoolFlow::pending`]);
//! - its band's TTL runs out: the refusal it would have had without a
//!   queue (429 `saturated`, or 503 `no-endpoint` when the pool has no
//!   healthy endpoint), with the queue's Retry-After;
//! - a higher band's arrival at a full pool displaces it: 429 `displaced`;
//! - the data plane drains (SIGTERM): 503 `shutting-down`;
//! - its client goes away (the stream's future dropped): it leaves the
//!   queue at once, and `dispatch` gives back its admission (without a
//!   charge: nothing was used) and its pool count, once.
//!
//! Each engine (one per reload) has its own queues: a request keeps the
//! discipline that admitted it, and the ticker serves every engine alive.
//! The queue's mutex is held for O(bands + log flows) per operation; a
//! request let out is told under it (a oneshot), so that a client leaving
//! at that moment gives its place back exactly once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::sync::oneshot;

use super::counters::{FCounter, FGauge};
use crate::endpoint::EndpointState;
use crate::error::{invalid, Result};
use crate::flow::{
    Arrival, Enqueued, FlowConfig, FlowQueue, Left, Outcome, Refusal, SaturationConfig,
    SaturationDetector, Ticket, WAIT_BUCKETS_S,
};

/// How often the queues are served without an event while a request waits:
/// expiries, and room that only a scrape or a health change shows.
pub const TICK: Duration = Duration::from_millis(10);

/// `flow_control` of the data plane's spec (the Python control plane checks
/// it and names the bad key; this side re-checks).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSpec {
    /// The bands, limits and TTLs of every pool's queue.
    pub queue: FlowConfig,
    /// When a pool has room.
    #[serde(default)]
    pub saturation: SaturationConfig,
}

impl FlowSpec {
    pub fn check(&self) -> Result<()> {
        self.queue
            .check()
            .map_err(|e| invalid(format!("flow_control: {e}")))?;
        SaturationDetector::new(self.saturation)
            .map_err(|e| invalid(format!("flow_control: {e}")))?;
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BandLabels {
    pub pool: String,
    pub band: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub pool: String,
    pub band: String,
    pub outcome: String,
}

fn wait_histogram() -> Histogram {
    Histogram::new(WAIT_BUCKETS_S)
}

/// The flow-control metric families (registered by `Metrics::new`).
#[derive(Clone)]
pub struct FlowMetrics {
    requests: Family<BandLabels, FGauge>,
    bytes: Family<BandLabels, FGauge>,
    outcomes: Family<OutcomeLabels, FCounter>,
    waits: Family<BandLabels, Histogram, fn() -> Histogram>,
    /// Times the ticker served the queues: one per [`TICK`] while a request
    /// waits in one, none while every queue is empty.
    pub ticks: FCounter,
}

impl FlowMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            bytes: Family::default(),
            outcomes: Family::default(),
            waits: Family::new_with_constructor(wait_histogram),
            ticks: FCounter::default(),
        };
        registry.register(
            "routecore_flow_queue_requests",
            "Requests waiting in flow control's queue, per pool and band",
            m.requests.clone(),
        );
        registry.register(
            "routecore_flow_queue_bytes",
            "Bytes of the requests waiting in flow control's queue, per pool and band",
            m.bytes.clone(),
        );
        registry.register(
            "routecore_flow_outcomes",
            "Requests that left flow control's queue (dispatched, expired, displaced, \
             cancelled, drained) or were refused entry (refused), per pool and band",
            m.outcomes.clone(),
        );
        registry.register(
            "routecore_flow_wait_seconds",
            "Time dispatched requests waited in flow control's queue, per pool and band",
            m.waits.clone(),
        );
        registry.register(
            "routecore_flow_ticks",
            "Times flow control's ticker served the queues: every 10 ms while a request \
             waits in one, never while none does (x 0.01 s: the time requests waited)",
            m.ticks.clone(),
        );
        m
    }

    /// `flow_queue_requests` and `flow_queue_bytes` of (pool, band), or
    /// `flow_outcomes` of (pool, band, outcome) (`Metrics::value`).
    pub fn value(&self, name: &str, labels: &[&str]) -> Option<f64> {
        let s = |i: usize| labels.get(i).map(|l| l.to_string());
        let band = || {
            Some(BandLabels {
                pool: s(0)?,
                band: s(1)?,
            })
        };
        match name {
            "flow_queue_requests" => Some(self.requests.get_or_create(&band()?).get()),
            "flow_queue_bytes" => Some(self.bytes.get_or_create(&band()?).get()),
            "flow_outcomes" => {
                let labels = OutcomeLabels {
                    pool: s(0)?,
                    band: s(1)?,
                    outcome: s(2)?,
                };
                Some(self.outcomes.get_or_create(&labels).get())
            }
            _ => None,
        }
    }
}

/// Outcomes in the order of [`BandMetrics::outcomes`].
const OUTCOMES: [Outcome; 5] = [
    Outcome::Dispatched,
    Outcome::Expired,
    Outcome::Displaced,
    Outcome::Cancelled,
    Outcome::Drained,
];

/// One band's metric handles, resolved once (no label built per request).
struct BandMetrics {
    requests: FGauge,
    bytes: FGauge,
    outcomes: [FCounter; 5],
    refused: FCounter,
    waits: Histogram,
}

impl BandMetrics {
    fn new(m: &FlowMetrics, pool: &str, band: &str) -> Self {
        let labels = BandLabels {
            pool: pool.into(),
            band: band.into(),
        };
        let outcome = |o: &str| {
            m.outcomes
                .get_or_create(&OutcomeLabels {
                    pool: pool.into(),
                    band: band.into(),
                    outcome: o.into(),
                })
                .clone()
        };
        Self {
            requests: m.requests.get_or_create(&labels).clone(),
            bytes: m.bytes.get_or_create(&labels).clone(),
            outcomes: OUTCOMES.map(|o| outcome(o.as_str())),
            refused: outcome("refused"),
            waits: m.waits.get_or_create(&labels).clone(),
        }
    }
}

/// Where a request starting to wait says for how long at most (the
/// ext_proc stream extends Envoy's message timeout by it:
/// `override_message_timeout`).
#[derive(Clone, Debug)]
pub struct WaitNotice(pub tokio::sync::mpsc::UnboundedSender<Duration>);

impl PartialEq for WaitNotice {
    fn eq(&self, other: &Self) -> bool {
        self.0.same_channel(&other.0)
    }
}

/// The margin added to a band's TTL in the message timeout asked of Envoy:
/// the refusal at expiry must reach it before its own timer fires.
pub const WAIT_MARGIN: Duration = Duration::from_secs(1);

/// What a waiting request is told when it leaves the queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Exit {
    /// Its pool has room: go on to the pick.
    Go,
    Expired {
        retry_after_s: f64,
        waited_s: f64,
    },
    Displaced {
        retry_after_s: f64,
    },
    Drained,
}

type Waiter = oneshot::Sender<Exit>;

/// What [`PoolFlow::enter`] did with a request.
pub enum Entry<'a> {
    /// The pool has room and nothing waits before it: go on.
    Now,
    /// Queued: await [`Waiting::exit`].
    Wait(Waiting<'a>),
    /// Not queued (a full band or pool, or a request larger than its limit):
    /// `Some` Retry-After, None when retrying cannot help.
    Refused {
        reason: Refusal,
        retry_after_s: Option<f64>,
    },
    /// The data plane is draining.
    Closed,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One pool's flow control: its queue, detector, metrics.
pub struct PoolFlow {
    queue: Mutex<FlowQueue<Waiter>>,
    detector: SaturationDetector,
    /// Requests let out of the queue and not yet placed on an endpoint
    /// (counted as landed by the detector).
    pending: AtomicU64,
    metrics: Vec<BandMetrics>,
    /// Reused by `tick`'s expiries and displacements (no allocation once grown).
    scratch: Mutex<Vec<Left<Waiter>>>,
}

impl PoolFlow {
    pub fn new(spec: &FlowSpec, pool: &str, metrics: &FlowMetrics) -> Result<Self> {
        let queue = FlowQueue::new(&spec.queue)?;
        let metrics = queue
            .bands()
            .map(|b| BandMetrics::new(metrics, pool, &b.name))
            .collect();
        Ok(Self {
            queue: Mutex::new(queue),
            detector: SaturationDetector::new(spec.saturation)?,
            pending: AtomicU64::new(0),
            metrics,
            scratch: Mutex::new(Vec::new()),
        })
    }

    /// The band of a request of objective or service class `key`.
    pub fn band_of(&self, key: Option<&str>) -> usize {
        lock(&self.queue).band_of(key)
    }

    /// The longest a request of band `band` waits.
    pub fn ttl(&self, band: usize) -> Duration {
        let q = lock(&self.queue);
        let ttl_s = q.bands().nth(band).map_or(0.0, |b| b.ttl_s);
        Duration::from_secs_f64(ttl_s.clamp(0.0, 1e9))
    }

    /// Whether the pool has room now, with the requests let out but not yet
    /// placed counted as landed.
    pub fn room(&self, endpoints: &[EndpointState]) -> bool {
        let pending = self.pending.load(AtomicOrdering::Acquire);
        !self.detector.saturated_with(endpoints, pending, false)
    }

    /// Requests waiting.
    pub fn len(&self) -> u64 {
        lock(&self.queue).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Requests let out and not yet placed.
    pub fn pending(&self) -> u64 {
        self.pending.load(AtomicOrdering::Acquire)
    }

    fn count_left(&self, l: &Left<Waiter>) {
        let m = &self.metrics[l.band];
        m.requests.dec();
        m.bytes.dec_by(l.bytes as f64);
        let k = OUTCOMES.iter().position(|&o| o == l.outcome).unwrap_or(0);
        m.outcomes[k].inc();
        if l.outcome == Outcome::Dispatched {
            m.waits.observe(l.waited_s);
        }
    }

    /// A request arrives. `room` reads the pool's endpoints (the chooser's
    /// states) and says whether it has room; it is asked under the queue's
    /// lock, so that no request passes one that waits. `arrival` is built
    /// only when the request must wait (its weight and deadline are looked
    /// up then, not on the fast path).
    pub fn enter<'a, 'b>(
        &'a self,
        arrival: impl FnOnce() -> Arrival<'b>,
        room: impl Fn(&Self) -> bool,
        closed: &AtomicBool,
        now: f64,
    ) -> Result<Entry<'a>> {
        let mut q = lock(&self.queue);
        if q.is_empty() && room(self) {
            return Ok(Entry::Now);
        }
        if closed.load(AtomicOrdering::Acquire) {
            return Ok(Entry::Closed);
        }
        let arrival = arrival();
        let (tx, rx) = oneshot::channel();
        let mut displaced = lock(&self.scratch);
        let entry = match q.enqueue(arrival, tx, now, &mut displaced)? {
            Enqueued::Accepted(ticket) => {
                let m = &self.metrics[arrival.band];
                m.requests.inc();
                m.bytes.inc_by(arrival.bytes as f64);
                Entry::Wait(Waiting {
                    flow: self,
                    ticket,
                    rx,
                    done: false,
                })
            }
            Enqueued::Refused {
                reason,
                retry_after_s,
                ..
            } => {
                self.metrics[arrival.band].refused.inc();
                Entry::Refused {
                    reason,
                    retry_after_s,
                }
            }
        };
        for l in displaced.drain(..) {
            let retry_after_s = q.retry_after_s(l.band, now)?;
            self.count_left(&l);
            let _ = l.payload.send(Exit::Displaced { retry_after_s });
        }
        Ok(entry)
    }

    /// Lets requests out while the pool has room (`room`, as in `enter`);
    /// returns how many.
    pub fn pump(&self, room: impl Fn(&Self) -> bool, now: f64) -> Result<usize> {
        let mut q = lock(&self.queue);
        let mut sent = 0;
        while !q.is_empty() && room(self) {
            let Some(l) = q.dispatch(now)? else { break };
            self.count_left(&l);
            // Told under the lock: a client leaving now finds the Go (`Waiting`).
            self.pending.fetch_add(1, AtomicOrdering::AcqRel);
            if l.payload.send(Exit::Go).is_err() {
                self.pending.fetch_sub(1, AtomicOrdering::AcqRel);
            }
            sent += 1;
        }
        Ok(sent)
    }

    /// Refuses every request past its TTL; returns how many.
    pub fn expire(&self, now: f64) -> Result<usize> {
        let mut q = lock(&self.queue);
        if q.next_expiry().is_none_or(|t| t > now) {
            return Ok(0);
        }
        let mut out = lock(&self.scratch);
        let n = q.expire(now, &mut out)?;
        for l in out.drain(..) {
            let retry_after_s = q.retry_after_s(l.band, now)?;
            self.count_left(&l);
            let waited_s = l.waited_s;
            let _ = l.payload.send(Exit::Expired {
                retry_after_s,
                waited_s,
            });
        }
        Ok(n)
    }

    /// Refuses every waiting request (shutdown); returns how many.
    pub fn drain(&self, now: f64) -> Result<usize> {
        let mut q = lock(&self.queue);
        let mut out = lock(&self.scratch);
        let n = q.drain(now, &mut out)?;
        for l in out.drain(..) {
            self.count_left(&l);
            let _ = l.payload.send(Exit::Drained);
        }
        Ok(n)
    }

    /// A request let out was placed on an endpoint (or refused by the pick).
    pub fn placed(&self) {
        let _ = self
            .pending
            .fetch_update(AtomicOrdering::AcqRel, AtomicOrdering::Acquire, |p| {
                p.checked_sub(1)
            });
    }
}

/// A request waiting in a pool's queue. Dropped before it left (its client
/// went away), it leaves the queue at once (`cancelled`); dropped after it
/// was let out but before it took its turn, it gives its place back.
pub struct Waiting<'a> {
    flow: &'a PoolFlow,
    ticket: Ticket,
    rx: oneshot::Receiver<Exit>,
    done: bool,
}

impl Waiting<'_> {
    /// How the request left the queue (`Go`: placed next, so
    /// [`PoolFlow::placed`] is the caller's to call).
    pub async fn exit(mut self) -> Exit {
        let exit = (&mut self.rx).await.unwrap_or(Exit::Drained);
        self.done = true;
        exit
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut q = lock(&self.flow.queue);
        match q.cancel(self.ticket, crate::clock::monotonic()) {
            Ok(l) => self.flow.count_left(&l),
            // It left already; a Go not taken gives its place back.
            Err(_) => {
                if let Ok(Exit::Go) = self.rx.try_recv() {
                    self.flow.placed();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn spec() -> FlowSpec {
        let queue = FlowConfig::from_json(
            r#"{"bands": [{"name": "guaranteed", "share": 1000}, {"name": "elastic", "share": 100},
                          {"name": "spot", "share": 1}], "max_requests": 100000}"#,
        )
        .expect("config");
        FlowSpec {
            queue,
            saturation: SaturationConfig::default(),
        }
    }

    fn flow() -> PoolFlow {
        let mut registry = Registry::default();
        PoolFlow::new(&spec(), "p", &FlowMetrics::register(&mut registry)).expect("flow")
    }

    fn arrival(names: &[String], k: u64) -> Arrival<'_> {
        Arrival {
            bytes: 1000,
            cost: (100 + k % 3900) as f64,
            ..Arrival::new((k % 3) as usize, &names[(k % 100) as usize])
        }
    }

    #[test]
    fn a_go_not_taken_gives_its_place_back_and_a_cancel_counts_once() {
        let f = flow();
        let open = AtomicBool::new(false);
        let Entry::Wait(mut w) = f
            .enter(|| Arrival::new(0, "a"), |_| false, &open, 0.0)
            .expect("e")
        else {
            panic!("waits")
        };
        assert_eq!((f.len(), f.pending()), (1, 0));
        // Let out, then dropped before it took its turn (its client left).
        assert_eq!(f.pump(|_| true, 1.0).expect("pump"), 1);
        assert_eq!((f.len(), f.pending()), (0, 1));
        assert_eq!(w.rx.try_recv().ok(), Some(Exit::Go));
        // A Go already read: done by `exit`; here it is put back as unread.
        w.done = false;
        let (tx, rx) = oneshot::channel();
        tx.send(Exit::Go).expect("send");
        w.rx = rx;
        drop(w);
        assert_eq!(f.pending(), 0, "its place given back");
        // Dropped while waiting: out of the queue, once.
        let Entry::Wait(w) = f
            .enter(|| Arrival::new(2, "b"), |_| false, &open, 2.0)
            .expect("e")
        else {
            panic!("waits")
        };
        assert_eq!(f.len(), 1);
        drop(w);
        assert_eq!((f.len(), f.pending()), (0, 0));
        assert_eq!(f.pump(|_| true, 3.0).expect("pump"), 0);
        let m = &f.metrics[2];
        assert_eq!((m.requests.get(), m.outcomes[3].get()), (0.0, 1.0));
        // Nothing waits and the pool has room: on at once, no queue touched.
        assert!(matches!(
            f.enter(|| Arrival::new(0, "a"), |_| true, &open, 4.0),
            Ok(Entry::Now)
        ));
        // Shut: a request that would wait is refused.
        open.store(true, AtomicOrdering::Release);
        assert!(matches!(
            f.enter(|| Arrival::new(0, "a"), |_| false, &open, 5.0),
            Ok(Entry::Closed)
        ));
    }

    /// `cargo test --release --features server --lib -- --ignored --nocapture pool_flow_timing`
    #[test]
    #[ignore]
    fn pool_flow_timing() {
        let names: Vec<String> = (0..100).map(|i| format!("tenant-{i}")).collect();
        let open = AtomicBool::new(false);
        let n = 200_000u64;
        // The fast path: nothing waits, the pool has room.
        let f = flow();
        let start = std::time::Instant::now();
        for k in 0..n {
            let e = f
                .enter(|| arrival(&names, k), |_| true, &open, 0.0)
                .expect("enter");
            assert!(matches!(e, Entry::Now));
        }
        let ns = start.elapsed().as_nanos() as f64 / n as f64;
        println!("room, nothing waiting: {ns:.0} ns per request");
        for waiting in [0u64, 10_000] {
            let f = flow();
            let mut held = Vec::with_capacity((waiting + n) as usize);
            for k in 0..waiting {
                match f.enter(|| arrival(&names, k), |_| false, &open, 0.0) {
                    Ok(Entry::Wait(w)) => held.push(w),
                    _ => panic!("waits"),
                }
            }
            // Each request waits, then one is let out and told (its oneshot).
            let start = std::time::Instant::now();
            for k in waiting..waiting + n {
                let Ok(Entry::Wait(w)) = f.enter(|| arrival(&names, k), |_| false, &open, 0.0)
                else {
                    panic!("waits")
                };
                held.push(w);
                let once = Cell::new(true);
                assert_eq!(f.pump(|_| once.replace(false), 0.0).expect("pump"), 1);
            }
            let ns = start.elapsed().as_nanos() as f64 / n as f64;
            println!("enqueue + dispatch + wake, {waiting} waiting: {ns:.0} ns per request");
            assert_eq!(f.pending(), n);
            drop(held);
            assert_eq!(
                (f.pending(), f.len()),
                (0, 0),
                "every Go given back, the rest cancelled"
            );
        }
    }
}
