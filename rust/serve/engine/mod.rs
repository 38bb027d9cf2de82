//! The routing state behind both front ends (ext_proc in Rust, the RouteCore
//! API through Python): tenants, pool and endpoint choice, admission, and the
//! leases of requests in flight.
//!
//! One [`Engine`] is built from one configuration [`Spec`]. It authenticates
//! the tenant (SHA-256 digests of the API keys, compared in constant time),
//! parses and routes the request with the core's `pipeline::route_request`
//! (token-budget pool, compress-and-route), or on the exact prompt token
//! count when the request's model has a tokenizer (`crate::tokenize`),
//! picks the endpoint inside the pool (least-request, prefix or VTC, over
//! the real token ids when there are), asks admission, and records a
//! [`Lease`] in the data plane's table ([`Shared`]) until the response ends,
//! the stream drops or the reaper finds it past its deadline. Whoever removes
//! a lease from the table releases it: exactly once, whatever the path.
//!
//! A request id is 128 random bits (SHA-256 of a secret drawn from the OS
//! at start and a counter), 32 hex digits: nobody can guess another
//! request's. A lease is ended by its own front end: its ext_proc stream, or
//! a RouteCore `Feedback` from the tenant that routed it ([`Caller`]);
//! Feedback never ends a stream's lease.
//!
//! A reload builds a new engine sharing the calibrator, the metrics and the
//! lease table; a lease is released by the engine that issued it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::budget::{
    compressible_category, Action, Decision, Pool, Request, TokenBudgetRouter, MAX_TOKENS,
};
use crate::calibrate::Calibrator;
use crate::classify::CATEGORIES;
use crate::compress::Compressor;
use crate::endpoint::EndpointState;
use crate::error::{invalid, Error, Result};
use crate::openai::{MediaTokens, ParsedRequest};
use crate::pick::{preset_specs, PickConfig, PickRequest, Pipeline, PoolPicker, Recorded};
use crate::pipeline::route_request;
use crate::prefix::Tokens;
use crate::tokenize::{Encoded, SpecialTokens, Tokenized, Tokenizer};

use super::admission::{Admission, AdmissionSpec, Ticket, Verdict};
use super::autoscale::{PlanePool, Scaling};
use super::config::{digest_from_hex, Spec};
use super::failure::FailureMode;
use super::handoff::PoolHandoff;
use super::limits::Overload;
use super::logs::{Occurrence, Repeats};
use super::metrics::{FCounter, FGauge, Metrics};
use super::scrape::{Probe, Scraper};
use super::usage::{plausible, Usage};
use dispatch::Routing;

mod auth;
mod autoscale;
mod chooser;
mod dispatch;
mod flow;
mod leases;
#[cfg(test)]
mod pd_tests;

use chooser::Choice;
pub use chooser::Chooser;

/// The VTC user of requests from no tenant (when no tenants are configured).
pub const ANONYMOUS: &str = "anonymous";

/// Phases a test can make fail once ([`Shared::inject_fault`]).
pub const FAULT_PHASES: [&str; 6] = [
    "request_headers",
    "routing",
    "admission",
    "response_headers",
    "response_body",
    "finish",
];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request refused: the HTTP status a gateway answers and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Reject {
    pub status: u16,
    pub reason: String,
    pub message: String,
    pub retry_after_s: f64,
}

/// What a routed request was given (the answer to the front end).
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub id: u128,
    pub request_id: String,
    pub pool: String,
    pub endpoint: String,
    /// Endpoints Envoy may retry on, best first (after `endpoint`).
    pub fallbacks: Vec<String>,
    /// The prefill endpoint of a request split by its pool's decider
    /// (`endpoint` decodes it); None: served on `endpoint` alone.
    pub prefill_endpoint: Option<String>,
    pub est_input_tokens: u64,
    pub est_output_tokens: u64,
    pub spilled: bool,
    pub reason: &'static str,
    pub compress_target_tokens: u64,
    /// The body to forward when routing rewrote it (compressed), else None.
    pub body: Option<Vec<u8>>,
}

/// A routing outcome: routed, or refused (a decision, not a failure).
pub type Outcome = std::result::Result<Routed, Reject>;

/// One request in flight.
#[derive(Debug)]
pub struct Lease {
    pool: usize,
    endpoint: usize,
    tenant: Option<usize>,
    /// The VTC user when it is not the tenant's name: the request's
    /// fairness id, scoped to its tenant ([`Engine::vtc_user`]).
    user: Option<String>,
    /// A RouteCore `Feedback` from its tenant may end it (routed through
    /// the RouteCore API, not an ext_proc stream).
    feedback: bool,
    est_input_tokens: u64,
    est_output_tokens: u64,
    /// Prompt bytes and category to feed the calibrator (None: not learned from).
    learn: Option<(u64, &'static str)>,
    started: Instant,
    deadline: Instant,
    ticket: Option<Ticket>,
    /// What the prefix plugin recorded for `endpoint`, moved with the lease
    /// when another endpoint serves the request ([`Shared::served`]).
    recorded: Recorded,
    /// The prefill endpoint of a split request, released with the lease.
    prefill: Option<usize>,
    /// An observing filter's stream named it ([`Shared::observe`]): that
    /// stream ends it.
    observed: bool,
    /// Its routing stream ended before the response, which an observing
    /// filter reads: released by the reaper if none names it by then
    /// ([`Shared::hand_over`]).
    awaited: Option<Instant>,
}

/// What the endpoint picker reads of a request's prompt: the prefix plugin
/// hashes the prompt (the messages' text in order, or the token ids), never
/// the raw JSON body, so the order of its keys does not matter.
#[derive(Debug, Clone, Copy)]
pub enum Key<'a> {
    None,
    /// An OpenAI request body (its prompt is read only when a prefix plugin
    /// asks for it).
    Body(&'a [u8]),
    Ids(&'a [u32]),
}

/// The prompt a body carries, as the prefix plugin hashes it: token ids when
/// the prompt is given as ids, else every text the engine tokenizes, in
/// order, each ended by a record separator (so `["ab", "c"]` and
/// `["a", "bc"]` differ). None for a body that is not a request.
fn prompt_of(body: &[u8]) -> Option<Prompt> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    if let Some(serde_json::Value::Array(items)) = v.get("prompt") {
        let ids: Option<Vec<u32>> = items
            .iter()
            .map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect();
        if let Some(ids) = ids.filter(|i| !i.is_empty()) {
            return Some(Prompt::Ids(ids));
        }
    }
    let texts = crate::openai::prompt_texts(&v).ok()?;
    let mut out = Vec::new();
    for t in &texts.texts {
        out.extend_from_slice(t.text.as_bytes());
        out.push(0x1e);
    }
    Some(Prompt::Bytes(out))
}

/// A prompt read out of a body (see [`prompt_of`]).
enum Prompt {
    Ids(Vec<u32>),
    Bytes(Vec<u8>),
}

impl Prompt {
    fn tokens(&self) -> Tokens<'_> {
        match self {
            Prompt::Ids(t) => Tokens::Ids(t),
            Prompt::Bytes(b) => Tokens::Bytes(b),
        }
    }
}

