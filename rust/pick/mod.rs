//! The endpoint picker: one pipeline of small plugins choosing the endpoint
//! inside a pool (after the Gateway API Inference Extension's / llm-d's
//! scheduler and the AIBrix routing algorithms).
//!
//! A [`Pipeline`] runs, for one request ([`PickRequest`]) over the pool's
//! endpoints (one [`EndpointState`] each):
//!
//! 1. its **filters** in order, each keeping a subset of the candidates. A
//!    *soft* filter (saturation, serves-adapter) that would leave no
//!    candidate is skipped: that is the fallback. A *hard* filter (healthy,
//!    subset hint) that leaves none gives an empty answer (the caller's 503);
//! 2. its **scorers**, each giving every candidate a score in [0, 1],
//!    summed with the scorers' weights;
//! 3. its **picker**, choosing one candidate: the highest total (ties first
//!    in order, least-request, round-robin or a seeded random draw), a draw
//!    weighted by the totals, or round-robin. The answer is a ranked list:
//!    the chosen endpoint, then the other candidates by total (fallbacks).
//!
//! Stateful plugins (prefix, VTC, session affinity) learn through two
//! hooks: [`Pipeline::started`] (a request went to an endpoint) and
//! [`Pipeline::completed_request`] (it ended, with its usage); the prefix
//! plugins also through [`Pipeline::moved`] (another endpoint served it:
//! Envoy retried it on a fallback). No allocation per pick once the pipeline has
//! seen its largest pool.
//!
//! Plugins describe themselves: each file holds its name, its parameter
//! struct (unknown fields refused), what it reads and its tests
//! ([`plugin::Describe`]); filters and scorers implement the small traits of
//! `plugin.rs`, pickers the [`Picker`] trait. One registry
//! ([`REGISTRY`], `registry.rs`) lists them: names resolve there, its list
//! is docs/picker.md's plugin table, and the data plane sets the plugins'
//! shared parameters through it ([`apply_shared`]). Presets are lists of
//! [`PluginSpec`]s (see `presets.rs`).

mod adapter;
mod healthy;
mod kv_usage;
mod least_request;
mod lora_affinity;
mod max_score;
pub mod plugin;
mod pool;
pub mod prefix;
mod prefix_router;
mod presets;
mod queue;
mod random;
mod registry;
mod round_robin;
mod saturation;
mod session;
pub mod split;
mod subset;
pub mod vtc;
mod vtc_router;

use std::cmp::Ordering;
use std::sync::{Arc, Mutex};

pub use max_score::Ties;
pub use plugin::{Describe, Kind, Needs, Picker, Shared};
pub use pool::PoolPicker;
pub use prefix_router::{PrefixCacheRouter, PrefixDecision};
pub use presets::{preset_specs, PRESETS};
pub use registry::{apply_shared, describe, needs, REGISTRY};
pub use vtc_router::VtcRouter;

use crate::endpoint::{EndpointSet, EndpointState};
use crate::error::{finite, invalid, non_negative, Error, Result};
use crate::kv::KvHeld;
use crate::prefix::PrefixIndex;
use crate::rng::Rng;
use crate::snapshot::{restore, Reader, Writer};
use plugin::{Built, Filter, Scorer};
use prefix::PrefixScorer;
use vtc::VtcScorer;

/// Longest session key, in bytes.
pub const MAX_SESSION_BYTES: usize = 256;

/// One request as the picker sees it (borrowed; no allocation per call).
#[derive(Debug, Clone, Copy, Default)]
pub struct PickRequest<'a> {
    /// Chained prompt block hashes (`crate::prefix::block_hashes`); may be empty.
    pub hashes: &'a [u64],
    /// Token ids when known (tokenizer / caller).
    pub token_ids: Option<&'a [u32]>,
    /// `hashes` are `token_ids`' block hashes with the prefix plugin's block
    /// size and seed (computed from them here, not given apart): the
    /// precise-prefix scorer reads them instead of hashing the ids again.
    pub hashes_of_ids: bool,
    /// The KV index's walk of `token_ids` that gave `hashes`
    /// (`KvIndex::walk_prompt`, done before the picker's lock): the
    /// precise-prefix scorer reads its endpoints' answers from it instead
    /// of walking again, when it is its own index's walk for `adapter`.
    pub kv_held: Option<&'a KvHeld>,
    /// LoRA adapter the request names (its model field); None = base model.
    pub adapter: Option<&'a str>,
    /// Subset hint, resolved to endpoint indices.
    pub subset: Option<&'a [usize]>,
    /// VTC user (the request's fairness id).
    pub fairness_id: Option<&'a str>,
    /// Session affinity key.
    pub session: Option<&'a str>,
    pub input_tokens: u64,
    /// Expected output tokens (VTC charges them).
    pub output_tokens: u64,
    /// Seconds, any epoch; never NaN.
    pub now: f64,
}

