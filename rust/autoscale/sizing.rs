//! The sizing step of one pool: its live workload, the demand flow control
//! holds and the entitlements' promised capacity become a desired endpoint
//! count through the planner's engine model ([`crate::planner::size_engine`]:
//! one model for the offline plan and the live fleet; one planner "GPU" is
//! one endpoint of the pool's profile).
//!
//! The rate sized for is `max(observed + queued / queue_drain_s, promised)`:
//! the window's arrival rate (with a [`Forecast`], the highest rate its
//! trend line reaches from now to `ahead_s` past now: `level + trend
//! ahead_s` on a rise, `level` on a fall, where `level` is the line's rate
//! now; the line is fitted after a level shift when the window holds one,
//! so a step is a new level, not a steep ramp ([`super::trend`]); at least
//! 0 and at most `max_ratio` times the newest sub-window's rate), plus the
//! requests flow control holds, as work drained over `queue_drain_s` (the
//! horizon new endpoints need to be ready and serve it), and at least the
//! entitlements' promised tokens per second over the window's mean tokens
//! per request (the paper's nominal cost `n_in + n_out`). With no traffic in
//! the window there is no token distribution to size from: the pool gets
//! `min_endpoints`.

use std::fmt;

use crate::error::{non_negative, Result};
use crate::planner::{size_engine, Binding, BuildChunks, EngineLoad, EngineSlo};
use crate::profile::Profile;

use super::config::{PoolScaling, MAX_ENDPOINTS};
use super::window::{LiveWorkload, Percentiles};

/// What a sizing step is told beside the live window.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PoolDemand {
    /// Requests flow control holds for the pool now.
    pub queued_requests: f64,
    /// The entitlements' promised capacity, tokens per second (a floor).
    pub promised_tokens_per_s: f64,
    /// Endpoints that serve no new request over the queue's horizon, busy
    /// with a backlog queued in them (only they can serve it): added to
    /// the model's count, rounded (0 in the data plane, whose queue is at
    /// the router).
    pub busy_endpoints: f64,
    /// Endpoints of the pool ready now, when known: the rest of its count
    /// is still starting, and a step cancels those its target does not
    /// need without waiting for the scale-down delay ([`super::Damper`]).
    pub ready_endpoints: Option<u64>,
}

impl PoolDemand {
    pub fn validate(&self, pool: &str) -> Result<()> {
        non_negative(
            &format!("queued_requests of pool {pool:?}"),
            self.queued_requests,
        )?;
        non_negative(
            &format!("promised_tokens_per_s of pool {pool:?}"),
            self.promised_tokens_per_s,
        )?;
        non_negative(
            &format!("busy_endpoints of pool {pool:?}"),
            self.busy_endpoints,
        )?;
        Ok(())
    }
}

/// How far ahead a sizing step forecasts the rate, and the bound on it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Forecast {
    /// Seconds past now.
    pub ahead_s: f64,
    /// The forecast is at most this multiple of the newest sub-window's rate.
    pub max_ratio: f64,
}

impl Forecast {
    /// The highest rate `live`'s trend line reaches from now to `ahead_s`
    /// past now (a count must cover every moment until the endpoints it
    /// starts are ready: on a fall, the rate now), within `[0, max_ratio *
    /// live.newest_rate]`.
    pub fn rate(&self, live: &LiveWorkload) -> f64 {
        self.rate_within(live, 0.0)
    }

    /// The forecast `z` standard errors of the arrivals' noise above
    /// ([`super::trend::Noise`]), within the same bounds.
    fn rate_within(&self, live: &LiveWorkload, z: f64) -> f64 {
        let now = live.level + z * live.noise.se(0.0);
        let ahead = live.level + live.trend * self.ahead_s + z * live.noise.se(self.ahead_s);
        now.max(ahead)
            .min(self.max_ratio * live.newest_rate)
            .max(0.0)
    }
}

/// How many standard errors of the arrivals' noise above the forecast a
/// starting endpoint is kept for: one is cancelled only once the rate, 2
/// sigma high, no longer needs it (a noisy forecast dipping for one step
/// would otherwise cancel endpoints the next step starts again, each
/// restart a start-up later).
pub const KEEP_Z: f64 = 2.0;

/// The rate `live` forecasts (`forecast`, else the window's rate),
/// `z` standard errors of its noise high.
fn forecast_at(live: &LiveWorkload, forecast: Option<Forecast>, z: f64) -> f64 {
    match forecast {
        Some(f) => f.rate_within(live, z),
        None => live.rate + z * (live.rate / live.span_s).sqrt(),
    }
}

/// Why the target is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// No request in the window: `min_endpoints`.
    NoTraffic,
    /// The model's count, within the bounds.
    Model,
    /// The model asks for fewer than `min_endpoints`.
    Min,
    /// The model asks for more than `max_endpoints`.
    Max,
    /// No count meets the SLO (the binding constraint says why): `max_endpoints`.
    SloUnreachable,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Self::NoTraffic => "no-traffic",
            Self::Model => "model",
            Self::Min => "min",
            Self::Max => "max",
            Self::SloUnreachable => "slo-unreachable",
        }
    }
}

