//! Autoscaling in the simulator (issue 26): one pool whose endpoint count a
//! [`Policy`] changes every period while a time-varying workload
//! ([`super::profile`]) arrives.
//!
//! Endpoints have a life: one that is started takes `startup_s` before it
//! is ready (the picker sees it unhealthy: no request goes to it); one
//! that is stopped first drains (no new request; it finishes what it holds,
//! then stops). A scale-down cancels starting endpoints first (the newest
//! first, as a ReplicaSet deletes unready pods first), then drains the
//! least-loaded ready ones. GPU time is counted from an endpoint's start to
//! its stop, start-up and drain included, within `[0, horizon_s]`.
//!
//! Requests go to the ready endpoints through the pool's endpoint picker
//! ([`PoolPicker`], the server's, e.g. least-request: it reads each
//! endpoint's queue, running count and KV use at every pick, as a scrape
//! just before it would, and starts and completes every request), each
//! endpoint the
//! iteration-level engine of [`super::engine`]; with none ready (every
//! endpoint starting or draining) they wait at the router and go out as
//! soon as one is. Every request that finishes is told to the policy (the
//! data plane observes at lease end), and at every period the policy says
//! how many endpoints the pool should run ([`Policy::desired`], within the
//! pool's `[min_endpoints, max_endpoints]`).

pub mod policy;

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::autoscale::PoolScaling;
use crate::endpoint::MAX_ENDPOINTS;
use crate::error::{invalid, non_negative, positive, Result};
use crate::pick::{PickConfig, PickRequest, Pipeline, PluginSpec, PoolPicker};

use super::engine::{Endpoint, Event};
use super::{check_requests, check_sorted, Category, Heap, PoolConfig, RequestBlocks, SimRequest};

pub use policy::{FleetState, Policy};

/// The settings of one autoscaled run besides the workload and the policy.
#[derive(Debug, Clone)]
pub struct ScaleConfig {
    /// The pool's engines; `endpoints` is the count ready at 0 s.
    pub pool: PoolConfig,
    /// Bounds and SLO (TTFT within `slo_ttft_s`, TPOT within `slo_tpot_s`).
    pub scaling: PoolScaling,
    /// Seconds between two of the policy's decisions (the first at `period_s`).
    pub period_s: f64,
    /// Seconds from an endpoint's start to its first request.
    pub startup_s: f64,
    /// End of the decisions and of the GPU-time count; arrivals after it are
    /// refused.
    pub horizon_s: f64,
    /// The pool's endpoint picker (e.g. `preset_specs("least-request")`).
    pub picker: Vec<PluginSpec>,
    /// Times the load rises at once (a step, a burst): requests arriving
    /// from one until the first start-up after it ends are left out of the
    /// attainment ([`ScaleConfig::excluded_until`]).
    pub rises: Vec<f64>,
}

impl ScaleConfig {
    /// The end of the first start-up delay after a rise at `rise` (issue 26:
    /// attainment "excluding the first start-up delay after a step"): the
    /// first decision that can see the rise is the first one after it (a
    /// decision at the rise's instant comes before its arrivals), and the
    /// endpoints it starts are ready `startup_s` later. The same window for
    /// every policy.
    pub fn excluded_until(&self, rise: f64) -> f64 {
        let first_decision = ((rise / self.period_s).floor() + 1.0) * self.period_s;
        first_decision + self.startup_s
    }
}

/// One decision of the policy, and the fleet as it stood after it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tick {
    pub time: f64,
    /// What the policy asked, within the bounds.
    pub desired: u64,
    pub ready: u64,
    pub starting: u64,
    pub draining: u64,
    /// Requests waiting in the engines' queues and at the router, before it.
    pub waiting: u64,
}

