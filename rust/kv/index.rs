//! The precise prefix index: what each endpoint's engine holds in its KV
//! cache, built from the engine's own KV-cache events (vLLM's `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`).
//!
//! Blocks are keyed by routecore's chained block hashes
//! (`crate::prefix::block_hashes`) of the event's token ids, never by the
//! engine's hashes, so the index does not depend on the engine's hash seed or
//! algorithm; a map per endpoint from the engine's hash to ours serves
//! `BlockRemoved` and the `parent_block_hash` of the next `BlockStored`. One
//! table over all endpoints maps our hash to the endpoints holding the block
//! (`table`), so a query walks the prompt's blocks once for every endpoint
//! (`match_prompt`), hashing them as it goes: its cost grows with the
//! prompt's matched length. Along a run of blocks stored side by side the
//! walk checks each block by its *link* (`link`: a keyed hash of the
//! block's ids alone, mixed with the link of the block before it, stored
//! with the block), so the blocks of a run are checked independently of
//! each other; the chained hash, where each block waits for the previous
//! one, is computed only where a run ends. The same runs give a prompt's
//! chained hashes without chaining them (`request_hashes_into`), and a
//! picker takes them with every live endpoint's answer from one walk
//! (`walk_prompt`, then `KvHeld::held_into`). An endpoint holds a block while its
//! engine holds it under some engine hash (engines that hash extra keys,
//! such as a multimodal input or a cache salt, may store the same tokens
//! under several). A LoRA adapter's blocks
//! chain from a seed of their own (`lora_seed`), so a base-model prompt never
//! matches an adapter's blocks. Each endpoint keeps at most `capacity_blocks`
//! blocks; past that the least recently stored eighth is forgotten (the index
//! then under-reports, never over-reports).
//!
//! An endpoint's entries are *live* while its event stream is connected and,
//! with `stale_after_s`, the engine was heard from in the last
//! `stale_after_s` seconds: an event, or an answer showing that nothing was
//! missed ([`KvIndex::heard`]; an idle engine sends no events, and idle is
//! not stale). A prefix scorer asks `leading_blocks`, which answers None
//! for an endpoint that is not live: the caller then falls back to the
//! approximate index.
//!
//! Sequence numbers (one per batch, from 0 per publisher) are checked by
//! `observe`: the next one is applied, an old one is a duplicate, a jump is a
//! gap (the caller replays the missed batches, or calls `unrecovered`), and a
//! return to 0 or an older number after a disconnect is an engine restart.
//! A batch that cannot be recovered clears the endpoint: what was missed may
//! have removed blocks, and the index must not claim blocks the engine lost.
//! An endpoint that follows no stream yet (empty, no sequence number) takes
//! any batch as its first: a suffix of the stream applied to nothing claims
//! no block the engine does not hold (it under-reports the older ones).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use foldhash::quality::RandomState;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::{invalid, unknown, Result};
use crate::prefix::{BlockStep, IdChain, MAX_BLOCK_SIZE, MAX_CAPACITY_BLOCKS};

mod link;
mod table;
use link::Links;
use table::{Hashed, Ids, Prompt, Stop, Table};

/// A query's scratch, kept per thread: no allocation per query once the
/// fleet's size was seen.
#[derive(Default)]
struct Scratch {
    /// Per endpoint id, the blocks the walk settled it at.
    depth: Vec<u32>,
    /// The endpoints asked and the walk's live set, a bitset each.
    masks: Vec<u64>,
    /// The chain step of the last (block size, seed) asked.
    step: Option<((usize, u64), BlockStep)>,
    /// The links of the last block size asked.
    links: Option<(usize, Links)>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// vLLM's default KV-cache block size, in tokens.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Blocks kept per endpoint unless configured otherwise.
pub const DEFAULT_CAPACITY_BLOCKS: usize = 1 << 18;
/// The storage tier the index follows (vLLM's `MEDIUM_GPU`); events of other
/// tiers (CPU offload) are skipped.
pub const MEDIUM_GPU: &str = "GPU";

/// One decoded KV-cache event. Engine hashes are u64: vLLM's integer hashes
/// as their 64-bit pattern, byte-string hashes by their xxh3-64.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored(Stored),
    Removed {
        hashes: Vec<u64>,
        medium: Option<String>,
    },
    Cleared,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    /// The adapter: vLLM's `lora_name`, else `lora_id` written as `#<id>`.
    pub lora: Option<String>,
    pub medium: Option<String>,
}

