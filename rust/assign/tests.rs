use super::*;
use crate::rng::Rng;

fn inst(name: &str, model: &str, tpot: f64, price: f64, max_batch: i64) -> Endpoint {
    Endpoint::new(name, model, tpot, price, price, max_batch, Some(0.0)).expect("endpoint")
}

fn sched(endpoints: Vec<Endpoint>, w: Weights) -> BatchScheduler {
    BatchScheduler::new(endpoints, w, LptKey::Max, BudgetFallback::Reject).expect("scheduler")
}

fn idle(n: usize) -> Load {
    Load {
        pending: vec![0.0; n],
        batch: vec![0; n],
    }
}

fn batch<'a>(q: &'a [f64], len: &'a [f64], tokens: &'a [u64]) -> Batch<'a> {
    Batch {
        quality: q,
        out_len: len,
        in_tokens: tokens,
        budget: None,
    }
}

#[test]
fn latency_and_cost_by_hand() {
    let i = Endpoint::new("a", "m", 0.02, 2.0, 4.0, 2, Some(0.001)).expect("endpoint");
    // prefill 400 * 0.001 = 0.4; no free slot: wait 300 / 2 * 0.02 = 3.0; decode 50 * 0.02 = 1.0
    assert!((i.latency(400.0, 50.0, 300.0, 2) - 4.4).abs() < 1e-12);
    // a free slot: no wait
    assert!((i.latency(400.0, 50.0, 300.0, 1) - 1.4).abs() < 1e-12);
    // (400 * 2 + 50 * 4) / 1e6
    assert!((i.cost(400.0, 50.0) - 0.001).abs() < 1e-15);
    let d = Endpoint::new("a", "m", 0.02, 0.0, 0.0, 2, None).expect("endpoint");
    assert!((d.prefill_s_per_token - 0.0001).abs() < 1e-15);
}

#[test]
fn lpt_order_by_each_key() {
    let s = |k| {
        BatchScheduler::new(
            vec![inst("a", "x", 0.01, 1.0, 4), inst("b", "y", 0.01, 1.0, 4)],
            Weights::new(1.0, 1.0, 1.0).expect("w"),
            k,
            BudgetFallback::Reject,
        )
        .expect("scheduler")
    };
    let lens = [10.0, 50.0, 80.0, 5.0, 30.0, 30.0];
    // max: 50, 80, 30; mean: 30, 42.5, 30 (ties keep batch order); min: 10, 5, 30
    assert_eq!(s(LptKey::Max).lpt_order(&lens), vec![1, 0, 2]);
    assert_eq!(s(LptKey::Mean).lpt_order(&lens), vec![1, 0, 2]);
    assert_eq!(s(LptKey::Min).lpt_order(&lens), vec![2, 0, 1]);
}

#[test]
fn dead_reckoning_spreads_identical_requests() {
    let endpoints: Vec<Endpoint> = (0..4)
        .map(|i| inst(&format!("i{i}"), "m", 0.01, 1.0, 1))
        .collect();
    let s = sched(endpoints, Weights::preset("balanced").expect("preset"));
    let q = [0.5; 4];
    let len = [100.0; 4];
    let tokens = [10; 4];
    let mut got = s
        .assign(&batch(&q, &len, &tokens), &idle(4))
        .expect("assign");
    got.sort_unstable();
    assert_eq!(got, vec![0, 1, 2, 3]);
    // without dead reckoning all four would have gone to endpoint 0
}

#[test]
fn ties_go_to_least_recently_assigned() {
    let s = sched(
        vec![inst("a", "m", 0.01, 1.0, 8), inst("b", "m", 0.01, 1.0, 8)],
        Weights::preset("balanced").expect("preset"),
    );
    let one = |s: &BatchScheduler| {
        s.assign(&batch(&[0.5], &[10.0], &[1]), &idle(2))
            .expect("assign")[0]
    };
    assert_eq!(one(&s), 0);
    assert_eq!(one(&s), 1);
    assert_eq!(one(&s), 0);
}

#[test]
fn budget_filter_and_fallback() {
    let endpoints = vec![
        inst("cheap", "small", 0.01, 1.0, 8),
        inst("dear", "large", 0.01, 10.0, 8),
    ];
    // cost: cheap (1000 + 1000) * 1 / 1e6 = 0.002, dear 0.02; quality prefers dear
    let q = [0.2, 0.9];
    let len = [1000.0, 1000.0];
    let tokens = [1000];
    let run = |fallback, budget: f64| {
        let s = BatchScheduler::new(
            endpoints.clone(),
            Weights::new(1.0, 0.0, 0.0).expect("w"),
            LptKey::Max,
            fallback,
        )
        .expect("scheduler");
        let b = [budget];
        let mut bt = batch(&q, &len, &tokens);
        bt.budget = Some(&b);
        s.assign(&bt, &idle(2)).expect("assign")[0]
    };
    assert_eq!(run(BudgetFallback::Reject, f64::INFINITY), 1);
    assert_eq!(run(BudgetFallback::Reject, 0.02), 1);
    assert_eq!(run(BudgetFallback::Reject, 0.01), 0);
    assert_eq!(run(BudgetFallback::Reject, 0.001), -1);
    assert_eq!(run(BudgetFallback::Cheapest, 0.001), 0);
}

