//! Scorer `least-request`: the endpoint holding the fewest requests
//! (`EndpointState::load`) scores 1, the most 0, linearly between; all 1
//! when equal. The one least-request of routecore: with the max-score
//! picker and ties to the first, it is the least-loaded endpoint, first on
//! ties.

use super::plugin::{scorer_without_params, Describe, Kind, Needs, Scorer};
use super::{lower_is_better, Ctx, PickRequest};
use crate::error::Result;

pub const PLUGIN: Describe = Describe {
    name: "least-request",
    kind: Kind::Scorer,
    needs: Needs::SCRAPED,
    build: scorer_without_params::<LeastRequest>,
    shared: None,
    resolve: None,
};

#[derive(Debug, Clone, Copy, Default)]
pub struct LeastRequest;

impl Scorer for LeastRequest {
    fn score(&mut self, _: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()> {
        lower_is_better(out, |k| ctx.states[ctx.cand[k]].load());
        Ok(())
    }
}
