use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::policy::{Fixed, Hindsight, ModelBased, Saturation, SaturationRule, Sizer};
use super::*;
use crate::autoscale::{AutoscaleConfig, Autoscaler};
use crate::pick::preset_specs;
use crate::profile::Profile;
use crate::rng::Rng;
use crate::sim::profile::RateProfile;
use crate::sim::timing::LinearTiming;

/// Asks `schedule`'s last count at or before `now`.
struct Scripted(Vec<(f64, u64)>);

impl Policy for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn desired(&mut self, now: f64, _: &PoolScaling, _: &FleetState) -> Result<u64> {
        Ok(self
            .0
            .iter()
            .rfind(|(t, _)| *t <= now)
            .map_or(0, |&(_, n)| n))
    }
}

fn scaling(min: u64, max: u64) -> PoolScaling {
    PoolScaling {
        name: "p".into(),
        context: 4096,
        min_endpoints: min,
        max_endpoints: max,
        slo_ttft_s: 2.0,
        slo_tpot_s: Some(0.08),
        entitlements: Vec::new(),
    }
}

fn config(initial: i64, period_s: f64, startup_s: f64, horizon_s: f64) -> ScaleConfig {
    let timing = Arc::new(LinearTiming::new(0.008, 0.00065).expect("timing"));
    ScaleConfig {
        pool: PoolConfig::new("p", initial, 4096, 8, 8 * 256, 512, 1, None, timing).expect("pool"),
        scaling: scaling(0, 16),
        period_s,
        startup_s,
        horizon_s,
        picker: preset_specs("least-request").expect("preset"),
        rises: Vec::new(),
    }
}

fn requests(times: &[f64], input: u64, output: u64) -> Vec<SimRequest> {
    times
        .iter()
        .map(|&arrival| SimRequest {
            arrival,
            input_tokens: input,
            output_tokens: output,
            category: 0,
            session: None,
        })
        .collect()
}

fn go(reqs: &[SimRequest], cfg: &ScaleConfig, policy: &mut dyn Policy) -> ScaleReport {
    run(reqs, cfg, policy, &AtomicU64::new(0)).expect("run")
}

/// Endpoint-seconds by hand: 2 from 0 s, a third started at 10 s, one
/// drained (idle: it stops at once) at 20 s: 20 + 100 + 90 = 210.
#[test]
fn gpu_time_by_hand() {
    let cfg = config(2, 10.0, 5.0, 100.0);
    let r = go(
        &[],
        &cfg,
        &mut Scripted(vec![(0.0, 2), (10.0, 3), (20.0, 2)]),
    );
    assert!((r.gpu_seconds - 210.0).abs() < 1e-9, "{}", r.gpu_seconds);
    assert_eq!((r.started, r.stopped), (3, 1));
    assert_eq!(r.ticks.len(), 10);
    assert_eq!(
        (r.ticks[0].ready, r.ticks[0].starting, r.ticks[1].ready),
        (2, 1, 2)
    );
    // Two started at 10 s and cancelled at 20 s while starting (25 s to
    // ready): 2 x 100 + 2 x 10.
    let cfg = config(2, 10.0, 15.0, 100.0);
    let r = go(
        &[],
        &cfg,
        &mut Scripted(vec![(0.0, 2), (10.0, 4), (20.0, 2)]),
    );
    assert!((r.gpu_seconds - 220.0).abs() < 1e-9, "{}", r.gpu_seconds);
    // Twice the GPUs per endpoint, twice the GPU time.
    let mut cfg = config(2, 10.0, 5.0, 100.0);
    cfg.pool.gpus_per_endpoint = 2;
    let r = go(&[], &cfg, &mut Scripted(vec![(0.0, 2)]));
    assert!((r.gpu_seconds - 400.0).abs() < 1e-9, "{}", r.gpu_seconds);
}

