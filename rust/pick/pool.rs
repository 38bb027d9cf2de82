//! The one pool picker: everything that places a request on an endpoint of
//! one pool, used alike by the data plane (`serve`'s chooser wraps it with
//! its probes, lock and metrics), the Python `EndpointPicker`, the
//! simulator's fleet and the preset routers (`PrefixCacheRouter`,
//! `VtcRouter`).
//!
//! It holds the pipeline, one [`EndpointState`] per endpoint (the caller's
//! probes or telemetry write the engine's side of them) and the pool's
//! prefill/decode [`Split`]. The request's prompt is hashed once, with the
//! prefix plugin's block size and seed ([`PoolPicker::hash_prompt`]): the
//! approximate index and, when the chains agree, the KV-event index
//! (`KvIndex::match_hashes`) read the same hashes. A request is started
//! exactly once on the endpoint chosen (plugins told, one more in flight and
//! dispatched since the scrape) and completed exactly once (one fewer,
//! `NotInFlight` with nothing changed when none is).

use super::split::{Pair, Split};
use super::{PickConfig, PickRequest, Pipeline, Recorded};
use crate::endpoint::{complete_one, set_in_flight, EndpointState, Saturation};
use crate::error::{invalid, Error, Result};
use crate::prefix::{block_hashes_into, Tokens};
use crate::snapshot::{Reader, Writer};

/// A pool's picker: its pipeline over its endpoints' states, and its P/D
/// split (None: every endpoint `both`, never split). The states follow the
/// pipeline's endpoints in order; endpoints are added and removed only
/// through the picker.
#[derive(Debug, Clone)]
pub struct PoolPicker {
    pub pipeline: Pipeline,
    pub states: Vec<EndpointState>,
    split: Option<Split>,
    /// The last placement's ranking (reused: no allocation per request).
    ranked: Vec<usize>,
}

impl PoolPicker {
    /// A picker whose endpoints are all `both` (never split).
    pub fn new(pipeline: Pipeline) -> Self {
        Self::with_split(pipeline, None)
    }

    /// A picker with `split` (built over `pipeline`, see [`Split::new`]).
    pub fn with_split(pipeline: Pipeline, split: Option<Split>) -> Self {
        let states = vec![EndpointState::default(); pipeline.endpoints().len()];
        Self {
            pipeline,
            states,
            split,
            ranked: Vec::new(),
        }
    }

    pub fn names(&self) -> &[String] {
        self.pipeline.endpoints().names()
    }
    pub fn index(&self, name: &str) -> Result<usize> {
        self.pipeline.endpoints().index(name)
    }
    pub fn split(&self) -> Option<&Split> {
        self.split.as_ref()
    }
    /// Running requests per endpoint, in endpoint order.
    pub fn running(&self) -> Vec<u64> {
        self.states.iter().map(|s| s.in_flight).collect()
    }

    /// The prefix plugin's block size and hash seed, if the pipeline has
    /// one: what [`PoolPicker::hash_prompt`] hashes with.
    pub fn block(&self) -> Option<(usize, u64)> {
        self.pipeline
            .prefix()
            .map(|p| (p.config().block_size, p.config().seed))
    }

    /// A prompt's block hashes into `out` (cleared), with `block` (a
    /// picker's [`PoolPicker::block`]: nothing without a prefix plugin).
    /// An associated function, so that a caller can hash a long prompt
    /// before it takes the picker's lock.
    pub fn hash_prompt(
        block: Option<(usize, u64)>,
        tokens: Tokens<'_>,
        out: &mut Vec<u64>,
    ) -> Result<()> {
        out.clear();
        match block {
            Some((size, seed)) => block_hashes_into(tokens, size, seed, out),
            None => Ok(()),
        }
    }

    /// Whether endpoint `i` may be a request's decode endpoint (any
    /// endpoint of a pool that does not split).
    pub fn decodes(&self, i: usize) -> bool {
        self.split.as_ref().is_none_or(|s| s.roles()[i].decodes())
    }

    /// The candidates of a request placed whole (never split): in a split
    /// pool, the endpoints that decode within `subset`; `subset` itself
    /// otherwise.
    pub fn whole(&self, subset: Option<Vec<usize>>) -> Option<Vec<usize>> {
        if self.split.is_none() {
            return subset;
        }
        let allowed = |i: &usize| subset.as_ref().is_none_or(|s| s.contains(i));
        Some(
            (0..self.states.len())
                .filter(|i| self.decodes(*i) && allowed(i))
                .collect(),
        )
    }

