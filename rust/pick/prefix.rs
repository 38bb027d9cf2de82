//! Scorers `prefix` and `precise-prefix`: the share of the prompt's leading
//! blocks each candidate holds (`held / blocks`), from one of two sources.
//!
//! - **Approximate** (`prefix`, AIBrix's "prefix cache aware" algorithm):
//!   routecore's `PrefixIndex` of what it routed, matched with the request's
//!   block hashes (`PickRequest::hashes`) and guarded by the candidates'
//!   loads (`EndpointState::load`): every candidate scores 0 when the loads
//!   are imbalanced (`max - min` above `imbalance_abs_count`), and one whose
//!   load is above `mean + std_factor * std` scores 0 (the hot-spot guard).
//!   With the max-score picker and ties to the least-loaded this is AIBrix's
//!   decision exactly (the `prefix` preset, `PrefixCacheRouter`).
//! - **Precise** (`precise-prefix`, llm-d's precise prefix-cache scorer and
//!   Dynamo's KV router): what the engine actually holds, from its KV-cache
//!   events (`crate::kv::KvIndex`), for a request with token ids
//!   (`PickRequest::token_ids`, hashed as the index keys blocks: its block
//!   size, the request's adapter's seed). No load guard: the engine says
//!   what it holds, and the load scorers weigh the rest.
//!
//! A precise scorer scores approximately every candidate the KV index cannot
//! answer for: a request without token ids, an endpoint whose event stream is
//! down or stale, a pipeline without a KV index. `started` records every
//! routed prompt in the approximate index, so that fallback stays warm.

use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::plugin::{params, Built, Describe, Kind, Needs, Scorer, Shared};
use super::{Ctx, PickConfig, PickRequest, Recorded};
use crate::error::{invalid, Result};
use crate::kv::KvIndex;
use crate::prefix::{lock, PrefixConfig, PrefixIndex, DEFAULT_CAPACITY_BLOCKS, NO_SLOT};
use crate::snapshot::{Reader, Writer};

#[derive(Debug, Clone)]
pub struct PrefixScorer {
    config: PrefixConfig,
    index: Arc<Mutex<PrefixIndex>>,
    /// The index ids of the endpoints, valid while the index's names
    /// generation is `ids_gen`.
    ids: Vec<u32>,
    /// Index id -> endpoint (`NO_SLOT` for other routers' endpoints).
    slot_of: Vec<usize>,
    ids_gen: Option<u64>,
    /// Per endpoint, the leading blocks it held at the last pick.
    matched: Vec<usize>,
    /// The slots the last match walked, at slot generation `found_gen`.
    found: Vec<u32>,
    found_gen: u64,
    /// The engines' KV-event index (`precise-prefix`); None: approximate only.
    kv: Option<Arc<KvIndex>>,
    /// The KV index's ids of the endpoints, valid while it has `kv_ids_for`
    /// endpoints (an id never changes; a new one may name one of ours).
    kv_ids: Vec<Option<u32>>,
    kv_ids_for: Option<usize>,
    /// Scratch of the precise source: the candidates' KV ids, what the KV
    /// index answered for each, and whether it answered.
    kv_cand: Vec<Option<u32>>,
    kv_held: Vec<Option<usize>>,
    precise: Vec<bool>,
}

impl PrefixScorer {
    /// `kv`: the KV-event index a precise scorer asks first (None: `prefix`).
    pub fn new(
        config: PrefixConfig,
        index: Arc<Mutex<PrefixIndex>>,
        kv: Option<Arc<KvIndex>>,
    ) -> Self {
        Self {
            config,
            index,
            ids: Vec::new(),
            slot_of: Vec::new(),
            ids_gen: None,
            matched: Vec::new(),
            found: Vec::new(),
            found_gen: u64::MAX,
            kv,
            kv_ids: Vec::new(),
            kv_ids_for: None,
            kv_cand: Vec::new(),
            kv_held: Vec::new(),
            precise: Vec::new(),
        }
    }

