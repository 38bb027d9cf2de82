//! routecore's `KvIndex` beside dynamo-kv-router's `RadixTree` and
//! `ConcurrentRadixTreeCompressed`, fed the same vLLM KV events (the
//! workload of benches/kv_workload.py), in one process: apply throughput,
//! query time (hash + lookup of an 8,192-token prompt), heap bytes per held
//! block; and a check that all three give every endpoint the same overlap.
//! See README.md for the command.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
#[cfg(not(feature = "before"))]
use routecore::kv::KvHeld;
use routecore::kv::{Event, KvConfig, KvIndex, Seq, Stored};
use serde_json::Value;

/// The heap in use, to the byte.
struct Counting;
static HEAP: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        HEAP.fetch_add(l.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HEAP.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        HEAP.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn heap() -> isize {
    HEAP.load(Ordering::Relaxed)
}

/// One event as vLLM sends it (decoded).
enum Raw {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed(Vec<u64>),
    Cleared,
}

struct Workload {
    endpoints: Vec<String>,
    block_size: usize,
    batches: Vec<(usize, u64, Vec<Raw>)>,
    queries: Vec<Vec<u32>>,
    served: Vec<Vec<u32>>,
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("u64"))
        .collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    u64s(v).into_iter().map(|x| x as u32).collect()
}

fn load(path: &str) -> Workload {
    let text = std::fs::read_to_string(path).expect("workload");
    let w: Value = serde_json::from_str(&text).expect("json");
    let batches = w["batches"]
        .as_array()
        .expect("batches")
        .iter()
        .map(|b| {
            let events = b[2]
                .as_array()
                .expect("events")
                .iter()
                .map(|e| match e[0].as_str().expect("tag") {
                    "BlockStored" => Raw::Stored {
                        hashes: u64s(&e[1]),
                        parent: e[2].as_u64(),
                        tokens: u32s(&e[3]),
                    },
                    "BlockRemoved" => Raw::Removed(u64s(&e[1])),
                    _ => Raw::Cleared,
                })
                .collect();
            (
                b[0].as_u64().expect("endpoint") as usize,
                b[1].as_u64().expect("seq"),
                events,
            )
        })
        .collect();
    let prompts = |k: &str| w[k].as_array().expect(k).iter().map(u32s).collect();
    Workload {
        endpoints: w["endpoints"]
            .as_array()
            .expect("endpoints")
            .iter()
            .map(|e| e.as_str().expect("name").to_owned())
            .collect(),
        block_size: w["block_size"].as_u64().expect("block_size") as usize,
        batches,
        queries: prompts("queries"),
        served: prompts("served"),
    }
}

/// The clock of the timings: wall time, or with `TIMER=cpu` the CPU time of
/// the process (all its threads), which a preemption on a shared machine
/// does not lengthen.
fn clock() -> Duration {
    static CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    if *CPU.get_or_init(|| std::env::var("TIMER").is_ok_and(|t| t == "cpu")) {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid clock id and a pointer to a timespec we own.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "clock_gettime");
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    } else {
        START.get_or_init(Instant::now).elapsed()
    }
}

/// The best of `rounds` timings of `f` (the machine is shared: the least
/// disturbed run).
fn best<T>(rounds: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut out = None;
    let mut best = Duration::MAX;
    for _ in 0..rounds {
        let t = clock();
        let r = f();
        best = best.min(clock() - t);
        out = Some(r);
    }
    (best, out.expect("rounds > 0"))
}

// ---------------------------------------------------------------- routecore

/// Batches as `KvIndex::apply` takes them: (endpoint, sequence, events).
type Batches = Vec<(usize, u64, Vec<Result<Event, routecore::kv::Skip>>)>;