/// Why an event (or part of one) changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Not the GPU tier.
    Medium(String),
    /// A block size other than the configured one.
    BlockSize(usize),
    /// Token ids that are not `block_size` per block hash, or a bad field.
    Malformed(String),
    /// An event tag the index does not know.
    UnknownTag(String),
    /// A `BlockStored` whose parent block the index does not hold.
    UnknownParent(u64),
    /// A `BlockRemoved` hash the index does not hold.
    UnknownBlock(u64),
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::Medium(m) => write!(f, "medium {m:?} is not {MEDIUM_GPU}"),
            Skip::BlockSize(b) => write!(f, "block size {b} differs from the configured one"),
            Skip::Malformed(why) => write!(f, "malformed event: {why}"),
            Skip::UnknownTag(t) => write!(f, "unknown event tag {t:?}"),
            Skip::UnknownParent(h) => write!(f, "parent block {h:#x} is not held"),
            Skip::UnknownBlock(h) => write!(f, "removed block {h:#x} was never stored"),
        }
    }
}

/// The index's settings (one per data plane: every endpoint hashes alike).
#[derive(Debug, Clone, PartialEq)]
pub struct KvConfig {
    pub block_size: usize,
    pub seed: u64,
    pub capacity_blocks: usize,
    /// None: an endpoint's entries never go stale while its stream is connected.
    pub stale_after_s: Option<f64>,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            seed: 0,
            capacity_blocks: DEFAULT_CAPACITY_BLOCKS,
            stale_after_s: None,
        }
    }
}

impl KvConfig {
    pub fn check(self) -> Result<Self> {
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(invalid(format!(
                "block_size must be in [1, {MAX_BLOCK_SIZE}], got {}",
                self.block_size
            )));
        }
        if self.capacity_blocks == 0 || self.capacity_blocks > MAX_CAPACITY_BLOCKS {
            return Err(invalid(format!(
                "capacity_blocks must be in [1, {MAX_CAPACITY_BLOCKS}], got {}",
                self.capacity_blocks
            )));
        }
        if let Some(s) = self.stale_after_s {
            if !(s.is_finite() && s > 0.0) {
                return Err(invalid("stale_after_s must be > 0 (or None)"));
            }
        }
        Ok(self)
    }
}

/// An endpoint's counters, as the metrics and the Python handle show them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvStats {
    /// Batches applied (in order, replayed ones included).
    pub batches: u64,
    /// Events applied, in whole or in part (see `Skip`).
    pub events: u64,
    /// Events or block hashes skipped (see `Skip`).
    pub skipped: u64,
    /// Frames that were not a batch (bad framing or msgpack).
    pub garbage: u64,
    pub duplicates: u64,
    /// Sequence gaps seen, and how many of them replay closed.
    pub gaps: u64,
    pub replays: u64,
    /// Gaps replay could not close (the endpoint was cleared).
    pub unrecovered: u64,
    pub restarts: u64,
    /// Clears: `AllBlocksCleared`, restarts, unrecovered gaps.
    pub clears: u64,
    pub evicted: u64,
    /// Blocks held now.
    pub blocks: u64,
    pub last_seq: Option<u64>,
    pub live: bool,
}

/// Which endpoints' entries answer queries (see the module docs): a bit per
/// endpoint id for "its stream is connected" and one for "stale". Kept
/// beside the table, where a query reads them for every endpoint at once;
/// an endpoint changes its own bits, under its own lock.
#[derive(Debug, Default)]
struct Liveness {
    connected: Vec<AtomicU64>,
    stale: Vec<AtomicU64>,
}

impl Liveness {
    fn grow(&mut self, endpoints: usize) {
        let words = endpoints.div_ceil(64);
        self.connected.resize_with(words, AtomicU64::default);
        self.stale.resize_with(words, AtomicU64::default);
    }
    fn get(bits: &[AtomicU64], id: u32) -> bool {
        bits[id as usize / 64].load(Ordering::Relaxed) >> (id % 64) & 1 == 1
    }
    /// Sets bit `id` of `bits` to `on`; returns what it was.
    fn set(bits: &[AtomicU64], id: u32, on: bool) -> bool {
        let bit = 1 << (id % 64);
        let w = &bits[id as usize / 64];
        let old = match on {
            true => w.fetch_or(bit, Ordering::Relaxed),
            false => w.fetch_and(!bit, Ordering::Relaxed),
        };
        old & bit != 0
    }
    fn live(&self, id: u32) -> bool {
        Self::get(&self.connected, id) && !Self::get(&self.stale, id)
    }
    /// Word `w` of the set of live endpoints (none past the endpoints added:
    /// a table of no endpoint still has a word).
    fn live_word(&self, w: usize) -> u64 {
        match (self.connected.get(w), self.stale.get(w)) {
            (Some(c), Some(s)) => c.load(Ordering::Relaxed) & !s.load(Ordering::Relaxed),
            _ => 0,
        }
    }
}

