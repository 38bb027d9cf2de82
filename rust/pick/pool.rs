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
//! (`KvIndex::match_hashes`) read the same hashes; then one walk of the KV
//! index's table gives the hashes of the blocks it holds (instead of the
//! chain computing them one after the other) and every live endpoint's
//! answer (`KvIndex::walk_prompt`), which the precise-prefix scorer reads. A request is started
//! exactly once on the endpoint chosen (plugins told, one more in flight and
//! dispatched since the scrape) and completed exactly once (one fewer,
//! `NotInFlight` with nothing changed when none is).

use std::sync::Arc;

use super::split::{Pair, Split};
use super::{PickConfig, PickRequest, Pipeline, Recorded};
use crate::endpoint::{complete_one, set_in_flight, EndpointState, Saturation};
use crate::error::{invalid, Error, Result};
use crate::kv::{KvHeld, KvIndex};
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
    /// picker's [`PoolPicker::block`]: nothing without a prefix plugin):
    /// token ids through `kv` (the picker's [`PoolPicker::kv`]) when it
    /// keys `adapter`'s blocks with that chain, the same hashes, and then
    /// that walk's answers in `held` (the request's `kv_held`; cleared
    /// otherwise). An associated function, so that a caller can hash a long
    /// prompt before it takes the picker's lock.
    pub fn hash_prompt(
        block: Option<(usize, u64)>,
        kv: Option<&KvIndex>,
        adapter: Option<&str>,
        tokens: Tokens<'_>,
        (out, held): (&mut Vec<u64>, &mut KvHeld),
    ) -> Result<()> {
        out.clear();
        held.clear();
        match (block, kv, tokens) {
            (Some((size, seed)), Some(kv), Tokens::Ids(ids))
                if kv.keys_like(size, seed, adapter) =>
            {
                kv.walk_prompt(ids, adapter, out, held);
                Ok(())
            }
            (Some((size, seed)), ..) => block_hashes_into(tokens, size, seed, out),
            (None, ..) => Ok(()),
        }
    }

    /// The KV-event index the prefix plugin reads (`precise-prefix`).
    pub fn kv(&self) -> Option<Arc<KvIndex>> {
        self.pipeline.prefix().and_then(|p| p.kv()).cloned()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::pick::split::{Decider, Role};
    use crate::pick::{preset_specs, PluginSpec};
    use crate::prefix::block_hashes;

    /// A picker over `n` endpoints with the VTC scorer and the prefix
    /// scorer (4-token blocks), least-request ties, and roles when given.
    fn picker(n: usize, roles: Option<Vec<Role>>) -> PoolPicker {
        let mut specs = preset_specs("prefix").expect("preset");
        for s in &mut specs {
            if s.name == "prefix" {
                s.params = serde_json::json!({"block_size": 4, "seed": 9});
            }
        }
        let last = specs.len() - 1;
        specs.insert(last, PluginSpec::new("vtc", 1.0));
        let names: Vec<String> = (0..n).map(|i| format!("e{i}")).collect();
        let pipeline = Pipeline::from_specs(&specs, &names, &PickConfig::default()).expect("ok");
        let split = roles.map(|r| Split::new(&pipeline, r, Decider::Always).expect("split"));
        PoolPicker::with_split(pipeline, split)
    }

    fn request(hashes: &[u64]) -> PickRequest<'_> {
        PickRequest {
            hashes,
            fairness_id: Some("u"),
            input_tokens: 16,
            output_tokens: 8,
            now: 1.0,
            ..PickRequest::default()
        }
    }

    fn snapshot(p: &PoolPicker) -> Vec<u8> {
        let mut w = Writer::new(b"TEST", 1);
        p.write(&mut w);
        w.finish()
    }

    #[test]
    fn the_prompt_is_hashed_with_the_prefix_plugins_block_size_and_seed() {
        let p = picker(2, None);
        assert_eq!(p.block(), Some((4, 9)));
        let tokens = Tokens::Ids(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        let (mut out, mut held) = (vec![42], KvHeld::default());
        PoolPicker::hash_prompt(p.block(), None, None, tokens, (&mut out, &mut held))
            .expect("hashes");
        assert_eq!(out, block_hashes(tokens, 4, 9).expect("hashes"));
        assert_eq!(out.len(), 2);
        PoolPicker::hash_prompt(None, None, None, tokens, (&mut out, &mut held)).expect("none");
        assert!(out.is_empty());
    }

    /// Token ids hashed through a KV index (which reads the hashes of the
    /// blocks it holds from its table) are the chain's hashes, for a base
    /// prompt and an adapter's, and the walk's answers are `match_hashes`'
    /// over them for that adapter only; a KV index keyed by another chain
    /// (another seed) is not used and answers nothing.
    #[test]
    fn hashing_through_the_kv_index_gives_the_chains_hashes() {
        use crate::kv::index::lora_seed;
        use crate::kv::{Event, KvConfig, Stored};
        let ids: Vec<u32> = (0..40).map(|i| i % 7).collect();
        for kv_seed in [9, 0] {
            let kv = KvIndex::new(KvConfig {
                block_size: 4,
                seed: kv_seed,
                ..KvConfig::default()
            })
            .expect("kv");
            kv.add_endpoint("e");
            kv.set_connected("e", true).expect("e");
            for (seq, lora) in [None, Some("sql")].into_iter().enumerate() {
                kv.observe("e", seq as u64).expect("seq");
                let stored = Event::Stored(Stored {
                    hashes: (0..6).map(|b| b + 10 * seq as u64).collect(),
                    parent: None,
                    token_ids: ids[..24].to_vec(),
                    block_size: 4,
                    lora: lora.map(str::to_owned),
                    medium: None,
                });
                kv.apply("e", seq as u64, &[Ok(stored)], 0.0)
                    .expect("apply");
            }
            for adapter in [None, Some("sql")] {
                let seed = lora_seed(kv_seed, adapter);
                let block = Some((4, seed));
                let (mut out, mut held) = (Vec::new(), KvHeld::default());
                let tokens = Tokens::Ids(&ids);
                PoolPicker::hash_prompt(block, Some(&kv), adapter, tokens, (&mut out, &mut held))
                    .expect("h");
                assert_eq!(
                    out,
                    block_hashes(tokens, 4, seed).expect("h"),
                    "{adapter:?}"
                );
                let ask = [Some(0), None];
                let (mut walked, mut want) = (Vec::new(), Vec::new());
                kv.match_hashes(&out, &ask, &mut want);
                assert_eq!(want, [Some(6), None]);
                assert_eq!(held.held_into(&kv, adapter, &ask, &mut walked), Some(10));
                assert_eq!(walked, want, "{adapter:?}");
                let other_adapter = adapter.map_or(Some("x"), |_| None);
                assert_eq!(held.held_into(&kv, other_adapter, &ask, &mut walked), None);
                // The plugin's chain is another one than the index's.
                let other = Some((4, seed ^ 1));
                PoolPicker::hash_prompt(other, Some(&kv), adapter, tokens, (&mut out, &mut held))
                    .expect("h");
                assert_eq!(out, block_hashes(tokens, 4, seed ^ 1).expect("h"));
                assert_eq!(held.held_into(&kv, adapter, &ask, &mut walked), None);
            }
        }
    }

    #[test]
    fn a_request_is_started_once_and_completed_once() {
        let mut p = picker(2, None);
        let hashes = [1, 2, 3];
        let e = p
            .start(&request(&hashes))
            .expect("ok")
            .expect("an endpoint");
        assert_eq!(p.running()[e], 1);
        assert_eq!(p.states[e].dispatched_since_scrape, 1);
        let charged = p.pipeline.vtc_mut().expect("vtc").tokens("u", 1.0);
        assert!(charged > 0.0);
        p.complete(e, &request(&hashes), 16, 8).expect("in flight");
        assert_eq!(p.running(), [0, 0]);
        assert_eq!(p.states[e].dispatched_since_scrape, 0);
        // A second completion is refused and changes nothing (VTC's charge
        // included).
        let before = snapshot(&p);
        let again = p.complete(e, &request(&hashes), 0, 0);
        assert!(matches!(again, Err(Error::NotInFlight(_))), "{again:?}");
        assert_eq!(snapshot(&p), before);
        assert!(p.complete(2, &request(&hashes), 0, 0).is_err());
        let bad = PickRequest {
            now: f64::NAN,
            ..request(&hashes)
        };
        assert!(p.complete(e, &bad, 0, 0).is_err());
        assert_eq!(snapshot(&p), before);
    }

    #[test]
    fn place_ranks_the_fallbacks_and_records_what_the_prefix_index_learned() {
        let mut p = picker(3, None);
        let hashes = [7, 8];
        let pair = p.place(&request(&hashes)).expect("ok").expect("placed");
        assert_eq!(pair.prefill, None);
        assert_eq!(pair.recorded.hashes, hashes);
        let mut ranked = p.ranked().to_vec();
        assert_eq!(ranked[0], pair.decode);
        ranked.sort_unstable();
        assert_eq!(ranked, [0, 1, 2]);
        assert_eq!(p.running()[pair.decode], 1);
        // Served by a fallback: the count and the recorded blocks move.
        let to = (pair.decode + 1) % 3;
        p.moved(pair.decode, to, &pair.recorded, 2.0)
            .expect("moved");
        let mut want = vec![0; 3];
        want[to] = 1;
        assert_eq!(p.running(), want);
        let held = |p: &mut PoolPicker, e| p.pipeline.prefix_held(&request(&hashes), e);
        assert_eq!(held(&mut p, to).expect("held"), 2);
        assert_eq!(held(&mut p, pair.decode).expect("held"), 0);
    }

    #[test]
    fn a_split_pool_places_decode_then_prefill_and_keeps_its_endpoints() {
        let roles = vec![Role::Prefill, Role::Decode, Role::Both];
        let mut p = picker(3, Some(roles));
        assert!(!p.decodes(0) && p.decodes(1) && p.decodes(2));
        assert_eq!(p.whole(None), Some(vec![1, 2]));
        assert_eq!(p.whole(Some(vec![0, 2])), Some(vec![2]));
        let pair = p.place(&request(&[1])).expect("ok").expect("placed");
        let (prefill, _) = pair.prefill.clone().expect("split: the decider is always");
        assert!([1, 2].contains(&pair.decode) && prefill != pair.decode);
        assert!(p.ranked().iter().all(|&i| i != 0), "{:?}", p.ranked());
        p.complete_prefill(prefill, &request(&[1]), 16)
            .expect("in flight");
        let again = p.complete_prefill(prefill, &request(&[1]), 16);
        assert!(matches!(again, Err(Error::NotInFlight(_))), "{again:?}");
        p.complete(pair.decode, &request(&[1]), 16, 8)
            .expect("in flight");
        assert_eq!(p.running(), [0, 0, 0]);
        assert!(p.add_endpoint("e3").is_err());
        assert!(p.remove_endpoint("e0").is_err());
        assert_eq!(p.names().len(), 3);
        let mut whole = picker(2, None);
        assert!(whole.complete_prefill(0, &request(&[1]), 16).is_err());
        assert_eq!(whole.whole(None), None);
        assert_eq!(whole.add_endpoint("e2").expect("added"), 2);
        assert_eq!((whole.names().len(), whole.states.len()), (3, 3));
        assert_eq!(whole.remove_endpoint("e0").expect("removed"), 0);
        assert_eq!(whole.names(), ["e1", "e2"]);
    }

    #[test]
    fn saturation_is_judged_over_the_healthy_endpoints_a_request_may_decode_on() {
        let sat = Saturation::default();
        let busy = Some(sat.max_waiting + 1.0);
        let mut p = picker(3, Some(vec![Role::Prefill, Role::Decode, Role::Decode]));
        for s in &mut p.states {
            s.waiting = busy;
        }
        assert!(p.saturated(None, &sat));
        p.states[0].waiting = Some(0.0); // a prefill endpoint with room
        assert!(p.saturated(None, &sat));
        p.states[2].waiting = Some(0.0);
        assert!(!p.saturated(None, &sat));
        assert!(p.saturated(Some(&[0, 1]), &sat));
        p.states[1].healthy = false;
        assert!(
            !p.saturated(Some(&[0, 1]), &sat),
            "no candidate: the pick's 503"
        );
    }

    #[test]
    fn a_snapshot_round_trips_the_pipeline_the_states_and_the_split() {
        for roles in [None, Some(vec![Role::Prefill, Role::Decode])] {
            let mut p = picker(2, roles);
            p.place(&request(&[3, 4])).expect("ok").expect("placed");
            p.states[1].waiting = Some(2.0);
            let bytes = snapshot(&p);
            let mut r = Reader::new(&bytes, b"TEST", 1, "pool picker").expect("header");
            let q = PoolPicker::read(&mut r, &PickConfig::default(), true).expect("read");
            assert_eq!(snapshot(&q), bytes);
            assert_eq!(
                q.split().map(|s| s.roles().to_vec()),
                p.split().map(|s| s.roles().to_vec())
            );
        }
    }
}
