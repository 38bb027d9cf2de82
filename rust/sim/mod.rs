//! Fleet simulator: a discrete-event simulation of pools of continuous-batching
//! engines ([`engine`]) behind a router ([`router`]), after the token-budget
//! paper's Appendix A and FleetOpt's validation (section 7.4).
//!
//! Events are request arrivals and iteration ends. An arrival goes through
//! the data plane's steps ([`crate::dispatch`]): routed to a pool, admitted
//! (rejected if `L_in + L_out` exceeds the pool's `max_context`, never
//! truncated: the admission step's place; a rejected request gives the router
//! its pool count back and teaches its calibrator nothing), then dispatched
//! to an endpoint of the pool by the pool's picker
//! ([`crate::pick::PoolPicker`], the server's) and queued there; an idle
//! endpoint starts iterating. The picker sees every endpoint's
//! [`crate::endpoint::EndpointState`] as a metrics scraper fills it: the
//! engine's waiting and running requests and KV-cache use (read at every
//! decision, or at every `scrape_interval` with the dispatches since added),
//! routecore's own requests in flight; it starts every dispatch (with the
//! prompt's block hashes) and completes every request once (with the usage).
//! The first `warmup` fraction of requests (by arrival) is left out of the
//! latency figures and of utilization, which is measured over the window from
//! the first measured arrival to the last arrival.
//!
//! Utilization is the share of slot-time held (sequences holding a slot over
//! `endpoints * max_num_seqs` slots), the one definition the planner reports
//! too. The model's figure beside it is the planner's engine model
//! ([`crate::planner::engine_state`]) at the pool's measured per-endpoint
//! arrival rate over the requests the pool actually served in the window, so
//! the two columns compare the same quantity.

pub mod autoscale;
pub mod cache;
pub mod disagg;
pub mod engine;
pub mod flow;
pub mod prefix_workload;
pub mod profile;
pub mod router;
pub mod timing;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::budget::{Pool, MAX_TOKENS};
use crate::dispatch::{dispatch_now, Steps};
use crate::endpoint::MAX_ENDPOINTS;
use crate::error::{invalid, non_negative, positive, Result};
use crate::kv::{KvConfig, KvIndex};
use crate::pick::{PickConfig, PickRequest, Pipeline, PluginSpec, PoolPicker};
use crate::planner::{engine_state, EngineLoad, EngineShape, EngineState};
use crate::prefix::IdChain;
use crate::rng::Rng;

use engine::{blocks_for, Endpoint, EngineLimits, Event};
use router::{Compress, FleetRouter, Homogeneous, Routed, TokenBudgetRouting};
use timing::{Batch, TimingModel};

/// One request of the workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimRequest {
    /// Arrival time, seconds.
    pub arrival: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Index into the simulation's categories.
    pub category: usize,
    /// The conversation it belongs to, the session-affinity key of the
    /// endpoint picker (None: no session).
    pub session: Option<u64>,
}

/// The requests' KV block hashes, for the endpoints' prefix caches (see
/// [`engine`]): request `i`'s are `hashes[offsets[i]..offsets[i + 1]]`, the
/// chained hashes ([`crate::prefix::block_hashes`]) of the full 16-token
/// blocks of its prompt followed by its output. With the blocks' token ids
/// (`tokens`, 16 per hash: block `j`'s are `tokens[16 j..16 (j + 1)]`) the
/// endpoints publish vLLM's KV-cache events and the picker gets each prompt's
/// token ids, which the `precise-prefix` scorer needs; without (empty), it
/// falls back to the approximate index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestBlocks {
    pub hashes: Vec<u64>,
    pub offsets: Vec<usize>,
    pub tokens: Vec<u32>,
    /// Every request's hashes are the chained hashes of its tokens
    /// (`block_hashes(tokens, BLOCK_TOKENS, 0)`): a pick then hands them to
    /// the precise-prefix scorer as the tokens' hashes
    /// (`PickRequest::hashes_of_ids`), which hashes the prompt no more.
    chained: bool,
}

impl RequestBlocks {
    /// Checks the offsets against the hashes and the request count.
    pub fn new(hashes: Vec<u64>, offsets: Vec<usize>, requests: usize) -> Result<Self> {
        if offsets.len() != requests + 1 {
            return Err(invalid(format!(
                "block hash offsets must have one entry per request plus one ({}), got {}",
                requests + 1,
                offsets.len()
            )));
        }
        if offsets.first() != Some(&0)
            || offsets.last() != Some(&hashes.len())
            || offsets.windows(2).any(|w| w[1] < w[0])
        {
            return Err(invalid(
                "block hash offsets must start at 0, never decrease and end at the hash count",
            ));
        }
        Ok(Self {
            hashes,
            offsets,
            tokens: Vec::new(),
            chained: false,
        })
    }