/// An endpoint's maps are keyed by what its KV publisher sends (engine
/// block hashes) or computes from it (our hashes of its token ids): they
/// hash under per-process random seeds (foldhash's quality `RandomState`:
/// folded 64x64-bit multiplies of the key with the seeds, then one more to
/// spread every bit over the low ones, the bucket), so a publisher that
/// cannot see the seeds cannot choose keys that collide and make a probe
/// walk all of them, as it could with the identity hash (block hashes are
/// well mixed only if the publisher is honest). foldhash's fast variant
/// left keys that differ only in their high bits in a third of the buckets
/// (`keys_that_share_their_low_bits_spread_once_keyed`); SipHash, std's
/// default, guards as well at several times the cost per block.
type Keyed<V> = HashMap<u64, V, RandomState>;

/// An engine's block hash as an endpoint's map keys it, and what the
/// endpoint holds under it (our hash, and its store stamp): 4-byte aligned,
/// so that an entry takes 20 bytes rather than 24 (the map holds one per
/// held block; benches/RESULTS.md, issue 28).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C, packed(4))]
struct Engine(u64);

#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct Held {
    ours: u64,
    stamp: u32,
}

impl Held {
    fn ours(self) -> u64 {
        self.ours
    }
    fn stamp(self) -> u32 {
        self.stamp
    }
}

#[derive(Debug, Default)]
struct EndpointKv {
    /// Its id in the table.
    id: u32,
    /// Engine hash -> our hash and store stamp: the blocks it holds.
    blocks: HashMap<Engine, Held, RandomState>,
    /// Our hashes held under more than one engine hash: how many more (the
    /// table holds such a block for the endpoint until the last one goes).
    aliases: Keyed<u32>,
    /// The last store's stamp (stamps are renumbered from 1 before they
    /// would pass `u32::MAX`).
    stamp: u32,
    /// A disconnect was seen: an older sequence number next is a restart.
    resync: bool,
    /// When the engine was last heard from (an event or [`KvIndex::heard`]).
    last_heard: Option<f64>,
    stats: KvStats,
}

impl EndpointKv {
    fn clear(&mut self, t: &mut Table) {
        for (_, held) in self.blocks.drain() {
            t.remove(held.ours(), self.id);
        }
        self.aliases.clear();
        self.stats.clears += 1;
    }
    /// The stream followed so far is gone (an engine restart): clears and
    /// forgets its sequence number.
    fn restart(&mut self, t: &mut Table) {
        self.stats.restarts += 1;
        self.stats.last_seq = None;
        self.clear(t);
    }
    /// Heard from the engine at `now`: whether that revived the endpoint.
    fn hear(&mut self, l: &Liveness, now: f64) -> bool {
        self.last_heard = Some(now);
        Liveness::set(&l.stale, self.id, false) && Liveness::get(&l.connected, self.id)
    }
    /// The table holds `ours` (of link `link`) for this endpoint (once
    /// more, if it did).
    fn hold(&mut self, t: &mut Table, ours: u64, link: u64) {
        if !t.add(ours, link, self.id) {
            *self.aliases.entry(ours).or_insert(0) += 1;
        }
    }
    /// One engine hash naming `ours` is gone.
    fn release(&mut self, t: &mut Table, ours: u64) {
        if self.aliases.is_empty() {
            t.remove(ours, self.id);
            return;
        }
        match self.aliases.get_mut(&ours) {
            Some(1) => {
                self.aliases.remove(&ours);
            }
            Some(more) => *more -= 1,
            None => {
                t.remove(ours, self.id);
            }
        }
    }
    fn insert(&mut self, t: &mut Table, ours: u64, link: u64, engine: u64) {
        if self.stamp == u32::MAX {
            self.renumber();
        }
        self.stamp += 1;
        let held = Held {
            ours,
            stamp: self.stamp,
        };
        match self.blocks.insert(Engine(engine), held).map(Held::ours) {
            Some(old) if old == ours => {}
            Some(old) => {
                self.release(t, old);
                self.hold(t, ours, link);
            }
            None => self.hold(t, ours, link),
        }
    }
    /// Numbers the stamps 1, 2, ... in their order (the blocks are fewer
    /// than `MAX_CAPACITY_BLOCKS` plus one event's, far below `u32::MAX`).
    fn renumber(&mut self) {
        let mut order: Vec<(u32, u64)> = self
            .blocks
            .iter()
            .map(|(&Engine(e), h)| (h.stamp(), e))
            .collect();
        order.sort_unstable();
        self.stamp = 0;
        for (_, e) in order {
            self.stamp += 1;
            if let Some(h) = self.blocks.get_mut(&Engine(e)) {
                h.stamp = self.stamp;
            }
        }
    }
    /// Forgets the block the engine names `engine`; false if it held none.
    fn remove(&mut self, t: &mut Table, engine: u64) -> bool {
        match self.blocks.remove(&Engine(engine)) {
            Some(held) => {
                self.release(t, held.ours());
                true
            }
            None => false,
        }
    }
    /// Forgets the least recently stored blocks down to 7/8 of `capacity`.
    fn evict(&mut self, t: &mut Table, capacity: usize) {
        if self.blocks.len() <= capacity {
            return;
        }
        let keep = capacity - capacity / 8;
        let mut stamps: Vec<u32> = self.blocks.values().map(|h| h.stamp()).collect();
        let cut = stamps.len() - keep;
        let (_, &mut oldest_kept, _) = stamps.select_nth_unstable(cut);
        let before = self.blocks.len();
        let mut gone = Vec::with_capacity(cut);
        self.blocks.retain(|_, h| {
            let keep = h.stamp() >= oldest_kept;
            if !keep {
                gone.push(h.ours());
            }
            keep
        });
        for ours in gone {
            self.release(t, ours);
        }
        self.stats.evicted += (before - self.blocks.len()) as u64;
    }
}

