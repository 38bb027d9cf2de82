//! Filter `serves-adapter`: keeps the endpoints that serve the request's LoRA
//! adapter (`vllm:lora_requests_info`); every endpoint for the base model.
//! Soft: when none serves it, any endpoint may load it.

use super::plugin::{filter_without_params, Describe, Filter, Kind, Needs};
use super::PickRequest;
use crate::endpoint::EndpointState;

pub const PLUGIN: Describe = Describe {
    name: "serves-adapter",
    kind: Kind::Filter { soft: true },
    needs: Needs::SCRAPED,
    build: filter_without_params::<ServesAdapter>,
    shared: None,
    resolve: None,
};

#[derive(Debug, Clone, Copy, Default)]
pub struct ServesAdapter;

impl Filter for ServesAdapter {
    fn keep(&self, req: &PickRequest<'_>, _: usize, s: &EndpointState) -> bool {
        serves(req, s)
    }
}

/// Whether `s` serves `req`'s adapter (always for the base model).
pub(super) fn serves(req: &PickRequest<'_>, s: &EndpointState) -> bool {
    req.adapter
        .is_none_or(|a| s.adapters.iter().any(|x| x == a))
}

#[cfg(test)]
mod tests {
    use super::super::{PickConfig, Pipeline, PluginSpec};
    use super::*;

    #[test]
    fn keeps_the_servers_of_the_adapter_and_is_skipped_when_none_does() {
        let mut states = vec![EndpointState::default(); 3];
        states[1].adapters = vec!["sql".into()];
        let specs = [
            PluginSpec::new("serves-adapter", 1.0),
            PluginSpec::with("max-score", 1.0, serde_json::json!({"ties": "first"})),
        ];
        let mut p = Pipeline::from_specs(&specs, &["a", "b", "c"], &PickConfig::default())
            .expect("pipeline");
        let req = |adapter| PickRequest {
            adapter,
            ..PickRequest::default()
        };
        let mut out = Vec::new();
        p.pick(&req(Some("sql")), &states, &mut out).expect("pick");
        assert_eq!(out, vec![1], "only b serves sql");
        p.pick(&req(None), &states, &mut out).expect("pick");
        assert_eq!(out, vec![0, 1, 2], "the base model: every endpoint");
        p.pick(&req(Some("chat")), &states, &mut out).expect("pick");
        assert_eq!(out, vec![0, 1, 2], "none serves chat: soft, skipped");
    }
}