    /// The same with the blocks' token ids, `BLOCK_TOKENS` per hash. Checks
    /// whether the hashes are the tokens' chain (one pass over the tokens,
    /// instead of one per pick).
    pub fn with_tokens(mut self, tokens: Vec<u32>) -> Result<Self> {
        let want = self.hashes.len() * engine::BLOCK_TOKENS as usize;
        if tokens.len() != want {
            return Err(invalid(format!(
                "block tokens must hold {} token ids per block hash ({want}), got {}",
                engine::BLOCK_TOKENS,
                tokens.len()
            )));
        }
        let b = engine::BLOCK_TOKENS as usize;
        self.chained = self.offsets.windows(2).all(|w| {
            IdChain::new(&tokens[w[0] * b..w[1] * b], b, 0, 0)
                .eq(self.hashes[w[0]..w[1]].iter().copied())
        });
        self.tokens = tokens;
        Ok(self)
    }

    /// No hashes: every prefix cache stays empty.
    pub fn none(requests: usize) -> Self {
        Self {
            hashes: Vec::new(),
            offsets: vec![0; requests + 1],
            tokens: Vec::new(),
            chained: false,
        }
    }

    /// Whether the blocks' token ids are known.
    pub fn has_tokens(&self) -> bool {
        !self.tokens.is_empty()
    }

    fn range(&self, request: usize) -> (usize, usize) {
        (self.offsets[request], self.offsets[request + 1])
    }

    /// Request `i`'s prompt blocks: the indices of its `input_tokens`' full
    /// blocks in `hashes`.
    fn prompt_range(&self, request: usize, input_tokens: u64) -> std::ops::Range<usize> {
        leading_blocks(self.range(request), input_tokens)
    }

    /// Request `i`'s prompt blocks: the hashes of its `input_tokens`' full blocks.
    pub fn prompt(&self, request: usize, input_tokens: u64) -> &[u64] {
        &self.hashes[self.prompt_range(request, input_tokens)]
    }

    /// The token ids of blocks `blocks` (indices into `hashes`); None when
    /// the tokens are not known.
    pub fn tokens_of(&self, blocks: std::ops::Range<usize>) -> Option<&[u32]> {
        let b = engine::BLOCK_TOKENS as usize;
        self.tokens
            .get(blocks.start * b..blocks.end * b)
            .filter(|_| self.has_tokens())
    }

    /// Request `i`'s prompt token ids (its full blocks'), when known.
    pub fn prompt_tokens(&self, request: usize, input_tokens: u64) -> Option<&[u32]> {
        self.tokens_of(self.prompt_range(request, input_tokens))
    }
}

/// The full blocks of the first `tokens` tokens of a request whose blocks
/// are `start..end` (as many as there are).
fn leading_blocks((start, end): (usize, usize), tokens: u64) -> std::ops::Range<usize> {
    let n = (end - start).min((tokens / engine::BLOCK_TOKENS) as usize);
    start..start + n
}

/// A traffic category: its name (the calibrator's), its true bytes-per-token
/// ratio, and whether compress-and-route may compress it (code is excluded in
/// FleetOpt section 5.2).
#[derive(Debug, Clone, PartialEq)]
pub struct Category {
    pub name: String,
    pub bytes_per_token: f64,
    pub compressible: bool,
}

/// A pool of identical endpoints.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub name: String,
    pub endpoints: usize,
    pub max_context: u64,
    /// The token-budget router's budget for the pool (defaults to max_context).
    pub budget: u64,
    /// Sequence slots per endpoint (vLLM max_num_seqs).
    pub max_num_seqs: usize,
    /// KV blocks (16 tokens each) per endpoint.
    pub kv_blocks: u64,
    /// Prefill tokens per iteration (C_chunk).
    pub chunk: u64,
    pub gpus_per_endpoint: u64,
    pub timing: Arc<dyn TimingModel>,
}

impl PoolConfig {
    /// Checks every limit. The block budget must hold one sequence of
    /// `max_context` tokens, so that every admissible request can run.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        endpoints: i64,
        max_context: i64,
        max_num_seqs: i64,
        kv_blocks: i64,
        chunk: i64,
        gpus_per_endpoint: i64,
        budget: Option<i64>,
        timing: Arc<dyn TimingModel>,
    ) -> Result<Self> {
        // Pool::new checks the name, max_context and budget.
        let pool = Pool::new(name, max_context, budget, None)?;
        let count = |what: &str, v: i64, max: i64| -> Result<u64> {
            if v < 1 || v > max {
                return Err(invalid(format!(
                    "pool {name:?}: {what} must be in [1, {max}], got {v}"
                )));
            }
            Ok(v as u64)
        };
        let endpoints = count("endpoints", endpoints, MAX_ENDPOINTS as i64)? as usize;
        let max_num_seqs = count("max_num_seqs", max_num_seqs, 1 << 16)? as usize;
        let kv_blocks = count("kv_blocks", kv_blocks, 1 << 32)?;
        let chunk = count("chunk", chunk, MAX_TOKENS as i64)?;
        let gpus_per_endpoint = count("gpus_per_endpoint", gpus_per_endpoint, 1 << 10)?;
        if kv_blocks < blocks_for(pool.max_context) {
            return Err(invalid(format!(
                "pool {name:?}: kv_blocks {kv_blocks} cannot hold one sequence of max_context {} \
                 ({} blocks of 16 tokens)",
                pool.max_context,
                blocks_for(pool.max_context)
            )));
        }
        Ok(Self {
            name: pool.name,
            endpoints,
            max_context: pool.max_context,
            budget: pool.budget,
            max_num_seqs,
            kv_blocks,
            chunk,
            gpus_per_endpoint,
            timing,
        })
    }

    fn limits(&self, fast_forward: bool) -> EngineLimits {
        EngineLimits {
            max_num_seqs: self.max_num_seqs,
            kv_blocks: self.kv_blocks,
            chunk: self.chunk,
            fast_forward,
        }
    }
}

