//! The autoscaler's configuration: the period, the live window, the damping
//! and each pool's bounds and SLO. It checks itself; an error names the key
//! (`autoscale.pools[1].min_endpoints`).
//!
//! ```json
//! {"period_s": 10, "window_s": 60, "sub_windows": 6,
//!  "scale_down_delay_s": 300, "max_step_up": 4, "max_step_up_percent": 100,
//!  "max_step_down": 4, "max_step_down_percent": 50,
//!  "forecast_s": 70, "max_forecast_ratio": 2, "queue_drain_s": 70,
//!  "pools": [{"name": "short", "context": 8192, "min_endpoints": 1,
//!             "max_endpoints": 40, "slo_ttft_s": 1.0, "slo_tpot_s": 0.05,
//!             "entitlements": ["team-a", "team-b"]}]}
//! ```
//!
//! A step limit is the larger of its count and its percentage of the
//! current count (rounded up), as Kubernetes' HPA combines its policies.

use serde::Deserialize;

use crate::error::{invalid, positive, Result};

/// Most pools, and most entitlements of one pool, an autoscaler tracks.
pub const MAX_POOLS: usize = 1024;
pub const MAX_ENTITLEMENTS: usize = 1024;
/// Largest `max_endpoints` (far above any fleet; keeps sums from overflow).
pub const MAX_ENDPOINTS: u64 = 1 << 32;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AutoscaleConfig {
    /// Seconds between sizing steps (default 10).
    pub period_s: f64,
    /// Seconds of traffic the live workload covers (default 60).
    pub window_s: f64,
    /// Parts of the window forgotten one at a time (default 6).
    pub sub_windows: usize,
    /// Share of requests whose TTFT and TPOT must meet the targets (0.99).
    pub quantile: f64,
    /// A pool scales down only after its target stayed below its count for
    /// this long (default 300 s, HPA's stabilization window).
    pub scale_down_delay_s: f64,
    /// Most endpoints added per step: the larger of the count and the
    /// percentage of the current count (defaults 4 and 100 %).
    pub max_step_up: u64,
    pub max_step_up_percent: f64,
    /// Most endpoints removed per step (defaults 4 and 50 %).
    pub max_step_down: u64,
    pub max_step_down_percent: f64,
    /// Requests held by flow control are work to drain over this many
    /// seconds, sized as that much more rate (default: `forecast_s` when it
    /// is longer than a period, else `period_s`: endpoints started now serve
    /// the backlog only once ready, so it is spread over the horizon a
    /// decision covers, not over one period).
    pub queue_drain_s: Option<f64>,
    /// Size for the rate expected this many seconds ahead (an endpoint's
    /// start-up plus a period is the horizon a decision must cover): the
    /// window's rate moved by its trend from the window's middle to
    /// `forecast_s` past now. None (default): the window's rate as it is.
    pub forecast_s: Option<f64>,
    /// The forecast is at most this multiple of the newest sub-window's
    /// rate (default 2): a step looks like a steep trend, which
    /// extrapolated would size for a rate that never comes.
    pub max_forecast_ratio: f64,
    pub pools: Vec<PoolScaling>,
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        Self {
            period_s: 10.0,
            window_s: 60.0,
            sub_windows: 6,
            quantile: 0.99,
            scale_down_delay_s: 300.0,
            max_step_up: 4,
            max_step_up_percent: 100.0,
            max_step_down: 4,
            max_step_down_percent: 50.0,
            queue_drain_s: None,
            forecast_s: None,
            max_forecast_ratio: 2.0,
            pools: Vec::new(),
        }
    }
}

/// One pool's bounds, engine context and SLO.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolScaling {
    pub name: String,
    /// The context window of the pool's endpoints, tokens (sets their slots).
    pub context: u64,
    #[serde(default = "one")]
    pub min_endpoints: u64,
    pub max_endpoints: u64,
    /// P(TTFT <= slo_ttft_s) >= quantile, seconds.
    pub slo_ttft_s: f64,
    /// TPOT target, seconds (None: none).
    #[serde(default)]
    pub slo_tpot_s: Option<f64>,
    /// The entitlements bound to the pool whose live workload is kept apart.
    #[serde(default)]
    pub entitlements: Vec<String>,
}

fn one() -> u64 {
    1
}

