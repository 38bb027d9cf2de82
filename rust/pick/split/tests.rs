use super::*;
use crate::pick::preset_specs;

fn pipeline(n: usize) -> Pipeline {
    let mut specs = preset_specs("prefix").expect("preset");
    for s in &mut specs {
        if s.name == "prefix" {
            s.params = serde_json::json!({"block_size": 4});
        }
    }
    let names: Vec<String> = (0..n).map(|i| format!("e{i}")).collect();
    Pipeline::from_specs(&specs, &names, &PickConfig::default()).expect("pipeline")
}

fn roles(words: &[&str]) -> Vec<Role> {
    words
        .iter()
        .map(|w| Role::parse(w).expect("role"))
        .collect()
}

fn request(hashes: &[u64], input_tokens: u64) -> PickRequest<'_> {
    PickRequest {
        hashes,
        input_tokens,
        output_tokens: 8,
        now: 1.0,
        ..PickRequest::default()
    }
}

#[test]
fn role_words_round_trip_and_say_what_an_endpoint_may_do() {
    for w in ROLES {
        assert_eq!(Role::parse(w).expect("role").as_str(), w);
    }
    assert!(Role::parse("prefill-decode").is_err());
    let can = |r: Role| (r.decodes(), r.prefills());
    assert_eq!(can(Role::Prefill), (false, true));
    assert_eq!(can(Role::Decode), (true, false));
    assert_eq!(can(Role::Both), (true, true));
    assert_eq!(Role::default(), Role::Both);
}

#[test]
fn deciders_split_by_their_rule() {
    let d = |name, t| Decider::new(name, t).expect("decider");
    assert!(d("always", None).split(0, f64::INFINITY));
    assert!(!d("never", None).split(u64::MAX, 0.0));
    let tokens = d("uncached-tokens", Some(100.0));
    assert_eq!(tokens, Decider::UncachedTokens { threshold: 100 });
    assert!(!tokens.split(100, 0.0));
    assert!(tokens.split(101, 1e9));
    let load = d("prefill-load", Some(4.0));
    assert!(load.split(0, 4.0));
    assert!(!load.split(u64::MAX, 4.5));
    for name in DECIDERS {
        let t = matches!(name, "uncached-tokens" | "prefill-load").then_some(1.0);
        assert_eq!(d(name, t).name(), name);
    }
}

#[test]
fn a_bad_decider_is_refused_with_its_reason() {
    let err = |name, t| Decider::new(name, t).expect_err("refused").to_string();
    assert!(err("sometimes", None).contains("unknown decider"));
    assert!(err("always", Some(1.0)).contains("takes no threshold"));
    assert!(err("uncached-tokens", None).contains("needs a threshold"));
    assert!(err("uncached-tokens", Some(1.5)).contains("whole number"));
    assert!(err("prefill-load", Some(-1.0)).contains(">= 0"));
    assert!(err("prefill-load", Some(f64::NAN)).contains("finite"));
}

#[test]
fn roles_that_leave_a_pool_unable_to_serve_are_refused() {
    let always = Decider::Always;
    let e = check_roles(&roles(&["prefill", "prefill"]), Decider::Never);
    assert!(e
        .expect_err("no decode")
        .to_string()
        .contains("none can serve"));
    let e = check_roles(&roles(&["decode", "decode"]), always);
    assert!(e
        .expect_err("no prefill")
        .to_string()
        .contains("no prefill endpoint"));
    // Aggregated by decision, decode endpoints alone serve.
    check_roles(&roles(&["decode", "decode"]), Decider::Never).expect("never");
    check_roles(&roles(&["decode", "both"]), always).expect("both prefills");
    check_roles(&roles(&["prefill", "decode"]), always).expect("split");
    check_roles(&[], always).expect("empty pool");
    let p = pipeline(2);
    let e = Split::new(&p, roles(&["both"]), always).expect_err("count");
    assert!(e.to_string().contains("1 roles for 2 endpoints"));
}

#[test]
fn decode_is_picked_among_decoders_and_prefill_among_prefillers_both_started() {
    let r = roles(&["prefill", "decode", "decode", "prefill"]);
    let mut decode = pipeline(4);
    let mut split = Split::new(&decode, r, Decider::Always).expect("split");
    let mut states = vec![EndpointState::default(); 4];
    let mut ranked = Vec::new();
    let mut seen = Vec::new();
    for k in 0..8u64 {
        let hashes: Vec<u64> = (0..4).map(|b| k * 10 + b).collect();
        let pair = split
            .pick(&mut decode, &request(&hashes, 16), &mut states, &mut ranked)
            .expect("pick")
            .expect("placed");
        let (p, _) = pair.prefill.clone().expect("split");
        assert!([1, 2].contains(&pair.decode), "{pair:?}");
        assert!([0, 3].contains(&p), "{pair:?}");
        assert!(ranked.iter().all(|i| [1, 2].contains(i)), "{ranked:?}");
        assert_eq!(pair.recorded.hashes, hashes);
        seen.push((pair.decode, p));
    }
    // Both phases count what they started: the load spreads over each tier.
    let flights: Vec<u64> = states.iter().map(|s| s.in_flight).collect();
    assert_eq!(flights, [4, 4, 4, 4]);
    assert_eq!(states[0].dispatched_since_scrape, 4);
    // Every prefill endpoint recorded the prompts it prefilled.
    let index = decode.prefix().expect("prefix").index().clone();
    let held = index.lock().expect("index").endpoints();
    assert_eq!(held.len(), 4, "{held:?}");
}

