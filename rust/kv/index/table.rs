//! Every endpoint's blocks in one table: our block hash -> the endpoints
//! holding it. A query walks a prompt's blocks once for all endpoints
//! (`Table::walk`): the set of endpoints still matching is intersected with
//! each block's holders, and the walk stops when it is empty, so its cost
//! grows with the prompt's matched length, not with endpoints x blocks.
//!
//! Blocks sit in `slab` in the order they were first stored, so the blocks
//! of one `BlockStored` (most of a prompt, or a system prompt) are side by
//! side. A walk that found block `i` at slot `s` checks slot `s + 1` first:
//! it holds block `i + 1` when its link (`super::link`) is the link after
//! slot `s`'s link and the block's tokens (or, with the prompt's hashes
//! given, when its hash is block `i + 1`'s). That check reads the previous
//! link from the slab instead of waiting for the previous block's, and a
//! link hashes the block's ids alone before one mix with it, so the blocks
//! of a run are checked side by side rather than one after the other (the
//! chain's latency bounds hashing a whole prompt); only where the run ends
//! does the walk compute the next chained hash and look it up in `index`.
//! A block no endpoint holds any more is dead: it leaves `index`, keeps its
//! slot until enough are dead to compact the slab (in order, so runs stay
//! runs).
//!
//! `index` hashes a block hash again, under a per-process random seed
//! (foldhash): our block hashes are xxh3 of token ids a KV publisher chose,
//! with a seed it may know, so it could grind token ids whose hashes share
//! their low bits (the bucket) and make every probe walk them all; keyed,
//! it cannot tell which do.
//!
//! A block's holders take 8 bytes (`Holders`): the endpoints of ids below 63
//! as a bitset; else a single endpoint by its id; else a set out of line, in
//! `wide` (`words` 64-bit words per set, one bit per endpoint id). A fleet
//! of up to 63 endpoints never goes out of line; in a larger one only the
//! blocks several endpoints hold do, one set per block shared by all its
//! holders. An out-of-line set marks whether it equals the set of the slot
//! before it (`SAME`), kept as blocks are held and released: along a run
//! of blocks the same endpoints hold (a shared system prompt), a walk then
//! reads no set, whatever the fleet's size.

use std::hash::BuildHasher;

use foldhash::quality::RandomState;
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

use super::link::Links;
use crate::prefix::BlockStep;

/// Endpoint ids the inline bitset holds: `0..INLINE`.
const INLINE: u32 = 63;
const TAG: u64 = 0b11 << 62;
const ONE: u64 = 0b10 << 62;
const WIDE: u64 = 0b11 << 62;
/// In an out-of-line `Holders`: the set equals the slot before's (see the
/// module docs).
const SAME: u64 = 1 << 61;
/// Dead slots the slab keeps before it is compacted: a quarter of it, and
/// this many at least (a few in the tests, so that they compact often).
const MIN_COMPACT: usize = if cfg!(test) { 4 } else { 1024 };
/// Slots a walk checks at a time along a run (at most this many blocks
/// past its end are hashed for nothing).
const RUN_CHUNK: usize = 8;

/// The endpoints holding one block (see the module docs): bit 63 clear, a
/// bitset of ids below `INLINE` (empty: a dead slot); tag `ONE`, one id in
/// the low 32 bits; tag `WIDE`, the index of a set in `Table::wide` in the
/// low 32 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holders(u64);

const DEAD: Holders = Holders(0);

enum Form {
    Bits(u64),
    One(u32),
    Wide(usize),
}

