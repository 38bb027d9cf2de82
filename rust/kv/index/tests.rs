use super::*;
use crate::prefix::{block_hashes, Tokens};
use crate::rng::Rng;

const BS: usize = 2;

fn index(capacity: usize, stale: Option<f64>) -> KvIndex {
    let kv = KvIndex::new(KvConfig {
        block_size: BS,
        seed: 7,
        capacity_blocks: capacity,
        stale_after_s: stale,
    })
    .expect("index");
    kv.add_endpoint("e");
    kv.set_connected("e", true).expect("endpoint");
    kv
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Event {
    Event::Stored(Stored {
        hashes: hashes.to_vec(),
        parent,
        token_ids: tokens.to_vec(),
        block_size: BS,
        lora: None,
        medium: Some(MEDIUM_GPU.into()),
    })
}

fn removed(hashes: &[u64]) -> Event {
    Event::Removed {
        hashes: hashes.to_vec(),
        medium: None,
    }
}

/// Applies `events` as the next batch.
fn feed(kv: &KvIndex, events: Vec<Event>) -> Applied {
    let seq = kv.stats("e").expect("e").last_seq.map_or(0, |s| s + 1);
    assert_eq!(kv.observe("e", seq).expect("e"), Seq::Next);
    let events: Vec<_> = events.into_iter().map(Ok).collect();
    kv.apply("e", seq, &events, 0.0).expect("apply")
}

fn leading(kv: &KvIndex, tokens: &[u32]) -> Option<usize> {
    kv.leading_blocks("e", &kv.request_hashes(tokens, None))
}

#[test]
fn stored_blocks_are_keyed_by_our_chained_hashes_of_their_tokens() {
    let kv = index(100, None);
    feed(
        &kv,
        vec![stored(&[101, 102, 103], None, &[1, 2, 3, 4, 5, 6])],
    );
    assert_eq!(leading(&kv, &[1, 2, 3, 4, 5, 6, 7, 8]), Some(3));
    assert_eq!(leading(&kv, &[1, 2, 3, 9, 5, 6]), Some(1));
    assert_eq!(leading(&kv, &[9, 2, 3, 4]), Some(0));
    // A child event chains from its parent's engine hash.
    feed(&kv, vec![stored(&[104], Some(103), &[7, 8])]);
    assert_eq!(leading(&kv, &[1, 2, 3, 4, 5, 6, 7, 8]), Some(4));
    let mut whole = block_hashes(Tokens::Ids(&[1, 2, 3, 4, 5, 6, 7, 8]), BS, 7).expect("h");
    whole.sort_unstable();
    assert_eq!(kv.blocks("e").expect("e"), whole);
}

#[test]
fn hashes_after_a_parent_are_the_tail_of_the_whole_chain() {
    let t: Vec<u32> = (0..12).collect();
    let whole = block_hashes(Tokens::Ids(&t), 3, 5).expect("h");
    let tail: Vec<u64> = IdChain::new(&t[6..], 3, 5, whole[1]).collect();
    assert_eq!(tail, whole[2..].to_vec());
}

#[test]
fn bad_events_are_skipped_and_change_nothing() {
    let kv = index(100, None);
    feed(&kv, vec![stored(&[1], None, &[1, 2])]);
    let before = kv.blocks("e").expect("e");
    let mut other_size = stored(&[2], Some(1), &[3, 4, 5]);
    if let Event::Stored(s) = &mut other_size {
        s.block_size = 3;
    }
    let mut cpu = stored(&[3], Some(1), &[3, 4]);
    if let Event::Stored(s) = &mut cpu {
        s.medium = Some("CPU".into());
    }
    let a = feed(
        &kv,
        vec![
            other_size,
            cpu,
            stored(&[4], Some(999), &[3, 4]),
            stored(&[5, 6], Some(1), &[3, 4, 5]),
            removed(&[12345]),
        ],
    );
    assert_eq!(a.events, 0);
    assert_eq!(
        a.skipped,
        vec![
            Skip::BlockSize(3),
            Skip::Medium("CPU".into()),
            Skip::UnknownParent(999),
            Skip::Malformed("3 token ids for 2 blocks of 2".into()),
            Skip::UnknownBlock(12345),
        ]
    );
    assert_eq!(kv.blocks("e").expect("e"), before);
    let s = kv.stats("e").expect("e");
    assert_eq!((s.skipped, s.events, s.blocks), (5, 1, 1));
}

/// A batch applies its good events around the bad ones, and a removal naming
/// blocks never stored still removes the ones the index holds.
#[test]
fn a_batch_applies_its_good_events_around_the_bad_ones() {
    let kv = index(100, None);
    assert_eq!(kv.observe("e", 0).expect("e"), Seq::Next);
    let batch = vec![
        Ok(stored(&[1, 2], None, &[1, 2, 3, 4])),
        Err(Skip::UnknownTag("BlockMoved".into())),
        Ok(stored(&[3], Some(999), &[5, 6])),
        Ok(removed(&[2, 12345])),
        Ok(stored(&[4], Some(1), &[7, 8])),
    ];
    let a = kv.apply("e", 0, &batch, 0.0).expect("apply");
    assert_eq!(
        a.skipped,
        vec![
            Skip::UnknownTag("BlockMoved".into()),
            Skip::UnknownParent(999),
            Skip::UnknownBlock(12345),
        ]
    );
    assert_eq!(leading(&kv, &[1, 2, 3, 4]), Some(1), "block 2 removed");
    assert_eq!(
        leading(&kv, &[1, 2, 7, 8]),
        Some(2),
        "block 4 after block 1"
    );
    let s = kv.stats("e").expect("e");
    assert_eq!((s.events, s.skipped, s.blocks), (3, 3, 2));
}

#[test]
fn removed_and_cleared_blocks_stop_matching() {
    let kv = index(100, None);
    feed(&kv, vec![stored(&[1, 2, 3], None, &[1, 2, 3, 4, 5, 6])]);
    feed(&kv, vec![removed(&[3])]);
    assert_eq!(leading(&kv, &[1, 2, 3, 4, 5, 6]), Some(2));
    feed(&kv, vec![removed(&[1])]);
    assert_eq!(
        leading(&kv, &[1, 2, 3, 4, 5, 6]),
        Some(0),
        "a prefix needs its first block"
    );
    feed(&kv, vec![Event::Cleared]);
    assert!(kv.blocks("e").expect("e").is_empty());
    // The engine hash of a cleared block is forgotten too.
    let a = feed(&kv, vec![removed(&[2])]);
    assert_eq!(a.skipped, vec![Skip::UnknownBlock(2)]);
}

#[test]
fn lora_blocks_match_only_requests_for_that_adapter() {
    let kv = index(100, None);
    let mut e = stored(&[1], None, &[1, 2]);
    if let Event::Stored(s) = &mut e {
        s.lora = Some("sql".into());
    }
    feed(&kv, vec![e]);
    assert_eq!(leading(&kv, &[1, 2]), Some(0));
    let h = kv.request_hashes(&[1, 2], Some("sql"));
    assert_eq!(kv.leading_blocks("e", &h), Some(1));
    assert_eq!(
        kv.leading_blocks("e", &kv.request_hashes(&[1, 2], Some("x"))),
        Some(0)
    );
}

#[test]
fn memory_stays_bounded_and_the_oldest_blocks_go_first() {
    let kv = index(16, None);
    for i in 0..100u32 {
        feed(&kv, vec![stored(&[u64::from(i)], None, &[i, i])]);
        assert!(kv.stats("e").expect("e").blocks <= 16);
    }
    assert_eq!(leading(&kv, &[99, 99]), Some(1));
    assert_eq!(leading(&kv, &[0, 0]), Some(0));
    let s = kv.stats("e").expect("e");
    assert_eq!(s.evicted + s.blocks, 100);
    // Evicted engine hashes are forgotten with their blocks.
    assert_eq!(
        feed(&kv, vec![removed(&[0])]).skipped,
        vec![Skip::UnknownBlock(0)]
    );
}

#[test]
fn sequence_numbers_tell_next_duplicate_gap_and_restart() {
    let kv = index(100, None);
    assert_eq!(kv.observe("e", 3).expect("e"), Seq::Gap { from: 0 });
    kv.apply("e", 0, &[Ok(stored(&[1], None, &[1, 2]))], 0.0)
        .expect("a");
    assert!(kv.expects("e", 1).expect("e"));
    assert_eq!(kv.observe("e", 1).expect("e"), Seq::Next);
    kv.apply("e", 1, &[], 0.0).expect("a");
    assert_eq!(kv.observe("e", 1).expect("e"), Seq::Duplicate);
    assert_eq!(kv.observe("e", 5).expect("e"), Seq::Gap { from: 2 });
    assert_eq!(kv.blocks("e").expect("e").len(), 1);
    assert_eq!(kv.observe("e", 0).expect("e"), Seq::Restart);
    assert!(kv.blocks("e").expect("e").is_empty(), "a restart clears");
    kv.apply("e", 0, &[], 0.0).expect("a");
    kv.apply("e", 1, &[Ok(stored(&[1], None, &[1, 2]))], 0.0)
        .expect("a");
    // After a disconnect an older number is a restart, not a duplicate.
    kv.set_connected("e", false).expect("e");
    assert_eq!(kv.observe("e", 1).expect("e"), Seq::Restart);
    let s = kv.stats("e").expect("e");
    assert_eq!((s.duplicates, s.gaps, s.restarts), (1, 2, 2));
    assert!(kv.observe("nope", 0).is_err());
}

#[test]
fn an_unrecovered_gap_clears_the_endpoint() {
    let kv = index(100, None);
    feed(&kv, vec![stored(&[1], None, &[1, 2])]);
    assert_eq!(kv.observe("e", 9).expect("e"), Seq::Gap { from: 1 });
    kv.unrecovered("e").expect("e");
    assert!(kv.blocks("e").expect("e").is_empty());
    assert_eq!(kv.stats("e").expect("e").unrecovered, 1);
}

#[test]
fn an_endpoint_that_follows_nothing_takes_any_batch_first() {
    let kv = index(100, None);
    assert!(
        kv.expects("e", 5000).expect("e"),
        "a fresh endpoint starts anywhere"
    );
    kv.apply("e", 5000, &[Ok(stored(&[1], None, &[1, 2]))], 0.0)
        .expect("a");
    assert!(!kv.expects("e", 5000).expect("e"));
    assert!(!kv.expects("e", 5002).expect("e"));
    assert!(kv.expects("e", 5001).expect("e"));
    // A restart seen by replay: cleared, and again any batch is first.
    kv.restarted("e").expect("e");
    let s = kv.stats("e").expect("e");
    assert_eq!((s.blocks, s.last_seq, s.restarts), (0, None, 1));
    assert!(kv.expects("e", 7).expect("e"));
}

#[test]
fn a_batch_that_cannot_be_read_consumes_its_number_and_clears() {
    let kv = index(100, None);
    feed(&kv, vec![stored(&[1], None, &[1, 2])]);
    assert_eq!(kv.observe("e", 1).expect("e"), Seq::Next);
    kv.refused("e", 1, 0.0).expect("e");
    let s = kv.stats("e").expect("e");
    assert_eq!((s.blocks, s.last_seq, s.garbage), (0, Some(1), 1));
    assert_eq!(kv.observe("e", 2).expect("e"), Seq::Next, "no gap");
}

#[test]
fn a_batch_larger_than_the_capacity_keeps_its_newest_blocks() {
    let kv = index(16, None);
    let events: Vec<_> = (0..1000u32)
        .map(|i| Ok(stored(&[u64::from(i)], None, &[i, i])))
        .collect();
    assert_eq!(kv.observe("e", 0).expect("e"), Seq::Next);
    let applied = kv.apply("e", 0, &events, 0.0).expect("a");
    assert_eq!(applied.events, 1000);
    let s = kv.stats("e").expect("e");
    assert!(s.blocks <= 16 && s.blocks + s.evicted == 1000, "{s:?}");
    assert_eq!(leading(&kv, &[999, 999]), Some(1));
}

#[test]
fn an_idle_endpoint_that_answers_stays_live() {
    let kv = index(100, Some(1.0));
    feed(&kv, vec![stored(&[1], None, &[1, 2])]);
    // Heard from (a replay answered, nothing missed) though no event came.
    for t in 1..10 {
        assert!(!kv.heard("e", f64::from(t) * 0.9).expect("e"));
        assert!(!kv.check_stale("e", f64::from(t) * 0.9 + 0.5).expect("e"));
    }
    assert_eq!(leading(&kv, &[1, 2]), Some(1));
    assert!(kv.check_stale("e", 20.0).expect("e"), "no answer: stale");
    assert!(kv.heard("e", 20.5).expect("e"), "an answer revives it");
    assert_eq!(leading(&kv, &[1, 2]), Some(1));
    assert!(kv.heard("nope", 0.0).is_err());
}

#[test]
fn a_stale_or_disconnected_endpoint_answers_none_for_the_fallback() {
    let kv = index(100, Some(1.0));
    feed(&kv, vec![stored(&[1], None, &[1, 2])]);
    assert!(!kv.check_stale("e", 0.5).expect("e"));
    assert_eq!(leading(&kv, &[1, 2]), Some(1));
    assert!(kv.check_stale("e", 2.0).expect("e"), "went stale");
    assert_eq!(leading(&kv, &[1, 2]), None);
    assert!(!kv.stats("e").expect("e").live);
    let a = kv.apply("e", 1, &[], 2.5).expect("a");
    assert!(a.revived);
    assert_eq!(leading(&kv, &[1, 2]), Some(1));
    assert!(kv.set_connected("e", false).expect("e"));
    assert_eq!(leading(&kv, &[1, 2]), None);
    assert_eq!(kv.leading_blocks("unknown", &[1]), None);
}

#[test]
fn bad_configs_are_refused() {
    let bad = |c: KvConfig| KvIndex::new(c).is_err();
    assert!(bad(KvConfig {
        block_size: 0,
        ..KvConfig::default()
    }));
    assert!(bad(KvConfig {
        capacity_blocks: 0,
        ..KvConfig::default()
    }));
    assert!(bad(KvConfig {
        stale_after_s: Some(f64::NAN),
        ..KvConfig::default()
    }));
    assert!(bad(KvConfig {
        stale_after_s: Some(0.0),
        ..KvConfig::default()
    }));
}

/// An engine's LRU block cache that reports what it does as vLLM would.
struct MockEngine {
    cap: usize,
    /// (engine hash, token prefix), least recently used first.
    lru: Vec<(u64, Vec<u32>)>,
    /// Its hash seed: a restarted engine names blocks anew.
    salt: u64,
    block_size: usize,
}

impl MockEngine {
    fn new(cap: usize, block_size: usize) -> Self {
        Self {
            cap,
            lru: Vec::new(),
            salt: 12345,
            block_size,
        }
    }

    /// Serves `prompt` for `lora`: stores its missing full blocks, evicting
    /// as needed, in one `BlockStored` per run of new blocks.
    fn serve(&mut self, prompt: &[u32], lora: Option<&str>, out: &mut Vec<Event>) {
        let mut parent = None;
        let mut run: Option<Stored> = None;
        let bs = self.block_size;
        for end in (bs..=prompt.len()).step_by(bs) {
            let prefix = prompt[..end].to_vec();
            // Engine hashes: anything unique per prefix and adapter.
            let mut bytes: Vec<u8> = prefix.iter().flat_map(|x| x.to_le_bytes()).collect();
            bytes.extend(lora.unwrap_or("").bytes());
            let h = xxh3_64_with_seed(&bytes, self.salt);
            if let Some(i) = self.lru.iter().position(|(x, _)| *x == h) {
                let hit = self.lru.remove(i);
                self.lru.push(hit);
                out.extend(run.take().map(Event::Stored));
            } else {
                if self.lru.len() == self.cap {
                    let (old, _) = self.lru.remove(0);
                    out.push(removed(&[old]));
                }
                self.lru.push((h, prefix));
                let s = run.get_or_insert_with(|| Stored {
                    hashes: Vec::new(),
                    parent,
                    token_ids: Vec::new(),
                    block_size: bs,
                    lora: lora.map(str::to_owned),
                    medium: Some(MEDIUM_GPU.into()),
                });
                s.hashes.push(h);
                s.token_ids.extend_from_slice(&prompt[end - bs..end]);
            }
            parent = Some(h);
        }
        out.extend(run.map(Event::Stored));
    }
}

/// Stamps that would pass `u32::MAX` are renumbered in their order: the
/// index evicts the same blocks as one whose stamps never came near it.
#[test]
fn stamps_renumbered_before_they_overflow_keep_the_eviction_order() {
    let mut rng = Rng::new(9);
    let (a, b) = (index(16, None), index(16, None));
    let mut engine = MockEngine::new(40, BS);
    for round in 0..200 {
        if round % 50 == 0 {
            // Close to the end of the stamps (their order kept).
            let e = b.get("e").expect("e");
            let mut e = lock(&e);
            let base = u32::MAX - 20 - e.stamp;
            for h in e.blocks.values_mut() {
                h.stamp += base;
            }
            e.stamp += base;
        }
        let prompt: Vec<u32> = (0..2 * (1 + rng.below(5) as u32))
            .map(|_| rng.below(4) as u32)
            .collect();
        let mut events = Vec::new();
        engine.serve(&prompt, None, &mut events);
        feed(&a, events.clone());
        feed(&b, events);
        assert_eq!(a.blocks("e"), b.blocks("e"), "round {round}");
    }
    assert!(a.stats("e").expect("e").evicted > 0);
    assert!(lock(&b.get("e").expect("e")).stamp < 1000, "renumbered");
}

#[test]
fn the_index_follows_an_engine_cache_exactly_and_replicas_agree() {
    let mut rng = Rng::new(3);
    let mut engine = MockEngine::new(24, BS);
    let (a, b) = (index(1000, None), index(1000, None));
    for _ in 0..300 {
        let len = 2 * (1 + rng.below(6) as usize);
        let head = rng.below(3) as u32;
        let prompt: Vec<u32> = (0..len as u32)
            .map(|i| if i < 4 { head + i } else { rng.below(4) as u32 })
            .collect();
        let mut events = Vec::new();
        engine.serve(&prompt, None, &mut events);
        feed(&a, events.clone());
        feed(&b, events);
    }
    let mut truth: Vec<u64> = engine
        .lru
        .iter()
        .map(|(_, prefix)| {
            *block_hashes(Tokens::Ids(prefix), BS, 7)
                .expect("h")
                .last()
                .expect("block")
        })
        .collect();
    truth.sort_unstable();
    assert_eq!(a.blocks("e").expect("e"), truth);
    assert_eq!(a.blocks("e").expect("e"), b.blocks("e").expect("e"));
}

/// The index before one table served every endpoint (issue 28), kept as
/// the oracle of the property test below: each endpoint's blocks by our
/// hash with the engine hash and store stamp, the engine hash -> ours map,
/// and a query that probes each endpoint on its own. Liveness is as before.
mod old {
    use std::collections::HashMap;

    use super::super::{lora_seed, Event, KvConfig, Skip, Stored, MEDIUM_GPU};
    use crate::prefix::IdChain;

    #[derive(Debug, Default)]
    pub struct Endpoint {
        blocks: HashMap<u64, (u64, u64)>,
        ours: HashMap<u64, u64>,
        stamp: u64,
        pub evicted: u64,
        pub clears: u64,
        connected: bool,
        stale: bool,
        last_event: Option<f64>,
    }

    impl Endpoint {
        pub fn live(&self) -> bool {
            self.connected && !self.stale
        }
        pub fn set_connected(&mut self, connected: bool) -> bool {
            let was = self.live();
            self.connected = connected;
            was != self.live()
        }
        pub fn check_stale(&mut self, after: f64, now: f64) -> bool {
            let was = self.live();
            let last = *self.last_event.get_or_insert(now);
            self.stale = now - last > after;
            was != self.live()
        }
        /// The start of a batch: whether it revived the endpoint.
        pub fn heard(&mut self, now: f64) -> bool {
            let revived = self.stale && self.connected;
            self.stale = false;
            self.last_event = Some(now);
            revived
        }
        pub fn clear(&mut self) {
            self.blocks.clear();
            self.ours.clear();
            self.clears += 1;
        }
        fn insert(&mut self, ours: u64, engine: u64) {
            self.stamp += 1;
            if let Some((old, _)) = self.blocks.insert(ours, (engine, self.stamp)) {
                if old != engine {
                    self.ours.remove(&old);
                }
            }
            self.ours.insert(engine, ours);
        }
        pub fn evict(&mut self, capacity: usize) {
            if self.blocks.len() <= capacity {
                return;
            }
            let keep = capacity - capacity / 8;
            let mut stamps: Vec<u64> = self.blocks.values().map(|&(_, s)| s).collect();
            let cut = stamps.len() - keep;
            let (_, &mut oldest_kept, _) = stamps.select_nth_unstable(cut);
            let before = self.blocks.len();
            let ours = &mut self.ours;
            self.blocks.retain(|_, &mut (engine, s)| {
                let keep = s >= oldest_kept;
                if !keep {
                    ours.remove(&engine);
                }
                keep
            });
            self.evicted += (before - self.blocks.len()) as u64;
        }
        pub fn apply_event(
            &mut self,
            c: &KvConfig,
            event: &Event,
            skipped: &mut Vec<Skip>,
        ) -> bool {
            match event {
                Event::Cleared => self.clear(),
                Event::Removed { hashes, medium } => {
                    if let Some(m) = medium.as_deref().filter(|m| *m != MEDIUM_GPU) {
                        skipped.push(Skip::Medium(m.to_owned()));
                        return false;
                    }
                    let before = skipped.len();
                    for h in hashes {
                        match self.ours.remove(h) {
                            Some(ours) => {
                                self.blocks.remove(&ours);
                            }
                            None => skipped.push(Skip::UnknownBlock(*h)),
                        }
                    }
                    return hashes.is_empty() || skipped.len() - before < hashes.len();
                }
                Event::Stored(s) => match self.stored_hashes(c, s) {
                    Err(skip) => {
                        skipped.push(skip);
                        return false;
                    }
                    Ok(ours) => {
                        for (o, engine) in ours.into_iter().zip(&s.hashes) {
                            self.insert(o, *engine);
                        }
                    }
                },
            }
            true
        }
        fn stored_hashes(&self, c: &KvConfig, s: &Stored) -> Result<Vec<u64>, Skip> {
            if let Some(m) = s.medium.as_deref().filter(|m| *m != MEDIUM_GPU) {
                return Err(Skip::Medium(m.to_owned()));
            }
            let bs = c.block_size;
            if s.block_size != bs {
                return Err(Skip::BlockSize(s.block_size));
            }
            if s.token_ids.len() != s.hashes.len() * bs {
                return Err(Skip::Malformed(format!(
                    "{} token ids for {} blocks of {bs}",
                    s.token_ids.len(),
                    s.hashes.len()
                )));
            }
            let seed = lora_seed(c.seed, s.lora.as_deref());
            let prev = match s.parent {
                None => seed,
                Some(p) => *self.ours.get(&p).ok_or(Skip::UnknownParent(p))?,
            };
            Ok(IdChain::new(&s.token_ids, bs, seed, prev).collect())
        }
        pub fn leading_blocks(&self, hashes: &[u64]) -> Option<usize> {
            self.live().then(|| {
                hashes
                    .iter()
                    .take_while(|h| self.blocks.contains_key(h))
                    .count()
            })
        }
        pub fn blocks(&self) -> Vec<u64> {
            let mut out: Vec<u64> = self.blocks.keys().copied().collect();
            out.sort_unstable();
            out
        }
    }
}

/// One endpoint of the property test: its engine, the batches it sent, and
/// the oracle's view of it.
struct Fleet {
    kv: KvIndex,
    names: Vec<String>,
    engines: Vec<MockEngine>,
    /// Per engine, the next sequence number and the last batch sent.
    seq: Vec<u64>,
    last: Vec<Option<(u64, Vec<Event>)>>,
    oracle: Vec<old::Endpoint>,
    now: f64,
    /// Blocks matched by the queries so far.
    matched: usize,
}

impl Fleet {
    fn new(n: usize, config: KvConfig, rng: &mut Rng) -> Self {
        let block_size = config.block_size;
        let kv = KvIndex::new(config).expect("index");
        let names: Vec<String> = (0..n).map(|i| format!("e{i}")).collect();
        let mut oracle = Vec::new();
        for name in &names {
            kv.add_endpoint(name);
            kv.set_connected(name, true).expect("e");
            let mut o = old::Endpoint::default();
            o.set_connected(true);
            oracle.push(o);
        }
        Self {
            kv,
            engines: (0..n)
                .map(|_| MockEngine::new(8 + rng.below(40) as usize, block_size))
                .collect(),
            seq: vec![0; n],
            last: vec![None; n],
            oracle,
            names,
            now: 0.0,
            matched: 0,
        }
    }

    /// Engine `p` publishes `events` as its next batch; `lost`: it never
    /// arrives (a gap at the next one).
    fn publish(&mut self, p: usize, events: Vec<Event>, lost: bool) {
        let seq = self.seq[p];
        self.seq[p] += 1;
        self.last[p] = Some((seq, events.clone()));
        if !lost {
            self.deliver(p, seq, Some(&events));
        }
    }

    /// The index receives batch `seq` of `p` as the subscriber would hand
    /// it over (a gap replay cannot close clears the endpoint; a frame that
    /// could not be read, `events` None, is refused), the oracle the same,
    /// and they must agree on what it did.
    fn deliver(&mut self, p: usize, seq: u64, events: Option<&[Event]>) {
        let name = &self.names[p];
        let o = &mut self.oracle[p];
        match self.kv.observe(name, seq).expect("e") {
            Seq::Duplicate => return,
            Seq::Restart => o.clear(),
            Seq::Gap { .. } => {
                self.kv.unrecovered(name).expect("e");
                o.clear();
            }
            Seq::Next => {}
        }
        let Some(events) = events else {
            let got = self.kv.refused(name, seq, self.now).expect("refused");
            o.clear();
            let want = Applied {
                revived: o.heard(self.now),
                ..Applied::default()
            };
            assert_eq!(got, want, "{name} refused batch {seq}");
            return;
        };
        let batch: Vec<_> = events.iter().cloned().map(Ok).collect();
        let got = self.kv.apply(name, seq, &batch, self.now).expect("apply");
        let mut want = Applied {
            revived: o.heard(self.now),
            ..Applied::default()
        };
        let config = self.kv.config().clone();
        for e in events {
            if o.apply_event(&config, e, &mut want.skipped) {
                want.events += 1;
            }
            o.evict(config.capacity_blocks);
        }
        assert_eq!(got, want, "{name} batch {seq}");
    }

    /// Every endpoint's answer for `prompt`, by one walk and one by one,
    /// against the oracle's.
    fn check_query(&mut self, prompt: &[u32], lora: Option<&str>) {
        let hashes = self.kv.request_hashes(prompt, lora);
        // Read from the table's runs where it holds them, the chain still.
        let c = self.kv.config();
        let chain = block_hashes(Tokens::Ids(prompt), c.block_size, lora_seed(c.seed, lora));
        assert_eq!(Ok(&hashes), chain.as_ref(), "request_hashes");
        let want: Vec<Option<usize>> = self
            .oracle
            .iter()
            .map(|o| o.leading_blocks(&hashes))
            .collect();
        let one_by_one: Vec<Option<usize>> = self
            .names
            .iter()
            .map(|n| self.kv.leading_blocks(n, &hashes))
            .collect();
        assert_eq!(one_by_one, want, "leading_blocks");
        let ids = self.kv.endpoint_ids(&self.names);
        let mut held = Vec::new();
        let blocks = self.kv.match_prompt(prompt, lora, &ids, &mut held);
        assert_eq!(blocks, hashes.len());
        assert_eq!(held, want, "match_prompt");
        // The prompt hashed already (the picker's shared hashes): the same.
        held.clear();
        assert_eq!(self.kv.match_hashes(&hashes, &ids, &mut held), blocks);
        assert_eq!(held, want, "match_hashes");
        // One walk for the hashes and every live endpoint (a pick's), read
        // for all of them and for some, in another order.
        let (mut walked, mut kv_held) = (vec![7], KvHeld::default());
        self.kv.walk_prompt(prompt, lora, &mut walked, &mut kv_held);
        assert_eq!(walked, hashes, "walk_prompt's hashes");
        held.clear();
        assert_eq!(
            kv_held.held_into(&self.kv, lora, &ids, &mut held),
            Some(blocks)
        );
        assert_eq!(held, want, "walk_prompt");
        let some: Vec<Option<u32>> = ids.iter().rev().step_by(2).copied().chain([None]).collect();
        let want_some: Vec<Option<usize>> = (0..ids.len())
            .rev()
            .step_by(2)
            .map(|k| want[k])
            .chain([None])
            .collect();
        kv_held.held_into(&self.kv, lora, &some, &mut held);
        assert_eq!(held, want_some, "walk_prompt, some endpoints");
        self.matched += held.iter().flatten().sum::<usize>();
    }

    /// Each endpoint's blocks and counters against the oracle's, and the
    /// table holding exactly the blocks some endpoint holds.
    fn check_blocks(&self) {
        let mut union = std::collections::BTreeSet::new();
        for (name, o) in self.names.iter().zip(&self.oracle) {
            let blocks = self.kv.blocks(name).expect("e");
            assert_eq!(blocks, o.blocks(), "{name}");
            let s = self.kv.stats(name).expect("e");
            assert_eq!(
                (s.blocks, s.evicted, s.clears, s.live),
                (blocks.len() as u64, o.evicted, o.clears, o.live()),
                "{name}"
            );
            union.extend(blocks);
        }
        let table = &self.kv.read_blocks().table;
        assert_eq!(table.len(), union.len());
        assert!(union.iter().all(|&h| self
            .names
            .iter()
            .any(|n| self.kv.leading_blocks(n, &[h]) != Some(0))
            || self.oracle.iter().all(|o| !o.live())));
    }
}

/// Random event streams from engines serving prompts that share prefixes
/// (LoRA adapters among them), with removals, evictions past the index's
/// capacity, clears, engine restarts, reconnects, lost and repeated
/// batches, bad events and stale streams: the one-table index answers as
/// the per-endpoint index did (`old`), by one walk and one endpoint at a
/// time, on fleets on both sides of the inline bitset's 63 endpoints, with
/// blocks of 16 ids (their links unrolled, by AVX2 where the CPU has it and
/// by the portable path, forced) and of 2 (the other sizes').
#[test]
fn the_table_answers_as_the_per_endpoint_index_did_on_random_streams() {
    let cases = [1usize, 3, 8, 62, 63, 64, 65, 130]
        .map(|n| (n, BS, false))
        .into_iter()
        .chain([(3, 16, false), (64, 16, false), (65, 16, false)])
        .chain([(3, 16, true), (65, 16, true)]);
    for (case, (n, bs, portable)) in cases.enumerate() {
        // Links made on this thread (the index's and the queries') take
        // the portable path.
        super::link::PORTABLE.set(portable);
        let mut rng = Rng::new(100 + case as u64);
        // A token of the prompts below is bs / 2 ids in a block of bs.
        let widen = |tokens: Vec<u32>| -> Vec<u32> {
            let w = bs as u32 / 2;
            tokens
                .into_iter()
                .flat_map(|t| (0..w).map(move |j| t * w + j))
                .collect()
        };
        let config = KvConfig {
            block_size: bs,
            seed: 7,
            capacity_blocks: 4 + rng.below(20) as usize,
            stale_after_s: Some(5.0),
        };
        let mut f = Fleet::new(n, config, &mut rng);
        // Prompts: one of 4 system prompts, then tokens of a small alphabet
        // (so that tails meet again), under no adapter or one of two.
        let systems: Vec<Vec<u32>> = (0..4)
            .map(|k| {
                (0..2 * (1 + rng.below(5) as u32))
                    .map(|i| 100 * k + i)
                    .collect()
            })
            .collect();
        let loras = [None, None, Some("sql"), Some("#2")];
        let prompt = |rng: &mut Rng| {
            let mut p = systems[rng.below(4) as usize].clone();
            p.extend((0..rng.below(12)).map(|_| rng.below(3) as u32));
            (widen(p), loras[rng.below(4) as usize])
        };
        for step in 0..1500 {
            let p = rng.below(n as u64) as usize;
            match rng.below(40) {
                0 => {
                    f.engines[p].lru.clear();
                    f.publish(p, vec![Event::Cleared], false);
                }
                1 => {
                    // A restart: the stream drops, the engine comes back
                    // empty, naming blocks anew, numbering batches from 0.
                    let name = &f.names[p];
                    assert_eq!(
                        f.kv.set_connected(name, false),
                        Ok(f.oracle[p].set_connected(false))
                    );
                    assert_eq!(
                        f.kv.set_connected(name, true),
                        Ok(f.oracle[p].set_connected(true))
                    );
                    let e = &mut f.engines[p];
                    e.lru.clear();
                    e.salt += 1;
                    f.seq[p] = 0;
                    f.last[p] = None;
                }
                // A lost batch (not the first after a restart: the index
                // would take the next one for the old stream's next).
                2 if f.seq[p] > 0 => {
                    // A lost batch.
                    let (tokens, lora) = prompt(&mut rng);
                    let mut events = Vec::new();
                    f.engines[p].serve(&tokens, lora, &mut events);
                    f.publish(p, events, true);
                }
                3 => {
                    if let Some((seq, events)) = f.last[p].clone() {
                        f.deliver(p, seq, Some(&events));
                    }
                }
                4 => {
                    let bad = vec![
                        removed(&[rng.next_u64()]),
                        stored(&[rng.next_u64()], Some(rng.next_u64()), &[1, 2]),
                        stored(&[rng.next_u64()], None, &[1, 2, 3]),
                    ];
                    f.publish(p, bad, false);
                }
                5 => {
                    f.now += rng.below(4) as f64;
                    for (name, o) in f.names.iter().zip(&mut f.oracle) {
                        assert_eq!(f.kv.check_stale(name, f.now), Ok(o.check_stale(5.0, f.now)));
                    }
                }
                6 => {
                    // A replay that missed nothing: heard from, as by an event.
                    assert_eq!(f.kv.heard(&f.names[p], f.now), Ok(f.oracle[p].heard(f.now)));
                }
                7 => {
                    // A frame that is not a batch: its number is consumed,
                    // what the engine did is unknown to the index.
                    let (tokens, lora) = prompt(&mut rng);
                    let mut events = Vec::new();
                    f.engines[p].serve(&tokens, lora, &mut events);
                    let seq = f.seq[p];
                    f.seq[p] += 1;
                    f.last[p] = None;
                    f.deliver(p, seq, None);
                }
                9 => {
                    // Several prompts in one batch (past the capacity
                    // between its events).
                    let mut events = Vec::new();
                    for _ in 0..2 + rng.below(3) {
                        let (tokens, lora) = prompt(&mut rng);
                        f.engines[p].serve(&tokens, lora, &mut events);
                    }
                    f.publish(p, events, false);
                }
                8 => {
                    // A restart that a replay showed (no batch came): the
                    // engine comes back empty and numbers batches from 0.
                    f.kv.restarted(&f.names[p]).expect("e");
                    f.oracle[p].clear();
                    let e = &mut f.engines[p];
                    e.lru.clear();
                    e.salt += 1;
                    f.seq[p] = 0;
                    f.last[p] = None;
                }
                _ => {
                    let (tokens, lora) = prompt(&mut rng);
                    let mut events = Vec::new();
                    f.engines[p].serve(&tokens, lora, &mut events);
                    f.publish(p, events, false);
                }
            }
            for _ in 0..3 {
                let (tokens, lora) = prompt(&mut rng);
                f.check_query(&tokens, lora);
            }
            if step % 100 == 0 {
                f.check_blocks();
            }
        }
        f.check_blocks();
        // The stream took every path.
        let total = f.names.iter().fold(KvStats::default(), |mut t, name| {
            let s = f.kv.stats(name).expect("e");
            t.evicted += s.evicted;
            t.restarts += s.restarts;
            t.unrecovered += s.unrecovered;
            t.duplicates += s.duplicates;
            t.skipped += s.skipped;
            t.clears += s.clears;
            t.garbage += s.garbage;
            t
        });
        assert!(
            [
                total.evicted,
                total.restarts,
                total.unrecovered,
                total.duplicates,
                total.skipped,
                total.garbage
            ]
            .iter()
            .all(|&c| c > 0),
            "{total:?}"
        );
        assert!(f.matched > 0);
        // Every endpoint cleared, the table is empty.
        for p in 0..n {
            f.publish(p, vec![Event::Cleared], false);
        }
        f.check_blocks();
        assert_eq!(f.kv.read_blocks().table.len(), 0);
    }
}

/// An engine that stores the same tokens under two of its hashes (a cache
/// salt, a multimodal input the tokens do not show): the block is held
/// while either is, and children of either chain from it.
#[test]
fn a_block_stored_under_two_engine_hashes_is_held_until_both_go() {
    let kv = index(100, None);
    feed(
        &kv,
        vec![stored(&[1], None, &[1, 2]), stored(&[2], None, &[1, 2])],
    );
    assert_eq!(kv.blocks("e").expect("e").len(), 1, "one block of ours");
    feed(&kv, vec![stored(&[3], Some(1), &[3, 4])]);
    assert_eq!(leading(&kv, &[1, 2, 3, 4]), Some(2), "a child of the first");
    feed(&kv, vec![removed(&[2])]);
    assert_eq!(leading(&kv, &[1, 2, 3, 4]), Some(2), "still held as 1");
    feed(&kv, vec![removed(&[1])]);
    assert_eq!(leading(&kv, &[1, 2, 3, 4]), Some(0), "both gone");
    let s = kv.stats("e").expect("e");
    assert_eq!(
        (s.blocks, s.skipped),
        (1, 0),
        "block 3 stays, nothing skipped"
    );
}

/// An index no endpoint was added to answers a query (a picker built before
/// any engine publishes): None for every name asked, no block.
#[test]
fn a_query_on_an_index_of_no_endpoint_answers_none() {
    let kv = KvIndex::default();
    let mut held = vec![Some(3)];
    let prompt: Vec<u32> = (0..64).collect();
    assert_eq!(
        kv.match_prompt(&prompt, None, &[None, Some(0)], &mut held),
        4
    );
    assert_eq!(held, vec![None, None]);
}