#[test]
fn uncached_tokens_decider_splits_a_new_prompt_and_keeps_a_cached_one_local() {
    let r = roles(&["decode", "prefill"]);
    let mut decode = pipeline(2);
    let decider = Decider::new("uncached-tokens", Some(8.0)).expect("decider");
    let mut split = Split::new(&decode, r, decider).expect("split");
    let mut states = vec![EndpointState::default(); 2];
    let mut ranked = Vec::new();
    let hashes = [1, 2, 3, 4];
    let mut pick = |states: &mut Vec<EndpointState>, input| {
        split
            .pick(&mut decode, &request(&hashes, input), states, &mut ranked)
            .expect("pick")
            .expect("placed")
    };
    let first = pick(&mut states, 16);
    assert_eq!((first.uncached_tokens, first.prefill.is_some()), (16, true));
    // The decode endpoint now holds the 4 blocks of 4 tokens: 2 uncached.
    let again = pick(&mut states, 18);
    assert_eq!((again.uncached_tokens, again.prefill.is_some()), (2, false));
    assert_eq!(states[0].in_flight, 2);
    assert_eq!(states[1].in_flight, 1);
}

#[test]
fn prefill_load_decider_keeps_the_prefill_local_when_the_prefill_tier_is_busy() {
    let r = roles(&["decode", "prefill"]);
    let mut decode = pipeline(2);
    let decider = Decider::new("prefill-load", Some(2.0)).expect("decider");
    let mut split = Split::new(&decode, r, decider).expect("split");
    let mut states = vec![EndpointState::default(); 2];
    states[1].waiting = Some(2.0);
    states[1].running = Some(0.0);
    let mut ranked = Vec::new();
    let req = request(&[], 16);
    let pair = split.pick(&mut decode, &req, &mut states, &mut ranked);
    assert!(pair.expect("pick").expect("placed").prefill.is_some());
    // One more dispatched since the scrape: load 3 > 2.
    let pair = split.pick(&mut decode, &req, &mut states, &mut ranked);
    assert_eq!(pair.expect("pick").expect("placed").prefill, None);
}

#[test]
fn no_healthy_prefill_endpoint_leaves_the_request_aggregated_on_its_decoder() {
    let r = roles(&["decode", "prefill", "prefill"]);
    let mut decode = pipeline(3);
    let mut split = Split::new(&decode, r, Decider::Always).expect("split");
    let mut states = vec![EndpointState::default(); 3];
    states[1].healthy = false;
    states[2].healthy = false;
    let mut ranked = Vec::new();
    let pair = split
        .pick(&mut decode, &request(&[], 4), &mut states, &mut ranked)
        .expect("pick")
        .expect("placed");
    assert_eq!((pair.decode, pair.prefill), (0, None));
    assert_eq!(ranked, [0]);
}

#[test]
fn no_decoder_left_changes_nothing() {
    let r = roles(&["decode", "prefill"]);
    let mut decode = pipeline(2);
    let mut split = Split::new(&decode, r, Decider::Always).expect("split");
    let mut states = vec![EndpointState::default(); 2];
    states[0].healthy = false;
    let before = (decode.to_bytes(), states.clone());
    let mut ranked = Vec::new();
    let out = split.pick(&mut decode, &request(&[7, 8], 8), &mut states, &mut ranked);
    assert_eq!(out.expect("pick"), None);
    assert_eq!((decode.to_bytes(), states), before);
    // A subset hint outside the pool is bad input, refused before anything.
    let bad = [5usize];
    let req = PickRequest {
        subset: Some(&bad),
        ..request(&[], 8)
    };
    let mut states = vec![EndpointState::default(); 2];
    assert!(split
        .pick(&mut decode, &req, &mut states, &mut ranked)
        .is_err());
    assert_eq!(states, vec![EndpointState::default(); 2]);
}

#[test]
fn a_released_pair_gives_back_both_endpoints() {
    let r = roles(&["decode", "prefill"]);
    let mut decode = pipeline(2);
    let mut split = Split::new(&decode, r, Decider::Always).expect("split");
    let mut states = vec![EndpointState::default(); 2];
    let mut ranked = Vec::new();
    let req = request(&[1], 4);
    let pair = split
        .pick(&mut decode, &req, &mut states, &mut ranked)
        .expect("pick")
        .expect("placed");
    let (p, _) = pair.prefill.expect("split");
    split
        .prefill_done(&req, p, 4, &mut states)
        .expect("prefill");
    states[pair.decode].in_flight -= 1;
    assert!(states.iter().all(|s| s.in_flight == 0));
    assert!(split.prefill_done(&req, 9, 4, &mut states).is_err());
}
