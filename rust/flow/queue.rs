//! [`FlowQueue`]: one pool's waiting room, a plain generic type with explicit
//! `now` and no runtime (the data plane wraps it in a task, the simulator
//! calls it directly).
//!
//! Three levels, each a policy of its own (llm-d / GIE flow control's
//! bands, fairness and ordering policies):
//!
//! 1. **Across bands: weighted deficit round robin** (Shreedhar and
//!    Varghese, "Efficient Fair Queueing Using Deficit Round Robin", 1995;
//!    Dynamo's router queue runs it across its policy classes). Each round a
//!    backlogged band earns its `share` in cost units and sends requests
//!    while its head's cost fits what it has earned; an emptied band's
//!    deficit is reset. So under contention band `b` gets `share_b /
//!    sum(shares)` of the dispatched cost, and a band with any share is
//!    never starved: it sends within `ceil(cost / share_b)` rounds. The GIE
//!    uses strict priority across bands (and names weighted fair queuing as
//!    the extension); with the paper's class weights as shares (1000, 100,
//!    1, 0.1) WDRR is strict priority in all but an anti-starvation share:
//!    spot gets 1/1101 of a saturated pool beside guaranteed and elastic.
//!    Rounds that no head can afford are skipped in one step (the fewest
//!    whole rounds any head needs), so dispatch costs O(bands).
//! 2. **Across flows inside a band** ([`Fairness`]): round robin, least
//!    attained service (VTC counters) or the token-pool debt (attained
//!    service per unit of `w_e`). Active flows sit in an indexed heap keyed
//!    by their counter: O(log flows).
//! 3. **Inside a flow** ([`Ordering`]): FCFS (an intrusive list, O(1)) or
//!    earliest deadline (an indexed heap, O(log n)).
//!
//! Requests live in a slab (a free list, intrusive links), flows in a
//! bounded table whose idle entries are forgotten oldest first: once the
//! slab and table have grown to their high-water marks, enqueue, dispatch,
//! cancel and expiry allocate nothing. A ticket is the slot and its
//! generation: cancelling a ticket finds it in O(1) (unlinking is O(1) under
//! FCFS; a flow that empties leaves the fairness heap in O(log flows)).
//!
//! Limits: a band's own `max_requests` / `max_bytes` refuse an arrival; the
//! pool's (all bands) first displace requests of lower bands, lowest band
//! and newest request first, and refuse only when displacing all of them
//! would not make room. A request waits at most its band's TTL: `expire`
//! returns those past it, oldest first (each band's arrivals are in TTL
//! order since the clock never goes back). Every request that enters leaves
//! exactly once: dispatched, expired, displaced, cancelled or drained.
//!
//! Time: `now` in seconds, any origin; an earlier `now` than one already
//! seen counts as the latest seen.

use std::collections::HashMap;

use super::config::{Band, Fairness, FlowConfig, Ordering, MAX_NAME_BYTES, MAX_REQUEST_BYTES};
use super::heap::{self, Slots};
use crate::admission::MIN_RETRY_AFTER_S;
use crate::error::{finite, invalid, not_in_flight, unknown, Result};

const NIL: u32 = u32::MAX;
/// Fairness counters are shifted down past this, keeping f64 exact enough.
const RENORMALIZE_AT: f64 = 1e12;
/// The time constant of the dispatch rate behind Retry-After, in seconds.
pub const RATE_WINDOW_S: f64 = 10.0;
/// Upper bounds (seconds) of the wait-time histogram's buckets; one more
/// bucket counts the rest.
pub const WAIT_BUCKETS_S: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// A waiting request's handle: its slot and the slot's generation.
pub type Ticket = u64;

/// One request arriving at the queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival<'a> {
    /// The band's index (`FlowQueue::band_index`, `FlowQueue::band_of`).
    pub band: usize,
    /// The flow inside the band: tenant, entitlement or fairness id.
    pub flow: &'a str,
    /// Its size, against the byte limits.
    pub bytes: u64,
    /// What serving it costs (tokens, or 1 per request), for WDRR and the
    /// attained-service counters; > 0.
    pub cost: f64,
    /// The flow's token-pool priority `w_e` (equation 1), for `debt`
    /// fairness: the latest arrival's weight is the flow's; > 0.
    pub weight: f64,
    /// When it should have started (arrival + SLO target), for `deadline`
    /// ordering; None: after those with one.
    pub deadline: Option<f64>,
}