    pub fn config(&self) -> &PrefixConfig {
        &self.config
    }
    pub fn index(&self) -> &Arc<Mutex<PrefixIndex>> {
        &self.index
    }
    /// The engines' KV-event index a precise scorer reads (None: approximate).
    pub fn kv(&self) -> Option<&Arc<KvIndex>> {
        self.kv.as_ref()
    }
    /// The leading blocks `endpoint` held at the last pick.
    pub fn matched(&self, endpoint: usize) -> usize {
        self.matched.get(endpoint).copied().unwrap_or(0)
    }

    /// The leading blocks of `hashes` that routecore's own index holds for
    /// `endpoint` (what it placed there and what it learned), now: the
    /// cached part of a prompt on one endpoint (the P/D decider's).
    pub fn held(
        &mut self,
        hashes: &[u64],
        names: &[String],
        endpoint: usize,
        now: f64,
    ) -> Result<usize> {
        let index = Arc::clone(&self.index);
        let mut index = lock(&index);
        self.ensure_ids(&mut index, names)?;
        self.matched.clear();
        self.matched.resize(names.len(), 0);
        index.match_into(
            hashes,
            now,
            &self.slot_of,
            &mut self.matched,
            &mut self.found,
        );
        self.found_gen = index.slots_gen();
        Ok(self.matched.get(endpoint).copied().unwrap_or(0))
    }

    /// Interns the endpoints in the index (a no-op while their ids hold).
    pub fn prepare(&mut self, names: &[String]) -> Result<()> {
        let index = Arc::clone(&self.index);
        let mut index = lock(&index);
        self.ensure_ids(&mut index, names)
    }

    fn ensure_ids(&mut self, index: &mut PrefixIndex, names: &[String]) -> Result<()> {
        if self.ids_gen == Some(index.names_gen()) && self.ids.len() == names.len() {
            return Ok(());
        }
        self.ids = index.ids_for(names)?;
        self.slot_of.clear();
        self.slot_of.resize(index.id_count(), NO_SLOT);
        for (slot, &id) in self.ids.iter().enumerate() {
            self.slot_of[id as usize] = slot;
        }
        self.ids_gen = Some(index.names_gen());
        Ok(())
    }

    pub(super) fn score(
        &mut self,
        req: &PickRequest<'_>,
        ctx: &Ctx<'_>,
        out: &mut [f64],
    ) -> Result<()> {
        out.fill(0.0);
        self.precise.clear();
        self.precise.resize(ctx.cand.len(), false);
        if let (Some(kv), Some(ids)) = (&self.kv, req.token_ids) {
            let count = kv.endpoint_count();
            if self.kv_ids_for != Some(count) || self.kv_ids.len() != ctx.names.len() {
                self.kv_ids = kv.endpoint_ids(ctx.names);
                self.kv_ids_for = Some(count);
            }
            // The answers of the walk that hashed the prompt, read per
            // candidate; else the prompt is hashed once for both indexes
            // where their chains agree.
            let all = match req.kv_held.and_then(|h| h.walked(kv, req.adapter)) {
                Some(walked) => {
                    let ids = &self.kv_ids;
                    let held = ctx.cand.iter().map(|&c| walked.held(ids[c]));
                    precise_shares(held, walked.blocks(), out, &mut self.precise)
                }
                None => {
                    self.kv_cand.clear();
                    self.kv_cand
                        .extend(ctx.cand.iter().map(|&c| self.kv_ids[c]));
                    let c = &self.config;
                    let blocks =
                        if req.hashes_of_ids && kv.keys_like(c.block_size, c.seed, req.adapter) {
                            kv.match_hashes(req.hashes, &self.kv_cand, &mut self.kv_held)
                        } else {
                            kv.match_prompt(ids, req.adapter, &self.kv_cand, &mut self.kv_held)
                        };
                    let held = self.kv_held.iter().copied();
                    precise_shares(held, blocks, out, &mut self.precise)
                }
            };
            if all {
                return Ok(());
            }
        }
        self.approximate(req, ctx, out)
    }

