//! Autoscaling from the capacity model (issue 26; Cunningham 2026: "token
//! pools authorize both admission and autoscaling from the same capacity
//! model"): each pool's desired endpoint count, every period, from the
//! traffic routecore sees, sized by the planner's engine model.
//!
//! The pure half, no I/O and no runtime (the data plane and the simulator
//! wrap it): [`LiveWindow`] keeps the live workload of a pool and of each
//! of its entitlements; [`sizing::target`] turns it, the demand flow
//! control holds and the entitlements' promised capacity into a count
//! within the pool's bounds; [`Damper`] keeps the count from flapping.
//! [`Autoscaler`] holds them for every pool of an [`AutoscaleConfig`].
//! Time is the caller's `now` (seconds, monotonic).

pub mod config;
pub mod damping;
pub mod histogram;
pub mod sizing;
pub mod trend;
pub mod window;

#[cfg(test)]
mod tests;

pub use config::{AutoscaleConfig, PoolScaling};
pub use damping::{Damper, Damping};
pub use histogram::LogHistogram;
pub use sizing::{Desired, Forecast, PoolDemand, Reason, Target};
pub use window::{LiveWindow, LiveWorkload, Percentiles};

use crate::error::{invalid, unknown, Result};
use crate::profile::Profile;

#[derive(Debug, Clone)]
struct PoolState {
    profile: Profile,
    live: LiveWindow,
    entitlements: Vec<LiveWindow>,
    damper: Damper,
    hint: Option<u64>,
}

/// The autoscaler of every pool of a config.
#[derive(Debug, Clone)]
pub struct Autoscaler {
    cfg: AutoscaleConfig,
    damping: Damping,
    pools: Vec<PoolState>,
}

impl Autoscaler {
    /// Checks `cfg` and `profiles` (one per pool, in order: the engine of the
    /// pool's endpoints); every pool starts at `min_endpoints` at `now`.
    pub fn new(cfg: AutoscaleConfig, profiles: Vec<Profile>, now: f64) -> Result<Self> {
        cfg.validate()?;
        if profiles.len() != cfg.pools.len() {
            return Err(invalid(format!(
                "autoscale: {} pools but {} profiles",
                cfg.pools.len(),
                profiles.len()
            )));
        }
        let mut pools = Vec::with_capacity(profiles.len());
        for (i, (p, profile)) in cfg.pools.iter().zip(profiles).enumerate() {
            profile.validate()?;
            if profile.h_ref_tokens.is_some() {
                return Err(invalid(format!(
                    "autoscale.pools[{i}]: the engine model needs a profile without \
                     h_ref_tokens"
                )));
            }
            if profile.slots(p.context)? == 0 {
                return Err(invalid(format!(
                    "autoscale.pools[{i}].context: no sequence of {} tokens fits one \
                     endpoint's KV memory",
                    p.context
                )));
            }
            let window = || LiveWindow::new(cfg.window_s, cfg.sub_windows, profile.c_chunk, now);
            pools.push(PoolState {
                live: window()?,
                entitlements: p
                    .entitlements
                    .iter()
                    .map(|_| window())
                    .collect::<Result<_>>()?,
                damper: Damper::new(p.min_endpoints),
                hint: None,
                profile,
            });
        }
        let damping = cfg.damping();
        Ok(Self {
            cfg,
            damping,
            pools,
        })
    }

    pub fn config(&self) -> &AutoscaleConfig {
        &self.cfg
    }

    /// Pool `pool` runs `endpoints` now (a fleet already running, or a
    /// restart, resumes from its size instead of `min_endpoints`): damping
    /// counts from it. Within the pool's bounds.
    pub fn set_current(&mut self, pool: usize, endpoints: u64) -> Result<()> {
        let p = self.pool_cfg(pool)?;
        if !(p.min_endpoints..=p.max_endpoints).contains(&endpoints) {
            return Err(invalid(format!(
                "pool {:?}: {endpoints} endpoints is outside [{}, {}]",
                p.name, p.min_endpoints, p.max_endpoints
            )));
        }
        self.pools[pool].damper = Damper::new(endpoints);
        Ok(())
    }

