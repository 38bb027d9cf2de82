//! How each pool's split requests travel (its `disaggregation.handoff`),
//! with its fallback counters and the log state of its failures: built with
//! the engine (which holds one per pool), read by routecore's prefill sender
//! (`serve::pd_send`, which imports the engine: this state sits below both).

use std::time::{Duration, Instant};

use super::config::PoolSpec;
use super::logs::{Occurrence, Repeats};
use super::metrics::{FCounter, FallbackLabels, PdMetrics};
use crate::pd::handshake::{Fallback, Handoff, FALLBACKS};

/// How one pool's split requests travel, with its fallback counters and
/// log state.
pub struct PoolHandoff {
    pool: String,
    pub handoff: Handoff,
    pub timeout: Duration,
    pub require_params: bool,
    pub bootstrap_port: Option<u16>,
    fallbacks: Vec<FCounter>,
    failing: Repeats,
}

impl PoolHandoff {
    pub fn new(p: &PoolSpec, metrics: &PdMetrics) -> Self {
        let d = p.disaggregation.as_ref();
        Self {
            pool: p.name.clone(),
            handoff: d.map_or(Handoff::Header, |d| d.handoff),
            timeout: Duration::from_secs_f64(d.map_or(30.0, |d| d.prefill_timeout_s)),
            require_params: d.is_none_or(|d| d.require_kv_transfer_params),
            bootstrap_port: d.and_then(|d| d.bootstrap_port),
            fallbacks: FALLBACKS
                .iter()
                .map(|r| {
                    metrics.fallbacks.get_or_create_owned(&FallbackLabels {
                        pool: p.name.clone(),
                        reason: (*r).into(),
                    })
                })
                .collect(),
            failing: Repeats::default(),
        }
    }

    /// A split request served aggregated for `reason`: counted, and logged
    /// once per run of failures.
    pub fn fell_back(&self, reason: Fallback, prefill: &str, request_id: &str) {
        self.fallbacks[reason as usize].inc();
        if let Occurrence::Log { suppressed } = self.failing.occur(Instant::now()) {
            tracing::warn!(
                request_id,
                pool = self.pool.as_str(),
                endpoint = prefill,
                reason = reason.as_str(),
                error = %reason,
                suppressed,
                "prefill-fallback"
            );
        }
    }

    /// A split request handed off: a run of failures, if any, ends.
    pub fn handed_off(&self, prefill: &str) {
        if let Some(suppressed) = self.failing.end() {
            tracing::info!(
                pool = self.pool.as_str(),
                endpoint = prefill,
                suppressed,
                "prefill-recovered"
            );
        }
    }
}