/// What a request tells the endpoint picker beside its body: the Envoy
/// protocol's hints (read by the ext_proc front end), and the prompt's token
/// ids a RouteCore API caller gives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hints {
    /// `x-gateway-destination-endpoint-subset` of the `envoy.lb.subset_hint`
    /// filter metadata: pick only among these.
    pub subset: Option<Vec<String>>,
    /// `x-llm-d-inference-objective` (alias `x-gateway-inference-objective`):
    /// its priority (`router.objectives`); a negative one is sheddable.
    pub objective: Option<String>,
    /// `x-llm-d-inference-fairness-id` (alias `x-gateway-inference-fairness-id`):
    /// the VTC user (default: the tenant), scoped to the tenant that sent it.
    pub fairness_id: Option<String>,
    /// The prompt's token ids from the caller: they key the prefix plugins
    /// (precise-prefix included) in place of the body's prompt.
    pub token_ids: Option<Vec<u32>>,
    /// Told the longest wait when the request starts waiting in a
    /// flow-control queue (the ext_proc stream extends Envoy's message
    /// timeout by it).
    pub on_wait: Option<crate::serve::flow::WaitNotice>,
}

impl Hints {
    /// What keys the prefix plugins: the caller's token ids, else `prompt`.
    fn key<'a>(&'a self, prompt: Key<'a>) -> Key<'a> {
        self.token_ids.as_deref().map_or(prompt, Key::Ids)
    }
}

/// A request described by its measured fields: `prompt_tokens` when known
/// exactly, else `prompt_bytes` of `category`; `token_ids` key the prefix
/// policy.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    pub prompt_bytes: u64,
    pub category: &'a str,
    pub max_output_tokens: u64,
    pub prompt_tokens: Option<u64>,
    pub token_ids: Option<&'a [u32]>,
}

/// What the endpoint choice reads of one request.
#[derive(Debug, Clone, Copy)]
struct Ask<'a> {
    key: Key<'a>,
    /// The request's `model` (routes to the pools serving it).
    model: Option<&'a str>,
    hints: &'a Hints,
}

struct Tenant {
    name: String,
    digests: Vec<[u8; 32]>,
    expires_at: Option<f64>,
    service_class: String,
    entitlement: Option<String>,
}

struct PoolMetrics {
    decisions: FCounter,
    spillovers: FCounter,
    disaggregated: FCounter,
    timeouts: FCounter,
    absurd_usage: FCounter,
    in_flight: Vec<FGauge>,
}

/// Who ends a request in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller<'a> {
    /// The request's own ext_proc stream, or the Python control plane
    /// (`DataPlane.finish`): any lease.
    Trusted,
    /// A RouteCore `Feedback` authenticated as this tenant (None: no tenants
    /// configured): only the leases it routed through the RouteCore API.
    Tenant(Option<&'a str>),
}

/// The longest request id a caller may name (the ids are 32 hex digits).
pub const MAX_REQUEST_ID_BYTES: usize = 64;

/// Request ids: 128 bits of SHA-256 over a secret drawn from the OS at
/// start and a counter, so that no id tells anything of another.
struct RequestIds {
    secret: [u8; 32],
    counter: AtomicU64,
}

impl RequestIds {
    fn new() -> Self {
        let mut secret = [0u8; 32];
        if getrandom::fill(&mut secret).is_err() {
            // No OS generator (never on Linux): std's hash keys, which are
            // drawn from the OS too, hashed with the time.
            use std::hash::{BuildHasher, Hasher};
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            for (i, part) in secret.chunks_mut(8).enumerate() {
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u128(nanos);
                h.write_usize(i);
                part.copy_from_slice(&h.finish().to_le_bytes());
            }
        }
        Self {
            secret,
            counter: AtomicU64::new(0),
        }
    }

    fn next(&self) -> u128 {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let digest = Sha256::new()
            .chain_update(self.secret)
            .chain_update(n.to_le_bytes())
            .finalize();
        let mut id = [0u8; 16];
        id.copy_from_slice(&digest[..16]);
        u128::from_le_bytes(id)
    }
}

