//! Filter `saturation`: drops endpoints whose engine queue (scraped waiting
//! requests plus the dispatches since that scrape) is above `max_waiting` or
//! whose KV-cache use is above `max_kv_usage` (the GIE's saturation
//! detector). Unknown values pass. Soft: when every endpoint is saturated
//! the filter is skipped.

use super::EndpointState;
use crate::error::{invalid, non_negative, Result};

/// The GIE's default thresholds: a queue of 5, 80% KV-cache use.
pub const DEFAULT_MAX_WAITING: f64 = 5.0;
pub const DEFAULT_MAX_KV_USAGE: f64 = 0.8;

/// Checks the thresholds of a saturation filter.
pub fn check(max_waiting: f64, max_kv_usage: f64) -> Result<()> {
    non_negative("max_waiting", max_waiting)?;
    if !(0.0..=1.0).contains(&max_kv_usage) {
        return Err(invalid(format!(
            "max_kv_usage must be in [0, 1], got {max_kv_usage}"
        )));
    }
    Ok(())
}

/// Whether `s` is at or below both thresholds (unknown values pass).
pub fn keep(max_waiting: f64, max_kv_usage: f64, s: &EndpointState) -> bool {
    let queue = s.waiting.map(|w| w + f64::from(s.dispatched_since_scrape));
    !(queue.is_some_and(|q| q > max_waiting) || s.kv_usage.is_some_and(|k| k > max_kv_usage))
}
