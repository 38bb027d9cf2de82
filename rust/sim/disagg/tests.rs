use std::sync::Arc;

use super::*;
use crate::sim::tests::req;
use crate::sim::timing::LinearTiming;

const W: f64 = 0.008;
const H: f64 = 0.00065;

fn pool(name: &str, endpoints: i64, seqs: i64) -> PoolConfig {
    let timing = Arc::new(LinearTiming::new(W, H).expect("timing"));
    PoolConfig::new(
        name,
        endpoints,
        8192,
        seqs,
        seqs * 512,
        512,
        1,
        None,
        timing,
    )
    .expect("pool")
}

fn fleet(prefill: Option<i64>, decode: i64, decider: Decider) -> DisaggFleet {
    DisaggFleet {
        prefill: prefill.map(|n| pool("prefill", n, 16)),
        decode: pool("decode", decode, 16),
        decider,
        transfer: Transfer::new(40960.0, 25e9, 0.002).expect("transfer"),
        warmup: 0.0,
        fast_forward: true,
    }
}

/// One request alone: 3 prefill iterations (1,200 tokens in chunks of 512),
/// the transfer, the decode's first step, then 9 decode steps, each
/// iteration `W + H` with one sequence; aggregated, no transfer.
#[test]
fn one_request_by_hand() {
    let t = W + H;
    let xfer = 0.002 + 40960.0 * 1200.0 / 25e9;
    let reqs = [req(0.0, 1200, 10)];
    let r = simulate_disagg(&reqs, &fleet(Some(1), 1, Decider::Always)).expect("sim");
    assert!(r.disaggregated[0]);
    assert!((r.ttft[0] - (3.0 * t + xfer + t)).abs() < 1e-12, "{r:?}");
    assert!(
        (r.e2e[0] - (3.0 * t + xfer + 10.0 * t)).abs() < 1e-12,
        "{r:?}"
    );
    assert!((r.tpot[0] - t).abs() < 1e-12);
    let r = simulate_disagg(&reqs, &fleet(None, 1, Decider::Never)).expect("sim");
    assert!(!r.disaggregated[0]);
    assert!((r.ttft[0] - 3.0 * t).abs() < 1e-12, "{r:?}");
    assert!((r.e2e[0] - 12.0 * t).abs() < 1e-12, "{r:?}");
    assert_eq!(r.pools.len(), 1);
}

/// The conditional decider splits only prompts above its threshold, and
/// the prefill pool sees only those.
#[test]
fn conditional_splits_long_prompts() {
    let reqs: Vec<SimRequest> = (0..40)
        .map(|k| req(k as f64 * 0.05, if k % 2 == 0 { 1500 } else { 300 }, 20))
        .collect();
    let r = simulate_disagg(&reqs, &fleet(Some(1), 2, Decider::Conditional(1000))).expect("sim");
    for (k, q) in reqs.iter().enumerate() {
        assert_eq!(r.disaggregated[k], q.input_tokens > 1000);
        assert!(r.e2e[k].is_finite() && r.ttft[k] > 0.0);
    }
    assert_eq!(r.pools[0].requests, 20);
    assert_eq!(r.pools[1].requests, 40);
}

/// Every request finishes exactly once, under load and under preemption
/// (a decode pool with blocks for few sequences drops transferred KV and
/// recomputes it), for each decider.
#[test]
fn every_request_finishes() {
    let mut rng = crate::rng::Rng::new(3);
    let mut t = 0.0;
    let reqs: Vec<SimRequest> = (0..600)
        .map(|_| {
            t += rng.exponential(40.0);
            req(t, 1 + rng.below(4000), 1 + rng.below(400))
        })
        .collect();
    for decider in [Decider::Always, Decider::Never, Decider::Conditional(2000)] {
        let mut f = fleet(Some(2), 3, decider);
        // Room for about two long sequences' KV per decode endpoint.
        f.decode.kv_blocks = 2 * 512 + 10;
        let r = simulate_disagg(&reqs, &f).expect("sim");
        assert!(r.e2e.iter().all(|e| e.is_finite()), "{decider:?}");
        assert!(r.ttft.iter().zip(&r.e2e).all(|(a, b)| a <= b));
        assert!(
            r.pools.last().map_or(0, |p| p.preemptions) > 0,
            "{decider:?}"
        );
    }
}

#[test]
fn bad_fleets_are_refused() {
    let reqs = [req(0.0, 100, 10)];
    // Decode endpoints and no prefill endpoint, with a decider that splits.
    let err = simulate_disagg(&reqs, &fleet(None, 1, Decider::Always)).expect_err("refused");
    assert!(err.to_string().contains("prefill pool"), "{err}");
    let mut f = fleet(Some(1), 1, Decider::Always);
    f.transfer.bandwidth_bytes_s = 0.0;
    assert!(simulate_disagg(&reqs, &f).is_err());
    let long = [req(0.0, 8000, 500)];
    assert!(simulate_disagg(&long, &fleet(Some(1), 1, Decider::Always)).is_err());
    assert!(Decider::parse("sometimes", 0).is_err());
    assert_eq!(
        Decider::parse("conditional", 7).ok(),
        Some(Decider::Conditional(7))
    );
}
