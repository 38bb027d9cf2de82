//! Filter `saturation`: drops endpoints whose engine queue (scraped waiting
//! requests plus the dispatches since that scrape) is above `max_waiting` or
//! whose KV-cache use is above `max_kv_usage` (the GIE's saturation
//! detector, [`crate::endpoint::Saturation`], which is also its parameter
//! struct). Unknown values pass. Soft: when every endpoint is saturated the
//! filter is skipped.

use serde_json::Value;

use super::plugin::{params, Built, Describe, Filter, Kind, Needs, Shared};
use super::{PickConfig, PickRequest};
use crate::endpoint::{EndpointState, Saturation};
use crate::error::Result;

pub const PLUGIN: Describe = Describe {
    name: "saturation",
    kind: Kind::Filter { soft: true },
    needs: Needs::SCRAPED,
    build,
    shared: Some(|s: &Shared| {
        serde_json::json!({
            "max_waiting": s.saturation.max_waiting, "max_kv_usage": s.saturation.max_kv_usage
        })
    }),
    resolve: None,
};

fn build(p: &Value, _: &PickConfig) -> Result<Built> {
    Ok(Built::Filter(Box::new(params::<Saturation>(p)?.check()?)))
}

impl Filter for Saturation {
    fn keep(&self, _: &PickRequest<'_>, _: usize, s: &EndpointState) -> bool {
        !self.saturated(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_default_check_and_name_the_bad_key() {
        let Built::Filter(f) = build(&serde_json::json!({}), &PickConfig::default()).expect("f")
        else {
            panic!("a filter")
        };
        let req = PickRequest::default();
        let mut s = EndpointState {
            waiting: Some(5.0),
            running: Some(0.0),
            ..EndpointState::default()
        };
        assert!(f.keep(&req, 0, &s), "5 waiting is at the default bound");
        s.dispatched_since_scrape = 1;
        assert!(!f.keep(&req, 0, &s), "one dispatch more is above it");
        let tight = build(
            &serde_json::json!({"max_waiting": 10}),
            &PickConfig::default(),
        );
        let Ok(Built::Filter(tight)) = tight else {
            panic!("a filter")
        };
        assert!(tight.keep(&req, 0, &s));
        let err = build(
            &serde_json::json!({"max_kv_usage": 1.5}),
            &PickConfig::default(),
        )
        .expect_err("out of range");
        assert!(err.to_string().contains("max_kv_usage"), "{err}");
        let err = build(
            &serde_json::json!({"max_waiting": "5"}),
            &PickConfig::default(),
        )
        .expect_err("not a number");
        assert!(
            err.to_string().starts_with("max_waiting: invalid type"),
            "{err}"
        );
    }
}
