//! The queue's properties, checked against a model over random operations
//! (seeded: reproducible), and the paper's numbers.

use std::collections::HashMap;

use super::*;
use crate::admission::{priority_weight, ServiceClass, MIN_RETRY_AFTER_S};
use crate::error::Error;
use crate::rng::Rng;

/// Counts this thread's allocations, so that a test can show that the queue
/// allocates nothing in steady state. A global allocator is one per binary:
/// it forwards every call to the system allocator unchanged.
pub(crate) mod alloc_count {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static COUNT: Cell<u64> = const { Cell::new(0) };
    }

    fn bump() {
        // try_with: never touch a thread-local while the thread is exiting.
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
    }

    pub struct Counting;

    // SAFETY: every method forwards to `System` with the caller's arguments,
    // which upholds `GlobalAlloc`'s contract; the count touches no memory the
    // allocator hands out.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            bump();
            // SAFETY: the caller's contract, forwarded.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            bump();
            // SAFETY: as above.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            bump();
            // SAFETY: as above.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: as above.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    /// Allocations made by this thread so far.
    pub fn count() -> u64 {
        COUNT.with(Cell::get)
    }
}

fn config(json: &str) -> FlowConfig {
    FlowConfig::from_json(json).expect("config")
}

fn queue(json: &str) -> FlowQueue<u64> {
    FlowQueue::new(&config(json)).expect("queue")
}

fn accepted(e: Enqueued<u64>) -> Ticket {
    match e {
        Enqueued::Accepted(t) => t,
        Enqueued::Refused { reason, .. } => panic!("refused: {}", reason.as_str()),
    }
}

fn push(q: &mut FlowQueue<u64>, a: Arrival<'_>, id: u64, now: f64) -> Enqueued<u64> {
    let mut displaced = Vec::new();
    let e = q.enqueue(a, id, now, &mut displaced).expect("enqueue");
    assert!(displaced.is_empty(), "displaced {displaced:?}");
    e
}

/// Dispatches `n` requests; the payloads in order.
fn send(q: &mut FlowQueue<u64>, n: usize, now: f64) -> Vec<u64> {
    (0..n)
        .map(|_| q.dispatch(now).expect("dispatch").expect("waiting").payload)
        .collect()
}

/// A waiting request as the model remembers it.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    id: u64,
    band: usize,
    flow: usize,
    bytes: u64,
    deadline: f64,
    seq: u64,
    expires_at: f64,
}