/// Which router stands in front of the fleet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterKind {
    /// One pool, everything to it.
    Homogeneous,
    /// routecore's token-budget router over the pools.
    TokenBudget,
    /// Token-budget routing plus compress-and-route with this gamma.
    CompressAndRoute { gamma: f64 },
}

impl RouterKind {
    pub fn parse(name: &str, gamma: f64) -> Result<Self> {
        match name {
            "homogeneous" => Ok(Self::Homogeneous),
            "token-budget" => Ok(Self::TokenBudget),
            "compress-and-route" => Ok(Self::CompressAndRoute { gamma }),
            _ => Err(invalid(format!(
                "router must be homogeneous, token-budget or compress-and-route, got {name:?}"
            ))),
        }
    }
}

/// A simulation's settings besides the workload.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub pools: Vec<PoolConfig>,
    pub categories: Vec<Category>,
    /// The endpoint picker of every pool (e.g. a preset's
    /// [`crate::pick::preset_specs`]); each pool runs its own pipeline.
    pub picker: Vec<PluginSpec>,
    pub seed: u64,
    /// Fraction of requests, by arrival, left out of the figures (0.2).
    pub warmup: f64,
    /// See [`EngineLimits::fast_forward`]; true but in the equivalence test.
    pub fast_forward: bool,
    /// Seconds between two scrapes of the endpoints' metrics (waiting,
    /// running, KV-cache use), all endpoints at multiples of the interval;
    /// between scrapes the picker adds its own dispatches since the last one.
    /// 0: the picker reads the engines' state at every decision.
    pub scrape_interval: f64,
}

/// What happened to each request (NaN where it does not apply) and to each pool.
#[derive(Debug, Clone, Default)]
pub struct SimReport {
    /// Pool index per request, -1 when the router rejected it.
    pub pool: Vec<i64>,
    pub ttft: Vec<f64>,
    /// (e2e - ttft) / (L_out - 1); NaN for one-token outputs.
    pub tpot: Vec<f64>,
    pub e2e: Vec<f64>,
    /// From arrival to the first admission into a batch.
    pub queue_wait: Vec<f64>,
    /// Prompt tokens served from the endpoint's prefix cache at the first
    /// admission (0 when not served).
    pub cached_tokens: Vec<u64>,
    /// Index of the endpoint inside its pool per request, -1 when not
    /// dispatched.
    pub endpoint: Vec<i64>,
    /// In the measurement window (after the warm-up).
    pub measured: Vec<bool>,
    pub rejected: Vec<bool>,
    pub compressed: Vec<bool>,
    pub pools: Vec<PoolReport>,
    /// Requests no pool could hold, by the router's estimate.
    pub router_rejections: u64,
    /// Measurement window, seconds.
    pub window: (f64, f64),
    /// Simulated time at which the last request finished.
    pub makespan: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PoolReport {
    pub name: String,
    pub endpoints: usize,
    pub gpus: u64,
    pub max_context: u64,
    /// Measured requests the pool served (rejections excluded).
    pub requests: u64,
    /// Share of slot-time held, measured.
    pub utilization_simulated: f64,
    /// The same, predicted by the planner's engine model (see [`model_state`]).
    pub utilization_model: f64,
    /// The prefill budget's utilization, measured: prompt tokens prefilled
    /// over `chunk` per iteration run, inside the window.
    pub prefill_utilization_simulated: f64,
    /// The same, predicted by the engine model.
    pub prefill_utilization_model: f64,
    /// Over the whole run, warm-up included.
    pub preemptions: u64,
    pub rejections: u64,
    pub compressed: u64,
}

/// Arrival times for `n` requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// The requests' own times.
    AsGiven,
    /// The requests' own times, shifted to start at 0 and scaled so that the
    /// mean rate is this many requests per second.
    Scaled(f64),
    /// A Poisson process at this rate (seeded), in the requests' order.
    Poisson(f64),
}

