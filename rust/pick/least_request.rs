//! Scorer `least-request`: the endpoint holding the fewest requests
//! (`EndpointState::load`) scores 1, the most 0, linearly between; all 1
//! when equal. The one least-request of routecore: with the max-score
//! picker and ties to the first, it is the least-loaded endpoint, first on
//! ties.

use super::{lower_is_better, Ctx};

pub fn score(ctx: &Ctx<'_>, out: &mut [f64]) {
    lower_is_better(out, |k| ctx.states[ctx.cand[k]].load());
}