    /// Scores the candidates the KV index did not answer for from the
    /// approximate index, behind the load guards (over every candidate).
    fn approximate(&mut self, req: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()> {
        let index = Arc::clone(&self.index);
        let mut index = lock(&index);
        self.ensure_ids(&mut index, ctx.names)?;
        self.matched.clear();
        self.matched.resize(ctx.names.len(), 0);
        index.match_into(
            req.hashes,
            req.now,
            &self.slot_of,
            &mut self.matched,
            &mut self.found,
        );
        self.found_gen = index.slots_gen();
        drop(index);

        let load = |k: usize| ctx.states[ctx.cand[k]].load();
        let m = ctx.cand.len();
        let (mut lo, mut hi, mut sum) = (f64::INFINITY, f64::NEG_INFINITY, 0.0);
        for k in 0..m {
            let l = load(k);
            lo = lo.min(l);
            hi = hi.max(l);
            sum += l;
        }
        let blocks = req.hashes.len();
        if hi - lo > self.config.imbalance_abs_count as f64 || blocks == 0 {
            return Ok(());
        }
        let mean = sum / m as f64;
        let var = (0..m)
            .map(|k| (load(k) - mean) * (load(k) - mean))
            .sum::<f64>()
            / m as f64;
        let limit = mean + self.config.std_factor * var.sqrt();
        for (k, o) in out.iter_mut().enumerate() {
            if !self.precise[k] && load(k) <= limit {
                *o = share(self.matched[ctx.cand[k]], blocks);
            }
        }
        Ok(())
    }

    /// Records the prompt's blocks for `endpoint` (and in `recorded`, when
    /// given, the blocks recorded and those it did not hold before).
    pub(super) fn started(
        &mut self,
        req: &PickRequest<'_>,
        names: &[String],
        endpoint: usize,
        recorded: Option<&mut Recorded>,
    ) -> Result<()> {
        let index = Arc::clone(&self.index);
        let mut index = lock(&index);
        self.ensure_ids(&mut index, names)?;
        let added = recorded.map(|r| {
            let n = req.hashes.len().min(index.capacity());
            r.hashes = req.hashes[..n].to_vec();
            &mut r.added
        });
        index.record_id(
            req.hashes,
            &self.found,
            self.found_gen,
            self.ids[endpoint],
            req.now,
            added,
        );
        self.found.clear();
        Ok(())
    }

    /// A request recorded for `from` was served by `to`: `from` forgets the
    /// blocks the request added, `to` holds all of them.
    pub(super) fn moved(
        &mut self,
        names: &[String],
        from: usize,
        to: usize,
        recorded: &Recorded,
        now: f64,
    ) -> Result<()> {
        let index = Arc::clone(&self.index);
        let mut index = lock(&index);
        index.forget(&recorded.added, &names[from]);
        self.ensure_ids(&mut index, names)?;
        index.record_id(&recorded.hashes, &[], 0, self.ids[to], now, None);
        Ok(())
    }

    /// An endpoint was added: its id is interned at the next pick.
    pub(super) fn added(&mut self) {
        self.ids_gen = None;
        self.kv_ids_for = None;
    }

    /// An endpoint was removed: its blocks leave the index.
    pub(super) fn removed(&mut self, name: &str) -> Result<()> {
        self.ids_gen = None;
        self.kv_ids_for = None;
        let mut index = lock(&self.index);
        if index.endpoint_id(name).is_some() {
            index.remove_endpoint(name)?;
        }
        Ok(())
    }

    pub(super) fn write(&self, w: &mut Writer) {
        lock(&self.index).write(w);
    }

    pub(super) fn read(&mut self, r: &mut Reader<'_>) -> Result<()> {
        self.index = Arc::new(Mutex::new(PrefixIndex::read(r)?));
        self.ids_gen = None;
        self.kv_ids_for = None;
        Ok(())
    }
}

/// Per candidate, the KV index's answer (`held`, in candidate order) as its
/// share of `blocks` into `out`, marked in `precise`; whether every
/// candidate was answered.
fn precise_shares(
    held: impl Iterator<Item = Option<usize>>,
    blocks: usize,
    out: &mut [f64],
    precise: &mut [bool],
) -> bool {
    let mut all = true;
    for ((o, p), held) in out.iter_mut().zip(precise).zip(held) {
        match held {
            Some(held) => {
                *o = share(held, blocks);
                *p = true;
            }
            None => all = false,
        }
    }
    all
}

/// `held` of `blocks` leading blocks as a score (0 for an empty prompt).
fn share(held: usize, blocks: usize) -> f64 {
    if blocks == 0 {
        0.0
    } else {
        held as f64 / blocks as f64
    }
}

/// The parameters of `prefix` (and of `precise-prefix`, for its approximate
/// fallback): `block_size` (16), `seed` (0), `imbalance_abs_count` (16),
/// `std_factor` (2.0), `capacity_blocks` (200,000) and `ttl_s` (none) of a
/// prefix index it makes (unless `PickConfig::prefix_index` is shared).
#[derive(Debug, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Params {
    block_size: usize,
    seed: u64,
    imbalance_abs_count: u64,
    std_factor: f64,
    capacity_blocks: usize,
    ttl_s: Option<f64>,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            block_size: 16,
            seed: 0,
            imbalance_abs_count: 16,
            std_factor: 2.0,
            capacity_blocks: DEFAULT_CAPACITY_BLOCKS,
            ttl_s: None,
        }
    }
}