fn routecore_events(w: &Workload) -> Batches {
    w.batches
        .iter()
        .map(|(e, seq, events)| {
            let events = events
                .iter()
                .map(|r| {
                    Ok(match r {
                        Raw::Stored {
                            hashes,
                            parent,
                            tokens,
                        } => Event::Stored(Stored {
                            hashes: hashes.clone(),
                            parent: *parent,
                            token_ids: tokens.clone(),
                            block_size: w.block_size,
                            lora: None,
                            medium: Some("GPU".into()),
                        }),
                        Raw::Removed(h) => Event::Removed {
                            hashes: h.clone(),
                            medium: Some("GPU".into()),
                        },
                        Raw::Cleared => Event::Cleared,
                    })
                })
                .collect();
            (*e, *seq, events)
        })
        .collect()
}

fn routecore_index(w: &Workload) -> KvIndex {
    let kv = KvIndex::new(KvConfig {
        block_size: w.block_size,
        ..KvConfig::default()
    })
    .expect("index");
    for e in &w.endpoints {
        kv.add_endpoint(e);
        kv.set_connected(e, true).expect("endpoint");
    }
    kv
}

fn routecore_apply(w: &Workload, kv: &KvIndex, batches: &Batches) {
    for (e, seq, events) in batches {
        let name = &w.endpoints[*e];
        assert_eq!(kv.observe(name, *seq).expect("e"), Seq::Next);
        let a = kv.apply(name, *seq, events, 0.0).expect("apply");
        assert!(a.skipped.is_empty(), "{:?}", a.skipped);
    }
}

/// One query as the picker asks it: every endpoint's leading blocks.
struct RoutecoreQuery<'a> {
    kv: &'a KvIndex,
    names: &'a [String],
    #[cfg(not(feature = "before"))]
    ids: Vec<Option<u32>>,
    hashes: Vec<u64>,
    held: Vec<Option<usize>>,
    #[cfg(not(feature = "before"))]
    walked: KvHeld,
}

impl<'a> RoutecoreQuery<'a> {
    fn new(kv: &'a KvIndex, names: &'a [String]) -> Self {
        Self {
            kv,
            names,
            #[cfg(not(feature = "before"))]
            ids: kv.endpoint_ids(names),
            hashes: Vec::new(),
            held: Vec::new(),
            #[cfg(not(feature = "before"))]
            walked: KvHeld::default(),
        }
    }

    /// Hash every block, then ask each endpoint (the only way before).
    fn each(&mut self, prompt: &[u32]) -> &[Option<usize>] {
        self.kv.request_hashes_into(prompt, None, &mut self.hashes);
        self.held.clear();
        for n in self.names {
            self.held.push(self.kv.leading_blocks(n, &self.hashes));
        }
        &self.held
    }

    /// One walk for all endpoints, hashing as it goes.
    #[cfg(not(feature = "before"))]
    fn walk(&mut self, prompt: &[u32]) -> &[Option<usize>] {
        self.kv
            .match_prompt(prompt, None, &self.ids, &mut self.held);
        &self.held
    }

    /// The picker's path since issue 28's second half: the prompt hashed
    /// once (for the approximate index too; since the kv-walk branch, the
    /// hashes of held runs read from the table), the walk reading them.
    #[cfg(not(feature = "before"))]
    fn hash_then_walk(&mut self, prompt: &[u32]) -> &[Option<usize>] {
        self.kv.request_hashes_into(prompt, None, &mut self.hashes);
        self.kv
            .match_hashes(&self.hashes, &self.ids, &mut self.held);
        &self.held
    }

    /// The picker's path since issue 28's fifth part: one walk gives the
    /// prompt's hashes and every live endpoint's answer
    /// (`KvIndex::walk_prompt`), read for the candidates after.
    #[cfg(not(feature = "before"))]
    fn one_walk(&mut self, prompt: &[u32]) -> &[Option<usize>] {
        self.kv
            .walk_prompt(prompt, None, &mut self.hashes, &mut self.walked);
        self.walked
            .held_into(self.kv, None, &self.ids, &mut self.held)
            .expect("this index's walk");
        &self.held
    }

