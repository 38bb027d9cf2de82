//! Hand-checkable scenarios: every expected number is worked out from the
//! engine's rules with W = 8 ms, H = 0.65 ms and C_chunk = 512.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::timing::LinearTiming;
use super::*;
use crate::pick::preset_specs;

const W: f64 = 0.008;
const H: f64 = 0.00065;

fn pool(name: &str, endpoints: i64, max_context: i64, seqs: i64, blocks: i64) -> PoolConfig {
    let timing = Arc::new(LinearTiming::new(W, H).expect("timing"));
    PoolConfig::new(
        name,
        endpoints,
        max_context,
        seqs,
        blocks,
        512,
        1,
        None,
        timing,
    )
    .expect("pool")
}

fn config(pools: Vec<PoolConfig>, preset: &str) -> SimConfig {
    SimConfig {
        pools,
        categories: vec![Category {
            name: "prose".into(),
            bytes_per_token: 4.0,
            compressible: true,
        }],
        picker: preset_specs(preset).expect("preset"),
        seed: 7,
        warmup: 0.0,
        fast_forward: true,
        scrape_interval: 0.0,
    }
}

/// A request of category 0, no session (the simulator's tests' and its
/// disaggregated half's).
pub(super) fn req(arrival: f64, input: u64, output: u64) -> SimRequest {
    SimRequest {
        arrival,
        input_tokens: input,
        output_tokens: output,
        category: 0,
        session: None,
    }
}

fn run(requests: &[SimRequest], cfg: &SimConfig, kind: RouterKind) -> SimReport {
    run_with_blocks(requests, &RequestBlocks::none(requests.len()), cfg, kind)
}

fn run_with_blocks(
    requests: &[SimRequest],
    blocks: &RequestBlocks,
    cfg: &SimConfig,
    kind: RouterKind,
) -> SimReport {
    let mut router = make_router(kind, cfg).expect("router");
    simulate(requests, blocks, cfg, router.as_mut(), &AtomicU64::new(0)).expect("simulate")
}

/// Block hashes per request, each given as a list.
fn blocks_of(per_request: &[Vec<u64>]) -> RequestBlocks {
    let mut offsets = vec![0];
    let mut hashes = Vec::new();
    for h in per_request {
        hashes.extend(h);
        offsets.push(hashes.len());
    }
    RequestBlocks::new(hashes, offsets, per_request.len()).expect("blocks")
}

/// `n` distinct hashes starting at `from`.
fn seq(from: u64, n: u64) -> Vec<u64> {
    (from..from + n).collect()
}

#[test]
fn a_repeated_prompt_skips_its_cached_blocks() {
    // 1500 tokens at C = 512: three prefill iterations. Repeated after the
    // first finished: its 93 full blocks (1488 tokens) hit, 12 tokens are left
    // to prefill, one iteration. A prompt sharing 40 blocks (640 tokens)
    // prefills 860 tokens: two iterations.
    let cfg = config(vec![pool("p", 1, 8192, 16, 4096)], "least-request");
    let work = [req(0.0, 1500, 1), req(1.0, 1500, 1), req(2.0, 1500, 1)];
    let mut third = seq(0, 40);
    third.extend(seq(1000, 53));
    let blocks = blocks_of(&[seq(0, 93), seq(0, 93), third]);
    let rep = run_with_blocks(&work, &blocks, &cfg, RouterKind::Homogeneous);
    let t = W + H;
    assert_eq!(rep.cached_tokens, vec![0, 1488, 640]);
    assert!(close(rep.ttft[0], 3.0 * t));
    assert!(close(rep.ttft[1], t), "{}", rep.ttft[1]);
    assert!(close(rep.ttft[2], 2.0 * t));
    // Without hashes nothing is cached.
    let rep = run(&work, &cfg, RouterKind::Homogeneous);
    assert_eq!(rep.cached_tokens, vec![0, 0, 0]);
    assert!(close(rep.ttft[1], 3.0 * t));
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let cfg = config(vec![pool("p", 1, 8192, 16, 4096)], "least-request");
    let work = [req(0.0, 1024, 1), req(1.0, 1024, 1)];
    let rep = run_with_blocks(
        &work,
        &blocks_of(&[seq(0, 64), seq(0, 64)]),
        &cfg,
        RouterKind::Homogeneous,
    );
    assert_eq!(rep.cached_tokens, vec![0, 1023]);
    assert!(close(rep.ttft[1], W + H));
}

