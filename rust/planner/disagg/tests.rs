use super::*;
use crate::planner::{engine_state, EngineShape};

fn profile() -> Profile {
    Profile::llama3_70b_a100()
}

fn workload(pairs: &[(i64, i64)], copies: usize) -> Workload {
    let (mut i, mut o) = (Vec::new(), Vec::new());
    for _ in 0..copies {
        for &(p, q) in pairs {
            i.push(p);
            o.push(q);
        }
    }
    Workload::new(&i, &o, None, None).expect("workload")
}

fn config(rate: f64, ttft: f64, tpot: f64) -> DisaggConfig {
    DisaggConfig {
        arrival_rate: rate,
        slo: EngineSlo {
            ttft_s: ttft,
            tpot_s: Some(tpot),
            quantile: 0.99,
        },
        context: 16384,
        transfer: Transfer::new(40960.0, 25e9, 0.002).expect("transfer"),
    }
}

#[test]
fn transfer_delay_by_hand_and_bad_links() {
    let t = Transfer::new(40960.0, 25e9, 0.002).expect("ok");
    assert_eq!(t.delay_s(0), 0.002);
    assert!((t.delay_s(2000) - (0.002 + 40960.0 * 2000.0 / 25e9)).abs() < 1e-15);
    // Linear in the prompt: the per-chunk term is exact at chunk multiples.
    assert!((t.delay_s(1024) - t.latency_s - 2.0 * t.per_chunk_s(512)).abs() < 1e-15);
    for (b, bw, lat) in [
        (40960.0, 0.0, 0.0),
        (40960.0, -1.0, 0.0),
        (40960.0, f64::NAN, 0.0),
        (40960.0, f64::INFINITY, 0.0),
        (-1.0, 25e9, 0.0),
        (f64::NAN, 25e9, 0.0),
        (40960.0, 25e9, -0.001),
        (40960.0, 25e9, f64::NAN),
    ] {
        assert!(Transfer::new(b, bw, lat).is_err(), "{b} {bw} {lat}");
    }
    // A bad link in a config is refused by the plan too.
    let mut cfg = config(10.0, 2.0, 0.08);
    cfg.transfer.bandwidth_bytes_s = 0.0;
    let w = workload(&[(1024, 100)], 10);
    let err = plan_disagg(&w, &profile(), &cfg).expect_err("refused");
    assert!(err.to_string().contains("bandwidth_bytes_s"), "{err}");
}

/// One request shape: every figure of the plan from the engine model by hand.
#[test]
fn ttft_and_tpot_by_hand() {
    let p = profile();
    let w = workload(&[(1024, 100)], 1);
    let cfg = config(200.0, 1.0, 0.05);
    let d = plan_disagg(&w, &p, &cfg).expect("plan");
    assert!(d.feasible, "{d:?}");
    let shape = |slots| EngineShape {
        w_s: p.w_s,
        h_s: p.h_s,
        chunk: p.c_chunk,
        n_slots: slots,
        kv_tokens: slots as f64 * 16384.0,
    };
    let slots = p.slots(16384).expect("slots");
    // Decode: a = L_out = 100 iterations, one prompt token each:
    // t = W + H r (100 + r t / (2 C)) t, the smaller root.
    let r = 200.0 / d.decode.gpus as f64;
    let (a, b) = (
        0.5 * p.h_s * r * r / p.c_chunk as f64,
        1.0 - p.h_s * r * 100.0,
    );
    let t_d = (b - (b * b - 4.0 * a * p.w_s).sqrt()) / (2.0 * a);
    assert!((d.decode.t_iter_s - t_d).abs() < 1e-12, "{d:?}");
    // Prefill: a = ceil(1024 / 512) = 2 iterations, 1024 prompt tokens.
    let r = 200.0 / d.prefill.gpus as f64;
    let (a, b) = (
        0.5 * p.h_s * r * r * 1024.0 / p.c_chunk as f64,
        1.0 - p.h_s * r * 2.0,
    );
    let t_p = (b - (b * b - 4.0 * a * p.w_s).sqrt()) / (2.0 * a);
    assert!((d.prefill.t_iter_s - t_p).abs() < 1e-12, "{d:?}");
    let table = w.service_table(p.c_chunk).expect("table");
    let load = Loads::new(&w, &table, 0.99).prefill;
    let state = engine_state(r, d.prefill.gpus, &load, &shape(slots));
    assert_eq!(state.t_iter_s, d.prefill.t_iter_s);
    // TTFT = waits + own prefill (2 + 1/2) t_own + transfer of 1,024 tokens
    // + the decode side (its slot wait and 3/2 of its t_own).
    let transfer = cfg.transfer.delay_s(1024);
    assert_eq!(d.transfer_q_s, transfer);
    // A prompt's own iterations at the larger of its endpoint's two active
    // counts, floor(n_a) + 1 (n_a at least 1: the prompt itself).
    let own = |t: f64| p.w_s + p.h_s * (((t - p.w_s) / p.h_s).max(1.0).floor() + 1.0);
    let decode_side = d.decode.p99_wait_s + 1.5 * own(t_d);
    assert!((d.decode.p99_ttft_s - decode_side).abs() < 1e-12, "{d:?}");
    let ttft = d.prefill.p99_wait_s + 2.5 * own(t_p) + transfer + decode_side;
    assert!((d.prefill.p99_ttft_s - ttft).abs() < 1e-12, "{d:?}");
    assert!(d.prefill.p99_ttft_s <= 1.0);
    // The decode side takes at most its share of the target.
    assert!(d.decode.p99_ttft_s <= DECODE_TTFT_SHARE * 1.0);
}