    fn hash_all(&mut self, prompt: &[u32]) -> usize {
        self.kv.request_hashes_into(prompt, None, &mut self.hashes);
        self.hashes.len()
    }

    /// The chain alone, every block after the one before (`block_hashes`).
    fn chain(&mut self, prompt: &[u32]) -> usize {
        let c = self.kv.config();
        let ids = routecore::prefix::Tokens::Ids(prompt);
        routecore::prefix::block_hashes_into(ids, c.block_size, c.seed, &mut self.hashes)
            .expect("block size");
        self.hashes.len()
    }
}

// ------------------------------------------------------------------- Dynamo

/// The batch's events as Dynamo's router gets them: its per-block token
/// hashes computed from the token ids (as its vLLM ZMQ decoder does).
fn dynamo_events(w: &Workload, batch: usize) -> impl Iterator<Item = RouterEvent> + '_ {
    let (e, seq, events) = &w.batches[batch];
    events.iter().map(move |r| {
        let data = match r {
            Raw::Stored {
                hashes,
                parent,
                tokens,
            } => {
                let local = compute_block_hash_for_seq(
                    tokens,
                    w.block_size as u32,
                    BlockHashOptions::default(),
                );
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: hashes
                        .iter()
                        .zip(local)
                        .map(|(&h, tokens_hash)| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(h),
                            tokens_hash,
                            mm_extra_info: None,
                        })
                        .collect(),
                })
            }
            Raw::Removed(h) => KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: h.iter().copied().map(ExternalSequenceBlockHash).collect(),
            }),
            Raw::Cleared => KvCacheEventData::Cleared,
        };
        RouterEvent::new(
            *e as u64,
            KvCacheEvent {
                event_id: *seq,
                data,
                dp_rank: 0,
            },
        )
    })
}

/// The tree after every event, and how many events it refused (Dynamo
/// counts a removal of a block it no longer holds as an error and goes on).
fn radix_apply(w: &Workload) -> (RadixTree, usize) {
    let mut t = RadixTree::new();
    let mut refused = 0;
    for b in 0..w.batches.len() {
        for ev in dynamo_events(w, b) {
            refused += usize::from(t.apply_event(ev).is_err());
        }
    }
    (t, refused)
}

fn crtc_apply(
    w: &Workload,
    rt: &tokio::runtime::Runtime,
) -> ThreadPoolIndexer<ConcurrentRadixTreeCompressed> {
    let t = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, w.block_size as u32);
    for b in 0..w.batches.len() {
        for ev in dynamo_events(w, b) {
            t.enqueue_event(ev).expect("enqueue");
        }
    }
    rt.block_on(t.flush());
    t
}

fn dynamo_hash(w: &Workload, prompt: &[u32]) -> Vec<dynamo_kv_router::LocalBlockHash> {
    compute_block_hash_for_seq(prompt, w.block_size as u32, BlockHashOptions::default())
}

/// Per endpoint, the overlap Dynamo's scores give (absent: 0).
fn overlaps(w: &Workload, scores: &dynamo_kv_router::OverlapScores) -> Vec<Option<usize>> {
    let mut out = vec![Some(0); w.endpoints.len()];
    for (worker, &s) in &scores.scores {
        out[worker.worker_id as usize] = Some(s as usize);
    }
    out
}

