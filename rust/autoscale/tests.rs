use super::*;
use crate::planner::{plan, Binding, PlanConfig};
use crate::rng::Rng;
use crate::workload::Workload;

fn pool(min: u64, max: u64) -> PoolScaling {
    PoolScaling {
        name: "p".into(),
        context: 16384,
        min_endpoints: min,
        max_endpoints: max,
        slo_ttft_s: 2.0,
        slo_tpot_s: Some(0.1),
        entitlements: vec!["a".into()],
    }
}

/// The sizing of `pool` for `live` (window `w`'s chunks), no queue, no floor.
fn target_of(
    pool: &PoolScaling,
    profile: &Profile,
    live: &LiveWorkload,
    w: &LiveWindow,
) -> sizing::Target {
    sizing::target(
        pool,
        profile,
        0.99,
        10.0,
        live,
        &|out: &mut Vec<(u64, f64)>| w.chunk_distribution(out),
        PoolDemand::default(),
        None,
        None,
    )
    .expect("ok")
}

fn config(pools: Vec<PoolScaling>) -> AutoscaleConfig {
    AutoscaleConfig {
        pools,
        ..AutoscaleConfig::default()
    }
}

/// Random chat-like requests: prompts log-uniform up to 8K, outputs up to 1K.
fn requests(rng: &mut Rng, n: usize) -> Vec<(u64, u64)> {
    (0..n)
        .map(|_| {
            let p = 2f64.powf(4.0 + rng.uniform() * 9.0) as u64;
            (p, 1 + rng.below(1024))
        })
        .collect()
}

#[test]
fn window_rate_moments_and_forgetting() {
    let mut w = LiveWindow::new(60.0, 6, 512, 100.0).expect("ok");
    // 10 s of nothing counts as one sub-window at least: no division by zero.
    let l = w.live(100.0, 0.99).expect("ok");
    assert_eq!((l.requests, l.rate), (0, 0.0));
    for i in 0..600 {
        w.observe(100.0 + i as f64 * 0.1, 1000, 100).expect("ok");
    }
    let l = w.live(160.0, 0.99).expect("ok");
    // Epoch 6 began at 160: the first sub-window (100..110) is forgotten.
    assert_eq!(l.requests, 500);
    assert!((l.rate - 500.0 / 50.0).abs() < 1e-9, "{l:?}");
    let k = (1000f64 / 512.0).ceil() + 100.0;
    assert!((l.k.mean - k).abs() < 1e-12);
    assert!((l.kl.mean - k * 1100.0).abs() < 1e-9);
    assert!((l.prompt.second - 1e6).abs() < 1e-6);
    assert_eq!(l.prefill_chunks_q, 2.0);
    assert!(l.prompt_tokens.p50 >= 1000 && l.prompt_tokens.p50 <= 1031);
    // A clock that goes backwards counts in the latest sub-window.
    w.observe(50.0, 10, 10).expect("ok");
    assert_eq!(w.live(160.0, 0.99).expect("ok").requests, 501);
    // A long silence forgets everything.
    let l = w.live(1000.0, 0.99).expect("ok");
    assert_eq!((l.requests, l.rate, l.prompt_tokens.p99), (0, 0.0, 0));
    assert!(w.observe(f64::NAN, 1, 1).is_err());
    assert!(w.observe(1.0, crate::budget::MAX_TOKENS + 1, 1).is_err());
}

#[test]
fn no_traffic_gives_min_endpoints() {
    let mut a = Autoscaler::new(
        config(vec![pool(3, 10)]),
        vec![Profile::llama3_70b_a100()],
        0.0,
    )
    .expect("ok");
    let d = a
        .step(
            10.0,
            &[PoolDemand {
                queued_requests: 0.0,
                promised_tokens_per_s: 1e6,
                busy_endpoints: 0.0,
                ready_endpoints: None,
            }],
        )
        .expect("ok");
    assert_eq!(d[0].endpoints, 3);
    assert_eq!(d[0].target.reason, Reason::NoTraffic);
    assert!(d[0].to_string().contains("no traffic: min 3"), "{}", d[0]);
}