    /// The dense id of pool `name`.
    pub fn pool_id(&self, name: &str) -> Result<usize> {
        self.cfg
            .pools
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| unknown("pool", name))
    }

    /// The dense id of entitlement `name` of pool `pool`.
    pub fn entitlement_id(&self, pool: usize, name: &str) -> Result<usize> {
        self.pool_cfg(pool)?
            .entitlements
            .iter()
            .position(|e| e == name)
            .ok_or_else(|| unknown("entitlement", name))
    }

    fn pool_cfg(&self, pool: usize) -> Result<&PoolScaling> {
        self.cfg
            .pools
            .get(pool)
            .ok_or_else(|| invalid(format!("pool id {pool} out of range")))
    }

    /// Counts a request arriving at `now` in its pool (and its
    /// entitlement's window): the rate is the arrivals' once any is counted
    /// (see [`LiveWindow::arrive`]). Allocation-free; an error changes
    /// nothing.
    pub fn arrive(&mut self, pool: usize, entitlement: Option<usize>, now: f64) -> Result<()> {
        crate::error::finite("now", now)?;
        let state = self
            .pools
            .get_mut(pool)
            .ok_or_else(|| invalid(format!("pool id {pool} out of range")))?;
        if let Some(e) = entitlement {
            state
                .entitlements
                .get_mut(e)
                .ok_or_else(|| invalid(format!("entitlement id {e} out of range")))?
                .arrive(now)?;
        }
        state.live.arrive(now)
    }

    /// Counts a finished request of `prompt` and `output` tokens in its pool
    /// (and its entitlement's window). Allocation-free; an error changes
    /// nothing.
    pub fn observe(
        &mut self,
        pool: usize,
        entitlement: Option<usize>,
        now: f64,
        prompt: u64,
        output: u64,
    ) -> Result<()> {
        let state = self
            .pools
            .get_mut(pool)
            .ok_or_else(|| invalid(format!("pool id {pool} out of range")))?;
        if let Some(e) = entitlement {
            let window = state
                .entitlements
                .get_mut(e)
                .ok_or_else(|| invalid(format!("entitlement id {e} out of range")))?;
            window.observe(now, prompt, output)?;
        }
        // The pool's window accepts what the entitlement's did.
        state.live.observe(now, prompt, output)
    }

    /// [`Self::observe`] for many requests (`now`, `prompt`, `output` of
    /// equal length), all checked before any is counted.
    pub fn observe_many(
        &mut self,
        pool: usize,
        entitlement: Option<usize>,
        now: &[f64],
        prompt: &[u64],
        output: &[u64],
    ) -> Result<()> {
        if prompt.len() != now.len() || output.len() != now.len() {
            return Err(invalid(format!(
                "now, prompt_tokens and output_tokens differ in length: {}, {}, {}",
                now.len(),
                prompt.len(),
                output.len()
            )));
        }
        self.pool_cfg(pool)?;
        if let Some(e) = entitlement {
            if e >= self.pools[pool].entitlements.len() {
                return Err(invalid(format!("entitlement id {e} out of range")));
            }
        }
        for ((&t, &p), &o) in now.iter().zip(prompt).zip(output) {
            window::check(t, p, o)?;
        }
        for ((&t, &p), &o) in now.iter().zip(prompt).zip(output) {
            self.observe(pool, entitlement, t, p, o)?;
        }
        Ok(())
    }

    /// The live workload of a pool (or of one of its entitlements) at `now`.
    pub fn live(
        &mut self,
        pool: usize,
        entitlement: Option<usize>,
        now: f64,
    ) -> Result<LiveWorkload> {
        let q = self.cfg.quantile;
        let state = self
            .pools
            .get_mut(pool)
            .ok_or_else(|| invalid(format!("pool id {pool} out of range")))?;
        match entitlement {
            None => state.live.live(now, q),
            Some(e) => state
                .entitlements
                .get_mut(e)
                .ok_or_else(|| invalid(format!("entitlement id {e} out of range")))?
                .live(now, q),
        }
    }

    /// One sizing step at `now`: every pool's desired count, damped, with
    /// its explanation. `demand` has one entry per pool (empty: none); a
    /// pool whose ready endpoints it gives has those of its count still
    /// starting cancelled as soon as its target no longer needs them. An
    /// error (bad demand, a `now` that is not a number) changes nothing.
    pub fn step(&mut self, now: f64, demand: &[PoolDemand]) -> Result<Vec<Desired>> {
        crate::error::finite("now", now)?;
        if !demand.is_empty() && demand.len() != self.pools.len() {
            return Err(invalid(format!(
                "demand has {} entries for {} pools",
                demand.len(),
                self.pools.len()
            )));
        }
        for (d, p) in demand.iter().zip(&self.cfg.pools) {
            d.validate(&p.name)?;
        }
        // Size every pool first, then commit: an error leaves no pool moved.
        let (q, drain) = (self.cfg.quantile, self.cfg.queue_drain_s());
        let mut targets = Vec::with_capacity(self.pools.len());
        for (i, (state, p)) in self.pools.iter_mut().zip(&self.cfg.pools).enumerate() {
            let live = state.live.live(now, q)?;
            let d = demand.get(i).copied().unwrap_or_default();
            let window = &state.live;
            let chunks = |out: &mut Vec<(u64, f64)>| window.chunk_distribution(out);
            targets.push(sizing::target(
                p,
                &state.profile,
                q,
                drain,
                &live,
                &chunks,
                d,
                self.cfg.forecast(),
                state.hint,
            )?);
        }
        let mut out = Vec::with_capacity(targets.len());
        for (i, ((state, p), t)) in self
            .pools
            .iter_mut()
            .zip(&self.cfg.pools)
            .zip(targets)
            .enumerate()
        {
            if t.model_endpoints > 0 {
                state.hint = Some(t.model_endpoints);
            }
            // Starting endpoints are cancelled down to the ready ones and
            // what the forecast, noise included, still needs.
            let cancel_to = demand
                .get(i)
                .and_then(|d| d.ready_endpoints)
                .map(|ready| ready.max(t.keep_endpoints));
            out.push(Desired {
                pool: p.name.clone(),
                endpoints: state
                    .damper
                    .step(now, t.endpoints, cancel_to, &self.damping),
                target: t,
            });
        }
        Ok(out)
    }
}
