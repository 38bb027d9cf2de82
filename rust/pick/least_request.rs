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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointState;

    #[test]
    fn fewest_requests_score_one_most_zero_linear_between() {
        let names: Vec<String> = (0..3).map(|i| format!("e{i}")).collect();
        let mut states = vec![EndpointState::default(); 3];
        states[0].in_flight = 4;
        states[1].in_flight = 1;
        // Scraped: waiting + running + dispatches since, not in flight.
        states[2].in_flight = 9;
        states[2].waiting = Some(1.0);
        states[2].running = Some(0.0);
        let scores = |states: &[EndpointState]| {
            let ctx = Ctx {
                names: &names,
                states,
                cand: &[0, 1, 2],
            };
            let mut out = [0.0; 3];
            LeastRequest
                .score(&PickRequest::default(), &ctx, &mut out)
                .expect("score");
            out
        };
        assert_eq!(scores(&states), [0.0, 1.0, 1.0]);
        states[2].dispatched_since_scrape = 1; // load 2 of [1, 4]
        assert_eq!(scores(&states), [0.0, 1.0, 2.0 / 3.0]);
    }
}
