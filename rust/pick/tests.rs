use super::*;
use std::sync::{Arc, Mutex};

fn states(n: usize) -> Vec<EndpointState> {
    vec![EndpointState::default(); n]
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("e{i}")).collect()
}

fn req(now: f64) -> PickRequest<'static> {
    PickRequest {
        now,
        ..PickRequest::default()
    }
}

#[test]
fn least_request_is_the_least_loaded_first_on_ties() {
    let mut p = Pipeline::preset("least-request", &names(3), &PickConfig::default()).expect("p");
    let mut s = states(3);
    assert_eq!(p.pick_one(&req(0.0), &s), Ok(Some(0)));
    s[0].in_flight = 3;
    s[1].in_flight = 1;
    s[2].in_flight = 1;
    assert_eq!(p.pick_one(&req(0.0), &s), Ok(Some(1)));
    let mut out = Vec::new();
    p.pick(&req(0.0), &s, &mut out).expect("pick");
    assert_eq!(out, vec![1, 2, 0]);
    s[1].healthy = false;
    p.pick(&req(0.0), &s, &mut out).expect("pick");
    assert_eq!(out, vec![2, 0], "the unhealthy endpoint is filtered out");
    for st in &mut s {
        st.healthy = false;
    }
    p.pick(&req(0.0), &s, &mut out).expect("pick");
    assert!(
        out.is_empty(),
        "none healthy: no endpoint, never a dead one"
    );
}

#[test]
fn queue_and_kv_scores_are_weighted_in_unit_range() {
    let mut p = Pipeline::preset("queue+kv", &names(3), &PickConfig::default()).expect("p");
    let mut s = states(3);
    // Queues 0, 2, 4 score 1, 0.5, 0; KV uses 0.5, 0.1, 0.0 score 0.5, 0.9, 1.
    for (st, (w, k)) in s.iter_mut().zip([(0.0, 0.5), (2.0, 0.1), (4.0, 0.0)]) {
        st.waiting = Some(w);
        st.running = Some(0.0);
        st.kv_usage = Some(k);
    }
    // Totals: 2 * (1 + 0.5) = 3, 2 * (0.5 + 0.9) = 2.8, 2 * (0 + 1) = 2.
    let mut out = Vec::new();
    p.pick(&req(0.0), &s, &mut out).expect("pick");
    assert_eq!(out, vec![0, 1, 2]);
    // Endpoint 0 saturated (KV above 0.8): filtered.
    s[0].kv_usage = Some(0.9);
    p.pick(&req(0.0), &s, &mut out).expect("pick");
    assert_eq!(out[0], 1);
    // All saturated: the soft filter is skipped (fallback).
    for st in &mut s {
        st.waiting = Some(50.0);
    }
    p.pick(&req(0.0), &s, &mut out).expect("pick");
    assert_eq!(out.len(), 3);
    // Dispatches since the scrape count in the queue.
    let mut q = Pipeline::preset("queue+kv", &names(2), &PickConfig::default()).expect("p");
    let mut s = states(2);
    for st in &mut s {
        st.waiting = Some(1.0);
        st.running = Some(0.0);
        st.kv_usage = Some(0.2);
    }
    s[0].dispatched_since_scrape = 2;
    assert_eq!(q.pick_one(&req(0.0), &s), Ok(Some(1)));
}

#[test]
fn bad_input_is_refused() {
    let cfg = PickConfig::default();
    let bad = |specs: &[PluginSpec]| Pipeline::from_specs(specs, &names(2), &cfg).is_err();
    assert!(bad(&[PluginSpec::new("nope", 1.0)]));
    assert!(bad(&[PluginSpec::new("least-request", -1.0)]));
    assert!(bad(&[PluginSpec::new("least-request", f64::NAN)]));
    assert!(bad(&[PluginSpec::with(
        "prefix",
        1.0,
        serde_json::json!({"blok_size": 4})
    )]));
    assert!(bad(&[
        PluginSpec::new("random", 1.0),
        PluginSpec::new("round-robin", 1.0)
    ]));
    assert!(Pipeline::preset("nope", &names(2), &cfg).is_err());
    assert!(Pipeline::preset("random", &["a", "a"], &cfg).is_err());
    let mut p = Pipeline::preset("least-request", &names(2), &cfg).expect("p");
    let mut out = Vec::new();
    assert!(p.pick(&req(f64::NAN), &states(2), &mut out).is_err());
    assert!(p.pick(&req(0.0), &states(3), &mut out).is_err());
    let subset = [5usize];
    let r = PickRequest {
        subset: Some(&subset),
        ..req(0.0)
    };
    assert!(p.pick(&r, &states(2), &mut out).is_err());
}