#[test]
fn the_endpoint_cache_evicts_least_recently_used_blocks() {
    // One endpoint of 128 blocks, requests one after another (1024-token
    // prompts, 64 blocks each): A and B fill the cache; A again hits and
    // becomes the most recent; D evicts B, the least recent; so A hits again
    // and B misses.
    let cfg = config(vec![pool("p", 1, 2048, 1, 128)], "least-request");
    let (a, b, d) = (seq(0, 64), seq(100, 64), seq(200, 64));
    let work: Vec<_> = (0..6).map(|i| req(i as f64, 1024, 1)).collect();
    let blocks = blocks_of(&[a.clone(), b.clone(), a.clone(), d, a, b]);
    let rep = run_with_blocks(&work, &blocks, &cfg, RouterKind::Homogeneous);
    assert_eq!(rep.cached_tokens, vec![0, 0, 1023, 0, 1023, 0]);
}

#[test]
fn request_blocks_are_checked() {
    let blocks = RequestBlocks::new(vec![1, 2], vec![0, 2], 1).expect("blocks");
    assert_eq!(blocks.prompt(0, 40), &[1, 2]);
    assert_eq!(blocks.prompt(0, 20), &[1]);
    assert!(RequestBlocks::new(vec![1, 2], vec![0, 1], 1).is_err());
    assert!(RequestBlocks::new(vec![1, 2], vec![0, 2, 2], 1).is_err());
    assert!(RequestBlocks::new(vec![1, 2], vec![1, 2], 1).is_err());
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn one_request_alone() {
    // 1000 tokens at C = 512: two prefill iterations of one sequence, the
    // second samples the first token; then 4 decode iterations.
    let cfg = config(vec![pool("p", 1, 8192, 16, 4096)], "least-request");
    let rep = run(&[req(1.0, 1000, 5)], &cfg, RouterKind::Homogeneous);
    let t = W + H;
    assert!(close(rep.ttft[0], 2.0 * t), "{}", rep.ttft[0]);
    assert!(close(rep.e2e[0], 6.0 * t));
    assert!(close(rep.tpot[0], t));
    assert!(close(rep.queue_wait[0], 0.0));
    assert!(close(rep.makespan, 1.0 + 6.0 * t));
    // 1024 tokens are still two chunks; 1025 are three.
    let rep = run(&[req(0.0, 1024, 1)], &cfg, RouterKind::Homogeneous);
    assert!(close(rep.ttft[0], 2.0 * t) && rep.tpot[0].is_nan());
    let rep = run(&[req(0.0, 1025, 1)], &cfg, RouterKind::Homogeneous);
    assert!(close(rep.ttft[0], 3.0 * t));
}

#[test]
fn two_requests_share_iterations() {
    // Both arrive at 0 with 300-token prompts. Iteration 1: A prefills 300,
    // B 212 of its 300 (chunk 512), two active, A samples its first token.
    // Iteration 2: A decodes, B prefills 88 and samples. Iteration 3: both
    // decode and finish (A has 3 outputs, B 2).
    let cfg = config(vec![pool("p", 1, 8192, 16, 4096)], "least-request");
    let rep = run(
        &[req(0.0, 300, 3), req(0.0, 300, 2)],
        &cfg,
        RouterKind::Homogeneous,
    );
    let t = W + 2.0 * H;
    assert!(close(rep.ttft[0], t));
    assert!(close(rep.ttft[1], 2.0 * t));
    assert!(close(rep.e2e[0], 3.0 * t) && close(rep.e2e[1], 3.0 * t));
    assert!(close(rep.tpot[0], t) && close(rep.tpot[1], t));
    assert_eq!(rep.pools[0].preemptions, 0);
}

#[test]
fn slots_make_requests_wait() {
    // One slot: B waits for A's whole service (1 prefill + 1 decode iteration).
    let cfg = config(vec![pool("p", 1, 8192, 1, 4096)], "least-request");
    let rep = run(
        &[req(0.0, 100, 2), req(0.0, 100, 2)],
        &cfg,
        RouterKind::Homogeneous,
    );
    let t = W + H;
    assert!(close(rep.queue_wait[1], 2.0 * t));
    assert!(close(rep.ttft[1], 3.0 * t));
}

#[test]
fn preemption_when_blocks_run_out() {
    // A 64-token window (4 blocks) and two slots. Two 16-token prompts with 40
    // outputs each need up to ceil(55 / 16) = 4 blocks each: 8 blocks never
    // preempt, 4 blocks must.
    let work = [req(0.0, 16, 40), req(0.0, 16, 40)];
    let safe = config(vec![pool("p", 1, 64, 2, 8)], "least-request");
    let rep = run(&work, &safe, RouterKind::Homogeneous);
    assert_eq!(rep.pools[0].preemptions, 0);
    // Alone-speed: one prefill iteration and 39 decodes, both in every batch.
    assert!(close(rep.e2e[1], 40.0 * (W + 2.0 * H)));
    let tight = config(vec![pool("p", 1, 64, 2, 4)], "least-request");
    let rep = run(&work, &tight, RouterKind::Homogeneous);
    assert!(rep.pools[0].preemptions >= 1);
    // Both still finish, the preempted one later than it would have.
    assert!(rep.e2e.iter().all(|e| e.is_finite()));
    assert!(rep.e2e[1] > 40.0 * (W + 2.0 * H));
    assert_eq!(rep.pools[0].rejections, 0);
}

#[test]
fn rejection_above_max_context() {
    let cfg = config(vec![pool("p", 1, 1024, 4, 64)], "least-request");
    let rep = run(
        &[req(0.0, 1000, 24), req(0.0, 1000, 25)],
        &cfg,
        RouterKind::Homogeneous,
    );
    assert!(!rep.rejected[0] && rep.ttft[0].is_finite());
    assert!(rep.rejected[1] && rep.ttft[1].is_nan() && rep.e2e[1].is_nan());
    assert_eq!(rep.pools[0].rejections, 1);
    assert_eq!(rep.pools[0].requests, 1);
}

#[test]
fn burst_into_idle_pool_spreads_evenly() {
    let burst: Vec<_> = (0..64).map(|_| req(0.0, 64, 50)).collect();
    for dispatch in ["least-request", "round-robin"] {
        let cfg = config(vec![pool("p", 8, 8192, 16, 4096)], dispatch);
        let rep = run(&burst, &cfg, RouterKind::Homogeneous);
        // Eight requests per endpoint: their 8 x 64 prompt tokens fill one chunk,
        // then all decode together, so all see the same
        // t_iter = W + 8 H. A single herded endpoint would give 64 H.
        let t = W + 8.0 * H;
        assert!(rep.e2e.iter().all(|&e| close(e, 50.0 * t)), "{dispatch:?}");
    }
}

#[test]
fn token_budget_short_pool_never_preempts() {
    // Short pool sized by the rule: 8 slots x ceil(2048 / 16) blocks.
    let mut rng = Rng::new(3);
    let mut work: Vec<SimRequest> = (0..3000)
        .map(|_| {
            let cap = if rng.uniform() < 0.8 { 1500 } else { 6000 };
            let input = 1 + rng.below(cap);
            req(0.0, input, 1 + rng.below(400))
        })
        .collect();
    set_arrivals(&mut work, Arrivals::Poisson(40.0), 1).expect("arrivals");
    let fleet = |short_blocks| {
        config(
            vec![
                pool("short", 4, 2048, 8, short_blocks),
                pool("long", 4, 8192, 4, 4 * 512),
            ],
            "least-request",
        )
    };
    let rep = run(&work, &fleet(8 * 128), RouterKind::TokenBudget);
    assert!(rep.pools[0].requests > 1000 && rep.pools[1].requests > 100);
    assert_eq!(rep.pools[0].preemptions, 0);
    assert_eq!(rep.pools[0].rejections, 0);
    // Break the rule: the same slots over half the blocks.
    let rep = run(&work, &fleet(4 * 128), RouterKind::TokenBudget);
    assert!(rep.pools[0].preemptions > 0);
}

#[test]
fn compress_and_route_moves_the_band_short() {
    // B = 2048, gamma = 1.5: a 2500-token estimate is cut to 2048 - 100 input
    // tokens and served short; 4000 stays long.
    let cfg = config(
        vec![
            pool("short", 1, 2048, 8, 1024),
            pool("long", 1, 8192, 4, 2048),
        ],
        "least-request",
    );
    let work = [req(0.0, 2400, 100), req(0.0, 3900, 100)];
    let rep = run(&work, &cfg, RouterKind::CompressAndRoute { gamma: 1.5 });
    assert_eq!(rep.pool, vec![0, 1]);
    assert_eq!(rep.compressed, vec![true, false]);
    // 1948 input tokens: four chunks, alone then with the long pool apart.
    assert!(close(rep.ttft[0], 4.0 * (W + H)));
    let rep = run(&work, &cfg, RouterKind::TokenBudget);
    assert_eq!(rep.pool, vec![1, 1]);
}

#[test]
fn deterministic_for_a_seed() {
    let mut work: Vec<SimRequest> = (0..2000)
        .map(|i| req(0.0, 50 + i % 700, 1 + i % 90))
        .collect();
    set_arrivals(&mut work, Arrivals::Poisson(200.0), 9).expect("arrivals");
    let cfg = config(vec![pool("p", 6, 8192, 16, 4096)], "random");
    let a = run(&work, &cfg, RouterKind::Homogeneous);
    let b = run(&work, &cfg, RouterKind::Homogeneous);
    assert_eq!(a.e2e, b.e2e);
    assert_eq!(a.pools, b.pools);
    let mut other = cfg.clone();
    other.seed = 8;
    assert_ne!(run(&work, &other, RouterKind::Homogeneous).e2e, a.e2e);
}

#[test]
fn arrivals_scaled_and_poisson() {
    let mut work: Vec<SimRequest> = (0..5).map(|i| req(10.0 + 2.0 * i as f64, 10, 1)).collect();
    set_arrivals(&mut work, Arrivals::Scaled(2.0), 0).expect("scaled");
    let times: Vec<f64> = work.iter().map(|r| r.arrival).collect();
    assert_eq!(times, vec![0.0, 0.5, 1.0, 1.5, 2.0]);
    let mut many: Vec<SimRequest> = (0..20_000).map(|_| req(0.0, 10, 1)).collect();
    set_arrivals(&mut many, Arrivals::Poisson(100.0), 5).expect("poisson");
    let last = many.last().map_or(0.0, |r| r.arrival);
    assert!((last - 200.0).abs() < 5.0, "{last}");
    assert!(set_arrivals(&mut many, Arrivals::Poisson(0.0), 5).is_err());
    work.swap(0, 1);
    assert!(set_arrivals(&mut work, Arrivals::AsGiven, 0).is_err());
}

#[test]
fn bad_input_is_refused() {
    let timing = Arc::new(LinearTiming::new(W, H).expect("timing"));
    // Blocks that cannot hold one max_context sequence; zero sizes.
    assert!(PoolConfig::new("p", 1, 8192, 16, 100, 512, 1, None, timing.clone()).is_err());
    assert!(PoolConfig::new("p", 0, 8192, 16, 4096, 512, 1, None, timing.clone()).is_err());
    assert!(PoolConfig::new("p", 1, 8192, 16, 4096, 0, 1, None, timing.clone()).is_err());
    assert!(PoolConfig::new("", 1, 8192, 16, 4096, 512, 1, None, timing).is_err());
    let cfg = config(vec![pool("p", 1, 8192, 16, 4096)], "least-request");
    let mut router = make_router(RouterKind::Homogeneous, &cfg).expect("router");
    let p = AtomicU64::new(0);
    for bad in [req(0.0, 0, 1), req(0.0, 1, 0), req(f64::NAN, 1, 1)] {
        assert!(simulate(&[bad], &RequestBlocks::none(1), &cfg, router.as_mut(), &p).is_err());
    }
    let mut c = cfg.clone();
    c.warmup = 1.0;
    assert!(simulate(
        &[req(0.0, 1, 1)],
        &RequestBlocks::none(1),
        &c,
        router.as_mut(),
        &p
    )
    .is_err());
    let two = config(
        vec![pool("a", 1, 8192, 16, 4096), pool("b", 1, 8192, 16, 4096)],
        "least-request",
    );
    assert!(make_router(RouterKind::Homogeneous, &two).is_err());
    assert!(make_router(RouterKind::CompressAndRoute { gamma: 0.5 }, &two).is_err());
}

#[test]
fn percentile_interpolates() {
    let xs = [4.0, 1.0, f64::NAN, 3.0, 2.0];
    assert!(close(percentile(&xs, 50.0), 2.5));
    assert!(close(percentile(&xs, 100.0), 4.0));
    assert!(close(percentile(&xs, 90.0), 3.7));
    assert!(percentile(&[f64::NAN], 50.0).is_nan());
}

#[test]
fn fast_forward_changes_nothing() {
    // Mixed lengths, arrivals that cut stretches, and a pool tight enough on
    // blocks to preempt: stretches must reproduce every iteration's outcome.
    let mut rng = Rng::new(11);
    let mut work: Vec<SimRequest> = (0..3000)
        .map(|_| req(0.0, 1 + rng.below(1500), 1 + rng.below(300)))
        .collect();
    set_arrivals(&mut work, Arrivals::Poisson(60.0), 2).expect("arrivals");
    for blocks in [8 * 128, 3 * 128] {
        let mut cfg = config(vec![pool("p", 3, 2048, 8, blocks)], "least-request");
        let fast = run(&work, &cfg, RouterKind::Homogeneous);
        cfg.fast_forward = false;
        let slow = run(&work, &cfg, RouterKind::Homogeneous);
        for (k, (a, b)) in fast.e2e.iter().zip(&slow.e2e).enumerate() {
            assert!(
                (a - b).abs() < 1e-6,
                "{blocks} #{k} {:?}: {a} vs {b}",
                work[k]
            );
        }
        for (a, b) in fast.ttft.iter().zip(&slow.ttft) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert_eq!(fast.pools[0].preemptions, slow.pools[0].preemptions);
        let (u, v) = (
            fast.pools[0].utilization_simulated,
            slow.pools[0].utilization_simulated,
        );
        assert!((u - v).abs() < 1e-9 && u > 0.3, "{u} vs {v}");
        if blocks < 8 * 128 {
            assert!(fast.pools[0].preemptions > 0);
        }
    }
}

#[test]
fn fast_forward_matches_on_small_random_fleets() {
    // Two tight endpoints (3 slots, 12 blocks, 16-token chunks) and bursts of
    // short requests: many cuts, preemptions and ties, checked exhaustively.
    for seed in 0..500u64 {
        let mut rng = Rng::new(seed);
        let n = 2 + rng.below(20) as usize;
        let mut w: Vec<SimRequest> = (0..n)
            .map(|_| {
                let t = rng.uniform() * 0.2;
                let input = 1 + rng.below(40);
                req(t, input, 1 + rng.below(12))
            })
            .collect();
        w.sort_by(|a, b| a.arrival.total_cmp(&b.arrival));
        let mut cfg = config(vec![pool("p", 2, 64, 3, 12)], "least-request");
        cfg.pools[0].chunk = 16;
        let fast = run(&w, &cfg, RouterKind::Homogeneous);
        cfg.fast_forward = false;
        let slow = run(&w, &cfg, RouterKind::Homogeneous);
        for k in 0..n {
            assert!((fast.e2e[k] - slow.e2e[k]).abs() < 1e-9, "seed {seed}");
            assert!((fast.ttft[k] - slow.ttft[k]).abs() < 1e-9, "seed {seed}");
        }
        assert_eq!(fast.pools[0].preemptions, slow.pools[0].preemptions);
    }
}

#[test]
fn model_state_by_hand() {
    // 16 slots, 2 requests/s per endpoint, 150 iterations each, no prompt:
    // t = W / (1 - H rate E[a]) = 0.008 / 0.805, occupancy = 2 * 150 * t.
    let p = pool("p", 1, 8192, 16, 8192);
    let m = model_state(2.0, &[150.0, 22500.0, 0.0, 0.0, 0.0], &p);
    assert!(close(m.t_iter_s, 0.008 / 0.805));
    assert!((m.utilization - 2.4 / 0.805 / 16.0).abs() < 1e-9, "{m:?}");
    assert_eq!(m.prefill_utilization, 0.0);
    // Overloaded compute: H rate E[a] >= 1, the iteration time is unbounded.
    let m = model_state(20.0, &[150.0, 22500.0, 0.0, 0.0, 0.0], &p);
    assert!(m.t_iter_s.is_infinite());
}

#[test]
fn the_prefix_picker_sends_a_repeated_prompt_where_it_is_cached() {
    // Four requests one after another with the same 1500-token prompt on two
    // endpoints: the prefix picker keeps them on endpoint 0, where all but the
    // first hit; round-robin alternates, so the first two miss.
    let work: Vec<_> = (0..4).map(|i| req(i as f64, 1500, 1)).collect();
    let blocks = blocks_of(&vec![seq(0, 93); 4]);
    let pools = || vec![pool("p", 2, 8192, 16, 4096)];
    let prefix = run_with_blocks(
        &work,
        &blocks,
        &config(pools(), "prefix"),
        RouterKind::Homogeneous,
    );
    assert_eq!(prefix.endpoint, vec![0, 0, 0, 0]);
    assert_eq!(prefix.cached_tokens, vec![0, 1488, 1488, 1488]);
    let rr = run_with_blocks(
        &work,
        &blocks,
        &config(pools(), "round-robin"),
        RouterKind::Homogeneous,
    );
    assert_eq!(rr.endpoint, vec![0, 1, 0, 1]);
    assert_eq!(rr.cached_tokens, vec![0, 0, 1488, 1488]);
}

#[test]
fn between_scrapes_the_picker_counts_its_own_dispatches_still_in_flight() {
    // A request goes to endpoint 0 at t = 0, the next comes at t = 0.5.
    // Scraped every second, the picker last saw the engines at t = 0, before
    // its dispatch: it counts that dispatch on endpoint 0 while the request
    // runs (200 tokens, past t = 0.5), so the next one takes endpoint 1; a
    // one-token request is done 8.65 ms later, and an ended request waits
    // in no queue, so the next one takes the first endpoint as when the
    // engines are read at every decision (or scraped every 0.25 s).
    let mut cfg = config(vec![pool("p", 2, 8192, 16, 4096)], "least-request");
    for (output, interval, want) in [
        (200, 0.0, [0, 1]),
        (200, 1.0, [0, 1]),
        (1, 0.0, [0, 0]),
        (1, 1.0, [0, 0]),
        (1, 0.25, [0, 0]),
    ] {
        cfg.scrape_interval = interval;
        let work = [req(0.0, 100, output), req(0.5, 100, 1)];
        let rep = run(&work, &cfg, RouterKind::Homogeneous);
        assert_eq!(
            rep.endpoint, want,
            "{output} tokens, scraped every {interval} s"
        );
    }
    let work = [req(0.0, 100, 1), req(0.5, 100, 1)];
    cfg.scrape_interval = f64::NAN;
    let mut router = make_router(RouterKind::Homogeneous, &cfg).expect("router");
    let p = AtomicU64::new(0);
    assert!(simulate(&work, &RequestBlocks::none(2), &cfg, router.as_mut(), &p).is_err());
}

#[test]
fn session_affinity_keeps_a_conversation_on_its_endpoint() {
    // Session affinity, then round-robin among equals: a new session goes
    // to the next endpoint in turn, a known one back to its endpoint.
    let mut cfg = config(vec![pool("p", 3, 8192, 16, 4096)], "round-robin");
    cfg.picker = vec![
        PluginSpec::new("session-affinity", 1.0),
        PluginSpec::with(
            "max-score",
            1.0,
            serde_json::json!({ "ties": "round-robin" }),
        ),
    ];
    let run_sessions = |sessions: [Option<u64>; 5]| {
        let work: Vec<_> = sessions
            .iter()
            .enumerate()
            .map(|(i, &s)| SimRequest {
                session: s,
                ..req(i as f64, 100, 1)
            })
            .collect();
        run(&work, &cfg, RouterKind::Homogeneous).endpoint
    };
    assert_eq!(
        run_sessions([Some(7), Some(8), Some(7), Some(9), Some(8)]),
        vec![0, 1, 0, 1, 1]
    );
    assert_eq!(run_sessions([None; 5]), vec![0, 1, 2, 0, 1]);
}

/// The shared-prefix workload as simulator input: requests and blocks
/// (with their token ids unless `tokens` is false).
fn prefix_run_input(
    cfg: &super::prefix_workload::PrefixWorkloadConfig,
    tokens: bool,
) -> (Vec<SimRequest>, RequestBlocks) {
    let w = super::prefix_workload::generate(cfg).expect("workload");
    let requests = (0..w.arrival_s.len())
        .map(|i| req(w.arrival_s[i], w.input_tokens[i], w.output_tokens[i]))
        .collect();
    let mut blocks = w.blocks;
    if !tokens {
        blocks.tokens.clear();
    }
    (requests, blocks)
}

fn hit_rate(requests: &[SimRequest], rep: &SimReport) -> f64 {
    let cached: u64 = rep.cached_tokens.iter().sum();
    let prompt: u64 = requests.iter().map(|r| r.input_tokens).sum();
    cached as f64 / prompt as f64
}

/// Without the blocks' token ids the precise-prefix scorer has nothing to
/// look up and scores by its approximate fallback: the same picks as prefix.
#[test]
fn without_token_ids_precise_prefix_picks_as_the_approximate_prefix() {
    let wl = super::prefix_workload::PrefixWorkloadConfig {
        requests: 300,
        sessions: 16,
        ..Default::default()
    };
    let (work, blocks) = prefix_run_input(&wl, false);
    let pools = || vec![pool("p", 3, 16384, 16, 2048)];
    for (approx, precise) in [
        ("prefix", "precise-prefix"),
        ("prefix+queue+kv", "precise-prefix+queue+kv"),
    ] {
        let a = run_with_blocks(
            &work,
            &blocks,
            &config(pools(), approx),
            RouterKind::Homogeneous,
        );
        let p = run_with_blocks(
            &work,
            &blocks,
            &config(pools(), precise),
            RouterKind::Homogeneous,
        );
        assert_eq!(a.endpoint, p.endpoint, "{precise}");
        assert_eq!(a.cached_tokens, p.cached_tokens, "{precise}");
    }
}

/// A prompt hashed once: the workload's hashes are its tokens' chain, so a
/// pick hands them to the precise-prefix scorer as the tokens' hashes; it
/// picks as when the scorer hashed the tokens again. Hashes of another
/// chain are not handed over (the picks are those of the true chain), and
/// a false claim that they are the chain is believed (the scorer reads
/// the given hashes: the once path is taken).
#[test]
fn the_prompt_hashed_once_picks_as_hashed_twice() {
    let wl = super::prefix_workload::PrefixWorkloadConfig {
        requests: 600,
        rate: 4.0,
        sessions: 32,
        seed: 3,
        ..Default::default()
    };
    let (work, blocks) = prefix_run_input(&wl, true);
    assert!(blocks.chained, "the generator's hashes are the chain");
    let with_tokens = |hashes: Vec<u64>| {
        RequestBlocks::new(hashes, blocks.offsets.clone(), work.len())
            .and_then(|b| b.with_tokens(blocks.tokens.clone()))
            .expect("blocks")
    };
    assert_eq!(
        with_tokens(blocks.hashes.clone()),
        blocks,
        "checked as the chain"
    );
    let twice = RequestBlocks {
        chained: false,
        ..blocks.clone()
    };
    // The same blocks hashed from seed 1: another chain, never handed over.
    let b = engine::BLOCK_TOKENS as usize;
    let seed1: Vec<u64> = blocks
        .offsets
        .windows(2)
        .flat_map(|w| IdChain::new(&blocks.tokens[w[0] * b..w[1] * b], b, 1, 1))
        .collect();
    let other = with_tokens(seed1.clone());
    assert!(!other.chained);
    let lie = RequestBlocks {
        chained: true,
        ..other.clone()
    };
    let pools = || vec![pool("p", 4, 16384, 16, 1024)];
    for preset in ["precise-prefix", "precise-prefix+queue+kv"] {
        let run = |b: &RequestBlocks| {
            run_with_blocks(&work, b, &config(pools(), preset), RouterKind::Homogeneous)
        };
        let once = run(&blocks);
        for (what, rep) in [
            ("hashed twice", run(&twice)),
            ("another chain", run(&other)),
        ] {
            assert_eq!(once.endpoint, rep.endpoint, "{preset}: {what}");
            assert_eq!(once.cached_tokens, rep.cached_tokens, "{preset}: {what}");
        }
        assert_ne!(once.endpoint, run(&lie).endpoint, "{preset}: believed");
    }
}

/// Engines too small to hold every prefix: the approximate index still
/// believes an endpoint holds what was routed to it after the engine evicted
/// it; the index fed by the engines' events knows, so precise routing serves
/// more prompt tokens from cache.
#[test]
fn under_cache_pressure_precise_prefix_hits_more_than_the_approximate_index() {
    let wl = super::prefix_workload::PrefixWorkloadConfig {
        requests: 800,
        rate: 4.0,
        sessions: 48,
        turns: (2, 6),
        seed: 11,
        ..Default::default()
    };
    let (work, blocks) = prefix_run_input(&wl, true);
    let pools = || vec![pool("p", 4, 16384, 16, 1024)];
    let rate = |preset: &str| {
        let rep = run_with_blocks(
            &work,
            &blocks,
            &config(pools(), preset),
            RouterKind::Homogeneous,
        );
        hit_rate(&work, &rep)
    };
    let (approx, precise) = (rate("prefix"), rate("precise-prefix"));
    assert!(
        precise > approx,
        "precise {precise} vs approximate {approx}"
    );
}

/// Nothing a refused request touched stays changed (the step order of
/// `crate::dispatch`: route, admit, pick): over random mixes of requests,
/// some of which admission refuses (a dense prompt the token-budget
/// router's estimate sends to the short pool, too long for its context),
/// every other request is served exactly as in a run that never saw the
/// refused ones: same pool, endpoint, cached tokens and latencies. The
/// router's pool counts, its calibrator (which learns from answered
/// requests only), the picker's prefix index, sessions and counts are what
/// the later requests read, so any trace left would move them.
#[test]
fn a_refused_request_leaves_no_trace_in_the_fleet() {
    let mut cfg = config(
        vec![
            PoolConfig::new(
                "short",
                2,
                1536,
                8,
                4096,
                512,
                1,
                Some(1024),
                Arc::new(LinearTiming::new(W, H).expect("timing")),
            )
            .expect("pool"),
            pool("long", 2, 16384, 8, 4096),
        ],
        "prefix+queue+kv",
    );
    cfg.categories.push(Category {
        name: "dense".into(),
        bytes_per_token: 2.0,
        compressible: false,
    });
    let last = cfg.picker.len() - 1;
    cfg.picker
        .insert(last, PluginSpec::new("session-affinity", 1.0));
    cfg.scrape_interval = 0.05;
    let mut refusals = 0;
    for seed in 0..20u64 {
        let mut rng = crate::rng::Rng::new(seed);
        let mut t = 0.0;
        let mut work = Vec::new();
        let mut prompts = Vec::new();
        for k in 0..60u64 {
            t += 0.02 * rng.uniform();
            let dense = rng.below(3) == 0;
            // Dense prompts of 1,300 to 1,700 tokens: the cold calibrator
            // (4 bytes a token) estimates half, so they go short, where
            // those over 1,536 tokens with their output do not fit.
            let input = if dense {
                1300 + rng.below(400)
            } else {
                16 * (4 + rng.below(40))
            };
            work.push(SimRequest {
                category: usize::from(dense),
                session: Some(rng.below(6)),
                ..req(t, input, 1 + rng.below(40))
            });
            // Eight leading blocks shared with a quarter of the others.
            let shared = rng.below(4);
            let block = |b: u64| {
                if b < 8 {
                    shared << 16 | b
                } else {
                    (k + 1) << 32 | b
                }
            };
            prompts.push((0..input / 16).map(block).collect::<Vec<u64>>());
        }
        let kind = RouterKind::TokenBudget;
        let all = run_with_blocks(&work, &blocks_of(&prompts), &cfg, kind);
        let kept: Vec<usize> = (0..work.len()).filter(|&k| !all.rejected[k]).collect();
        refusals += work.len() - kept.len();
        let only: Vec<SimRequest> = kept.iter().map(|&k| work[k]).collect();
        let only_prompts: Vec<Vec<u64>> = kept.iter().map(|&k| prompts[k].clone()).collect();
        let alone = run_with_blocks(&only, &blocks_of(&only_prompts), &cfg, kind);
        // The router learns from served requests only: without the refused
        // ones, the others are routed (and admitted) alike.
        assert!(
            alone.rejected.iter().all(|r| !r),
            "seed {seed}: refused alone"
        );
        let bits = |v: &[f64], k: usize| v[k].to_bits();
        for (j, &k) in kept.iter().enumerate() {
            let a = &all;
            let b = &alone;
            assert_eq!(
                (
                    a.pool[k],
                    a.endpoint[k],
                    a.cached_tokens[k],
                    a.compressed[k]
                ),
                (
                    b.pool[j],
                    b.endpoint[j],
                    b.cached_tokens[j],
                    b.compressed[j]
                ),
                "seed {seed}, request {k}"
            );
            for (x, y) in [
                (&a.ttft, &b.ttft),
                (&a.e2e, &b.e2e),
                (&a.queue_wait, &b.queue_wait),
            ] {
                assert_eq!(bits(x, k), bits(y, j), "seed {seed}, request {k}");
            }
        }
    }
    assert!(refusals >= 20, "the mixes refuse requests: {refusals}");
}