pub const PREFIX: Describe = Describe {
    name: "prefix",
    kind: Kind::Scorer,
    needs: Needs {
        scraped: true,
        hashes: true,
        ..Needs::NOTHING
    },
    build: |p, config| build(p, config, None),
    shared: Some(shared),
    resolve: None,
};

pub const PRECISE_PREFIX: Describe = Describe {
    name: "precise-prefix",
    kind: Kind::Scorer,
    needs: Needs {
        scraped: true,
        hashes: true,
        token_ids: true,
        kv_index: true,
    },
    build: |p, config| build(p, config, config.kv_index.clone()),
    shared: Some(shared),
    resolve: None,
};

/// The data plane sets the block size of both.
fn shared(s: &Shared) -> Value {
    serde_json::json!({ "block_size": s.prefix_block_size })
}

/// A prefix scorer from its parameters; `kv`: the KV-event index of a
/// precise one.
fn build(p: &Value, config: &PickConfig, kv: Option<Arc<KvIndex>>) -> Result<Built> {
    let p: Params = params(p)?;
    let imbalance = i64::try_from(p.imbalance_abs_count)
        .map_err(|_| invalid("imbalance_abs_count is too large"))?;
    let prefix = PrefixConfig::new(p.block_size, imbalance, p.std_factor, p.seed)?;
    let index = match &config.prefix_index {
        Some(ix) => Arc::clone(ix),
        None => Arc::new(Mutex::new(PrefixIndex::new(p.capacity_blocks, p.ttl_s)?)),
    };
    Ok(Built::Scorer(Box::new(PrefixScorer::new(
        prefix, index, kv,
    ))))
}

