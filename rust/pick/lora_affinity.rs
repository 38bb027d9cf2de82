//! Scorer `lora-affinity` (after the GIE's LoRA affinity scorer): 1 for
//! the endpoints that serve the request's LoRA adapter already (the
//! scraped `vllm:lora_requests_info`), 0 for the others; 1 for every
//! endpoint when the request names none. Where `serves-adapter` drops the
//! endpoints without the adapter, this prefers those with it, weighed
//! against the other scorers.
//!
//! This file and its line in `registry.rs` are all a scorer takes.

use super::adapter::serves;
use super::plugin::{scorer_without_params, Describe, Kind, Needs, Scorer};
use super::{Ctx, PickRequest};
use crate::error::Result;

pub const PLUGIN: Describe = Describe {
    name: "lora-affinity",
    kind: Kind::Scorer,
    needs: Needs::SCRAPED,
    build: scorer_without_params::<LoraAffinity>,
    shared: None,
    resolve: None,
};

#[derive(Debug, Clone, Copy, Default)]
pub struct LoraAffinity;

impl Scorer for LoraAffinity {
    fn score(&mut self, req: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()> {
        for (o, &i) in out.iter_mut().zip(ctx.cand) {
            *o = if serves(req, &ctx.states[i]) {
                1.0
            } else {
                0.0
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PickConfig, Pipeline, PluginSpec};
    use super::*;
    use crate::endpoint::EndpointState;

    #[test]
    fn prefers_the_endpoints_serving_the_adapter_against_load() {
        // a serves "sql" but is busier; b is idle.
        let mut states = vec![EndpointState::default(); 2];
        states[0].adapters = vec!["sql".into()];
        states[0].in_flight = 3;
        let specs = |w: f64| {
            [
                PluginSpec::new("least-request", 1.0),
                PluginSpec::new("lora-affinity", w),
                PluginSpec::with("max-score", 1.0, serde_json::json!({"ties": "first"})),
            ]
        };
        let req = |adapter| PickRequest {
            adapter,
            ..PickRequest::default()
        };
        let cfg = PickConfig::default();
        let mut p = Pipeline::from_specs(&specs(2.0), &["a", "b"], &cfg).expect("pipeline");
        assert_eq!(p.pick_one(&req(Some("sql")), &states), Ok(Some(0)));
        assert_eq!(
            p.pick_one(&req(None), &states),
            Ok(Some(1)),
            "base model: load"
        );
        let mut light = Pipeline::from_specs(&specs(0.5), &["a", "b"], &cfg).expect("pipeline");
        assert_eq!(
            light.pick_one(&req(Some("sql")), &states),
            Ok(Some(1)),
            "load wins"
        );
    }
}