/// What [`Pipeline::started_recorded`] recorded of a request in the prefix
/// index: its blocks, and those the endpoint did not hold before (what
/// [`Pipeline::moved`] takes back from it). Empty without a prefix plugin.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recorded {
    pub hashes: Vec<u64>,
    pub added: Vec<u64>,
}

/// What a scorer sees: every endpoint's name and state, and the candidates
/// (endpoint indices) that passed the filters. Scores are written per
/// candidate, in `cand` order.
pub struct Ctx<'a> {
    pub names: &'a [String],
    pub states: &'a [EndpointState],
    pub cand: &'a [usize],
}

/// One plugin of a pipeline: its registry name, its weight (scorers) and
/// its parameters (a JSON object; `null` for none).
#[derive(Debug, Clone, PartialEq)]
pub struct PluginSpec {
    pub name: String,
    pub weight: f64,
    pub params: serde_json::Value,
}

impl PluginSpec {
    pub fn new(name: &str, weight: f64) -> Self {
        Self {
            name: name.to_owned(),
            weight,
            params: serde_json::Value::Null,
        }
    }
    pub fn with(name: &str, weight: f64, params: serde_json::Value) -> Self {
        Self {
            name: name.to_owned(),
            weight,
            params,
        }
    }
}

/// What a pipeline takes besides its plugins.
#[derive(Debug, Clone, Default)]
pub struct PickConfig {
    /// Seeds the random pickers and tie-breaks that give none of their own.
    pub seed: u64,
    /// A prefix index to share (the prefix scorer makes its own without).
    pub prefix_index: Option<Arc<Mutex<PrefixIndex>>>,
    /// The precise prefix index fed by KV events (the precise-prefix scorer
    /// is approximate only without; snapshots do not hold it).
    pub kv_index: Option<Arc<crate::kv::KvIndex>>,
}

/// Filters, then weighted scorers, then a picker (see the module docs).
#[derive(Debug, Clone)]
pub struct Pipeline {
    specs: Vec<PluginSpec>,
    endpoints: EndpointSet,
    /// Each filter, and whether it is soft.
    filters: Vec<(Box<dyn Filter>, bool)>,
    scorers: Vec<(Box<dyn Scorer>, f64)>,
    picker: Arc<dyn Picker>,
    /// Picks made: with the seed, the random draw of the next pick.
    picks: u64,
    /// The endpoint after the last chosen one (round-robin).
    cursor: usize,
    // Scratch, reused by every pick.
    cand: Vec<usize>,
    total: Vec<f64>,
    tmp: Vec<f64>,
    order: Vec<usize>,
}

const MAGIC: &[u8; 4] = b"RCEP";
const SNAPSHOT_VERSION: u16 = 1;

impl Pipeline {
    /// A preset by name (see [`PRESETS`]).
    pub fn preset<S: AsRef<str>>(name: &str, endpoints: &[S], config: &PickConfig) -> Result<Self> {
        Self::from_specs(&preset_specs(name)?, endpoints, config)
    }

    /// A pipeline from plugin specs: filters and scorers in the order given,
    /// at most one picker (default: max-score, ties round-robin).
    pub fn from_specs<S: AsRef<str>>(
        specs: &[PluginSpec],
        endpoints: &[S],
        config: &PickConfig,
    ) -> Result<Self> {
        let endpoints = EndpointSet::new(endpoints)?;
        let mut filters = Vec::new();
        let mut scorers = Vec::new();
        let mut picker = None;
        let specs: Vec<PluginSpec> = specs
            .iter()
            .map(|s| registry::resolved(s, config))
            .collect();
        for (i, spec) in specs.iter().enumerate() {
            let w = non_negative(&format!("weight of {:?}", spec.name), spec.weight)?;
            let (kind, built) = registry::build(i, spec, config)?;
            match built {
                Built::Filter(f) => filters.push((f, kind == Kind::Filter { soft: true })),
                Built::Scorer(s) => scorers.push((s, w)),
                Built::Picker(p) => {
                    if picker.replace(p).is_some() {
                        return Err(invalid("a pipeline has at most one picker"));
                    }
                }
            }
        }
        Ok(Self {
            specs,
            endpoints,
            filters,
            scorers,
            picker: picker.unwrap_or_else(|| Arc::new(max_score::MaxScore::default())),
            picks: 0,
            cursor: 0,
            cand: Vec::new(),
            total: Vec::new(),
            tmp: Vec::new(),
            order: Vec::new(),
        })
    }

