//! Flow control in simulation: the token-pool paper's two experiments
//! (Cunningham 2026, section 5) with the router's queue in place, under three
//! policies, so that refusing at once, a FCFS queue and the token-pool queue
//! can be compared on the same seeded workload.
//!
//! The model is the paper's: one quota of `slots` concurrent sequences (16,
//! about 240 tokens/s) in front of one backend that runs at most `slots`
//! requests at once and holds the rest in its own FIFO. A request of `i`
//! prompt and `o` output tokens holds a slot for `j (i / PREFILL_RATE + o /
//! SLOT_RATE)` seconds, `j` a seeded factor in [0.75, 1.25]; its first token
//! comes `j (i / PREFILL_RATE + 1 / SLOT_RATE)` after it starts. Tenants send
//! open-loop Poisson arrivals at the rate that keeps `demand` slots busy
//! (`demand / E[service]`) between their start and end; a refused request is
//! not retried (its Retry-After is recorded), so the demand stays the
//! scenario's whatever the policy.
//!
//! Each request runs the data plane's steps ([`crate::dispatch`]): admission
//! is the pure [`AdmissionController`] (entitlements with service classes,
//! the priority of equation 1, contention at the quota), the pick a slot of
//! the backend. The policies differ at one place, before the steps:
//!
//! - `refuse`: today's behaviour: every arrival is decided at once; a quota
//!   at its limit refuses the lower priorities (429) and lets a higher one
//!   through to the backend's FIFO.
//! - `fcfs` and `token-pool`: while the pool is saturated (the
//!   [`SaturationDetector`], concurrency against the slots, or the quota at
//!   its limit) or requests already wait, an arrival waits in a
//!   [`FlowQueue`] instead; a completion (or more capacity) dispatches the
//!   next one, which then runs the steps (admission finds room, so only its
//!   own entitlement's limits can still refuse it). A request past its TTL
//!   leaves with the refusal it would have had. `fcfs`: one band, one flow.
//!   `token-pool`: [`FlowConfig::service_classes`] (a band per service class,
//!   WDRR with the class weights as shares), flows are entitlements sharing
//!   their band by the token-pool debt fairness with `w_e` as weight.
//!
//! Fairness (experiment 2): every second, each active tenant's slot
//! occupancy since the phase began (the last capacity change, tenant joining
//! or leaving) over its max-min fair share of the slots (water-filling the
//! capacity over the tenants' demands), and Jain's index over the tenants of
//! those ratios: 1 when every tenant got its fair share so far.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::future::Future;

use crate::admission::{AdmissionController, Entitlement, Quota};
use crate::dispatch::{dispatch_now, Steps};
use crate::endpoint::EndpointState;
use crate::error::{invalid, Error, Result};
use crate::flow::{
    Arrival, BandConfig, Detector, Enqueued, Fairness, FlowConfig, FlowQueue, Left, Outcome,
    SaturationConfig, SaturationDetector,
};
use crate::rng::Rng;

/// Decode tokens per second of one slot (240 tokens/s over 16 slots).
pub const SLOT_RATE: f64 = 15.0;
/// Prompt tokens per second of one slot (prefill runs ten times faster).
pub const PREFILL_RATE: f64 = 150.0;
/// Tokens (prompt and output) one slot serves per second when prompts and
/// outputs are equally long on average.
pub const SLOT_TOKENS_PER_S: f64 = 2.0 / (1.0 / PREFILL_RATE + 1.0 / SLOT_RATE);
/// Jain's index that counts as fair.
pub const FAIR_JAIN: f64 = 0.9;
const QUOTA: &str = "pool";

/// Where a request waits when the pool is saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowPolicy {
    /// No queue: decided at once (today's behaviour).
    Refuse,
    /// One FIFO for everyone.
    Fcfs,
    /// Bands per service class, debt fairness across entitlements.
    TokenPool,
}

impl FlowPolicy {
    pub const ALL: [FlowPolicy; 3] = [FlowPolicy::Refuse, FlowPolicy::Fcfs, FlowPolicy::TokenPool];

    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == name)
            .ok_or_else(|| {
                invalid(format!(
                    "policy must be refuse, fcfs or token-pool, got {name:?}"
                ))
            })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FlowPolicy::Refuse => "refuse",
            FlowPolicy::Fcfs => "fcfs",
            FlowPolicy::TokenPool => "token-pool",
        }
    }
}

/// One tenant: its entitlement, the slots its arrivals keep busy, when it
/// sends (its entitlement is bound from `start` to `end` when it is not
/// bound from the beginning).
#[derive(Debug, Clone)]
pub struct FlowTenant {
    pub entitlement: Entitlement,
    pub demand: f64,
    pub start: f64,
    pub end: f64,
}

