//! The endpoint choice inside one pool: the pool picker
//! ([`crate::pick::PoolPicker`]) behind the pool's lock, its endpoints'
//! states fed by their probes and by this data plane's own dispatches.

use super::*;

/// What the picker of a pool answered.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Choice {
    /// The chosen endpoint first, then the fallbacks; the chosen one is
    /// counted in flight, and what the prefix plugin recorded for it; the
    /// prefill endpoint of a split request (counted in flight too).
    Ranked(Vec<usize>, Recorded, Option<usize>),
    /// No endpoint is healthy (or in the subset hint).
    NoEndpoint,
}

pub(super) struct PoolState {
    pub(super) picker: PoolPicker,
    /// The probe sequence number each state was last refreshed from.
    pub(super) seen: Vec<u64>,
    /// The probe's adapter list each state copied last (copied again only
    /// when the probe's list is another one).
    pub(super) adapters: Vec<Arc<Vec<String>>>,
}

/// Picks the endpoint inside one pool: the pool picker of `router.policy`
/// (`crate::pick::PoolPicker`) over one [`EndpointState`] per endpoint,
/// fed by the endpoints' probes (health, queue, KV use, adapters: see
/// `scrape`) and by this data plane's own dispatches (in flight, and since
/// the last scrape); the chooser adds the probes, the lock and the
/// fallbacks' count.
pub struct Chooser {
    pub(super) endpoints: Vec<String>,
    /// One per endpoint; empty when the endpoints are not scraped.
    pub(super) probes: Vec<Arc<Probe>>,
    /// The prefix plugin's (block size, seed), when the pipeline has one.
    pub(super) prefix: Option<(usize, u64)>,
    /// The KV-event index it reads, which hashes token ids it holds.
    pub(super) kv: Option<Arc<crate::kv::KvIndex>>,
    pub(super) fallbacks: usize,
    pub(super) saturation: crate::endpoint::Saturation,
    pub(super) state: Mutex<PoolState>,
}

impl Chooser {
    pub(super) fn new(
        pool: &crate::serve::config::PoolSpec,
        router: &crate::serve::config::RouterSpec,
        probes: Vec<Arc<Probe>>,
        kv: &Arc<crate::kv::KvIndex>,
    ) -> Result<Self> {
        let sat = router.saturation;
        let mut specs =
            preset_specs(&router.policy).map_err(|e| invalid(format!("router.policy: {e}")))?;
        let shared = crate::pick::Shared {
            prefix_block_size: router.prefix_block_size,
            saturation: sat,
        };
        crate::pick::apply_shared(&mut specs, &shared);
        let config = PickConfig {
            kv_index: Some(Arc::clone(kv)),
            ..PickConfig::default()
        };
        let mut pipeline = Pipeline::from_specs(&specs, &pool.endpoints, &config)?;
        pipeline.prepare()?;
        let split = Self::split(pool, &pipeline)
            .map_err(|e| invalid(format!("pools: {:?}: {e}", pool.name)))?;
        let picker = PoolPicker::with_split(pipeline, split);
        let n = pool.endpoints.len();
        Ok(Self {
            endpoints: pool.endpoints.clone(),
            probes,
            prefix: picker.block(),
            kv: picker.kv(),
            fallbacks: router.fallbacks,
            saturation: sat,
            state: Mutex::new(PoolState {
                picker,
                seen: vec![0; n],
                adapters: vec![Arc::default(); n],
            }),
        })
    }

    /// The pool's prefill/decode split from its roles and decider (None:
    /// every endpoint `both`, never split).
    fn split(
        pool: &crate::serve::config::PoolSpec,
        pipeline: &Pipeline,
    ) -> Result<Option<crate::pd::Split>> {
        use crate::pd::{pool_decider, pool_roles, Split};
        let roles = pool_roles(&pool.endpoints, pool.role, &pool.roles)?;
        let decider = pool_decider(pool.disaggregation.as_ref(), &roles)?;
        Split::of_pool(pipeline, roles, decider)
    }

    /// Copies what the probes know into the states (lock-free reads); a new
    /// scrape restarts the count of dispatches since the last one.
    pub(super) fn refresh(&self, st: &mut PoolState) {
        if self.probes.is_empty() {
            return;
        }
        let now = Instant::now();
        for (i, p) in self.probes.iter().enumerate() {
            let r = p.reading(now);
            let s = &mut st.picker.states[i];
            s.healthy = r.healthy;
            s.waiting = r.waiting;
            s.running = r.running;
            s.kv_usage = r.kv_usage;
            if r.seq != st.seen[i] {
                st.seen[i] = r.seq;
                s.dispatched_since_scrape = 0;
                let adapters = p.adapters();
                if !Arc::ptr_eq(&adapters, &st.adapters[i]) {
                    s.adapters = (*adapters).clone();
                    st.adapters[i] = adapters;
                }
            }
        }
    }

    /// The endpoints in the request's subset hint (every endpoint without one).
    pub(super) fn subset(&self, st: &PoolState, hints: &Hints) -> Option<Vec<usize>> {
        hints.subset.as_ref().map(|names| {
            names
                .iter()
                .filter_map(|n| st.picker.index(n).ok())
                .collect()
        })
    }