#[test]
fn pickers_round_robin_random_and_ties() {
    let cfg = PickConfig {
        seed: 7,
        ..PickConfig::default()
    };
    let s = states(4);
    let mut rr = Pipeline::preset("round-robin", &names(4), &cfg).expect("p");
    let seq: Vec<Option<usize>> = (0..6)
        .map(|_| rr.pick_one(&req(0.0), &s).expect("pick"))
        .collect();
    assert_eq!(seq, [0, 1, 2, 3, 0, 1].map(Some));
    // Equal totals under max-score, ties round-robin, also rotate.
    let specs = [
        PluginSpec::new("least-request", 1.0),
        PluginSpec::new("max-score", 1.0),
    ];
    let mut ties = Pipeline::from_specs(&specs, &names(3), &cfg).expect("p");
    let seq: Vec<Option<usize>> = (0..4)
        .map(|_| ties.pick_one(&req(0.0), &states(3)).expect("pick"))
        .collect();
    assert_eq!(seq, [0, 1, 2, 0].map(Some));
    // Random: the same seed draws the same sequence, over every endpoint.
    let draws = |seed: u64| -> Vec<usize> {
        let cfg = PickConfig {
            seed,
            ..PickConfig::default()
        };
        let mut p = Pipeline::preset("random", &names(4), &cfg).expect("p");
        (0..200)
            .map(|_| p.pick_one(&req(0.0), &s).expect("pick").expect("some"))
            .collect()
    };
    assert_eq!(draws(1), draws(1));
    assert_ne!(draws(1), draws(2));
    let d = draws(3);
    assert!((0..4).all(|e| d.iter().filter(|&&x| x == e).count() > 20));
    // Weighted random: a zero score is never drawn while another is positive.
    let specs = [
        PluginSpec::new("least-request", 1.0),
        PluginSpec::with("random", 1.0, serde_json::json!({"seed": 5})),
    ];
    let mut w = Pipeline::from_specs(&specs, &names(2), &cfg).expect("p");
    let mut s2 = states(2);
    s2[1].in_flight = 9;
    assert!((0..100).all(|_| w.pick_one(&req(0.0), &s2) == Ok(Some(0))));
}

#[test]
fn subset_hint_adapter_and_session_affinity() {
    let specs: Vec<PluginSpec> = preset_specs("least-request")
        .expect("preset")
        .into_iter()
        .chain([PluginSpec::new("session-affinity", 10.0)])
        .collect();
    let mut p = Pipeline::from_specs(&specs, &names(3), &PickConfig::default()).expect("p");
    let mut s = states(3);
    let subset = [1usize, 2];
    let r = PickRequest {
        subset: Some(&subset),
        ..req(0.0)
    };
    assert_eq!(p.pick_one(&r, &s), Ok(Some(1)));
    s[1].healthy = false;
    s[2].healthy = false;
    assert_eq!(p.pick_one(&r, &s), Ok(None), "a hard filter leaves none");
    s[1].healthy = true;
    s[2].healthy = true;
    // Adapter: served by endpoint 2 only; when none serves it, anyone.
    s[2].adapters = vec!["sql-lora".into()];
    let r = PickRequest {
        adapter: Some("sql-lora"),
        ..req(0.0)
    };
    assert_eq!(p.pick_one(&r, &s), Ok(Some(2)));
    let r = PickRequest {
        adapter: Some("other"),
        ..req(0.0)
    };
    assert_eq!(p.pick_one(&r, &s), Ok(Some(0)));
    // Session: bound on start, kept while it outweighs the load.
    let r = PickRequest {
        session: Some("chat-1"),
        ..req(0.0)
    };
    s[1].in_flight = 0;
    s[0].in_flight = 1;
    assert_eq!(p.pick_one(&r, &s), Ok(Some(1)));
    p.started(&r, 1).expect("start");
    s[1].in_flight = 5;
    assert_eq!(p.pick_one(&r, &s), Ok(Some(1)), "affinity outweighs load");
    // Removing endpoint 0 moves the binding to index 0.
    p.remove_endpoint("e0").expect("remove");
    s.remove(0);
    assert_eq!(p.pick_one(&r, &s), Ok(Some(0)));
    p.remove_endpoint("e1").expect("remove");
    s.remove(0);
    assert_eq!(
        p.pick_one(&r, &s),
        Ok(Some(0)),
        "its endpoint gone: unbound"
    );
}