impl AutoscaleConfig {
    /// The config from its JSON value (unknown keys refused), checked.
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        let cfg: Self =
            serde_json::from_value(value).map_err(|e| invalid(format!("autoscale: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The damping its keys describe.
    pub fn damping(&self) -> super::Damping {
        super::Damping {
            scale_down_delay_s: self.scale_down_delay_s,
            max_step_up: self.max_step_up,
            max_step_up_percent: self.max_step_up_percent,
            max_step_down: self.max_step_down,
            max_step_down_percent: self.max_step_down_percent,
        }
    }

    /// Seconds over which queued requests are drained.
    pub fn queue_drain_s(&self) -> f64 {
        self.queue_drain_s
            .unwrap_or(self.period_s.max(self.forecast_s.unwrap_or(0.0)))
    }

    /// The forecast its keys describe (None without `forecast_s`).
    pub fn forecast(&self) -> Option<super::Forecast> {
        self.forecast_s.map(|ahead_s| super::Forecast {
            ahead_s,
            max_ratio: self.max_forecast_ratio,
        })
    }

    /// Checks every key; the error names the first one out of range.
    pub fn validate(&self) -> Result<()> {
        let key = |k: &str| format!("autoscale.{k}");
        positive(&key("period_s"), self.period_s)?;
        positive(&key("window_s"), self.window_s)?;
        if !(1..=super::window::MAX_SUB_WINDOWS).contains(&self.sub_windows) {
            return Err(invalid(format!(
                "autoscale.sub_windows must be in [1, {}], got {}",
                super::window::MAX_SUB_WINDOWS,
                self.sub_windows
            )));
        }
        if !(self.quantile > 0.0 && self.quantile < 1.0) {
            return Err(invalid(format!(
                "autoscale.quantile must be in (0, 1), got {}",
                self.quantile
            )));
        }
        if !(self.scale_down_delay_s.is_finite() && self.scale_down_delay_s >= 0.0) {
            return Err(invalid(format!(
                "autoscale.scale_down_delay_s must be >= 0, got {}",
                self.scale_down_delay_s
            )));
        }
        for (k, v) in [
            ("max_step_up_percent", self.max_step_up_percent),
            ("max_step_down_percent", self.max_step_down_percent),
        ] {
            if !(v.is_finite() && (0.0..=1e6).contains(&v)) {
                return Err(invalid(format!(
                    "autoscale.{k} must be in [0, 1000000], got {v}"
                )));
            }
        }
        for (k, count, pct) in [
            ("max_step_up", self.max_step_up, self.max_step_up_percent),
            (
                "max_step_down",
                self.max_step_down,
                self.max_step_down_percent,
            ),
        ] {
            if count == 0 && pct == 0.0 {
                return Err(invalid(format!(
                    "autoscale.{k} and {k}_percent are both 0: the pool could never move"
                )));
            }
        }
        if let Some(d) = self.queue_drain_s {
            positive(&key("queue_drain_s"), d)?;
        }
        if let Some(f) = self.forecast_s {
            crate::error::non_negative(&key("forecast_s"), f)?;
        }
        if !(self.max_forecast_ratio.is_finite() && self.max_forecast_ratio >= 1.0) {
            return Err(invalid(format!(
                "autoscale.max_forecast_ratio must be >= 1, got {}",
                self.max_forecast_ratio
            )));
        }
        if self.pools.len() > MAX_POOLS {
            return Err(invalid(format!(
                "autoscale.pools: at most {MAX_POOLS} pools, got {}",
                self.pools.len()
            )));
        }
        for (i, p) in self.pools.iter().enumerate() {
            let key = |k: &str| format!("autoscale.pools[{i}].{k}");
            if p.name.is_empty() {
                return Err(invalid(format!("{} must not be empty", key("name"))));
            }
            if self.pools[..i].iter().any(|q| q.name == p.name) {
                return Err(invalid(format!(
                    "{}: pool {:?} is listed twice",
                    key("name"),
                    p.name
                )));
            }
            if p.context == 0 {
                return Err(invalid(format!("{} must be >= 1", key("context"))));
            }
            if !(1..=MAX_ENDPOINTS).contains(&p.max_endpoints) {
                return Err(invalid(format!(
                    "{} must be in [1, {MAX_ENDPOINTS}], got {}",
                    key("max_endpoints"),
                    p.max_endpoints
                )));
            }
            if p.min_endpoints > p.max_endpoints {
                return Err(invalid(format!(
                    "{} ({}) is above max_endpoints ({})",
                    key("min_endpoints"),
                    p.min_endpoints,
                    p.max_endpoints
                )));
            }
            positive(&key("slo_ttft_s"), p.slo_ttft_s)?;
            if let Some(t) = p.slo_tpot_s {
                positive(&key("slo_tpot_s"), t)?;
            }
            if p.entitlements.len() > MAX_ENTITLEMENTS {
                return Err(invalid(format!(
                    "{}: at most {MAX_ENTITLEMENTS}, got {}",
                    key("entitlements"),
                    p.entitlements.len()
                )));
            }
            for (j, e) in p.entitlements.iter().enumerate() {
                if p.entitlements[..j].contains(e) {
                    return Err(invalid(format!(
                        "{}: {e:?} is listed twice",
                        key("entitlements")
                    )));
                }
            }
        }
        Ok(())
    }
}