/// What `observe` makes of a batch's sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seq {
    /// The next batch (or the first one seen): apply it.
    Next,
    /// Seen already: skip it.
    Duplicate,
    /// Batches `from..seq` were missed: replay them, then apply.
    Gap { from: u64 },
    /// The engine restarted: its entries were cleared; apply.
    Restart,
}

/// What one batch did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Applied {
    pub events: usize,
    pub skipped: Vec<Skip>,
    /// The endpoint just went back to live (the caller logs the switch).
    pub revived: bool,
}

/// The seed a LoRA adapter's blocks chain from (the base model's is `seed`).
pub fn lora_seed(seed: u64, lora: Option<&str>) -> u64 {
    match lora {
        None => seed,
        Some(name) => xxh3_64_with_seed(name.as_bytes(), seed),
    }
}

type Shared = Arc<Mutex<EndpointKv>>;

/// What a query reads: the table and which endpoints are live.
#[derive(Debug, Default)]
struct Blocks {
    table: Table,
    liveness: Liveness,
    /// Endpoints added (ids below this are taken).
    endpoints: usize,
}

/// Every endpoint's precise prefix entries (see the module docs). Shared
/// between the event subscribers (writers) and the scorers (readers). Locks
/// are taken in the order `endpoints`, an endpoint, `blocks`.
#[derive(Debug)]
pub struct KvIndex {
    config: KvConfig,
    /// This index's number in the process (what a [`KvHeld`] names).
    number: u64,
    endpoints: RwLock<HashMap<String, Shared>>,
    blocks: RwLock<Blocks>,
}

impl Default for KvIndex {
    /// The default configuration, no endpoints.
    fn default() -> Self {
        Self {
            config: KvConfig::default(),
            number: next_number(),
            endpoints: RwLock::new(HashMap::new()),
            blocks: RwLock::default(),
        }
    }
}

/// A number no other index of the process has (never 0).
fn next_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What one walk (`KvIndex::walk_prompt`) found of a prompt: how many of
/// its leading blocks every endpoint live then holds. `held_into` answers
/// for a picker's candidates as `match_hashes` did at the walk. Empty (it
/// answers nothing) until a walk fills it; reused, no allocation per walk
/// once the fleet's size was seen.
#[derive(Debug, Clone, Default)]
pub struct KvHeld {
    /// The index walked (`KvIndex::number`; 0: none).
    index: u64,
    /// The chain's seed: the adapter's.
    seed: u64,
    /// The prompt's full blocks.
    blocks: usize,
    /// The endpoints live at the walk, a bitset.
    live: Vec<u64>,
    /// Per endpoint id, the leading blocks it holds.
    depth: Vec<u32>,
}

impl KvHeld {
    /// Forgets the walk: answers nothing until the next.
    pub fn clear(&mut self) {
        self.index = 0;
    }

    /// When this is `kv`'s walk of a prompt for `adapter`: per endpoint of
    /// `ids` (from `kv.endpoint_ids`) the leading blocks it held, into
    /// `held` (cleared first; None for an endpoint not live then or a None
    /// id), and the prompt's full blocks, as `kv.match_hashes` over the
    /// prompt's hashes answered at the walk. None (and `held` untouched)
    /// for another index's walk, another adapter's, or none.
    pub fn held_into(
        &self,
        kv: &KvIndex,
        adapter: Option<&str>,
        ids: &[Option<u32>],
        held: &mut Vec<Option<usize>>,
    ) -> Option<usize> {
        if self.index != kv.number || self.seed != lora_seed(kv.config.seed, adapter) {
            return None;
        }
        held_of(&self.live, &self.depth, ids, held);
        Some(self.blocks)
    }
}