#[test]
fn snapshots_restore_and_continue_identically() {
    let cfg = PickConfig {
        seed: 3,
        ..PickConfig::default()
    };
    let specs: Vec<PluginSpec> = preset_specs("prefix+queue+kv")
        .expect("preset")
        .into_iter()
        .chain([
            PluginSpec::new("vtc", 1.0),
            PluginSpec::new("session-affinity", 1.0),
        ])
        .collect();
    let mut a = Pipeline::from_specs(&specs, &names(4), &cfg).expect("p");
    let mut s = states(4);
    let hashes: Vec<Vec<u64>> = (0..20u64)
        .map(|i| (0..(i % 5)).map(|b| b * 31 + i % 3).collect())
        .collect();
    let run = |p: &mut Pipeline,
               s: &mut Vec<EndpointState>,
               range: std::ops::Range<usize>|
     -> Vec<usize> {
        range
            .map(|i| {
                let user = format!("u{}", i % 3);
                let session = format!("s{}", i % 4);
                let r = PickRequest {
                    hashes: &hashes[i],
                    fairness_id: Some(&user),
                    session: Some(&session),
                    input_tokens: 100,
                    output_tokens: 10,
                    now: i as f64,
                    ..PickRequest::default()
                };
                let e = p.pick_one(&r, s).expect("pick").expect("some");
                p.started(&r, e).expect("start");
                s[e].in_flight += 1;
                e
            })
            .collect()
    };
    run(&mut a, &mut s, 0..10);
    let bytes = a.to_bytes();
    let mut b = Pipeline::from_bytes(&bytes).expect("restore");
    assert_eq!(b.to_bytes(), bytes);
    let mut s2 = s.clone();
    assert_eq!(run(&mut a, &mut s, 10..20), run(&mut b, &mut s2, 10..20));
    for cut in 0..bytes.len() {
        assert!(Pipeline::from_bytes(&bytes[..cut]).is_err());
    }
}

#[test]
fn prefix_started_after_the_shared_index_changed_records_every_block() {
    let index = Arc::new(Mutex::new(PrefixIndex::new(6, None).expect("index")));
    let cfg = PickConfig {
        seed: 0,
        prefix_index: Some(Arc::clone(&index)),
        kv_index: None,
    };
    let mut a = Pipeline::preset("prefix", &["a0", "a1"], &cfg).expect("p");
    let s = states(2);
    let h = [1u64, 2, 3, 4];
    let r = PickRequest {
        hashes: &h,
        ..req(0.0)
    };
    a.started(&r, 1).expect("start");
    assert_eq!(a.pick_one(&r, &s), Ok(Some(1)));
    // Between this pick and its start, other blocks evict some of the
    // slots the match walked (capacity 6) and reuse them.
    crate::prefix::lock(&index)
        .record(&[10, 11, 12, 13, 14], "other", 0.0)
        .expect("record");
    a.started(&r, 0).expect("start");
    let mut ix = crate::prefix::lock(&index);
    let m = ix.match_prefix(&h, 0.0).expect("match");
    assert!(m.contains(&("a0".to_owned(), 4)), "{m:?}");
}

#[test]
fn moved_takes_back_only_what_the_request_added_and_gives_it_all_to_the_server() {
    let index = Arc::new(Mutex::new(PrefixIndex::new(100, None).expect("index")));
    let cfg = PickConfig {
        seed: 0,
        prefix_index: Some(Arc::clone(&index)),
        kv_index: None,
    };
    let mut p = Pipeline::preset("prefix", &["a", "b", "c"], &cfg).expect("p");
    let held = [1u64, 2];
    p.started(
        &PickRequest {
            hashes: &held,
            ..req(0.0)
        },
        0,
    )
    .expect("start");
    // A request sharing a's two blocks is recorded for a, then served by b.
    let h = [1u64, 2, 3, 4];
    let r = PickRequest {
        hashes: &h,
        ..req(1.0)
    };
    let rec = p.started_recorded(&r, 0).expect("start");
    assert_eq!(rec.hashes, h);
    assert_eq!(rec.added, vec![3, 4], "a held 1 and 2 already");
    p.moved(0, 1, &rec, 2.0).expect("moved");
    let m = crate::prefix::lock(&index)
        .match_prefix(&h, 2.0)
        .expect("m");
    assert_eq!(m, vec![("a".to_owned(), 2), ("b".to_owned(), 4)]);
    // The next request with that prompt goes to b, which holds all of it.
    assert_eq!(p.pick_one(&r, &states(3)), Ok(Some(1)));
    assert!(p.moved(0, 3, &rec, 2.0).is_err(), "out of range");
    assert!(p.moved(0, 1, &rec, f64::NAN).is_err());
    // No prefix plugin: nothing recorded, nothing to move.
    let mut q = Pipeline::preset("least-request", &["a", "b"], &cfg).expect("q");
    let rec = q.started_recorded(&r, 0).expect("start");
    assert_eq!(rec, Recorded::default());
    q.moved(0, 1, &rec, 2.0).expect("moved");
}
