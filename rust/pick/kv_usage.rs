//! Scorer `kv-usage` (the GIE's KV-cache utilization scorer): `1 - kv_usage`
//! (clamped to [0, 1]); an endpoint whose use is unknown scores 0.5.

use super::plugin::{scorer_without_params, Describe, Kind, Needs, Scorer};
use super::{Ctx, PickRequest};
use crate::error::Result;

pub const PLUGIN: Describe = Describe {
    name: "kv-usage",
    kind: Kind::Scorer,
    needs: Needs::SCRAPED,
    build: scorer_without_params::<KvUsage>,
    shared: None,
    resolve: None,
};

/// The score of an endpoint whose KV-cache use is unknown.
pub const UNKNOWN_SCORE: f64 = 0.5;

#[derive(Debug, Clone, Copy, Default)]
pub struct KvUsage;

impl Scorer for KvUsage {
    fn score(&mut self, _: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()> {
        for (o, &i) in out.iter_mut().zip(ctx.cand) {
            *o = ctx.states[i]
                .kv_usage
                .map_or(UNKNOWN_SCORE, |k| (1.0 - k).clamp(0.0, 1.0));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointState;

    #[test]
    fn one_minus_use_clamped_and_half_when_unknown() {
        let names: Vec<String> = (0..4).map(|i| format!("e{i}")).collect();
        let mut states = vec![EndpointState::default(); 4];
        for (s, k) in states
            .iter_mut()
            .zip([Some(0.25), None, Some(1.5), Some(-0.5)])
        {
            s.kv_usage = k;
        }
        let cand = [3, 2, 1, 0];
        let ctx = Ctx {
            names: &names,
            states: &states,
            cand: &cand,
        };
        let mut out = [0.0; 4];
        KvUsage
            .score(&PickRequest::default(), &ctx, &mut out)
            .expect("score");
        assert_eq!(out, [1.0, 0.0, UNKNOWN_SCORE, 0.75], "in candidate order");
    }
}
