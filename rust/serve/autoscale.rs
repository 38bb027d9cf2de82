//! The autoscaler in the data plane (issue 26): every lease that ends is
//! observed into its pool's live window (and its tenant's entitlement's),
//! and a thin periodic actor ([`autoscale_forever`]) runs one sizing step
//! of the pure [`crate::autoscale::Autoscaler`] for every pool and publishes
//! the result: Prometheus gauges, [`Scaling::last`] for the RouteCore API,
//! and a warning once per change when a pool is held at its maximum.
//!
//! On when the configuration has an `autoscale` section ([`AutoscaleSpec`]);
//! a reload with the same section keeps the live windows and the damping.
//!
//! Below the engine: it reads the data plane's pools as [`PlanePool`]s and
//! the engine through [`Scaled`] (which the engine implements), so the
//! data plane's spec (`serve::config`) and metrics (`serve::metrics`)
//! compose its section and its gauges without an import circle.

use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::sync::watch;

use super::counters::{FGauge, PoolLabel};
use crate::autoscale::{AutoscaleConfig, Autoscaler, Desired, LiveWorkload, PoolDemand, Reason};
use crate::error::{invalid, Result};
use crate::planner::Binding;
use crate::profile::Profile;

/// The `autoscale` section of the data plane's spec, as the Python control
/// plane writes it from the `routecore serve` file: the pure config, one
/// engine profile per pool, and each pool's promised capacity (the sum of
/// its entitlements' `tokens_per_s`, the sizing's floor).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoscaleSpec {
    pub config: AutoscaleConfig,
    pub profiles: Vec<Profile>,
    #[serde(default)]
    pub promised_tokens_per_s: Vec<f64>,
}

/// A pool of the data plane as the autoscaler reads it: its name and how
/// many endpoint addresses it lists.
#[derive(Debug, Clone, Copy)]
pub struct PlanePool<'a> {
    pub name: &'a str,
    pub endpoints: usize,
}

impl AutoscaleSpec {
    /// Checks the section against the data plane's pools (by name).
    pub fn check(&self, pools: &[&str]) -> Result<()> {
        self.config.validate()?;
        let n = self.config.pools.len();
        if self.profiles.len() != n {
            return Err(invalid(format!(
                "autoscale: {n} pools but {} profiles",
                self.profiles.len()
            )));
        }
        if !self.promised_tokens_per_s.is_empty() && self.promised_tokens_per_s.len() != n {
            return Err(invalid(format!(
                "autoscale: {n} pools but {} promised rates",
                self.promised_tokens_per_s.len()
            )));
        }
        for (i, &r) in self.promised_tokens_per_s.iter().enumerate() {
            crate::error::non_negative(&format!("autoscale.promised_tokens_per_s[{i}]"), r)?;
        }
        for (i, p) in self.config.pools.iter().enumerate() {
            if !pools.contains(&p.name.as_str()) {
                return Err(invalid(format!(
                    "autoscale.pools[{i}].name: unknown pool {:?}",
                    p.name
                )));
            }
        }
        Ok(())
    }
}

/// What the data plane knows of a pool at a sizing step, by its pool
/// index: the demand flow control holds, and its endpoints' readiness.
pub trait PoolSignals {
    fn queued_requests(&self, pool: usize) -> f64;

    /// The pool's endpoints that are ready (None: not known).
    fn ready_endpoints(&self, _pool: usize) -> Option<u64> {
        None
    }
}

