//! Scorer `kv-usage` (the GIE's KV-cache utilization scorer): `1 - kv_usage`
//! (clamped to [0, 1]); an endpoint whose use is unknown scores 0.5.

use super::Ctx;

/// The score of an endpoint whose KV-cache use is unknown.
pub const UNKNOWN_SCORE: f64 = 0.5;

pub fn score(ctx: &Ctx<'_>, out: &mut [f64]) {
    for (o, &i) in out.iter_mut().zip(ctx.cand) {
        *o = ctx.states[i]
            .kv_usage
            .map_or(UNKNOWN_SCORE, |k| (1.0 - k).clamp(0.0, 1.0));
    }
}
