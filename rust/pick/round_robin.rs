//! Picker `round-robin`: the first candidate at or after the endpoint that
//! follows the one chosen last (in endpoint order, wrapping), scores ignored.

use super::Ranking;

pub(super) fn choose(r: &Ranking<'_>) -> usize {
    let rot = |i: usize| (i + r.n - r.cursor) % r.n;
    (0..r.cand.len())
        .min_by_key(|&p| rot(r.cand[p]))
        .unwrap_or(0)
}