impl Scorer for PrefixScorer {
    fn score(&mut self, req: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()> {
        PrefixScorer::score(self, req, ctx, out)
    }
    fn prepare(&mut self, names: &[String]) -> Result<()> {
        PrefixScorer::prepare(self, names)
    }
    fn started(
        &mut self,
        req: &PickRequest<'_>,
        names: &[String],
        endpoint: usize,
        recorded: Option<&mut Recorded>,
    ) -> Result<()> {
        PrefixScorer::started(self, req, names, endpoint, recorded)
    }
    fn moved(
        &mut self,
        names: &[String],
        from: usize,
        to: usize,
        recorded: &Recorded,
        now: f64,
    ) -> Result<()> {
        PrefixScorer::moved(self, names, from, to, recorded, now)
    }
    fn added(&mut self) {
        PrefixScorer::added(self);
    }
    fn removed(&mut self, _: usize, name: &str) -> Result<()> {
        PrefixScorer::removed(self, name)
    }
    fn write(&self, w: &mut Writer) {
        PrefixScorer::write(self, w);
    }
    fn read(&mut self, r: &mut Reader<'_>, _: usize) -> Result<()> {
        PrefixScorer::read(self, r)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PickConfig, Pipeline};
    use super::*;
    use crate::endpoint::EndpointState;
    use crate::kv::{Event, KvConfig, KvHeld, Stored};
    use crate::prefix::{block_hashes, Tokens};
    use crate::rng::Rng;

    const BS: usize = 4;

    fn names() -> Vec<String> {
        (0..3).map(|i| format!("e{i}")).collect()
    }

    /// A KV index where every endpoint is live and `holder` holds `prompt`.
    fn kv_with(holder: &str, prompt: &[u32], lora: Option<&str>) -> Arc<KvIndex> {
        let kv = KvIndex::new(KvConfig {
            block_size: BS,
            ..KvConfig::default()
        })
        .expect("kv");
        for n in names() {
            kv.add_endpoint(&n);
            kv.set_connected(&n, true).expect("endpoint");
        }
        let blocks = prompt.len() / BS;
        let event = Event::Stored(Stored {
            hashes: (0..blocks as u64).collect(),
            parent: None,
            token_ids: prompt[..blocks * BS].to_vec(),
            block_size: BS,
            lora: lora.map(str::to_owned),
            medium: None,
        });
        kv.observe(holder, 0).expect("seq");
        kv.apply(holder, 0, &[Ok(event)], 0.0).expect("apply");
        Arc::new(kv)
    }

    fn pipeline(kv: &Arc<KvIndex>) -> Pipeline {
        let config = PickConfig {
            kv_index: Some(Arc::clone(kv)),
            ..PickConfig::default()
        };
        Pipeline::preset("precise-prefix", &names(), &config).expect("pipeline")
    }

    fn request<'a>(hashes: &'a [u64], ids: Option<&'a [u32]>) -> PickRequest<'a> {
        PickRequest {
            hashes,
            token_ids: ids,
            ..PickRequest::default()
        }
    }

    #[test]
    fn the_endpoint_holding_the_most_leading_blocks_wins() {
        let prompt: Vec<u32> = (0..16).collect();
        let kv = kv_with("e2", &prompt[..8], None);
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        assert_eq!(
            p.pick_one(&request(&[], Some(&prompt)), &states),
            Ok(Some(2))
        );
        // Another prompt sharing no first block: no endpoint holds it; ties
        // go to the least loaded (the first here).
        let other: Vec<u32> = (100..116).collect();
        assert_eq!(
            p.pick_one(&request(&[], Some(&other)), &states),
            Ok(Some(0))
        );
    }

    #[test]
    fn adapters_match_only_their_own_blocks() {
        let prompt: Vec<u32> = (0..8).collect();
        let kv = kv_with("e1", &prompt, Some("sql"));
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        let mut r = request(&[], Some(&prompt));
        assert_eq!(p.pick_one(&r, &states), Ok(Some(0)), "base model: no hit");
        r.adapter = Some("sql");
        assert_eq!(p.pick_one(&r, &states), Ok(Some(1)));
    }

    /// Without token ids, or for an endpoint whose stream is not live, the
    /// approximate prefix index (what routecore routed) scores.
    #[test]
    fn without_token_ids_or_live_events_the_approximate_index_scores() {
        let prompt: Vec<u32> = (0..32).collect();
        let hashes = block_hashes(Tokens::Ids(&prompt), 16, 0).expect("hashes");
        let kv = kv_with("e2", &[], None);
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        // The approximate index learns that e1 got this prompt.
        p.started(&request(&hashes, None), 1).expect("started");
        assert_eq!(p.pick_one(&request(&hashes, None), &states), Ok(Some(1)));
        // With token ids, the live events say nobody holds it.
        let with_ids = request(&hashes, Some(&prompt));
        assert_eq!(p.pick_one(&with_ids, &states), Ok(Some(0)));
        // e1's stream goes down: its score comes from the approximate index.
        kv.set_connected("e1", false).expect("e1");
        assert_eq!(p.pick_one(&with_ids, &states), Ok(Some(1)));
    }

    /// The KV index answers for every endpoint, so the pick reads no block
    /// hash; starting the request still records all of its blocks in the
    /// approximate index (the fallback for a later request): the hashes are
    /// needed for every started pick, not only to score.
    #[test]
    fn a_pick_the_kv_index_answers_whole_still_records_the_blocks() {
        let prompt: Vec<u32> = (0..48).collect();
        let hashes = block_hashes(Tokens::Ids(&prompt), 16, 0).expect("hashes");
        let kv = kv_with("e1", &prompt, None);
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        let r = request(&hashes, Some(&prompt));
        assert_eq!(p.pick_one(&r, &states), Ok(Some(1)));
        p.started(&r, 1).expect("started");
        let held = p
            .prefix()
            .map(|s| lock(s.index()).match_prefix(&hashes, 0.0))
            .expect("a prefix scorer");
        assert_eq!(held, Ok(vec![("e1".to_owned(), 3)]));
        // Every stream goes down: the approximate index alone scores.
        for n in names() {
            kv.set_connected(&n, false).expect("endpoint");
        }
        assert_eq!(p.pick_one(&r, &states), Ok(Some(1)));
    }

    /// An endpoint whose KV events start after the picker's first pick is
    /// scored from them from then on.
    #[test]
    fn an_endpoint_added_to_the_kv_index_later_is_scored_precisely() {
        let prompt: Vec<u32> = (0..16).collect();
        let kv = Arc::new(
            KvIndex::new(KvConfig {
                block_size: BS,
                ..KvConfig::default()
            })
            .expect("kv"),
        );
        kv.add_endpoint("e0");
        kv.set_connected("e0", true).expect("e0");
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        let r = request(&[], Some(&prompt));
        assert_eq!(p.pick_one(&r, &states), Ok(Some(0)), "nobody holds it");
        kv.add_endpoint("e2");
        kv.set_connected("e2", true).expect("e2");
        let event = Event::Stored(Stored {
            hashes: vec![1, 2],
            parent: None,
            token_ids: prompt[..8].to_vec(),
            block_size: BS,
            lora: None,
            medium: None,
        });
        kv.observe("e2", 0).expect("seq");
        kv.apply("e2", 0, &[Ok(event)], 0.0).expect("apply");
        assert_eq!(p.pick_one(&r, &states), Ok(Some(2)));
    }

    /// `precise-prefix+queue+kv`: the holder wins over a shorter queue; once
    /// its engine clears its cache the next request goes by load.
    #[test]
    fn a_held_prompt_goes_to_its_holder_until_the_engine_clears() {
        let prompt: Vec<u32> = (0..32).collect();
        let kv = kv_with("e1", &prompt, None);
        let config = PickConfig {
            kv_index: Some(Arc::clone(&kv)),
            ..PickConfig::default()
        };
        let mut p = Pipeline::preset("precise-prefix+queue+kv", &names(), &config).expect("p");
        let states: Vec<EndpointState> = [1.0, 2.0, 3.0]
            .into_iter()
            .map(|w| EndpointState {
                waiting: Some(w),
                running: Some(0.0),
                kv_usage: Some(0.1),
                ..EndpointState::default()
            })
            .collect();
        let r = request(&[], Some(&prompt));
        assert_eq!(p.pick_one(&r, &states), Ok(Some(1)));
        kv.observe("e1", 1).expect("seq");
        kv.apply("e1", 1, &[Ok(Event::Cleared)], 0.0)
            .expect("apply");
        assert_eq!(p.pick_one(&r, &states), Ok(Some(0)), "by load");
    }

    /// A request carrying the walk that hashed its prompt (`kv_held`) is
    /// scored from that walk: the index as it was then (here, before the
    /// holder's engine cleared its cache), and only when the walk is the
    /// scorer's own index's for the request's adapter (another index's
    /// walk, or the base model's walk for an adapter's request, is not
    /// read: the index answers as it is now).
    #[test]
    fn a_request_with_the_walk_that_hashed_it_is_scored_from_that_walk() {
        let prompt: Vec<u32> = (0..32).collect();
        let kv = kv_with("e1", &prompt, None);
        let other = kv_with("e2", &prompt, None);
        let mut p = pipeline(&kv);
        let states = vec![EndpointState::default(); 3];
        let (mut hashes, mut walked) = (Vec::new(), KvHeld::default());
        kv.walk_prompt(&prompt, None, &mut hashes, &mut walked);
        let (mut other_hashes, mut other_walk) = (Vec::new(), KvHeld::default());
        other.walk_prompt(&prompt, None, &mut other_hashes, &mut other_walk);
        assert_eq!(hashes, other_hashes);
        kv.observe("e1", 1).expect("seq");
        kv.apply("e1", 1, &[Ok(Event::Cleared)], 0.0)
            .expect("apply");
        let mut r = request(&hashes, Some(&prompt));
        r.kv_held = Some(&walked);
        assert_eq!(p.pick_one(&r, &states), Ok(Some(1)), "the walk's holder");
        r.kv_held = Some(&other_walk);
        assert_eq!(p.pick_one(&r, &states), Ok(Some(0)), "not its index's walk");
        let mut r = request(&hashes, Some(&prompt));
        r.kv_held = Some(&walked);
        r.adapter = Some("sql");
        assert_eq!(p.pick_one(&r, &states), Ok(Some(0)), "another adapter's");
    }

    /// A pick that hands the KV index the prompt's hashes (computed once,
    /// for both indexes) chooses, records and snapshots exactly as one
    /// where the KV index hashes the ids itself, on random event streams
    /// (stores chained to a parent, removals, clears, streams going down)
    /// and requests with and without an adapter, for a KV index that keys
    /// blocks like the prefix scorer and one that does not (another seed);
    /// and so does one scored from the KV index's walk of the prompt
    /// (`kv_held`, read per candidate), with or without a subset hint.
    #[test]
    fn hashing_once_for_both_indexes_picks_and_records_as_hashing_twice() {
        const BS: usize = 16;
        let names: Vec<String> = (0..5).map(|i| format!("e{i}")).collect();
        for (case, kv_seed) in [0u64, 0, 0, 9].into_iter().enumerate() {
            let mut rng = Rng::new(40 + case as u64);
            let kv = KvIndex::new(KvConfig {
                block_size: BS,
                seed: kv_seed,
                capacity_blocks: 40,
                ..KvConfig::default()
            })
            .expect("kv");
            for n in &names {
                kv.add_endpoint(n);
                kv.set_connected(n, true).expect("endpoint");
            }
            let kv = Arc::new(kv);
            let config = PickConfig {
                kv_index: Some(Arc::clone(&kv)),
                ..PickConfig::default()
            };
            let preset = "precise-prefix+queue+kv";
            let mut once = Pipeline::preset(preset, &names, &config).expect("pipeline");
            let mut twice = Pipeline::preset(preset, &names, &config).expect("pipeline");
            // Scored from the KV index's walk of the prompt, read per
            // candidate (the data plane's path).
            let mut walked = Pipeline::preset(preset, &names, &config).expect("pipeline");
            let (mut walk_hashes, mut walk) = (Vec::new(), KvHeld::default());
            // Prompts of 1-6 blocks over one of 3 shared first blocks and a
            // small alphabet, so that they meet again.
            let prompt = |rng: &mut Rng| -> Vec<u32> {
                let first = rng.below(3) as u32;
                let mut p: Vec<u32> = (0..BS as u32).map(|i| 1000 * first + i).collect();
                p.extend((0..rng.below(6 * BS as u64)).map(|_| rng.below(2) as u32));
                p
            };
            let loras = [None, None, None, Some("sql")];
            let mut seq = vec![0u64; names.len()];
            let mut engine_hash = 0u64;
            let mut states = vec![EndpointState::default(); names.len()];
            for step in 0..600 {
                let e = rng.below(names.len() as u64) as usize;
                let name = &names[e];
                let event = match rng.below(12) {
                    0 => Some(Event::Cleared),
                    1 => Some(Event::Removed {
                        hashes: (0..3).map(|_| rng.below(engine_hash + 1)).collect(),
                        medium: None,
                    }),
                    2 => {
                        let up = rng.below(4) > 0;
                        kv.set_connected(name, up).expect("endpoint");
                        None
                    }
                    3..=6 => {
                        let p = prompt(&mut rng);
                        let blocks = p.len() / BS;
                        let hashes: Vec<u64> =
                            (0..blocks as u64).map(|k| engine_hash + 1 + k).collect();
                        engine_hash += blocks as u64;
                        Some(Event::Stored(Stored {
                            hashes,
                            parent: None,
                            token_ids: p[..blocks * BS].to_vec(),
                            block_size: BS,
                            lora: loras[rng.below(4) as usize].map(str::to_owned),
                            medium: None,
                        }))
                    }
                    _ => {
                        let p = prompt(&mut rng);
                        let lora = loras[rng.below(4) as usize];
                        let hashes = block_hashes(Tokens::Ids(&p), BS, 0).expect("hashes");
                        // Some of the endpoints as candidates, at times.
                        let subset: Vec<usize> =
                            (0..names.len()).filter(|_| rng.below(3) > 0).collect();
                        let mut r = request(&hashes, Some(&p));
                        r.adapter = lora;
                        r.now = step as f64;
                        r.subset = (rng.below(2) == 0).then_some(&subset[..]);
                        states[e].waiting = Some(rng.below(3) as f64);
                        let separate = twice.pick_one(&r, &states).expect("pick");
                        r.hashes_of_ids = true;
                        let shared = once.pick_one(&r, &states).expect("pick");
                        assert_eq!(shared, separate, "case {case} step {step}");
                        kv.walk_prompt(&p, lora, &mut walk_hashes, &mut walk);
                        let mut from_walk = r;
                        from_walk.kv_held = Some(&walk);
                        let read = walked.pick_one(&from_walk, &states).expect("pick");
                        assert_eq!(read, shared, "the walk: case {case} step {step}");
                        if let Some(c) = shared {
                            once.started(&r, c).expect("started");
                            walked.started(&from_walk, c).expect("started");
                            r.hashes_of_ids = false;
                            twice.started(&r, c).expect("started");
                        }
                        assert_eq!(once.to_bytes(), twice.to_bytes(), "step {step}");
                        assert_eq!(once.to_bytes(), walked.to_bytes(), "step {step}");
                        None
                    }
                };
                if let Some(event) = event {
                    kv.observe(name, seq[e]).expect("seq");
                    kv.apply(name, seq[e], &[Ok(event)], step as f64)
                        .expect("apply");
                    seq[e] += 1;
                }
            }
        }
    }
}