    /// Whether every healthy endpoint the request may be placed on (in its
    /// subset hint; in a split pool, the endpoints that decode) is
    /// saturated (false when there is none: that is the pick's 503).
    pub(super) fn saturated(&self, hints: &Hints) -> bool {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        self.refresh(st);
        let subset = self.subset(st, hints);
        st.picker.saturated(subset.as_deref(), &self.saturation)
    }

    /// Whether the pool has room by `flow`'s detector, over the states as
    /// the picker sees them now (no copy).
    pub(super) fn room(&self, flow: &crate::serve::flow::PoolFlow) -> bool {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        self.refresh(st);
        flow.room(&st.picker.states)
    }

    /// Ranks the pool's endpoints for a request and counts the chosen one in
    /// flight (and as dispatched since the last scrape).
    pub(super) fn choose(
        &self,
        key: Key<'_>,
        user: &str,
        adapter: Option<&str>,
        hints: &Hints,
        est: (u64, u64),
        now: f64,
    ) -> Result<Choice> {
        // A body's prompt is read only when a prefix plugin asks for it; a
        // prompt given as token ids also feeds the precise-prefix scorer.
        let read = match (self.prefix, key) {
            (Some(_), Key::Body(b)) => prompt_of(b),
            _ => None,
        };
        let token_ids = match (key, &read) {
            (Key::Ids(t), _) => Some(t),
            (_, Some(Prompt::Ids(t))) => Some(t.as_slice()),
            _ => None,
        };
        // The token ids when there are, else the body's prompt as read.
        let tokens = token_ids
            .map(Tokens::Ids)
            .or_else(|| read.as_ref().map(Prompt::tokens));
        let (mut hashes, mut held) = (Vec::new(), crate::kv::KvHeld::default());
        if let Some(tokens) = tokens {
            let kv = self.kv.as_deref();
            PoolPicker::hash_prompt(self.prefix, kv, adapter, tokens, (&mut hashes, &mut held))?;
        }
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        self.refresh(st);
        let subset = self.subset(st, hints);
        let req = PickRequest {
            hashes: &hashes,
            token_ids,
            hashes_of_ids: token_ids.is_some() && self.prefix.is_some(),
            kv_held: Some(&held),
            adapter,
            subset: subset.as_deref(),
            fairness_id: Some(user),
            session: None,
            input_tokens: est.0,
            output_tokens: est.1,
            now,
        };
        let Some(pair) = st.picker.place(&req)? else {
            return Ok(Choice::NoEndpoint);
        };
        let ranked = st.picker.ranked();
        let ranked = ranked[..ranked.len().min(1 + self.fallbacks)].to_vec();
        Ok(Choice::Ranked(
            ranked,
            pair.recorded,
            pair.prefill.map(|(p, _)| p),
        ))
    }

    /// A request on `endpoint` ended (with its usage when known): out of
    /// flight, and the stateful plugins learn it (VTC's charge corrected).
    pub(super) fn release(
        &self,
        endpoint: usize,
        user: &str,
        est: (u64, u64),
        usage: Option<Usage>,
        now: f64,
    ) -> Result<()> {
        let actual = usage.unwrap_or((est.0, 0));
        let req = PickRequest {
            fairness_id: Some(user),
            input_tokens: est.0,
            output_tokens: est.1,
            now,
            ..PickRequest::default()
        };
        // Released exactly once per counted request (leases.rs).
        lock(&self.state)
            .picker
            .complete(endpoint, &req, actual.0, actual.1)
    }

    /// A split request's prefill on `endpoint` ended (its lease ended: the
    /// prefill ran before the decode answered): out of flight, the prefill
    /// pipeline told.
    pub(super) fn release_prefill(&self, endpoint: usize, est: (u64, u64), now: f64) -> Result<()> {
        let req = PickRequest {
            input_tokens: est.0,
            output_tokens: est.1,
            now,
            ..PickRequest::default()
        };
        lock(&self.state)
            .picker
            .complete_prefill(endpoint, &req, est.0)
    }

    /// A request counted on `from` was served by `to`: its in-flight count
    /// and what the prefix plugin recorded move (see `Pipeline::moved`).
    pub(super) fn moved(
        &self,
        from: usize,
        to: usize,
        recorded: &Recorded,
        now: f64,
    ) -> Result<()> {
        lock(&self.state).picker.moved(from, to, recorded, now)
    }

    /// Requests in flight per endpoint.
    pub fn loads(&self) -> Vec<u64> {
        lock(&self.state).picker.running()
    }

    /// The endpoints' states as the picker sees them now.
    pub fn states(&self) -> Vec<EndpointState> {
        let mut st = lock(&self.state);
        self.refresh(&mut st);
        st.picker.states.clone()
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Every endpoint's state is known: scraped once, or found unhealthy
    /// (true at once when the endpoints are not scraped).
    pub(super) fn synced(&self) -> bool {
        self.probes.iter().all(|p| p.seq() > 0 || !p.healthy())
    }
}
