//! Filter `healthy`: keeps the endpoints whose health checks pass
//! (`EndpointState::healthy`, kept by the scraper). Hard: with none healthy
//! the answer is empty, never a dead address.

use super::plugin::{filter_without_params, Describe, Filter, Kind, Needs};
use super::PickRequest;
use crate::endpoint::EndpointState;

pub const PLUGIN: Describe = Describe {
    name: "healthy",
    kind: Kind::Filter { soft: false },
    needs: Needs::SCRAPED,
    build: filter_without_params::<Healthy>,
    shared: None,
    resolve: None,
};

#[derive(Debug, Clone, Copy, Default)]
pub struct Healthy;

impl Filter for Healthy {
    fn keep(&self, _: &PickRequest<'_>, _: usize, s: &EndpointState) -> bool {
        s.healthy
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PickConfig, PluginSpec};
    use super::*;

    #[test]
    fn keeps_the_healthy_and_takes_no_parameter() {
        let req = PickRequest::default();
        let mut s = EndpointState::default();
        assert!(Healthy.keep(&req, 0, &s));
        s.healthy = false;
        assert!(!Healthy.keep(&req, 0, &s));
        let spec = PluginSpec::with("healthy", 1.0, serde_json::json!({"strict": true}));
        let err = super::super::Pipeline::from_specs(&[spec], &["a"], &PickConfig::default())
            .expect_err("no parameter");
        assert!(
            err.to_string().contains("strict: unknown parameter"),
            "{err}"
        );
    }
}
