//! The autoscaling policies the simulator compares, behind one trait:
//!
//! - [`Fixed`]: a static fleet (peak-provisioned: the engine model's count
//!   at the profile's highest rate);
//! - [`Hindsight`]: the reference, a fleet sized for each moment knowing the
//!   rate to come: at every period, the engine model's count for the highest
//!   true rate until the next decision's endpoints are ready;
//! - [`Saturation`]: the WVA-style rule on what the engines report: one step
//!   up when the ready endpoints are saturated (KV-cache use or slot
//!   occupancy above `up`, or requests waiting above `queue_up` per
//!   endpoint), one step down when they are below `down` with nothing
//!   waiting, damped as HPA damps any metric;
//! - [`ModelBased`]: routecore's [`Autoscaler`], the same code the data plane
//!   runs: every finished request observed, the pool sized every period by
//!   the planner's engine model from the live window (the requests held at
//!   the router as queued demand, those queued in an engine making its
//!   endpoint busy; the ready endpoints told, so the starting ones a lower
//!   forecast no longer needs are cancelled), damped.

use std::collections::HashMap;

use serde::Deserialize;

use crate::autoscale::{
    sizing, AutoscaleConfig, Autoscaler, Damper, Damping, LiveWindow, LiveWorkload, PoolDemand,
    PoolScaling,
};
use crate::error::{invalid, positive, Result};
use crate::profile::Profile;

use super::super::profile::RateProfile;
use super::super::SimRequest;

/// What the policy sees of the pool at a decision: what a controller reads
/// from the endpoints' metrics and its own bookkeeping.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetState {
    pub ready: u64,
    pub starting: u64,
    pub draining: u64,
    /// Requests waiting in the engines' queues (and at the router while no
    /// endpoint is ready).
    pub waiting: u64,
    /// Of them, those held at the router (any endpoint may take them).
    pub held: u64,
    /// Endpoints (ready or draining) with requests waiting in their queue.
    pub backlogged: u64,
    /// Requests the engines run.
    pub running: u64,
    /// Mean KV-cache use of the ready endpoints, in [0, 1].
    pub kv_usage: f64,
    /// Sequence slots of one endpoint.
    pub max_num_seqs: u64,
}

impl FleetState {
    /// The ready endpoints' saturation in [0, 1]: the higher of their mean
    /// KV-cache use and their slot occupancy (0 with none ready).
    pub fn saturation(&self) -> f64 {
        if self.ready == 0 {
            return 0.0;
        }
        let slots = (self.ready * self.max_num_seqs) as f64;
        self.kv_usage.max(self.running as f64 / slots)
    }
}

/// An autoscaling policy: told of every finished request, asked every
/// period how many endpoints the pool should run (ready or starting).
pub trait Policy {
    fn name(&self) -> &'static str;

    /// A request arrived at `now`.
    fn arrive(&mut self, _now: f64) -> Result<()> {
        Ok(())
    }

    /// A request of `prompt` and `output` tokens finished at `now`.
    fn observe(&mut self, _now: f64, _prompt: u64, _output: u64) -> Result<()> {
        Ok(())
    }

    /// The endpoint count from `now` on (the caller clamps it to the pool's
    /// bounds).
    fn desired(&mut self, now: f64, pool: &PoolScaling, state: &FleetState) -> Result<u64>;
}

/// A fleet that never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fixed(pub u64);

impl Policy for Fixed {
    fn name(&self) -> &'static str {
        "static"
    }

    fn desired(&mut self, _: f64, _: &PoolScaling, _: &FleetState) -> Result<u64> {
        Ok(self.0)
    }
}

/// The engine model's count for a rate, with the whole workload's token
/// distribution: the sizing step of [`crate::autoscale::sizing::target`]
/// fed with a window that saw every request.
#[derive(Debug, Clone)]
pub struct Sizer {
    pool: PoolScaling,
    profile: Profile,
    quantile: f64,
    live: LiveWorkload,
    chunks: Vec<(u64, f64)>,
    memo: HashMap<u64, u64>,
    hint: Option<u64>,
}

