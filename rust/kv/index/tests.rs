use super::*;
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
    let tail = block_hashes_after(whole[1], Tokens::Ids(&t[6..]), 3, 5).expect("h");
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
}

impl MockEngine {
    /// Serves `prompt`: stores its missing full blocks, evicting as needed.
    fn serve(&mut self, prompt: &[u32], out: &mut Vec<Event>) {
        let mut parent = None;
        for end in (BS..=prompt.len()).step_by(BS) {
            let prefix = prompt[..end].to_vec();
            // Engine hashes: anything unique per prefix (here a foreign hash).
            let bytes: Vec<u8> = prefix.iter().flat_map(|x| x.to_le_bytes()).collect();
            let h = xxh3_64_with_seed(&bytes, 12345);
            if let Some(i) = self.lru.iter().position(|(x, _)| *x == h) {
                let hit = self.lru.remove(i);
                self.lru.push(hit);
            } else {
                if self.lru.len() == self.cap {
                    let (old, _) = self.lru.remove(0);
                    out.push(removed(&[old]));
                }
                self.lru.push((h, prefix));
                out.push(stored(&[h], parent, &prompt[end - BS..end]));
            }
            parent = Some(h);
        }
    }
}

#[test]
fn the_index_follows_an_engine_cache_exactly_and_replicas_agree() {
    let mut rng = Rng::new(3);
    let mut engine = MockEngine {
        cap: 24,
        lru: Vec::new(),
    };
    let (a, b) = (index(1000, None), index(1000, None));
    for _ in 0..300 {
        let len = 2 * (1 + rng.below(6) as usize);
        let head = rng.below(3) as u32;
        let prompt: Vec<u32> = (0..len as u32)
            .map(|i| if i < 4 { head + i } else { rng.below(4) as u32 })
            .collect();
        let mut events = Vec::new();
        engine.serve(&prompt, &mut events);
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