/// A random run of enqueues, dispatches, cancels and expiries against the
/// model of what waits; every request that entered must leave exactly once,
/// with its payload, and the counts must follow the model throughout.
fn random_run(json: &str, seed: u64, ops: usize) -> FlowQueue<u64> {
    let mut rng = Rng::new(seed);
    let mut q = queue(json);
    let bands: Vec<Band> = q.bands().cloned().collect();
    let names: Vec<String> = (0..9).map(|k| format!("tenant-{k}")).collect();
    let mut live: HashMap<Ticket, Waiting> = HashMap::new();
    let mut left_ids = std::collections::HashSet::new();
    let mut refused = vec![0u64; bands.len()];
    let mut now = 0.0;
    let mut next_id = 0u64;
    let mut out = Vec::new();
    let mut leave = |live: &mut HashMap<Ticket, Waiting>, l: &Left<u64>, outcome: Outcome| {
        assert_eq!(l.outcome, outcome);
        let w = live
            .remove(&l.ticket)
            .expect("a waiting ticket leaves once");
        assert_eq!((w.id, w.band, w.bytes), (l.payload, l.band, l.bytes));
        assert!(
            left_ids.insert(l.payload),
            "payload {} left twice",
            l.payload
        );
        w
    };
    for _ in 0..ops {
        match rng.below(20) {
            0..=9 => {
                let band = rng.below(bands.len() as u64) as usize;
                let flow = rng.below(names.len() as u64) as usize;
                let deadline = (rng.below(3) > 0).then(|| now + rng.uniform() * 5.0);
                let a = Arrival {
                    band,
                    flow: &names[flow],
                    bytes: rng.below(300),
                    cost: 1.0 + rng.below(5) as f64,
                    weight: 0.5 + rng.uniform() * 100.0,
                    deadline,
                };
                next_id += 1;
                let mut displaced = Vec::new();
                match q.enqueue(a, next_id, now, &mut displaced).expect("enqueue") {
                    Enqueued::Accepted(t) => {
                        for d in &displaced {
                            let w = leave(&mut live, d, Outcome::Displaced);
                            assert!(w.band > band, "displaced from band {} by {band}", w.band);
                        }
                        let w = Waiting {
                            id: next_id,
                            band,
                            flow,
                            bytes: a.bytes,
                            deadline: deadline.unwrap_or(f64::INFINITY),
                            seq: next_id,
                            expires_at: now + bands[band].ttl_s,
                        };
                        assert!(live.insert(t, w).is_none(), "ticket {t} given twice");
                    }
                    Enqueued::Refused {
                        reason,
                        retry_after_s,
                        payload,
                    } => {
                        assert!(displaced.is_empty());
                        assert_eq!(payload, next_id);
                        assert_eq!(retry_after_s.is_none(), reason == Refusal::TooLarge);
                        refused[band] += 1;
                    }
                }
            }
            10..=14 => match q.dispatch(now).expect("dispatch") {
                None => assert!(live.is_empty()),
                Some(l) => {
                    let w = leave(&mut live, &l, Outcome::Dispatched);
                    // Ordering inside the flow: the oldest, or the earliest
                    // deadline (then the oldest), of the flow's requests.
                    let key = |x: &Waiting| match bands[x.band].ordering {
                        Ordering::Fcfs => (0.0, x.seq),
                        Ordering::Deadline => (x.deadline, x.seq),
                    };
                    let first = live
                        .values()
                        .filter(|x| x.band == w.band && x.flow == w.flow)
                        .all(|x| key(&w) < key(x));
                    assert!(first, "dispatched {w:?} ahead of an earlier one");
                    assert!(
                        (l.waited_s - (now - (w.expires_at - bands[w.band].ttl_s))).abs() < 1e-9
                    );
                }
            },
            15..=16 => {
                if let Some(&t) = live
                    .keys()
                    .nth(rng.below(live.len().max(1) as u64) as usize)
                {
                    let l = q.cancel(t, now).expect("cancel");
                    leave(&mut live, &l, Outcome::Cancelled);
                    assert!(matches!(q.cancel(t, now), Err(Error::NotInFlight(_))));
                }
            }
            _ => {
                now += rng.uniform() * 2.0;
                out.clear();
                q.expire(now, &mut out).expect("expire");
                for l in &out {
                    let w = leave(&mut live, l, Outcome::Expired);
                    assert!(w.expires_at <= now);
                }
                assert!(
                    live.values().all(|w| w.expires_at > now),
                    "missed an expiry"
                );
                let next = live.values().map(|w| w.expires_at).min_by(f64::total_cmp);
                assert_eq!(q.next_expiry(), next);
            }
        }
        assert_eq!(q.len(), live.len() as u64);
        assert_eq!(q.bytes(), live.values().map(|w| w.bytes).sum::<u64>());
        for (b, band) in bands.iter().enumerate() {
            let s = q.band_stats(b).expect("stats");
            let here = live.values().filter(|w| w.band == b);
            assert_eq!(s.requests, here.clone().count() as u64);
            assert!(s.requests <= band.max_requests);
            assert_eq!(s.bytes, here.map(|w| w.bytes).sum::<u64>());
            assert_eq!(s.outcomes.refused, refused[b]);
            assert_eq!(s.outcomes.accepted, s.outcomes.left() + s.requests);
        }
        assert!(q.flows() as u64 <= q.config().flows_bound());
    }
    out.clear();
    q.drain(now, &mut out).expect("drain");
    for l in &out {
        leave(&mut live, l, Outcome::Drained);
    }
    assert!(live.is_empty());
    assert_eq!((q.len(), q.bytes()), (0, 0));
    for b in 0..bands.len() {
        let s = q.band_stats(b).expect("stats");
        assert_eq!((s.requests, s.bytes, s.flows), (0, 0, 0));
        assert_eq!(s.outcomes.accepted, s.outcomes.left());
    }
    assert_eq!(q.next_expiry(), None);
    assert_eq!(q.dispatch(now).expect("dispatch"), None);
    q
}