/// Per endpoint of `ids`, its depth when it is in `live`.
fn held_of(live: &[u64], depth: &[u32], ids: &[Option<u32>], held: &mut Vec<Option<usize>>) {
    held.clear();
    held.extend(ids.iter().map(|id| {
        let id = (*id)? as usize;
        (live.get(id / 64)? >> (id % 64) & 1 == 1).then(|| depth[id] as usize)
    }));
}

fn lock(e: &Shared) -> MutexGuard<'_, EndpointKv> {
    e.lock().unwrap_or_else(|p| p.into_inner())
}

impl KvIndex {
    pub fn new(config: KvConfig) -> Result<Self> {
        Ok(Self {
            config: config.check()?,
            number: next_number(),
            endpoints: RwLock::new(HashMap::new()),
            blocks: RwLock::default(),
        })
    }

    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    fn read_blocks(&self) -> RwLockReadGuard<'_, Blocks> {
        self.blocks.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_blocks(&self) -> RwLockWriteGuard<'_, Blocks> {
        self.blocks.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `name` (no entries, not live); an endpoint already there is kept.
    /// Its id (`endpoint_ids`) is the number of endpoints added before it.
    pub fn add_endpoint(&self, name: &str) {
        let mut endpoints = self.endpoints.write().unwrap_or_else(|p| p.into_inner());
        if endpoints.contains_key(name) {
            return;
        }
        let e = EndpointKv {
            id: endpoints.len() as u32,
            ..EndpointKv::default()
        };
        // In the table before anyone can find it by name.
        let mut blocks = self.write_blocks();
        blocks.endpoints += 1;
        let count = blocks.endpoints;
        blocks.table.grow(count);
        blocks.liveness.grow(count);
        drop(blocks);
        endpoints.insert(name.to_owned(), Arc::new(Mutex::new(e)));
    }

    /// The endpoint names, sorted.
    pub fn endpoints(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// How many endpoints were added: the ids of `endpoint_ids` hold while
    /// it is unchanged (an endpoint keeps its id; only new names get one).
    pub fn endpoint_count(&self) -> usize {
        self.read_blocks().endpoints
    }

    /// The ids of `names` for `match_prompt` (None for a name not added).
    pub fn endpoint_ids(&self, names: &[String]) -> Vec<Option<u32>> {
        let endpoints = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        names
            .iter()
            .map(|n| endpoints.get(n).map(|e| lock(e).id))
            .collect()
    }

    fn get(&self, name: &str) -> Result<Shared> {
        self.endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| unknown("endpoint", name))
    }

    /// Classifies batch `seq` of `name` and counts duplicates and gaps; a
    /// restart clears the endpoint.
    pub fn observe(&self, name: &str, seq: u64) -> Result<Seq> {
        let e = self.get(name)?;
        let mut e = lock(&e);
        let verdict = match e.stats.last_seq {
            None if seq == 0 => Seq::Next,
            None => Seq::Gap { from: 0 },
            Some(last) if seq == last.wrapping_add(1) => Seq::Next,
            Some(last) if seq > last => Seq::Gap { from: last + 1 },
            Some(last) if (seq == 0 && last > 0) || e.resync => Seq::Restart,
            Some(_) => Seq::Duplicate,
        };
        e.resync = false;
        match verdict {
            Seq::Duplicate => e.stats.duplicates += 1,
            Seq::Gap { .. } => e.stats.gaps += 1,
            Seq::Restart => e.restart(&mut self.write_blocks().table),
            Seq::Next => {}
        }
        Ok(verdict)
    }

    /// Whether batch `seq` can be applied next (during a replay): the next
    /// number, or any while `name` follows no stream yet (see the module docs).
    pub fn expects(&self, name: &str, seq: u64) -> Result<bool> {
        let e = self.get(name)?;
        let last = lock(&e).stats.last_seq;
        Ok(last.is_none_or(|l| seq == l.wrapping_add(1)))
    }

    /// The engine's replay showed that the stream `name` followed is not the
    /// one it publishes now (a restart while no batch came): clears `name`
    /// and forgets its sequence number, counted as a restart.
    pub fn restarted(&self, name: &str) -> Result<()> {
        lock(&self.get(name)?).restart(&mut self.write_blocks().table);
        Ok(())
    }

    /// The engine answered at `now` and nothing was missed (a replay that
    /// ended without a gap): liveness as from an event. Returns whether the
    /// endpoint went back to live (the caller logs the switch).
    pub fn heard(&self, name: &str, now: f64) -> Result<bool> {
        Ok(lock(&self.get(name)?).hear(&self.read_blocks().liveness, now))
    }

    /// Counts a gap that replay closed.
    pub fn replayed(&self, name: &str) -> Result<()> {
        lock(&self.get(name)?).stats.replays += 1;
        Ok(())
    }