/// Rewrites the requests' arrival times. Times must be finite, >= 0 and
/// sorted.
pub fn set_arrivals(requests: &mut [SimRequest], arrivals: Arrivals, seed: u64) -> Result<()> {
    check_sorted(requests)?;
    match arrivals {
        Arrivals::AsGiven => {}
        Arrivals::Scaled(rate) => {
            positive("rate", rate)?;
            let (Some(first), Some(last)) = (requests.first(), requests.last()) else {
                return Ok(());
            };
            let (t0, span) = (first.arrival, last.arrival - first.arrival);
            let n = requests.len() as f64;
            // The trace's own rate is (n - 1) / span; scale it to `rate`.
            let scale = if span > 0.0 {
                (n - 1.0) / span / rate
            } else {
                0.0
            };
            for r in requests.iter_mut() {
                r.arrival = (r.arrival - t0) * scale;
            }
        }
        Arrivals::Poisson(rate) => {
            positive("rate", rate)?;
            let mut rng = Rng::new(seed ^ 0xA5A5_5A5A_0F0F_F0F0);
            let mut t = 0.0;
            for r in requests.iter_mut() {
                t += rng.exponential(rate);
                r.arrival = t;
            }
        }
    }
    Ok(())
}

fn check_sorted(requests: &[SimRequest]) -> Result<()> {
    if requests.windows(2).any(|w| w[1].arrival < w[0].arrival) {
        return Err(invalid("arrival times must be sorted"));
    }
    Ok(())
}

/// Checks a workload against the categories.
pub fn check_requests(requests: &[SimRequest], categories: &[Category]) -> Result<()> {
    for (i, r) in requests.iter().enumerate() {
        non_negative("arrival time", r.arrival)?;
        if r.input_tokens < 1 || r.input_tokens > MAX_TOKENS {
            return Err(invalid(format!(
                "request {i}: input_tokens must be in [1, {MAX_TOKENS}], got {}",
                r.input_tokens
            )));
        }
        if r.output_tokens < 1 || r.output_tokens > MAX_TOKENS {
            return Err(invalid(format!(
                "request {i}: output_tokens must be in [1, {MAX_TOKENS}], got {}",
                r.output_tokens
            )));
        }
        if r.category >= categories.len() {
            return Err(invalid(format!(
                "request {i}: category {} is not among the {} categories",
                r.category,
                categories.len()
            )));
        }
    }
    Ok(())
}

fn check_config(config: &SimConfig) -> Result<()> {
    if config.pools.is_empty() {
        return Err(invalid("at least one pool is required"));
    }
    if config.categories.is_empty() {
        return Err(invalid("at least one category is required"));
    }
    for c in &config.categories {
        positive("bytes_per_token", c.bytes_per_token)?;
    }
    non_negative("scrape_interval", config.scrape_interval)?;
    let w = non_negative("warmup", config.warmup)?;
    if w >= 1.0 {
        return Err(invalid(format!("warmup must be in [0, 1), got {w}")));
    }
    Ok(())
}

/// Builds the router of `kind` for the pools.
pub fn make_router(kind: RouterKind, config: &SimConfig) -> Result<Box<dyn FleetRouter>> {
    let pools = || -> Result<Vec<Pool>> {
        config
            .pools
            .iter()
            .map(|p| Pool::new(&p.name, p.max_context as i64, Some(p.budget as i64), None))
            .collect()
    };
    Ok(match kind {
        RouterKind::Homogeneous => {
            if config.pools.len() != 1 {
                return Err(invalid(format!(
                    "the homogeneous router takes exactly one pool, got {}",
                    config.pools.len()
                )));
            }
            Box::new(Homogeneous)
        }
        RouterKind::TokenBudget => {
            Box::new(TokenBudgetRouting::new(pools()?, &config.categories, None)?)
        }
        RouterKind::CompressAndRoute { gamma } => Box::new(TokenBudgetRouting::new(
            pools()?,
            &config.categories,
            Some(Compress { gamma }),
        )?),
    })
}

/// The precise prefix index of a run whose picker reads one (a
/// `precise-prefix` scorer) and whose blocks carry their token ids (None
/// otherwise): keyed like the endpoints' caches (16-token blocks; its own seed, which need not
/// be the workload's) and large enough to follow the largest cache.
fn kv_index(blocks: &RequestBlocks, config: &SimConfig) -> Result<Option<Arc<KvIndex>>> {
    let precise = crate::pick::needs(&config.picker).kv_index;
    if !(precise && blocks.has_tokens()) {
        return Ok(None);
    }
    let largest = config.pools.iter().map(|p| p.kv_blocks).max().unwrap_or(1);
    let capacity_blocks = usize::try_from(largest)
        .unwrap_or(usize::MAX)
        .min(crate::prefix::MAX_CAPACITY_BLOCKS);
    Ok(Some(Arc::new(KvIndex::new(KvConfig {
        block_size: engine::BLOCK_TOKENS as usize,
        capacity_blocks,
        ..KvConfig::default()
    })?)))
}