/// An endpoint started at 10 s with a 5 s start-up gets no request before
/// 15 s, and gets some after.
#[test]
fn a_starting_endpoint_gets_no_request() {
    let cfg = config(1, 10.0, 5.0, 30.0);
    let times: Vec<f64> = (0..300).map(|k| k as f64 * 0.1).collect();
    let reqs = requests(&times, 100, 20);
    let r = go(&reqs, &cfg, &mut Scripted(vec![(0.0, 1), (10.0, 2)]));
    for (k, q) in reqs.iter().enumerate() {
        if q.arrival < 15.0 {
            assert_eq!(r.endpoint[k], 0, "request {k} at {}", q.arrival);
        }
    }
    let late = (0..reqs.len()).filter(|&k| reqs[k].arrival >= 15.0 && r.endpoint[k] == 1);
    assert!(late.count() > 10);
    assert!(r.ttft.iter().all(|t| t.is_finite()));
}

/// With no endpoint ready (the only one stopped at 1 s, the next one
/// started at 2 s and ready at 5 s), requests wait at the router and go out
/// when one is ready.
#[test]
fn requests_wait_while_no_endpoint_is_ready() {
    let cfg = config(1, 1.0, 3.0, 20.0);
    let reqs = requests(&[1.5, 2.0, 3.0], 100, 10);
    let r = go(
        &reqs,
        &cfg,
        &mut Scripted(vec![(0.0, 1), (1.0, 0), (2.0, 1)]),
    );
    for (k, q) in reqs.iter().enumerate() {
        assert!(r.ttft[k] >= 5.0 - q.arrival, "{k}: {}", r.ttft[k]);
        assert_eq!(r.endpoint[k], 0);
    }
    assert_eq!((r.ticks[0].ready, r.ticks[1].starting), (0, 1));
    assert_eq!((r.ticks[1].waiting, r.ticks[2].waiting), (1, 2));
}

/// Draining: the endpoint told to stop gets no new request, finishes every
/// request it holds, and stops when the last one ends (its GPU time runs
/// to then).
#[test]
fn a_draining_endpoint_finishes_what_it_holds() {
    let cfg = config(2, 5.0, 1.0, 60.0);
    // 16 long requests at 0 s (8 per endpoint), then a trickle.
    let mut times = vec![0.0; 16];
    times.extend((0..50).map(|k| 5.5 + k as f64 * 0.5));
    let mut reqs = requests(&times, 200, 2000);
    for r in reqs.iter_mut().skip(16) {
        r.output_tokens = 5;
    }
    let r = go(&reqs, &cfg, &mut Scripted(vec![(0.0, 2), (5.0, 1)]));
    assert!(
        r.e2e.iter().all(|t| t.is_finite()),
        "every request finished"
    );
    let kept = r.endpoint[16];
    let drained = 1 - kept;
    let on_drained: Vec<usize> = (0..reqs.len())
        .filter(|&k| r.endpoint[k] == drained)
        .collect();
    assert_eq!(on_drained.len(), 8, "only the first burst");
    assert!(on_drained.iter().all(|&k| reqs[k].arrival < 5.0));
    let stop = on_drained
        .iter()
        .map(|&k| reqs[k].arrival + r.e2e[k])
        .fold(0.0, f64::max);
    assert!(stop > 5.0 + 10.0, "it drained long after 5 s: {stop}");
    assert!(
        (r.gpu_seconds - (60.0 + stop)).abs() < 1e-9,
        "{} vs {}",
        r.gpu_seconds,
        60.0 + stop
    );
    assert_eq!(r.ticks[0].draining, 1);
}

