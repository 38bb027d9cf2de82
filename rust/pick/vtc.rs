//! Scorer `vtc`: VTC fairness (AIBrix's `vtc-basic`, see `crate::vtc`).
//!
//! It reads the request's fairness id and token estimates and the
//! candidates' loads (`EndpointState::load`). With `x` the user's "ideal"
//! endpoint index (heavy users high, light users low) and `n` the endpoints
//! of the pool, candidate `i` costs
//! `fairness_weight * |i - x| + utilization_weight * min(load_i / max_endpoint_load, 1)`
//! and scores `1 - cost / max_cost` (`max_cost` the largest cost possible,
//! so the lowest cost scores highest; with ties to the first this is the
//! `vtc` preset, `VtcRouter`). A request without a fairness id counts as a
//! user with no tokens. `started` charges the estimate, `completed` corrects
//! it to the usage.

use serde_json::Value;

use super::plugin::{params, Built, Describe, Kind, Needs, Scorer};
use super::{Ctx, PickConfig, PickRequest, Recorded};
use crate::error::Result;
use crate::snapshot::{Reader, Writer};
use crate::vtc::{Fairness, VtcConfig};

/// Its parameters are [`VtcConfig`]'s fields.
pub const PLUGIN: Describe = Describe {
    name: "vtc",
    kind: Kind::Scorer,
    needs: Needs::SCRAPED,
    build,
    shared: None,
    resolve: None,
};

fn build(p: &Value, _: &PickConfig) -> Result<Built> {
    Ok(Built::Scorer(Box::new(VtcScorer::new(params(p)?)?)))
}

#[derive(Debug, Clone)]
pub struct VtcScorer {
    fairness: Fairness,
}

impl VtcScorer {
    pub fn new(config: VtcConfig) -> Result<Self> {
        Ok(Self {
            fairness: Fairness::new(config)?,
        })
    }

    pub fn fairness(&self) -> &Fairness {
        &self.fairness
    }
    pub fn set_fairness(&mut self, fairness: Fairness) {
        self.fairness = fairness;
    }

    /// `user`'s weighted tokens in the window at `now` (finite).
    pub fn tokens(&mut self, user: &str, now: f64) -> f64 {
        self.fairness.advance(now);
        self.fairness.tokens(user)
    }
}

impl Scorer for VtcScorer {
    fn score(&mut self, req: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()> {
        self.fairness.advance(req.now);
        let c = *self.fairness.config();
        let n = ctx.names.len();
        let x = self.fairness.ideal(req.fairness_id.unwrap_or(""), n);
        let max_cost = c.fairness_weight * n.saturating_sub(1) as f64 + c.utilization_weight;
        for (o, &i) in out.iter_mut().zip(ctx.cand) {
            let fairness = (i as f64 - x).abs();
            let util = (ctx.states[i].load() / c.max_endpoint_load).min(1.0);
            let cost = c.fairness_weight * fairness + c.utilization_weight * util;
            *o = if max_cost > 0.0 {
                1.0 - cost / max_cost
            } else {
                1.0
            };
        }
        Ok(())
    }

    fn started(
        &mut self,
        req: &PickRequest<'_>,
        _: &[String],
        _: usize,
        _: Option<&mut Recorded>,
    ) -> Result<()> {
        if let Some(user) = req.fairness_id {
            self.fairness.advance(req.now);
            let cost = self
                .fairness
                .cost(req.input_tokens as f64, req.output_tokens as f64);
            self.fairness.charge(user, cost);
        }
        Ok(())
    }

    fn completed(&mut self, req: &PickRequest<'_>, input_tokens: u64, output_tokens: u64) {
        if let Some(user) = req.fairness_id {
            self.fairness.advance(req.now);
            let delta = self.fairness.cost(
                input_tokens as f64 - req.input_tokens as f64,
                output_tokens as f64 - req.output_tokens as f64,
            );
            self.fairness.charge(user, delta);
        }
    }

    fn write(&self, w: &mut Writer) {
        self.fairness.write(w);
    }

    fn read(&mut self, r: &mut Reader<'_>, _: usize) -> Result<()> {
        self.fairness = Fairness::read(r)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointState;

    #[test]
    fn scores_the_fairness_and_load_cost_and_charges_the_user() {
        let names: Vec<String> = (0..3).map(|i| format!("e{i}")).collect();
        let mut states = vec![EndpointState::default(); 3];
        states[1].in_flight = 50;
        states[2].in_flight = 200;
        let ctx = Ctx {
            names: &names,
            states: &states,
            cand: &[0, 1, 2],
        };
        let Built::Scorer(mut v) =
            build(&serde_json::json!({}), &PickConfig::default()).expect("defaults")
        else {
            panic!("a scorer")
        };
        let req = PickRequest {
            fairness_id: Some("a"),
            input_tokens: 1000,
            output_tokens: 500,
            ..PickRequest::default()
        };
        let close = |got: [f64; 3], want: [f64; 3]| {
            assert!(
                got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-12),
                "{got:?}"
            );
        };
        // A user without tokens: ideal endpoint 0; max cost 1 * 2 + 1 * 1.
        let mut out = [0.0; 3];
        v.score(&req, &ctx, &mut out).expect("score");
        close(out, [1.0, 1.0 - 1.5 / 3.0, 0.0]);
        // Charged 1000 + 2 * 500 = 2000 tokens, the only user: ideal 1.
        v.started(&req, &names, 0, None).expect("started");
        v.score(&req, &ctx, &mut out).expect("score");
        close(out, [1.0 - 1.0 / 3.0, 1.0 - 0.5 / 3.0, 1.0 - 2.0 / 3.0]);
        // The usage was 1000 in, 0 out: the charge is corrected to 1000.
        v.completed(&req, 1000, 0);
        let vtc = v.as_any_mut().downcast_mut::<VtcScorer>().expect("vtc");
        assert_eq!(vtc.tokens("a", 0.0), 1000.0);
        let err =
            build(&serde_json::json!({"window": 60}), &PickConfig::default()).expect_err("unknown");
        assert!(
            err.to_string().starts_with("window: unknown parameter"),
            "{err}"
        );
    }
}