/// One experiment.
#[derive(Debug, Clone)]
pub struct FlowScenario {
    pub name: String,
    pub duration: f64,
    pub slots: u64,
    pub tenants: Vec<FlowTenant>,
    /// Prompt and output lengths, uniform in this range.
    pub lengths: (u64, u64),
    /// Capacity changes of quota and backend: (time, slots).
    pub capacity: Vec<(f64, u64)>,
    /// How long a request may wait in the queue.
    pub ttl_s: f64,
    pub seed: u64,
}

/// An entitlement of `slots` for a tenant whose arrivals keep `slots` busy
/// on average: its concurrency limit twice that (open-loop arrivals peak
/// above their mean, the paper's closed-loop clients never exceed theirs) and
/// a token budget 20% above those slots' throughput.
fn entitlement(
    name: &str,
    class: &str,
    slo_ms: f64,
    slots: i64,
    bound: bool,
) -> Result<Entitlement> {
    let tokens_per_s = 1.2 * slots as f64 * SLOT_TOKENS_PER_S;
    let state = if bound { "bound" } else { "pending" };
    let concurrency = 2 * slots;
    Entitlement::new(
        name,
        name,
        QUOTA,
        class,
        slo_ms,
        tokens_per_s,
        1 << 32,
        concurrency,
        state,
    )
}

impl FlowScenario {
    /// The paper's experiment 1 (cross-class protection) or 2 (SLO-aware
    /// fair share), `duration_scale` times as long (phases scaled alike).
    pub fn experiment(number: u32, duration_scale: f64, ttl_s: f64, seed: u64) -> Result<Self> {
        if !(duration_scale.is_finite() && duration_scale > 0.0) {
            return Err(invalid(format!(
                "duration_scale must be a finite number > 0, got {duration_scale}"
            )));
        }
        if !(ttl_s.is_finite() && ttl_s > 0.0) {
            return Err(invalid(format!(
                "ttl_s must be a finite number > 0, got {ttl_s}"
            )));
        }
        let s = duration_scale;
        let tenant = |entitlement, demand, start: f64, end: f64| FlowTenant {
            entitlement,
            demand,
            start: start * s,
            end: end * s,
        };
        Ok(match number {
            // guaranteed-a (6 slots), spot-b (10), guaranteed-c (6, from 30 s
            // to 60 s): 22 slots of demand on 16 in the middle phase.
            1 => Self {
                name: "experiment 1: cross-class protection".into(),
                duration: 90.0 * s,
                slots: 16,
                tenants: vec![
                    tenant(
                        entitlement("guaranteed-a", "guaranteed", 1000.0, 6, true)?,
                        6.0,
                        0.0,
                        90.0,
                    ),
                    tenant(
                        entitlement("spot-b", "spot", 1000.0, 10, true)?,
                        10.0,
                        0.0,
                        90.0,
                    ),
                    tenant(
                        entitlement("guaranteed-c", "guaranteed", 1000.0, 6, false)?,
                        6.0,
                        30.0,
                        60.0,
                    ),
                ],
                lengths: (64, 64),
                capacity: Vec::new(),
                ttl_s,
                seed,
            },
            // Elastic copilot (500 ms SLO), synth (30 s) and reports (5 s,
            // from 210 s), 5 slots each and 6 slots of demand each; an
            // outage halves the capacity from 30 s to 120 s.
            2 => Self {
                name: "experiment 2: SLO-aware fair share".into(),
                duration: 300.0 * s,
                slots: 16,
                tenants: vec![
                    tenant(
                        entitlement("elastic-copilot", "elastic", 500.0, 5, true)?,
                        6.0,
                        0.0,
                        300.0,
                    ),
                    tenant(
                        entitlement("elastic-synth", "elastic", 30_000.0, 5, true)?,
                        6.0,
                        0.0,
                        300.0,
                    ),
                    tenant(
                        entitlement("elastic-reports", "elastic", 5_000.0, 5, false)?,
                        6.0,
                        210.0,
                        300.0,
                    ),
                ],
                lengths: (32, 176),
                capacity: vec![(30.0 * s, 8), (120.0 * s, 16)],
                ttl_s,
                seed,
            },
            _ => return Err(invalid(format!("experiment must be 1 or 2, got {number}"))),
        })
    }

