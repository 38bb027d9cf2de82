//! Scorer `queue-depth` (the GIE's queue scorer): the shortest engine queue
//! (`EndpointState::queue`: scraped waiting requests plus routecore's
//! dispatches since that scrape) scores 1, the longest 0, linearly between.

use super::{lower_is_better, Ctx};

pub fn score(ctx: &Ctx<'_>, out: &mut [f64]) {
    lower_is_better(out, |k| ctx.states[ctx.cand[k]].queue());
}