/// Random schedules: every request lands on an endpoint that was ready at
/// its dispatch, every request finishes, GPU time is at least the ready time.
#[test]
fn random_schedules_never_use_a_starting_or_stopped_endpoint() {
    let mut rng = Rng::new(5);
    for case in 0..20 {
        let period = 1.0 + rng.below(4) as f64;
        let startup = rng.below(6) as f64;
        let cfg = config(1 + rng.below(3) as i64, period, startup, 60.0);
        let schedule: Vec<(f64, u64)> = (0..30).map(|k| (k as f64 * 2.0, rng.below(6))).collect();
        let mut t = 0.0;
        let mut times = Vec::new();
        while t < 55.0 {
            t += rng.exponential(20.0);
            times.push(t);
        }
        let reqs = requests(&times, 50 + rng.below(500), 1 + rng.below(100));
        let r = go(&reqs, &cfg, &mut Scripted(schedule.clone()));
        assert!(r.e2e.iter().all(|x| x.is_finite()), "case {case}");
        // Replay the ticks: the set of ready endpoints between decisions
        // only grows at ready times, which the run logged as ticks' counts;
        // a request served by slot j arrived when j existed.
        let most = r.peak_endpoints;
        assert!(
            r.endpoint
                .iter()
                .all(|&e| e >= 0 && (e as u64) < most.max(1)),
            "case {case}"
        );
        assert!(r.ticks.iter().all(|t| t.desired <= 16), "case {case}");
    }
}

fn azure_like(n: usize, seed: u64) -> Vec<SimRequest> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|k| SimRequest {
            arrival: k as f64,
            input_tokens: 100 + rng.below(2000),
            output_tokens: 10 + rng.below(400),
            category: 0,
            session: None,
        })
        .collect()
}

fn autoscale_config(max: u64) -> AutoscaleConfig {
    AutoscaleConfig {
        pools: vec![PoolScaling {
            context: 8192,
            ..scaling(1, max)
        }],
        ..AutoscaleConfig::default()
    }
}

#[test]
fn the_sizer_is_the_autoscalers_model_and_grows_with_the_rate() {
    let cfg = autoscale_config(500);
    let profile = Profile::llama3_70b_a100();
    let reqs = azure_like(2000, 1);
    let mut sizer = Sizer::new(&cfg, &profile, &reqs).expect("ok");
    let mut last = 0;
    for rate in [1.0, 10.0, 50.0, 200.0] {
        let n = sizer.endpoints(rate).expect("ok");
        assert!(n >= last, "{rate}: {n} < {last}");
        last = n;
        // The autoscaler fed the same requests over one window of 60 s at
        // this rate sizes the same (same code).
        let mut a = Autoscaler::new(cfg.clone(), vec![profile.clone()], 0.0).expect("ok");
        let m = (rate * 60.0) as usize;
        for k in 0..m {
            let q = &reqs[k % reqs.len()];
            a.observe(
                0,
                None,
                60.0 * k as f64 / m as f64,
                q.input_tokens,
                q.output_tokens,
            )
            .expect("ok");
        }
        let d = a.step(60.0, &[]).expect("ok");
        let target = d[0].target.endpoints;
        assert!(
            target.abs_diff(n) <= (n / 10).max(1),
            "{rate}: {target} vs {n}"
        );
    }
    assert!(last > 1);
}

#[test]
fn hindsight_sees_the_step_coming() {
    let cfg = autoscale_config(500);
    let profile = Profile::llama3_70b_a100();
    let reqs = azure_like(2000, 2);
    let rates = RateProfile::parse("step:10@0,100@100").expect("ok");
    let mut sizer = Sizer::new(&cfg, &profile, &reqs).expect("ok");
    let (low, high) = (
        sizer.endpoints(10.0).expect("ok"),
        sizer.endpoints(100.0).expect("ok"),
    );
    assert!(high > low);
    let mut h = Hindsight::new(sizer, rates, 40.0).expect("ok");
    let st = FleetState {
        ready: 1,
        starting: 0,
        draining: 0,
        waiting: 0,
        held: 0,
        backlogged: 0,
        running: 0,
        kv_usage: 0.0,
        max_num_seqs: 8,
    };
    let pool = &cfg.pools[0];
    assert_eq!(h.desired(50.0, pool, &st).expect("ok"), low);
    assert_eq!(
        h.desired(60.0, pool, &st).expect("ok"),
        high,
        "100 s is within 60 + 40"
    );
    assert_eq!(h.desired(200.0, pool, &st).expect("ok"), high);
}