impl<'a> Arrival<'a> {
    /// A request of cost 1, weight 1, 0 bytes, no deadline.
    pub fn new(band: usize, flow: &'a str) -> Self {
        Self {
            band,
            flow,
            bytes: 0,
            cost: 1.0,
            weight: 1.0,
            deadline: None,
        }
    }
}

/// The weight floor of a flow's arrival: equation 1's debt factor
/// `1 + a_debt d_e` goes to 0 and below for an entitlement served 25% above
/// its baseline, and a flow's weight must stay > 0. Every front end floors
/// the token-pool priority `w_e` with it (the data plane, the Python
/// `Dispatcher`, the simulator).
pub const MIN_WEIGHT: f64 = 1e-3;

/// How a request left the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Dispatched,
    Expired,
    /// Pushed out by a higher band's arrival at a full pool.
    Displaced,
    Cancelled,
    /// Taken out by `drain` (shutdown).
    Drained,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Dispatched => "dispatched",
            Outcome::Expired => "expired",
            Outcome::Displaced => "displaced",
            Outcome::Cancelled => "cancelled",
            Outcome::Drained => "drained",
        }
    }
}

/// Why an arrival was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Larger than its band's or the pool's byte limit: retrying cannot help.
    TooLarge,
    BandRequests,
    BandBytes,
    PoolRequests,
    PoolBytes,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::TooLarge => "too-large",
            Refusal::BandRequests => "band-full",
            Refusal::BandBytes => "band-bytes",
            Refusal::PoolRequests => "pool-full",
            Refusal::PoolBytes => "pool-bytes",
        }
    }
}

/// What `enqueue` did with an arrival.
#[derive(Debug, PartialEq)]
pub enum Enqueued<T> {
    Accepted(Ticket),
    /// Not queued; the payload comes back for the caller to refuse, with
    /// the Retry-After of [`FlowQueue::retry_after_s`] (None: too large).
    Refused {
        reason: Refusal,
        retry_after_s: Option<f64>,
        payload: T,
    },
}

/// A request that left the queue, with its payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Left<T> {
    pub ticket: Ticket,
    pub band: usize,
    pub outcome: Outcome,
    pub bytes: u64,
    pub cost: f64,
    /// Seconds from its arrival to leaving.
    pub waited_s: f64,
    pub payload: T,
}

/// Outcome counters. `accepted = dispatched + expired + displaced +
/// cancelled + drained + waiting`; refused arrivals never entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcomes {
    pub accepted: u64,
    pub refused: u64,
    pub dispatched: u64,
    pub expired: u64,
    pub displaced: u64,
    pub cancelled: u64,
    pub drained: u64,
}

impl Outcomes {
    /// Requests that entered and left.
    pub fn left(&self) -> u64 {
        self.dispatched + self.expired + self.displaced + self.cancelled + self.drained
    }
    fn add(&mut self, o: &Outcomes) {
        self.accepted += o.accepted;
        self.refused += o.refused;
        self.dispatched += o.dispatched;
        self.expired += o.expired;
        self.displaced += o.displaced;
        self.cancelled += o.cancelled;
        self.drained += o.drained;
    }
    fn count(&mut self, o: Outcome) {
        *match o {
            Outcome::Dispatched => &mut self.dispatched,
            Outcome::Expired => &mut self.expired,
            Outcome::Displaced => &mut self.displaced,
            Outcome::Cancelled => &mut self.cancelled,
            Outcome::Drained => &mut self.drained,
        } += 1;
    }
}

/// Waits of dispatched requests: counts per bucket of [`WAIT_BUCKETS_S`]
/// (the last: longer), their number and sum.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WaitHistogram {
    pub counts: [u64; WAIT_BUCKETS_S.len() + 1],
    pub count: u64,
    pub sum_s: f64,
}

impl WaitHistogram {
    fn record(&mut self, wait_s: f64) {
        let k = WAIT_BUCKETS_S.partition_point(|&b| b < wait_s);
        self.counts[k] += 1;
        self.count += 1;
        self.sum_s += wait_s;
    }