impl Sizer {
    /// For pool 0 of `cfg` (its engines' `profile`) and `requests`' lengths.
    pub fn new(cfg: &AutoscaleConfig, profile: &Profile, requests: &[SimRequest]) -> Result<Self> {
        let pool = cfg
            .pools
            .first()
            .ok_or_else(|| invalid("autoscale: one pool is needed"))?
            .clone();
        let mut window = LiveWindow::new(1.0, 1, profile.c_chunk, 0.0)?;
        for r in requests {
            window.observe(0.0, r.input_tokens, r.output_tokens)?;
        }
        let live = window.live(0.0, cfg.quantile)?;
        let mut chunks = Vec::new();
        window.chunk_distribution(&mut chunks);
        Ok(Self {
            pool,
            profile: profile.clone(),
            quantile: cfg.quantile,
            live,
            chunks,
            memo: HashMap::new(),
            hint: None,
        })
    }

    /// The count (within the pool's bounds) for `rate` requests per second.
    pub fn endpoints(&mut self, rate: f64) -> Result<u64> {
        if let Some(&n) = self.memo.get(&rate.to_bits()) {
            return Ok(n);
        }
        let live = LiveWorkload { rate, ..self.live };
        let chunks = &self.chunks;
        let t = sizing::target(
            &self.pool,
            &self.profile,
            self.quantile,
            1.0,
            &live,
            &|out: &mut Vec<(u64, f64)>| out.extend_from_slice(chunks),
            PoolDemand::default(),
            None,
            self.hint,
        )?;
        if t.model_endpoints > 0 {
            self.hint = Some(t.model_endpoints);
        }
        self.memo.insert(rate.to_bits(), t.endpoints);
        Ok(t.endpoints)
    }
}

/// The fleet sized for each moment in hindsight: at `now`, the count for the
/// highest true rate over `[now, now + lead_s]` (sampled every `resolution_s`
/// and at every rise), where `lead_s` is the start-up delay plus a period:
/// the endpoints it starts are ready when the rate they are for arrives, and
/// it drains none that the rate until the next decision still needs.
#[derive(Debug, Clone)]
pub struct Hindsight {
    sizer: Sizer,
    rates: RateProfile,
    lead_s: f64,
    resolution_s: f64,
}

impl Hindsight {
    pub fn new(sizer: Sizer, rates: RateProfile, lead_s: f64) -> Result<Self> {
        crate::error::non_negative("lead_s", lead_s)?;
        Ok(Self {
            sizer,
            rates,
            lead_s,
            resolution_s: 1.0,
        })
    }

    /// The highest rate in `[a, b]`.
    pub fn highest_rate(&self, a: f64, b: f64) -> f64 {
        let steps = ((b - a) / self.resolution_s).ceil().max(0.0) as u64;
        let sampled = (0..=steps).map(|k| (a + k as f64 * self.resolution_s).min(b));
        let rises = self.rates.rises(b).into_iter().filter(|&t| t >= a);
        sampled
            .chain(rises)
            .map(|t| self.rates.rate(t))
            .fold(0.0, f64::max)
    }
}

impl Policy for Hindsight {
    fn name(&self) -> &'static str {
        "hindsight"
    }

    fn desired(&mut self, now: f64, _: &PoolScaling, _: &FleetState) -> Result<u64> {
        let rate = self.highest_rate(now, now + self.lead_s);
        self.sizer.endpoints(rate)
    }
}

/// The saturation rule's thresholds (as JSON: `{"up": 0.8, "queue_up": 2,
/// "down": 0.5, "step_percent": 10}`, unknown keys refused).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaturationRule {
    /// Scale up when the saturation is at or above this (0.8)...
    pub up: f64,
    /// ... or when the requests waiting per ready endpoint are at or above
    /// this (2).
    pub queue_up: f64,
    /// Scale down when the saturation is below this (0.5) and nothing waits.
    pub down: f64,
    /// Endpoints added or removed at a step: the larger of 1 and this
    /// percentage of the count (10 %).
    pub step_percent: f64,
}

impl Default for SaturationRule {
    fn default() -> Self {
        Self {
            up: 0.8,
            queue_up: 2.0,
            down: 0.5,
            step_percent: 10.0,
        }
    }
}

impl SaturationRule {
    pub fn validate(&self) -> Result<()> {
        for (k, v) in [("up", self.up), ("down", self.down)] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(invalid(format!(
                    "saturation.{k} must be in (0, 1], got {v}"
                )));
            }
        }
        if self.down >= self.up {
            return Err(invalid(format!(
                "saturation.down ({}) must be below saturation.up ({})",
                self.down, self.up
            )));
        }
        positive("saturation.queue_up", self.queue_up)?;
        positive("saturation.step_percent", self.step_percent)?;
        Ok(())
    }
}