    /// Expected seconds a request holds a slot.
    fn mean_service(&self) -> f64 {
        let mean = (self.lengths.0 + self.lengths.1) as f64 / 2.0;
        mean / PREFILL_RATE + mean / SLOT_RATE
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowOutcome {
    Served,
    /// Refused at once: admission's status, or the queue full.
    Refused,
    /// Waited its TTL in the queue.
    Expired,
    /// Pushed out of a full queue by a higher band.
    Displaced,
    /// Still waiting or running when the run ended.
    Unfinished,
}

/// One request of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowRequest {
    pub tenant: usize,
    pub arrival: f64,
    pub input: u64,
    pub output: u64,
    pub outcome: FlowOutcome,
    /// Seconds to the first token (served requests; NaN otherwise).
    pub ttft: f64,
    /// Seconds waited in the router's queue (0 when never queued).
    pub queued: f64,
    /// The refusal's Retry-After, when it had one.
    pub retry_after_s: Option<f64>,
}

/// The state at the end of one simulated second.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSecond {
    pub t: f64,
    pub slots: u64,
    pub running: u64,
    /// In the backend's FIFO.
    pub backend_waiting: u64,
    /// In the router's queue.
    pub queued: u64,
    /// Slot-seconds per tenant over the last second.
    pub occupancy: Vec<f64>,
    /// Jain's index of the fairness ratios (NaN with fewer than two
    /// tenants active).
    pub jain: f64,
}

/// Everything a run produced.
#[derive(Debug, Clone)]
pub struct FlowRun {
    pub policy: FlowPolicy,
    pub requests: Vec<FlowRequest>,
    pub timeline: Vec<FlowSecond>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    State(usize, bool),
    Capacity(u64),
    Arrive(usize),
    Finish(usize),
    Sample,
}

/// Why the steps stopped.
enum Stop {
    Denied(Option<f64>),
    Failed(Error),
}

struct Sim<'s> {
    scenario: &'s FlowScenario,
    policy: FlowPolicy,
    rng: Rng,
    admission: AdmissionController,
    queue: Option<FlowQueue<usize>>,
    detector: SaturationDetector,
    slots: u64,
    running: u64,
    backend: VecDeque<usize>,
    tickets: Vec<Option<u64>>,
    requests: Vec<FlowRequest>,
    /// Per tenant: requests running now, slot-seconds so far.
    running_of: Vec<u64>,
    slot_s: Vec<f64>,
    last_t: f64,
    /// When the phase began, and the slot-seconds then.
    phase: (f64, Vec<f64>),
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
}

/// One request's steps ([`crate::dispatch::Steps`]): one pool, admission by
/// the entitlement, the pick a backend slot.
struct Request<'a, 's> {
    sim: &'a mut Sim<'s>,
    k: usize,
    now: f64,
    failed: Option<Error>,
}

impl Steps for Request<'_, '_> {
    type Pool = ();
    type Admitted = u64;
    type Picked = ();
    type Refused = Stop;

    fn route(&mut self) -> std::result::Result<(), Stop> {
        Ok(())
    }

    fn admit(&mut self, _: &()) -> impl Future<Output = std::result::Result<u64, Stop>> {
        let r = &self.sim.requests[self.k];
        let name = &self.sim.scenario.tenants[r.tenant].entitlement.name;
        let decided =
            self.sim
                .admission
                .admit(name, r.input as i64, Some(r.output as i64), self.now);
        std::future::ready(match decided {
            Ok(a) => a
                .ticket
                .filter(|_| a.admitted)
                .ok_or(Stop::Denied(a.retry_after_s)),
            Err(e) => Err(Stop::Failed(e)),
        })
    }

    fn pick(&mut self, _: &(), &ticket: &u64) -> std::result::Result<(), Stop> {
        self.sim.tickets[self.k] = Some(ticket);
        self.sim.backend.push_back(self.k);
        self.sim.start_backend(self.now);
        Ok(())
    }

    fn unadmit(&mut self, _: &(), ticket: u64) {
        if let Err(e) = self.sim.admission.complete(ticket, 0, 0, 0.0, self.now) {
            self.failed.get_or_insert(e);
        }
    }

    fn unroute(&mut self, _: ()) {}
}

/// The queue of a policy (None: refuse at once).
fn queue_config(policy: FlowPolicy, ttl_s: f64) -> Option<FlowConfig> {
    let mut config = match policy {
        FlowPolicy::Refuse => return None,
        FlowPolicy::Fcfs => FlowConfig {
            bands: vec![BandConfig {
                fairness: Fairness::RoundRobin,
                ..BandConfig::new("all", 1.0)
            }],
            ..FlowConfig::service_classes()
        },
        FlowPolicy::TokenPool => FlowConfig::service_classes(),
    };
    config.ttl_s = ttl_s;
    Some(config)
}

fn detector(slots: u64) -> Result<SaturationDetector> {
    SaturationDetector::new(SaturationConfig {
        detector: Detector::Concurrency,
        max_in_flight: slots as i64,
        ..SaturationConfig::default()
    })
}