/// Every fairness and ordering, with limits small enough that the run meets
/// every refusal, displacement and expiry.
const RUNS: [&str; 5] = [
    r#"{"bands": [{"name": "hi", "share": 5, "max_requests": 12},
                  {"name": "mid", "share": 2, "fairness": "least-attained-service"},
                  {"name": "lo", "share": 0.5, "fairness": "debt", "ordering": "deadline",
                   "max_bytes": 2000, "ttl_s": 3}],
        "max_requests": 30, "max_bytes": 5000, "ttl_s": 6}"#,
    r#"{"bands": [{"name": "a", "ordering": "deadline", "fairness": "least-attained-service"},
                  {"name": "b", "fairness": "debt"}],
        "max_requests": 8, "ttl_s": 1.5}"#,
    r#"{"bands": [{"name": "only", "fairness": "debt"}], "max_requests": 50, "max_bytes": 400}"#,
    r#"{"bands": [{"name": "g", "share": 1000}, {"name": "e", "share": 100},
                  {"name": "s", "share": 1, "max_requests": 5}],
        "max_requests": 40, "ttl_s": 4}"#,
    r#"{"bands": [{"name": "a"}, {"name": "b", "ordering": "deadline"},
                  {"name": "c", "fairness": "least-attained-service"}],
        "max_requests": 6, "max_bytes": 1200, "ttl_s": 50}"#,
];

#[test]
fn every_request_leaves_exactly_once_and_counts_return_to_zero() {
    let mut seen = Outcomes::default();
    for (k, json) in RUNS.iter().enumerate() {
        for seed in 0..25 {
            let q = random_run(json, seed * 10 + k as u64, 1500);
            let o = q.outcomes();
            seen.refused += o.refused;
            seen.dispatched += o.dispatched;
            seen.expired += o.expired;
            seen.displaced += o.displaced;
            seen.cancelled += o.cancelled;
            seen.drained += o.drained;
        }
    }
    // The runs met every way in and out.
    for (what, n) in [
        ("refused", seen.refused),
        ("dispatched", seen.dispatched),
        ("expired", seen.expired),
        ("displaced", seen.displaced),
        ("cancelled", seen.cancelled),
        ("drained", seen.drained),
    ] {
        assert!(n > 500, "{what}: {n}");
    }
}