/// What every engine of one data plane shares across reloads.
pub struct Shared {
    pub metrics: Arc<Metrics>,
    pub calibrator: Arc<RwLock<Calibrator>>,
    leases: Mutex<HashMap<u128, (Arc<Engine>, Lease)>>,
    engines: Mutex<Vec<Weak<Engine>>>,
    /// Engines built so far, and the number of the one built last.
    built: AtomicU64,
    latest: AtomicU64,
    ids: RequestIds,
    /// The refusals logged, one run per reason ([`Engine::refuse`]).
    refusals: Mutex<HashMap<String, Repeats>>,
    /// What the streams hold, bounded by `limits.*` (`serve::limits`).
    pub overload: Arc<Overload>,
    handle: tokio::runtime::Handle,
    faults: Mutex<HashSet<&'static str>>,
    /// The endpoints' metrics scrapes, shared by the engines of every reload.
    pub scraper: Scraper,
    /// The precise prefix index fed by the engines' KV events (crate::kv).
    pub kv: Arc<crate::kv::KvIndex>,
    /// Set at shutdown: no request waits in a flow-control queue any more.
    flow_closed: std::sync::atomic::AtomicBool,
    /// Told when a request starts to wait in a flow-control queue: the
    /// ticker sleeps on it while every queue is empty.
    flow_queued: tokio::sync::Notify,
}

impl Shared {
    pub fn new(calibrator: Calibrator, handle: tokio::runtime::Handle) -> Self {
        let metrics = Arc::new(Metrics::new());
        Self {
            scraper: Scraper::new(Arc::clone(&metrics)),
            overload: Arc::new(Overload::new(Arc::clone(&metrics))),
            metrics,
            calibrator: Arc::new(RwLock::new(calibrator)),
            leases: Mutex::new(HashMap::new()),
            engines: Mutex::new(Vec::new()),
            built: AtomicU64::new(0),
            latest: AtomicU64::new(0),
            ids: RequestIds::new(),
            refusals: Mutex::new(HashMap::new()),
            handle,
            faults: Mutex::new(HashSet::new()),
            kv: Arc::default(),
            flow_closed: std::sync::atomic::AtomicBool::new(false),
            flow_queued: tokio::sync::Notify::new(),
        }
    }

    /// Uses `kv` as the precise prefix index (and reports it in the metrics).
    pub fn with_kv(mut self, kv: Arc<crate::kv::KvIndex>) -> Self {
        #[cfg(feature = "kv-events")]
        self.metrics.kv.set(Arc::clone(&kv));
        self.kv = kv;
        self
    }

    /// Seconds on the core's monotonic clock (`crate::clock`, what
    /// `routecore.monotonic()` reads): what the choosers are given.
    pub fn now(&self) -> f64 {
        crate::clock::monotonic()
    }

    pub fn request_id(&self, id: u128) -> String {
        format!("{id:032x}")
    }

    /// The lease id of a request id ([`Shared::request_id`]); None when it is not one.
    pub fn parse_id(&self, request_id: &str) -> Option<u128> {
        let hex = request_id.as_bytes();
        if hex.len() != 32 || !hex.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        u128::from_str_radix(request_id, 16).ok()
    }

    /// Makes `phase` fail once (tests of the failure paths).
    pub fn inject_fault(&self, phase: &str) -> Result<()> {
        let phase = FAULT_PHASES
            .iter()
            .find(|&&p| p == phase)
            .ok_or_else(|| invalid(format!("phase must be one of {FAULT_PHASES:?}")))?;
        lock(&self.faults).insert(*phase);
        Ok(())
    }

    /// Fails when a fault was injected for `phase` (once).
    pub fn fault(&self, phase: &'static str) -> Result<()> {
        let mut faults = lock(&self.faults);
        if !faults.is_empty() && faults.remove(phase) {
            return Err(invalid(format!("injected failure in {phase}")));
        }
        Ok(())
    }