    /// A gap replay could not close: clears `name` (the missed batches may
    /// have removed blocks) and forgets its sequence number.
    pub fn unrecovered(&self, name: &str) -> Result<()> {
        let e = self.get(name)?;
        let mut e = lock(&e);
        e.stats.unrecovered += 1;
        e.stats.last_seq = None;
        e.clear(&mut self.write_blocks().table);
        Ok(())
    }

    /// Counts a frame that was not a batch.
    pub fn garbage(&self, name: &str) -> Result<()> {
        lock(&self.get(name)?).stats.garbage += 1;
        Ok(())
    }

    /// Batch `seq` (already `observe`d) of `name` could not be read (not a
    /// batch, or over a limit) at `now`: counted as garbage, its number is
    /// consumed (it is no gap) and the endpoint cleared, since what it said,
    /// removals too, is unknown.
    pub fn refused(&self, name: &str, seq: u64, now: f64) -> Result<Applied> {
        let e = self.get(name)?;
        let mut e = lock(&e);
        e.stats.garbage += 1;
        e.clear(&mut self.write_blocks().table);
        drop(e);
        self.apply(name, seq, &[], now)
    }

    /// Applies batch `seq` (already `observe`d) of `name` at time `now`
    /// (seconds, the caller's clock). Undecodable events come as `Err(skip)`.
    pub fn apply(
        &self,
        name: &str,
        seq: u64,
        events: &[std::result::Result<Event, Skip>],
        now: f64,
    ) -> Result<Applied> {
        let e = self.get(name)?;
        let mut e = lock(&e);
        let mut out = Applied {
            revived: e.hear(&self.read_blocks().liveness, now),
            ..Applied::default()
        };
        e.stats.last_seq = Some(seq);
        e.stats.batches += 1;
        for event in events {
            match event {
                Err(skip) => out.skipped.push(skip.clone()),
                Ok(event) => {
                    if self.apply_event(&mut e, event, &mut out.skipped) {
                        out.events += 1;
                    }
                }
            }
        }
        e.stats.events += out.events as u64;
        e.stats.skipped += out.skipped.len() as u64;
        e.stats.blocks = e.blocks.len() as u64;
        Ok(out)
    }

    /// Applies one event; false when it is skipped whole (a removal naming
    /// blocks never stored still removes the others it names). The table is
    /// locked per event, after its blocks are hashed.
    fn apply_event(&self, e: &mut EndpointKv, event: &Event, skipped: &mut Vec<Skip>) -> bool {
        match event {
            Event::Cleared => e.clear(&mut self.write_blocks().table),
            Event::Removed { hashes, medium } => {
                if let Some(m) = medium.as_deref().filter(|m| *m != MEDIUM_GPU) {
                    skipped.push(Skip::Medium(m.to_owned()));
                    return false;
                }
                let before = skipped.len();
                let mut blocks = self.write_blocks();
                for h in hashes {
                    if !e.remove(&mut blocks.table, *h) {
                        skipped.push(Skip::UnknownBlock(*h));
                    }
                }
                return hashes.is_empty() || skipped.len() - before < hashes.len();
            }
            Event::Stored(s) => match self.stored_hashes(e, s) {
                Err(skip) => {
                    skipped.push(skip);
                    return false;
                }
                Ok((ours, parent, seed)) => {
                    let mut blocks = self.write_blocks();
                    let t = &mut blocks.table;
                    // The links chain from the parent's (held by this
                    // endpoint, so in the table).
                    let Some(mut link) = parent.map_or(Some(seed), |p| t.link_of(p)) else {
                        skipped.push(Skip::UnknownParent(s.parent.unwrap_or_default()));
                        return false;
                    };
                    let mut links = Links::new(self.config.block_size);
                    let ids = s.token_ids.chunks_exact(self.config.block_size);
                    for ((o, &engine), block) in ours.into_iter().zip(&s.hashes).zip(ids) {
                        link = links.link(link, block, seed);
                        e.insert(t, o, link, engine);
                    }
                    // Per event: a large batch never holds more than one
                    // event's blocks past the capacity.
                    e.evict(t, self.config.capacity_blocks);
                }
            },
        }
        true
    }

    /// Our hashes of a `BlockStored`'s blocks, the parent's (None: the
    /// blocks chain from the seed) and the chain's seed, or why it is
    /// skipped.
    fn stored_hashes(
        &self,
        e: &EndpointKv,
        s: &Stored,
    ) -> std::result::Result<(Vec<u64>, Option<u64>, u64), Skip> {
        if let Some(m) = s.medium.as_deref().filter(|m| *m != MEDIUM_GPU) {
            return Err(Skip::Medium(m.to_owned()));
        }
        let bs = self.config.block_size;
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
        let seed = lora_seed(self.config.seed, s.lora.as_deref());
        let parent = match s.parent {
            None => None,
            Some(p) => Some(
                e.blocks
                    .get(&Engine(p))
                    .ok_or(Skip::UnknownParent(p))?
                    .ours(),
            ),
        };
        // The block size was checked with the config (at least 1).
        let ours = IdChain::new(&s.token_ids, bs, seed, parent.unwrap_or(seed)).collect();
        Ok((ours, parent, seed))
    }

