//! Whether a pool is saturated: when it is, its queue holds requests; when
//! it is not, the queue dispatches. Pure: it reads the pool's endpoints as
//! the picker sees them ([`EndpointState`]) and one signal from the
//! admission layer.
//!
//! - `utilization` (the default; the GIE's `utilization-detector`): each
//!   healthy endpoint scores `max(queue / max_waiting, kv_usage /
//!   max_kv_usage)`, its queue being the scraped waiting requests plus the
//!   picker's own dispatches since that scrape; an endpoint whose metrics
//!   are unknown or stale scores 1. The pool's saturation is the mean score
//!   (1 with no healthy endpoint: scale-from-zero waits), saturated at 1 or
//!   more. Thresholds default to the GIE's: a queue of 5, 80% KV cache (the
//!   same keys and defaults as the picker's `saturation` filter).
//! - `concurrency` (the GIE's `concurrency-detector`, for pools that are not
//!   scraped): each healthy endpoint scores routecore's own requests in
//!   flight over `max_in_flight` (default 100, the GIE's).
//!
//! Either way a quota at its limit in the admission layer saturates the
//! pool: its requests could only be refused downstream. The caller passes
//! `AdmissionController::quota_in_flight(q) >= q.concurrency` for the quota
//! `q` bound to the pool.

use serde::Deserialize;

use crate::endpoint::{EndpointState, Saturation, DEFAULT_MAX_KV_USAGE, DEFAULT_MAX_WAITING};
use crate::error::{invalid, Result};

/// The GIE concurrency detector's default per-endpoint limit.
pub const DEFAULT_MAX_IN_FLIGHT: i64 = 100;

/// Which signal says an endpoint is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Detector {
    #[default]
    Utilization,
    Concurrency,
}

fn default_max_waiting() -> f64 {
    DEFAULT_MAX_WAITING
}
fn default_max_kv_usage() -> f64 {
    DEFAULT_MAX_KV_USAGE
}
fn default_max_in_flight() -> i64 {
    DEFAULT_MAX_IN_FLIGHT
}

/// The detector's configuration (JSON keys as the fields).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SaturationConfig {
    #[serde(default)]
    pub detector: Detector,
    #[serde(default = "default_max_waiting")]
    pub max_waiting: f64,
    #[serde(default = "default_max_kv_usage")]
    pub max_kv_usage: f64,
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: i64,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        Self {
            detector: Detector::Utilization,
            max_waiting: DEFAULT_MAX_WAITING,
            max_kv_usage: DEFAULT_MAX_KV_USAGE,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }
}

/// `x / limit`; a limit of 0 makes anything above 0 infinitely full.
fn ratio(x: f64, limit: f64) -> f64 {
    if limit > 0.0 {
        x / limit
    } else if x > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

/// One pool's saturation detector (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationDetector {
    config: SaturationConfig,
}

impl SaturationDetector {
    pub fn new(config: SaturationConfig) -> Result<Self> {
        Saturation {
            max_waiting: config.max_waiting,
            max_kv_usage: config.max_kv_usage,
        }
        .check()
        .map_err(|e| invalid(format!("saturation: {e}")))?;
        if config.max_in_flight < 1 {
            return Err(invalid(format!(
                "saturation: max_in_flight must be >= 1, got {}",
                config.max_in_flight
            )));
        }
        Ok(Self { config })
    }

    pub fn config(&self) -> &SaturationConfig {
        &self.config
    }

    /// One endpoint's score: 1 is full.
    pub fn score(&self, s: &EndpointState) -> f64 {
        let c = &self.config;
        match c.detector {
            Detector::Utilization => match (s.waiting, s.kv_usage) {
                (Some(w), Some(kv)) => {
                    let queue = w + f64::from(s.dispatched_since_scrape);
                    ratio(queue, c.max_waiting).max(ratio(kv, c.max_kv_usage))
                }
                _ => 1.0,
            },
            Detector::Concurrency => s.in_flight as f64 / c.max_in_flight as f64,
        }
    }

