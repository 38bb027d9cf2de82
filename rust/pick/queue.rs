//! Scorer `queue-depth` (the GIE's queue scorer): the shortest engine queue
//! (`EndpointState::queue`: scraped waiting requests plus routecore's
//! dispatches since that scrape) scores 1, the longest 0, linearly between.

use super::plugin::{scorer_without_params, Describe, Kind, Needs, Scorer};
use super::{lower_is_better, Ctx, PickRequest};
use crate::error::Result;

pub const PLUGIN: Describe = Describe {
    name: "queue-depth",
    kind: Kind::Scorer,
    needs: Needs::SCRAPED,
    build: scorer_without_params::<QueueDepth>,
    shared: None,
    resolve: None,
};

#[derive(Debug, Clone, Copy, Default)]
pub struct QueueDepth;

impl Scorer for QueueDepth {
    fn score(&mut self, _: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()> {
        lower_is_better(out, |k| ctx.states[ctx.cand[k]].queue());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointState;

    #[test]
    fn shortest_queue_scores_one_longest_zero_linear_between() {
        let names: Vec<String> = (0..4).map(|i| format!("e{i}")).collect();
        let mut states = vec![EndpointState::default(); 4];
        for (s, w) in states.iter_mut().zip([4.0, 0.0, 1.0, 2.0]) {
            s.waiting = Some(w);
        }
        states[3].dispatched_since_scrape = 2; // queue 4, like e0
        let cand = [0, 1, 2, 3];
        let ctx = Ctx {
            names: &names,
            states: &states,
            cand: &cand,
        };
        let mut out = [0.0; 4];
        QueueDepth
            .score(&PickRequest::default(), &ctx, &mut out)
            .expect("score");
        assert_eq!(out, [0.0, 1.0, 0.75, 0.0]);
        let cand = [0, 3];
        let ctx = Ctx { cand: &cand, ..ctx };
        let mut out = [0.0; 2];
        QueueDepth
            .score(&PickRequest::default(), &ctx, &mut out)
            .expect("score");
        assert_eq!(out, [1.0, 1.0], "equal queues all score 1");
    }
}