/// What happened: per request (in arrival order) and over time.
#[derive(Debug, Clone, Default)]
pub struct ScaleReport {
    pub ttft: Vec<f64>,
    pub e2e: Vec<f64>,
    /// `(e2e - ttft) / (L_out - 1)`; NaN for one-token outputs.
    pub tpot: Vec<f64>,
    /// The endpoint (slot) that served it: slots are reused, a stopped
    /// endpoint's slot by the next one started; -1 when never dispatched.
    pub endpoint: Vec<i64>,
    /// Within both SLO targets (TPOT when there is one).
    pub met: Vec<bool>,
    /// Arrived within `startup_s` after a rise: not counted in `attainment`.
    pub excluded: Vec<bool>,
    pub ticks: Vec<Tick>,
    /// Endpoint-seconds times `gpus_per_endpoint`, start-up and drain included.
    pub gpu_seconds: f64,
    /// Endpoints started (the initial ones included) and stopped (drained
    /// or cancelled while starting) during the run.
    pub started: u64,
    pub stopped: u64,
    /// Share of the counted requests within both targets.
    pub attainment: f64,
    /// The most endpoints running at once (starting, ready and draining).
    pub peak_endpoints: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    Stopped,
    Starting { ready_at: f64 },
    Ready,
    Draining,
}

struct Slot {
    engine: Endpoint,
    phase: Phase,
    /// When the endpoint (last) started.
    since: f64,
}

struct Run<'a> {
    requests: &'a [SimRequest],
    cfg: &'a ScaleConfig,
    blocks: RequestBlocks,
    slots: Vec<Slot>,
    version: Vec<u64>,
    /// The pool's picker over every slot (a slot not ready is unhealthy).
    picker: PoolPicker,
    /// Starting endpoints in start order (all take `startup_s`): (ready time, slot).
    starting: VecDeque<(f64, usize)>,
    /// Requests waiting at the router while no endpoint is ready.
    held: VecDeque<usize>,
    report: ScaleReport,
}

/// Runs the pool under `policy` over `requests` (sorted by arrival, all
/// before `horizon_s`). `progress` counts the arrivals processed.
pub fn run(
    requests: &[SimRequest],
    cfg: &ScaleConfig,
    policy: &mut dyn Policy,
    progress: &AtomicU64,
) -> Result<ScaleReport> {
    let categories = [Category {
        name: "default".into(),
        bytes_per_token: 4.0,
        compressible: false,
    }];
    check_requests(requests, &categories)?;
    check_sorted(requests)?;
    positive("period_s", cfg.period_s)?;
    non_negative("startup_s", cfg.startup_s)?;
    positive("horizon_s", cfg.horizon_s)?;
    let s = &cfg.scaling;
    if s.min_endpoints > s.max_endpoints {
        return Err(invalid(format!(
            "min_endpoints ({}) is above max_endpoints ({})",
            s.min_endpoints, s.max_endpoints
        )));
    }
    if s.max_endpoints > MAX_ENDPOINTS as u64 {
        return Err(invalid(format!(
            "max_endpoints must be <= {MAX_ENDPOINTS} in the simulator, got {}",
            s.max_endpoints
        )));
    }
    let initial = cfg.pool.endpoints as u64;
    if !(s.min_endpoints..=s.max_endpoints).contains(&initial) {
        return Err(invalid(format!(
            "the initial {initial} endpoints are outside [min_endpoints {}, max_endpoints {}]",
            s.min_endpoints, s.max_endpoints
        )));
    }
    if let Some(r) = requests.iter().find(|r| r.arrival > cfg.horizon_s) {
        return Err(invalid(format!(
            "a request arrives at {} s, after the horizon {} s",
            r.arrival, cfg.horizon_s
        )));
    }
    for r in requests {
        if r.input_tokens + r.output_tokens > cfg.pool.max_context {
            return Err(invalid(format!(
                "a request of {} tokens does not fit the pool's max_context {}",
                r.input_tokens + r.output_tokens,
                cfg.pool.max_context
            )));
        }
    }
    let n_slots = s.max_endpoints as usize;
    let names: Vec<String> = (0..n_slots).map(|i| format!("e{i}")).collect();
    let mut picker = PoolPicker::new(Pipeline::from_specs(
        &cfg.picker,
        &names,
        &PickConfig::default(),
    )?);
    for s in &mut picker.states {
        s.healthy = false;
    }
    let n = requests.len();
    let nan = vec![f64::NAN; n];
    let mut run = Run {
        requests,
        cfg,
        blocks: RequestBlocks::none(n),
        slots: Vec::new(),
        version: vec![0; n_slots],
        picker,
        starting: VecDeque::new(),
        held: VecDeque::new(),
        report: ScaleReport {
            ttft: nan.clone(),
            e2e: nan.clone(),
            tpot: nan,
            endpoint: vec![-1; n],
            met: vec![false; n],
            excluded: requests
                .iter()
                .map(|r| {
                    cfg.rises
                        .iter()
                        .any(|&t| r.arrival >= t && r.arrival < cfg.excluded_until(t))
                })
                .collect(),
            ..ScaleReport::default()
        },
    };
    for _ in 0..initial {
        let i = run.free_slot();
        run.set_phase(i, Phase::Ready, 0.0);
    }
    run.report.peak_endpoints = initial;
    run.main(policy, progress)?;
    run.finish()
}