    /// Whether every healthy endpoint a request may be placed on (in
    /// `subset`; in a split pool, the endpoints that decode) is saturated by
    /// `saturation` (false when there is none: that is the pick's "no
    /// endpoint").
    pub fn saturated(&self, subset: Option<&[usize]>, saturation: &Saturation) -> bool {
        let mut candidates = self
            .states
            .iter()
            .enumerate()
            .filter(|&(i, s)| {
                s.healthy && self.decodes(i) && subset.is_none_or(|sub| sub.contains(&i))
            })
            .peekable();
        candidates.peek().is_some() && candidates.all(|(_, s)| saturation.saturated(s))
    }

    /// Checks a request against the pipeline and the states.
    pub fn check(&self, req: &PickRequest<'_>) -> Result<()> {
        self.pipeline.check(req, &self.states)
    }

    /// Every candidate for `req`, best first, into `out`; starts nothing.
    pub fn rank(&mut self, req: &PickRequest<'_>, out: &mut Vec<usize>) -> Result<()> {
        self.pipeline.pick(req, &self.states, out)
    }

    /// Picks for `req` and starts it there; None when no endpoint is left
    /// (nothing changed).
    pub fn start(&mut self, req: &PickRequest<'_>) -> Result<Option<usize>> {
        let Some(endpoint) = self.pipeline.pick_one(req, &self.states)? else {
            return Ok(None);
        };
        self.started(req, endpoint)?;
        Ok(Some(endpoint))
    }

    /// Starts `req` on `endpoint` (chosen by the caller: a fallback of
    /// [`PoolPicker::rank`]): the plugins told, one more in flight.
    pub fn started(&mut self, req: &PickRequest<'_>, endpoint: usize) -> Result<()> {
        self.pipeline.started(req, endpoint)?;
        self.states[endpoint].start_one();
        Ok(())
    }

    /// Places `req` and starts it: in a split pool, its decode endpoint,
    /// the decider and its prefill endpoint ([`Split::pick`]); otherwise
    /// the endpoint chosen, with what the prefix plugin recorded there (for
    /// [`PoolPicker::moved`]). Every candidate for the decode, best first,
    /// is left in [`PoolPicker::ranked`] (the fallbacks). None when no
    /// endpoint can take it (nothing changed).
    pub fn place(&mut self, req: &PickRequest<'_>) -> Result<Option<Pair>> {
        let PoolPicker {
            pipeline,
            states,
            split,
            ranked,
        } = self;
        if let Some(split) = split {
            return split.pick(pipeline, req, states, ranked);
        }
        pipeline.pick(req, states, ranked)?;
        let Some(&chosen) = ranked.first() else {
            return Ok(None);
        };
        let recorded = pipeline.started_recorded(req, chosen)?;
        states[chosen].start_one();
        Ok(Some(Pair {
            decode: chosen,
            recorded,
            prefill: None,
            uncached_tokens: req.input_tokens,
        }))
    }

    /// The candidates of the last [`PoolPicker::place`], best first.
    pub fn ranked(&self) -> &[usize] {
        &self.ranked
    }

    /// Ends a request on `endpoint`: one fewer in flight (`NotInFlight`
    /// when none is, nothing changed), and the plugins learn its usage
    /// (`req` as it was picked, `now` its end: VTC's charge corrected).
    pub fn complete(
        &mut self,
        endpoint: usize,
        req: &PickRequest<'_>,
        input_tokens: u64,
        output_tokens: u64,
    ) -> Result<()> {
        crate::error::finite("now", req.now)?;
        let names = self.pipeline.endpoints().names();
        let (Some(name), Some(state)) = (names.get(endpoint), self.states.get_mut(endpoint)) else {
            return Err(invalid(format!(
                "endpoint index {endpoint} out of range for {} endpoints",
                names.len()
            )));
        };
        complete_one(state, name)?;
        self.pipeline
            .completed_request(req, endpoint, input_tokens, output_tokens)
    }

