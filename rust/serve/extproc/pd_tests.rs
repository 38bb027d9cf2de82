//! Prefill/decode disaggregation through a whole ext_proc conversation:
//! the paths that end a split request while routecore sends its prefill
//! (`serve::pd_send`).

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Msg, HttpBody, HttpHeaders, ProcessingRequest,
};
use serde_json::json;

use super::Conversation;
use crate::serve::pd_send::support::{body, plane};

#[tokio::test]
async fn a_client_gone_while_the_prefill_is_out_releases_both_endpoints_once() {
    // A prefill engine that accepts and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let prefill = listener.local_addr().expect("address").to_string();
    let (shared, engine) = plane(&prefill, json!({"decider": "always", "handoff": "vllm"}));
    let mut conv = Conversation::new(Arc::clone(&engine), Arc::clone(&shared));
    let headers = ProcessingRequest {
        request: Some(Msg::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap::default()),
            ..Default::default()
        })),
        ..Default::default()
    };
    conv.handle(&headers).await.expect("headers");
    let last = ProcessingRequest {
        request: Some(Msg::RequestBody(HttpBody {
            body: body(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    // The stream ends (Envoy cancels it) while routecore waits for the prefill.
    let waited = tokio::time::timeout(Duration::from_millis(300), conv.handle(&last)).await;
    assert!(waited.is_err(), "still waiting for the prefill");
    assert_eq!(
        engine.choosers[0].loads(),
        vec![1, 1],
        "both held meanwhile"
    );
    drop(conv);
    assert_eq!(engine.choosers[0].loads(), vec![0, 0], "both released");
    assert_eq!(shared.metrics.in_flight_gauge("p", &prefill).get(), 0.0);
    drop(listener);
}
