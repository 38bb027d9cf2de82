use std::sync::Mutex;
use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::{json, Value};

use super::support::{body, plane, DECODE};
use super::*;
use crate::pd::handshake::FALLBACKS;
use crate::serve::engine::{Engine, Hints};
use crate::serve::metrics::FallbackLabels;

#[test]
fn request_paths() {
    for (p, want) in [
        (Some(&b"/v1/completions"[..]), "/v1/completions"),
        (Some(b"/v1/chat/completions?x=1"), "/v1/chat/completions"),
        (Some(b"/admin"), "/v1/chat/completions"),
        (Some(b"/v1/a b"), "/v1/chat/completions"),
        (Some(&[0xff][..]), "/v1/chat/completions"),
        (None, "/v1/chat/completions"),
    ] {
        assert_eq!(request_path(p), want, "{p:?}");
    }
}

/// What a mock prefill engine received: (path, headers, body) per request.
type Received = Arc<Mutex<Vec<(String, Vec<(String, String)>, Value)>>>;

/// A prefill engine on loopback answering every POST with `status` and
/// `answer`; what it received is recorded.
async fn mock_engine(status: u16, answer: Value) -> (String, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address").to_string();
    let received: Received = Arc::default();
    let log = Arc::clone(&received);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (log, answer) = (Arc::clone(&log), answer.to_string());
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let (log, answer) = (Arc::clone(&log), answer.clone());
                    async move {
                        let path = req.uri().path().to_string();
                        let headers = req
                            .headers()
                            .iter()
                            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
                            .collect();
                        let body = req.into_body().collect().await.expect("body").to_bytes();
                        let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        log.lock().expect("log").push((path, headers, body));
                        hyper::Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::from(answer)))
                    }
                });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    (address, received)
}

/// A free loopback address nothing listens on.
fn dead_address() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("address").to_string()
}

/// Routes one request and hands it off: (the routed request, the lease's
/// in-flight counts on [DECODE, prefill]).
async fn hand(shared: &Arc<Shared>, engine: &Arc<Engine>) -> (Routed, Vec<u64>) {
    let b = body();
    let mut r = engine
        .route_body(&b, None, &Hints::default())
        .await
        .expect("ok")
        .expect("routed");
    assert!(r.prefill_endpoint.is_some(), "split");
    let h = &engine.handoffs[0];
    hand_off(shared, h, &mut r, &b, "/v1/chat/completions", 10000, None).await;
    assert_eq!(
        r.prefill_endpoint, None,
        "no sidecar header: routecore sent the prefill"
    );
    let loads = engine.choosers[0].loads();
    (r, loads)
}

fn fallbacks(shared: &Shared, reason: &str) -> f64 {
    shared
        .metrics
        .pd
        .fallbacks
        .get_or_create(&FallbackLabels {
            pool: "p".into(),
            reason: reason.into(),
        })
        .get()
}

#[tokio::test]
async fn vllm_sends_the_prefill_then_the_decode_carries_its_params() {
    let params = json!({"do_remote_prefill": true, "remote_engine_id": "e1",
                        "remote_block_ids": [4, 5], "remote_host": "10.0.0.2", "remote_port": 5600});
    let (prefill, received) =
        mock_engine(200, json!({"choices": [], "kv_transfer_params": params})).await;
    let (shared, engine) = plane(&prefill, json!({"decider": "always", "handoff": "vllm"}));
    let (r, loads) = hand(&shared, &engine).await;
    // The prefill engine got one request: one token, unstreamed, remote decode.
    let got = received.lock().expect("log").clone();
    assert_eq!(got.len(), 1);
    let (path, headers, sent) = &got[0];
    assert_eq!(path, "/v1/chat/completions");
    assert_eq!(
        (sent["max_tokens"].clone(), sent["stream"].clone()),
        (json!(1), json!(false))
    );
    assert_eq!(sent["kv_transfer_params"]["do_remote_decode"], true);
    let names: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
    assert!(
        !names.contains(&"x-api-key"),
        "no client header reaches the engine: {names:?}"
    );
    // The decode request: the client's body with the prefill's params.
    let decode: Value =
        serde_json::from_slice(r.body.as_deref().expect("rewritten")).expect("JSON");
    let mut want: Value = serde_json::from_slice(&body()).expect("JSON");
    want["kv_transfer_params"] = params;
    assert_eq!(decode, want);
    // The prefill half is released as soon as it answered; the decode holds.
    assert_eq!(loads, vec![1, 0]);
    assert!(!shared.release_prefill(r.id), "released once");
    assert!(shared.release(r.id, None));
    assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
    assert_eq!(FALLBACKS.map(|f| fallbacks(&shared, f)), [0.0; 5]);
}