impl<'s> Sim<'s> {
    fn new(scenario: &'s FlowScenario, policy: FlowPolicy) -> Result<Self> {
        if scenario.slots < 1 || scenario.tenants.is_empty() {
            return Err(invalid("a scenario needs slots and tenants"));
        }
        let slots = scenario.slots;
        let quota = Quota::new(
            QUOTA,
            SLOT_TOKENS_PER_S * slots as f64,
            1 << 40,
            slots as i64,
            0,
        )?;
        let ents = scenario
            .tenants
            .iter()
            .map(|t| t.entitlement.clone())
            .collect();
        let queue = queue_config(policy, scenario.ttl_s)
            .map(|c| FlowQueue::new(&c))
            .transpose()?;
        let n = scenario.tenants.len();
        let mut sim = Self {
            scenario,
            policy,
            rng: Rng::new(scenario.seed),
            admission: AdmissionController::new(vec![quota], ents, 4096, 60.0)?,
            queue,
            detector: detector(slots)?,
            slots,
            running: 0,
            backend: VecDeque::new(),
            tickets: Vec::new(),
            requests: Vec::new(),
            running_of: vec![0; n],
            slot_s: vec![0.0; n],
            last_t: 0.0,
            phase: (0.0, vec![0.0; n]),
            events: BinaryHeap::new(),
            seq: 0,
        };
        // State and capacity changes first at their instant.
        for (i, t) in scenario.tenants.iter().enumerate() {
            if t.entitlement.state.as_str() != "bound" {
                sim.push(t.start, Ev::State(i, true));
                sim.push(t.end, Ev::State(i, false));
            }
        }
        for &(at, slots) in &scenario.capacity {
            sim.push(at, Ev::Capacity(slots));
        }
        for t in 1..=scenario.duration.floor() as u64 {
            sim.push(t as f64, Ev::Sample);
        }
        for (i, t) in scenario.tenants.iter().enumerate() {
            let first = t.start + sim.gap(i);
            sim.push(first, Ev::Arrive(i));
        }
        Ok(sim)
    }

    fn push(&mut self, at: f64, ev: Ev) {
        self.seq += 1;
        // Non-negative f64 order as their bits do.
        self.events
            .push(Reverse((at.max(0.0).to_bits(), self.seq, ev)));
    }

    /// Seconds to tenant `i`'s next arrival.
    fn gap(&mut self, i: usize) -> f64 {
        let rate = self.scenario.tenants[i].demand / self.scenario.mean_service();
        self.rng.exponential(rate)
    }

    /// Slot-seconds held up to `now`.
    fn advance(&mut self, now: f64) {
        let dt = (now - self.last_t).max(0.0);
        for (s, &n) in self.slot_s.iter_mut().zip(&self.running_of) {
            *s += n as f64 * dt;
        }
        self.last_t = self.last_t.max(now);
    }

    /// Starts what the backend's FIFO holds while it has free slots.
    fn start_backend(&mut self, now: f64) {
        while self.running < self.slots {
            let Some(k) = self.backend.pop_front() else {
                return;
            };
            self.running += 1;
            let j = 0.75 + 0.5 * self.rng.uniform();
            let r = &mut self.requests[k];
            self.running_of[r.tenant] += 1;
            let prefill = r.input as f64 / PREFILL_RATE;
            r.ttft = now - r.arrival + j * (prefill + 1.0 / SLOT_RATE);
            let service = j * (prefill + r.output as f64 / SLOT_RATE);
            self.push(now + service, Ev::Finish(k));
        }
    }

    /// Whether an arrival must wait: the pool saturated, or others waiting.
    fn saturated(&self) -> Result<bool> {
        let state = EndpointState {
            in_flight: self.running + self.backend.len() as u64,
            ..EndpointState::default()
        };
        let at_limit = self.admission.quota_in_flight(QUOTA)? >= self.slots;
        Ok(self.detector.saturated(&[state], at_limit))
    }

    /// Runs request `k`'s steps now; a refusal ends it.
    fn steps(&mut self, k: usize, now: f64) -> Result<()> {
        let mut req = Request {
            sim: self,
            k,
            now,
            failed: None,
        };
        let outcome = dispatch_now(&mut req);
        if let Some(e) = req.failed.take() {
            return Err(e);
        }
        match outcome {
            Some(Ok(_)) => Ok(()),
            Some(Err(Stop::Denied(retry))) => {
                let r = &mut self.requests[k];
                r.outcome = FlowOutcome::Refused;
                r.retry_after_s = retry;
                Ok(())
            }
            Some(Err(Stop::Failed(e))) => Err(e),
            None => Err(invalid("a simulated step waited")),
        }
    }