#[test]
fn the_saturation_rule_by_hand() {
    let mut cfg = autoscale_config(100);
    cfg.scale_down_delay_s = 30.0;
    let mut p = Saturation::new(SaturationRule::default(), &cfg, 20).expect("ok");
    let pool = &cfg.pools[0];
    let st = |running: u64, waiting: u64, kv: f64| FleetState {
        ready: 20,
        starting: 0,
        draining: 0,
        waiting,
        held: 0,
        backlogged: 0,
        running,
        kv_usage: kv,
        max_num_seqs: 10,
    };
    // Slots 170 of 200 held: 0.85 >= 0.8, up by 10 % of 20.
    assert_eq!(p.desired(10.0, pool, &st(170, 0, 0.1)).expect("ok"), 22);
    // KV-cache use alone.
    assert_eq!(p.desired(20.0, pool, &st(10, 0, 0.9)).expect("ok"), 25);
    // Requests waiting: 2 per endpoint.
    assert_eq!(p.desired(30.0, pool, &st(10, 50, 0.1)).expect("ok"), 28);
    // Between the thresholds: stays.
    assert_eq!(p.desired(40.0, pool, &st(150, 0, 0.1)).expect("ok"), 28);
    // Below 0.5 with nothing waiting: down, but only after the delay.
    assert_eq!(p.desired(50.0, pool, &st(20, 0, 0.1)).expect("ok"), 28);
    assert_eq!(p.desired(70.0, pool, &st(20, 0, 0.1)).expect("ok"), 28);
    assert_eq!(p.desired(80.0, pool, &st(20, 0, 0.1)).expect("ok"), 25);
    // Low but something waits: no scale-down.
    assert_eq!(p.desired(90.0, pool, &st(20, 1, 0.1)).expect("ok"), 25);
    let bad = SaturationRule {
        down: 0.9,
        ..SaturationRule::default()
    };
    assert!(Saturation::new(bad, &cfg, 20).is_err());
}

/// The model-based policy is the autoscaler: the same observations and the
/// same queued demand give the same count; requests waiting in the engines
/// raise it.
#[test]
fn the_model_policy_is_the_autoscaler_with_the_engines_queue_as_demand() {
    let cfg = autoscale_config(500);
    let profile = Profile::llama3_70b_a100();
    let mut m = ModelBased::new(cfg.clone(), profile.clone(), 5).expect("ok");
    let mut a = Autoscaler::new(cfg.clone(), vec![profile.clone()], 0.0).expect("ok");
    a.set_current(0, 5).expect("ok");
    for (k, q) in azure_like(600, 3).iter().enumerate() {
        let t = k as f64 / 20.0;
        m.observe(t, q.input_tokens, q.output_tokens).expect("ok");
        a.observe(0, None, t, q.input_tokens, q.output_tokens)
            .expect("ok");
    }
    let st = |waiting| FleetState {
        ready: 5,
        starting: 0,
        draining: 0,
        waiting,
        held: waiting,
        backlogged: 0,
        running: 0,
        kv_usage: 0.0,
        max_num_seqs: 8,
    };
    let pool = &cfg.pools[0];
    let demand = crate::autoscale::PoolDemand {
        queued_requests: 300.0,
        promised_tokens_per_s: 0.0,
        busy_endpoints: 0.0,
        ready_endpoints: Some(5),
    };
    // From the first decision on, the autoscaler's count.
    let first = a.step(30.0, &[demand]).expect("ok")[0].endpoints;
    assert_eq!(m.desired(30.0, pool, &st(300)).expect("ok"), first);
    let want = a.step(60.0, &[demand]).expect("ok")[0].endpoints;
    assert_eq!(m.desired(60.0, pool, &st(300)).expect("ok"), want);
    let mut quiet = ModelBased::new(cfg.clone(), profile.clone(), 5).expect("ok");
    for (k, q) in azure_like(600, 3).iter().enumerate() {
        quiet
            .observe(k as f64 / 20.0, q.input_tokens, q.output_tokens)
            .expect("ok");
    }
    assert!(quiet.desired(60.0, pool, &st(0)).expect("ok") < want);
    // Requests queued in the engines make their endpoints busy, at most
    // the 20 that hold them: twice the backlog in the same 20 endpoints
    // asks for no more, while held at the router (any endpoint takes
    // them) it does.
    let in_engines = |waiting, held| FleetState {
        waiting,
        held,
        backlogged: 20,
        ..st(0)
    };
    let queued = |waiting, held| {
        let undamped = AutoscaleConfig {
            max_step_up_percent: 1e6,
            ..cfg.clone()
        };
        let mut m = ModelBased::new(undamped, profile.clone(), 5).expect("ok");
        for (k, q) in azure_like(600, 3).iter().enumerate() {
            m.observe(k as f64 / 20.0, q.input_tokens, q.output_tokens)
                .expect("ok");
        }
        m.desired(30.0, pool, &st(0)).expect("ok");
        m.desired(60.0, pool, &in_engines(waiting, held))
            .expect("ok")
    };
    let capped = queued(1_000_000, 0);
    assert!(capped > queued(0, 0), "{capped}");
    assert_eq!(queued(2_000_000, 0), capped);
    assert!(queued(1_000_000, 1_000_000) > capped);
    // Out of bounds: refused.
    assert!(ModelBased::new(cfg, Profile::llama3_70b_a100(), 501).is_err());
}