    /// The stream of `name` connected (true) or dropped (false). Returns
    /// whether the endpoint's liveness changed (the caller logs the switch).
    pub fn set_connected(&self, name: &str, connected: bool) -> Result<bool> {
        let e = self.get(name)?;
        let mut e = lock(&e);
        if !connected {
            e.resync = true;
        }
        let blocks = self.read_blocks();
        let l = &blocks.liveness;
        let was = l.live(e.id);
        Liveness::set(&l.connected, e.id, connected);
        Ok(was != l.live(e.id))
    }

    /// Marks `name` stale when it was not heard from for `stale_after_s` by
    /// `now`; returns whether that changed its liveness.
    pub fn check_stale(&self, name: &str, now: f64) -> Result<bool> {
        let Some(after) = self.config.stale_after_s else {
            return Ok(false);
        };
        let e = self.get(name)?;
        let mut e = lock(&e);
        let last = *e.last_heard.get_or_insert(now);
        let blocks = self.read_blocks();
        let l = &blocks.liveness;
        let was = l.live(e.id);
        Liveness::set(&l.stale, e.id, now - last > after);
        Ok(was != l.live(e.id))
    }

    pub fn stats(&self, name: &str) -> Result<KvStats> {
        let e = self.get(name)?;
        let e = lock(&e);
        let mut stats = e.stats.clone();
        stats.blocks = e.blocks.len() as u64;
        stats.live = self.read_blocks().liveness.live(e.id);
        Ok(stats)
    }

    /// A request's block hashes as the index keys them (`adapter`: its LoRA).
    pub fn request_hashes(&self, token_ids: &[u32], adapter: Option<&str>) -> Vec<u64> {
        let mut out = Vec::new();
        self.request_hashes_into(token_ids, adapter, &mut out);
        out
    }

    /// `request_hashes` into `out` (cleared first; its buffer is reused):
    /// the chain of `block_hashes(token_ids, block_size, lora_seed)`, with
    /// the hashes of the blocks the table holds in runs read from it
    /// instead of chained (see `Table::hashes`).
    pub fn request_hashes_into(
        &self,
        token_ids: &[u32],
        adapter: Option<&str>,
        out: &mut Vec<u64>,
    ) {
        out.clear();
        out.reserve(token_ids.len() / self.config.block_size);
        self.with_prompt(token_ids, adapter, |prompt, _| {
            let from = Stop::start(prompt.seed);
            self.read_blocks().table.hashes(prompt, from, out)
        });
    }

    /// `request_hashes_into` and `match_prompt` for every live endpoint in
    /// one walk (what a picker asks before it knows its candidates): the
    /// prompt's chained hashes into `hashes` (cleared first), and into
    /// `held` how many of its leading blocks each endpoint live now holds
    /// (read with `KvHeld::held_into`). The walk reads the hashes of the
    /// blocks it goes through from the table, and the chain continues
    /// from where it stopped as `request_hashes_into` does.
    pub fn walk_prompt(
        &self,
        token_ids: &[u32],
        adapter: Option<&str>,
        hashes: &mut Vec<u64>,
        held: &mut KvHeld,
    ) {
        hashes.clear();
        hashes.reserve(token_ids.len() / self.config.block_size);
        self.with_prompt(token_ids, adapter, |prompt, (_, alive)| {
            let blocks = self.read_blocks();
            let words = blocks.table.words();
            held.live.clear();
            held.live
                .extend((0..words).map(|w| blocks.liveness.live_word(w)));
            // The walk writes only those it settles: the others hold none.
            held.depth.clear();
            held.depth.resize(blocks.endpoints, 0);
            alive.clear();
            alive.extend_from_slice(&held.live);
            let depth = &mut held.depth;
            let stop = blocks.table.walk(
                alive,
                prompt,
                |h| hashes.push(h),
                |id, n| depth[id as usize] = n as u32,
            );
            blocks.table.hashes(prompt, stop, hashes);
            held.index = self.number;
            held.seed = prompt.seed;
            held.blocks = prompt.blocks();
        });
    }

