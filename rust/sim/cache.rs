//! A simulated engine's prefix cache (vLLM's automatic prefix caching): the
//! chained block hashes ([`crate::prefix::block_hashes`]) of the KV blocks the
//! endpoint has computed, kept in least-recently-used order and bounded by the
//! endpoint's KV blocks.
//!
//! A prompt hits its leading blocks the cache holds, up to the first miss
//! (a block's hash names its whole prefix, so a later block cannot be reused
//! without the earlier ones); a lookup makes the hit blocks the most recently
//! used. Blocks are inserted last block first, so a prefix's first blocks are
//! the most recent and evicted last, as vLLM frees a finished request's blocks
//! tail first.
//!
//! Publishing (off unless [`PrefixCache::publish`]), the cache emits the
//! KV-cache events a vLLM engine publishes for the same changes, as
//! [`crate::kv::Event`]s: `BlockStored` for the blocks an insertion newly
//! cached (in chain order, with the parent block's hash, their token ids and
//! the block size), `BlockRemoved` for the blocks it evicted, and
//! `AllBlocksCleared` for [`PrefixCache::clear`]. A hit changes nothing the
//! engine publishes. The block hashes are the cache's own (the engine's).

use std::collections::HashMap;

use crate::kv::index::MEDIUM_GPU;
use crate::kv::{Event, Stored};

/// Tokens per KV block (vLLM's default block size), the cache's unit (the
/// engine re-exports it: `sim::engine::BLOCK_TOKENS`).
pub const BLOCK_TOKENS: u64 = 16;

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

/// Block hashes in LRU order: a hash map into a slab of list nodes, the list's
/// head the most recently used. O(1) per lookup, insertion and eviction.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    capacity: usize,
    index: HashMap<u64, u32>,
    nodes: Vec<Node>,
    head: u32,
    tail: u32,
    /// Events not taken yet; None: the cache does not publish.
    events: Option<Vec<Event>>,
    /// Scratch of a publishing insertion: the hashes it evicted, and which
    /// of its blocks were not cached before it.
    evicted: Vec<u64>,
    fresh: Vec<bool>,
}