/// The live window's answer is the planner's for the same requests: the
/// homogeneous pool of `plan` (one pool at the context, every request).
#[test]
fn desired_count_is_the_planners() {
    let mut rng = Rng::new(3);
    let profile = Profile::llama3_70b_a100();
    let mut checked = 0;
    for case in 0..40 {
        let n = 200 + rng.below(2000) as usize;
        let reqs = requests(&mut rng, n);
        let mut w = LiveWindow::new(60.0, 6, profile.c_chunk, 0.0).expect("ok");
        for (i, &(p, o)) in reqs.iter().enumerate() {
            w.observe(i as f64 * 59.0 / reqs.len() as f64, p, o)
                .expect("ok");
        }
        let mut live = w.live(59.99, 0.99).expect("ok");
        // A random fleet rate: 1 to 2,000 req/s.
        live.rate = 2f64.powf(rng.uniform() * 11.0);
        let ttft = 0.5 + 3.0 * rng.uniform();
        let tpot = 0.02 + 0.1 * rng.uniform();
        let p = PoolScaling {
            slo_ttft_s: ttft,
            slo_tpot_s: Some(tpot),
            max_endpoints: 1 << 20,
            ..pool(1, 10)
        };
        let t = target_of(&p, &profile, &live, &w);
        let input: Vec<i64> = reqs.iter().map(|r| r.0 as i64).collect();
        let output: Vec<i64> = reqs.iter().map(|r| r.1 as i64).collect();
        let wl = Workload::new(&input, &output, None, None).expect("ok");
        let cfg = PlanConfig {
            slo_tpot_s: Some(tpot),
            long_context: p.context,
            b_short: vec![1024],
            gammas: vec![1.0],
            ..PlanConfig::new(live.rate, ttft)
        };
        let Ok(planned) = plan(&wl, &profile, &cfg) else {
            // No fleet meets it: the autoscaler says so too.
            assert_eq!(t.reason, Reason::SloUnreachable, "case {case}");
            continue;
        };
        let homo = planned.homogeneous.long;
        if homo.feasible {
            assert_eq!(t.model_endpoints, homo.gpus, "case {case}: {t:?} {homo:?}");
            assert_eq!(t.binding, homo.binding, "case {case}");
            checked += 1;
        } else {
            assert_eq!(t.reason, Reason::SloUnreachable, "case {case}");
        }
    }
    assert!(checked >= 20, "{checked}");
}

#[test]
fn desired_count_is_monotone_in_rate() {
    let mut rng = Rng::new(5);
    let profile = Profile::llama3_70b_a100();
    for case in 0..30 {
        let mut w = LiveWindow::new(60.0, 6, profile.c_chunk, 0.0).expect("ok");
        for (i, (p, o)) in requests(&mut rng, 500).into_iter().enumerate() {
            w.observe(i as f64 * 0.1, p, o).expect("ok");
        }
        let mut live = w.live(50.0, 0.99).expect("ok");
        let p = PoolScaling {
            max_endpoints: 1 << 20,
            ..pool(0, 10)
        };
        let mut last = 0;
        let mut rate = 0.1;
        while rate < 5000.0 {
            live.rate = rate;
            let t = target_of(&p, &profile, &live, &w);
            assert!(t.model_endpoints >= last, "case {case} rate {rate}");
            last = t.model_endpoints;
            rate *= 1.0 + rng.uniform();
        }
        assert!(last > 1);
    }
}