impl Holders {
    fn single(id: u32) -> Self {
        match id < INLINE {
            true => Holders(1 << id),
            false => Holders(ONE | u64::from(id)),
        }
    }
    /// An out-of-line set equal to the slot before's.
    #[inline(always)]
    fn same(self) -> bool {
        self.0 & (TAG | SAME) == WIDE | SAME
    }
    fn form(self) -> Form {
        if self.0 >> 63 == 0 {
            Form::Bits(self.0)
        } else if self.0 & TAG == ONE {
            Form::One(self.0 as u32)
        } else {
            Form::Wide(self.0 as u32 as usize)
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    /// The block's chained hash (`crate::prefix`'s chain): `index`'s key.
    hash: u64,
    /// Its link (`super::link`): what a walk checks along a run.
    link: u64,
    holders: Holders,
}

/// The out-of-line sets of `Holders`.
#[derive(Debug, Default)]
struct Wide {
    sets: Vec<u64>,
    free: Vec<u32>,
    /// Words per set: one bit for every endpoint id.
    words: usize,
}

impl Wide {
    /// Word `w` of a block's holders as a bitset.
    #[inline]
    fn word(&self, h: Holders, w: usize) -> u64 {
        match h.form() {
            Form::Bits(b) => match w {
                0 => b,
                _ => 0,
            },
            Form::One(id) => match id as usize / 64 == w {
                true => 1 << (id % 64),
                false => 0,
            },
            Form::Wide(ix) => self.sets[ix * self.words + w],
        }
    }

    /// Adds `id` to `h`; false if it was there.
    fn add(&mut self, h: &mut Holders, id: u32) -> bool {
        let bit = 1u64 << (id % 64);
        // A second holder the inline form cannot take: a set out of line.
        let mut widen = |held: &[u32], bits: u64| {
            let words = self.words;
            let ix = match self.free.pop() {
                Some(ix) => ix as usize,
                None => {
                    self.sets.resize(self.sets.len() + words, 0);
                    self.sets.len() / words - 1
                }
            };
            let set = &mut self.sets[ix * words..(ix + 1) * words];
            set[0] = bits;
            for &p in held.iter().chain([&id]) {
                set[p as usize / 64] |= 1 << (p % 64);
            }
            Holders(WIDE | ix as u64)
        };
        match h.form() {
            Form::Bits(b) if id < INLINE => {
                *h = Holders(b | bit);
                b & bit == 0
            }
            Form::Bits(0) => {
                *h = Holders::single(id);
                true
            }
            Form::Bits(b) => {
                *h = widen(&[], b);
                true
            }
            Form::One(one) if one == id => false,
            Form::One(one) => {
                *h = widen(&[one], 0);
                true
            }
            Form::Wide(ix) => {
                let w = &mut self.sets[ix * self.words + id as usize / 64];
                let new = *w & bit == 0;
                *w |= bit;
                new
            }
        }
    }

    /// Removes `id` from `h` (`DEAD` when none is left); false if it was
    /// not there.
    fn remove(&mut self, h: &mut Holders, id: u32) -> bool {
        let bit = 1u64 << (id % 64);
        match h.form() {
            Form::Bits(b) => {
                if id >= INLINE || b & bit == 0 {
                    return false;
                }
                *h = Holders(b & !bit);
            }
            Form::One(one) => {
                if one != id {
                    return false;
                }
                *h = DEAD;
            }
            Form::Wide(ix) => {
                let words = self.words;
                let set = &mut self.sets[ix * words..(ix + 1) * words];
                let w = id as usize / 64;
                if set[w] & bit == 0 {
                    return false;
                }
                set[w] &= !bit;
                // Back inline when the set fits there (it keeps one holder
                // at least: an out-of-line set has two).
                let count: u32 = set.iter().map(|w| w.count_ones()).sum();
                let narrow = match set.iter().skip(1).all(|&w| w == 0) && set[0] >> 63 == 0 {
                    true => Some(Holders(set[0])),
                    false if count == 1 => set.iter().enumerate().find_map(|(w, &bits)| {
                        (bits != 0).then(|| Holders::single(64 * w as u32 + bits.trailing_zeros()))
                    }),
                    false => None,
                };
                if let Some(narrow) = narrow {
                    set.fill(0);
                    self.free.push(ix as u32);
                    *h = narrow;
                }
            }
        }
        true
    }
}

/// A prompt's blocks as a walk reads them: how many; the chained hash of
/// block `n` when the block before it hashed `prev` (the chain's seed for
/// the first), to look it up; and along a run, what slot `x` holds when it
/// holds block `n` after the block in slot `before` (`run_key`, compared
/// with `key_of(x)`).
pub(super) trait Prompt {
    fn blocks(&self) -> usize;
    fn seed(&self) -> u64;
    fn hash(&mut self, prev: u64, n: usize) -> u64;
    fn run_key(&mut self, before: &Slot, n: usize) -> u64;
    /// `run_key` of blocks `n..n + out.len()` after the slots `before`.
    fn run_keys(&mut self, before: &[Slot], n: usize, out: &mut [u64]) {
        for (k, (o, x)) in out.iter_mut().zip(before).enumerate() {
            *o = self.run_key(x, n + k);
        }
    }
    fn key_of(x: &Slot) -> u64;
}

/// Token ids, hashed as the walk goes (only the blocks it reaches): a run
/// by the blocks' links, independent per block; a lookup by the chained
/// hash.
pub(super) struct Ids<'a> {
    pub(super) ids: &'a [u32],
    pub(super) block_size: usize,
    pub(super) seed: u64,
    pub(super) step: &'a mut BlockStep,
    pub(super) links: &'a mut Links,
}

impl Prompt for Ids<'_> {
    fn blocks(&self) -> usize {
        self.ids.len() / self.block_size
    }
    fn seed(&self) -> u64 {
        self.seed
    }
    #[inline(always)]
    fn hash(&mut self, prev: u64, n: usize) -> u64 {
        let bs = self.block_size;
        self.step.hash(prev, &self.ids[n * bs..(n + 1) * bs])
    }
    #[inline(always)]
    fn run_key(&mut self, before: &Slot, n: usize) -> u64 {
        let bs = self.block_size;
        self.links
            .link(before.link, &self.ids[n * bs..(n + 1) * bs], self.seed)
    }
    #[inline(always)]
    fn run_keys(&mut self, before: &[Slot], n: usize, out: &mut [u64]) {
        let bs = self.block_size;
        let mut prevs = [0u64; RUN_CHUNK];
        let prevs = &mut prevs[..out.len()];
        for (p, x) in prevs.iter_mut().zip(before) {
            *p = x.link;
        }
        let blocks = &self.ids[n * bs..(n + out.len()) * bs];
        self.links.links(prevs, blocks, self.seed, out);
    }
    #[inline(always)]
    fn key_of(x: &Slot) -> u64 {
        x.link
    }
}