/// Runs the simulation. `progress` counts processed arrivals as it goes.
pub fn simulate(
    requests: &[SimRequest],
    blocks: &RequestBlocks,
    config: &SimConfig,
    router: &mut dyn FleetRouter,
    progress: &AtomicU64,
) -> Result<SimReport> {
    check_config(config)?;
    check_requests(requests, &config.categories)?;
    check_sorted(requests)?;
    if blocks.offsets.len() != requests.len() + 1 {
        return Err(invalid("block hashes must be given for every request"));
    }
    Fleet::new(requests, blocks, config)?.run(router, progress)
}

/// Scheduled iteration ends: (time bits, endpoint, version). An entry whose
/// version is not the endpoint's current one was superseded.
type Heap = BinaryHeap<Reverse<(u64, usize, u64)>>;

/// Why an arrival went no further than routing or admission (counted in
/// the report), or the error that stops the run.
enum Refused {
    Rejected,
    Failed(crate::error::Error),
}

impl From<crate::error::Error> for Refused {
    fn from(e: crate::error::Error) -> Self {
        Refused::Failed(e)
    }
}

/// One arrival's steps, in the data plane's order ([`crate::dispatch`]):
/// the fleet's router chooses the pool, admission (today the pool's hard
/// context constraint; the place of the admission layer's quotas) admits it,
/// the pool's picker chooses the endpoint.
struct Arrival<'f, 'a> {
    fleet: &'f mut Fleet<'a>,
    router: &'f mut dyn FleetRouter,
    k: usize,
    request: SimRequest,
    /// An error giving a step back (reported after the dispatch).
    failed: Option<crate::error::Error>,
}

impl Steps for Arrival<'_, '_> {
    type Pool = Routed;
    type Admitted = ();
    type Picked = usize;
    type Refused = Refused;

    fn route(&mut self) -> std::result::Result<Routed, Refused> {
        let (rep, k) = (&mut self.fleet.report, self.k);
        let Some(routed) = self.router.route(&self.request)? else {
            rep.rejected[k] = true;
            rep.router_rejections += 1;
            return Err(Refused::Rejected);
        };
        if self.fleet.config.pools.get(routed.pool).is_none() {
            let message = format!("router chose pool {} of none", routed.pool);
            self.router.unroute(routed)?;
            return Err(invalid(message).into());
        }
        rep.pool[k] = routed.pool as i64;
        rep.compressed[k] = routed.compressed;
        Ok(routed)
    }

    fn admit(&mut self, routed: &Routed) -> impl Future<Output = std::result::Result<(), Refused>> {
        let context = self.fleet.config.pools[routed.pool].max_context;
        let fits = routed.input_tokens + self.request.output_tokens <= context;
        if !fits {
            self.fleet.report.rejected[self.k] = true;
        }
        std::future::ready(if fits { Ok(()) } else { Err(Refused::Rejected) })
    }

    fn pick(&mut self, &routed: &Routed, _: &()) -> std::result::Result<usize, Refused> {
        Ok(self.fleet.dispatch(routed.pool, self.k, routed)?)
    }

    fn unadmit(&mut self, _: &Routed, _: ()) {}

    fn unroute(&mut self, routed: Routed) {
        if let Err(e) = self.router.unroute(routed) {
            self.failed.get_or_insert(e);
        }
    }
}

struct Fleet<'a> {
    requests: &'a [SimRequest],
    blocks: &'a RequestBlocks,
    config: &'a SimConfig,
    endpoints: Vec<Endpoint>,
    /// Index of the first endpoint of each pool (and the total at the end).
    first: Vec<usize>,
    pool_of: Vec<usize>,
    version: Vec<u64>,
    /// Each pool's picker, with what it knows of the pool's endpoints
    /// (their states, in the pool's order).
    pickers: Vec<PoolPicker>,
    /// Every endpoint's name, as the pickers and the KV index know it.
    names: Vec<String>,
    /// The precise prefix index the endpoints' KV-cache events feed, and the
    /// next event batch's sequence number per endpoint (see [`Fleet::publish`]).
    kv: Option<Arc<KvIndex>>,
    kv_seq: Vec<u64>,
    /// The next scrape is the `scrapes`-th multiple of the interval.
    scrapes: u64,
    /// The session key of the request being picked, as text.
    session: String,
    window: (f64, f64),
    first_measured: usize,
    routed: Vec<Option<Routed>>,
    report: SimReport,
}