    pub fn specs(&self) -> &[PluginSpec] {
        &self.specs
    }
    pub fn endpoints(&self) -> &EndpointSet {
        &self.endpoints
    }

    /// The prefix scorer (`prefix` or `precise-prefix`), if the pipeline has one.
    pub fn prefix(&self) -> Option<&PrefixScorer> {
        self.scorers
            .iter()
            .find_map(|(s, _)| s.as_any().downcast_ref())
    }

    /// The leading blocks of `req`'s prompt the prefix index holds for
    /// `endpoint` (0 without a prefix scorer; see `PrefixScorer::held`).
    pub fn prefix_held(&mut self, req: &PickRequest<'_>, endpoint: usize) -> Result<usize> {
        self.check_index(endpoint)?;
        let names = self.endpoints.names();
        let prefix = self
            .scorers
            .iter_mut()
            .find_map(|(s, _)| s.as_any_mut().downcast_mut::<PrefixScorer>());
        match prefix {
            Some(p) => p.held(req.hashes, names, endpoint, req.now),
            None => Ok(0),
        }
    }

    /// Whether a `precise-prefix` scorer reads `PickConfig::kv_index`.
    pub fn wants_kv_index(&self) -> bool {
        needs(&self.specs).kv_index
    }

    /// The VTC scorer, if the pipeline has one.
    pub fn vtc(&self) -> Option<&VtcScorer> {
        self.scorers
            .iter()
            .find_map(|(s, _)| s.as_any().downcast_ref())
    }

    /// The VTC scorer, mutable (its window moves with time).
    pub fn vtc_mut(&mut self) -> Option<&mut VtcScorer> {
        self.scorers
            .iter_mut()
            .find_map(|(s, _)| s.as_any_mut().downcast_mut())
    }

    /// Readies the stateful plugins for the current endpoints (the prefix
    /// scorer interns them in its index, which fails when the index is
    /// full); `pick` does it too, so callers only need it to fail early.
    pub fn prepare(&mut self) -> Result<()> {
        let names = self.endpoints.names();
        for (s, _) in &mut self.scorers {
            s.prepare(names)?;
        }
        Ok(())
    }

    /// Checks a request against this pipeline and `states`.
    pub fn check(&self, req: &PickRequest<'_>, states: &[EndpointState]) -> Result<()> {
        finite("now", req.now)?;
        if states.len() != self.endpoints.len() {
            return Err(invalid(format!(
                "{} endpoint states for {} endpoints",
                states.len(),
                self.endpoints.len()
            )));
        }
        if let Some(&i) = req
            .subset
            .and_then(|s| s.iter().find(|&&i| i >= states.len()))
        {
            return Err(invalid(format!(
                "subset index {i} out of range for {} endpoints",
                states.len()
            )));
        }
        if let Some(u) = req.fairness_id {
            crate::vtc::check_user(u)?;
        }
        if let Some(s) = req.session {
            if s.is_empty() || s.len() > MAX_SESSION_BYTES {
                return Err(invalid(format!(
                    "session must be 1 to {MAX_SESSION_BYTES} bytes, got {} bytes",
                    s.len()
                )));
            }
        }
        Ok(())
    }

    /// Ranked endpoint indices into `out`: the chosen first, then the other
    /// candidates by total (fallbacks, for Envoy's retry list). Err only on
    /// bad input (nothing changed); Ok with `out` empty when no endpoint
    /// survives the hard filters.
    pub fn pick(
        &mut self,
        req: &PickRequest<'_>,
        states: &[EndpointState],
        out: &mut Vec<usize>,
    ) -> Result<()> {
        self.rank(req, states, usize::MAX, out)
    }