/// Dynamo 1.6.1 keeps blocks a worker removed when another worker's store
/// split the node first: worker 2 stores blocks [1, 2, 5, 6], worker 1
/// stores [1, 2, 3, 4] (a shared system prompt), worker 1 then removes its
/// four blocks, deepest first (as vLLM evicts). Returns the removals the
/// tree refused and what it says worker 1 holds of [1, 2, 3, 4] afterwards.
fn split_then_remove() -> (usize, u32) {
    let event = |worker: u64, data| {
        RouterEvent::new(
            worker,
            KvCacheEvent {
                event_id: 0,
                data,
                dp_rank: 0,
            },
        )
    };
    let store = |worker: u64, local: &[u64]| {
        event(
            worker,
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                start_position: None,
                blocks: local
                    .iter()
                    .map(|&l| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(1000 * worker + l),
                        tokens_hash: dynamo_kv_router::LocalBlockHash(l),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        )
    };
    let mut t = RadixTree::new();
    t.apply_event(store(2, &[1, 2, 5, 6])).expect("store");
    t.apply_event(store(1, &[1, 2, 3, 4])).expect("store");
    let refused = [4, 3, 2, 1]
        .into_iter()
        .filter(|&l| {
            let gone = KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: vec![ExternalSequenceBlockHash(1000 + l)],
            });
            t.apply_event(event(1, gone)).is_err()
        })
        .count();
    let seq = [1, 2, 3, 4].map(dynamo_kv_router::LocalBlockHash).to_vec();
    let held = t
        .find_matches(seq, false)
        .scores
        .iter()
        .find(|(w, _)| w.worker_id == 1)
        .map_or(0, |(_, &s)| s);
    (refused, held)
}

// --------------------------------------------------------------------- main

fn us(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e6 / n as f64
}