impl Ids<'_> {
    /// Appends the chained hashes of blocks `from..` to `out`, the first
    /// after `prev`: the chain alone, in a loop of its own (one step a
    /// block and nothing else, so each waits only for the one before).
    fn chain_into(&mut self, from: usize, mut prev: u64, out: &mut Vec<u64>) {
        let (bs, step) = (self.block_size, &mut *self.step);
        out.extend(self.ids[from * bs..].chunks_exact(bs).map(|block| {
            prev = step.hash(prev, block);
            prev
        }));
    }
}

/// The prompt's chained block hashes, computed already (the same chain:
/// block `n`'s hash after `prev` is `hashes[n]` wherever the walk asks); a
/// run is checked by the slots' hashes.
pub(super) struct Hashed<'a>(pub(super) &'a [u64]);

impl Prompt for Hashed<'_> {
    fn blocks(&self) -> usize {
        self.0.len()
    }
    fn seed(&self) -> u64 {
        0
    }
    #[inline(always)]
    fn hash(&mut self, _prev: u64, n: usize) -> u64 {
        self.0[n]
    }
    #[inline(always)]
    fn run_key(&mut self, _before: &Slot, n: usize) -> u64 {
        self.0[n]
    }
    #[inline(always)]
    fn key_of(x: &Slot) -> u64 {
        x.hash
    }
}

/// Where a walk stopped: the blocks it went through (`n`), the hash of the
/// last of them (the chain's seed before the first) and its slot; and the
/// hash of block `n` when the walk looked it up and no block had it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stop {
    n: usize,
    prev: u64,
    at: Option<usize>,
    missed: Option<u64>,
}

