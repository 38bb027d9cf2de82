//! Prefix-cache-aware routing (AIBrix gateway routing algorithms, "Prefix
//! Cache Aware"): chained block hashes and a bounded prefix index (the router
//! that uses them is `crate::pick::PrefixCacheRouter`).
//!
//! # Block hashes
//!
//! A prompt is a sequence of tokens: `u32` token ids, or bytes (AIBrix's
//! "character" tokenizer). It is cut into blocks of `block_size` tokens; only
//! full blocks are hashed, a partial tail block is ignored. With `le8(x)` the
//! 8 little-endian bytes of a `u64`, token ids written as 4 little-endian
//! bytes each, and xxh3-64 with the given `seed` throughout:
//!
//! ```text
//! h_0 = xxh3_64(le8(seed)    ++ block_0, seed)
//! h_i = xxh3_64(le8(h_{i-1}) ++ block_i, seed)      for i >= 1
//! ```
//!
//! so `h_i` names the whole prefix up to and including block `i`: equal
//! prefixes give equal leading hashes and a changed token changes every later
//! hash. Any language with xxh3 reproduces them (the tests do, in Python).
//!
//! # Prefix index
//!
//! `PrefixIndex` maps a block hash to the endpoints that hold the block. It keeps at
//! most `capacity` hashes and evicts the least recently used; with a TTL a hash
//! not recorded for longer than the TTL is dropped. Memory is bounded by
//! `capacity * (entry + 4 bytes per endpoint holding it)` whatever the input.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::endpoint::{check_endpoint_name, MAX_ENDPOINTS};
use crate::error::{finite, invalid, non_negative, unknown, Error, Result};
use crate::snapshot::{restore, Reader, Writer};

mod chain;
pub use chain::{BlockStep, IdChain};

/// Largest block size, in tokens.
pub const MAX_BLOCK_SIZE: usize = 1 << 16;
/// AIBrix's default index size (AIBRIX_PREFIX_CACHE_BLOCK_NUMBER).
pub const DEFAULT_CAPACITY_BLOCKS: usize = 200_000;
/// Largest index capacity, in blocks.
pub const MAX_CAPACITY_BLOCKS: usize = 1 << 26;