/// Keeps every band backlogged with requests of random cost in [1, 5] and
/// dispatches `n`; the served cost per band and the longest run of
/// dispatches that passed each band over while it waited.
fn backlogged(shares: &[f64], n: usize, seed: u64) -> (Vec<f64>, Vec<usize>) {
    let bands: Vec<String> = shares
        .iter()
        .enumerate()
        .map(|(i, s)| format!(r#"{{"name": "b{i}", "share": {s}}}"#))
        .collect();
    let mut q = queue(&format!(
        r#"{{"bands": [{}], "max_requests": 1000}}"#,
        bands.join(",")
    ));
    let mut rng = Rng::new(seed);
    let mut id = 0;
    let mut refill = |q: &mut FlowQueue<u64>, b: usize, rng: &mut Rng| {
        id += 1;
        let a = Arrival {
            cost: 1.0 + rng.below(5) as f64,
            ..Arrival::new(b, "f")
        };
        accepted(push(q, a, id, 0.0));
    };
    for b in 0..shares.len() {
        for _ in 0..3 {
            refill(&mut q, b, &mut rng);
        }
    }
    let mut served = vec![0.0; shares.len()];
    let mut gap = vec![0usize; shares.len()];
    let mut longest = vec![0usize; shares.len()];
    for _ in 0..n {
        let l = q.dispatch(0.0).expect("dispatch").expect("backlogged");
        let b = l.band;
        served[b] += l.cost;
        for (o, g) in gap.iter_mut().enumerate() {
            *g = if o == b { 0 } else { *g + 1 };
            longest[o] = longest[o].max(*g);
        }
        refill(&mut q, b, &mut rng);
    }
    (served, longest)
}

#[test]
fn a_band_with_a_share_gets_it_and_is_never_starved() {
    let (cmax, cmin) = (5.0, 1.0);
    for seed in 0..30 {
        let mut rng = Rng::new(seed);
        let shares: Vec<f64> = (0..2 + rng.below(3))
            .map(|_| (0.5 + rng.uniform() * 50.0).round())
            .collect();
        let (served, longest) = backlogged(&shares, 20_000, seed);
        // DRR's bound: after R rounds a backlogged band has sent between
        // R q_b - C and R q_b + C, so served_b / q_b agree within 2 C / q_b
        // (and one round of slack for the round in progress).
        let rounds: Vec<f64> = served.iter().zip(&shares).map(|(s, q)| s / q).collect();
        let spread = rounds.iter().cloned().fold(f64::MIN, f64::max)
            - rounds.iter().cloned().fold(f64::MAX, f64::min);
        let qmin = shares.iter().cloned().fold(f64::MAX, f64::min);
        assert!(spread <= 2.0 * cmax / qmin + 1.0, "{shares:?}: {rounds:?}");
        // Starvation: band b affords a head within ceil(C / q_b) rounds, and
        // in one round another band o sends at most (q_o + C) / c_min requests.
        for (b, &qb) in shares.iter().enumerate() {
            let per_round: f64 = shares
                .iter()
                .enumerate()
                .filter(|&(o, _)| o != b)
                .map(|(_, qo)| (qo + cmax) / cmin)
                .sum();
            let bound = ((cmax / qb).ceil() + 1.0) * per_round;
            assert!(
                longest[b] as f64 <= bound,
                "{shares:?} band {b}: {} > {bound}",
                longest[b]
            );
        }
    }
}

#[test]
fn the_papers_class_weights_split_a_saturated_pool_exactly() {
    // Guaranteed, elastic and spot (weights 1000, 100, 1) all backlogged with
    // requests of cost 1: every round sends 1000, 100 and 1 of them.
    let mut q = FlowQueue::new(&FlowConfig::service_classes()).expect("queue");
    let [g, e, s] = ["guaranteed", "elastic", "spot"].map(|n| q.band_index(n).expect("band"));
    let mut id = 0;
    for band in [g, e, s] {
        for _ in 0..3_100 {
            id += 1;
            accepted(push(&mut q, Arrival::new(band, "t"), id, 0.0));
        }
    }
    let mut per_band = [0u64; 5];
    for _ in 0..3 * 1101 {
        per_band[q.dispatch(0.0).expect("d").expect("waiting").band] += 1;
    }
    assert_eq!(per_band, [0, 3000, 300, 3, 0]);
    // An emptied band loses its turn and what it had left of its quantum
    // (classic DRR): after guaranteed sent its only request, elastic's turn
    // (100) comes first, then guaranteed's next (1000).
    let mut out = Vec::new();
    q.drain(0.0, &mut out).expect("drain");
    accepted(push(&mut q, Arrival::new(g, "t"), 0, 0.0));
    assert_eq!(send(&mut q, 1, 0.0), [0]);
    for k in 1..=1500 {
        accepted(push(&mut q, Arrival::new(g, "t"), k, 0.0));
        accepted(push(&mut q, Arrival::new(e, "t"), 10_000 + k, 0.0));
    }
    let next: Vec<u64> = send(&mut q, 1100, 0.0);
    assert!(next[..100].iter().all(|&id| id > 10_000));
    assert!(next[100..].iter().all(|&id| id < 10_000));
}

#[test]
fn debt_fairness_shares_a_band_by_the_papers_priorities() {
    // Experiment 2's entitlements: copilot (SLO 500 ms) and synth (30 s), the
    // pool-average SLO 15,250 ms: w = 93.8 and 20.3; both backlogged, they
    // share the band 93.8 : 20.3.
    let w = |slo, debt| priority_weight(ServiceClass::Elastic, slo, 15_250.0, 0.0, debt);
    let (copilot, synth) = (w(500.0, 0.0), w(30_000.0, 0.0));
    assert!((copilot - 93.846).abs() < 1e-3 && (synth - 20.266).abs() < 1e-3);
    let share_of_copilot = |synth_weight: f64| {
        let mut q = queue(r#"{"bands": [{"name": "elastic", "fairness": "debt"}]}"#);
        for k in 0..1_000 {
            for (flow, weight) in [("copilot", copilot), ("synth", synth_weight)] {
                let a = Arrival {
                    weight,
                    ..Arrival::new(0, flow)
                };
                accepted(push(&mut q, a, k * 2 + u64::from(flow == "synth"), 0.0));
            }
        }
        send(&mut q, 1_000, 0.0)
            .iter()
            .filter(|&&id| id % 2 == 0)
            .count() as f64
    };
    let expect = 1_000.0 * copilot / (copilot + synth);
    assert!((share_of_copilot(synth) - expect).abs() <= 1.0, "{expect}");
    // At synth's peak debt (0.775) its priority is 20.3 (1 + 4 x 0.775) =
    // 83.1: the paper's gap narrows, and synth's share of the band with it.
    let indebted = w(30_000.0, 0.775);
    assert!((indebted - 83.2).abs() < 0.15);
    let expect = 1_000.0 * copilot / (copilot + indebted);
    assert!(
        (share_of_copilot(indebted) - expect).abs() <= 1.0,
        "{expect}"
    );
}

#[test]
fn round_robin_takes_turns_and_attained_service_lifts_returning_flows() {
    // Round robin: three backlogged flows, one request each per turn.
    let mut q = queue(r#"{"bands": [{"name": "b"}]}"#);
    for k in 0..30u64 {
        let flow = ["x", "y", "z"][(k % 3) as usize];
        accepted(push(&mut q, Arrival::new(0, flow), k, 0.0));
    }
    let order: Vec<u64> = send(&mut q, 30, 0.0).iter().map(|id| id % 3).collect();
    assert!(order.chunks(3).all(|c| c == [0, 1, 2]), "{order:?}");

    // Least attained service: a flow of cost 4 and a flow of cost 1 are
    // served the same cost, within one request of the larger.
    let mut q = queue(r#"{"bands": [{"name": "b", "fairness": "least-attained-service"}]}"#);
    for k in 0..200u64 {
        let (flow, cost) = if k % 2 == 0 {
            ("big", 4.0)
        } else {
            ("small", 1.0)
        };
        let a = Arrival {
            cost,
            ..Arrival::new(0, flow)
        };
        accepted(push(&mut q, a, k, 0.0));
    }
    let (mut big, mut small) = (0.0, 0.0);
    for id in send(&mut q, 100, 0.0) {
        if id % 2 == 0 {
            big += 4.0;
        } else {
            small += 1.0;
        }
        assert!(f64::abs(big - small) <= 4.0, "{big} against {small}");
    }
    // A flow returning after the other was served alone starts at the least
    // active counter: it alternates instead of catching up in a burst.
    let mut q = queue(r#"{"bands": [{"name": "b", "fairness": "least-attained-service"}]}"#);
    for k in 0..50 {
        accepted(push(&mut q, Arrival::new(0, "old"), k, 0.0));
    }
    assert_eq!(send(&mut q, 40, 0.0).len(), 40);
    for k in 100..110 {
        accepted(push(&mut q, Arrival::new(0, "new"), k, 0.0));
    }
    let next: Vec<bool> = send(&mut q, 10, 0.0).iter().map(|&id| id >= 100).collect();
    assert_eq!(next.iter().filter(|&&n| n).count(), 5, "{next:?}");
}

#[test]
fn deadline_ordering_sends_the_earliest_deadline_first() {
    let mut q = queue(r#"{"bands": [{"name": "b", "ordering": "deadline"}]}"#);
    for (id, deadline) in [
        (1, Some(9.0)),
        (2, None),
        (3, Some(2.0)),
        (4, Some(5.0)),
        (5, None),
    ] {
        let a = Arrival {
            deadline,
            ..Arrival::new(0, "f")
        };
        accepted(push(&mut q, a, id, 0.0));
    }
    assert_eq!(send(&mut q, 5, 0.0), [3, 4, 1, 2, 5]);
}

#[test]
fn limits_refuse_or_displace_with_retry_after() {
    let mut q = queue(
        r#"{"bands": [{"name": "hi", "max_requests": 2},
                      {"name": "lo", "max_requests": 5, "ttl_s": 20}],
            "max_requests": 3, "max_bytes": 1000, "ttl_s": 10}"#,
    );
    let sized = |band, bytes| Arrival {
        bytes,
        ..Arrival::new(band, "t")
    };
    let mut displaced = Vec::new();
    // Too large for the pool: refused for good.
    let e = q
        .enqueue(sized(1, 1001), 0, 0.0, &mut displaced)
        .expect("e");
    assert_eq!(
        e,
        Enqueued::Refused {
            reason: Refusal::TooLarge,
            retry_after_s: None,
            payload: 0
        }
    );
    for id in 1..=3 {
        accepted(push(&mut q, sized(1, 100), id, 0.0));
    }
    // The pool is full; lo cannot displace its own band: refused. No
    // dispatch seen yet: Retry-After is the band's TTL.
    let e = q.enqueue(sized(1, 10), 4, 0.0, &mut displaced).expect("e");
    assert_eq!(
        e,
        Enqueued::Refused {
            reason: Refusal::PoolRequests,
            retry_after_s: Some(20.0),
            payload: 4
        }
    );
    // hi displaces lo's newest request.
    let t = accepted(q.enqueue(sized(0, 700), 5, 1.0, &mut displaced).expect("e"));
    assert_eq!(displaced.len(), 1);
    assert_eq!(
        (displaced[0].payload, displaced[0].outcome),
        (3, Outcome::Displaced)
    );
    assert_eq!(displaced[0].waited_s, 1.0);
    // 900 bytes wait; 350 more need both of lo's requests (100 + 100) gone.
    displaced.clear();
    accepted(q.enqueue(sized(0, 250), 6, 1.0, &mut displaced).expect("e"));
    let ids: Vec<u64> = displaced.iter().map(|l| l.payload).collect();
    assert_eq!(ids, [2, 1], "newest first");
    // hi's own limit (2 requests) is not lifted by displacing anything.
    displaced.clear();
    let e = q.enqueue(sized(0, 1), 7, 1.0, &mut displaced).expect("e");
    assert!(matches!(
        e,
        Enqueued::Refused {
            reason: Refusal::BandRequests,
            ..
        }
    ));
    assert!(displaced.is_empty());
    // Bytes: the pool has 950 of 1000 bytes; hi's band limit is the pool's.
    assert_eq!(q.cancel(t, 1.0).expect("cancel").payload, 5);
    let e = q.enqueue(sized(1, 800), 8, 1.0, &mut displaced).expect("e");
    assert!(matches!(
        e,
        Enqueued::Refused {
            reason: Refusal::PoolBytes,
            ..
        }
    ));
    let o = q.band_stats(1).expect("s").outcomes;
    assert_eq!((o.accepted, o.displaced, o.refused), (3, 3, 3));

    // Retry-After from the dispatch rate: one request a second for 10 s,
    // then the backlog ahead over the decayed rate.
    let mut q = queue(r#"{"bands": [{"name": "b", "ttl_s": 1000}], "max_requests": 100}"#);
    for k in 0..10 {
        accepted(push(&mut q, Arrival::new(0, "t"), k, f64::from(k as u32)));
        q.dispatch(f64::from(k as u32)).expect("d").expect("one");
    }
    for k in 0..30 {
        accepted(push(&mut q, Arrival::new(0, "t"), 100 + k, 9.0));
    }
    let rate: f64 = (0..10)
        .map(|k| (-f64::from(9 - k) / RATE_WINDOW_S).exp())
        .sum::<f64>()
        / RATE_WINDOW_S;
    let got = q.retry_after_s(0, 9.0).expect("retry");
    assert!(
        (got - 30.0 / rate).abs() < 1e-9,
        "{got} against {}",
        30.0 / rate
    );
    // Never below the admission layer's floor, never past the TTL.
    let mut q = queue(r#"{"bands": [{"name": "b", "ttl_s": 0.01}]}"#);
    assert_eq!(q.retry_after_s(0, 0.0).expect("retry"), 0.01);
    for k in 0..100 {
        accepted(push(&mut q, Arrival::new(0, "t"), k, 0.0));
        q.dispatch(0.0).expect("d");
    }
    assert!(q.retry_after_s(0, 0.0).expect("retry") <= 0.01);
    let mut q = queue(r#"{"bands": [{"name": "b"}]}"#);
    for k in 0..1000 {
        accepted(push(&mut q, Arrival::new(0, "t"), k, 0.0));
        q.dispatch(0.0).expect("d");
    }
    assert_eq!(q.retry_after_s(0, 0.0).expect("retry"), MIN_RETRY_AFTER_S);
}

#[test]
fn ttl_expiry_cancel_and_drain_each_return_what_waits() {
    let mut q =
        queue(r#"{"bands": [{"name": "hi", "ttl_s": 5}, {"name": "lo", "ttl_s": 2}], "ttl_s": 9}"#);
    let t1 = accepted(push(&mut q, Arrival::new(0, "a"), 1, 0.0));
    let t2 = accepted(push(&mut q, Arrival::new(1, "b"), 2, 1.0));
    accepted(push(&mut q, Arrival::new(1, "b"), 3, 1.5));
    assert_eq!(q.next_expiry(), Some(3.0));
    let mut out = Vec::new();
    assert_eq!(q.expire(2.9, &mut out).expect("expire"), 0);
    assert_eq!(q.expire(3.2, &mut out).expect("expire"), 1);
    assert_eq!(out[0].payload, 2);
    assert!((out[0].waited_s - 2.2).abs() < 1e-12);
    assert_eq!(q.band_stats(1).expect("s").outcomes.expired, 1);
    // A time earlier than one seen counts as the latest seen.
    assert_eq!(q.expire(0.0, &mut out).expect("expire"), 0);
    assert!(matches!(q.cancel(t2, 3.0), Err(Error::NotInFlight(_))));
    assert_eq!(
        q.cancel(t1, 3.0).expect("cancel").outcome,
        Outcome::Cancelled
    );
    // The freed slot is reused under a new ticket; the old one stays dead.
    let t4 = accepted(push(&mut q, Arrival::new(0, "a"), 4, 3.0));
    assert_ne!(t4, t1);
    assert!(q.contains(t4) && !q.contains(t1));
    assert!(matches!(q.cancel(t1, 3.0), Err(Error::NotInFlight(_))));
    out.clear();
    assert_eq!(q.drain(4.0, &mut out).expect("drain"), 2);
    let drained: Vec<(u64, Outcome)> = out.iter().map(|l| (l.payload, l.outcome)).collect();
    assert_eq!(drained, [(4, Outcome::Drained), (3, Outcome::Drained)]);
    assert!(q.is_empty() && q.next_expiry().is_none());
}

#[test]
fn the_flow_table_is_bounded_and_forgets_idle_flows_oldest_first() {
    // Two requests may wait: three flows are remembered.
    let mut q = queue(
        r#"{"bands": [{"name": "b", "fairness": "least-attained-service"}],
                         "max_requests": 2}"#,
    );
    let one = |q: &mut FlowQueue<u64>, flow: &str, id| {
        accepted(push(q, Arrival::new(0, flow), id, 0.0));
        assert_eq!(send(q, 1, 0.0), [id]);
    };
    for (id, flow) in ["a", "b", "c", "a", "d", "e"].into_iter().enumerate() {
        one(&mut q, flow, id as u64);
        assert!(q.flows() <= 3);
    }
    // d and e took the places of b and c (idle longest), not a's (used again
    // after them).
    let remembered: Vec<&str> = ["a", "b", "c", "d", "e"]
        .into_iter()
        .filter(|f| q.remembers(0, f))
        .collect();
    assert_eq!(remembered, ["a", "d", "e"]);
    // A full pool of waiting flows still admits an arrival that displaces.
    let mut q = queue(r#"{"bands": [{"name": "hi"}, {"name": "lo"}], "max_requests": 2}"#);
    accepted(push(&mut q, Arrival::new(1, "x"), 1, 0.0));
    accepted(push(&mut q, Arrival::new(1, "y"), 2, 0.0));
    let mut displaced = Vec::new();
    let e = q
        .enqueue(Arrival::new(0, "z"), 3, 0.0, &mut displaced)
        .expect("e");
    assert!(matches!(e, Enqueued::Accepted(_)));
    assert_eq!(displaced[0].payload, 2);
    assert_eq!(q.flows(), 3);
}

#[test]
fn bad_input_is_an_error_and_changes_nothing() {
    let mut q = queue(r#"{"bands": [{"name": "b"}]}"#);
    accepted(push(&mut q, Arrival::new(0, "t"), 1, 0.0));
    let long = "x".repeat(MAX_NAME_BYTES + 1);
    let mut displaced = Vec::new();
    for a in [
        Arrival::new(1, "t"),
        Arrival::new(0, ""),
        Arrival::new(0, &long),
        Arrival {
            bytes: MAX_REQUEST_BYTES + 1,
            ..Arrival::new(0, "t")
        },
        Arrival {
            cost: 0.0,
            ..Arrival::new(0, "t")
        },
        Arrival {
            cost: f64::NAN,
            ..Arrival::new(0, "t")
        },
        Arrival {
            weight: -1.0,
            ..Arrival::new(0, "t")
        },
        Arrival {
            deadline: Some(f64::INFINITY),
            ..Arrival::new(0, "t")
        },
    ] {
        assert!(q.enqueue(a, 9, 1.0, &mut displaced).is_err(), "{a:?}");
    }
    assert!(q
        .enqueue(Arrival::new(0, "t"), 9, f64::NAN, &mut displaced)
        .is_err());
    assert!(q.dispatch(f64::INFINITY).is_err());
    assert!(q.expire(f64::NAN, &mut Vec::new()).is_err());
    assert!(q.retry_after_s(3, 0.0).is_err());
    assert!(q.band_stats(1).is_err());
    assert!(matches!(
        q.band_index("gold"),
        Err(Error::UnknownName { .. })
    ));
    let o = q.outcomes();
    assert_eq!((q.len(), o.accepted, o.refused, o.dispatched), (1, 1, 0, 0));
    // The clock did not move: a request enqueued at 0 expires at the TTL.
    assert_eq!(q.next_expiry(), Some(DEFAULT_TTL_S));
}

/// A pool with `waiting` requests over three bands and 300 flows, every
/// fairness and ordering present; `cycle` enqueues one and dispatches one.
fn steady(waiting: u64) -> (FlowQueue<u64>, Vec<String>) {
    let mut q = queue(
        r#"{"bands": [{"name": "g", "share": 1000, "fairness": "debt"},
                      {"name": "e", "share": 100, "fairness": "least-attained-service",
                       "ordering": "deadline"},
                      {"name": "s", "share": 1}],
            "max_requests": 20000, "ttl_s": 1e9}"#,
    );
    let names: Vec<String> = (0..100).map(|k| format!("tenant-{k}")).collect();
    for k in 0..waiting {
        let a = arrival(&names, k);
        accepted(push(&mut q, a, k, 0.0));
    }
    (q, names)
}

fn arrival(names: &[String], k: u64) -> Arrival<'_> {
    Arrival {
        band: (k % 3) as usize,
        flow: &names[(k * 7 % 100) as usize],
        bytes: 2000,
        cost: 100.0 + (k % 5) as f64,
        weight: 1.0 + (k % 4) as f64,
        deadline: Some(k as f64),
    }
}

#[test]
fn steady_state_allocates_nothing() {
    let (mut q, names) = steady(10_000);
    let mut out = Vec::with_capacity(16);
    let mut run = |q: &mut FlowQueue<u64>, from: u64, n: u64| {
        for k in from..from + n {
            let a = arrival(&names, k);
            let t = accepted(push(q, a, k, 0.0));
            if k % 10 == 0 {
                q.cancel(t, 0.0).expect("cancel");
            } else {
                q.dispatch(0.0).expect("d").expect("one");
            }
            out.clear();
            q.expire(0.0, &mut out).expect("expire");
        }
    };
    run(&mut q, 10_000, 20_000); // the slab, heaps and flow table grow to size
    let before = alloc_count::count();
    run(&mut q, 30_000, 100_000);
    assert_eq!(alloc_count::count() - before, 0);
    assert!(q.len() > 9_000);
}

/// `cargo test --release -- --ignored --nocapture flow_timing`
#[test]
#[ignore]
fn flow_timing() {
    for waiting in [0, 10_000] {
        let (mut q, names) = steady(waiting);
        let n = 1_000_000u64;
        let start = std::time::Instant::now();
        for k in waiting..waiting + n {
            let a = arrival(&names, k);
            accepted(push(&mut q, a, k, 0.0));
            q.dispatch(0.0).expect("d").expect("one");
        }
        let ns = start.elapsed().as_nanos() as f64 / n as f64;
        println!("enqueue + dispatch, {waiting} waiting: {ns:.0} ns per request");
    }
}