    fn arrive(&mut self, i: usize, now: f64) -> Result<()> {
        let t = &self.scenario.tenants[i];
        let (lo, hi) = self.scenario.lengths;
        let mut length = || lo + self.rng.below(hi - lo + 1);
        let (input, output) = (length(), length());
        let k = self.requests.len();
        self.requests.push(FlowRequest {
            tenant: i,
            arrival: now,
            input,
            output,
            outcome: FlowOutcome::Unfinished,
            ttft: f64::NAN,
            queued: 0.0,
            retry_after_s: None,
        });
        self.tickets.push(None);
        let next = now + self.gap(i);
        if next < t.end {
            self.push(next, Ev::Arrive(i));
        }
        let waiting = self.queue.as_ref().is_some_and(|q| !q.is_empty());
        if self.queue.is_none() || !(waiting || self.saturated()?) {
            return self.steps(k, now);
        }
        let ent = &t.entitlement;
        let weight = self
            .admission
            .priority(&ent.name)?
            .max(crate::flow::MIN_WEIGHT);
        let class = ent.service_class.as_str();
        let Some(queue) = self.queue.as_mut() else {
            unreachable!("checked above")
        };
        let band = queue.band_of(Some(class));
        let arrival = Arrival {
            cost: (input + output) as f64,
            weight,
            ..Arrival::new(band, &ent.name)
        };
        let mut displaced = Vec::new();
        let enqueued = queue.enqueue(arrival, k, now, &mut displaced)?;
        self.left(displaced);
        if let Enqueued::Refused {
            retry_after_s,
            payload,
            ..
        } = enqueued
        {
            let r = &mut self.requests[payload];
            r.outcome = FlowOutcome::Refused;
            r.retry_after_s = retry_after_s;
        }
        Ok(())
    }

    /// Records the requests that left the queue without being dispatched.
    fn left(&mut self, out: Vec<Left<usize>>) {
        for l in out {
            let r = &mut self.requests[l.payload];
            r.queued = l.waited_s;
            r.outcome = match l.outcome {
                Outcome::Displaced => FlowOutcome::Displaced,
                _ => FlowOutcome::Expired,
            };
        }
    }

    /// Dispatches from the queue while the pool has room.
    fn pump(&mut self, now: f64) -> Result<()> {
        while self.queue.as_ref().is_some_and(|q| !q.is_empty()) && !self.saturated()? {
            let Some(l) = self
                .queue
                .as_mut()
                .map(|q| q.dispatch(now))
                .transpose()?
                .flatten()
            else {
                return Ok(());
            };
            self.requests[l.payload].queued = l.waited_s;
            self.steps(l.payload, now)?;
        }
        Ok(())
    }

    fn finish(&mut self, k: usize, now: f64) -> Result<()> {
        self.running -= 1;
        let r = &mut self.requests[k];
        r.outcome = FlowOutcome::Served;
        self.running_of[r.tenant] -= 1;
        let (input, output, latency) = (r.input as i64, r.output as i64, now - r.arrival);
        if let Some(ticket) = self.tickets[k].take() {
            self.admission
                .complete(ticket, input, output, latency, now)?;
        }
        self.start_backend(now);
        self.pump(now)
    }

    fn run(mut self) -> Result<FlowRun> {
        let mut timeline = Vec::new();
        let mut last_slot_s = self.slot_s.clone();
        while let Some(&Reverse((bits, _, ev))) = self.events.peek() {
            let at = f64::from_bits(bits);
            if at > self.scenario.duration {
                break;
            }
            // Expiries due before the next event come first.
            if let Some(exp) = self.queue.as_ref().and_then(FlowQueue::next_expiry) {
                if exp <= at {
                    self.advance(exp);
                    let mut out = Vec::new();
                    if let Some(q) = self.queue.as_mut() {
                        q.expire(exp, &mut out)?;
                    }
                    self.left(out);
                    continue;
                }
            }
            self.events.pop();
            self.advance(at);
            if matches!(ev, Ev::State(..) | Ev::Capacity(_)) {
                self.phase = (at, self.slot_s.clone());
            }
            match ev {
                Ev::State(i, bound) => {
                    let name = &self.scenario.tenants[i].entitlement.name;
                    let state = if bound { "bound" } else { "expired" };
                    self.admission.set_state(name, state)?;
                }
                Ev::Capacity(slots) => {
                    self.slots = slots;
                    self.detector = detector(slots)?;
                    let rate = SLOT_TOKENS_PER_S * slots as f64;
                    self.admission
                        .set_capacity(QUOTA, Some(rate), None, Some(slots as i64))?;
                    self.start_backend(at);
                    self.pump(at)?;
                }
                Ev::Arrive(i) => self.arrive(i, at)?,
                Ev::Finish(k) => self.finish(k, at)?,
                Ev::Sample => {
                    let occupancy: Vec<f64> = self
                        .slot_s
                        .iter()
                        .zip(&last_slot_s)
                        .map(|(now, before)| now - before)
                        .collect();
                    last_slot_s.clone_from(&self.slot_s);
                    let jain = self.jain(at);
                    timeline.push(FlowSecond {
                        t: at,
                        slots: self.slots,
                        running: self.running,
                        backend_waiting: self.backend.len() as u64,
                        queued: self.queue.as_ref().map_or(0, FlowQueue::len),
                        occupancy,
                        jain,
                    });
                }
            }
        }
        Ok(FlowRun {
            policy: self.policy,
            requests: self.requests,
            timeline,
        })
    }