fn mixed() -> Workload {
    workload(
        &[(200, 300), (1500, 150), (3000, 40), (6000, 20), (800, 600)],
        20,
    )
}

/// Each pool's GPUs never fall as the rate grows; nor does the aggregated.
#[test]
fn the_split_is_monotone_in_rate() {
    let (p, w) = (profile(), mixed());
    let mut last = (0, 0, 0);
    let mut rate = 1.0;
    while rate < 20_000.0 {
        let d = plan_disagg(&w, &p, &config(rate, 1.5, 0.06)).expect("plan");
        assert!(d.feasible, "{rate}: {d:?}");
        let now = (d.prefill.gpus, d.decode.gpus, d.aggregated.gpus);
        assert!(
            now.0 >= last.0 && now.1 >= last.1 && now.2 >= last.2,
            "{rate}: {now:?} after {last:?}"
        );
        last = now;
        rate *= 1.3;
    }
}

/// At a low rate one aggregated GPU does what two disaggregated ones do;
/// long prompts under a tight TTFT make the aggregated fleet wait for its
/// prefill budget, shared with every decoding sequence's iterations, where a
/// prefill endpoint iterates at nearly `W`.
#[test]
fn aggregated_is_chosen_when_cheaper() {
    let p = profile();
    let d = plan_disagg(&mixed(), &p, &config(0.5, 2.0, 0.08)).expect("plan");
    assert_eq!((d.aggregated.gpus, d.gpus), (1, 2), "{d:?}");
    assert!(d.aggregated_cheaper);
    let long_prompts = workload(&[(8000, 300), (12000, 200)], 10);
    let d = plan_disagg(&long_prompts, &p, &config(50.0, 1.0, 0.1)).expect("plan");
    assert!(d.feasible && d.gpus < d.aggregated.gpus, "{d:?}");
    assert!(!d.aggregated_cheaper);
    // The binding resource per side: the prefill budget, the decode's slots.
    assert_eq!(d.prefill.binding, crate::planner::Binding::Prefill, "{d:?}");
    assert_eq!(d.decode.binding, crate::planner::Binding::Slot, "{d:?}");
    assert_eq!(
        d.aggregated.binding,
        crate::planner::Binding::Prefill,
        "{d:?}"
    );
}

/// Requests longer than the context, and bad SLOs, are refused.
#[test]
fn bad_input_is_refused() {
    let p = profile();
    let w = workload(&[(20000, 100)], 2);
    assert!(plan_disagg(&w, &p, &config(10.0, 2.0, 0.08)).is_err());
    let w = mixed();
    for cfg in [
        config(0.0, 2.0, 0.08),
        config(f64::NAN, 2.0, 0.08),
        config(10.0, -1.0, 0.08),
        config(10.0, 2.0, f64::NAN),
    ] {
        assert!(plan_disagg(&w, &p, &cfg).is_err(), "{cfg:?}");
    }
}

/// Random workloads and links: the plan's TTFT bound is within the target
/// for every feasible plan, and a faster link never needs more prefill GPUs.
#[test]
fn random_plans_meet_their_bounds() {
    let mut rng = crate::rng::Rng::new(7);
    let p = profile();
    for _ in 0..40 {
        let pairs: Vec<(i64, i64)> = (0..8)
            .map(|_| {
                (
                    1 + (rng.uniform() * 8000.0) as i64,
                    1 + (rng.uniform() * 800.0) as i64,
                )
            })
            .collect();
        let w = workload(&pairs, 3);
        let rate = 1.0 + rng.uniform() * 2000.0;
        let ttft = 0.5 + rng.uniform() * 3.0;
        let mut cfg = config(rate, ttft, 0.04 + rng.uniform() * 0.1);
        cfg.transfer.bandwidth_bytes_s = 1e9 + rng.uniform() * 5e10;
        let d = plan_disagg(&w, &p, &cfg).expect("plan");
        if d.feasible {
            assert!(d.prefill.p99_ttft_s <= ttft + 1e-9, "{d:?}");
        }
        cfg.transfer.bandwidth_bytes_s *= 4.0;
        let fast = plan_disagg(&w, &p, &cfg).expect("plan");
        assert!(fast.prefill.gpus <= d.prefill.gpus, "{fast:?} vs {d:?}");
        assert_eq!(fast.decode, d.decode);
    }
}

/// The decode pool's TPOT is checked at the SLO's quantile, whatever share of
/// the TTFT's miss budget its side gets: a TPOT-bound decode pool is the
/// aggregated engine model's pool of the same decode-only requests.
#[test]
fn the_decode_tpot_is_checked_at_the_slos_quantile() {
    let p = profile();
    // Short prompts, long replies, a tight TPOT and a loose TTFT.
    let w = workload(&[(16, 400), (16, 600)], 10);
    let cfg = config(300.0, 30.0, 0.03);
    let d = plan_disagg(&w, &p, &cfg).expect("plan");
    assert_eq!(d.decode.binding, crate::planner::Binding::Compute, "{d:?}");
    let table = w.service_table(p.c_chunk).expect("table");
    let load = Loads::new(&w, &table, 0.99).decode;
    let one = |out: &mut Vec<(u64, f64)>| out.push((1, 1.0));
    let slots = p.slots(16384).expect("slots");
    let alone = size_engine(&p, 16384, slots, 300.0, &load, cfg.slo, &one, None).expect("pool");
    assert_eq!(d.decode.gpus, alone.gpus, "{d:?}");
}