    /// The upper bound of the bucket holding the `q` quantile (infinite in
    /// the last bucket); None when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = (q.clamp(0.0, 1.0) * self.count as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (k, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(WAIT_BUCKETS_S.get(k).copied().unwrap_or(f64::INFINITY));
            }
        }
        Some(f64::INFINITY)
    }
}

/// One band's state now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BandStats {
    pub requests: u64,
    pub bytes: u64,
    /// Flows with a request waiting.
    pub flows: u64,
    pub outcomes: Outcomes,
}

struct Slot<T> {
    payload: Option<T>,
    gen: u32,
    band: u32,
    flow: u32,
    bytes: u64,
    cost: f64,
    deadline: f64,
    enqueued_at: f64,
    expires_at: f64,
    seq: u64,
    /// The band's arrival list; `next` links the free list too.
    prev: u32,
    next: u32,
    /// The flow's FCFS list; under deadline ordering `fprev` is the
    /// position in the flow's heap.
    fprev: u32,
    fnext: u32,
}

struct Flow {
    name: Box<str>,
    band: u32,
    head: u32,
    tail: u32,
    heap: Vec<u32>,
    waiting: u32,
    /// The fairness key: attained service (per unit weight) or the turn.
    counter: f64,
    since: u64,
    weight: f64,
    /// Position in the band's heap of active flows; NIL when idle.
    pos: u32,
    /// The idle list, oldest idle first.
    iprev: u32,
    inext: u32,
}

struct BandState {
    cfg: Band,
    flows: HashMap<Box<str>, u32>,
    heap: Vec<u32>,
    head: u32,
    tail: u32,
    requests: u64,
    bytes: u64,
    deficit: f64,
    /// The counter of the flow served last: where a returning flow starts.
    vtime: f64,
    turns: u64,
    outcomes: Outcomes,
    waits: WaitHistogram,
}

struct FlowKeys<'a>(&'a mut [Flow]);

impl Slots for FlowKeys<'_> {
    fn key(&self, id: u32) -> (f64, u64) {
        let f = &self.0[id as usize];
        (f.counter, f.since)
    }
    fn set_pos(&mut self, id: u32, pos: u32) {
        self.0[id as usize].pos = pos;
    }
}

struct ItemKeys<'a, T>(&'a mut [Slot<T>]);

impl<T> Slots for ItemKeys<'_, T> {
    fn key(&self, id: u32) -> (f64, u64) {
        let s = &self.0[id as usize];
        (s.deadline, s.seq)
    }
    fn set_pos(&mut self, id: u32, pos: u32) {
        self.0[id as usize].fprev = pos;
    }
}

/// One pool's queue of waiting requests (see the module docs).
pub struct FlowQueue<T> {
    config: FlowConfig,
    bands: Vec<BandState>,
    slots: Vec<Slot<T>>,
    free_slot: u32,
    flows: Vec<Flow>,
    max_flows: u64,
    idle_head: u32,
    idle_tail: u32,
    requests: u64,
    bytes: u64,
    max_requests: u64,
    max_bytes: u64,
    cursor: usize,
    turn_open: bool,
    seq: u64,
    clock: f64,
    rate_count: f64,
    rate_at: f64,
}

fn ticket_of(slot: u32, gen: u32) -> Ticket {
    (u64::from(gen) << 32) | u64::from(slot)
}

impl<T> FlowQueue<T> {
    pub fn new(config: &FlowConfig) -> Result<Self> {
        let bands = config
            .resolve()?
            .into_iter()
            .map(|cfg| BandState {
                cfg,
                flows: HashMap::new(),
                heap: Vec::new(),
                head: NIL,
                tail: NIL,
                requests: 0,
                bytes: 0,
                deficit: 0.0,
                vtime: 0.0,
                turns: 0,
                outcomes: Outcomes::default(),
                waits: WaitHistogram::default(),
            })
            .collect();
        Ok(Self {
            max_flows: config.flows_bound(),
            max_requests: config.max_requests as u64,
            max_bytes: config.max_bytes as u64,
            config: config.clone(),
            bands,
            slots: Vec::new(),
            free_slot: NIL,
            flows: Vec::new(),
            idle_head: NIL,
            idle_tail: NIL,
            requests: 0,
            bytes: 0,
            cursor: 0,
            turn_open: false,
            seq: 0,
            clock: f64::NEG_INFINITY,
            rate_count: 0.0,
            rate_at: 0.0,
        })
    }