    /// Jain's index at `t` of the active tenants' occupancy since the phase
    /// began over their max-min fair shares.
    fn jain(&self, t: f64) -> f64 {
        let (since, ref before) = self.phase;
        let tenants = &self.scenario.tenants;
        let active: Vec<usize> = (0..tenants.len())
            .filter(|&i| tenants[i].start <= since && tenants[i].end >= t)
            .collect();
        if active.len() < 2 || t <= since {
            return f64::NAN;
        }
        let demands: Vec<f64> = active.iter().map(|&i| tenants[i].demand).collect();
        let fair = max_min_shares(self.slots as f64, &demands);
        let x: Vec<f64> = active
            .iter()
            .zip(&fair)
            .map(|(&i, f)| (self.slot_s[i] - before[i]) / (t - since) / f)
            .collect();
        jain_index(&x)
    }
}

/// Max-min fair shares of `capacity` among `demands` (water-filling): each
/// gets its demand or the equal share of what is left, whichever is less.
pub fn max_min_shares(capacity: f64, demands: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_by(|&a, &b| demands[a].total_cmp(&demands[b]));
    let mut shares = vec![0.0; demands.len()];
    let mut left = capacity;
    for (n, &i) in order.iter().enumerate() {
        let equal = left / (demands.len() - n) as f64;
        shares[i] = demands[i].min(equal);
        left -= shares[i];
    }
    shares
}

/// Jain's fairness index `(sum x)^2 / (n sum x^2)`: 1 when all are equal,
/// `1/n` when one has everything; NaN for no values or all zero.
pub fn jain_index(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    sum * sum / (x.len() as f64 * squares)
}

/// Runs `scenario` under `policy`.
pub fn run_flow(scenario: &FlowScenario, policy: FlowPolicy) -> Result<FlowRun> {
    Sim::new(scenario, policy)?.run()
}

/// The figures of a run's requests of one class or one tenant.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSummary {
    /// The class, or the tenant's entitlement.
    pub name: String,
    pub requests: u64,
    pub served: u64,
    /// Refused at once, expired in the queue or displaced from it.
    pub refused: u64,
    pub expired: u64,
    pub displaced: u64,
    /// Of the served requests; NaN when none.
    pub p99_ttft: f64,
    pub mean_queued: f64,
}

/// A run's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSummary {
    pub policy: FlowPolicy,
    /// Tokens (prompt and output) of the served requests per second.
    pub goodput: f64,
    pub refused_share: f64,
    pub classes: Vec<GroupSummary>,
    pub tenants: Vec<GroupSummary>,
    /// Seconds from the first capacity drop until Jain's index reaches
    /// [`FAIR_JAIN`] and stays there until the capacity changes again (or
    /// the run ends); None when it never does or there is no drop.
    pub time_to_fairness: Option<f64>,
    /// The mean of Jain's index over that phase (NaN without one).
    pub scarcity_jain: f64,
}