    /// The pool's saturation: the mean score of its healthy endpoints; 1
    /// when it has none.
    pub fn saturation(&self, endpoints: &[EndpointState]) -> f64 {
        let (sum, n) = endpoints
            .iter()
            .filter(|s| s.healthy)
            .fold((0.0, 0u32), |(sum, n), s| (sum + self.score(s), n + 1));
        if n == 0 {
            1.0
        } else {
            sum / f64::from(n)
        }
    }

    /// Whether the pool's queue must hold its requests now.
    pub fn saturated(&self, endpoints: &[EndpointState], quota_at_limit: bool) -> bool {
        self.saturated_with(endpoints, 0, quota_at_limit)
    }

    /// [`SaturationDetector::saturated`] once `pending` requests, let out of
    /// the queue but not yet counted on an endpoint, have landed: each adds
    /// at most one request to one endpoint's queue (or its requests in
    /// flight), so at most `1 / (healthy * limit)` to the mean score.
    pub fn saturated_with(
        &self,
        endpoints: &[EndpointState],
        pending: u64,
        quota_at_limit: bool,
    ) -> bool {
        if quota_at_limit {
            return true;
        }
        let (sum, n) = endpoints
            .iter()
            .filter(|s| s.healthy)
            .fold((0.0, 0u32), |(sum, n), s| (sum + self.score(s), n + 1));
        if n == 0 {
            return true;
        }
        let c = &self.config;
        let landed = if pending == 0 {
            0.0
        } else {
            let per = match c.detector {
                Detector::Utilization => ratio(1.0, c.max_waiting),
                Detector::Concurrency => 1.0 / c.max_in_flight as f64,
            };
            pending as f64 * per
        };
        (sum + landed) / f64::from(n) >= 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scraped(waiting: f64, kv: f64) -> EndpointState {
        EndpointState {
            waiting: Some(waiting),
            running: Some(1.0),
            kv_usage: Some(kv),
            ..EndpointState::default()
        }
    }

    fn detector(max_waiting: f64, max_kv_usage: f64) -> SaturationDetector {
        SaturationDetector::new(SaturationConfig {
            max_waiting,
            max_kv_usage,
            ..SaturationConfig::default()
        })
        .expect("detector")
    }

    #[test]
    fn the_gies_roofline_scores_and_mean() {
        // The GIE's cases (queue 5, KV 0.9): max of the two ratios, averaged.
        let d = detector(5.0, 0.9);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(d.saturation(&[scraped(2.0, 0.5)]), 0.5 / 0.9));
        assert!(close(d.saturation(&[scraped(10.0, 0.1)]), 2.0));
        assert!(close(d.saturation(&[scraped(1.0, 0.95)]), 0.95 / 0.9));
        let two = [scraped(1.0, 0.1), scraped(0.0, 0.2)];
        assert!(close(d.saturation(&two), (0.2 + 0.2 / 0.9) / 2.0));
        let bad = [scraped(1.0, 0.1), scraped(15.0, 0.2)];
        assert!(close(d.saturation(&bad), 1.6));
        assert!(d.saturated(&bad, false));
        // At the threshold is saturated (the GIE: saturation >= 1).
        assert!(d.saturated(&[scraped(5.0, 0.1)], false));
        assert!(!d.saturated(&[scraped(4.0, 0.1)], false));
    }