#[test]
fn a_fixed_fleet_stays() {
    let cfg = config(3, 10.0, 5.0, 50.0);
    let r = go(&[], &cfg, &mut Fixed(3));
    assert!((r.gpu_seconds - 150.0).abs() < 1e-9);
    assert!(r.ticks.iter().all(|t| t.ready == 3 && t.starting == 0));
}

#[test]
fn bad_runs_are_refused() {
    let reqs = requests(&[1.0, 100.0], 10, 10);
    let cfg = config(1, 10.0, 5.0, 50.0);
    let e = run(&reqs, &cfg, &mut Fixed(1), &AtomicU64::new(0)).expect_err("refused");
    assert!(e.to_string().contains("after the horizon"), "{e}");
    let mut c = config(1, 10.0, 5.0, 50.0);
    c.scaling = scaling(5, 3);
    assert!(run(&[], &c, &mut Fixed(1), &AtomicU64::new(0)).is_err());
    let c = config(1, 0.0, 5.0, 50.0);
    assert!(run(&[], &c, &mut Fixed(1), &AtomicU64::new(0)).is_err());
    let reqs = requests(&[2.0, 1.0], 10, 10);
    let e = run(&reqs, &cfg, &mut Fixed(1), &AtomicU64::new(0)).expect_err("refused");
    assert!(e.to_string().contains("sorted"), "{e}");
}

/// Requests arriving from a rise until the first start-up after it ends are
/// left out of the attainment, and only those: a rise at 10 s (a decision's
/// instant, which comes before the rise's arrivals) is first seen at 20 s,
/// whose endpoints are ready at 25 s; one at 12 s the same.
#[test]
fn the_first_start_up_after_a_rise_is_excluded() {
    let mut cfg = config(1, 10.0, 5.0, 40.0);
    assert_eq!(cfg.excluded_until(10.0), 25.0);
    assert_eq!(cfg.excluded_until(12.0), 25.0);
    assert_eq!(cfg.excluded_until(19.9), 25.0);
    cfg.rises = vec![10.0];
    let reqs = requests(&[1.0, 9.9, 10.0, 14.9, 15.0, 20.0, 24.9, 25.0, 30.0], 10, 2);
    let r = go(&reqs, &cfg, &mut Fixed(1));
    let out = [false, false, true, true, true, true, true, false, false];
    assert_eq!(r.excluded, out);
    assert_eq!(r.attainment, 1.0);
}