    /// Calls `f` with the prompt of `token_ids` for `adapter`'s chain (its
    /// steps from this thread's scratch) and the scratch's depths and masks.
    fn with_prompt<R>(
        &self,
        token_ids: &[u32],
        adapter: Option<&str>,
        f: impl FnOnce(&mut Ids<'_>, (&mut Vec<u32>, &mut Vec<u64>)) -> R,
    ) -> R {
        let seed = lora_seed(self.config.seed, adapter);
        let bs = self.config.block_size;
        SCRATCH.with_borrow_mut(|scratch| {
            let Scratch {
                depth,
                masks,
                step,
                links,
            } = scratch;
            if step.as_ref().is_none_or(|(key, _)| *key != (bs, seed)) {
                *step = None;
            }
            if links
                .as_ref()
                .is_none_or(|(size, l)| *size != bs || !l.current())
            {
                *links = None;
            }
            let (_, step) = step.get_or_insert_with(|| ((bs, seed), BlockStep::new(bs, seed)));
            let (_, links) = links.get_or_insert_with(|| (bs, Links::new(bs)));
            let mut prompt = Ids {
                ids: token_ids,
                block_size: bs,
                seed,
                step,
                links,
            };
            f(&mut prompt, (depth, masks))
        })
    }

    /// How many of `hashes` (a request's, from `request_hashes`) `name` holds
    /// from the first on; None when `name` is unknown or not live.
    pub fn leading_blocks(&self, name: &str, hashes: &[u64]) -> Option<usize> {
        let id = lock(&self.get(name).ok()?).id;
        let blocks = self.read_blocks();
        blocks
            .liveness
            .live(id)
            .then(|| blocks.table.leading(hashes, id))
    }

    /// Per endpoint of `ids` (from `endpoint_ids`), how many of the prompt's
    /// leading blocks (`token_ids` cut into blocks, chained from `adapter`'s
    /// seed) its engine holds, into `held` (cleared first): None for an
    /// endpoint that is not live or a None id. Returns the prompt's full
    /// blocks. One walk for all endpoints, hashing each block as it goes: it
    /// stops at the first block none of them holds.
    pub fn match_prompt(
        &self,
        token_ids: &[u32],
        adapter: Option<&str>,
        ids: &[Option<u32>],
        held: &mut Vec<Option<usize>>,
    ) -> usize {
        self.with_prompt(token_ids, adapter, |prompt, (depth, masks)| {
            self.match_with(prompt, ids, held, depth, masks)
        });
        token_ids.len() / self.config.block_size
    }

    /// Whether this index keys a prompt's blocks with the chain of
    /// `block_hashes(tokens, block_size, seed)` for `adapter`'s requests:
    /// the same block size, and the adapter's seed (`lora_seed`) equal to
    /// `seed`. Then `match_hashes` over those hashes answers as
    /// `match_prompt` over the tokens.
    pub fn keys_like(&self, block_size: usize, seed: u64, adapter: Option<&str>) -> bool {
        self.config.block_size == block_size && lora_seed(self.config.seed, adapter) == seed
    }

    /// `match_prompt` for a prompt hashed already: `hashes` are its chained
    /// block hashes as this index keys them (`request_hashes`, or any chain
    /// `keys_like` accepts). Hashes nothing.
    pub fn match_hashes(
        &self,
        hashes: &[u64],
        ids: &[Option<u32>],
        held: &mut Vec<Option<usize>>,
    ) -> usize {
        SCRATCH.with_borrow_mut(|s| {
            self.match_with(&mut Hashed(hashes), ids, held, &mut s.depth, &mut s.masks)
        });
        hashes.len()
    }

    fn match_with(
        &self,
        prompt: &mut impl Prompt,
        ids: &[Option<u32>],
        held: &mut Vec<Option<usize>>,
        depth: &mut Vec<u32>,
        masks: &mut Vec<u64>,
    ) {
        let blocks = self.read_blocks();
        let words = blocks.table.words();
        // The endpoints asked about that are live, and a copy the walk
        // leaves alone.
        masks.clear();
        masks.resize(2 * words, 0);
        let (asked, alive) = masks.split_at_mut(words);
        depth.resize(depth.len().max(blocks.endpoints), 0);
        for &id in ids
            .iter()
            .flatten()
            .filter(|&&id| (id as usize) < blocks.endpoints)
        {
            asked[id as usize / 64] |= 1 << (id % 64);
            // The walk writes only those it settles: the others hold none.
            depth[id as usize] = 0;
        }
        for (w, (a, b)) in asked.iter_mut().zip(alive.iter_mut()).enumerate() {
            *a &= blocks.liveness.live_word(w);
            *b = *a;
        }
        blocks
            .table
            .walk(alive, prompt, |_| (), |id, n| depth[id as usize] = n as u32);
        held_of(asked, depth, ids, held);
    }

    /// `name`'s blocks (our hashes), sorted: replicas fed the same events agree.
    pub fn blocks(&self, name: &str) -> Result<Vec<u64>> {
        let e = self.get(name)?;
        let mut out: Vec<u64> = lock(&e).blocks.values().map(|h| h.ours()).collect();
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
