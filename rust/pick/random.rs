//! Picker `random`: a seeded draw weighted by the totals (uniform when they
//! are all zero, as in a pipeline without scorers).

use super::Ranking;
use crate::rng::Rng;

pub(super) fn choose(r: &Ranking<'_>) -> usize {
    let mut rng = Rng::new(r.draw);
    let sum: f64 = r.total.iter().sum();
    if sum <= 0.0 {
        return rng.below(r.cand.len() as u64) as usize;
    }
    let mut x = rng.uniform() * sum;
    for (p, &t) in r.total.iter().enumerate() {
        if x < t {
            return p;
        }
        x -= t;
    }
    // Rounding left x at or past the last positive total.
    r.total.iter().rposition(|&t| t > 0.0).unwrap_or(0)
}