    pub fn config(&self) -> &FlowConfig {
        &self.config
    }
    pub fn bands(&self) -> impl Iterator<Item = &Band> {
        self.bands.iter().map(|b| &b.cfg)
    }
    /// The index of the band named `name`.
    pub fn band_index(&self, name: &str) -> Result<usize> {
        self.bands
            .iter()
            .position(|b| b.cfg.name == name)
            .ok_or_else(|| unknown("band", name))
    }
    /// The band of a request of service class or objective `key`
    /// ([`FlowConfig::band_of`]).
    pub fn band_of(&self, key: Option<&str>) -> usize {
        self.config.band_of(key)
    }
    /// Requests waiting.
    pub fn len(&self) -> u64 {
        self.requests
    }
    pub fn is_empty(&self) -> bool {
        self.requests == 0
    }
    /// Bytes waiting.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// Flows remembered (waiting or idle).
    pub fn flows(&self) -> usize {
        self.flows.len()
    }
    pub fn band_stats(&self, band: usize) -> Result<BandStats> {
        let b = self.band(band)?;
        Ok(BandStats {
            requests: b.requests,
            bytes: b.bytes,
            flows: b.heap.len() as u64,
            outcomes: b.outcomes,
        })
    }
    /// Every band's outcome counters summed.
    pub fn outcomes(&self) -> Outcomes {
        let mut o = Outcomes::default();
        for b in &self.bands {
            o.add(&b.outcomes);
        }
        o
    }
    pub fn waits(&self, band: usize) -> Result<&WaitHistogram> {
        Ok(&self.band(band)?.waits)
    }
    /// Whether flow `flow` of band `band` is remembered (tests).
    #[cfg(test)]
    pub(super) fn remembers(&self, band: usize, flow: &str) -> bool {
        self.bands[band].flows.contains_key(flow)
    }
    /// Whether `ticket` is waiting.
    pub fn contains(&self, ticket: Ticket) -> bool {
        self.live(ticket).is_some()
    }

    fn band(&self, band: usize) -> Result<&BandState> {
        self.bands.get(band).ok_or_else(|| {
            invalid(format!(
                "band {band} is not one of the {} bands",
                self.bands.len()
            ))
        })
    }

    fn tick(&mut self, now: f64) -> Result<f64> {
        finite("now", now)?;
        self.clock = self.clock.max(now);
        Ok(self.clock)
    }

    fn live(&self, ticket: Ticket) -> Option<u32> {
        let i = (ticket & u64::from(u32::MAX)) as u32;
        let s = self.slots.get(i as usize)?;
        (s.payload.is_some() && u64::from(s.gen) == ticket >> 32).then_some(i)
    }

    /// Dispatches per second, decayed with [`RATE_WINDOW_S`].
    fn rate(&self, now: f64) -> f64 {
        self.rate_count * (-(now - self.rate_at).max(0.0) / RATE_WINDOW_S).exp() / RATE_WINDOW_S
    }

    /// The Retry-After of a refusal (or an expiry) in `band` at `now`: the
    /// time the queue takes to send what waits in that band and above at its
    /// recent dispatch rate, within [`MIN_RETRY_AFTER_S`, the band's TTL].
    pub fn retry_after_s(&self, band: usize, now: f64) -> Result<f64> {
        let ttl = self.band(band)?.cfg.ttl_s;
        let now = finite("now", now)?.max(self.clock);
        let ahead: u64 = self.bands[..=band].iter().map(|b| b.requests).sum();
        let rate = self.rate(now);
        let wait = if rate > 0.0 {
            ahead.max(1) as f64 / rate
        } else {
            ttl
        };
        Ok(wait.clamp(MIN_RETRY_AFTER_S.min(ttl), ttl))
    }

    /// When the next request expires (None: none waiting).
    pub fn next_expiry(&self) -> Option<f64> {
        self.bands
            .iter()
            .filter(|b| b.head != NIL)
            .map(|b| self.slots[b.head as usize].expires_at)
            .min_by(f64::total_cmp)
    }