    /// At shutdown, once the streams have ended: ends every lease still held
    /// (a RouteCore API request whose `Feedback` can no longer come) and waits
    /// until each admission backend has sent what it owes (the releases under
    /// way), at most its `flush_timeout`; what is left then is logged
    /// (`admission-unsettled`) and left to the backend's lease.
    pub async fn close(&self) {
        let mut admissions: Vec<Arc<Admission>> = Vec::new();
        for engine in self.engines() {
            if let Some(a) = &engine.admission {
                if !admissions.iter().any(|b| Arc::ptr_eq(a, b)) {
                    admissions.push(Arc::clone(a));
                }
            }
        }
        let wait = admissions.iter().map(|a| a.flush_timeout()).max();
        let deadline = tokio::time::Instant::now() + wait.unwrap_or_default();
        loop {
            let ended: Vec<(u128, (Arc<Engine>, Lease))> = lock(&self.leases).drain().collect();
            for (id, (engine, lease)) in ended {
                engine.finish(id, lease, None, self);
            }
            let mut left = 0u64;
            for a in &admissions {
                let settled = tokio::time::timeout_at(deadline, a.settled()).await;
                left += u64::from(!settled.unwrap_or(false));
            }
            if left == 0 {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(backends = left, "admission-unsettled");
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn lease_ids(&self) -> Vec<String> {
        lock(&self.leases)
            .keys()
            .map(|&id| self.request_id(id))
            .collect()
    }

    pub fn lease_count(&self) -> usize {
        lock(&self.leases).len()
    }

    /// Every engine still alive (the current one first when it is alive).
    pub fn engines(&self) -> Vec<Arc<Engine>> {
        let mut engines = lock(&self.engines);
        engines.retain(|w| w.strong_count() > 0);
        engines.iter().rev().filter_map(Weak::upgrade).collect()
    }

    fn register(&self, engine: &Arc<Engine>) {
        lock(&self.engines).push(Arc::downgrade(engine));
        self.latest.store(engine.number, Ordering::Release);
    }

    /// The engine built last (the running configuration).
    fn latest(&self) -> Option<Arc<Engine>> {
        lock(&self.engines).last().and_then(Weak::upgrade)
    }

    /// Logs a refusal once per state change of its reason (the first, then
    /// a line a period with the count held back: `serve::logs::Repeats`);
    /// every one is counted in `routecore_rejections_total`.
    fn log_refusal(&self, rej: &Reject, tenant: Option<&str>) {
        /// Reasons followed apart (they come from the code and the admission
        /// scripts: a handful); any other is only counted.
        const REASONS: usize = 64;
        let occurrence = {
            let mut runs = lock(&self.refusals);
            let full = runs.len() >= REASONS;
            match runs.get(&rej.reason) {
                Some(r) => r.occur(Instant::now()),
                None if full => Occurrence::Quiet,
                None => runs
                    .entry(rej.reason.clone())
                    .or_default()
                    .occur(Instant::now()),
            }
        };
        if let Occurrence::Log { suppressed } = occurrence {
            tracing::info!(
                status = rej.status,
                reason = rej.reason.as_str(),
                tenant,
                suppressed,
                "refused"
            );
        }
    }
}

pub struct Engine {
    pub spec: Spec,
    router: TokenBudgetRouter,
    compressor: Compressor,
    media: MediaTokens,
    pub choosers: Vec<Chooser>,
    /// Tokenizer by model name (`models` of the configuration).
    tokenizers: HashMap<String, Arc<Tokenizer>>,
    tenants: Vec<Tenant>,
    keys: HashMap<[u8; 32], usize>,
    pub admission: Option<Arc<Admission>>,
    default_pool: usize,
    pool_metrics: Vec<PoolMetrics>,
    /// Flow control's queue per pool (empty: off).
    flows: Vec<crate::serve::flow::PoolFlow>,
    timeout: Duration,
    /// The request header carrying the API key, lower case, as bytes.
    pub key_header: Vec<u8>,
    /// The request headers never sent on to the engine: the key header and
    /// `server.strip_headers`, lower case.
    pub strip_headers: Vec<String>,
    /// The entitlements of its admission section.
    entitlements: HashSet<String>,
    /// Its number among the engines of its data plane, in build order.
    number: u64,
    /// The autoscaler (`autoscale` of the configuration; None: off).
    pub autoscale: Option<Arc<Scaling>>,
    /// How each pool's split requests travel (`serve::pd_send` sends them).
    pub handoffs: Vec<PoolHandoff>,
    shared: Weak<Shared>,
}

/// The prompt bytes and category a request's usage teaches the calibrator.
/// Token ids are exact, and the usage of image and audio parts is not text:
/// such requests are not learned from.
fn learnable(r: &ParsedRequest) -> Option<(u64, &'static str)> {
    (r.prompt_tokens.is_none() && r.media_tokens == 0).then_some((r.prompt_bytes, r.category))
}

fn int(v: u64) -> i64 {
    v.min(i64::MAX as u64) as i64
}

/// A measured field as the core's signed argument (beyond i64 is a 400).
fn signed(what: &str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| invalid(format!("{what} must be at most {}, got {v}", i64::MAX)))
}

/// A test data plane of `spec` on the current tokio runtime, with its own
/// shared state (the calibrator every test plane uses).
#[cfg(test)]
pub(crate) fn test_plane(spec: Spec) -> (Arc<Shared>, Arc<Engine>) {
    let cal = Calibrator::new(0.95, 1.0, 4.0, 16).expect("cal");
    let shared = Arc::new(Shared::new(cal, tokio::runtime::Handle::current()));
    let engine = Engine::build(spec, &shared, None).expect("engine");
    (shared, engine)
}

impl Engine {
    /// Builds an engine; `previous` (a reload) hands over in-memory admission state.
    pub fn build(spec: Spec, shared: &Arc<Shared>, previous: Option<&Engine>) -> Result<Arc<Self>> {
        let pools = spec
            .pools
            .iter()
            .map(|p| {
                Pool::new(
                    &p.name,
                    int(p.max_context),
                    p.budget.map(int),
                    p.queue_limit.map(int),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let mut router = TokenBudgetRouter::new(pools, Arc::clone(&shared.calibrator))?;
        if let Some(gamma) = spec.router.compress_band {
            router = router.with_compress_band(gamma)?;
        }
        let scrape = spec
            .scrape
            .as_ref()
            .filter(|s| s.enabled)
            .map(|s| Arc::new(s.clone()));
        let choosers = spec
            .pools
            .iter()
            .map(|p| {
                let probes = match &scrape {
                    Some(s) => p
                        .endpoints
                        .iter()
                        .map(|e| shared.scraper.probe(e, s, &p.engine))
                        .collect::<Result<Vec<_>>>()?,
                    None => Vec::new(),
                };
                Chooser::new(p, &spec.router, probes, &shared.kv)
                    .map_err(|e| invalid(format!("pools: {:?}: {e}", p.name)))
            })
            .collect::<Result<Vec<_>>>()?;
        // A tokenizer handed over loaded (`Spec::with_tokenizers`) is used as
        // it is: the file is read once, by whoever validated it.
        let tokenizers = spec
            .models
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if let Some(t) = &m.loaded {
                    return Ok((m.name.clone(), Arc::clone(t)));
                }
                let special = SpecialTokens {
                    bos_token: m.bos_token.clone(),
                    eos_token: m.eos_token.clone(),
                };
                let t = Tokenizer::load(m.tokenizer.as_ref(), m.chat_template.as_deref(), special)
                    .map_err(|e| invalid(format!("models[{i}].{e}")))?;
                Ok((m.name.clone(), Arc::new(t)))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let mut tenants = Vec::new();
        let mut keys = HashMap::new();
        for (i, t) in spec.tenants.iter().enumerate() {
            let digests = t
                .key_digests
                .iter()
                .map(|d| digest_from_hex(d))
                .collect::<Result<Vec<_>>>()?;
            for d in &digests {
                if keys.insert(*d, i).is_some() {
                    return Err(invalid("tenants: a key belongs to two tenants"));
                }
            }
            tenants.push(Tenant {
                name: t.name.clone(),
                digests,
                expires_at: t.expires_at,
                service_class: t.service_class.clone(),
                entitlement: t.entitlement.clone(),
            });
        }
        let mut entitlements = HashSet::new();
        let admission = match &spec.admission {
            Some(a) => {
                let a = AdmissionSpec::from_json(&a.to_string())?;
                entitlements.extend(a.entitlements.iter().map(|e| e.name.clone()));
                let backend = Admission::from_spec(&a)?.with_metrics(Arc::clone(&shared.metrics));
                if let Some(old) = previous.and_then(|p| p.admission.as_ref()) {
                    backend.adopt(old)?;
                }
                Some(Arc::new(backend))
            }
            None => None,
        };
        let metrics = &shared.metrics;
        let pool_metrics = spec
            .pools
            .iter()
            .map(|p| PoolMetrics {
                decisions: Metrics::pool(&metrics.decisions, &p.name),
                spillovers: Metrics::pool(&metrics.spillovers, &p.name),
                disaggregated: Metrics::pool(&metrics.disaggregated, &p.name),
                timeouts: Metrics::pool(&metrics.timeouts, &p.name),
                absurd_usage: Metrics::pool(&metrics.absurd_usage, &p.name),
                in_flight: p
                    .endpoints
                    .iter()
                    .map(|e| metrics.in_flight_gauge(&p.name, e))
                    .collect(),
            })
            .collect();
        let flows = Self::pool_flows(&spec, metrics)?;
        let handoffs = spec
            .pools
            .iter()
            .map(|p| PoolHandoff::new(p, &metrics.pd))
            .collect();
        let default_pool = router.pool_index(&spec.server.default_pool)?;
        let timeout = Duration::from_secs_f64(spec.limits.request_timeout_s);
        let key_header = spec.server.key_header.to_ascii_lowercase();
        let mut strip_headers = vec![key_header.clone()];
        for h in &spec.server.strip_headers {
            let h = h.to_ascii_lowercase();
            if !strip_headers.contains(&h) {
                strip_headers.push(h);
            }
        }
        let key_header = key_header.into_bytes();
        let media = MediaTokens::new(int(spec.limits.image_tokens), int(spec.limits.audio_tokens))?;
        let autoscale = spec
            .autoscale
            .as_ref()
            .map(|a| {
                let previous = previous.and_then(|p| p.autoscale.as_deref());
                let gauges = Arc::clone(&shared.metrics.autoscale);
                let pools: Vec<PlanePool<'_>> = spec
                    .pools
                    .iter()
                    .map(|p| PlanePool {
                        name: &p.name,
                        endpoints: p.endpoints.len(),
                    })
                    .collect();
                let tenants: Vec<Option<&str>> = spec
                    .tenants
                    .iter()
                    .map(|t| t.entitlement.as_deref())
                    .collect();
                Scaling::new(a, &pools, &tenants, gauges, previous, shared.now()).map(Arc::new)
            })
            .transpose()?;
        shared
            .overload
            .set_max_buffered(spec.limits.max_buffered_bytes);
        let engine = Arc::new(Self {
            spec,
            router,
            compressor: Compressor::default(),
            media,
            choosers,
            tokenizers,
            tenants,
            keys,
            admission,
            default_pool,
            pool_metrics,
            flows,
            timeout,
            key_header,
            strip_headers,
            entitlements,
            number: shared.built.fetch_add(1, Ordering::Relaxed) + 1,
            handoffs,
            autoscale,
            shared: Arc::downgrade(shared),
        });
        // The endpoints that stay keep their probes (health, values); the
        // settings change now that the configuration is valid as a whole.
        if let Some(s) = &scrape {
            for p in engine.choosers.iter().flat_map(|c| &c.probes) {
                p.configure(s);
            }
        }
        shared
            .metrics
            .pd
            .set_roles(engine.spec.pools.iter().flat_map(|p| {
                let role = |e: &String| p.roles.get(e).copied().unwrap_or(p.role);
                p.endpoints
                    .iter()
                    .map(move |e| (p.name.as_str(), e.as_str(), role(e)))
            }));
        shared.register(&engine);
        Ok(engine)
    }

    fn shared(&self) -> Result<Arc<Shared>> {
        self.shared
            .upgrade()
            .ok_or_else(|| invalid("the data plane is stopped"))
    }

    pub fn router(&self) -> &TokenBudgetRouter {
        &self.router
    }

    /// The endpoints' state is synced (see `Chooser::synced`): the
    /// readiness the health service reports.
    pub fn synced(&self) -> bool {
        self.choosers.iter().all(Chooser::synced)
    }

    pub fn failure_mode(&self) -> FailureMode {
        self.spec.server.failure_mode
    }

    pub fn tenant_name(&self, tenant: Option<usize>) -> Option<&str> {
        tenant.map(|t| self.tenants[t].name.as_str())
    }

    // -- routing ------------------------------------------------------------

    /// Routes an OpenAI request body (parse, route, compress: one core call).
    /// A malformed body is a 400. A compressed prompt is not learned from
    /// (the prompt the calibrator counted is not the one the model read).
    pub async fn route_body(
        self: &Arc<Self>,
        body: &[u8],
        tenant: Option<usize>,
        hints: &Hints,
    ) -> Result<Outcome> {
        if let Some(t) = self.route_tokenized(body).await {
            let learn = learnable(&t.request);
            let ask = Ask {
                key: hints.key(Key::Ids(&t.ids)),
                model: t.request.model.as_deref(),
                hints,
            };
            return self.routed(t.decision, tenant, learn, ask, None).await;
        }
        let r = match route_request(
            &self.router,
            &self.compressor,
            body,
            self.spec.limits.default_max_tokens,
            self.media,
        ) {
            Ok(r) => r,
            Err(e) => {
                let message = format!("invalid request body: {e}");
                return Ok(Err(self.refuse(
                    tenant,
                    400,
                    "malformed-body",
                    message,
                    0.0,
                )));
            }
        };
        let d = r.decision;
        let model = r.request.model.as_deref();
        if d.action == Action::Compress {
            let new_body = r.body;
            let ask = Ask {
                key: Key::Body(&new_body),
                model,
                hints,
            };
            return self
                .routed(d, tenant, None, ask, Some(new_body.clone()))
                .await;
        }
        // Token ids are exact, and the usage of image and audio parts is not
        // text: such requests are not learned from.
        let learn = learnable(&r.request);
        let ask = Ask {
            key: hints.key(Key::Body(body)),
            model,
            hints,
        };
        self.routed(d, tenant, learn, ask, None).await
    }

    /// Routes a body on its exact prompt token count when its `model` has a
    /// tokenizer. A tokenizer or template that fails is logged
    /// (`tokenize-skipped`) and counted, and the request is routed on the
    /// estimate instead (None).
    ///
    /// A body of `limits.tokenize_inline_bytes` or more is tokenized on the
    /// data plane's blocking pool (the first shard's `spawn_blocking`, one
    /// pool for every shard, at most as many threads as cores), so a long
    /// prompt does not hold the worker that serves the other streams; a shorter one is tokenized inline, where the hand-off costs
    /// more than the tokenizing (benches/RESULTS.md, "Tokenizing off the
    /// worker"). Only routing touches shared state, after the ids are in:
    /// a stream dropped meanwhile has counted nothing.
    async fn route_tokenized(&self, body: &[u8]) -> Option<Tokenized> {
        #[derive(serde::Deserialize)]
        struct Model {
            model: Option<String>,
        }
        if self.tokenizers.is_empty() {
            return None;
        }
        let model = serde_json::from_slice::<Model>(body).ok()?.model?;
        let tokenizer = self.tokenizers.get(&model)?;
        let limits = &self.spec.limits;
        let (max_tokens, media) = (limits.default_max_tokens, self.media);
        let encoded = if (body.len() as u64) < limits.tokenize_inline_bytes {
            Encoded::new(tokenizer, body, max_tokens, media)
        } else {
            let (tokenizer, body) = (Arc::clone(tokenizer), body.to_vec());
            let pool = self.shared().ok()?.handle.clone();
            pool.spawn_blocking(move || Encoded::new(&tokenizer, &body, max_tokens, media))
                .await
                .unwrap_or_else(|e| Err(invalid(format!("tokenizing stopped: {e}"))))
        };
        match encoded {
            Ok(e) => Some(e.route(&self.router)),
            Err(e) => {
                tracing::warn!(model = model.as_str(), error = %e, "tokenize-skipped");
                if let Ok(shared) = self.shared() {
                    shared.metrics.tokenize_skipped.inc();
                }
                None
            }
        }
    }

    /// Routes a request given its measured fields (bad values are a 400).
    pub async fn route_fields(
        self: &Arc<Self>,
        fields: &Fields<'_>,
        tenant: Option<usize>,
        hints: &Hints,
    ) -> Result<Outcome> {
        let bad = |e: Error| {
            Ok(Err(self.refuse(
                tenant,
                400,
                "invalid-request",
                e.to_string(),
                0.0,
            )))
        };
        let req = match signed("prompt_bytes", fields.prompt_bytes).and_then(|bytes| {
            Request::new(
                bytes,
                None,
                signed("max_output_tokens", fields.max_output_tokens)?,
            )
        }) {
            Ok(r) => r,
            Err(e) => return bad(e),
        };
        let ask = Ask {
            key: fields.token_ids.map_or(Key::None, Key::Ids),
            model: None,
            hints,
        };
        if let Some(tokens) = fields.prompt_tokens {
            if tokens > MAX_TOKENS {
                let e = invalid(format!(
                    "prompt_tokens must be in [0, {MAX_TOKENS}], got {tokens}"
                ));
                return bad(e);
            }
            let d = self.router.route_estimated(tokens, req.max_output_tokens);
            return self.routed(d, tenant, None, ask, None).await;
        }
        let Some(category) = CATEGORIES.into_iter().find(|&c| c == fields.category) else {
            return bad(invalid(format!(
                "category must be one of {CATEGORIES:?}, got {:?}",
                fields.category
            )));
        };
        let est = self
            .router
            .read_calibrator()
            .estimate_tokens(req.prompt_bytes, category);
        let d = self
            .router
            .route_with(est, req.max_output_tokens, compressible_category(category));
        self.routed(d, tenant, Some((req.prompt_bytes, category)), ask, None)
            .await
    }

    /// The default pool, without a budget decision (nothing is known of the
    /// request): bodyless requests and, under `failure_mode: open`, requests
    /// whose routing failed (then `admit` is false).
    pub async fn route_default(
        self: &Arc<Self>,
        tenant: Option<usize>,
        hints: &Hints,
        admit: bool,
    ) -> Result<Outcome> {
        let ask = Ask {
            key: Key::None,
            model: None,
            hints,
        };
        self.dispatch(Routing::Default, (1, 1), tenant, admit, None, ask, None)
            .await
    }

    /// A request the token budget routed, through the rest of its steps.
    async fn routed(
        self: &Arc<Self>,
        d: Decision,
        tenant: Option<usize>,
        learn: Option<(u64, &'static str)>,
        ask: Ask<'_>,
        body: Option<Vec<u8>>,
    ) -> Result<Outcome> {
        let est = (d.est_input_tokens, d.est_output_tokens);
        let routing = Routing::Decided(d);
        self.dispatch(routing, est, tenant, true, learn, ask, body)
            .await
    }

    /// The pool for a request for `model` when the token budget's choice
    /// does not serve it: the smallest serving pool whose context fits
    /// `tokens`. Err(status) when no pool serves the model (404) or none that
    /// does fits (400).
    fn pool_for_model(&self, model: Option<&str>, tokens: u64) -> std::result::Result<usize, u16> {
        let serving: Vec<usize> = (0..self.spec.pools.len())
            .filter(|&i| self.spec.pools[i].serves(model))
            .collect();
        if serving.is_empty() {
            return Err(404);
        }
        serving
            .into_iter()
            .filter(|&i| self.spec.pools[i].max_context >= tokens)
            .min_by_key(|&i| (self.spec.pools[i].max_context, i))
            .ok_or(400)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::block_hashes;
    use crate::serve::config::testing;

    fn hashes(body: &[u8]) -> Vec<u64> {
        let prompt = prompt_of(body).expect("a request");
        block_hashes(prompt.tokens(), 64, 0).expect("hashes")
    }

    #[test]
    fn prefix_key_is_the_prompt_not_the_json_body() {
        let system = "You are a careful assistant who answers in detail. ".repeat(34);
        assert!(system.len() > 1700);
        let a = format!(
            r#"{{"model": "m", "max_tokens": 10, "messages": [{{"role": "system", "content": {s:?}}}, {{"role": "user", "content": "hi"}}]}}"#,
            s = system
        );
        let b = format!(
            r#"{{"messages": [{{"content": {s:?}, "role": "system"}}, {{"content": "hi", "role": "user"}}], "max_tokens": 10, "model": "m"}}"#,
            s = system
        );
        let (ha, hb) = (hashes(a.as_bytes()), hashes(b.as_bytes()));
        assert!(ha.len() >= 1700 / 64);
        assert_eq!(ha, hb, "same prompt, keys in another order: a full match");
        // The raw bodies share no block at all.
        let raw = |x: &str| block_hashes(Tokens::Bytes(x.as_bytes()), 64, 0).expect("h");
        assert_ne!(raw(&a)[0], raw(&b)[0]);
        // Texts are separated: ["ab", "c"] is not ["a", "bc"].
        let split = |x: &str, y: &str| {
            let body = serde_json::json!({"messages": [
                {"role": "user", "content": x}, {"role": "user", "content": y}]});
            prompt_of(body.to_string().as_bytes()).map(|p| match p {
                Prompt::Bytes(b) => b,
                Prompt::Ids(_) => Vec::new(),
            })
        };
        assert_ne!(split("ab", "c"), split("a", "bc"));
    }

    /// A data plane routing by VTC over four endpoints, for tenants `demo`
    /// (0) and `other` (1).
    fn vtc_plane() -> (Arc<Shared>, Arc<Engine>) {
        plane("vtc", serde_json::Value::Null)
    }

    /// A data plane routing by `policy` over four endpoints, for tenants
    /// `demo` (0) and `other` (1), with this `admission` section; tenant
    /// `name` has the entitlement `name` when the section names one.
    fn plane(policy: &str, admission: serde_json::Value) -> (Arc<Shared>, Arc<Engine>) {
        plane_of(plane_json(policy, admission))
    }

    /// The spec of [`plane`], to change before [`plane_of`] builds it.
    pub(super) fn plane_json(policy: &str, admission: serde_json::Value) -> serde_json::Value {
        let tenant = |name: &str| {
            let entitled = admission["entitlements"]
                .as_array()
                .is_some_and(|es| es.iter().any(|e| e["name"] == name));
            testing::tenant(name, name.as_bytes(), entitled.then_some(name))
        };
        let pools = serde_json::json!([{
            "name": "p", "max_context": 8192, "budget": null, "queue_limit": null,
            "endpoints": ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"]
        }]);
        let mut json = testing::plane_json(policy, pools);
        json["tenants"] = serde_json::json!([tenant("demo"), tenant("other")]);
        json["admission"] = admission;
        json
    }

    /// A data plane of `json` (see [`plane_json`]).
    pub(super) fn plane_of(json: serde_json::Value) -> (Arc<Shared>, Arc<Engine>) {
        test_plane(Spec::from_json(&json.to_string()).expect("spec"))
    }

    /// Where `demo`'s next request goes after `other` sent 20 heavy
    /// requests under the fairness id `label`.
    async fn demo_after_other_labelled(label: &str) -> String {
        let (shared, engine) = vtc_plane();
        let body = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}"#;
        let labelled = Hints {
            fairness_id: Some(label.into()),
            ..Hints::default()
        };
        for _ in 0..20 {
            let r = engine.route_body(body, Some(1), &labelled).await;
            let routed = r.expect("ok").expect("routed");
            assert!(shared.release(routed.id, Some((2000, 2000))));
        }
        let r = engine.route_body(body, Some(0), &Hints::default()).await;
        let routed = r.expect("ok").expect("routed");
        assert!(shared.release(routed.id, None));
        routed.endpoint
    }

    #[tokio::test]
    async fn a_tenant_cannot_weigh_on_anothers_fairness_by_naming_its_id() {
        // "demo" is demo's VTC user (its name); "x" is nobody's.
        let named = demo_after_other_labelled("demo").await;
        assert_eq!(named, demo_after_other_labelled("x").await);
        assert_eq!(
            named, "10.0.0.1:1",
            "demo has used nothing: the lightest end"
        );
    }

    #[tokio::test]
    async fn a_scoped_fairness_id_too_long_for_its_tenant_is_a_400() {
        let (_shared, engine) = vtc_plane();
        let body = br#"{"messages": [{"role": "user", "content": "hi"}]}"#;
        // 256 bytes fit a user name, not "5:other:" + 256.
        let long = Hints {
            fairness_id: Some("f".repeat(256)),
            ..Hints::default()
        };
        let rej = engine.route_body(body, Some(1), &long).await.expect("ok");
        assert_eq!(rej.map(|_| ()).expect_err("refused").status, 400);
        let fits = Hints {
            fairness_id: Some("f".repeat(256 - 8)),
            ..Hints::default()
        };
        assert!(engine
            .route_body(body, Some(1), &fits)
            .await
            .expect("ok")
            .is_ok());
        assert_eq!(engine.router().in_flight(0).expect("pool"), 1);
    }

    #[test]
    fn prefix_key_of_token_ids_is_the_ids() {
        let body = br#"{"model": "m", "prompt": [1, 2, 3, 4]}"#;
        assert!(matches!(prompt_of(body), Some(Prompt::Ids(ids)) if ids == vec![1, 2, 3, 4]));
        assert!(prompt_of(b"not json").is_none());
    }

    /// What a data plane's request path keeps of the requests it saw: per
    /// endpoint in flight, per pool in flight, admission's requests in
    /// flight, each tenant's VTC charge, and which endpoints hold each
    /// prompt's blocks in the approximate prefix index.
    fn kept(engine: &Engine, prompts: &[Vec<u8>], now: f64) -> String {
        let mut st = lock(&engine.choosers[0].state);
        let st = &mut *st;
        let loads: Vec<u64> = st.picker.states.iter().map(|s| s.in_flight).collect();
        let charges = st
            .picker
            .pipeline
            .vtc_mut()
            .map(|v| ["demo", "other"].map(|u| v.tokens(u, now)));
        let held = st.picker.pipeline.prefix().map(|p| {
            let mut index = lock(p.index()).clone();
            let (size, seed) = (p.config().block_size, p.config().seed);
            let held: Vec<_> = prompts
                .iter()
                .map(|b| {
                    let prompt = prompt_of(b).expect("a request");
                    let h = block_hashes(prompt.tokens(), size, seed).expect("hashes");
                    let mut m = index.match_prefix(&h, now).expect("match");
                    m.sort();
                    m
                })
                .collect();
            (index.len(), held)
        });
        let admission = engine.admission.as_ref().map(|a| a.in_flight());
        let pools = engine.router.in_flight(0).expect("pool");
        format!(
            "loads {loads:?} pools {pools} admission {admission:?} vtc {charges:?} prefix {held:?}"
        )
    }

    /// Nothing a refused request touched stays changed: over random mixes of
    /// requests answered (with usage), failed (no usage) and refused by
    /// admission (tenant `other`'s entitlement admits one request at a time,
    /// and its first is held to the end), the data plane keeps what a run
    /// that never saw the refused requests keeps: every count, VTC charge
    /// and prefix-index entry.
    #[tokio::test]
    async fn a_refused_request_leaves_no_trace() {
        let quota = serde_json::json!({"name": "q", "tokens_per_s": 1e9, "kv_bytes": 1_i64 << 40,
                                       "concurrency": 1000});
        let entitlement = |name: &str, concurrency: i64| {
            serde_json::json!({"name": name, "tenant": name, "quota": "q",
                               "service_class": "guaranteed", "slo_target_ms": 1000.0,
                               "tokens_per_s": 1e8, "kv_bytes": 1_i64 << 38,
                               "concurrency": concurrency})
        };
        let admission = serde_json::json!({"quotas": [quota],
            "entitlements": [entitlement("demo", 1000), entitlement("other", 1)]});
        let prompts: Vec<Vec<u8>> = (0..4)
            .map(|k| {
                let text = format!("{k} shared context of prompt {k}. ").repeat(6);
                serde_json::json!({"messages": [{"role": "user", "content": text}],
                                   "max_tokens": 20})
                .to_string()
                .into_bytes()
            })
            .collect();
        for policy in ["prefix", "vtc"] {
            for seed in 0..20u64 {
                let mut rng = crate::rng::Rng::new(seed);
                // (tenant, prompt, usage); tenant 1's are refused.
                let ops: Vec<(usize, usize, Option<Usage>)> = (0..30)
                    .map(|_| {
                        let tenant = usize::from(rng.next_u64() % 3 == 0);
                        let prompt = (rng.next_u64() % 4) as usize;
                        let usage = (rng.next_u64() % 2 == 0)
                            .then(|| (10 + rng.next_u64() % 90, rng.next_u64() % 50));
                        (tenant, prompt, usage)
                    })
                    .collect();
                let mut runs = Vec::new();
                for skip_refused in [false, true] {
                    let (shared, engine) = plane(policy, admission.clone());
                    let hints = Hints::default();
                    let first = engine.route_body(&prompts[0], Some(1), &hints).await;
                    let blocker = first.expect("ok").expect("admitted");
                    let mut refused = 0;
                    for &(tenant, prompt, usage) in &ops {
                        if skip_refused && tenant == 1 {
                            continue;
                        }
                        let r = engine
                            .route_body(&prompts[prompt], Some(tenant), &hints)
                            .await;
                        match r.expect("ok") {
                            Ok(routed) => assert!(shared.release(routed.id, usage)),
                            Err(rej) => {
                                assert_eq!((tenant, rej.status), (1, 429), "{rej:?}");
                                refused += 1;
                            }
                        }
                    }
                    let mid = kept(&engine, &prompts, shared.now());
                    assert!(shared.release(blocker.id, None));
                    runs.push((mid, kept(&engine, &prompts, shared.now()), refused));
                }
                let want_refused = ops.iter().filter(|o| o.0 == 1).count();
                assert_eq!((runs[0].2, runs[1].2), (want_refused, 0));
                assert_eq!(runs[0].0, runs[1].0, "{policy} seed {seed}: held");
                assert_eq!(runs[0].1, runs[1].1, "{policy} seed {seed}: after");
            }
        }
    }

    /// The router section's prefix block size and saturation thresholds
    /// reach the pool's pipeline through the plugins' own descriptions.
    #[tokio::test]
    async fn router_settings_reach_the_plugins_that_take_them() {
        let mut json = plane_json("precise-prefix+queue+kv", serde_json::Value::Null);
        json["router"]["prefix_block_size"] = 64.into();
        json["router"]["saturation"] = serde_json::json!({"max_waiting": 9.0, "max_kv_usage": 0.5});
        let (_shared, engine) = plane_of(json);
        let chooser = &engine.choosers[0];
        assert_eq!(chooser.prefix, Some((64, 0)));
        let st = lock(&chooser.state);
        let params = |name: &str| {
            let spec = st.picker.pipeline.specs().iter().find(|s| s.name == name);
            spec.expect("in the preset").params.clone()
        };
        assert_eq!(
            params("precise-prefix"),
            serde_json::json!({"block_size": 64})
        );
        assert_eq!(
            params("saturation"),
            serde_json::json!({"max_waiting": 9.0, "max_kv_usage": 0.5})
        );
    }
}