fn main() {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let (refused, held) = split_then_remove();
    println!(
        "Dynamo RadixTree, a split by another worker then four removals: {refused} refused, \
         still holds {held} of 4 blocks"
    );
    for path in paths {
        let w = load(&path);
        let ops: usize = w
            .batches
            .iter()
            .flat_map(|(_, _, ev)| ev)
            .map(|r| match r {
                Raw::Stored { hashes, .. } | Raw::Removed(hashes) => hashes.len(),
                Raw::Cleared => 1,
            })
            .sum();
        println!(
            "\n## {path}: {} endpoints, {} batches, {ops} block operations",
            w.endpoints.len(),
            w.batches.len()
        );

        // Apply: a fresh index per round; the heap it holds at the end.
        let batches = routecore_events(&w);
        let (t_rc, kv) = best(rounds, || {
            let kv = routecore_index(&w);
            routecore_apply(&w, &kv, &batches);
            kv
        });
        drop(kv);
        if std::env::var("APPLY_ONLY").is_ok() {
            // routecore's apply alone (the A B A B runs against an older build).
            println!(
                "routecore KvIndex apply: {:.2} M block-ops/s ({:.1} ms)",
                ops as f64 / t_rc.as_secs_f64() / 1e6,
                t_rc.as_secs_f64() * 1e3
            );
            continue;
        }
        let h0 = heap();
        let kv = routecore_index(&w);
        routecore_apply(&w, &kv, &batches);
        let rc_bytes = heap() - h0;
        let held: u64 = w
            .endpoints
            .iter()
            .map(|e| kv.stats(e).expect("e").blocks)
            .sum();
        let (t_rt, tree) = best(rounds, || radix_apply(&w));
        drop(tree);
        let h0 = heap();
        let (tree, refused) = radix_apply(&w);
        let rt_bytes = heap() - h0;
        let (t_crtc, crtc) = best(rounds, || crtc_apply(&w, &rt));
        drop(crtc);
        let h0 = heap();
        let crtc = crtc_apply(&w, &rt);
        let crtc_bytes = heap() - h0;
        let mops = |t: Duration| ops as f64 / t.as_secs_f64() / 1e6;
        println!(
            "held blocks (endpoint, block) at the end: {held}; events RadixTree refused: {refused}"
        );
        println!("| apply | M block-ops/s | ms | heap bytes / held block |");
        println!("|---|---|---|---|");
        for (name, t, bytes) in [
            ("routecore KvIndex", t_rc, rc_bytes),
            ("Dynamo RadixTree", t_rt, rt_bytes),
            (
                "Dynamo ConcurrentRadixTreeCompressed (1 worker thread)",
                t_crtc,
                crtc_bytes,
            ),
        ] {
            println!(
                "| {name} | {:.2} | {:.1} | {:.1} |",
                mops(t),
                t.as_secs_f64() * 1e3,
                bytes as f64 / held as f64
            );
        }

        // The same overlap for every endpoint, every query: routecore's two
        // ways always; Dynamo's where it did not refuse a removal (see
        // `split_then_remove`).
        let mut q = RoutecoreQuery::new(&kv, &w.endpoints);
        // Per Dynamo structure: queries where some endpoint's overlap is
        // higher than routecore's (blocks Dynamo kept after their removal),
        // and where some endpoint's is lower (which would be a miss).
        let (mut higher, mut lower) = ([0; 2], [0; 2]);
        for p in w.queries.iter().chain(&w.served) {
            let each = q.each(p).to_vec();
            #[cfg(not(feature = "before"))]
            {
                assert_eq!(q.walk(p), each.as_slice());
                assert_eq!(q.one_walk(p), each.as_slice());
                assert_eq!(q.hashes, kv.request_hashes(p, None));
            }
            let seq = dynamo_hash(&w, p);
            let theirs = [
                overlaps(&w, &tree.find_matches(seq.clone(), false)),
                overlaps(&w, &crtc.backend().find_matches(&seq, false)),
            ];
            for (k, t) in theirs.iter().enumerate() {
                higher[k] += usize::from(t.iter().zip(&each).any(|(t, o)| t > o));
                lower[k] += usize::from(t.iter().zip(&each).any(|(t, o)| t < o));
            }
        }
        println!(
            "queries where Dynamo's overlap is higher / lower than routecore's for some \
             endpoint, of {}: RadixTree {} / {}, ConcurrentRadixTreeCompressed {} / {}",
            w.queries.len() + w.served.len(),
            higher[0],
            lower[0],
            higher[1],
            lower[1]
        );

        for (what, prompts) in [
            ("new 8K prompt on a shared system prompt", &w.queries),
            ("8K prompt served before (held whole)", &w.served),
        ] {
            let n = prompts.len();
            let matched: usize = prompts
                .iter()
                .map(|p| q.each(p).iter().flatten().max().copied().unwrap_or(0))
                .sum();
            println!(
                "\n### query: {what} (longest match {:.0} blocks on average)",
                matched as f64 / n as f64
            );
            println!("| query | us per query |");
            println!("|---|---|");
            let reps = 20;
            let time = |f: &mut dyn FnMut(&[u32])| {
                best(rounds, || {
                    for _ in 0..reps {
                        for p in prompts {
                            f(p);
                        }
                    }
                })
                .0
            };
            let mut rows: Vec<(&str, Duration)> = Vec::new();
            #[cfg(not(feature = "before"))]
            rows.push((
                "routecore match_prompt (hash as it walks, one walk)",
                time(&mut |p| {
                    black_box(q.walk(p));
                }),
            ));
            #[cfg(not(feature = "before"))]
            rows.push((
                "routecore request_hashes + match_hashes (a pick's shared hashes)",
                time(&mut |p| {
                    black_box(q.hash_then_walk(p));
                }),
            ));
            #[cfg(not(feature = "before"))]
            rows.push((
                "routecore walk_prompt + held_into (a pick's path: hashes and answers, one walk)",
                time(&mut |p| {
                    black_box(q.one_walk(p));
                }),
            ));
            #[cfg(not(feature = "before"))]
            {
                let hashed: Vec<Vec<u64>> =
                    prompts.iter().map(|p| kv.request_hashes(p, None)).collect();
                let mut k = 0;
                rows.push((
                    "routecore match_hashes only (hashes given)",
                    time(&mut |_| {
                        black_box(kv.match_hashes(&hashed[k % n], &q.ids, &mut q.held));
                        k += 1;
                    }),
                ));
            }
            rows.push((
                "routecore hash all + leading_blocks per endpoint",
                time(&mut |p| {
                    black_box(q.each(p));
                }),
            ));
            rows.push((
                "routecore request_hashes only (kv-walk: held runs from the table)",
                time(&mut |p| {
                    black_box(q.hash_all(p));
                }),
            ));
            rows.push((
                "routecore chained hash alone (block_hashes)",
                time(&mut |p| {
                    black_box(q.chain(p));
                }),
            ));
            // The tail: the blocks past the longest match, which a pick's
            // walk chains after it stops, from the last matched block's
            // hash; beside the same step unchained (each block after one
            // fixed hash: the function without the wait) and Dynamo's hash
            // of the same ids.
            let c = kv.config();
            let bs = c.block_size;
            let tails: Vec<(u64, &[u32])> = prompts
                .iter()
                .map(|p| {
                    let m = q.each(p).iter().flatten().max().copied().unwrap_or(0);
                    let prev = m
                        .checked_sub(1)
                        .map_or(c.seed, |m| kv.request_hashes(p, None)[m]);
                    (prev, &p[m * bs..])
                })
                .collect();
            let tail_blocks =
                tails.iter().map(|(_, t)| t.len() / bs).sum::<usize>() as f64 / n as f64;
            let mut step = routecore::prefix::BlockStep::new(bs, c.seed);
            let mut k = 0;
            let mut tail_rows = [
                ("routecore chain of the tail alone", Duration::ZERO),
                (
                    "routecore the same step unchained, the tail",
                    Duration::ZERO,
                ),
                ("Dynamo hash of the tail alone", Duration::ZERO),
            ];
            for (row, (_, t)) in tail_rows.iter_mut().enumerate() {
                *t = time(&mut |_| {
                    let (prev, ids) = tails[k % n];
                    k += 1;
                    match row {
                        0 => {
                            q.hashes.clear();
                            q.hashes
                                .extend(routecore::prefix::IdChain::new(ids, bs, c.seed, prev));
                        }
                        1 => {
                            q.hashes.clear();
                            q.hashes
                                .extend(ids.chunks_exact(bs).map(|b| step.hash(prev, b)));
                        }
                        _ => {
                            black_box(dynamo_hash(&w, ids));
                        }
                    }
                    black_box(&q.hashes);
                });
            }
            if tail_blocks >= 1.0 {
                println!(
                    "tail past the match: {tail_blocks:.0} blocks on average; ns per block: {}",
                    tail_rows
                        .iter()
                        .map(|(name, t)| format!(
                            "{name} {:.2}",
                            us(*t, reps * n) * 1e3 / tail_blocks
                        ))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            rows.extend(tail_rows);
            let seqs: Vec<_> = prompts.iter().map(|p| dynamo_hash(&w, p)).collect();
            rows.push((
                "Dynamo hash + RadixTree.find_matches",
                time(&mut |p| {
                    black_box(tree.find_matches(dynamo_hash(&w, p), false));
                }),
            ));
            rows.push((
                "Dynamo hash + ConcurrentRadixTreeCompressed.find_matches",
                time(&mut |p| {
                    black_box(crtc.backend().find_matches(&dynamo_hash(&w, p), false));
                }),
            ));
            rows.push((
                "Dynamo hash only",
                time(&mut |p| {
                    black_box(dynamo_hash(&w, p));
                }),
            ));
            let mut k = 0;
            rows.push((
                "Dynamo RadixTree.find_matches only (hashes given)",
                time(&mut |_| {
                    black_box(tree.find_matches(seqs[k % n].clone(), false));
                    k += 1;
                }),
            ));
            let mut k = 0;
            rows.push((
                "Dynamo ConcurrentRadixTreeCompressed.find_matches only",
                time(&mut |_| {
                    black_box(crtc.backend().find_matches(&seqs[k % n], false));
                    k += 1;
                }),
            ));
            for (name, t) in rows {
                println!("| {name} | {:.2} |", us(t, reps * n));
            }
        }
        drop(crtc);
    }
}