impl PrefixCache {
    /// A cache of at most `capacity` blocks (0: caches nothing).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            index: HashMap::new(),
            nodes: Vec::new(),
            head: NONE,
            tail: NONE,
            events: None,
            evicted: Vec::new(),
            fresh: Vec::new(),
        }
    }

    /// From now on the cache collects its KV-cache events (module docs).
    pub fn publish(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events collected since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.index.contains_key(&hash)
    }

    /// The hashes from the most to the least recently used.
    pub fn lru_order(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len());
        let mut at = self.head;
        while at != NONE {
            let n = self.nodes[at as usize];
            out.push(n.hash);
            at = n.next;
        }
        out
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NONE => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NONE => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, i: u32) {
        self.nodes[i as usize].prev = NONE;
        self.nodes[i as usize].next = self.head;
        match self.head {
            NONE => self.tail = i,
            h => self.nodes[h as usize].prev = i,
        }
        self.head = i;
    }

    /// Makes `hash` the most recently used, inserting it (and evicting the
    /// least recently used block when full).
    fn touch(&mut self, hash: u64) {
        if let Some(&i) = self.index.get(&hash) {
            self.unlink(i);
            self.push_front(i);
            return;
        }
        if self.capacity == 0 {
            return;
        }
        let i = if self.index.len() >= self.capacity {
            // Full: reuse the least recently used block's node.
            let t = self.tail;
            self.unlink(t);
            let old = self.nodes[t as usize].hash;
            self.index.remove(&old);
            if self.events.is_some() {
                self.evicted.push(old);
            }
            self.nodes[t as usize].hash = hash;
            t
        } else {
            self.nodes.push(Node {
                hash,
                prev: NONE,
                next: NONE,
            });
            (self.nodes.len() - 1) as u32
        };
        self.index.insert(hash, i);
        self.push_front(i);
    }

    /// The number of leading `hashes` the cache holds, up to the first miss;
    /// those become the most recently used (the first one most of all).
    pub fn lookup(&mut self, hashes: &[u64]) -> usize {
        let hit = hashes.iter().take_while(|h| self.contains(**h)).count();
        for &h in hashes[..hit].iter().rev() {
            self.touch(h);
        }
        hit
    }

    /// Caches `hashes` (one sequence's computed blocks, in order), last block
    /// first, evicting the least recently used blocks beyond the capacity.
    /// `tokens`: the blocks' token ids, `BLOCK_TOKENS` per hash, which the
    /// published `BlockStored` events carry (unused when not publishing).
    pub fn insert(&mut self, hashes: &[u64], tokens: &[u32]) {
        let publishing = self.events.is_some();
        let mut fresh = std::mem::take(&mut self.fresh);
        fresh.clear();
        if publishing {
            fresh.extend(hashes.iter().map(|&h| !self.contains(h)));
            self.evicted.clear();
        }
        for &h in hashes.iter().rev() {
            self.touch(h);
        }
        if publishing {
            let events = self.inserted(hashes, tokens, &fresh);
            self.events.get_or_insert_with(Vec::new).extend(events);
        }
        self.fresh = fresh;
    }

    /// The events of an insertion of `hashes` of which `fresh` were not
    /// cached before: the blocks held before and evicted, then each run of
    /// newly cached blocks (its parent is the block before it, held).
    fn inserted(&self, hashes: &[u64], tokens: &[u32], fresh: &[bool]) -> Vec<Event> {
        let mut out = Vec::new();
        // A new block evicted by its own insertion (a chain longer than the
        // capacity) was never published.
        let lost: Vec<u64> = hashes
            .iter()
            .zip(fresh)
            .filter(|&(h, &f)| f && !self.contains(*h))
            .map(|(h, _)| *h)
            .collect();
        let mut removed: Vec<u64> = self
            .evicted
            .iter()
            .copied()
            .filter(|h| !self.contains(*h) && !lost.contains(h))
            .collect();
        removed.sort_unstable();
        removed.dedup();
        if !removed.is_empty() {
            out.push(Event::Removed {
                hashes: removed,
                medium: Some(MEDIUM_GPU.to_owned()),
            });
        }
        let b = BLOCK_TOKENS as usize;
        let stored = |i: usize| fresh[i] && self.contains(hashes[i]);
        let mut i = 0;
        while i < hashes.len() {
            if !stored(i) {
                i += 1;
                continue;
            }
            let start = i;
            while i < hashes.len() && stored(i) {
                i += 1;
            }
            out.push(Event::Stored(Stored {
                hashes: hashes[start..i].to_vec(),
                parent: start.checked_sub(1).map(|p| hashes[p]),
                token_ids: tokens
                    .get(start * b..i * b)
                    .map(<[u32]>::to_vec)
                    .unwrap_or_default(),
                block_size: b,
                lora: None,
                medium: Some(MEDIUM_GPU.to_owned()),
            }));
        }
        out
    }

    /// Drops every block (vLLM's prefix-cache reset), publishing
    /// `AllBlocksCleared`. The simulated engines never reset their caches:
    /// only the tests do, to check that a `KvIndex` fed by these events
    /// forgets everything.
    #[cfg(test)]
    pub fn clear(&mut self) {
        self.index.clear();
        self.nodes.clear();
        self.head = NONE;
        self.tail = NONE;
        if let Some(events) = &mut self.events {
            events.push(Event::Cleared);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvConfig, KvIndex};
    use crate::prefix::{block_hashes, Tokens};
    use crate::rng::Rng;

    const B: usize = BLOCK_TOKENS as usize;

    /// An index fed by one endpoint `e`'s events, hashing with a seed of its
    /// own (not the cache's 0), as large as the cache.
    fn index(capacity: usize) -> KvIndex {
        let kv = KvIndex::new(KvConfig {
            block_size: B,
            seed: 99,
            capacity_blocks: capacity,
            stale_after_s: None,
        })
        .expect("kv");
        kv.add_endpoint("e");
        kv.set_connected("e", true).expect("e");
        kv
    }

    /// Applies the cache's new events as batch `seq`, as the simulator does.
    fn feed(kv: &KvIndex, cache: &mut PrefixCache, seq: &mut u64) {
        let events: Vec<_> = cache.take_events().into_iter().map(Ok).collect();
        kv.observe("e", *seq).expect("seq");
        let applied = kv.apply("e", *seq, &events, 0.0).expect("apply");
        assert_eq!(applied.skipped, vec![], "every event applies");
        *seq += 1;
    }

    /// A publishing cache and the chained hashes (seed 0) of `tokens`.
    fn chain(tokens: &[u32]) -> Vec<u64> {
        block_hashes(Tokens::Ids(tokens), B, 0).expect("hashes")
    }

    /// Texts sharing prefixes: one of three roots, then random blocks.
    fn text(rng: &mut Rng, max_blocks: u64) -> Vec<u32> {
        let root = rng.below(3) as u32;
        let blocks = 1 + rng.below(max_blocks) as usize;
        (0..blocks * B)
            .map(|i| {
                if i < 2 * B {
                    root * 1000 + i as u32
                } else {
                    rng.below(3) as u32
                }
            })
            .collect()
    }

    /// Property: whatever the insertions, hits and clears, an index fed the
    /// published events holds what the cache holds: the same block count and,
    /// for any prompt, as many leading blocks as the cache's lookup finds.
    #[test]
    fn the_published_events_keep_an_index_equal_to_the_cache() {
        for seed in 0..40 {
            let mut rng = Rng::new(seed);
            let capacity = 4 + rng.below(24) as usize;
            let mut cache = PrefixCache::new(capacity);
            cache.publish();
            let kv = index(capacity);
            let mut seq = 0;
            for _ in 0..120 {
                let tokens = text(&mut rng, 12);
                let hashes = chain(&tokens);
                match rng.below(20) {
                    0 => cache.clear(),
                    1..=6 => {
                        cache.lookup(&hashes);
                    }
                    _ => cache.insert(&hashes, &tokens),
                }
                feed(&kv, &mut cache, &mut seq);
                assert_eq!(kv.stats("e").expect("e").blocks as usize, cache.len());
                let probe = text(&mut rng, 12);
                let expected = cache.clone().lookup(&chain(&probe));
                let held = kv.leading_blocks("e", &kv.request_hashes(&probe, None));
                assert_eq!(held, Some(expected), "seed {seed}");
            }
        }
    }

    #[test]
    fn an_insertion_publishes_its_new_blocks_in_chain_order_with_their_parent() {
        let tokens: Vec<u32> = (0..4 * B as u32).collect();
        let h = chain(&tokens);
        let mut c = PrefixCache::new(8);
        c.publish();
        c.insert(&h[..2], &tokens[..2 * B]);
        c.insert(&h, &tokens);
        c.lookup(&h);
        let stored = |from: usize, to: usize, parent: Option<u64>| {
            Event::Stored(Stored {
                hashes: h[from..to].to_vec(),
                parent,
                token_ids: tokens[from * B..to * B].to_vec(),
                block_size: B,
                lora: None,
                medium: Some(MEDIUM_GPU.to_owned()),
            })
        };
        // The second insertion stores only blocks 2 and 3, after block 1; a
        // hit publishes nothing.
        assert_eq!(
            c.take_events(),
            vec![stored(0, 2, None), stored(2, 4, Some(h[1]))]
        );
        assert_eq!(c.take_events(), vec![]);
    }

    #[test]
    fn an_eviction_publishes_block_removed_and_the_index_forgets() {
        let a: Vec<u32> = (0..2 * B as u32).collect();
        let b: Vec<u32> = (100..100 + 2 * B as u32).collect();
        let (ha, hb) = (chain(&a), chain(&b));
        let mut c = PrefixCache::new(3);
        c.publish();
        let kv = index(3);
        let mut seq = 0;
        c.insert(&ha, &a);
        feed(&kv, &mut c, &mut seq);
        assert_eq!(
            kv.leading_blocks("e", &kv.request_hashes(&a, None)),
            Some(2)
        );
        // Two blocks of b evict a's least recently used one, its second.
        c.insert(&hb, &b);
        let events = c.take_events();
        assert_eq!(
            events[0],
            Event::Removed {
                hashes: vec![ha[1]],
                medium: Some(MEDIUM_GPU.to_owned())
            }
        );
        kv.observe("e", seq).expect("seq");
        let batch: Vec<_> = events.into_iter().map(Ok).collect();
        kv.apply("e", seq, &batch, 0.0).expect("apply");
        assert_eq!(
            kv.leading_blocks("e", &kv.request_hashes(&a, None)),
            Some(1)
        );
        assert_eq!(
            kv.leading_blocks("e", &kv.request_hashes(&b, None)),
            Some(2)
        );
        // A reset publishes AllBlocksCleared: the index forgets everything.
        c.clear();
        assert!(c.is_empty());
        feed(&kv, &mut c, &mut seq);
        assert_eq!(
            kv.leading_blocks("e", &kv.request_hashes(&b, None)),
            Some(0)
        );
        assert_eq!(kv.stats("e").expect("e").clears, 1);
    }

    #[test]
    fn a_cache_that_does_not_publish_collects_no_events() {
        let mut c = PrefixCache::new(2);
        c.insert(&[1, 2, 3], &[]);
        c.clear();
        assert_eq!(c.take_events(), vec![]);
    }

    #[test]
    fn lookup_stops_at_the_first_miss() {
        let mut c = PrefixCache::new(8);
        c.insert(&[1, 2, 3], &[]);
        assert_eq!(c.lookup(&[1, 2, 3, 4]), 3);
        assert_eq!(c.lookup(&[1, 9, 3]), 1);
        assert_eq!(c.lookup(&[9, 1]), 0);
        assert_eq!(c.lookup(&[]), 0);
    }

    #[test]
    fn insertion_keeps_the_prefix_root_most_recent() {
        let mut c = PrefixCache::new(8);
        c.insert(&[1, 2, 3], &[]);
        assert_eq!(c.lru_order(), vec![1, 2, 3]);
        c.insert(&[7, 8], &[]);
        assert_eq!(c.lru_order(), vec![7, 8, 1, 2, 3]);
        // A hit moves the hit blocks to the front, root first.
        assert_eq!(c.lookup(&[1, 2, 5]), 2);
        assert_eq!(c.lru_order(), vec![1, 2, 7, 8, 3]);
    }

    #[test]
    fn eviction_is_least_recently_used_first() {
        let mut c = PrefixCache::new(4);
        c.insert(&[1, 2], &[]);
        c.insert(&[3, 4], &[]);
        assert_eq!(c.lru_order(), vec![3, 4, 1, 2]);
        // Two more blocks evict 2, then 1 (the least recently used).
        c.insert(&[5, 6], &[]);
        assert_eq!(c.lru_order(), vec![5, 6, 3, 4]);
        assert!(!c.contains(1) && !c.contains(2));
        // The hit makes 3 and 4 the most recent: the next insertion evicts 6.
        assert_eq!(c.lookup(&[3, 4]), 2);
        c.insert(&[9], &[]);
        assert_eq!(c.lru_order(), vec![9, 3, 4, 5]);
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut c = PrefixCache::new(0);
        c.insert(&[1, 2], &[]);
        assert!(c.is_empty());
        assert_eq!(c.lookup(&[1]), 0);
    }
}