/// The figures of the requests `of` puts in each group, groups in order of
/// first appearance.
fn groups<'r>(
    requests: &'r [FlowRequest],
    of: impl Fn(&'r FlowRequest) -> &'r str,
) -> Vec<GroupSummary> {
    let mut out: Vec<GroupSummary> = Vec::new();
    let mut ttfts: Vec<Vec<f64>> = Vec::new();
    for r in requests {
        let name = of(r);
        let g = match out.iter().position(|g| g.name == name) {
            Some(g) => g,
            None => {
                out.push(GroupSummary {
                    name: name.to_owned(),
                    requests: 0,
                    served: 0,
                    refused: 0,
                    expired: 0,
                    displaced: 0,
                    p99_ttft: f64::NAN,
                    mean_queued: 0.0,
                });
                ttfts.push(Vec::new());
                out.len() - 1
            }
        };
        let s = &mut out[g];
        s.requests += 1;
        s.mean_queued += r.queued;
        match r.outcome {
            FlowOutcome::Served => {
                s.served += 1;
                ttfts[g].push(r.ttft);
            }
            FlowOutcome::Refused => s.refused += 1,
            FlowOutcome::Expired => {
                s.refused += 1;
                s.expired += 1;
            }
            FlowOutcome::Displaced => {
                s.refused += 1;
                s.displaced += 1;
            }
            FlowOutcome::Unfinished => {}
        }
    }
    for (s, t) in out.iter_mut().zip(&ttfts) {
        s.p99_ttft = super::percentile(t, 99.0);
        s.mean_queued /= s.requests.max(1) as f64;
    }
    out
}

impl FlowRun {
    pub fn summary(&self, scenario: &FlowScenario) -> FlowSummary {
        let ent = |r: &FlowRequest| &scenario.tenants[r.tenant].entitlement;
        let classes = groups(&self.requests, |r| ent(r).service_class.as_str());
        let tenants = groups(&self.requests, |r| ent(r).name.as_str());
        let tokens: u64 = self
            .requests
            .iter()
            .filter(|r| r.outcome == FlowOutcome::Served)
            .map(|r| r.input + r.output)
            .sum();
        let total: u64 = classes.iter().map(|c| c.requests).sum();
        let refused: u64 = classes.iter().map(|c| c.refused).sum();
        FlowSummary {
            policy: self.policy,
            goodput: tokens as f64 / scenario.duration,
            refused_share: refused as f64 / total.max(1) as f64,
            classes,
            tenants,
            time_to_fairness: self.time_to_fairness(scenario),
            scarcity_jain: self.scarcity_jain(scenario),
        }
    }

    /// The samples of the scarcity phase: from the first capacity drop to
    /// the next change (or the end).
    fn scarcity(&self, scenario: &FlowScenario) -> Option<(f64, Vec<&FlowSecond>)> {
        let (onset, _) = *scenario.capacity.first()?;
        let end = scenario
            .capacity
            .get(1)
            .map_or(scenario.duration, |&(t, _)| t);
        let phase = self
            .timeline
            .iter()
            .filter(|s| s.t > onset && s.t < end)
            .collect();
        Some((onset, phase))
    }

    fn time_to_fairness(&self, scenario: &FlowScenario) -> Option<f64> {
        let (onset, phase) = self.scarcity(scenario)?;
        let first_fair = match phase
            .iter()
            .rposition(|s| s.jain.is_nan() || s.jain < FAIR_JAIN)
        {
            None => phase.first()?,
            Some(last_unfair) => phase.get(last_unfair + 1)?,
        };
        Some(first_fair.t - onset)
    }

