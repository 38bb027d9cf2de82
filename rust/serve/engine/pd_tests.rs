//! Prefill/decode disaggregation in the data plane: a split pool's lease
//! holds both endpoints and every path that ends it releases both once.

use super::*;
use crate::serve::config::testing::plane_json;

const ENDPOINTS: [&str; 4] = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"];

/// A data plane over one pool of four endpoints, the last two `prefill`,
/// the others `decode`, split by `decider`; requests time out after
/// `timeout_s`.
fn split_plane(decider: serde_json::Value, timeout_s: f64) -> (Arc<Shared>, Arc<Engine>) {
    let pool = serde_json::json!({
        "name": "p", "max_context": 8192, "budget": null, "queue_limit": null,
        "endpoints": ENDPOINTS, "role": "decode",
        "roles": {ENDPOINTS[2]: "prefill", ENDPOINTS[3]: "prefill"},
        "disaggregation": decider
    });
    let mut json = plane_json("prefix+queue+kv", serde_json::json!([pool]));
    json["limits"]["request_timeout_s"] = timeout_s.into();
    test_plane(Spec::from_json(&json.to_string()).expect("spec"))
}

fn body(k: usize) -> Vec<u8> {
    let text = format!("request {k} ").repeat(40);
    serde_json::json!({"messages": [{"role": "user", "content": text}], "max_tokens": 10})
        .to_string()
        .into_bytes()
}

async fn route(engine: &Arc<Engine>, k: usize) -> Routed {
    let r = engine.route_body(&body(k), None, &Hints::default()).await;
    r.expect("ok").expect("routed")
}

/// Requests in flight per endpoint: the chooser's counts and the gauges.
fn flights(shared: &Shared, engine: &Engine) -> (Vec<u64>, Vec<f64>) {
    let gauges = ENDPOINTS
        .iter()
        .map(|e| shared.metrics.in_flight_gauge("p", e).get())
        .collect();
    (engine.choosers[0].loads(), gauges)
}

#[tokio::test]
async fn a_split_request_holds_a_decode_and_a_prefill_endpoint_released_once() {
    let (shared, engine) = split_plane(serde_json::json!({"decider": "always"}), 30.0);
    let mut ids = Vec::new();
    for k in 0..4 {
        let r = route(&engine, k).await;
        assert!(ENDPOINTS[..2].contains(&r.endpoint.as_str()), "{r:?}");
        let p = r.prefill_endpoint.as_deref().expect("split");
        assert!(ENDPOINTS[2..].contains(&p), "{r:?}");
        assert!(r
            .fallbacks
            .iter()
            .all(|f| ENDPOINTS[..2].contains(&f.as_str())));
        ids.push(r.id);
    }
    assert_eq!(flights(&shared, &engine), (vec![2; 4], vec![2.0; 4]));
    let split = shared.metrics.value("disaggregated", &["p"]);
    assert_eq!(split, Some(4.0));
    for id in &ids {
        assert!(shared.release(*id, Some((100, 5))));
        assert!(!shared.release(*id, None), "released twice");
    }
    assert_eq!(flights(&shared, &engine), (vec![0; 4], vec![0.0; 4]));
}

#[tokio::test]
async fn a_reaped_or_shut_down_split_request_releases_both_endpoints() {
    let (shared, engine) = split_plane(serde_json::json!({"decider": "always"}), 0.01);
    route(&engine, 1).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(shared.reap(), 1);
    assert_eq!(flights(&shared, &engine), (vec![0; 4], vec![0.0; 4]));
    route(&engine, 2).await;
    shared.close().await;
    assert_eq!(flights(&shared, &engine), (vec![0; 4], vec![0.0; 4]));
}

#[tokio::test]
async fn the_uncached_tokens_decider_keeps_a_repeated_prompt_on_its_decoder() {
    let decider = serde_json::json!({"decider": "uncached-tokens", "threshold": 64});
    let (shared, engine) = split_plane(decider, 30.0);
    let first = route(&engine, 7).await;
    assert!(first.prefill_endpoint.is_some(), "a new prompt is split");
    let again = route(&engine, 7).await;
    assert_eq!(again.endpoint, first.endpoint, "the decoder holding it");
    assert_eq!(again.prefill_endpoint, None, "its prompt is cached there");
    for r in [first, again] {
        assert!(shared.release(r.id, None));
    }
    assert_eq!(flights(&shared, &engine).0, vec![0; 4]);
}

#[tokio::test]
async fn roles_that_leave_no_prefill_endpoint_are_refused_at_build() {
    let json = |roles: serde_json::Value| {
        let pool = serde_json::json!({
            "name": "p", "max_context": 8192, "budget": null, "queue_limit": null,
            "endpoints": ENDPOINTS[..2], "role": "decode", "roles": roles
        });
        plane_json("least-request", serde_json::json!([pool])).to_string()
    };
    let cal = Calibrator::new(0.95, 1.0, 4.0, 16).expect("cal");
    let shared = Arc::new(Shared::new(cal, tokio::runtime::Handle::current()));
    let build = |roles| {
        let spec = Spec::from_json(&json(roles)).expect("spec");
        Engine::build(spec, &shared, None).map(|_| ())
    };
    let e = build(serde_json::json!({})).expect_err("no prefill");
    assert!(e.to_string().contains("no prefill endpoint"), "{e}");
    let e = build(serde_json::json!({"10.9.9.9:1": "prefill"})).expect_err("unknown");
    assert!(e.to_string().contains("not an endpoint of the pool"), "{e}");
    build(serde_json::json!({ENDPOINTS[1]: "prefill"})).expect("split pool");
}

#[tokio::test]
async fn the_sheddable_gate_looks_at_the_endpoints_a_request_decodes_on() {
    let (_shared, engine) = split_plane(serde_json::json!({"decider": "always"}), 30.0);
    let chooser = &engine.choosers[0];
    let queues = |waiting: [f64; 4]| {
        let mut st = chooser.state.lock().expect("state");
        for (s, w) in st.picker.states.iter_mut().zip(waiting) {
            s.waiting = Some(w);
        }
    };
    let busy = crate::endpoint::Saturation::default().max_waiting + 1.0;
    // Both decoders saturated, the prefillers idle: no decode endpoint is
    // left for the request, so a sheddable one is shed.
    queues([busy, busy, 0.0, 0.0]);
    assert!(chooser.saturated(&Hints::default()));
    // The prefillers saturated, a decoder with room: not saturated.
    queues([busy, 0.0, busy, busy]);
    assert!(!chooser.saturated(&Hints::default()));
}