    #[test]
    fn stale_metrics_own_dispatches_health_and_quota_count() {
        let d = SaturationDetector::new(SaturationConfig::default()).expect("detector");
        // Unknown (stale or never scraped) metrics score 1.
        let stale = EndpointState::default();
        assert_eq!(d.score(&stale), 1.0);
        let fresh = scraped(1.0, 0.1);
        assert!((d.saturation(&[fresh.clone(), stale]) - 0.6).abs() < 1e-12);
        // The picker's dispatches since the scrape count in the queue: 1 + 4
        // waiting is the default threshold of 5.
        let busy = EndpointState {
            dispatched_since_scrape: 4,
            ..fresh.clone()
        };
        assert!(!d.saturated(std::slice::from_ref(&fresh), false));
        assert!(d.saturated(&[busy], false));
        // Unhealthy endpoints are not capacity; none healthy: saturated.
        let sick = EndpointState {
            healthy: false,
            ..fresh.clone()
        };
        assert!(d.saturated(std::slice::from_ref(&sick), false));
        assert!(d.saturated(&[], false));
        assert_eq!(d.saturation(&[sick, fresh.clone()]), d.score(&fresh));
        // A quota at its limit saturates an idle pool.
        assert!(d.saturated(&[fresh], true));
        // A zero queue threshold: any waiting request is full.
        let strict = detector(0.0, 0.8);
        assert!(!strict.saturated(&[scraped(0.0, 0.1)], false));
        assert!(strict.saturated(&[scraped(1.0, 0.1)], false));
    }

    #[test]
    fn requests_let_out_but_not_yet_placed_count_as_landed() {
        // Two endpoints at queues 2 and 3 of 5: mean 0.5. Five requests let
        // out of the queue fill it: (2 + 3 + 5) / 5 / 2 = 1.
        let d = SaturationDetector::new(SaturationConfig::default()).expect("detector");
        let two = [scraped(2.0, 0.1), scraped(3.0, 0.1)];
        assert!(!d.saturated_with(&two, 4, false));
        assert!(d.saturated_with(&two, 5, false));
        assert_eq!(d.saturated_with(&two, 0, false), d.saturated(&two, false));
        // A zero queue threshold: one landed request is full.
        let strict = detector(0.0, 0.8);
        let idle = [scraped(0.0, 0.1)];
        assert!(!strict.saturated_with(&idle, 0, false));
        assert!(strict.saturated_with(&idle, 1, false));
        let c = SaturationDetector::new(SaturationConfig {
            detector: Detector::Concurrency,
            max_in_flight: 4,
            ..SaturationConfig::default()
        })
        .expect("detector");
        let load = EndpointState {
            in_flight: 2,
            ..EndpointState::default()
        };
        assert!(!c.saturated_with(std::slice::from_ref(&load), 1, false));
        assert!(c.saturated_with(&[load], 2, false));
        assert!(
            c.saturated_with(&[], 0, false),
            "no endpoint: the waiting room"
        );
    }

    #[test]
    fn concurrency_counts_own_requests_in_flight() {
        let d = SaturationDetector::new(SaturationConfig {
            detector: Detector::Concurrency,
            max_in_flight: 4,
            ..SaturationConfig::default()
        })
        .expect("detector");
        let load = |n| EndpointState {
            in_flight: n,
            ..EndpointState::default()
        };
        assert_eq!(d.saturation(&[load(2), load(4)]), 0.75);
        assert!(!d.saturated(&[load(3), load(4)], false));
        assert!(d.saturated(&[load(4), load(4)], false));
    }

    #[test]
    fn bad_thresholds_are_refused() {
        for (w, kv, n) in [
            (-1.0, 0.8, 1),
            (5.0, 1.5, 1),
            (f64::NAN, 0.8, 1),
            (5.0, 0.8, 0),
        ] {
            let c = SaturationConfig {
                max_waiting: w,
                max_kv_usage: kv,
                max_in_flight: n,
                ..SaturationConfig::default()
            };
            let e = SaturationDetector::new(c).expect_err("refused");
            assert!(e.to_string().starts_with("saturation: "), "{e}");
        }
        let c: SaturationConfig =
            serde_json::from_str(r#"{"detector": "concurrency"}"#).expect("json");
        assert_eq!((c.detector, c.max_in_flight), (Detector::Concurrency, 100));
        assert!(serde_json::from_str::<SaturationConfig>(r#"{"max_queue": 3}"#).is_err());
    }
}