/// The running engine as the periodic actor reads it: its autoscaler
/// (None: no `autoscale` section) and its pools' signals.
pub trait Scaled: PoolSignals {
    fn scaling(&self) -> Option<&Scaling>;
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RateLabels {
    pub pool: String,
    pub source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuantileLabels {
    pub pool: String,
    pub quantile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EntitlementLabels {
    pub pool: String,
    pub entitlement: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EntitlementQuantileLabels {
    pub pool: String,
    pub entitlement: String,
    pub quantile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    pub pool: String,
    pub resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub pool: String,
    pub reason: String,
}

/// The gauges of the last sizing step (docs/autoscale.md lists them).
#[derive(Default)]
pub struct Gauges {
    desired: Family<PoolLabel, FGauge>,
    target: Family<PoolLabel, FGauge>,
    model: Family<PoolLabel, FGauge>,
    rate: Family<RateLabels, FGauge>,
    prompt_tokens: Family<QuantileLabels, FGauge>,
    output_tokens: Family<QuantileLabels, FGauge>,
    binding: Family<ResourceLabels, FGauge>,
    reason: Family<ReasonLabels, FGauge>,
    entitlement_rate: Family<EntitlementLabels, FGauge>,
    entitlement_prompt_tokens: Family<EntitlementQuantileLabels, FGauge>,
    entitlement_output_tokens: Family<EntitlementQuantileLabels, FGauge>,
}

const BINDINGS: [Binding; 5] = [
    Binding::None,
    Binding::Compute,
    Binding::Slot,
    Binding::Kv,
    Binding::Prefill,
];
const REASONS: [Reason; 5] = [
    Reason::NoTraffic,
    Reason::Model,
    Reason::Min,
    Reason::Max,
    Reason::SloUnreachable,
];

impl Gauges {
    pub fn register(registry: &mut Registry) -> Self {
        let g = Self::default();
        for (name, help, family) in [
            (
                "routecore_pool_desired_endpoints",
                "Endpoints a pool should run now (the autoscaler's target, damped)",
                &g.desired,
            ),
            (
                "routecore_pool_target_endpoints",
                "The autoscaler's undamped target, within min/max endpoints",
                &g.target,
            ),
            (
                "routecore_pool_model_endpoints",
                "The engine model's count for the pool's SLO, unclamped (0: no traffic)",
                &g.model,
            ),
        ] {
            registry.register(name, help, family.clone());
        }
        registry.register(
            "routecore_pool_arrival_rate",
            "Requests per second a pool is sized for (sized) and its parts: observed \
             in the live window, queued (held by flow control), promised (entitlements)",
            g.rate.clone(),
        );
        registry.register(
            "routecore_pool_prompt_tokens",
            "Prompt tokens per request in the live window, by quantile (0.5, 0.99)",
            g.prompt_tokens.clone(),
        );
        registry.register(
            "routecore_pool_output_tokens",
            "Output tokens per request in the live window, by quantile (0.5, 0.99)",
            g.output_tokens.clone(),
        );
        registry.register(
            "routecore_pool_binding",
            "1 for the resource that sets the pool's model count (none, compute, slot, \
             kv, prefill), else 0",
            g.binding.clone(),
        );
        registry.register(
            "routecore_pool_scaling_reason",
            "1 for why the target is what it is (no-traffic, model, min, max, \
             slo-unreachable), else 0",
            g.reason.clone(),
        );
        registry.register(
            "routecore_entitlement_arrival_rate",
            "Requests per second of an entitlement a scaled pool lists, in its live window",
            g.entitlement_rate.clone(),
        );
        registry.register(
            "routecore_entitlement_prompt_tokens",
            "Prompt tokens per request of an entitlement in its live window, by quantile \
             (0.5, 0.99)",
            g.entitlement_prompt_tokens.clone(),
        );
        registry.register(
            "routecore_entitlement_output_tokens",
            "Output tokens per request of an entitlement in its live window, by quantile \
             (0.5, 0.99)",
            g.entitlement_output_tokens.clone(),
        );
        g
    }

    /// The series of entitlement `entitlement` of `pool`.
    fn entitlement(&self, pool: &str, entitlement: &str) -> EntitlementGauges {
        let quantiles = |f: &Family<EntitlementQuantileLabels, FGauge>| {
            QUANTILES.map(|q| {
                f.get_or_create_owned(&EntitlementQuantileLabels {
                    pool: pool.to_owned(),
                    entitlement: entitlement.to_owned(),
                    quantile: q.into(),
                })
            })
        };
        EntitlementGauges {
            rate: self
                .entitlement_rate
                .get_or_create_owned(&EntitlementLabels {
                    pool: pool.to_owned(),
                    entitlement: entitlement.to_owned(),
                }),
            prompt_tokens: quantiles(&self.entitlement_prompt_tokens),
            output_tokens: quantiles(&self.entitlement_output_tokens),
        }
    }

    /// `pool`'s series, looked up once (made when missing).
    fn pool(&self, pool: &str) -> PoolGauges {
        let p = || pool.to_owned();
        let one = |f: &Family<PoolLabel, FGauge>| f.get_or_create_owned(&PoolLabel { pool: p() });
        let quantiles = |f: &Family<QuantileLabels, FGauge>| {
            QUANTILES.map(|q| {
                f.get_or_create_owned(&QuantileLabels {
                    pool: p(),
                    quantile: q.into(),
                })
            })
        };
        PoolGauges {
            desired: one(&self.desired),
            target: one(&self.target),
            model: one(&self.model),
            rate: RATE_SOURCES.map(|source| {
                self.rate.get_or_create_owned(&RateLabels {
                    pool: p(),
                    source: source.into(),
                })
            }),
            prompt_tokens: quantiles(&self.prompt_tokens),
            output_tokens: quantiles(&self.output_tokens),
            binding: BINDINGS.map(|b| {
                self.binding.get_or_create_owned(&ResourceLabels {
                    pool: p(),
                    resource: b.name().into(),
                })
            }),
            reason: REASONS.map(|r| {
                self.reason.get_or_create_owned(&ReasonLabels {
                    pool: p(),
                    reason: r.name().into(),
                })
            }),
            entitlements: Vec::new(),
        }
    }

    /// Forgets every pool's series (the pools changed).
    fn clear(&self) {
        for f in [&self.desired, &self.target, &self.model] {
            f.clear();
        }
        self.rate.clear();
        self.prompt_tokens.clear();
        self.output_tokens.clear();
        self.binding.clear();
        self.reason.clear();
        self.entitlement_rate.clear();
        self.entitlement_prompt_tokens.clear();
        self.entitlement_output_tokens.clear();
    }
}

/// One entitlement's series of [`Gauges`]: its live window's inputs.
struct EntitlementGauges {
    rate: FGauge,
    /// By [`QUANTILES`].
    prompt_tokens: [FGauge; 2],
    output_tokens: [FGauge; 2],
}

impl EntitlementGauges {
    fn publish(&self, live: &LiveWorkload) {
        self.rate.set(live.rate);
        for (gauges, p) in [
            (&self.prompt_tokens, live.prompt_tokens),
            (&self.output_tokens, live.output_tokens),
        ] {
            gauges[0].set(p.p50 as f64);
            gauges[1].set(p.p99 as f64);
        }
    }
}

const RATE_SOURCES: [&str; 4] = ["sized", "observed", "queued", "promised"];
const QUANTILES: [&str; 2] = ["0.5", "0.99"];

/// One pool's series of [`Gauges`].
struct PoolGauges {
    desired: FGauge,
    target: FGauge,
    model: FGauge,
    /// By [`RATE_SOURCES`].
    rate: [FGauge; 4],
    /// By [`QUANTILES`].
    prompt_tokens: [FGauge; 2],
    output_tokens: [FGauge; 2],
    /// By [`BINDINGS`] and [`REASONS`]: 1 for the one that holds.
    binding: [FGauge; 5],
    reason: [FGauge; 5],
    /// By the pool's entitlements, in order.
    entitlements: Vec<EntitlementGauges>,
}

impl PoolGauges {
    fn publish(&self, d: &Desired) {
        let t = &d.target;
        self.desired.set(d.endpoints as f64);
        self.target.set(t.endpoints as f64);
        self.model.set(t.model_endpoints as f64);
        let rates = [t.rate, t.observed_rate, t.queued_rate, t.promised_rate];
        for (g, v) in self.rate.iter().zip(rates) {
            g.set(v);
        }
        for (gauges, p) in [
            (&self.prompt_tokens, t.prompt_tokens),
            (&self.output_tokens, t.output_tokens),
        ] {
            gauges[0].set(p.p50 as f64);
            gauges[1].set(p.p99 as f64);
        }
        for (g, b) in self.binding.iter().zip(BINDINGS) {
            g.set(f64::from(u8::from(b == t.binding)));
        }
        for (g, r) in self.reason.iter().zip(REASONS) {
            g.set(f64::from(u8::from(r == t.reason)));
        }
    }
}

/// A pool held at its maximum, and why: what its warning names.
pub type AtMax = Option<(Reason, Binding)>;

/// The state a pool's warning follows: `Some` while the target is held at
/// `max_endpoints` (the model asks for more, or no count meets the SLO).
pub fn at_max(d: &Desired) -> AtMax {
    matches!(d.target.reason, Reason::Max | Reason::SloUnreachable)
        .then_some((d.target.reason, d.target.binding))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the actor last published, and each pool's warning state.
#[derive(Default)]
struct Published {
    desired: Vec<Desired>,
    at_max: Vec<AtMax>,
}

/// The autoscaler of one engine (a reload with the same `autoscale`
/// section shares its windows and damping with the previous engine's).
pub struct Scaling {
    spec: AutoscaleSpec,
    autoscaler: Arc<Mutex<Autoscaler>>,
    /// By the data plane's pool index: its autoscaler pool (None: not scaled).
    pools: Vec<Option<usize>>,
    /// By autoscaler pool: the data plane's pool index.
    plane_pools: Vec<usize>,
    /// By autoscaler pool: whether its endpoints' health is its readiness
    /// (the pool lists an address for every endpoint it may run, at least
    /// `max_endpoints`; one address in front of many, a Service, says
    /// nothing of how many are ready).
    readiness: Vec<bool>,
    /// By data-plane pool, then tenant: the tenant's entitlement's window.
    entitlements: Vec<Vec<Option<usize>>>,
    published: Arc<Mutex<Published>>,
    /// By autoscaler pool: its series.
    gauges: Vec<PoolGauges>,
}

impl Scaling {
    /// The autoscaler of `spec` over the data plane's `pools` and its
    /// tenants (each one's entitlement, in the spec's order) at `now`;
    /// `previous` (a reload) hands over its state when its section is the
    /// same.
    pub fn new(
        spec: &AutoscaleSpec,
        pools: &[PlanePool<'_>],
        tenants: &[Option<&str>],
        gauges: Arc<Gauges>,
        previous: Option<&Scaling>,
        now: f64,
    ) -> Result<Self> {
        let names: Vec<&str> = pools.iter().map(|p| p.name).collect();
        spec.check(&names)?;
        let (autoscaler, published) = match previous.filter(|p| p.spec == *spec) {
            Some(p) => (Arc::clone(&p.autoscaler), Arc::clone(&p.published)),
            None => {
                let a = Autoscaler::new(spec.config.clone(), spec.profiles.clone(), now)?;
                gauges.clear();
                // Until its first step, a pool runs its minimum (its damper's start).
                for p in &spec.config.pools {
                    let g = gauges.pool(&p.name);
                    g.desired.set(p.min_endpoints as f64);
                    g.target.set(p.min_endpoints as f64);
                }
                (Arc::new(Mutex::new(a)), Arc::default())
            }
        };
        let gauges = spec
            .config
            .pools
            .iter()
            .map(|p| PoolGauges {
                entitlements: p
                    .entitlements
                    .iter()
                    .map(|e| gauges.entitlement(&p.name, e))
                    .collect(),
                ..gauges.pool(&p.name)
            })
            .collect();
        let cfg = &spec.config;
        let plane_pools: Vec<usize> = cfg
            .pools
            .iter()
            .filter_map(|p| names.iter().position(|&q| q == p.name))
            .collect();
        let readiness = cfg
            .pools
            .iter()
            .zip(&plane_pools)
            .map(|(p, &i)| pools[i].endpoints as u64 >= p.max_endpoints)
            .collect();
        let mut by_plane = vec![None; pools.len()];
        for (i, &p) in plane_pools.iter().enumerate() {
            by_plane[p] = Some(i);
        }
        let entitlements = by_plane
            .iter()
            .map(|scaled| {
                tenants
                    .iter()
                    .map(|t| {
                        let p = &cfg.pools[(*scaled)?];
                        let e = (*t)?;
                        p.entitlements.iter().position(|x| x == e)
                    })
                    .collect()
            })
            .collect();
        Ok(Self {
            spec: spec.clone(),
            autoscaler,
            pools: by_plane,
            plane_pools,
            readiness,
            entitlements,
            published,
            gauges,
        })
    }

    pub fn period(&self) -> Duration {
        Duration::from_secs_f64(self.spec.config.period_s)
    }

    /// Counts a request of data-plane pool `pool` from `tenant` given its
    /// lease at `now` (the pool's arrival rate); false when the pool is not
    /// scaled.
    pub fn arrive(&self, pool: usize, tenant: Option<usize>, now: f64) -> bool {
        let Some(Some(p)) = self.pools.get(pool) else {
            return false;
        };
        let e = tenant.and_then(|t| self.entitlements[pool].get(t).copied().flatten());
        lock(&self.autoscaler).arrive(*p, e, now).is_ok()
    }

    /// Counts a finished request of data-plane pool `pool` from `tenant`
    /// (its index among the spec's tenants). A pool not scaled is skipped;
    /// a count the window refuses (beyond the token bound) is not counted.
    pub fn observe(
        &self,
        pool: usize,
        tenant: Option<usize>,
        now: f64,
        prompt: u64,
        output: u64,
    ) -> bool {
        let Some(Some(p)) = self.pools.get(pool) else {
            return false;
        };
        let e = tenant.and_then(|t| self.entitlements[pool].get(t).copied().flatten());
        lock(&self.autoscaler)
            .observe(*p, e, now, prompt, output)
            .is_ok()
    }

    /// One sizing step at `now` for every pool, with the demand `signals`
    /// hold and, where a pool's endpoints' health is their readiness, its
    /// ready endpoints (those of its count still starting are cancelled
    /// once its target no longer needs them); publishes the gauges and
    /// [`Self::last`], and logs a warning for each pool that came to be
    /// held at its maximum (or changed why), once per change. Returns the
    /// pools whose warning state changed.
    pub fn step(&self, now: f64, signals: &dyn PoolSignals) -> Result<Vec<(String, AtMax)>> {
        let demand: Vec<PoolDemand> = self
            .plane_pools
            .iter()
            .enumerate()
            .map(|(i, &p)| PoolDemand {
                queued_requests: signals.queued_requests(p),
                busy_endpoints: 0.0,
                ready_endpoints: if self.readiness[i] {
                    signals.ready_endpoints(p)
                } else {
                    None
                },
                promised_tokens_per_s: self
                    .spec
                    .promised_tokens_per_s
                    .get(i)
                    .copied()
                    .unwrap_or(0.0),
            })
            .collect();
        let (desired, entitlements) = {
            let mut a = lock(&self.autoscaler);
            let desired = a.step(now, &demand)?;
            let mut entitlements = Vec::new();
            for (i, p) in self.spec.config.pools.iter().enumerate() {
                for e in 0..p.entitlements.len() {
                    entitlements.push(a.live(i, Some(e), now)?);
                }
            }
            (desired, entitlements)
        };
        let mut live = entitlements.iter();
        for g in self.gauges.iter().flat_map(|g| &g.entitlements) {
            if let Some(l) = live.next() {
                g.publish(l);
            }
        }
        let mut published = lock(&self.published);
        published.at_max.resize(desired.len(), None);
        let mut changed = Vec::new();
        for ((d, was), g) in desired
            .iter()
            .zip(published.at_max.iter_mut())
            .zip(&self.gauges)
        {
            g.publish(d);
            let is = at_max(d);
            if is == *was {
                continue;
            }
            match is {
                Some((reason, binding)) => tracing::warn!(
                    pool = d.pool.as_str(),
                    reason = reason.name(),
                    binding = binding.name(),
                    endpoints = d.target.endpoints,
                    explanation = %d,
                    "autoscale-at-max"
                ),
                None => tracing::info!(
                    pool = d.pool.as_str(),
                    explanation = %d,
                    "autoscale-below-max"
                ),
            }
            *was = is;
            changed.push((d.pool.clone(), is));
        }
        published.desired = desired;
        Ok(changed)
    }

    /// The last step's answer for every pool (empty before the first step).
    pub fn last(&self) -> Vec<Desired> {
        lock(&self.published).desired.clone()
    }

    /// The live window of autoscaler pool `pool` (of its entitlement
    /// `entitlement`, by index) at `now`, as the tests read it.
    #[cfg(test)]
    pub(crate) fn live(
        &self,
        pool: usize,
        entitlement: Option<usize>,
        now: f64,
    ) -> Result<LiveWorkload> {
        lock(&self.autoscaler).live(pool, entitlement, now)
    }
}

/// The periodic actor: one sizing step of the current engine's autoscaler
/// every `period_s` (re-read after each step: a reload may change it);
/// without an `autoscale` section it looks again every default period.
/// `current` is the engine running now (a reload swaps it: ext_proc's
/// `Current`).
pub async fn autoscale_forever<E: Scaled>(
    current: Arc<RwLock<Arc<E>>>,
    mut stop: watch::Receiver<bool>,
) {
    let idle = Duration::from_secs_f64(AutoscaleConfig::default().period_s);
    loop {
        let engine = Arc::clone(&current.read().unwrap_or_else(|e| e.into_inner()));
        let period = match engine.scaling() {
            Some(s) => {
                let now = crate::clock::monotonic();
                if let Err(e) = s.step(now, &*engine) {
                    tracing::error!(error = %e, "autoscale-failed");
                }
                s.period()
            }
            None => idle,
        };
        drop(engine);
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
