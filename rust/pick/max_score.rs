//! Picker `max-score`: the candidate with the highest total; equal totals
//! are ordered by `Ties`.

use std::cmp::Ordering;

use super::Ranking;
use crate::rng::Rng;

/// How the max-score picker orders equal totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ties {
    /// Endpoint order.
    First,
    /// Fewer requests (`EndpointState::load`) first, then endpoint order.
    LeastRequest,
    /// Starting after the endpoint chosen last, in endpoint order.
    RoundRobin,
    /// A seeded random order, drawn anew for every pick.
    Random { seed: u64 },
}

/// Endpoint `a` before endpoint `b` among equal totals.
pub(super) fn tie_cmp(r: &Ranking<'_>, a: usize, b: usize) -> Ordering {
    match r.ties {
        Ties::First => a.cmp(&b),
        Ties::LeastRequest => r.states[a]
            .load()
            .total_cmp(&r.states[b].load())
            .then(a.cmp(&b)),
        Ties::RoundRobin => {
            let rot = |i: usize| (i + r.n - r.cursor) % r.n;
            rot(a).cmp(&rot(b))
        }
        Ties::Random { .. } => {
            let key = |i: usize| Rng::new(r.draw ^ i as u64).next_u64();
            key(a).cmp(&key(b)).then(a.cmp(&b))
        }
    }
}

/// The position of the best candidate.
pub(super) fn choose(r: &Ranking<'_>) -> usize {
    (1..r.cand.len()).fold(0, |best, p| {
        if r.cmp(p, best) == Ordering::Less {
            p
        } else {
            best
        }
    })
}