#[test]
fn queue_and_entitlement_floor_raise_the_rate() {
    let profile = Profile::llama3_70b_a100();
    let mut a =
        Autoscaler::new(config(vec![pool(1, 1000)]), vec![profile.clone()], 0.0).expect("ok");
    let e = a.entitlement_id(0, "a").expect("ok");
    for i in 0..600 {
        a.observe(0, Some(e), i as f64 * 0.1, 2000, 200)
            .expect("ok");
    }
    let base = a.clone().step(60.0, &[]).expect("ok")[0].target;
    assert!((base.rate - 10.0).abs() < 1e-9, "{base:?}");
    let queued = a
        .clone()
        .step(
            60.0,
            &[PoolDemand {
                queued_requests: 100.0,
                promised_tokens_per_s: 0.0,
                busy_endpoints: 0.0,
                ready_endpoints: None,
            }],
        )
        .expect("ok")[0]
        .target;
    assert!((queued.rate - 20.0).abs() < 1e-9);
    assert!(queued.model_endpoints >= base.model_endpoints);
    // 2,200 tokens per request: 220,000 tokens/s promised is 100 req/s.
    let promised = a
        .clone()
        .step(
            60.0,
            &[PoolDemand {
                queued_requests: 0.0,
                promised_tokens_per_s: 220_000.0,
                busy_endpoints: 0.0,
                ready_endpoints: None,
            }],
        )
        .expect("ok")[0]
        .target;
    assert!((promised.rate - 100.0).abs() < 1e-9);
    assert!(promised.model_endpoints > base.model_endpoints);
    // Busy endpoints (a backlog of their own) add to the model's count,
    // rounded; the model's count itself is the rate's.
    let busy = a
        .clone()
        .step(
            60.0,
            &[PoolDemand {
                busy_endpoints: 20.4,
                ..PoolDemand::default()
            }],
        )
        .expect("ok")[0]
        .target;
    assert_eq!(busy.model_endpoints, base.model_endpoints);
    assert_eq!(busy.endpoints, base.endpoints + 20);
    assert_eq!(busy.reason, Reason::Model);
    // The entitlement's own window saw the same requests.
    let l = a.live(0, Some(e), 60.0).expect("ok");
    assert_eq!(l.requests, 500);
    // Bad demand changes nothing.
    let before = format!("{:?}", a);
    assert!(a
        .step(
            60.0,
            &[PoolDemand {
                queued_requests: -1.0,
                promised_tokens_per_s: 0.0,
                busy_endpoints: 0.0,
                ready_endpoints: None,
            }],
        )
        .is_err());
    let busy = PoolDemand {
        busy_endpoints: f64::NAN,
        ..PoolDemand::default()
    };
    assert!(a.step(60.0, &[busy]).is_err());
    assert!(a.step(60.0, &[PoolDemand::default(); 2]).is_err());
    assert_eq!(format!("{:?}", a), before);
}

#[test]
fn unreachable_slo_says_max_and_names_the_binding() {
    let profile = Profile::llama3_70b_a100();
    // TPOT below the iteration's base time W = 8 ms: no count meets it.
    let p = PoolScaling {
        slo_tpot_s: Some(0.005),
        ..pool(1, 7)
    };
    let mut a = Autoscaler::new(config(vec![p]), vec![profile], 0.0).expect("ok");
    for i in 0..100 {
        a.observe(0, None, i as f64 * 0.1, 500, 50).expect("ok");
    }
    let d = a.step(10.0, &[]).expect("ok");
    assert_eq!(d[0].target.reason, Reason::SloUnreachable);
    assert_eq!(d[0].target.binding, Binding::Compute);
    assert_eq!(d[0].target.endpoints, 7);
    assert!(
        d[0].to_string()
            .contains("SLO unreachable: max 7 (binding compute)"),
        "{}",
        d[0]
    );
}

#[test]
fn bad_configs_name_the_key() {
    let profile = Profile::llama3_70b_a100();
    let cases: Vec<(AutoscaleConfig, &str)> = vec![
        (
            config(vec![pool(5, 3)]),
            "autoscale.pools[0].min_endpoints (5) is above max_endpoints (3)",
        ),
        (
            AutoscaleConfig {
                period_s: 0.0,
                ..config(vec![])
            },
            "autoscale.period_s must be > 0",
        ),
        (
            AutoscaleConfig {
                window_s: f64::NAN,
                ..config(vec![])
            },
            "autoscale.window_s must be a finite number",
        ),
        (
            AutoscaleConfig {
                scale_down_delay_s: -1.0,
                ..config(vec![])
            },
            "autoscale.scale_down_delay_s must be >= 0",
        ),
        (
            AutoscaleConfig {
                max_forecast_ratio: 0.5,
                ..config(vec![])
            },
            "autoscale.max_forecast_ratio must be >= 1, got 0.5",
        ),
        (
            AutoscaleConfig {
                max_forecast_ratio: f64::INFINITY,
                ..config(vec![])
            },
            "autoscale.max_forecast_ratio must be >= 1, got inf",
        ),
        (
            config(vec![PoolScaling {
                slo_ttft_s: -2.0,
                ..pool(1, 3)
            }]),
            "autoscale.pools[0].slo_ttft_s must be > 0",
        ),
        (
            config(vec![PoolScaling {
                slo_tpot_s: Some(f64::NAN),
                ..pool(1, 3)
            }]),
            "autoscale.pools[0].slo_tpot_s must be a finite number",
        ),
        (
            config(vec![pool(0, 0)]),
            "autoscale.pools[0].max_endpoints must be in [1,",
        ),
        (
            config(vec![pool(1, 3), pool(1, 3)]),
            "autoscale.pools[1].name",
        ),
    ];
    for (cfg, want) in cases {
        let err = Autoscaler::new(cfg.clone(), vec![profile.clone(); cfg.pools.len()], 0.0)
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "{err} lacks {want}");
    }
    let err = AutoscaleConfig::from_value(serde_json::json!({"period_s": 10, "perod": 1}))
        .expect_err("typo");
    assert!(err.to_string().contains("perod"), "{err}");
    let ok = AutoscaleConfig::from_value(serde_json::json!(
        {"pools": [{"name": "s", "context": 8192, "max_endpoints": 4, "slo_ttft_s": 1}]}
    ))
    .expect("ok");
    assert_eq!((ok.period_s, ok.pools[0].min_endpoints), (10.0, 1));
}