impl Stop {
    /// Before the first block of a chain from `seed`.
    pub(super) fn start(seed: u64) -> Self {
        Self {
            n: 0,
            prev: seed,
            at: None,
            missed: None,
        }
    }
    /// After `n` blocks, the last in slot `s`.
    fn at(slab: &[Slot], s: usize, n: usize) -> Self {
        Self {
            n,
            prev: slab[s].hash,
            at: Some(s),
            missed: None,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Table {
    /// The blocks in the order first stored; dead ones included.
    slab: Vec<Slot>,
    /// The slots of the live blocks, by their hash (keyed by `keys`).
    index: HashTable<u32>,
    dead: usize,
    wide: Wide,
    keys: RandomState,
}

impl Table {
    /// Makes room for endpoint ids below `endpoints`.
    pub(super) fn grow(&mut self, endpoints: usize) {
        let w = &mut self.wide;
        let words = endpoints.div_ceil(64).max(1);
        if words <= w.words {
            return;
        }
        let old = w.words.max(1);
        let mut sets = vec![0; w.sets.len() / old * words];
        for (s, set) in w.sets.chunks_exact(old).enumerate() {
            sets[s * words..s * words + set.len()].copy_from_slice(set);
        }
        w.sets = sets;
        w.words = words;
    }

    /// Words in an endpoint set of this table (`walk`'s `alive`).
    pub(super) fn words(&self) -> usize {
        self.wide.words.max(1)
    }

    /// Distinct blocks held by some endpoint.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Slots whose holders are marked `SAME`.
    #[cfg(test)]
    pub(super) fn marked(&self) -> usize {
        self.slab.iter().filter(|x| x.holders.same()).count()
    }

    fn find(&self, hash: u64) -> Option<usize> {
        let slab = &self.slab;
        self.index
            .find(self.keys.hash_one(hash), |&s| slab[s as usize].hash == hash)
            .map(|&s| s as usize)
    }

    /// The link of block `hash` (None when no endpoint holds it).
    pub(super) fn link_of(&self, hash: u64) -> Option<u64> {
        self.find(hash).map(|s| self.slab[s].link)
    }

    /// Records that endpoint `id` holds block `hash` (of link `link`);
    /// false if it did already. A new block takes the next slot: the new
    /// blocks of one event follow each other. One probe of `index`.
    pub(super) fn add(&mut self, hash: u64, link: u64, id: u32) -> bool {
        if self.index.len() == self.index.capacity() {
            self.grow_index();
        }
        let (slab, keys) = (&mut self.slab, &self.keys);
        let entry = self.index.entry(
            keys.hash_one(hash),
            |&s| slab[s as usize].hash == hash,
            |&s| keys.hash_one(slab[s as usize].hash),
        );
        match entry {
            Entry::Occupied(e) => {
                let s = *e.get() as usize;
                let added = self.wide.add(&mut slab[s].holders, id);
                self.mark_around(s);
                added
            }
            Entry::Vacant(e) => {
                e.insert(slab.len() as u32);
                // By a sixteenth, not by doubling: a slot is 24 bytes, and a
                // large slab's realloc moves pages rather than copying.
                if slab.len() == slab.capacity() {
                    slab.reserve_exact((slab.len() / 16).max(64));
                }
                slab.push(Slot {
                    hash,
                    link,
                    holders: Holders::single(id),
                });
                true
            }
        }
    }

    /// Makes `index` room for as many blocks again, rebuilt from the slab
    /// in slot order: hashbrown's own rehash reads each entry's block hash
    /// from the slab in bucket order, a cache miss per block (a quarter of
    /// apply's time at 256 endpoints).
    fn grow_index(&mut self) {
        let (slab, keys) = (&self.slab, &self.keys);
        let mut index = HashTable::with_capacity((2 * self.index.len()).max(64));
        for (s, x) in slab.iter().enumerate().filter(|(_, x)| x.holders != DEAD) {
            index.insert_unique(keys.hash_one(x.hash), s as u32, |&s| {
                keys.hash_one(slab[s as usize].hash)
            });
        }
        self.index = index;
    }

    /// Records that endpoint `id` no longer holds block `hash` (a block no
    /// endpoint holds dies); false if it did not hold it. One probe of
    /// `index`.
    pub(super) fn remove(&mut self, hash: u64, id: u32) -> bool {
        let slab = &mut self.slab;
        let Ok(e) = self
            .index
            .find_entry(self.keys.hash_one(hash), |&s| slab[s as usize].hash == hash)
        else {
            return false;
        };
        let s = *e.get() as usize;
        if !self.wide.remove(&mut slab[s].holders, id) {
            return false;
        }
        let dead = slab[s].holders == DEAD;
        if dead {
            e.remove();
            self.dead += 1;
        }
        self.mark_around(s);
        if dead && self.dead >= MIN_COMPACT.max(self.slab.len() / 4) {
            self.compact();
        }
        true
    }

    /// Drops the dead slots, keeping the live ones in order.
    fn compact(&mut self) {
        let mut moved = vec![u32::MAX; self.slab.len()];
        let mut next = 0u32;
        for (s, m) in moved.iter_mut().enumerate() {
            if self.slab[s].holders != DEAD {
                *m = next;
                next += 1;
            }
        }
        self.slab.retain(|s| s.holders != DEAD);
        self.slab.shrink_to(self.slab.len() + self.slab.len() / 16);
        for s in self.index.iter_mut() {
            *s = moved[*s as usize];
        }
        self.dead = 0;
        // Other slots are side by side now.
        for s in 0..self.slab.len() {
            self.mark(s);
        }
    }

    /// Marks slots `s` and `s + 1` after slot `s`'s holders changed (none
    /// to mark while no set is out of line: a fleet of up to 63 endpoints).
    fn mark_around(&mut self, s: usize) {
        let w = &self.wide;
        if w.sets.len() > w.free.len() * w.words {
            self.mark(s);
            self.mark(s + 1);
        }
    }

    /// Marks slot `s`'s out-of-line set `SAME` when it equals the slot
    /// before's (an out-of-line one too: a set that fits in line is kept
    /// there), unmarks it otherwise.
    fn mark(&mut self, s: usize) {
        let Some(Form::Wide(ix)) = self.slab.get(s).map(|x| x.holders.form()) else {
            return;
        };
        let same = match s.checked_sub(1).map(|p| self.slab[p].holders.form()) {
            Some(Form::Wide(before)) => {
                let (sets, w) = (&self.wide.sets, self.wide.words);
                sets[ix * w..(ix + 1) * w] == sets[before * w..(before + 1) * w]
            }
            _ => false,
        };
        let h = &mut self.slab[s].holders.0;
        *h = if same { *h | SAME } else { *h & !SAME };
    }

    fn holds_slot(&self, s: usize, id: u32) -> bool {
        self.wide.word(self.slab[s].holders, id as usize / 64) >> (id % 64) & 1 == 1
    }

    /// Whether endpoint `id` holds block `hash`.
    #[cfg(test)]
    pub(super) fn holds(&self, hash: u64, id: u32) -> bool {
        self.find(hash).is_some_and(|s| self.holds_slot(s, id))
    }

    /// How many of `hashes` endpoint `id` holds from the first on (each
    /// block looked for in the slot after the last one first).
    pub(super) fn leading(&self, hashes: &[u64], id: u32) -> usize {
        let mut at: Option<usize> = None;
        for (n, &h) in hashes.iter().enumerate() {
            let next = at.map(|s| s + 1).filter(|&s| {
                self.slab
                    .get(s)
                    .is_some_and(|x| x.hash == h && x.holders != DEAD)
            });
            match next.or_else(|| self.find(h)) {
                Some(s) if self.holds_slot(s, id) => at = Some(s),
                _ => return n,
            }
        }
        hashes.len()
    }

    /// Appends the chained hashes of `prompt`'s blocks from block `from.n`
    /// on to `out` (`from`: where a walk stopped, or the start): along a
    /// run of slots holding its blocks (each checked by its link from the
    /// slot before, independent per block), the slots' hashes; elsewhere
    /// the chain, looking each block up to start a run until one is not
    /// found (no lookup after that: the chain alone, `Ids::chain_into`).
    /// A slot keeps its hash and link when its block dies, so a run goes
    /// through dead slots too.
    pub(super) fn hashes(&self, prompt: &mut Ids<'_>, from: Stop, out: &mut Vec<u64>) {
        let slab = &self.slab;
        let Stop {
            n,
            mut prev,
            mut at,
            missed,
        } = from;
        // Block n was looked up by the walk: the chain alone after it.
        if let Some(h) = missed {
            out.push(h);
            return prompt.chain_into(n + 1, h, out);
        }
        let mut looking = true;
        for n in n..prompt.blocks() {
            if !looking {
                return prompt.chain_into(n, prev, out);
            }
            let next = at
                .map(|s| s + 1)
                .filter(|&s| s < slab.len() && slab[s].link == prompt.run_key(&slab[s - 1], n));
            prev = match next {
                Some(s) => {
                    at = Some(s);
                    slab[s].hash
                }
                None => {
                    let h = prompt.hash(prev, n);
                    at = self.find(h);
                    looking = at.is_some();
                    h
                }
            };
            out.push(prev);
        }
    }

    /// Walks the blocks of `prompt` in order while some endpoint of `alive`
    /// (a bitset of `words()` words, emptied on the way) holds every block
    /// so far, and calls `settle(w, bits, n)` for the endpoints of `alive`
    /// that hold the first `n >= 1` blocks and not the next (or there is
    /// none), a word of them at a time (`bits`: ids `64 * w + i`, none
    /// empty), as they drop out (`n` never decreasing; every endpoint once
    /// at most); the others hold none. `found` is told the hash of every block the
    /// walk went through, in order (the slot's, along a run). Returns where
    /// it stopped.
    // Out of line: inlined into `walk_prompt`'s scratch closure (as the
    // build happened to do after the kv-held branch's scorer change) the
    // walk ran 0.2-0.3 us a prompt slower.
    #[inline(never)]
    pub(super) fn walk<P: Prompt>(
        &self,
        alive: &mut [u64],
        prompt: &mut P,
        mut found: impl FnMut(u64),
        mut settle: impl FnMut(usize, u64, usize),
    ) -> Stop {
        let slab = &self.slab;
        let blocks = prompt.blocks();
        let mut stop = Stop::start(prompt.seed());
        let mut n = 0;
        'walk: while n < blocks && alive.iter().any(|&a| a != 0) {
            // Block n by its hash, then the slots after it while they hold
            // the blocks after it: each checked from the slot before (its
            // link, or its hash), not from the block just checked.
            let hash = prompt.hash(stop.prev, n);
            let Some(mut s) = self.find(hash) else {
                stop.missed = Some(hash);
                break;
            };
            // The holders last kept: `alive` is a subset of them, so a block
            // with the same holders (most of a run) keeps every endpoint.
            let mut kept = slab[s].holders;
            if !self.keep(alive, kept, n, &mut settle) {
                break;
            }
            found(hash);
            n += 1;
            // In chunks: computing a chunk's keys first, comparing after,
            // leaves the compiler no equality to put the computed key in
            // place of the slot's (which would chain the blocks again). The
            // chunks grow from 1 block to `RUN_CHUNK` along a run, so a
            // short run computes few keys past its end.
            let mut chunk = 1;
            'run: loop {
                let m = chunk.min(blocks - n).min(slab.len() - 1 - s);
                let mut next = [0u64; RUN_CHUNK];
                prompt.run_keys(&slab[s..s + m], n, &mut next[..m]);
                for &h in &next[..m] {
                    let x = slab[s + 1];
                    if x.holders == DEAD || P::key_of(&x) != h {
                        break 'run;
                    }
                    // Slot s + 1 keeps every endpoint when its holders
                    // are slot s's (a superset of `alive`): the same, or
                    // an out-of-line set marked `SAME`.
                    if x.holders != kept {
                        if !x.holders.same() && !self.keep(alive, x.holders, n, &mut settle) {
                            stop = Stop::at(slab, s, n);
                            break 'walk;
                        }
                        kept = x.holders;
                    }
                    found(x.hash);
                    n += 1;
                    s += 1;
                }
                if m < chunk {
                    break;
                }
                chunk = (2 * chunk).min(RUN_CHUNK);
            }
            stop = Stop::at(slab, s, n);
        }
        for (w, a) in alive.iter_mut().enumerate() {
            settle_bits(w, std::mem::take(a), n, &mut settle);
        }
        stop
    }

    /// Keeps the endpoints of `alive` that hold a block, settling the others
    /// at `n`; false when none is left.
    #[inline(always)]
    fn keep(
        &self,
        alive: &mut [u64],
        holders: Holders,
        n: usize,
        settle: &mut impl FnMut(usize, u64, usize),
    ) -> bool {
        let mut any = 0;
        for (w, a) in alive.iter_mut().enumerate() {
            if *a != 0 {
                let kept = *a & self.wide.word(holders, w);
                settle_bits(w, *a & !kept, n, settle);
                *a = kept;
                any |= kept;
            }
        }
        any != 0
    }
}

/// Settles the endpoints of word `w` of a set at `n` (none at 0).
#[inline(always)]
fn settle_bits(w: usize, bits: u64, n: usize, settle: &mut impl FnMut(usize, u64, usize)) {
    if n > 0 && bits != 0 {
        settle(w, bits, n);
    }
}

/// Calls `f(id)` for each endpoint of word `w` of a set (`bits`).
#[inline(always)]
pub(super) fn each_id(w: usize, mut bits: u64, mut f: impl FnMut(u32)) {
    while bits != 0 {
        f(64 * w as u32 + bits.trailing_zeros());
        bits &= bits - 1;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use super::*;
    use crate::prefix::{block_hashes, Tokens};
    use crate::rng::Rng;

    fn holders(t: &Table, hash: u64) -> Option<Holders> {
        t.find(hash).map(|s| t.slab[s].holders)
    }

    /// The table against a map of sets, on random holds and releases over
    /// endpoint ids on both sides of the inline bitset's 63 and of a word.
    #[test]
    fn the_table_agrees_with_a_map_of_sets() {
        let mut rng = Rng::new(5);
        for endpoints in [3u32, 63, 64, 65, 130, 300] {
            let mut t = Table::default();
            t.grow(endpoints as usize);
            let mut model: HashMap<u64, BTreeSet<u32>> = HashMap::new();
            for step in 0..20_000 {
                let hash = rng.below(40);
                let id = match rng.below(4) {
                    0 => endpoints - 1 - rng.below(2.min(u64::from(endpoints))) as u32,
                    _ => rng.below(u64::from(endpoints)) as u32,
                };
                // One block, or the blocks of a few slots side by side
                // (as an engine stores and evicts runs: sets equal to the
                // slot before's).
                let mut hashes = vec![hash];
                if rng.below(3) == 0 && !t.slab.is_empty() {
                    let from = rng.below(t.slab.len() as u64) as usize;
                    let to = (from + 1 + rng.below(6) as usize).min(t.slab.len());
                    hashes = t.slab[from..to].iter().map(|x| x.hash).collect();
                }
                apply(&mut t, &mut model, hashes, id, rng.below(2) == 0);
                if step % 500 == 0 {
                    check(&t, &model, endpoints);
                }
            }
            check(&t, &model, endpoints);
            // Emptied, the table holds nothing, out of line neither.
            for (hash, set) in std::mem::take(&mut model) {
                for id in set {
                    assert!(t.remove(hash, id));
                }
            }
            assert_eq!(t.len(), 0);
            let w = &t.wide;
            assert_eq!(w.free.len() * w.words, w.sets.len(), "every set freed");
            assert!(t.slab.len() < MIN_COMPACT.max(40), "dead slots compacted");
        }
    }

    /// Runs of blocks held and released by a few endpoints, as engines
    /// store and evict a shared prompt: an out-of-line set is marked `SAME`
    /// exactly while it equals the slot before's (`check`), through holds,
    /// releases, deaths and compactions.
    #[test]
    fn a_set_is_marked_the_same_exactly_while_it_is_the_slot_befores() {
        let mut rng = Rng::new(9);
        for endpoints in [65u32, 130, 256] {
            let mut t = Table::default();
            t.grow(endpoints as usize);
            let mut model: HashMap<u64, BTreeSet<u32>> = HashMap::new();
            let few = [0, 5, 63, 64, endpoints - 1];
            let mut marked = 0;
            for step in 0..3000 {
                let id = few[rng.below(few.len() as u64) as usize];
                let from = rng.below(12);
                let to = from + 1 + rng.below(12 - from);
                apply(&mut t, &mut model, from..to, id, rng.below(5) < 3);
                if step % 10 == 0 {
                    marked += check(&t, &model, endpoints);
                }
            }
            assert!(marked > 100, "{endpoints}: {marked} marked");
        }
    }

    /// Holds (`add`) or releases `hashes` for `id` in `t` and in `model`,
    /// asserting that each changes `t` exactly when it changes the model.
    fn apply(
        t: &mut Table,
        model: &mut HashMap<u64, BTreeSet<u32>>,
        hashes: impl IntoIterator<Item = u64>,
        id: u32,
        add: bool,
    ) {
        for hash in hashes {
            let set = model.entry(hash).or_default();
            match add {
                true => assert_eq!(t.add(hash, !hash, id), set.insert(id)),
                false => assert_eq!(t.remove(hash, id), set.remove(&id)),
            }
        }
        model.retain(|_, s| !s.is_empty());
    }

    /// Checks `t` against `model`; returns the slots marked `SAME`.
    fn check(t: &Table, model: &HashMap<u64, BTreeSet<u32>>, endpoints: u32) -> usize {
        assert_eq!(t.len(), model.len());
        for hash in 0..40 {
            let set = model.get(&hash);
            for id in 0..endpoints {
                assert_eq!(t.holds(hash, id), set.is_some_and(|s| s.contains(&id)));
            }
            // In line whenever it fits: all ids below 63, or a single one.
            if let (Some(set), Some(h)) = (set, holders(t, hash)) {
                let fits = set.len() == 1 || set.iter().all(|&id| id < INLINE);
                assert_eq!(fits, !matches!(h.form(), Form::Wide(_)), "{set:?}");
            }
        }
        // Out-of-line sets are only those in use; dead slots are counted.
        let live: Vec<&Slot> = t.slab.iter().filter(|s| s.holders != DEAD).collect();
        assert_eq!(live.len(), t.len());
        assert_eq!(t.slab.len() - live.len(), t.dead);
        let used = live
            .iter()
            .filter(|s| matches!(s.holders.form(), Form::Wide(_)))
            .count();
        assert_eq!(used + t.wide.free.len(), t.wide.sets.len() / t.wide.words);
        // An out-of-line set is marked `SAME` exactly when it equals the
        // slot before's.
        let set = |h: Holders| match h.form() {
            Form::Wide(ix) => Some(&t.wide.sets[ix * t.wide.words..(ix + 1) * t.wide.words]),
            _ => None,
        };
        let mut marked = 0;
        for (s, x) in t.slab.iter().enumerate().skip(1) {
            if let Some(mine) = set(x.holders) {
                let same = set(t.slab[s - 1].holders) == Some(mine);
                assert_eq!(x.holders.same(), same, "slot {s}");
                marked += usize::from(same);
            }
        }
        marked
    }

    /// Keys a publisher chose to share their low bits (the bucket of an
    /// identity hash, hashbrown's) spread over the buckets once keyed: the
    /// table's index and an endpoint's maps alike.
    #[test]
    fn keys_that_share_their_low_bits_spread_once_keyed() {
        let table = Table::default();
        let endpoint = super::super::EndpointKv::default();
        let hashes: [&dyn Fn(u64) -> u64; 2] = [&|k| table.keys.hash_one(k), &|k| {
            endpoint.blocks.hasher().hash_one(k)
        }];
        for hash in hashes {
            let buckets: BTreeSet<u64> = (1..=4096u64).map(|i| hash(i << 40) & 4095).collect();
            // 4,096 keys thrown into 4,096 buckets at random fill 63% of them.
            assert!(buckets.len() > 2400, "{} buckets", buckets.len());
        }
    }

    /// A walk settles each endpoint that holds some of the prompt's blocks
    /// once, with the blocks it holds from the first on, however the blocks lie in the slab (runs,
    /// scattered, dead slots, re-stored blocks, compactions).
    #[test]
    fn a_walk_settles_every_endpoint_with_its_leading_blocks() {
        let mut rng = Rng::new(8);
        // Both ways of computing links: 16 ids unrolled, any other size.
        for (endpoints, bs) in [(5u32, 4usize), (64, 16), (200, 4), (200, 16)] {
            let mut links = Links::new(bs);
            for _ in 0..20 {
                let mut t = Table::default();
                t.grow(endpoints as usize);
                let prompt: Vec<u32> = (0..20 * bs as u32).map(|_| rng.below(3) as u32).collect();
                let seed = rng.next_u64();
                let hashes = block_hashes(Tokens::Ids(&prompt), bs, seed).expect("h");
                let mut link = seed;
                let link_of: HashMap<u64, u64> = hashes
                    .iter()
                    .zip(prompt.chunks_exact(bs))
                    .map(|(&h, block)| {
                        link = links.link(link, block, seed);
                        (h, link)
                    })
                    .collect();
                // Endpoint p holds blocks 0..len[p], then a hole, then more;
                // added in runs, or in a random order, over noise.
                let len: Vec<usize> = (0..endpoints).map(|_| rng.below(16) as usize).collect();
                let mut adds: Vec<(u64, u32)> = Vec::new();
                for (p, &l) in len.iter().enumerate() {
                    adds.extend((0..l).chain(l + 1..18).map(|b| (hashes[b], p as u32)));
                }
                if rng.below(2) == 0 {
                    for i in (1..adds.len()).rev() {
                        adds.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                }
                for (h, p) in adds {
                    t.add(rng.next_u64(), rng.next_u64(), 0);
                    t.add(h, link_of[&h], p);
                    // A block dying and coming back: a dead slot of its hash
                    // before the live one.
                    if rng.below(8) == 0 {
                        t.remove(h, p);
                        t.add(rng.next_u64(), rng.next_u64(), 1);
                        t.add(h, link_of[&h], p);
                    }
                }
                let asked: Vec<u32> = (0..endpoints).filter(|_| rng.below(3) > 0).collect();
                let want: HashMap<u32, usize> = asked
                    .iter()
                    .map(|&p| (p, len[p as usize]))
                    .filter(|&(_, l)| l > 0)
                    .collect();
                // Hashing the ids as it goes, or reading their hashes.
                let mut step = BlockStep::new(bs, seed);
                let mut ids = Ids {
                    ids: &prompt,
                    block_size: bs,
                    seed,
                    step: &mut step,
                    links: &mut links,
                };
                assert_eq!(settled(&t, &asked, &mut ids), want);
                assert_eq!(settled(&t, &asked, &mut Hashed(&hashes)), want);
            }
        }
    }

    /// What a walk over `prompt` settles for the endpoints `asked`.
    fn settled(t: &Table, asked: &[u32], prompt: &mut impl Prompt) -> HashMap<u32, usize> {
        let mut alive = vec![0u64; t.words()];
        for &p in asked {
            alive[p as usize / 64] |= 1 << (p % 64);
        }
        let mut got = HashMap::new();
        let mut last = 0;
        t.walk(
            &mut alive,
            prompt,
            |_| (),
            |w, bits, n| {
                assert!(bits != 0 && n >= last.max(1), "in the order they dropped");
                last = n;
                each_id(w, bits, |id| {
                    assert!(got.insert(id, n).is_none(), "settled twice");
                });
            },
        );
        assert!(alive.iter().all(|&a| a == 0));
        got
    }
}