    /// A split request's prefill on `endpoint` ended (`NotInFlight` when
    /// none is there; refused in a pool that does not split): one fewer in
    /// flight, the prefill plugins told (`req` as picked; the prefill used
    /// `input_tokens`).
    pub fn complete_prefill(
        &mut self,
        endpoint: usize,
        req: &PickRequest<'_>,
        input_tokens: u64,
    ) -> Result<()> {
        let Some(split) = self.split.as_mut() else {
            return Err(invalid(
                "this picker has no roles: nothing is prefilled apart",
            ));
        };
        split.prefill_done(req, endpoint, input_tokens, &mut self.states)
    }

    /// A request started on `from` was served by `to` (the gateway retried
    /// it on a fallback): its in-flight count and what the prefix plugin
    /// recorded move (see [`Pipeline::moved`]).
    pub fn moved(&mut self, from: usize, to: usize, recorded: &Recorded, now: f64) -> Result<()> {
        self.pipeline.moved(from, to, recorded, now)?;
        let s = &mut self.states[from];
        s.in_flight = s.in_flight.saturating_sub(1);
        s.dispatched_since_scrape = s.dispatched_since_scrape.saturating_sub(1);
        self.states[to].start_one();
        Ok(())
    }

    /// Refused in a split pool: its roles are fixed with its endpoints.
    fn fixed(&self) -> Result<()> {
        match self.split {
            Some(_) => Err(invalid(
                "a picker with roles keeps its endpoints: build a new one with their roles",
            )),
            None => Ok(()),
        }
    }

    /// Appends an endpoint (healthy, idle, nothing cached); returns its index.
    pub fn add_endpoint(&mut self, name: &str) -> Result<usize> {
        self.fixed()?;
        let i = self.pipeline.add_endpoint(name)?;
        self.states.push(EndpointState::default());
        Ok(i)
    }

    /// Removes an endpoint (and what its plugins hold of it); returns its index.
    pub fn remove_endpoint(&mut self, name: &str) -> Result<usize> {
        self.fixed()?;
        let i = self.pipeline.remove_endpoint(name)?;
        self.states.remove(i);
        Ok(i)
    }

    /// Sets every endpoint's running count (telemetry); nothing changed on
    /// bad input.
    pub fn set_running(&mut self, counts: &[i64]) -> Result<()> {
        set_in_flight(&mut self.states, counts)
    }

    /// The pipeline, every state and the split, for a snapshot.
    pub fn write(&self, w: &mut Writer) {
        self.pipeline.write(w);
        for s in &self.states {
            s.write(w);
        }
        match &self.split {
            Some(split) => split.write(w.u8(1)),
            None => {
                w.u8(0);
            }
        }
    }

    /// What [`PoolPicker::write`] wrote (`with_split`: false for snapshots
    /// written before the split was, which end after the states).
    pub fn read(r: &mut Reader<'_>, config: &PickConfig, with_split: bool) -> Result<Self> {
        let pipeline = Pipeline::read(r, config)?;
        let states = (0..pipeline.endpoints().len())
            .map(|_| EndpointState::read(r))
            .collect::<Result<Vec<_>>>()?;
        let split = match if with_split { r.u8()? } else { 0 } {
            0 => None,
            1 => Some(Split::read(r, &pipeline)?),
            b => return Err(Error::Snapshot(format!("bad split flag {b}"))),
        };
        let mut picker = Self::with_split(pipeline, split);
        picker.states = states;
        Ok(picker)
    }

    /// Endpoint names and running counts, for the preset routers' snapshots.
    pub fn write_counts(&self, w: &mut Writer) {
        w.u64(self.states.len() as u64);
        for (name, s) in self.names().iter().zip(&self.states) {
            w.str(name).u64(s.in_flight);
        }
    }

    /// What `write_counts` wrote: the names and the running counts.
    pub fn read_counts(r: &mut Reader<'_>) -> Result<(Vec<String>, Vec<u64>)> {
        let n = r.count(12)?;
        let mut names = Vec::with_capacity(n);
        let mut running = Vec::with_capacity(n);
        for _ in 0..n {
            names.push(r.str()?);
            running.push(r.u64()?);
        }
        Ok((names, running))
    }

    /// Running counts from a snapshot (same order as the endpoints).
    pub fn restore_running(&mut self, running: &[u64]) {
        for (s, &c) in self.states.iter_mut().zip(running) {
            s.in_flight = c;
        }
    }
}
