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