    /// The chosen endpoint alone (no fallbacks ranked): None when no
    /// endpoint survives the hard filters.
    pub fn pick_one(
        &mut self,
        req: &PickRequest<'_>,
        states: &[EndpointState],
    ) -> Result<Option<usize>> {
        let mut out = std::mem::take(&mut self.order);
        let r = self.rank(req, states, 1, &mut out);
        let chosen = out.first().copied();
        self.order = out;
        r.map(|()| chosen)
    }

    fn rank(
        &mut self,
        req: &PickRequest<'_>,
        states: &[EndpointState],
        k: usize,
        out: &mut Vec<usize>,
    ) -> Result<()> {
        self.check(req, states)?;
        out.clear();
        self.cand.clear();
        self.cand.extend(0..states.len());
        for (f, soft) in &self.filters {
            let kept = f.count(req, &self.cand, states);
            if kept == self.cand.len() || (kept == 0 && *soft) {
                continue;
            }
            f.retain(req, &mut self.cand, states);
        }
        let m = self.cand.len();
        if m == 0 {
            return Ok(());
        }
        self.total.clear();
        self.total.resize(m, 0.0);
        let ctx = Ctx {
            names: self.endpoints.names(),
            states,
            cand: &self.cand,
        };
        for (scorer, w) in &mut self.scorers {
            self.tmp.clear();
            self.tmp.resize(m, 0.0);
            scorer.score(req, &ctx, &mut self.tmp)?;
            for (t, x) in self.total.iter_mut().zip(&self.tmp) {
                *t += *w * x;
            }
        }
        let n = states.len();
        let draw = Rng::new(self.picker.seed().wrapping_add(self.picks)).next_u64();
        let rank = Ranking {
            total: &self.total,
            cand: &self.cand,
            states,
            ties: self.picker.ties(),
            cursor: self.cursor % n,
            n,
            draw,
        };
        let chosen = self.picker.choose(&rank);
        out.push(self.cand[chosen]);
        if k > 1 {
            self.order.clear();
            self.order.extend((0..m).filter(|&p| p != chosen));
            let cmp = |a: &usize, b: &usize| rank.cmp(*a, *b);
            if k - 1 < self.order.len() {
                self.order.select_nth_unstable_by(k - 1, cmp);
                self.order.truncate(k - 1);
            }
            self.order.sort_unstable_by(cmp);
            out.extend(self.order.iter().map(|&p| self.cand[p]));
        }
        self.picks = self.picks.wrapping_add(1);
        self.cursor = (self.cand[chosen] + 1) % n;
        Ok(())
    }

    /// A request went to `endpoint`: the stateful plugins learn it (prefix
    /// blocks recorded, VTC charged the estimate, session bound). The
    /// caller counts it in its `EndpointState::in_flight`.
    pub fn started(&mut self, req: &PickRequest<'_>, endpoint: usize) -> Result<()> {
        self.start(req, endpoint, None)
    }

    /// [`Pipeline::started`], keeping what the prefix index recorded, for
    /// [`Pipeline::moved`] when another endpoint serves the request.
    pub fn started_recorded(&mut self, req: &PickRequest<'_>, endpoint: usize) -> Result<Recorded> {
        let mut recorded = Recorded::default();
        self.start(req, endpoint, Some(&mut recorded))?;
        Ok(recorded)
    }

    fn start(
        &mut self,
        req: &PickRequest<'_>,
        endpoint: usize,
        mut recorded: Option<&mut Recorded>,
    ) -> Result<()> {
        finite("now", req.now)?;
        self.check_index(endpoint)?;
        let names = self.endpoints.names();
        for (s, _) in &mut self.scorers {
            s.started(req, names, endpoint, recorded.as_deref_mut())?;
        }
        Ok(())
    }

    /// A request started on `from` was served by `to` (the gateway retried
    /// it on a fallback): the prefix plugins move what `started_recorded`
    /// recorded (`from` forgets the blocks the request added, `to` holds
    /// them all). The caller moves it in its `EndpointState::in_flight`.
    pub fn moved(&mut self, from: usize, to: usize, recorded: &Recorded, now: f64) -> Result<()> {
        finite("now", now)?;
        self.check_index(from)?;
        self.check_index(to)?;
        let names = self.endpoints.names();
        for (s, _) in &mut self.scorers {
            s.moved(names, from, to, recorded, now)?;
        }
        Ok(())
    }

    fn check_index(&self, endpoint: usize) -> Result<()> {
        if endpoint >= self.endpoints.len() {
            return Err(invalid(format!(
                "endpoint index {endpoint} out of range for {} endpoints",
                self.endpoints.len()
            )));
        }
        Ok(())
    }

