//! Scorer `prefix`: approximate prefix-cache match (AIBrix's "prefix cache
//! aware" algorithm) over routecore's `PrefixIndex` of chained block hashes.
//!
//! It reads the request's block hashes and the candidates' loads
//! (`EndpointState::load`), and scores each candidate:
//!
//! - 0 for all when the loads are imbalanced (`max - min` over the
//!   candidates above `imbalance_abs_count`);
//! - else `matched_blocks / blocks` (the leading blocks of the prompt the
//!   index says it holds) for a candidate whose load is at or below
//!   `mean + std_factor * std` over the candidates (the hot-spot guard),
//!   and 0 for one above.
//!
//! With the max-score picker and ties to the least-loaded this is AIBrix's
//! decision exactly (the `prefix` preset, `PrefixCacheRouter`). `started`
//! records the prompt's blocks for the chosen endpoint.

use std::sync::{Arc, Mutex};

use super::{Ctx, PickRequest};
use crate::error::Result;
use crate::prefix::{lock, PrefixConfig, PrefixIndex, NO_SLOT};
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
}

impl PrefixScorer {
    pub fn new(config: PrefixConfig, index: Arc<Mutex<PrefixIndex>>) -> Self {
        Self {
            config,
            index,
            ids: Vec::new(),
            slot_of: Vec::new(),
            ids_gen: None,
            matched: Vec::new(),
            found: Vec::new(),
            found_gen: u64::MAX,
        }
    }

    pub fn config(&self) -> &PrefixConfig {
        &self.config
    }
    pub fn index(&self) -> &Arc<Mutex<PrefixIndex>> {
        &self.index
    }
    /// The leading blocks `endpoint` held at the last pick.
    pub fn matched(&self, endpoint: usize) -> usize {
        self.matched.get(endpoint).copied().unwrap_or(0)
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
        out.fill(0.0);
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
            let matched = self.matched[ctx.cand[k]];
            if matched > 0 && load(k) <= limit {
                *o = matched as f64 / blocks as f64;
            }
        }
        Ok(())
    }

    /// Records the prompt's blocks for `endpoint`.
    pub(super) fn started(
        &mut self,
        req: &PickRequest<'_>,
        names: &[String],
        endpoint: usize,
    ) -> Result<()> {
        let index = Arc::clone(&self.index);
        let mut index = lock(&index);
        self.ensure_ids(&mut index, names)?;
        index.record_id(
            req.hashes,
            &self.found,
            self.found_gen,
            self.ids[endpoint],
            req.now,
        );
        self.found.clear();
        Ok(())
    }

    /// An endpoint was added: its id is interned at the next pick.
    pub(super) fn added(&mut self) {
        self.ids_gen = None;
    }

    /// An endpoint was removed: its blocks leave the index.
    pub(super) fn removed(&mut self, name: &str) -> Result<()> {
        self.ids_gen = None;
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
        Ok(())
    }
}