/// A prompt's tokens: token ids, or the bytes of the character tokenizer.
#[derive(Debug, Clone, Copy)]
pub enum Tokens<'a> {
    Ids(&'a [u32]),
    Bytes(&'a [u8]),
}

impl<'a> Tokens<'a> {
    pub fn len(&self) -> usize {
        match self {
            Tokens::Ids(t) => t.len(),
            Tokens::Bytes(b) => b.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn slice(&self, start: usize, end: usize) -> Tokens<'a> {
        match self {
            Tokens::Ids(t) => Tokens::Ids(&t[start..end]),
            Tokens::Bytes(b) => Tokens::Bytes(&b[start..end]),
        }
    }
}

fn check_block_size(block_size: usize) -> Result<usize> {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE {
        return Err(invalid(format!(
            "block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}"
        )));
    }
    Ok(block_size)
}

/// Appends the chained hashes of a prompt's full blocks to `out`.
fn extend_hashes(tokens: Tokens<'_>, block_size: usize, seed: u64, out: &mut Vec<u64>) {
    match tokens {
        Tokens::Ids(ids) => out.extend(IdChain::new(ids, block_size, seed, seed)),
        Tokens::Bytes(bytes) => chain(bytes.chunks_exact(block_size), block_size, seed, out),
    }
}

/// The hash chain over byte `blocks` of `block_bytes` bytes each.
fn chain<'a>(
    blocks: impl Iterator<Item = &'a [u8]>,
    block_bytes: usize,
    seed: u64,
    out: &mut Vec<u64>,
) {
    let mut prev = seed;
    // Two buffers: block i + 1 is copied in while block i is hashed, as
    // only the first 8 bytes wait for the previous hash.
    let mut bufs = [vec![0u8; 8 + block_bytes], vec![0u8; 8 + block_bytes]];
    let mut blocks = blocks.peekable();
    if let Some(first) = blocks.peek() {
        bufs[0][8..].copy_from_slice(first);
    }
    let mut cur = 0;
    while blocks.next().is_some() {
        let [a, b] = &mut bufs;
        let (this, next) = if cur == 0 { (a, b) } else { (b, a) };
        if let Some(block) = blocks.peek() {
            next[8..].copy_from_slice(block);
        }
        this[..8].copy_from_slice(&prev.to_le_bytes());
        prev = xxh3_64_with_seed(this, seed);
        out.push(prev);
        cur ^= 1;
    }
}

/// The chained block hashes of one prompt (see the module docs).
pub fn block_hashes(tokens: Tokens<'_>, block_size: usize, seed: u64) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    block_hashes_into(tokens, block_size, seed, &mut out)?;
    Ok(out)
}

/// `block_hashes` into `out` (cleared first; its buffer is reused).
pub fn block_hashes_into(
    tokens: Tokens<'_>,
    block_size: usize,
    seed: u64,
    out: &mut Vec<u64>,
) -> Result<()> {
    let block_size = check_block_size(block_size)?;
    out.clear();
    out.reserve(tokens.len() / block_size);
    extend_hashes(tokens, block_size, seed, out);
    Ok(())
}

/// Checks ragged-batch offsets: `offsets[0] == 0`, non-decreasing, last equal
/// to `len`. Returns them as `usize`.
pub(crate) fn check_offsets(offsets: &[i64], len: usize) -> Result<Vec<usize>> {
    if offsets.first() != Some(&0) || offsets.last() != Some(&(len as i64)) {
        return Err(invalid(format!(
            "offsets must start at 0 and end at the token count {len}"
        )));
    }
    if offsets.windows(2).any(|w| w[1] < w[0]) {
        return Err(invalid("offsets must be non-decreasing"));
    }
    Ok(offsets.iter().map(|&o| o as usize).collect())
}

/// Block hashes of many prompts in one flat token array: prompt `i` is
/// `tokens[offsets[i]..offsets[i + 1]]`. Returns the flat hashes and their
/// offsets (prompt `i`'s hashes are `hashes[out[i]..out[i + 1]]`).
pub fn block_hashes_many(
    tokens: Tokens<'_>,
    offsets: &[i64],
    block_size: usize,
    seed: u64,
) -> Result<(Vec<u64>, Vec<i64>)> {
    let block_size = check_block_size(block_size)?;
    let offsets = check_offsets(offsets, tokens.len())?;
    let mut hashes = Vec::with_capacity(tokens.len() / block_size);
    let mut out = Vec::with_capacity(offsets.len());
    out.push(0);
    for w in offsets.windows(2) {
        extend_hashes(tokens.slice(w[0], w[1]), block_size, seed, &mut hashes);
        out.push(hashes.len() as i64);
    }
    Ok((hashes, out))
}

/// Block hashes are xxh3 outputs, already uniform: the index (and the KV
/// index's) use them as their own hash-table hash.
#[derive(Default)]
pub(crate) struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

const NIL: u32 = u32::MAX;
/// Marks an index endpoint that has no slot in a router.
pub(crate) const NO_SLOT: usize = usize::MAX;

/// A set of endpoint ids as a bitset: ids below 64 in `low` (no allocation
/// for the common fleet), id `64 * (w + 1) + b` as bit `b` of `high[w]`
/// (`high` has no trailing zero word).
#[derive(Debug, Clone, Default, PartialEq)]
struct EndpointBits {
    low: u64,
    high: Vec<u64>,
}

impl EndpointBits {
    /// Word `w` of the set (0 is `low`), 0 past the end.
    fn word(&self, w: usize) -> u64 {
        match w {
            0 => self.low,
            _ => self.high.get(w - 1).copied().unwrap_or(0),
        }
    }
    /// How many words may be non-zero.
    fn words(&self) -> usize {
        1 + self.high.len()
    }
    fn word_mut(&mut self, w: usize) -> &mut u64 {
        if w == 0 {
            return &mut self.low;
        }
        if self.high.len() < w {
            self.high.resize(w, 0);
        }
        &mut self.high[w - 1]
    }
    fn holds(&self, id: u32) -> bool {
        self.word(id as usize / 64) >> (id % 64) & 1 == 1
    }
    /// Adds `id`; false if it was there already.
    fn add(&mut self, id: u32) -> bool {
        if id < 64 {
            let new = self.low >> id & 1 == 0;
            self.low |= 1 << id;
            return new;
        }
        let new = !self.holds(id);
        *self.word_mut(id as usize / 64) |= 1 << (id % 64);
        new
    }
    /// Removes `id`; false if it was not there.
    fn remove(&mut self, id: u32) -> bool {
        let held = self.holds(id);
        if held {
            *self.word_mut(id as usize / 64) &= !(1 << (id % 64));
            while self.high.last() == Some(&0) {
                self.high.pop();
            }
        }
        held
    }
    fn is_empty(&self) -> bool {
        self.low == 0 && self.high.is_empty()
    }
    /// The ids, ascending.
    fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.words()).flat_map(move |w| {
            let mut bits = self.word(w);
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let b = bits.trailing_zeros();
                    bits &= bits - 1;
                    64 * w as u32 + b
                })
            })
        })
    }
}

#[derive(Debug, Clone)]
struct Entry {
    hash: u64,
    last: f64,
    prev: u32,
    next: u32,
    endpoints: EndpointBits,
}

/// Block hash -> the endpoints holding it, LRU-bounded, with an optional idle TTL.
///
/// Time is passed in by the caller (seconds, any epoch). Endpoints are interned to
/// dense ids; a removed endpoint's id is reused, and so, when all `MAX_ENDPOINTS` ids
/// are taken, are the ids of endpoints that hold no block any more (evicted or
/// expired), so any number of distinct endpoints can pass through the index.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    capacity: usize,
    ttl: Option<f64>,
    map: HashMap<u64, u32, BuildHasherDefault<BlockHasher>>,
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Most recently used entry.
    head: u32,
    /// Least recently used entry.
    tail: u32,
    endpoint_names: Vec<Option<String>>,
    endpoint_ids: HashMap<String, u32>,
    free_endpoints: Vec<u32>,
    /// Per endpoint id, how many entries hold it.
    endpoint_blocks: Vec<u32>,
    /// Bumped whenever an endpoint id changes hands (interned, reclaimed,
    /// removed): a router's cached ids stay valid while it is unchanged.
    names_gen: u64,
    /// Bumped whenever an entry slot is freed or filled: slots found by a
    /// match stay valid while it is unchanged.
    slots_gen: u64,
}