impl Run<'_> {
    fn limits(&self) -> super::engine::EngineLimits {
        self.cfg.pool.limits(true)
    }

    /// A stopped slot (the lowest), or a new one.
    fn free_slot(&mut self) -> usize {
        if let Some(i) = self.slots.iter().position(|s| s.phase == Phase::Stopped) {
            return i;
        }
        self.slots.push(Slot {
            engine: Endpoint::new(self.limits()),
            phase: Phase::Stopped,
            since: 0.0,
        });
        self.slots.len() - 1
    }

    /// Moves slot `i` to `phase` at `now`, counting its GPU time when it stops.
    fn set_phase(&mut self, i: usize, phase: Phase, now: f64) {
        let (old, since) = (self.slots[i].phase, self.slots[i].since);
        match (old, phase) {
            (Phase::Stopped, Phase::Stopped) => {}
            (Phase::Stopped, _) => {
                self.slots[i].since = now;
                self.report.started += 1;
            }
            (_, Phase::Stopped) => {
                self.report.gpu_seconds += self.gpu_seconds(since, now);
                self.report.stopped += 1;
            }
            _ => {}
        }
        self.slots[i].phase = phase;
        self.picker.states[i].healthy = phase == Phase::Ready;
    }

    /// GPU-seconds of an endpoint from `since` to `end`, within the horizon.
    fn gpu_seconds(&self, since: f64, end: f64) -> f64 {
        let end = end.min(self.cfg.horizon_s);
        (end - since).max(0.0) * self.cfg.pool.gpus_per_endpoint as f64
    }

    fn fleet_state(&self) -> FleetState {
        let mut st = FleetState {
            ready: 0,
            starting: 0,
            draining: 0,
            waiting: self.held.len() as u64,
            held: self.held.len() as u64,
            backlogged: 0,
            running: 0,
            kv_usage: 0.0,
            max_num_seqs: self.cfg.pool.max_num_seqs as u64,
        };
        for s in &self.slots {
            match s.phase {
                Phase::Stopped => continue,
                Phase::Starting { .. } => st.starting += 1,
                Phase::Draining => st.draining += 1,
                Phase::Ready => {
                    st.ready += 1;
                    st.kv_usage += s.engine.kv_usage();
                }
            }
            st.waiting += s.engine.waiting() as u64;
            st.running += s.engine.running() as u64;
            st.backlogged += u64::from(s.engine.waiting() > 0);
        }
        if st.ready > 0 {
            st.kv_usage /= st.ready as f64;
        }
        st
    }

    /// The policy's decision at `now`, carried out.
    fn decide(&mut self, now: f64, policy: &mut dyn Policy, heap: &mut Heap) -> Result<()> {
        let state = self.fleet_state();
        let s = &self.cfg.scaling;
        let want = policy
            .desired(now, s, &state)?
            .clamp(s.min_endpoints, s.max_endpoints);
        let active = state.ready + state.starting;
        for _ in active..want {
            let i = self.free_slot();
            if self.cfg.startup_s > 0.0 {
                let ready_at = now + self.cfg.startup_s;
                self.set_phase(i, Phase::Starting { ready_at }, now);
                self.starting.push_back((ready_at, i));
            } else {
                self.set_phase(i, Phase::Starting { ready_at: now }, now);
                self.become_ready(i, now, heap)?;
            }
        }
        let mut remove = active.saturating_sub(want);
        while remove > 0 {
            let Some((_, i)) = self.starting.pop_back() else {
                break;
            };
            self.set_phase(i, Phase::Stopped, now);
            remove -= 1;
        }
        if remove > 0 {
            let mut ready: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].phase == Phase::Ready)
                .collect();
            ready.sort_by_key(|&i| (self.slots[i].engine.load(), i));
            for &i in ready.iter().take(remove as usize) {
                let empty = self.slots[i].engine.load() == 0;
                self.set_phase(i, Phase::Draining, now);
                if empty {
                    self.set_phase(i, Phase::Stopped, now);
                }
            }
        }
        let st = self.fleet_state();
        self.report.ticks.push(Tick {
            time: now,
            desired: want,
            ready: st.ready,
            starting: st.starting,
            draining: st.draining,
            waiting: state.waiting,
        });
        let running = st.ready + st.starting + st.draining;
        self.report.peak_endpoints = self.report.peak_endpoints.max(running);
        Ok(())
    }

    fn become_ready(&mut self, i: usize, now: f64, heap: &mut Heap) -> Result<()> {
        self.set_phase(i, Phase::Ready, now);
        while let Some(k) = self.held.pop_front() {
            self.dispatch(k, now, heap)?;
        }
        Ok(())
    }

    /// Request `k` to a ready endpoint chosen by the picker, at `now`; held
    /// at the router when none is ready.
    fn dispatch(&mut self, k: usize, now: f64, heap: &mut Heap) -> Result<()> {
        if !self.picker.states.iter().any(|s| s.healthy) {
            self.held.push_back(k);
            return Ok(());
        }
        for (slot, st) in self.slots.iter().zip(&mut self.picker.states) {
            let e = &slot.engine;
            st.waiting = Some(e.waiting() as f64);
            st.running = Some(e.running() as f64);
            st.kv_usage = Some(e.kv_usage());
            st.in_flight = e.load() as u64;
            st.dispatched_since_scrape = 0;
        }
        let r = &self.requests[k];
        let req = PickRequest {
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            now,
            ..PickRequest::default()
        };
        let i = self
            .picker
            .start(&req)?
            .ok_or_else(|| invalid("the picker chose no endpoint"))?;
        self.report.endpoint[k] = i as i64;
        self.slots[i]
            .engine
            .enqueue(k, r.input_tokens, r.output_tokens, (0, 0));
        self.wake(i, now, heap);
        Ok(())
    }

    /// Wakes endpoint `i` at `now` for what was just queued on it: an idle
    /// one starts iterating then (after every arrival of the same instant),
    /// a running stretch is cut at its next iteration boundary.
    fn wake(&mut self, i: usize, now: f64, heap: &mut Heap) {
        let e = &mut self.slots[i].engine;
        let wake = if e.busy {
            e.interrupt(now)
        } else {
            e.busy = true;
            Some(now)
        };
        if let Some(t) = wake {
            self.version[i] += 1;
            heap.push(std::cmp::Reverse((t.to_bits(), i, self.version[i])));
        }
    }

    fn iteration_end(
        &mut self,
        i: usize,
        now: f64,
        heap: &mut Heap,
        policy: &mut dyn Policy,
    ) -> Result<()> {
        let window = (0.0, self.cfg.horizon_s);
        let slot = &mut self.slots[i];
        slot.engine.end_iteration(window, &self.blocks);
        let events = std::mem::take(&mut slot.engine.pending);
        for e in events {
            match e {
                Event::Admitted { .. } => {}
                Event::FirstToken { request, time } => {
                    self.report.ttft[request] = time - self.requests[request].arrival;
                }
                Event::Finished { request, time } => {
                    let r = &self.requests[request];
                    let ttft = self.report.ttft[request];
                    self.report.e2e[request] = time - r.arrival;
                    if r.output_tokens > 1 {
                        self.report.tpot[request] =
                            (time - r.arrival - ttft) / (r.output_tokens - 1) as f64;
                    }
                    let s = &self.cfg.scaling;
                    let tpot = self.report.tpot[request];
                    self.report.met[request] =
                        ttft <= s.slo_ttft_s && !s.slo_tpot_s.is_some_and(|t| tpot > t);
                    let done = PickRequest {
                        now: time,
                        ..PickRequest::default()
                    };
                    self.picker
                        .complete(i, &done, r.input_tokens, r.output_tokens)?;
                    policy.observe(time, r.input_tokens, r.output_tokens)?;
                }
            }
        }
        let timing = self.cfg.pool.timing.as_ref();
        let slot = &mut self.slots[i];
        match slot.engine.step(now, timing, window, &self.blocks) {
            Some(dt) => {
                slot.engine.busy = true;
                self.version[i] += 1;
                heap.push(std::cmp::Reverse((
                    (now + dt).to_bits(),
                    i,
                    self.version[i],
                )));
            }
            None => {
                slot.engine.busy = false;
                if slot.phase == Phase::Draining && slot.engine.load() == 0 {
                    self.set_phase(i, Phase::Stopped, now);
                }
            }
        }
        Ok(())
    }

    fn main(&mut self, policy: &mut dyn Policy, progress: &AtomicU64) -> Result<()> {
        let mut heap = Heap::new();
        let mut next = 0;
        let mut tick = 1u64;
        loop {
            let t_ready = self.starting.front().map(|&(t, _)| t);
            let t_tick = tick as f64 * self.cfg.period_s;
            let t_tick = (t_tick <= self.cfg.horizon_s).then_some(t_tick);
            let t_arrival = self.requests.get(next).map(|r| r.arrival);
            let t_end = heap
                .peek()
                .map(|std::cmp::Reverse((t, _, _))| f64::from_bits(*t));
            // Ties: an endpoint becomes ready, then the policy decides, then
            // requests arrive, then iterations end.
            let times = [t_ready, t_tick, t_arrival, t_end];
            let Some((which, now)) = times
                .iter()
                .enumerate()
                .filter_map(|(k, t)| t.map(|t| (k, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
            else {
                break;
            };
            match which {
                0 => {
                    if let Some((_, i)) = self.starting.pop_front() {
                        self.become_ready(i, now, &mut heap)?;
                    }
                }
                1 => {
                    self.decide(now, policy, &mut heap)?;
                    tick += 1;
                }
                2 => {
                    policy.arrive(now)?;
                    self.dispatch(next, now, &mut heap)?;
                    next += 1;
                    if next % 1024 == 0 {
                        progress.store(next as u64, Ordering::Relaxed);
                    }
                }
                _ => {
                    if let Some(std::cmp::Reverse((_, i, v))) = heap.pop() {
                        if v == self.version[i] {
                            self.iteration_end(i, now, &mut heap, policy)?;
                        }
                    }
                }
            }
        }
        progress.store(self.requests.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn finish(mut self) -> Result<ScaleReport> {
        // Endpoints still running count to the horizon (the run's end is not a stop).
        for slot in &self.slots {
            if slot.phase != Phase::Stopped {
                self.report.gpu_seconds += self.gpu_seconds(slot.since, self.cfg.horizon_s);
            }
        }
        let (mut counted, mut met) = (0u64, 0u64);
        for (m, x) in self.report.met.iter().zip(&self.report.excluded) {
            if !x {
                counted += 1;
                met += u64::from(*m);
            }
        }
        self.report.attainment = if counted > 0 {
            met as f64 / counted as f64
        } else {
            f64::NAN
        };
        Ok(self.report)
    }
}