/// The WVA-style saturation rule, through the same damping as the
/// model-based policy (HPA applies its behavior to any metric).
#[derive(Debug, Clone)]
pub struct Saturation {
    rule: SaturationRule,
    damper: Damper,
    damping: Damping,
}

impl Saturation {
    /// Starting at `current` endpoints, damped as `cfg` says.
    pub fn new(rule: SaturationRule, cfg: &AutoscaleConfig, current: u64) -> Result<Self> {
        rule.validate()?;
        cfg.validate()?;
        Ok(Self {
            rule,
            damper: Damper::new(current),
            damping: cfg.damping(),
        })
    }
}

impl Policy for Saturation {
    fn name(&self) -> &'static str {
        "saturation"
    }

    fn desired(&mut self, now: f64, pool: &PoolScaling, state: &FleetState) -> Result<u64> {
        let current = self.damper.current();
        let step = ((current as f64 * self.rule.step_percent / 100.0).ceil() as u64).max(1);
        let per_endpoint = state.waiting as f64 / state.ready.max(1) as f64;
        let saturation = state.saturation();
        let target = if saturation >= self.rule.up || per_endpoint >= self.rule.queue_up {
            current.saturating_add(step)
        } else if saturation < self.rule.down && state.waiting == 0 {
            current.saturating_sub(step)
        } else {
            current
        };
        let target = target.clamp(pool.min_endpoints, pool.max_endpoints);
        Ok(self.damper.step(now, target, None, &self.damping))
    }
}

/// routecore's policy: the data plane's [`Autoscaler`] in the loop, told of
/// every arrival and every finished request, deciding from the first period
/// as the data plane does (its window's rate is the arrivals': a young
/// window reads the rate that comes, not the few requests a fleet has
/// finished yet).
#[derive(Debug, Clone)]
pub struct ModelBased {
    autoscaler: Autoscaler,
    /// Requests per second one endpoint serves within the SLO, by the last
    /// sizing (its rate over the model's count); None before one.
    per_endpoint_rate: Option<f64>,
}

impl ModelBased {
    /// `cfg` with one pool whose engines are `profile`, running `current`
    /// endpoints at 0 s.
    pub fn new(cfg: AutoscaleConfig, profile: Profile, current: u64) -> Result<Self> {
        if cfg.pools.len() != 1 {
            return Err(invalid(format!(
                "autoscale: the simulator scales one pool, got {}",
                cfg.pools.len()
            )));
        }
        let mut autoscaler = Autoscaler::new(cfg, vec![profile], 0.0)?;
        autoscaler.set_current(0, current)?;
        Ok(Self {
            autoscaler,
            per_endpoint_rate: None,
        })
    }
}

impl Policy for ModelBased {
    fn name(&self) -> &'static str {
        "routecore"
    }

    fn arrive(&mut self, now: f64) -> Result<()> {
        self.autoscaler.arrive(0, None, now)
    }

    fn observe(&mut self, now: f64, prompt: u64, output: u64) -> Result<()> {
        self.autoscaler.observe(0, None, now, prompt, output)
    }

    /// The queued demand is the requests held at the router (any endpoint
    /// takes them); those queued in an engine are served by it alone, so
    /// endpoints started for them would serve none of them: the endpoints
    /// holding them are busy instead, each for its share of the backlog
    /// over what one endpoint serves in the queue's horizon, at most the
    /// endpoints that hold one (before the first sizing, with no rate per
    /// endpoint known, they count as queued). The data plane's
    /// flow-control queue is at the router.
    fn desired(&mut self, now: f64, _: &PoolScaling, state: &FleetState) -> Result<u64> {
        let in_engines = state.waiting.saturating_sub(state.held) as f64;
        let drain_s = self.autoscaler.config().queue_drain_s();
        let (queued, busy) = match self.per_endpoint_rate {
            Some(mu) => (
                state.held as f64,
                (in_engines / (mu * drain_s)).min(state.backlogged as f64),
            ),
            None => (state.waiting as f64, 0.0),
        };
        let demand = PoolDemand {
            queued_requests: queued,
            promised_tokens_per_s: 0.0,
            busy_endpoints: busy,
            ready_endpoints: Some(state.ready),
        };
        let d = self.autoscaler.step(now, &[demand])?;
        let t = &d[0].target;
        if t.model_endpoints > 0 {
            self.per_endpoint_rate = Some(t.rate / t.model_endpoints as f64);
        }
        Ok(d[0].endpoints)
    }
}