impl<'a> Fleet<'a> {
    fn new(
        requests: &'a [SimRequest],
        blocks: &'a RequestBlocks,
        config: &'a SimConfig,
    ) -> Result<Self> {
        let mut first = vec![0];
        let mut endpoints = Vec::new();
        let mut pool_of = Vec::new();
        let mut pickers = Vec::new();
        let mut all_names = Vec::new();
        let kv = kv_index(blocks, config)?;
        for (p, pool) in config.pools.iter().enumerate() {
            let names: Vec<String> = (0..pool.endpoints)
                .map(|j| format!("{}-{j}", pool.name))
                .collect();
            let pick = PickConfig {
                seed: config.seed.wrapping_add(p as u64),
                kv_index: kv.clone(),
                ..PickConfig::default()
            };
            let pipeline = Pipeline::from_specs(&config.picker, &names, &pick)?;
            pickers.push(PoolPicker::new(pipeline));
            for name in names {
                let mut endpoint = Endpoint::new(pool.limits(config.fast_forward));
                if let Some(kv) = &kv {
                    // The endpoint's event stream is up from the start.
                    kv.add_endpoint(&name);
                    kv.set_connected(&name, true)?;
                    endpoint.cache.publish();
                }
                endpoints.push(endpoint);
                all_names.push(name);
                pool_of.push(p);
            }
            first.push(endpoints.len());
        }
        let n = requests.len();
        let first_measured = ((n as f64) * config.warmup).floor() as usize;
        let window = match (requests.get(first_measured), requests.last()) {
            (Some(a), Some(b)) => (a.arrival, b.arrival),
            _ => (0.0, 0.0),
        };
        let nan = vec![f64::NAN; n];
        Ok(Self {
            requests,
            blocks,
            config,
            endpoints,
            first,
            version: vec![0; pool_of.len()],
            kv_seq: vec![0; pool_of.len()],
            pool_of,
            pickers,
            names: all_names,
            kv,
            scrapes: 0,
            session: String::new(),
            window,
            first_measured,
            routed: vec![None; n],
            report: SimReport {
                pool: vec![-1; n],
                ttft: nan.clone(),
                tpot: nan.clone(),
                e2e: nan.clone(),
                queue_wait: nan,
                cached_tokens: vec![0; n],
                endpoint: vec![-1; n],
                measured: (0..n).map(|i| i >= first_measured).collect(),
                rejected: vec![false; n],
                compressed: vec![false; n],
                pools: Vec::new(),
                router_rejections: 0,
                window,
                makespan: 0.0,
            },
        })
    }

    /// Reads endpoint `i`'s metrics into its state, as a scrape does.
    fn scrape(&mut self, i: usize) {
        let pool = self.pool_of[i];
        let st = &mut self.pickers[pool].states[i - self.first[pool]];
        let e = &self.endpoints[i];
        st.waiting = Some(e.waiting() as f64);
        st.running = Some(e.running() as f64);
        st.kv_usage = Some(e.kv_usage());
        st.dispatched_since_scrape = 0;
    }

    /// A scrape of every endpoint, due at or before `t_next` (the next event),
    /// if scraping is periodic; the next one is then the first multiple of the
    /// interval at or after `t_next`, since nothing changes before it.
    fn scrape_due(&mut self, t_next: f64) -> bool {
        let interval = self.config.scrape_interval;
        if interval <= 0.0 || (self.scrapes as f64) * interval > t_next {
            return false;
        }
        for i in 0..self.endpoints.len() {
            self.scrape(i);
        }
        self.scrapes = ((t_next / interval).ceil() as u64).max(self.scrapes + 1);
        true
    }

    /// The endpoint of `pool` for request `k`, from the pool's picker.
    fn dispatch(&mut self, pool: usize, k: usize, routed: Routed) -> Result<usize> {
        let (lo, hi) = (self.first[pool], self.first[pool + 1]);
        if self.config.scrape_interval <= 0.0 {
            for i in lo..hi {
                self.scrape(i);
            }
        }
        let r = &self.requests[k];
        let blocks = self.blocks;
        self.session.clear();
        if let Some(s) = r.session {
            // Writing into a String cannot fail.
            let _ = write!(self.session, "{s}");
        }
        let req = PickRequest {
            session: r.session.map(|_| self.session.as_str()),
            // A compressed prompt is another text: no hashes for it.
            hashes: if routed.compressed {
                &[]
            } else {
                blocks.prompt(k, routed.input_tokens)
            },
            token_ids: if routed.compressed {
                None
            } else {
                blocks.prompt_tokens(k, routed.input_tokens)
            },
            // The hashes serve both prefix indexes when they are the tokens'
            // chain as the prefix plugin hashes (its block size, seed 0).
            hashes_of_ids: !routed.compressed
                && blocks.chained
                && self.pickers[pool].block() == Some((engine::BLOCK_TOKENS as usize, 0)),
            input_tokens: routed.input_tokens,
            output_tokens: r.output_tokens,
            now: r.arrival,
            ..PickRequest::default()
        };
        let j = self.pickers[pool]
            .start(&req)?
            .ok_or_else(|| invalid(format!("the picker of pool {pool} chose no endpoint")))?;
        Ok(lo + j)
    }