    fn scarcity_jain(&self, scenario: &FlowScenario) -> f64 {
        let Some((_, phase)) = self.scarcity(scenario) else {
            return f64::NAN;
        };
        let finite: Vec<f64> = phase
            .iter()
            .map(|s| s.jain)
            .filter(|j| j.is_finite())
            .collect();
        finite.iter().sum::<f64>() / finite.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class<'a>(s: &'a FlowSummary, name: &str) -> &'a GroupSummary {
        s.classes.iter().find(|c| c.name == name).expect("class")
    }

    #[test]
    fn max_min_shares_fill_the_small_demands_first() {
        assert_eq!(max_min_shares(8.0, &[6.0, 6.0]), vec![4.0, 4.0]);
        assert_eq!(max_min_shares(16.0, &[2.0, 6.0, 20.0]), vec![2.0, 6.0, 8.0]);
        assert_eq!(max_min_shares(16.0, &[3.0, 4.0]), vec![3.0, 4.0]);
    }

    #[test]
    fn jain_index_is_one_when_equal_and_one_over_n_when_one_has_all() {
        assert!((jain_index(&[0.5, 0.5, 0.5]) - 1.0).abs() < 1e-12);
        assert!((jain_index(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        // (1 + 3)^2 / (2 (1 + 9)) = 0.8
        assert!((jain_index(&[1.0, 3.0]) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn policies_parse_and_bad_scenarios_are_refused() {
        for p in FlowPolicy::ALL {
            assert_eq!(FlowPolicy::parse(p.as_str()).expect("known"), p);
        }
        assert!(FlowPolicy::parse("lifo").is_err());
        assert!(FlowScenario::experiment(3, 1.0, 10.0, 1).is_err());
        assert!(FlowScenario::experiment(1, 0.0, 10.0, 1).is_err());
        assert!(FlowScenario::experiment(1, 1.0, 0.0, 1).is_err());
        assert!(FlowScenario::experiment(1, 1.0, f64::NAN, 1).is_err());
    }

    /// Every request ends one way, and the same seed gives the same run.
    #[test]
    fn every_request_ends_once_and_runs_are_deterministic() {
        let s = FlowScenario::experiment(1, 0.5, 10.0, 3).expect("scenario");
        for policy in FlowPolicy::ALL {
            let a = run_flow(&s, policy).expect("run");
            let b = run_flow(&s, policy).expect("run");
            // Debug form: NaN (no TTFT) equals itself there.
            assert_eq!(format!("{:?}", a.requests), format!("{:?}", b.requests));
            let sum = a.summary(&s);
            let c: u64 = sum.classes.iter().map(|c| c.requests).sum();
            assert_eq!(c, a.requests.len() as u64);
            // The backend never runs more than its slots.
            assert!(a.timeline.iter().all(|t| t.running <= t.slots));
            if policy == FlowPolicy::Refuse {
                assert!(a.timeline.iter().all(|t| t.queued == 0));
            } else {
                // The gate keeps the backend's own FIFO empty.
                assert!(
                    a.timeline.iter().all(|t| t.backend_waiting == 0),
                    "{policy:?}"
                );
            }
        }
    }

    /// Experiment 1, the paper's claims with the queue: the token-pool queue
    /// keeps the guaranteed p99 TTFT bounded (a few seconds, whatever the
    /// overload phase lasts) while a FCFS queue lets it grow with the
    /// backlog; spot is queued, then shed (it expires), guaranteed is not.
    #[test]
    fn experiment_1_token_pool_protects_guaranteed_and_sheds_spot() {
        for seed in [1, 2, 3] {
            for scale in [1.0, 2.0] {
                let s = FlowScenario::experiment(1, scale, 30.0, seed).expect("scenario");
                let run = |p| run_flow(&s, p).expect("run").summary(&s);
                let (tp, fcfs) = (run(FlowPolicy::TokenPool), run(FlowPolicy::Fcfs));
                let (g_tp, g_fcfs) = (class(&tp, "guaranteed"), class(&fcfs, "guaranteed"));
                let s_tp = class(&tp, "spot");
                let at = format!("seed {seed} scale {scale}");
                assert!(g_tp.p99_ttft < 5.0, "{at}: {g_tp:?}");
                assert!(g_fcfs.p99_ttft > 2.0 * g_tp.p99_ttft, "{at}: {g_fcfs:?}");
                assert_eq!(g_tp.expired + g_tp.displaced, 0, "{at}");
                assert!(s_tp.mean_queued > 4.0 * g_tp.mean_queued, "{at}: {s_tp:?}");
                if scale > 1.0 {
                    assert!(s_tp.expired > 0, "{at}: {s_tp:?}");
                }
            }
        }
    }

    fn tenant<'a>(s: &'a FlowSummary, name: &str) -> &'a GroupSummary {
        s.tenants.iter().find(|c| c.name == name).expect("tenant")
    }

    /// Experiment 2: under the token-pool queue the tight-SLO copilot is
    /// never refused and waits far less than under FCFS (which shares the
    /// slots evenly but ignores the SLOs); refusing at once squeezes synth
    /// below its fair share for the whole outage (Jain's index never stays
    /// above the threshold) while FCFS gets there within seconds.
    #[test]
    fn experiment_2_slo_aware_under_token_pool_fair_under_fcfs() {
        for seed in [1, 2, 3] {
            let s = FlowScenario::experiment(2, 1.0, 30.0, seed).expect("scenario");
            let run = |p| run_flow(&s, p).expect("run").summary(&s);
            let (tp, fcfs, refuse) = (
                run(FlowPolicy::TokenPool),
                run(FlowPolicy::Fcfs),
                run(FlowPolicy::Refuse),
            );
            let copilot = |s| tenant(s, "elastic-copilot");
            assert_eq!(copilot(&tp).refused, 0, "seed {seed}");
            assert!(
                copilot(&tp).mean_queued < 0.5 * copilot(&fcfs).mean_queued,
                "seed {seed}"
            );
            assert!(
                copilot(&tp).p99_ttft < copilot(&fcfs).p99_ttft,
                "seed {seed}"
            );
            assert!(
                fcfs.time_to_fairness.is_some_and(|t| t <= 10.0),
                "seed {seed}: {fcfs:?}"
            );
            assert_eq!(refuse.time_to_fairness, None, "seed {seed}: {refuse:?}");
            assert!(refuse.scarcity_jain < fcfs.scarcity_jain, "seed {seed}");
        }
    }
}