    /// Queues a request. Bad input (an unknown band, a flow name outside 1 to
    /// 256 bytes, bytes over [`MAX_REQUEST_BYTES`], a cost or weight not > 0,
    /// a NaN) is an error and changes nothing. A full band, or a full pool
    /// with nothing lower to displace, refuses it; requests displaced to make
    /// room are appended to `displaced` for the caller to refuse.
    pub fn enqueue(
        &mut self,
        a: Arrival<'_>,
        payload: T,
        now: f64,
        displaced: &mut Vec<Left<T>>,
    ) -> Result<Enqueued<T>> {
        let cfg = &self.band(a.band)?.cfg;
        if a.flow.is_empty() || a.flow.len() > MAX_NAME_BYTES {
            return Err(invalid(format!(
                "flow name must be 1 to {MAX_NAME_BYTES} bytes, got {}",
                a.flow.len()
            )));
        }
        if a.bytes > MAX_REQUEST_BYTES {
            return Err(invalid(format!(
                "bytes must be <= {MAX_REQUEST_BYTES}, got {}",
                a.bytes
            )));
        }
        for (what, v) in [("cost", a.cost), ("weight", a.weight)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(format!(
                    "{what} must be a finite number > 0, got {v}"
                )));
            }
        }
        if let Some(d) = a.deadline {
            finite("deadline", d)?;
        }
        let (band_max_requests, band_max_bytes, ttl) = (cfg.max_requests, cfg.max_bytes, cfg.ttl_s);
        let now = self.tick(now)?;
        let b = a.band;

        let refusal = if a.bytes > band_max_bytes || a.bytes > self.max_bytes {
            Some(Refusal::TooLarge)
        } else if self.bands[b].requests >= band_max_requests {
            Some(Refusal::BandRequests)
        } else if self.bands[b].bytes + a.bytes > band_max_bytes {
            Some(Refusal::BandBytes)
        } else {
            None
        };
        let need_requests = (self.requests + 1).saturating_sub(self.max_requests);
        let need_bytes = (self.bytes + a.bytes).saturating_sub(self.max_bytes);
        let refusal = refusal.or_else(|| {
            let lower = &self.bands[b + 1..];
            let lower_requests: u64 = lower.iter().map(|l| l.requests).sum();
            let lower_bytes: u64 = lower.iter().map(|l| l.bytes).sum();
            if lower_requests < need_requests {
                Some(Refusal::PoolRequests)
            } else if lower_bytes < need_bytes {
                Some(Refusal::PoolBytes)
            } else {
                None
            }
        });
        if let Some(reason) = refusal {
            let retry = (reason != Refusal::TooLarge)
                .then(|| self.retry_after_s(b, now))
                .transpose()?;
            self.bands[b].outcomes.refused += 1;
            return Ok(Enqueued::Refused {
                reason,
                retry_after_s: retry,
                payload,
            });
        }

        // Make room in the pool: the lowest band's newest requests first.
        let (mut need_requests, mut need_bytes) = (need_requests, need_bytes);
        let mut victim_band = self.bands.len() - 1;
        while need_requests > 0 || need_bytes > 0 {
            let victim = self.bands[victim_band].tail;
            if victim == NIL {
                victim_band -= 1;
                continue;
            }
            let left = self.detach(victim, Outcome::Displaced, now);
            need_requests = need_requests.saturating_sub(1);
            need_bytes = need_bytes.saturating_sub(left.bytes);
            displaced.push(left);
        }

        let f = match self.bands[b].flows.get(a.flow) {
            Some(&f) => f,
            None => self.new_flow(b, a.flow),
        };
        self.seq += 1;
        let slot = Slot {
            payload: Some(payload),
            gen: 0,
            band: b as u32,
            flow: f,
            bytes: a.bytes,
            cost: a.cost,
            deadline: a.deadline.unwrap_or(f64::INFINITY),
            enqueued_at: now,
            expires_at: now + ttl,
            seq: self.seq,
            prev: NIL,
            next: NIL,
            fprev: NIL,
            fnext: NIL,
        };
        let i = if self.free_slot == NIL {
            self.slots.push(slot);
            (self.slots.len() - 1) as u32
        } else {
            let i = self.free_slot;
            let s = &mut self.slots[i as usize];
            self.free_slot = s.next;
            *s = Slot { gen: s.gen, ..slot };
            i
        };

        // The band's arrival list.
        let band = &mut self.bands[b];
        self.slots[i as usize].prev = band.tail;
        if band.tail == NIL {
            band.head = i;
        } else {
            self.slots[band.tail as usize].next = i;
        }
        band.tail = i;
        band.requests += 1;
        band.bytes += a.bytes;
        band.outcomes.accepted += 1;
        self.requests += 1;
        self.bytes += a.bytes;

        // The flow's order, then the flow among the band's active ones.
        let flow = &mut self.flows[f as usize];
        flow.weight = a.weight;
        match band.cfg.ordering {
            Ordering::Fcfs => {
                self.slots[i as usize].fprev = flow.tail;
                if flow.tail == NIL {
                    flow.head = i;
                } else {
                    self.slots[flow.tail as usize].fnext = i;
                }
                flow.tail = i;
            }
            Ordering::Deadline => heap::push(&mut flow.heap, &mut ItemKeys(&mut self.slots), i),
        }
        flow.waiting += 1;
        if flow.waiting == 1 {
            self.activate(f);
        }
        Ok(Enqueued::Accepted(ticket_of(i, self.slots[i as usize].gen)))
    }

    /// A flow record for `name` in band `b`: a new one while the table has
    /// room, else the oldest idle one, forgotten (one is idle: the table
    /// holds one more flow than requests may wait).
    fn new_flow(&mut self, b: usize, name: &str) -> u32 {
        let fresh = Flow {
            name: name.into(),
            band: b as u32,
            head: NIL,
            tail: NIL,
            heap: Vec::new(),
            waiting: 0,
            counter: 0.0,
            since: 0,
            weight: 1.0,
            pos: NIL,
            iprev: NIL,
            inext: NIL,
        };
        let f = if (self.flows.len() as u64) < self.max_flows {
            self.flows.push(fresh);
            (self.flows.len() - 1) as u32
        } else {
            let f = self.idle_head;
            debug_assert!(f != NIL, "a full flow table has an idle flow");
            self.unlink_idle(f);
            let old = &mut self.flows[f as usize];
            self.bands[old.band as usize].flows.remove(&old.name);
            let heap = std::mem::take(&mut old.heap);
            *old = Flow { heap, ..fresh };
            f
        };
        let name = self.flows[f as usize].name.clone();
        self.bands[b].flows.insert(name, f);
        f
    }

    fn unlink_idle(&mut self, f: u32) {
        let (p, n) = {
            let fl = &self.flows[f as usize];
            (fl.iprev, fl.inext)
        };
        if p == NIL {
            self.idle_head = n;
        } else {
            self.flows[p as usize].inext = n;
        }
        if n == NIL {
            self.idle_tail = p;
        } else {
            self.flows[n as usize].iprev = p;
        }
        let fl = &mut self.flows[f as usize];
        fl.iprev = NIL;
        fl.inext = NIL;
    }

    /// A flow with its first waiting request joins its band's active flows,
    /// its counter lifted to the least active counter (or to the last
    /// served one) so that idle time banks no credit.
    fn activate(&mut self, f: u32) {
        let idle = {
            let fl = &self.flows[f as usize];
            fl.iprev != NIL || fl.inext != NIL || self.idle_head == f
        };
        if idle {
            self.unlink_idle(f);
        }
        let b = self.flows[f as usize].band as usize;
        let band = &mut self.bands[b];
        let floor = match band.heap.first() {
            Some(&g) => self.flows[g as usize].counter,
            None => band.vtime,
        };
        self.seq += 1;
        let fl = &mut self.flows[f as usize];
        match band.cfg.fairness {
            Fairness::RoundRobin => {
                fl.counter = band.turns as f64;
                band.turns += 1;
            }
            Fairness::LeastAttainedService | Fairness::Debt => {
                fl.counter = fl.counter.max(floor);
            }
        }
        fl.since = self.seq;
        heap::push(&mut band.heap, &mut FlowKeys(&mut self.flows), f);
    }

    /// Takes request `i` out of every list and the counts, frees its slot,
    /// and keeps its flow's place among the active ones right (out when it
    /// has no more requests, re-sorted when `rekey`).
    fn detach(&mut self, i: u32, outcome: Outcome, now: f64) -> Left<T> {
        let (b, f, prev, next, fprev, fnext) = {
            let s = &self.slots[i as usize];
            (s.band as usize, s.flow, s.prev, s.next, s.fprev, s.fnext)
        };
        let band = &mut self.bands[b];
        if prev == NIL {
            band.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            band.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        let flow = &mut self.flows[f as usize];
        match band.cfg.ordering {
            Ordering::Fcfs => {
                if fprev == NIL {
                    flow.head = fnext;
                } else {
                    self.slots[fprev as usize].fnext = fnext;
                }
                if fnext == NIL {
                    flow.tail = fprev;
                } else {
                    self.slots[fnext as usize].fprev = fprev;
                }
            }
            Ordering::Deadline => heap::remove(
                &mut flow.heap,
                &mut ItemKeys(&mut self.slots),
                fprev as usize,
            ),
        }
        flow.waiting -= 1;
        let (pos, empty) = (flow.pos as usize, flow.waiting == 0);
        let keys = &mut FlowKeys(&mut self.flows);
        if empty {
            heap::remove(&mut band.heap, keys, pos);
            let fl = &mut self.flows[f as usize];
            fl.pos = NIL;
            fl.iprev = self.idle_tail;
            if self.idle_tail == NIL {
                self.idle_head = f;
            } else {
                self.flows[self.idle_tail as usize].inext = f;
            }
            self.idle_tail = f;
        } else if outcome == Outcome::Dispatched {
            heap::fix(&mut band.heap, keys, pos);
        }

        let s = &mut self.slots[i as usize];
        let left = Left {
            ticket: ticket_of(i, s.gen),
            band: b,
            outcome,
            bytes: s.bytes,
            cost: s.cost,
            waited_s: now - s.enqueued_at,
            payload: s.payload.take().expect("a waiting slot holds its payload"),
        };
        s.gen = s.gen.wrapping_add(1);
        s.next = self.free_slot;
        self.free_slot = i;
        band.requests -= 1;
        band.bytes -= left.bytes;
        if band.requests == 0 {
            band.deficit = 0.0;
        }
        band.outcomes.count(outcome);
        self.requests -= 1;
        self.bytes -= left.bytes;
        left
    }

    /// The head of a band: its first active flow's next request.
    fn head(&self, b: usize) -> Option<(u32, u32)> {
        let band = &self.bands[b];
        let &f = band.heap.first()?;
        let fl = &self.flows[f as usize];
        let i = match band.cfg.ordering {
            Ordering::Fcfs => fl.head,
            Ordering::Deadline => fl.heap[0],
        };
        Some((f, i))
    }

    fn affordable(&self, b: usize, i: u32) -> bool {
        let cost = self.slots[i as usize].cost;
        cost <= self.bands[b].deficit + 1e-9 * cost
    }

    /// Weighted deficit round robin: the band whose turn it is and whose head
    /// fits its deficit (the caller checked that a request waits).
    fn next_band(&mut self) -> usize {
        let n = self.bands.len();
        let mut visits = 0;
        loop {
            let b = self.cursor;
            if let Some((_, i)) = self.head(b) {
                if !self.turn_open {
                    self.bands[b].deficit += self.bands[b].cfg.share;
                    self.turn_open = true;
                }
                if self.affordable(b, i) {
                    return b;
                }
            } else {
                self.bands[b].deficit = 0.0;
            }
            self.cursor = (b + 1) % n;
            self.turn_open = false;
            visits += 1;
            if visits == n {
                self.skip_rounds();
                visits = 0;
            }
        }
    }

    /// After a round in which no head could be afforded, grants every
    /// backlogged band the rounds but one that the closest head still needs,
    /// so that the next round sends it (exactly as that many rounds would).
    fn skip_rounds(&mut self) {
        let mut fewest = f64::INFINITY;
        let mut closest = 0;
        for b in 0..self.bands.len() {
            if let Some((_, i)) = self.head(b) {
                let band = &self.bands[b];
                let missing = self.slots[i as usize].cost - band.deficit;
                let rounds = (missing / band.cfg.share).ceil().max(1.0);
                if rounds < fewest {
                    fewest = rounds;
                    closest = b;
                }
            }
        }
        for b in 0..self.bands.len() {
            if self.head(b).is_some() {
                let band = &mut self.bands[b];
                band.deficit += (fewest - 1.0) * band.cfg.share;
            }
        }
        // Rounding must not leave the closest head a hair short.
        if let Some((_, i)) = self.head(closest) {
            let band = &mut self.bands[closest];
            let cost = self.slots[i as usize].cost;
            band.deficit = band.deficit.max(cost - band.cfg.share);
        }
    }

    /// Sends the next request by the discipline (None: none waits). Call it
    /// when capacity appears (a completion, a scrape that shows room).
    pub fn dispatch(&mut self, now: f64) -> Result<Option<Left<T>>> {
        let now = self.tick(now)?;
        if self.requests == 0 {
            return Ok(None);
        }
        let b = self.next_band();
        let Some((f, i)) = self.head(b) else {
            return Ok(None);
        };
        let cost = self.slots[i as usize].cost;
        let band = &mut self.bands[b];
        band.deficit -= cost;
        let fl = &mut self.flows[f as usize];
        band.vtime = band.vtime.max(fl.counter);
        match band.cfg.fairness {
            Fairness::RoundRobin => {
                fl.counter = band.turns as f64;
                band.turns += 1;
            }
            Fairness::LeastAttainedService => fl.counter += cost,
            Fairness::Debt => fl.counter += cost / fl.weight,
        }
        if fl.counter > RENORMALIZE_AT {
            self.renormalize(b);
        }
        let left = self.detach(i, Outcome::Dispatched, now);
        let band = &mut self.bands[b];
        band.waits.record(left.waited_s);
        self.rate_count =
            self.rate_count * (-(now - self.rate_at).max(0.0) / RATE_WINDOW_S).exp() + 1.0;
        self.rate_at = now;
        Ok(Some(left))
    }

    /// Shifts band `b`'s counters down by its virtual time (order kept).
    fn renormalize(&mut self, b: usize) {
        let band = &mut self.bands[b];
        let shift = band.vtime;
        for &f in band.flows.values() {
            let fl = &mut self.flows[f as usize];
            fl.counter = (fl.counter - shift).max(0.0);
        }
        band.vtime = 0.0;
    }

    /// Moves every request past its TTL to `out` (oldest first in each
    /// band); returns how many.
    pub fn expire(&mut self, now: f64, out: &mut Vec<Left<T>>) -> Result<usize> {
        let now = self.tick(now)?;
        let before = out.len();
        for b in 0..self.bands.len() {
            loop {
                let i = self.bands[b].head;
                if i == NIL || self.slots[i as usize].expires_at > now {
                    break;
                }
                out.push(self.detach(i, Outcome::Expired, now));
            }
        }
        Ok(out.len() - before)
    }

    /// Takes a waiting request out (its client went away): its payload
    /// comes back. `NotInFlight` when the ticket is not waiting (dispatched,
    /// expired, displaced, cancelled or drained already).
    pub fn cancel(&mut self, ticket: Ticket, now: f64) -> Result<Left<T>> {
        let now = finite("now", now)?;
        let i = self
            .live(ticket)
            .ok_or_else(|| not_in_flight(format!("cancel: ticket {ticket} is not waiting")))?;
        let now = self.tick(now)?;
        Ok(self.detach(i, Outcome::Cancelled, now))
    }

    /// Moves every waiting request to `out` (shutdown), band by band from
    /// the highest, oldest first; returns how many.
    pub fn drain(&mut self, now: f64, out: &mut Vec<Left<T>>) -> Result<usize> {
        let now = self.tick(now)?;
        let before = out.len();
        for b in 0..self.bands.len() {
            while self.bands[b].head != NIL {
                let i = self.bands[b].head;
                out.push(self.detach(i, Outcome::Drained, now));
            }
        }
        Ok(out.len() - before)
    }
}

impl<T> std::fmt::Debug for FlowQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowQueue")
            .field("bands", &self.bands.len())
            .field("requests", &self.requests)
            .field("bytes", &self.bytes)
            .field("flows", &self.flows.len())
            .finish()
    }
}