    /// Applies the KV-cache events endpoint `i`'s cache published since the
    /// last call (the step that ends at `now`), as one batch, to the precise
    /// prefix index: the same `KvIndex::observe` and `apply` as `serve`'s
    /// event subscribers (without their transport: no delay, no loss).
    fn publish(&mut self, i: usize, now: f64) -> Result<()> {
        let Some(kv) = &self.kv else {
            return Ok(());
        };
        let events = self.endpoints[i].cache.take_events();
        if events.is_empty() {
            return Ok(());
        }
        let (name, seq) = (&self.names[i], self.kv_seq[i]);
        kv.observe(name, seq)?;
        let batch: Vec<_> = events.into_iter().map(Ok).collect();
        kv.apply(name, seq, &batch, now)?;
        self.kv_seq[i] += 1;
        Ok(())
    }

    fn start(&mut self, i: usize, now: f64, heap: &mut Heap) {
        let timing = self.config.pools[self.pool_of[i]].timing.as_ref();
        let inst = &mut self.endpoints[i];
        match inst.step(now, timing, self.window, self.blocks) {
            Some(dt) => {
                inst.busy = true;
                self.version[i] += 1;
                // Non-negative f64 order as their bits do.
                heap.push(Reverse(((now + dt).to_bits(), i, self.version[i])));
            }
            None => inst.busy = false,
        }
    }

    fn arrive(&mut self, k: usize, router: &mut dyn FleetRouter, heap: &mut Heap) -> Result<()> {
        let r = self.requests[k];
        let mut steps = Arrival {
            fleet: self,
            router,
            k,
            request: r,
            failed: None,
        };
        let outcome = dispatch_now(&mut steps);
        if let Some(e) = steps.failed.take() {
            return Err(e);
        }
        let (routed, i) = match outcome {
            Some(Ok(d)) => (d.pool, d.picked),
            Some(Err(Refused::Rejected)) => return Ok(()),
            Some(Err(Refused::Failed(e))) => return Err(e),
            None => return Err(invalid("a simulator step waited")),
        };
        self.routed[k] = Some(routed);
        self.report.endpoint[k] = (i - self.first[routed.pool]) as i64;
        let hashes = if routed.compressed {
            (0, 0)
        } else {
            self.blocks.range(k)
        };
        self.endpoints[i].enqueue(k, routed.input_tokens, r.output_tokens, hashes);
        let inst = &mut self.endpoints[i];
        let wake = if inst.busy {
            inst.interrupt(r.arrival)
        } else {
            // Wake the endpoint at this time, after every arrival of the same
            // instant: a simultaneous burst shares the first iteration.
            inst.busy = true;
            Some(r.arrival)
        };
        if let Some(t) = wake {
            self.version[i] += 1;
            heap.push(Reverse((t.to_bits(), i, self.version[i])));
        }
        Ok(())
    }

    fn handle(&mut self, event: Event, router: &mut dyn FleetRouter) -> Result<()> {
        let rep = &mut self.report;
        match event {
            Event::Admitted {
                request,
                time,
                cached,
            } => {
                if rep.queue_wait[request].is_nan() {
                    rep.queue_wait[request] = time - self.requests[request].arrival;
                    rep.cached_tokens[request] = cached;
                }
            }
            Event::FirstToken { request, time } => {
                rep.ttft[request] = time - self.requests[request].arrival;
            }
            Event::Finished { request, time } => {
                let r = &self.requests[request];
                let e2e = time - r.arrival;
                rep.e2e[request] = e2e;
                if r.output_tokens > 1 {
                    rep.tpot[request] = (e2e - rep.ttft[request]) / (r.output_tokens - 1) as f64;
                }
                rep.makespan = rep.makespan.max(time);
                if let Some(routed) = self.routed[request] {
                    let j = rep.endpoint[request] as usize;
                    let done = PickRequest {
                        now: time,
                        ..PickRequest::default()
                    };
                    self.pickers[routed.pool].complete(
                        j,
                        &done,
                        routed.input_tokens,
                        r.output_tokens,
                    )?;
                    router.complete(r, routed)?;
                }
            }
        }
        Ok(())
    }