#[test]
fn each_preset_pulls_to_its_corner() {
    // A: good, slow, dear; B: fast; C: cheap. out 100, no prompt:
    // latency 4 / 1 / 3 s, cost 100e-6 / 50e-6 / 5e-6 USD.
    // quality (.8,.1,.1): A .72, B .4+.075+.05=.525, C .32+.025+.095=.44
    // latency (.1,.8,.1): A .09, B .05+.6+.05=.70, C .04+.2+.095=.335
    // cost (.1,.1,.8):    A .09, B .05+.075+.4=.525, C .04+.025+.76=.825
    let endpoints = vec![
        inst("A", "a", 0.04, 1.0, 8),
        inst("B", "b", 0.01, 0.5, 8),
        inst("C", "c", 0.03, 0.05, 8),
    ];
    let q = [0.9, 0.5, 0.4];
    let len = [100.0; 3];
    for (preset, want) in [("quality", 0), ("latency", 1), ("cost", 2)] {
        let s = sched(endpoints.clone(), Weights::preset(preset).expect("preset"));
        let got = s.assign(&batch(&q, &len, &[0]), &idle(3)).expect("assign");
        assert_eq!(got, vec![want], "{preset}");
    }
    assert!(matches!(
        Weights::preset("fast"),
        Err(crate::error::Error::UnknownName { .. })
    ));
}

#[test]
fn batch_equals_one_by_one_with_state_carried() {
    let mut rng = Rng::new(3);
    let endpoints: Vec<Endpoint> = (0..7)
        .map(|i| {
            inst(
                &format!("i{i}"),
                &format!("m{}", i % 3),
                0.01 + 0.01 * (i % 3) as f64,
                0.1 * (1 + i % 3) as f64,
                2,
            )
        })
        .collect();
    let (b, m) = (40, 3);
    let q: Vec<f64> = (0..b * m).map(|_| rng.uniform()).collect();
    let len: Vec<f64> = (0..b * m).map(|_| (rng.below(300) + 1) as f64).collect();
    let tokens: Vec<u64> = (0..b).map(|_| rng.below(500)).collect();
    let start = Load {
        pending: (0..7).map(|_| rng.below(400) as f64).collect(),
        batch: (0..7).map(|_| rng.below(4)).collect(),
    };
    let w = Weights::preset("balanced").expect("preset");
    let all = sched(endpoints.clone(), w)
        .assign(&batch(&q, &len, &tokens), &start)
        .expect("assign");
    let one = sched(endpoints, w);
    let mut load = start;
    let mut got = vec![-2i64; b];
    for r in one.lpt_order(&len) {
        let rows = r * m..(r + 1) * m;
        let bt = batch(&q[rows.clone()], &len[rows.clone()], &tokens[r..r + 1]);
        let i = one.assign(&bt, &load).expect("assign")[0];
        load.pending[i as usize] += len[rows][one.model_of()[i as usize]];
        load.batch[i as usize] += 1;
        got[r] = i;
    }
    assert_eq!(all, got);
    assert!(all.iter().all(|&i| i >= 0));
}

#[test]
fn bad_input_changes_nothing() {
    let s = sched(
        vec![inst("a", "m", 0.01, 1.0, 8), inst("b", "m", 0.01, 1.0, 8)],
        Weights::preset("balanced").expect("preset"),
    );
    s.assign(&batch(&[0.5], &[10.0], &[1]), &idle(2))
        .expect("assign");
    let before = s.to_bytes();
    let bad = [
        batch(&[0.5, 0.5], &[10.0], &[1]),
        batch(&[f64::NAN], &[10.0], &[1]),
        batch(&[0.5], &[-1.0], &[1]),
    ];
    for b in bad {
        assert!(s.assign(&b, &idle(2)).is_err());
    }
    assert!(s.assign(&batch(&[0.5], &[1.0], &[1]), &idle(3)).is_err());
    let mut b = batch(&[0.5], &[1.0], &[1]);
    b.budget = Some(&[f64::NAN]);
    assert!(s.assign(&b, &idle(2)).is_err());
    assert_eq!(s.to_bytes(), before);

    assert!(Endpoint::new("a", "m", 0.0, 1.0, 1.0, 1, None).is_err());
    assert!(Endpoint::new("a", "m", 0.01, -1.0, 1.0, 1, None).is_err());
    assert!(Endpoint::new("a", "m", 0.01, 1.0, 1.0, 0, None).is_err());
    assert!(Endpoint::new("", "m", 0.01, 1.0, 1.0, 1, None).is_err());
    assert!(Weights::new(0.0, 0.0, 0.0).is_err());
    assert!(Weights::new(-1.0, 1.0, 1.0).is_err());
    let dup = vec![inst("a", "m", 0.01, 1.0, 8), inst("a", "m", 0.01, 1.0, 8)];
    let w = Weights::preset("cost").expect("preset");
    assert!(BatchScheduler::new(dup, w, LptKey::Max, BudgetFallback::Reject).is_err());
    assert!(BatchScheduler::new(vec![], w, LptKey::Max, BudgetFallback::Reject).is_err());
}

#[test]
fn snapshot_round_trip() {
    let s = sched(
        vec![inst("a", "m", 0.01, 1.0, 8), inst("b", "n", 0.02, 2.0, 4)],
        Weights::new(0.2, 0.3, 0.5).expect("w"),
    );
    s.assign(&batch(&[0.5, 0.1], &[10.0, 9.0], &[1]), &idle(2))
        .expect("assign");
    let bytes = s.to_bytes();
    let back = BatchScheduler::from_bytes(&bytes).expect("restore");
    assert_eq!(back.to_bytes(), bytes);
    assert_eq!(back.endpoints(), s.endpoints());
    assert_eq!(back.weights(), s.weights());
    for cut in 0..bytes.len() {
        assert!(BatchScheduler::from_bytes(&bytes[..cut]).is_err());
    }
}