/// Rust alone: the cost of one observed request (the window rotating as
/// time moves) and of one step over eight pools. Prints, never asserts.
/// `cargo test --release --lib -- --ignored --nocapture autoscale_timing`
#[test]
#[ignore]
fn autoscale_timing() {
    let profile = Profile::llama3_70b_a100();
    let pools: Vec<PoolScaling> = (0..8)
        .map(|i| PoolScaling {
            name: format!("p{i}"),
            max_endpoints: 1 << 20,
            ..pool(1, 10)
        })
        .collect();
    let mut a = Autoscaler::new(config(pools), vec![profile; 8], 0.0).expect("ok");
    let mut rng = Rng::new(1);
    let reqs = requests(&mut rng, 1 << 16);
    let n = 10_000_000usize;
    let start = std::time::Instant::now();
    for k in 0..n {
        let (p, o) = reqs[k & 0xffff];
        // 1,600 req/s per pool: the window turns over many times.
        a.observe(k % 8, None, k as f64 / 12_800.0, p, o)
            .expect("ok");
    }
    let ns = start.elapsed().as_nanos() as f64 / n as f64;
    println!("observe: {ns:.1} ns per request");
    let now = n as f64 / 12_800.0;
    let rounds = 2_000;
    let start = std::time::Instant::now();
    for r in 0..rounds {
        std::hint::black_box(a.step(now + r as f64 * 1e-6, &[]).expect("ok"));
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / rounds as f64;
    println!("step, 8 pools: {us:.1} us");
}

/// A ramp from 10 to 70 req/s over a 60 s window: the trend is its slope,
/// and `forecast_s` sizes for the rate the ramp reaches that far past now.
#[test]
fn the_forecast_follows_the_windows_trend() {
    let mut w = LiveWindow::new(60.0, 6, 512, 0.0).expect("ok");
    let mut t = 0.0;
    while t < 60.0 {
        w.observe(t, 1000, 100).expect("ok");
        t += 1.0 / (10.0 + t);
    }
    // Just before 60 s: the window still holds its first sub-window.
    let live = w.live(59.999, 0.99).expect("ok");
    assert!((live.trend - 1.0).abs() < 0.05, "{}", live.trend);
    assert!((live.rate - 40.0).abs() < 1.0, "{}", live.rate);
    let pool = PoolScaling {
        name: "p".into(),
        context: 8192,
        min_endpoints: 1,
        max_endpoints: 1000,
        slo_ttft_s: 2.0,
        slo_tpot_s: None,
        entitlements: Vec::new(),
    };
    let profile = Profile::llama3_70b_a100();
    let chunks = |out: &mut Vec<(u64, f64)>| w.chunk_distribution(out);
    let size = |ahead: Option<f64>| {
        sizing::target(
            &pool,
            &profile,
            0.99,
            10.0,
            &live,
            &chunks,
            PoolDemand::default(),
            ahead.map(|ahead_s| Forecast {
                ahead_s,
                max_ratio: 2.0,
            }),
            None,
        )
        .expect("ok")
    };
    let now = size(None);
    let ahead = size(Some(30.0));
    assert_eq!(now.forecast_rate, now.observed_rate);
    assert!(
        (ahead.forecast_rate - 100.0).abs() < 3.0,
        "{}",
        ahead.forecast_rate
    );
    assert!(ahead.endpoints > now.endpoints);
    // A ramp down from 70 to 10 req/s: its line is at 10 req/s now and
    // would reach -20 in 30 s; the count covers now, the highest rate
    // until the endpoints it starts are ready.
    let mut down = LiveWindow::new(60.0, 6, 512, 0.0).expect("ok");
    let mut t = 0.0;
    while t < 60.0 {
        down.observe(t, 1000, 100).expect("ok");
        t += 1.0 / (70.0 - t);
    }
    let falling = down.live(59.999, 0.99).expect("ok");
    assert!((falling.trend + 1.0).abs() < 0.05, "{}", falling.trend);
    let f = Forecast {
        ahead_s: 30.0,
        max_ratio: 2.0,
    };
    let at_now = falling.rate + falling.trend * falling.span_s / 2.0;
    assert!((at_now - 10.0).abs() < 1.0, "{at_now}");
    assert!((falling.level - at_now).abs() < 1e-9, "{}", falling.level);
    assert_eq!(falling.shift_s, None, "a ramp is no step");
    assert_eq!(f.rate(&falling), falling.level);
    // A window that fell silent 30 s ago is a step down to 0: no trend, a
    // level of 0, and the forecast 0.
    let mut w = LiveWindow::new(60.0, 6, 512, 0.0).expect("ok");
    for k in 0..300 {
        w.observe(k as f64 / 10.0, 1000, 100).expect("ok");
    }
    let live = w.live(60.0, 0.99).expect("ok");
    assert_eq!(
        (live.trend, live.level, live.shift_s),
        (0.0, 0.0, Some(30.0))
    );
    let t = sizing::target(
        &pool,
        &profile,
        0.99,
        10.0,
        &live,
        &chunks,
        PoolDemand::default(),
        Some(Forecast {
            ahead_s: 600.0,
            max_ratio: 1.5,
        }),
        None,
    )
    .expect("ok");
    assert_eq!(t.forecast_rate, 0.0);
}

/// A step from 500 to 2,000 req/s 10 s before a decision (at 129.999 s,
/// while the window still holds its first sub-window), with 20,000
/// requests queued behind it. A least-squares line over the 30 s window
/// would read it as a ramp of 1,500 x 20 / 437.5 = 68.6 req/s per s,
/// extrapolated 70 s past now to the bound of 2 x the newest sub-window's
/// 2,000 req/s (what the step experiment sized for: 534 endpoints against
/// hindsight's 259). The level shift is found instead: the rate is the
/// 2,000 req/s since it, with no slope (two sub-windows after a shift say
/// nothing of one), plus the backlog drained over the decision's horizon
/// (the forecast's 70 s): the planner's count for 2,000 + 20,000 / 70 req/s.
#[test]
fn a_step_is_a_new_level_not_a_ramp() {
    let cfg = AutoscaleConfig {
        window_s: 30.0,
        forecast_s: Some(70.0),
        pools: vec![PoolScaling {
            max_endpoints: 1000,
            entitlements: Vec::new(),
            ..pool(1, 1000)
        }],
        ..AutoscaleConfig::default()
    };
    assert_eq!(cfg.queue_drain_s(), 70.0);
    let profile = Profile::llama3_70b_a100();
    let mut a = Autoscaler::new(cfg, vec![profile.clone()], 0.0).expect("ok");
    let mut w = LiveWindow::new(30.0, 6, profile.c_chunk, 0.0).expect("ok");
    let mut t = 100.0;
    while t < 130.0 {
        a.observe(0, None, t, 2000, 200).expect("ok");
        w.observe(t, 2000, 200).expect("ok");
        t += if t < 120.0 { 1.0 / 500.0 } else { 1.0 / 2000.0 };
    }
    let live = w.live(129.999, 0.99).expect("ok");
    assert_eq!(live.trend, 0.0);
    assert_eq!(live.shift_s, Some(120.0));
    assert!((live.level - 2000.0).abs() < 1.0, "{}", live.level);
    assert!((live.rate - 1000.0).abs() < 1.0, "{}", live.rate);
    let queued = 20_000.0;
    let [d] = <[Desired; 1]>::try_from(
        a.step(
            129.999,
            &[PoolDemand {
                queued_requests: queued,
                promised_tokens_per_s: 0.0,
                busy_endpoints: 0.0,
                ready_endpoints: None,
            }],
        )
        .expect("ok"),
    )
    .expect("one pool");
    assert_eq!(d.target.forecast_rate, live.level);
    let rate = live.level + queued / 70.0;
    assert!((d.target.rate - rate).abs() < 1e-6 * rate, "{:?}", d.target);
    let by_hand = target_of(&pool(1, 1000), &profile, &LiveWorkload { rate, ..live }, &w);
    assert_eq!(d.target.model_endpoints, by_hand.model_endpoints);
    let at_new_rate = target_of(
        &pool(1, 1000),
        &profile,
        &LiveWorkload {
            rate: 2000.0,
            ..live
        },
        &w,
    );
    assert!(
        (d.target.model_endpoints as f64) < 1.2 * at_new_rate.model_endpoints as f64,
        "{} vs {} at 2,000 req/s",
        d.target.model_endpoints,
        at_new_rate.model_endpoints
    );
}

/// Poisson arrivals at `rate(t)` from `from` to `to` into a window of 30 s
/// in 6 parts, read at `to`.
fn poisson_window(rng: &mut Rng, rate: impl Fn(f64) -> f64, from: f64, to: f64) -> LiveWorkload {
    let mut w = LiveWindow::new(30.0, 6, 512, from).expect("ok");
    // Thinning under the highest rate.
    let top = (0..=100)
        .map(|k| rate(from + (to - from) * f64::from(k) / 100.0))
        .fold(0.0, f64::max);
    let mut t = from + rng.exponential(top);
    while t < to {
        if rng.uniform() * top < rate(t) {
            w.arrive(t).expect("ok");
        }
        t += rng.exponential(top);
    }
    w.live(to, 0.99).expect("ok")
}

/// With Poisson noise, 40 cases: a step (500 to 2,000 req/s, at a
/// sub-window's edge or inside one) is found as a level shift, with no
/// slope while fewer than three sub-windows follow it and the new level
/// within noise; a ramp (4 to 8 req/s per s, steeper than the day's 2) is
/// never taken for one, and its slope and level are the line's.
#[test]
fn a_step_gives_no_ramp_slope_and_a_ramp_still_does() {
    let mut rng = Rng::new(7);
    for seed in 0..40 {
        let at = 120.0 + [0.0, 2.5, 4.0][seed % 3];
        let step = |t: f64| if t < at { 500.0 } else { 2000.0 };
        let live = poisson_window(&mut rng, step, 95.0, 130.0);
        assert!(live.shift_s.is_some(), "seed {seed}: {live:?}");
        assert_eq!(live.trend, 0.0, "seed {seed}");
        // Bounds: 5 sigma of the Poisson noise (one sub-window: 20 req/s).
        assert!(
            (live.level - 2000.0).abs() < 100.0,
            "seed {seed}: {}",
            live.level
        );
        // Three or four sub-windows after it: their own (flat) slope.
        let later = poisson_window(&mut rng, step, 95.0, 142.0);
        assert!(later.shift_s.is_some(), "seed {seed}");
        assert!(later.trend.abs() < 12.0, "seed {seed}: {}", later.trend);
        assert!(
            (later.level - 2000.0).abs() < 120.0,
            "seed {seed}: {}",
            later.level
        );
        let slope = 4.0 + 4.0 * rng.uniform();
        let ramp = |t: f64| 200.0 + slope * (t - 95.0);
        let live = poisson_window(&mut rng, ramp, 95.0, 130.0);
        assert_eq!(live.shift_s, None, "seed {seed}: {live:?}");
        // 4 sigma: the slope of five sub-windows at <= 480 req/s, 0.62.
        assert!(
            (live.trend - slope).abs() < 2.5,
            "seed {seed}: {} vs {slope}",
            live.trend
        );
        assert!(
            (live.level - ramp(130.0)).abs() < 40.0,
            "seed {seed}: {} vs {}",
            live.level,
            ramp(130.0)
        );
    }
}

#[test]
fn a_pool_is_sized_for_its_arrivals_not_for_what_its_endpoints_finish() {
    let cfg = AutoscaleConfig {
        window_s: 30.0,
        pools: vec![PoolScaling {
            entitlements: Vec::new(),
            ..pool(1, 1000)
        }],
        ..AutoscaleConfig::default()
    };
    let profile = Profile::llama3_70b_a100();
    let mut a = Autoscaler::new(cfg, vec![profile.clone()], 0.0).expect("ok");
    let mut finished_only = a.clone();
    let mut w = LiveWindow::new(30.0, 6, profile.c_chunk, 0.0).expect("ok");
    // In time order (a window never goes back): arrivals (true) and the
    // requests the endpoints finish (false), 500 a second throughout.
    let mut events: Vec<(f64, bool)> = (0..10_000)
        .map(|i| (100.0 + f64::from(i) / 500.0, true))
        .chain((0..20_000).map(|j| (120.0 + f64::from(j) / 2000.0, true)))
        .chain((0..15_000).map(|i| (100.0 + f64::from(i) / 500.0, false)))
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (t, arrival) in events {
        if arrival {
            a.arrive(0, None, t).expect("ok");
            continue;
        }
        for x in [&mut a, &mut finished_only] {
            x.observe(0, None, t, 2000, 200).expect("ok");
        }
        w.observe(t, 2000, 200).expect("ok");
    }
    let live = w.live(130.0, 0.99).expect("ok");
    assert_eq!(live.span_s, 25.0);
    let [d] = <[Desired; 1]>::try_from(a.step(130.0, &[]).expect("ok")).expect("one pool");
    assert!((d.target.rate - 1100.0).abs() < 1e-9, "{:?}", d.target);
    let p = pool(1, 1000);
    let at = |rate| target_of(&p, &profile, &LiveWorkload { rate, ..live }, &w);
    assert_eq!(d.target.model_endpoints, at(1100.0).model_endpoints);
    let [old] =
        <[Desired; 1]>::try_from(finished_only.step(130.0, &[]).expect("ok")).expect("one pool");
    assert!((old.target.rate - 500.0).abs() < 1e-9, "{:?}", old.target);
    assert_eq!(old.target.model_endpoints, at(500.0).model_endpoints);
    assert!(d.target.model_endpoints > old.target.model_endpoints);
}

/// The endpoints a step starts that the next target no longer needs are
/// cancelled at that step while they are still starting (the demand says
/// how many are ready), down to what the rate 2 sigma of its noise high
/// needs; the ready ones wait for the scale-down delay, and without
/// readiness every endpoint does.
#[test]
fn starting_endpoints_are_cancelled_at_once_ready_ones_wait_the_delay() {
    let cfg = AutoscaleConfig {
        window_s: 10.0,
        sub_windows: 2,
        scale_down_delay_s: 60.0,
        max_step_up_percent: 10_000.0,
        pools: vec![pool(1, 100)],
        ..AutoscaleConfig::default()
    };
    let profile = Profile::llama3_70b_a100();
    let demand = |ready| {
        [PoolDemand {
            ready_endpoints: ready,
            ..PoolDemand::default()
        }]
    };
    let go = |ready: Option<u64>| {
        let mut a = Autoscaler::new(cfg.clone(), vec![profile.clone()], 0.0).expect("ok");
        // 40 req/s for 10 s, then 4 req/s.
        for k in 0..400 {
            a.arrive(0, None, k as f64 / 40.0).expect("ok");
            a.observe(0, None, k as f64 / 40.0, 2000, 200).expect("ok");
        }
        let high = a.step(10.0, &demand(Some(1))).expect("ok")[0].endpoints;
        for k in 0..80 {
            let t = 10.0 + k as f64 / 4.0;
            a.arrive(0, None, t).expect("ok");
            a.observe(0, None, t, 2000, 200).expect("ok");
        }
        let low = a.step(30.0, &demand(ready)).expect("ok").remove(0);
        (high, low.target, low.endpoints)
    };
    let (high, target, _) = go(None);
    assert!(target.keep_endpoints >= target.endpoints, "{target:?}");
    assert!(target.keep_endpoints + 2 < high, "{target:?} vs {high}");
    // 1 ready, the rest starting: down to what the noisy rate keeps, at once.
    assert_eq!(go(Some(1)).2, target.keep_endpoints);
    // All ready but one: the ready ones wait.
    assert_eq!(go(Some(high - 1)).2, high - 1);
    assert_eq!(go(None).2, high);
}