    fn run(mut self, router: &mut dyn FleetRouter, progress: &AtomicU64) -> Result<SimReport> {
        let mut heap = Heap::new();
        let mut next = 0;
        let mut events = Vec::new();
        loop {
            let t_end = heap.peek().map(|Reverse((t, _, _))| f64::from_bits(*t));
            let t_arr = self.requests.get(next).map(|r| r.arrival);
            let arrival_first = match (t_arr, t_end) {
                (None, None) => break,
                (Some(ta), Some(te)) => ta <= te,
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            let t_next = if arrival_first { t_arr } else { t_end };
            if self.scrape_due(t_next.unwrap_or(f64::INFINITY)) {
                continue;
            }
            if arrival_first {
                self.arrive(next, router, &mut heap)?;
                next += 1;
                if next % 1024 == 0 {
                    progress.store(next as u64, Ordering::Relaxed);
                }
            } else if let Some(Reverse((te, i, version))) = heap.pop() {
                if version != self.version[i] {
                    continue;
                }
                let now = f64::from_bits(te);
                self.endpoints[i].end_iteration(self.window, self.blocks);
                std::mem::swap(&mut events, &mut self.endpoints[i].pending);
                for e in events.drain(..) {
                    self.handle(e, router)?;
                }
                // The ended step's events (its prefills, its finished
                // sequences), before the next step makes more.
                self.publish(i, now)?;
                self.start(i, now, &mut heap);
            }
        }
        progress.store(self.requests.len() as u64, Ordering::Relaxed);
        self.finish()
    }

    fn finish(mut self) -> Result<SimReport> {
        let span = self.window.1 - self.window.0;
        for (p, pool) in self.config.pools.iter().enumerate() {
            let insts = &self.endpoints[self.first[p]..self.first[p + 1]];
            let slot_seconds: f64 = insts.iter().map(|i| i.slot_seconds).sum();
            let slots = (pool.endpoints * pool.max_num_seqs) as f64;
            let mut requests = 0u64;
            let mut sums = [0.0f64; 5];
            let mut rejections = 0;
            let mut compressed = 0;
            for k in 0..self.requests.len() {
                if self.report.pool[k] != p as i64 {
                    continue;
                }
                if self.report.rejected[k] {
                    rejections += 1;
                    continue;
                }
                compressed += u64::from(self.report.compressed[k]);
                if k >= self.first_measured {
                    let input = self.routed[k].map_or(0, |r| r.input_tokens);
                    requests += 1;
                    let out = self.requests[k].output_tokens;
                    let a = (input.div_ceil(pool.chunk) + out).saturating_sub(1) as f64;
                    let p = input as f64;
                    for (s, v) in sums
                        .iter_mut()
                        .zip([a, a * a, p, p * p, a * (p + out as f64)])
                    {
                        *s += v;
                    }
                }
            }
            let model = (span > 0.0 && requests > 0).then(|| {
                let per_endpoint = requests as f64 / span / pool.endpoints as f64;
                model_state(per_endpoint, &sums.map(|s| s / requests as f64), pool)
            });
            let measured = |x: f64| if span > 0.0 { x / span } else { f64::NAN };
            let iterations: f64 = insts.iter().map(|i| i.iterations).sum();
            let prefilled: f64 = insts.iter().map(|i| i.prefill_tokens).sum();
            self.report.pools.push(PoolReport {
                name: pool.name.clone(),
                endpoints: pool.endpoints,
                gpus: pool.endpoints as u64 * pool.gpus_per_endpoint,
                max_context: pool.max_context,
                requests,
                utilization_simulated: measured(slot_seconds / slots),
                utilization_model: model.map_or(f64::NAN, |m| m.utilization),
                prefill_utilization_simulated: if iterations > 0.0 {
                    prefilled / (iterations * pool.chunk as f64)
                } else {
                    f64::NAN
                },
                prefill_utilization_model: model.map_or(f64::NAN, |m| m.prefill_utilization),
                preemptions: insts.iter().map(|i| i.preemptions).sum(),
                rejections,
                compressed,
            });
        }
        Ok(self.report)
    }
}

/// The planner's engine model ([`crate::planner::engine_state`]) of one
/// endpoint of `pool` at `rate` requests per second, from the served
/// requests' means `[E[a], E[a^2], E[L_in], E[L_in^2], E[a L_total]]`
/// (`a = ceil(L_in / C) + L_out - 1`). The timing model is read as linear:
/// `W = t(0)`, `H = t(1) - t(0)`, exact for [`timing::LinearTiming`].
pub fn model_state(rate: f64, means: &[f64; 5], pool: &PoolConfig) -> EngineState {
    let t = |n| {
        pool.timing.iteration_time(Batch {
            n_active: n,
            prefill_tokens: 0,
        })
    };
    let [a, a2, p, p2, al] = *means;
    let load = EngineLoad {
        iterations: a,
        iterations_cs2: if a > 0.0 { (a2 - a * a) / (a * a) } else { 0.0 },
        prompt_mean: p,
        prompt_second: p2,
        kv_token_iterations: al,
        ..EngineLoad::default()
    };
    let shape = EngineShape {
        w_s: t(0),
        h_s: t(1) - t(0),
        chunk: pool.chunk,
        n_slots: pool.max_num_seqs as u64,
        kv_tokens: (pool.kv_blocks * engine::BLOCK_TOKENS) as f64,
    };
    engine_state(rate, pool.endpoints as u64, &load, &shape)
}

/// The `q`-th percentile (0..=100) of the finite values, linearly
/// interpolated between order statistics (NumPy's default); NaN when none.
pub fn percentile(values: &[f64], q: f64) -> f64 {
    let mut xs: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let pos = (q / 100.0).clamp(0.0, 1.0) * (xs.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    xs[lo] + (xs[hi] - xs[lo]) * (pos - lo as f64)
}

#[cfg(test)]
mod tests;