#[tokio::test]
async fn a_failed_prefill_is_served_aggregated_counted_and_released_once() {
    let no_params = json!({"choices": [], "kv_transfer_params": null});
    for (case, reason) in [
        ("dead", "connect"),
        ("500", "status"),
        ("null", "no-params"),
    ] {
        let prefill = match case {
            "dead" => dead_address(),
            "500" => mock_engine(500, json!({"error": "boom"})).await.0,
            _ => mock_engine(200, no_params.clone()).await.0,
        };
        let (shared, engine) = plane(&prefill, json!({"decider": "always", "handoff": "vllm"}));
        for k in 1..=2 {
            let (r, loads) = hand(&shared, &engine).await;
            assert_eq!(r.body, None, "{case}: the body goes as it came");
            assert_eq!(
                loads,
                vec![k, 0],
                "{case}: the prefill endpoint is given back"
            );
            assert_eq!(fallbacks(&shared, reason), k as f64, "{case}");
        }
    }
    // Optional params (a connector that hands the KV over by itself): no fallback.
    let (prefill, _) = mock_engine(200, no_params).await;
    let disagg =
        json!({"decider": "always", "handoff": "vllm", "require_kv_transfer_params": false});
    let (shared, engine) = plane(&prefill, disagg);
    let (r, loads) = hand(&shared, &engine).await;
    assert!(r.body.is_some());
    assert_eq!((loads, fallbacks(&shared, "no-params")), (vec![1, 0], 0.0));
}

#[tokio::test]
async fn a_prefill_past_its_timeout_falls_back() {
    // Accepts and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let prefill = listener.local_addr().expect("address").to_string();
    let disagg = json!({"decider": "always", "handoff": "vllm", "prefill_timeout_s": 0.2});
    let (shared, engine) = plane(&prefill, disagg);
    let (r, loads) = hand(&shared, &engine).await;
    assert_eq!((r.body, loads), (None, vec![1, 0]));
    assert_eq!(fallbacks(&shared, "timeout"), 1.0);
    drop(listener);
}

#[tokio::test]
async fn sglang_sends_the_same_body_to_both_with_one_room() {
    let (prefill, received) = mock_engine(200, json!({"choices": []})).await;
    let disagg = json!({"decider": "always", "handoff": "sglang", "bootstrap_port": 8998});
    let (shared, engine) = plane(&prefill, disagg);
    let (r, _) = hand(&shared, &engine).await;
    let decode: Value =
        serde_json::from_slice(r.body.as_deref().expect("rewritten")).expect("JSON");
    assert_eq!(decode["bootstrap_host"], "127.0.0.1");
    assert_eq!(decode["bootstrap_port"], 8998);
    assert!(decode["bootstrap_room"]
        .as_u64()
        .is_some_and(|room| room <= MAX_ROOM));
    // The prefill task sends the same body and ends the prefill half.
    for _ in 0..200 {
        if engine.choosers[0].loads() == vec![1, 0] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(engine.choosers[0].loads(), vec![1, 0]);
    let got = received.lock().expect("log").clone();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].2, decode, "the same body, the same room");
    assert!(shared.release(r.id, None));
    assert_eq!(engine.choosers[0].loads(), vec![0, 0]);
    // A dead prefill endpoint: aggregated.
    let (shared, engine) = plane(
        &dead_address(),
        json!({"decider": "always", "handoff": "sglang"}),
    );
    let (r, loads) = hand(&shared, &engine).await;
    assert_eq!((r.body, loads), (None, vec![1, 0]));
    assert_eq!(fallbacks(&shared, "connect"), 1.0);
}

#[tokio::test]
async fn the_header_handoff_leaves_the_request_to_the_sidecar() {
    let (shared, engine) = plane(&dead_address(), json!({"decider": "always"}));
    let b = body();
    let mut r = engine
        .route_body(&b, None, &Hints::default())
        .await
        .expect("ok")
        .expect("routed");
    let before = r.clone();
    hand_off(
        &shared,
        &engine.handoffs[0],
        &mut r,
        &b,
        "/v1/chat/completions",
        10000,
        None,
    )
    .await;
    assert_eq!(r, before);
    assert_eq!(engine.choosers[0].loads(), vec![1, 1]);
}

#[tokio::test]
async fn roles_are_a_gauge_per_endpoint() {
    let (shared, _engine) = plane("10.0.0.9:8000", json!({"decider": "always"}));
    let text = shared.metrics.text();
    for (e, role) in [(DECODE, "decode"), ("10.0.0.9:8000", "prefill")] {
        let line =
            format!("routecore_endpoint_role{{pool=\"p\",endpoint=\"{e}\",role=\"{role}\"}} 1");
        assert!(text.contains(&line), "{line} in\n{text}");
    }
}