    /// A request ended: `req` as it was picked (its fairness id and token
    /// estimates: VTC corrects the charge to the usage), `now` its end.
    pub fn completed_request(
        &mut self,
        req: &PickRequest<'_>,
        endpoint: usize,
        input_tokens: u64,
        output_tokens: u64,
    ) -> Result<()> {
        finite("now", req.now)?;
        self.check_index(endpoint)?;
        for (s, _) in &mut self.scorers {
            s.completed(req, input_tokens, output_tokens);
        }
        Ok(())
    }

    /// Appends an endpoint (its state is the caller's); returns its index.
    pub fn add_endpoint(&mut self, name: &str) -> Result<usize> {
        let i = self.endpoints.add(name)?;
        for (s, _) in &mut self.scorers {
            s.added();
        }
        Ok(i)
    }

    /// Removes an endpoint (and what plugins know of it); the ones after it
    /// move down one index. Returns the index it had.
    pub fn remove_endpoint(&mut self, name: &str) -> Result<usize> {
        let i = self.endpoints.remove(name)?;
        for (s, _) in &mut self.scorers {
            s.removed(i, name)?;
        }
        if self.cursor > i {
            self.cursor -= 1;
        }
        Ok(i)
    }

    /// A snapshot: specs, endpoints, picker state and every stateful
    /// plugin's state (a shared prefix index is written whole).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(MAGIC, SNAPSHOT_VERSION);
        self.write(&mut w);
        w.finish()
    }

    pub fn write(&self, w: &mut Writer) {
        w.u64(self.specs.len() as u64);
        for s in &self.specs {
            w.str(&s.name).f64(s.weight).str(&s.params.to_string());
        }
        self.endpoints.write(w);
        w.u64(self.picks).u64(self.cursor as u64);
        for (s, _) in &self.scorers {
            s.write(w);
        }
    }

    /// Restores a snapshot written by `to_bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        restore(bytes, MAGIC, SNAPSHOT_VERSION, "endpoint picker", |r| {
            Self::read(r, &PickConfig::default())
        })
    }

    /// Reads a pipeline written by `write`; `config` gives what a snapshot
    /// does not hold (the KV-event index; the prefix index is read).
    pub fn read(r: &mut Reader<'_>, config: &PickConfig) -> Result<Self> {
        let n = r.count(16)?;
        let mut specs = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.str()?;
            let weight = r.f64()?;
            let params = serde_json::from_str(&r.str()?)
                .map_err(|e| Error::Snapshot(format!("plugin params: {e}")))?;
            specs.push(PluginSpec {
                name,
                weight,
                params,
            });
        }
        let endpoints = EndpointSet::read(r)?;
        let mut p = Self::from_specs(&specs, endpoints.names(), config)?;
        p.picks = r.u64()?;
        p.cursor = usize::try_from(r.u64()?).unwrap_or(0) % endpoints.len().max(1);
        for (s, _) in &mut p.scorers {
            s.read(r, endpoints.len())?;
        }
        Ok(p)
    }
}

/// The totals and tie order of one pick, shared by the pickers.
pub struct Ranking<'a> {
    pub total: &'a [f64],
    pub cand: &'a [usize],
    pub states: &'a [EndpointState],
    pub ties: Ties,
    pub cursor: usize,
    pub n: usize,
    pub draw: u64,
}

impl Ranking<'_> {
    /// Candidate positions `a` before `b`: higher total, then the tie order.
    pub fn cmp(&self, a: usize, b: usize) -> Ordering {
        self.total[b]
            .total_cmp(&self.total[a])
            .then_with(|| max_score::tie_cmp(self, self.cand[a], self.cand[b]))
    }
}

/// Scores `1 - (x - min) / (max - min)` of one value per candidate (lower is
/// better), all 1 when they are equal: the normalisation of the load
/// scorers (least-request, queue depth).
fn lower_is_better(out: &mut [f64], value: impl Fn(usize) -> f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for (k, o) in out.iter_mut().enumerate() {
        let v = value(k);
        *o = v;
        lo = lo.min(v);
        hi = hi.max(v);
    }
    let span = hi - lo;
    for o in out.iter_mut() {
        *o = if span > 0.0 { (hi - *o) / span } else { 1.0 };
    }
}

#[cfg(test)]
mod tests;
