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

use std::collections::HashMap;

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
        }
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
            self.index.remove(&self.nodes[t as usize].hash);
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
    pub fn insert(&mut self, hashes: &[u64]) {
        for &h in hashes.iter().rev() {
            self.touch(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_stops_at_the_first_miss() {
        let mut c = PrefixCache::new(8);
        c.insert(&[1, 2, 3]);
        assert_eq!(c.lookup(&[1, 2, 3, 4]), 3);
        assert_eq!(c.lookup(&[1, 9, 3]), 1);
        assert_eq!(c.lookup(&[9, 1]), 0);
        assert_eq!(c.lookup(&[]), 0);
    }

    #[test]
    fn insertion_keeps_the_prefix_root_most_recent() {
        let mut c = PrefixCache::new(8);
        c.insert(&[1, 2, 3]);
        assert_eq!(c.lru_order(), vec![1, 2, 3]);
        c.insert(&[7, 8]);
        assert_eq!(c.lru_order(), vec![7, 8, 1, 2, 3]);
        // A hit moves the hit blocks to the front, root first.
        assert_eq!(c.lookup(&[1, 2, 5]), 2);
        assert_eq!(c.lru_order(), vec![1, 2, 7, 8, 3]);
    }

    #[test]
    fn eviction_is_least_recently_used_first() {
        let mut c = PrefixCache::new(4);
        c.insert(&[1, 2]);
        c.insert(&[3, 4]);
        assert_eq!(c.lru_order(), vec![3, 4, 1, 2]);
        // Two more blocks evict 2, then 1 (the least recently used).
        c.insert(&[5, 6]);
        assert_eq!(c.lru_order(), vec![5, 6, 3, 4]);
        assert!(!c.contains(1) && !c.contains(2));
        // The hit makes 3 and 4 the most recent: the next insertion evicts 6.
        assert_eq!(c.lookup(&[3, 4]), 2);
        c.insert(&[9]);
        assert_eq!(c.lru_order(), vec![9, 3, 4, 5]);
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut c = PrefixCache::new(0);
        c.insert(&[1, 2]);
        assert!(c.is_empty());
        assert_eq!(c.lookup(&[1]), 0);
    }
}
