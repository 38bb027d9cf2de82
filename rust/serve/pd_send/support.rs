//! The data plane of the prefill sender's tests, shared with ext_proc's
//! (`serve::extproc`'s P/D tests drive a whole conversation through it):
//! one pool whose every request is split.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::serve::config::testing::plane_json;
use crate::serve::config::Spec;
use crate::serve::engine::{test_plane, Engine, Shared};

/// The decode endpoint.
pub const DECODE: &str = "10.0.0.1:8000";

/// A data plane over one pool: DECODE decodes, `prefill` prefills, every
/// request is split and handed off by `handoff`.
pub fn plane(prefill: &str, disaggregation: Value) -> (Arc<Shared>, Arc<Engine>) {
    let pool = json!({"name": "p", "max_context": 8192, "budget": null, "queue_limit": null,
                      "endpoints": [DECODE, prefill], "role": "decode",
                      "roles": {prefill: "prefill"}, "disaggregation": disaggregation});
    let json = plane_json("least-request", json!([pool]));
    test_plane(Spec::from_json(&json.to_string()).expect("spec"))
}

/// A streamed chat request.
pub fn body() -> Vec<u8> {
    json!({"model": "m", "messages": [{"role": "user", "content": "Hello there"}],
           "max_tokens": 12, "stream": true})
    .to_string()
    .into_bytes()
}