/// The undamped answer of one sizing step and what explains it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target {
    /// Within `[min_endpoints, max_endpoints]`.
    pub endpoints: u64,
    /// The count for the forecast [`KEEP_Z`] standard errors of its noise
    /// high, within the bounds and at least `endpoints`: the endpoints
    /// still starting beyond it are cancelled at once.
    pub keep_endpoints: u64,
    /// The engine model's count (0 with no traffic).
    pub model_endpoints: u64,
    pub reason: Reason,
    /// What sets the model's count (or what no count satisfies).
    pub binding: Binding,
    /// The rates: observed in the window, from the queue, promised, sized for.
    pub observed_rate: f64,
    /// The window's trend (req/s per s) and the rate it forecasts (the
    /// observed rate without `forecast_s`).
    pub trend: f64,
    pub forecast_rate: f64,
    pub queued_rate: f64,
    pub promised_rate: f64,
    pub rate: f64,
    pub prompt_tokens: Percentiles,
    pub output_tokens: Percentiles,
    /// The model's P99 TTFT and iteration time (TPOT) at its count, seconds.
    pub p99_ttft_s: f64,
    pub t_iter_s: f64,
}

/// Sizes one pool for its live workload `live` (`chunks`: its window's
/// [`super::LiveWindow::chunk_distribution`]) and demand, the rate forecast
/// as `forecast` says when given; `hint` (the last model count) only speeds
/// the search.
#[allow(clippy::too_many_arguments)]
pub fn target(
    pool: &PoolScaling,
    profile: &Profile,
    quantile: f64,
    queue_drain_s: f64,
    live: &LiveWorkload,
    chunks: BuildChunks<'_>,
    demand: PoolDemand,
    forecast: Option<Forecast>,
    hint: Option<u64>,
) -> Result<Target> {
    let observed_rate = live.rate;
    let forecast_rate = forecast_at(live, forecast, 0.0);
    let queued_rate = demand.queued_requests / queue_drain_s;
    let mean_tokens = live.mean_tokens();
    let promised_rate = if mean_tokens > 0.0 {
        demand.promised_tokens_per_s / mean_tokens
    } else {
        0.0
    };
    let rate = (forecast_rate + queued_rate).max(promised_rate);
    let mut t = Target {
        endpoints: pool.min_endpoints,
        keep_endpoints: pool.min_endpoints,
        model_endpoints: 0,
        reason: Reason::NoTraffic,
        binding: Binding::None,
        observed_rate,
        trend: live.trend,
        forecast_rate,
        queued_rate,
        promised_rate,
        rate,
        prompt_tokens: live.prompt_tokens,
        output_tokens: live.output_tokens,
        p99_ttft_s: 0.0,
        t_iter_s: 0.0,
    };
    if live.requests == 0 || rate <= 0.0 {
        return Ok(t);
    }
    let load = EngineLoad::from_moments(
        live.k,
        live.kl,
        live.prompt,
        live.prefill_chunks_q,
        live.prefill_chunks_min,
    );
    let slo = EngineSlo {
        ttft_s: pool.slo_ttft_s,
        tpot_s: pool.slo_tpot_s,
        quantile,
    };
    let n_slots = profile.slots(pool.context)?;
    let size = |rate| {
        size_engine(
            profile,
            pool.context,
            n_slots,
            rate,
            &load,
            slo,
            chunks,
            hint,
        )
    };
    let plan = size(rate)?;
    t.model_endpoints = plan.gpus;
    t.binding = plan.binding;
    t.p99_ttft_s = plan.p99_ttft_s;
    t.t_iter_s = plan.t_iter_s;
    let busy = demand.busy_endpoints.round().min(MAX_ENDPOINTS as f64) as u64;
    let count = plan.gpus.saturating_add(busy);
    (t.endpoints, t.reason) = if !plan.feasible {
        (pool.max_endpoints, Reason::SloUnreachable)
    } else if count > pool.max_endpoints {
        (pool.max_endpoints, Reason::Max)
    } else if count < pool.min_endpoints {
        (pool.min_endpoints, Reason::Min)
    } else {
        (count, Reason::Model)
    };
    let high = (forecast_at(live, forecast, KEEP_Z) + queued_rate).max(promised_rate);
    t.keep_endpoints = if high > rate && plan.feasible && t.endpoints < pool.max_endpoints {
        let keep = size(high)?;
        if keep.feasible {
            keep.gpus
                .saturating_add(busy)
                .clamp(t.endpoints, pool.max_endpoints)
        } else {
            pool.max_endpoints
        }
    } else {
        t.endpoints
    };
    Ok(t)
}

/// One pool's answer of a step: the damped count and its explanation.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    pub pool: String,
    /// The count to run now (the target, damped).
    pub endpoints: u64,
    pub target: Target,
}

impl fmt::Display for Desired {
    /// The explanation, e.g. `pool "short": 12 endpoints (target 14, model
    /// 14, binding slot) for 40.0 req/s (observed 38.5, queued 1.5,
    /// promised 0.0); prompt p50/p99 1024/7936, output p50/p99 200/896`, or
    /// `SLO unreachable: max 20 (binding compute)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.target;
        write!(f, "pool {:?}: {} endpoints (", self.pool, self.endpoints)?;
        match t.reason {
            Reason::NoTraffic => write!(f, "no traffic: min {}", t.endpoints)?,
            Reason::SloUnreachable => write!(
                f,
                "SLO unreachable: max {} (binding {})",
                t.endpoints,
                t.binding.name()
            )?,
            _ => write!(
                f,
                "target {} ({}), model {}, binding {}",
                t.endpoints,
                t.reason.name(),
                t.model_endpoints,
                t.binding.name()
            )?,
        }
        write!(
            f,
            ") for {:.3} req/s (observed {:.3}, queued {:.3}, promised {:.3}); \
             prompt p50/p99 {}/{}, output p50/p99 {}/{}",
            t.rate,
            t.observed_rate,
            t.queued_rate,
            t.promised_rate,
            t.prompt_tokens.p50,
            t.prompt_tokens.p99,
            t.output_tokens.p50,
            t.output_tokens.p99
        )
    }
}