const INDEX_MAGIC: &[u8; 4] = b"RCPX";
const SNAPSHOT_VERSION: u16 = 1;

impl PrefixIndex {
    pub fn new(capacity: usize, ttl: Option<f64>) -> Result<Self> {
        if capacity == 0 || capacity > MAX_CAPACITY_BLOCKS {
            return Err(invalid(format!(
                "capacity_blocks must be in [1, {MAX_CAPACITY_BLOCKS}], got {capacity}"
            )));
        }
        if let Some(t) = ttl {
            if non_negative("ttl_s", t)? == 0.0 {
                return Err(invalid("ttl_s must be > 0 (or None for no TTL)"));
            }
        }
        Ok(Self {
            capacity,
            ttl,
            map: HashMap::default(),
            entries: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            endpoint_names: Vec::new(),
            endpoint_ids: HashMap::new(),
            free_endpoints: Vec::new(),
            endpoint_blocks: Vec::new(),
            names_gen: 0,
            slots_gen: 0,
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn ttl(&self) -> Option<f64> {
        self.ttl
    }
    /// Number of block hashes held.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// Names of the endpoints that hold at least one block or were recorded (a
    /// endpoint holding no block is forgotten when its id is needed: see above).
    pub fn endpoints(&self) -> Vec<String> {
        self.endpoint_names.iter().flatten().cloned().collect()
    }

    pub(crate) fn endpoint_id(&self, name: &str) -> Option<u32> {
        self.endpoint_ids.get(name).copied()
    }

    /// Ids not taken: free ones and those never handed out.
    fn spare_ids(&self) -> usize {
        self.free_endpoints.len() + MAX_ENDPOINTS - self.endpoint_names.len()
    }

    /// The ids of named endpoints that hold no block, except those in `keep`.
    fn idle_ids(&self, keep: &[u32]) -> Vec<u32> {
        (0..self.endpoint_names.len() as u32)
            .filter(|&id| {
                self.endpoint_names[id as usize].is_some()
                    && self.endpoint_blocks[id as usize] == 0
                    && !keep.contains(&id)
            })
            .collect()
    }

    /// Forgets the (blockless) endpoints of `ids`, freeing their ids.
    fn reclaim(&mut self, ids: Vec<u32>) {
        self.names_gen += 1;
        for id in ids {
            if let Some(name) = self.endpoint_names[id as usize].take() {
                self.endpoint_ids.remove(&name);
            }
            self.free_endpoints.push(id);
        }
    }

    fn intern(&mut self, name: &str) -> Result<u32> {
        if let Some(id) = self.endpoint_id(name) {
            return Ok(id);
        }
        check_endpoint_name(name)?;
        if self.spare_ids() == 0 {
            self.reclaim(self.idle_ids(&[]));
        }
        let id = match self.free_endpoints.pop() {
            Some(id) => {
                self.endpoint_names[id as usize] = Some(name.to_owned());
                id
            }
            None => {
                if self.endpoint_names.len() >= MAX_ENDPOINTS {
                    return Err(invalid(format!(
                        "a prefix index holds at most {MAX_ENDPOINTS} endpoints"
                    )));
                }
                self.endpoint_names.push(Some(name.to_owned()));
                self.endpoint_blocks.push(0);
                (self.endpoint_names.len() - 1) as u32
            }
        };
        self.endpoint_ids.insert(name.to_owned(), id);
        self.names_gen += 1;
        Ok(id)
    }

    /// The ids of `names`, interning the new ones (reclaiming the ids of
    /// other endpoints that hold no block if need be); refused, changing nothing,
    /// when that would pass `MAX_ENDPOINTS`.
    pub(crate) fn ids_for(&mut self, names: &[String]) -> Result<Vec<u32>> {
        let known: Vec<Option<u32>> = names.iter().map(|n| self.endpoint_id(n)).collect();
        let new = known.iter().filter(|id| id.is_none()).count();
        if new > self.spare_ids() {
            let keep: Vec<u32> = known.iter().flatten().copied().collect();
            let idle = self.idle_ids(&keep);
            if new > self.spare_ids() + idle.len() {
                return Err(invalid(format!(
                    "a prefix index holds at most {MAX_ENDPOINTS} endpoints"
                )));
            }
            self.reclaim(idle);
        }
        names
            .iter()
            .zip(known)
            .map(|(name, id)| id.map_or_else(|| self.intern(name), Ok))
            .collect()
    }

    fn unlink(&mut self, slot: u32) {
        let (prev, next) = {
            let e = &self.entries[slot as usize];
            (e.prev, e.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.entries[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.entries[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, slot: u32) {
        self.place_after(NIL, slot, false);
    }

    /// Puts `slot` right after `cursor` in recency order (at the front when
    /// `cursor` is NIL); `linked` says whether it is in the list now. A slot
    /// already in that place is left alone, so touching a prompt that is
    /// already the most recent costs one comparison per block.
    fn place_after(&mut self, cursor: u32, slot: u32, linked: bool) {
        let next_of = |ix: &Self| match cursor {
            NIL => ix.head,
            c => ix.entries[c as usize].next,
        };
        if slot == cursor || (linked && next_of(self) == slot) {
            return;
        }
        if linked {
            self.unlink(slot);
        }
        let next = next_of(self);
        {
            let e = &mut self.entries[slot as usize];
            e.prev = cursor;
            e.next = next;
        }
        match cursor {
            NIL => self.head = slot,
            c => self.entries[c as usize].next = slot,
        }
        match next {
            NIL => self.tail = slot,
            n => self.entries[n as usize].prev = slot,
        }
    }

    fn drop_entry(&mut self, slot: u32) {
        self.slots_gen += 1;
        self.unlink(slot);
        let e = &mut self.entries[slot as usize];
        self.map.remove(&e.hash);
        for id in std::mem::take(&mut e.endpoints).ids() {
            self.endpoint_blocks[id as usize] -= 1;
        }
        self.free.push(slot);
    }

    fn expired(&self, slot: u32, now: f64) -> bool {
        self.ttl
            .is_some_and(|ttl| now - self.entries[slot as usize].last > ttl)
    }

    /// Drops hashes idle longer than the TTL, from the least recent end, and
    /// returns how many. With time passed in order this is every idle hash.
    pub fn expire(&mut self, now: f64) -> Result<usize> {
        let now = finite("now", now)?;
        let mut n = 0;
        while self.tail != NIL && self.expired(self.tail, now) {
            self.drop_entry(self.tail);
            n += 1;
        }
        Ok(n)
    }

    /// The live entry for `hash`: an entry idle past the TTL is dropped.
    fn lookup(&mut self, hash: u64, now: f64) -> Option<u32> {
        let slot = *self.map.get(&hash)?;
        if self.expired(slot, now) {
            self.drop_entry(slot);
            return None;
        }
        Some(slot)
    }

    /// Matches `hashes` from the first block on: `matched[slot_of[p]]` becomes
    /// the number of leading blocks index endpoint `p` holds, for every endpoint mapped
    /// to a slot. Walks the blocks while some mapped endpoint still matches, and
    /// leaves the slots it walked in `found`.
    pub(crate) fn match_into(
        &mut self,
        hashes: &[u64],
        now: f64,
        slot_of: &[usize],
        matched: &mut [usize],
        found: &mut Vec<u32>,
    ) {
        found.clear();
        let mut alive = EndpointBits::default();
        for (id, _) in slot_of.iter().enumerate().filter(|(_, &s)| s != NO_SLOT) {
            alive.add(id as u32);
        }
        // Marks the ids of `bits` as matching `i` blocks.
        let mut settle = |w: usize, mut bits: u64, i: usize| {
            while bits != 0 {
                matched[slot_of[64 * w + bits.trailing_zeros() as usize]] = i;
                bits &= bits - 1;
            }
        };
        let mut i = 0;
        while i < hashes.len() && !alive.is_empty() {
            // A prompt's blocks are recorded in prompt order, one after the
            // other in recency order: the next block is most often the next
            // entry, found without a hash-table lookup.
            let next = found.last().map_or(NIL, |&p| self.entries[p as usize].next);
            let hit = next != NIL
                && self.entries[next as usize].hash == hashes[i]
                && !self.expired(next, now);
            let slot = match hit {
                true => next,
                false => match self.lookup(hashes[i], now) {
                    Some(slot) => slot,
                    None => break,
                },
            };
            found.push(slot);
            let bits = &self.entries[slot as usize].endpoints;
            if alive.high.is_empty() {
                let kept = alive.low & bits.low;
                settle(0, alive.low & !kept, i);
                alive.low = kept;
            } else {
                for w in 0..alive.words() {
                    let a = alive.word(w);
                    let kept = a & bits.word(w);
                    settle(w, a & !kept, i);
                    *alive.word_mut(w) = kept;
                }
                while alive.high.last() == Some(&0) {
                    alive.high.pop();
                }
            }
            i += 1;
        }
        for w in 0..alive.words() {
            settle(w, alive.word(w), i);
        }
    }

    /// Per endpoint, how many leading blocks of `hashes` it holds (endpoints with none
    /// are left out), in endpoint-id order.
    pub fn match_prefix(&mut self, hashes: &[u64], now: f64) -> Result<Vec<(String, usize)>> {
        let now = finite("now", now)?;
        let slot_of: Vec<usize> = (0..self.endpoint_names.len()).collect();
        let mut matched = vec![0; slot_of.len()];
        self.match_into(hashes, now, &slot_of, &mut matched, &mut Vec::new());
        Ok(self
            .endpoint_names
            .iter()
            .zip(matched)
            .filter_map(|(name, m)| match name {
                Some(n) if m > 0 => Some((n.clone(), m)),
                _ => None,
            })
            .collect())
    }

    /// Records that endpoint `id` holds every block of `hashes`, which become the
    /// most recent in prompt order: the first block (the most shared) is the
    /// most recent and the last to be evicted. Only the first `capacity`
    /// blocks are recorded (the later ones would evict each other). `found`
    /// holds the live slots of the leading blocks as `match_into` walked them
    /// when the slots were at generation `found_gen`: while no slot changed
    /// since, those need no second hash lookup. The blocks `id` did not hold
    /// before are appended to `added` when given.
    pub(crate) fn record_id(
        &mut self,
        hashes: &[u64],
        found: &[u32],
        found_gen: u64,
        id: u32,
        now: f64,
        mut added: Option<&mut Vec<u64>>,
    ) {
        while self.tail != NIL && self.expired(self.tail, now) {
            self.drop_entry(self.tail);
        }
        let hashes = &hashes[..hashes.len().min(self.capacity)];
        let found = match self.slots_gen == found_gen {
            true => &found[..found.len().min(hashes.len())],
            false => &[],
        };
        // The blocks placed so far form the front of the list; an insertion
        // at capacity evicts the tail, which is never one of them, as fewer
        // than `hashes.len() <= capacity` are placed (and the found slots
        // are all placed before the first insertion).
        let mut cursor = NIL;
        for (j, &h) in hashes.iter().enumerate() {
            let (slot, linked) = match found.get(j) {
                Some(&slot) if self.entries[slot as usize].hash == h => (slot, true),
                _ => match self.lookup(h, now) {
                    Some(slot) => (slot, true),
                    None => (self.insert(h, now), false),
                },
            };
            self.place_after(cursor, slot, linked);
            let e = &mut self.entries[slot as usize];
            e.last = now;
            if e.endpoints.add(id) {
                self.endpoint_blocks[id as usize] += 1;
                if let Some(a) = added.as_deref_mut() {
                    a.push(h);
                }
            }
            cursor = slot;
        }
    }

    /// The generation of the entry slots (see `record_id`).
    pub(crate) fn slots_gen(&self) -> u64 {
        self.slots_gen
    }

    /// The generation of the endpoint ids (see `PrefixScorer`).
    pub(crate) fn names_gen(&self) -> u64 {
        self.names_gen
    }

    /// How many endpoint ids are handed out (the length of a `slot_of` map).
    pub(crate) fn id_count(&self) -> usize {
        self.endpoint_names.len()
    }

    /// A new, unlinked entry for `hash`, evicting the least recent at capacity.
    fn insert(&mut self, hash: u64, now: f64) -> u32 {
        self.slots_gen += 1;
        if self.map.len() >= self.capacity {
            self.drop_entry(self.tail);
        }
        let entry = Entry {
            hash,
            last: now,
            prev: NIL,
            next: NIL,
            endpoints: EndpointBits::default(),
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.entries[s as usize] = entry;
                s
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        self.map.insert(hash, slot);
        slot
    }

    /// Records that `endpoint` holds every block of `hashes` at time `now`.
    pub fn record(&mut self, hashes: &[u64], endpoint: &str, now: f64) -> Result<()> {
        let now = finite("now", now)?;
        let id = self.intern(endpoint)?;
        self.record_id(hashes, &[], 0, id, now, None);
        Ok(())
    }

    /// Forgets that `endpoint` holds the blocks of `hashes` (a block no endpoint
    /// holds any more is dropped); an unknown endpoint or hash is a no-op.
    /// Returns how many of them it held.
    pub fn forget(&mut self, hashes: &[u64], endpoint: &str) -> usize {
        let Some(id) = self.endpoint_id(endpoint) else {
            return 0;
        };
        let mut held = 0;
        for h in hashes {
            let Some(&slot) = self.map.get(h) else {
                continue;
            };
            let e = &mut self.entries[slot as usize];
            if e.endpoints.remove(id) {
                held += 1;
                self.endpoint_blocks[id as usize] -= 1;
                if e.endpoints.is_empty() {
                    self.drop_entry(slot);
                }
            }
        }
        held
    }

    /// Forgets `endpoint`: removes it from every block (a block no endpoint holds any
    /// more is dropped). Returns how many blocks it held.
    pub fn remove_endpoint(&mut self, endpoint: &str) -> Result<usize> {
        let id = self
            .endpoint_id(endpoint)
            .ok_or_else(|| unknown("endpoint", endpoint))?;
        let mut held = 0;
        let mut slot = self.head;
        while slot != NIL {
            let e = &mut self.entries[slot as usize];
            let next = e.next;
            if e.endpoints.remove(id) {
                held += 1;
                if e.endpoints.is_empty() {
                    self.drop_entry(slot);
                }
            }
            slot = next;
        }
        self.endpoint_blocks[id as usize] = 0;
        self.endpoint_names[id as usize] = None;
        self.endpoint_ids.remove(endpoint);
        self.free_endpoints.push(id);
        self.names_gen += 1;
        Ok(held)
    }

    pub(crate) fn write(&self, w: &mut Writer) {
        w.u64(self.capacity as u64);
        match self.ttl {
            Some(t) => w.u8(1).f64(t),
            None => w.u8(0).f64(0.0),
        };
        w.u64(self.endpoint_names.len() as u64);
        for name in &self.endpoint_names {
            match name {
                Some(n) => w.u8(1).str(n),
                None => w.u8(0),
            };
        }
        w.u64(self.map.len() as u64);
        let mut slot = self.tail;
        while slot != NIL {
            let e = &self.entries[slot as usize];
            w.u64(e.hash)
                .f64(e.last)
                .u64(e.endpoints.ids().count() as u64);
            for p in e.endpoints.ids() {
                w.u32(p);
            }
            slot = e.prev;
        }
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self> {
        let capacity = r.u64()? as usize;
        let ttl = match (r.u8()?, r.f64()?) {
            (0, _) => None,
            (1, t) => Some(t),
            (flag, _) => return Err(Error::Snapshot(format!("bad ttl flag {flag}"))),
        };
        let mut index = Self::new(capacity, ttl)?;
        let n_endpoints = r.count(1)?;
        if n_endpoints > MAX_ENDPOINTS {
            return Err(Error::Snapshot(format!("{n_endpoints} endpoints")));
        }
        let mut live = Vec::with_capacity(n_endpoints);
        for id in 0..n_endpoints {
            match r.u8()? {
                0 => {
                    index.endpoint_names.push(None);
                    live.push(false);
                }
                1 => {
                    let name = r.str()?;
                    check_endpoint_name(&name)?;
                    if index.endpoint_ids.insert(name.clone(), id as u32).is_some() {
                        return Err(Error::Snapshot(format!("endpoint {name:?} twice")));
                    }
                    index.endpoint_names.push(Some(name));
                    live.push(true);
                }
                flag => return Err(Error::Snapshot(format!("bad endpoint flag {flag}"))),
            }
        }
        index.free_endpoints = (0..n_endpoints as u32)
            .rev()
            .filter(|&i| !live[i as usize])
            .collect();
        index.endpoint_blocks = vec![0; n_endpoints];
        let n = r.count(24)?;
        if n > capacity {
            return Err(Error::Snapshot(format!(
                "{n} blocks exceed capacity {capacity}"
            )));
        }
        for _ in 0..n {
            let hash = r.u64()?;
            let last = finite("block time", r.f64()?)?;
            let k = r.count(4)?;
            let mut endpoints = EndpointBits::default();
            for _ in 0..k {
                let p = r.u32()?;
                if !live.get(p as usize).copied().unwrap_or(false) || !endpoints.add(p) {
                    return Err(Error::Snapshot(format!("bad endpoint id {p} in a block")));
                }
                index.endpoint_blocks[p as usize] += 1;
            }
            if endpoints.is_empty() || index.map.contains_key(&hash) {
                return Err(Error::Snapshot("empty or repeated block".into()));
            }
            index.entries.push(Entry {
                hash,
                last,
                prev: NIL,
                next: NIL,
                endpoints,
            });
            let slot = (index.entries.len() - 1) as u32;
            index.map.insert(hash, slot);
            index.push_front(slot);
        }
        Ok(index)
    }

    /// A snapshot of everything held, LRU order and times included.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(INDEX_MAGIC, SNAPSHOT_VERSION);
        self.write(&mut w);
        w.finish()
    }

    /// Restores a snapshot written by `to_bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        restore(
            bytes,
            INDEX_MAGIC,
            SNAPSHOT_VERSION,
            "prefix index",
            Self::read,
        )
    }

    /// Entries from most to least recent, as (hash, last time, endpoint names).
    #[cfg(test)]
    pub(crate) fn dump(&self) -> Vec<(u64, f64, Vec<String>)> {
        let mut out = Vec::new();
        let mut slot = self.head;
        while slot != NIL {
            let e = &self.entries[slot as usize];
            let mut endpoints: Vec<String> = e
                .endpoints
                .ids()
                .filter_map(|p| self.endpoint_names[p as usize].clone())
                .collect();
            endpoints.sort();
            out.push((e.hash, e.last, endpoints));
            slot = e.next;
        }
        out
    }
}

/// The router's settings (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixConfig {
    pub block_size: usize,
    pub imbalance_abs_count: u64,
    pub std_factor: f64,
    pub seed: u64,
}

impl PrefixConfig {
    pub fn new(
        block_size: usize,
        imbalance_abs_count: i64,
        std_factor: f64,
        seed: u64,
    ) -> Result<Self> {
        check_block_size(block_size)?;
        if imbalance_abs_count < 0 {
            return Err(invalid(format!(
                "imbalance_abs_count must be >= 0, got {imbalance_abs_count}"
            )));
        }
        Ok(Self {
            block_size,
            imbalance_abs_count: imbalance_abs_count as u64,
            std_factor: non_negative("std_factor", std_factor)?,
            seed,
        })
    }
}

/// The prefix index behind its lock (a poisoned lock is still read: the
/// index is valid after any panic).
pub(crate) fn lock(index: &Mutex<PrefixIndex>) -> MutexGuard<'_, PrefixIndex> {
    index.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Vec<u32> {
        (0..n).map(|i| i.wrapping_mul(2_654_435_761)).collect()
    }

    #[test]
    fn hashes_follow_the_documented_chain() {
        let t = ids(10);
        let h = block_hashes(Tokens::Ids(&t), 4, 7).expect("hashes");
        assert_eq!(h.len(), 2, "the partial tail block is ignored");
        let mut b0 = 7u64.to_le_bytes().to_vec();
        t[..4]
            .iter()
            .for_each(|x| b0.extend_from_slice(&x.to_le_bytes()));
        let h0 = xxh3_64_with_seed(&b0, 7);
        let mut b1 = h0.to_le_bytes().to_vec();
        t[4..8]
            .iter()
            .for_each(|x| b1.extend_from_slice(&x.to_le_bytes()));
        assert_eq!(h, vec![h0, xxh3_64_with_seed(&b1, 7)]);

        let text = b"abcdefgh";
        let hb = block_hashes(Tokens::Bytes(text), 3, 0).expect("hashes");
        let mut c0 = 0u64.to_le_bytes().to_vec();
        c0.extend_from_slice(b"abc");
        assert_eq!(hb.len(), 2);
        assert_eq!(hb[0], xxh3_64_with_seed(&c0, 0));

        let mut t2 = t.clone();
        t2[1] ^= 1;
        let h2 = block_hashes(Tokens::Ids(&t2), 4, 7).expect("hashes");
        assert!(h2[0] != h[0] && h2[1] != h[1]);
        assert!(block_hashes(Tokens::Ids(&t), 0, 0).is_err());
        assert!(block_hashes(Tokens::Ids(&t), MAX_BLOCK_SIZE + 1, 0).is_err());
    }

    #[test]
    fn batched_hashes_equal_single() {
        let t = ids(50);
        let offsets = [0i64, 9, 9, 30, 50];
        let (flat, out) = block_hashes_many(Tokens::Ids(&t), &offsets, 4, 3).expect("many");
        assert_eq!(out.len(), offsets.len());
        for (w, o) in offsets.windows(2).zip(out.windows(2)) {
            let one =
                block_hashes(Tokens::Ids(&t[w[0] as usize..w[1] as usize]), 4, 3).expect("one");
            assert_eq!(&flat[o[0] as usize..o[1] as usize], one.as_slice());
        }
        for bad in [&[1i64, 50][..], &[0, 51], &[0, 30, 20, 50], &[]] {
            assert!(block_hashes_many(Tokens::Ids(&t), bad, 4, 3).is_err());
        }
    }

    #[test]
    fn forget_removes_one_endpoint_from_those_blocks_only() {
        let mut ix = PrefixIndex::new(10, None).expect("index");
        ix.record(&[1, 2, 3], "a", 0.0).expect("record");
        ix.record(&[1, 9], "b", 0.0).expect("record");
        assert_eq!(ix.forget(&[1, 2, 3, 7], "a"), 3, "7 is not in the index");
        assert_eq!(ix.forget(&[1, 2], "a"), 0, "forgotten already");
        assert_eq!(ix.forget(&[1], "nobody"), 0);
        // Blocks 2 and 3 were a's only: dropped; 1 and 9 stay b's.
        assert_eq!(ix.len(), 2);
        assert_eq!(ix.match_prefix(&[1, 2, 3], 0.0), Ok(vec![("b".into(), 1)]));
        assert_eq!(ix.match_prefix(&[1, 9], 0.0), Ok(vec![("b".into(), 2)]));
        // a holds nothing now: removing it reports no block.
        assert_eq!(ix.remove_endpoint("a"), Ok(0));
    }

    #[test]
    fn index_is_lru_bounded_and_expires() {
        let mut ix = PrefixIndex::new(3, Some(10.0)).expect("index");
        ix.record(&[1, 2], "a", 0.0).expect("record");
        ix.record(&[3], "b", 1.0).expect("record");
        // Recorded last to first: 1 is more recent than 2.
        let order: Vec<u64> = ix.dump().iter().map(|e| e.0).collect();
        assert_eq!(order, vec![3, 1, 2]);
        ix.record(&[4], "b", 2.0).expect("record");
        assert_eq!(ix.len(), 3, "capacity holds");
        let order: Vec<u64> = ix.dump().iter().map(|e| e.0).collect();
        assert_eq!(order, vec![4, 3, 1], "the least recent (2) is evicted");
        ix.record(&[1], "b", 5.0).expect("record");
        assert_eq!(
            ix.match_prefix(&[1, 3], 5.0),
            Ok(vec![("a".into(), 1), ("b".into(), 2)])
        );
        // At t = 12.5 blocks 3 (t=1) and 4 (t=2) are idle > 10 s, 1 (t=5) is not.
        assert_eq!(ix.expire(12.5), Ok(2));
        assert_eq!(ix.len(), 1);
        // A lookup past the TTL is a miss.
        assert_eq!(ix.match_prefix(&[1], 15.1), Ok(vec![]));
        assert!(ix.is_empty());
        assert!(PrefixIndex::new(0, None).is_err());
        assert!(PrefixIndex::new(1, Some(0.0)).is_err());
        assert!(PrefixIndex::new(1, Some(f64::NAN)).is_err());
        assert!(ix.record(&[1], "a", f64::NAN).is_err());
        assert!(ix.record(&[1], "", 0.0).is_err());
    }

    #[test]
    fn a_match_along_the_recency_list_stops_at_an_expired_block() {
        let mut ix = PrefixIndex::new(100, Some(10.0)).expect("index");
        ix.record(&[1, 2, 3], "a", 0.0).expect("record");
        ix.record(&[1], "a", 5.0).expect("record");
        // Recency order is still 1, 2, 3; at t = 12 block 1 (t = 5) is live,
        // block 2 (t = 0), the next entry, expired.
        let order: Vec<u64> = ix.dump().iter().map(|e| e.0).collect();
        assert_eq!(order, vec![1, 2, 3]);
        assert_eq!(ix.match_prefix(&[1, 2, 3], 12.0), Ok(vec![("a".into(), 1)]));
        // The next entry with another hash is not taken for the next block.
        ix.record(&[7, 8], "b", 12.0).expect("record");
        ix.record(&[7, 9], "b", 12.0).expect("record");
        assert_eq!(ix.match_prefix(&[7, 8], 12.0), Ok(vec![("b".into(), 2)]));
        assert_eq!(ix.match_prefix(&[7, 9], 12.0), Ok(vec![("b".into(), 2)]));
        assert_eq!(ix.match_prefix(&[7, 3], 12.0), Ok(vec![("b".into(), 1)]));
    }

    #[test]
    fn remove_endpoint_and_snapshot_round_trip() {
        let mut ix = PrefixIndex::new(100, None).expect("index");
        ix.record(&[1, 2, 3], "a", 1.0).expect("record");
        ix.record(&[1, 2], "b", 2.0).expect("record");
        assert_eq!(
            ix.match_prefix(&[1, 2, 3], 3.0),
            Ok(vec![("a".into(), 3), ("b".into(), 2)])
        );
        let bytes = ix.to_bytes();
        let back = PrefixIndex::from_bytes(&bytes).expect("restore");
        assert_eq!(back.dump(), ix.dump());
        assert_eq!(back.to_bytes(), bytes);
        assert_eq!(ix.remove_endpoint("a"), Ok(3));
        assert_eq!(ix.len(), 2, "block 3 had only endpoint a");
        assert_eq!(ix.remove_endpoint("a"), Err(unknown("endpoint", "a")));
        assert_eq!(ix.endpoints(), vec!["b".to_owned()]);
        ix.record(&[9], "c", 4.0).expect("record");
        let bytes = ix.to_bytes();
        assert_eq!(
            PrefixIndex::from_bytes(&bytes).expect("restore").dump(),
            ix.dump()
        );
        for cut in 0..bytes.len() {
            assert!(PrefixIndex::from_bytes(&bytes[..cut]).is_err());
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(PrefixIndex::from_bytes(&long).is_err());
    }

    #[test]
    fn ids_of_endpoints_without_blocks_are_reclaimed() {
        // A small index sees far more than MAX_ENDPOINTS distinct endpoints: each new
        // endpoint evicts old blocks, and the ids of endpoints left without a block
        // serve the new ones.
        let mut ix = PrefixIndex::new(8, None).expect("index");
        for i in 0..3 * MAX_ENDPOINTS as u64 {
            ix.record(&[i, i + 1_000_000], &format!("endpoint-{i}"), i as f64)
                .expect("record");
            assert_eq!(
                ix.match_prefix(&[i], i as f64),
                Ok(vec![(format!("endpoint-{i}"), 1)])
            );
        }
        assert!(ix.endpoint_names.len() <= MAX_ENDPOINTS);
        let held: usize = ix.endpoint_blocks.iter().map(|&b| b as usize).sum();
        assert_eq!(held, ix.len());
        // The endpoints of the blocks still held keep their names.
        let last = 3 * MAX_ENDPOINTS as u64 - 1;
        assert!(ix.endpoints().contains(&format!("endpoint-{last}")));
        assert_eq!(
            PrefixIndex::from_bytes(&ix.to_bytes()).map(|b| b.dump()),
            Ok(ix.dump())
        );

        // A router's own endpoints keep their ids even without a block, and every
        // other endpoint's id is taken only when it holds no block.
        let mut full = PrefixIndex::new(MAX_ENDPOINTS, None).expect("index");
        for i in 0..MAX_ENDPOINTS as u64 {
            full.record(&[i], &format!("p{i}"), 0.0).expect("record");
        }
        assert!(
            full.record(&[1 << 40], "one-more", 0.0).is_err(),
            "every endpoint holds a block"
        );
        assert_eq!(full.remove_endpoint("p7"), Ok(1));
        full.record(&[], "idle", 0.0).expect("record");
        assert!(full.endpoints().contains(&"idle".to_owned()));
        let names = vec!["idle".to_owned(), "new".to_owned()];
        assert!(full.ids_for(&names).is_err(), "idle is kept: no id for new");
        assert!(
            full.endpoints().contains(&"idle".to_owned()),
            "the refusal changed nothing"
        );
        full.record(&[1 << 41], "other", 0.0)
            .expect("idle reclaimed");
        assert!(!full.endpoints().contains(&"idle".to_owned()));
    }
}
