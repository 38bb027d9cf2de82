//! The shared backend: quota state in Redis, one atomic Lua script per
//! operation (`scripts`), through one multiplexed async connection.
//!
//! - Construction never connects; [`RedisAdmission::warm`] (the data
//!   plane, before its readiness) or else the first call does, and a call
//!   after a connection error or a timeout connects again.
//! - Every call (connecting, settling, configuring, the script) is bounded by
//!   `socket_timeout_s`; a failure (no connection, no answer in time, Redis
//!   full, another error reply) goes through `failure_mode`, is counted by
//!   kind (`routecore_faults_total{source="redis"}`) and no detail reaches the
//!   verdict. An outage is one warning (`redis-unavailable`) and one line when
//!   it ends (`redis-recovered`), each with the count of failures not
//!   written; Redis full likewise (`redis-full`, `redis-writable`).
//! - Redis full (over `maxmemory`): admits are refused whole (the scripts'
//!   flags, see `scripts`), completions, voids and the sweep still run. An
//!   admit refused so sweeps its quota (at most every [`SWEEP_EVERY`]: what
//!   expired is freed, any entitlement's) and tries once more, so a Redis
//!   filled by routecore's own state recovers by itself as it expires.
//! - What the scripts keep is bounded (`scripts::Bounds`): window entries per
//!   entitlement and per quota, void markers per quota; reservations by the
//!   concurrency limits.
//! - After a timeout, while Redis may be stalled, one call at a time asks it
//!   and concurrent calls answer by `failure_mode` at once (not counted as
//!   failures; a completion is kept to replay), so a stall holds one call
//!   for `socket_timeout_s`, not every stream.
//! - Scripts run by EVALSHA, loaded again on NOSCRIPT (the `redis` crate's
//!   `Script`).
//! - No reservation whose reply was lost can leak: the reservation is made
//!   under the caller's request id; when the call fails the id is kept and
//!   voided as soon as Redis answers again (releasing the reservation, or
//!   refusing it if a stalled Redis has not run the script yet); a failed
//!   completion is replayed then (it counts once). Beyond that, a lease
//!   (`lease_s`) releases what a dead replica held.
//! - At shutdown the data plane waits until [`RedisAdmission::settled`], at
//!   most `flush_timeout_s`: the admits and completions under way (the
//!   releases of the streams just ended) and the lost replies still to settle
//!   reach Redis before the process exits.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, Client, RedisError, Script};

use super::scripts::{self, Bounds, MAX_QUOTAS};
use super::{latency, usage, AdmissionSpec, FailureMode, Ticket, Verdict};
use crate::admission::{ServiceClass, Shrink};
use crate::budget::MAX_TOKENS;
use crate::error::{invalid, Error};
use crate::serve::logs::{Occurrence, Repeats};
use crate::serve::metrics::Metrics;

/// Lost admits and failed completions a quota keeps to settle when Redis
/// answers again; beyond it the oldest are left to their leases.
pub const MAX_PENDING: usize = 10_000;
/// How many of them one call settles before its own work.
pub const RECONCILE_BATCH: usize = 256;
/// While Redis is full, how often an admit may sweep its quota.
pub const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// Why a call to Redis failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    Connection,
    Timeout,
    /// An error reply other than OOM.
    Reply,
    /// Redis over `maxmemory` refused a script that may grow the state.
    Oom,
}

impl FailureKind {
    pub const ALL: [FailureKind; 4] = [Self::Connection, Self::Timeout, Self::Reply, Self::Oom];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connection => "connection",
            Self::Timeout => "timeout",
            Self::Reply => "reply",
            Self::Oom => "oom",
        }
    }

    fn of(e: &RedisError) -> Self {
        if e.code() == Some("OOM") {
            Self::Oom
        } else if e.is_timeout() {
            Self::Timeout
        } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
            Self::Connection
        } else {
            Self::Reply
        }
    }
}

/// A completion to replay: ticket number, tokens, latency, time.
type Replay = (u64, u64, f64, f64);

/// The latency that tells the complete script the request was never served
/// (`Admission::release`): its charge is given back, nothing learned.
pub const UNSERVED: f64 = -1.0;

#[derive(Default)]
struct Pending {
    voids: VecDeque<String>,
    replays: VecDeque<Replay>,
}

fn defer<T>(queue: &mut VecDeque<T>, item: T) {
    queue.push_back(item);
    if queue.len() > MAX_PENDING {
        queue.pop_front();
    }
}

fn take<T>(queue: &mut VecDeque<T>) -> Vec<T> {
    let n = queue.len().min(RECONCILE_BATCH);
    queue.drain(..n).collect()
}

fn put_back<T>(queue: &mut VecDeque<T>, items: Vec<T>) {
    for item in items.into_iter().rev() {
        queue.push_front(item);
    }
    queue.truncate(MAX_PENDING);
}

/// What one settlement took from a quota's pending queues. Whatever it has
/// not settled goes back when it is dropped: on an error, and when the call
/// is cut short by its timeout (a stalled Redis), so no void or replay owed to
/// Redis is forgotten. Settling twice is harmless (a void and a completion
/// each count once).
struct Taken<'a> {
    pending: &'a Mutex<Pending>,
    voids: Vec<String>,
    replays: Vec<Replay>,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut pending = lock(self.pending);
        put_back(&mut pending.voids, std::mem::take(&mut self.voids));
        put_back(&mut pending.replays, std::mem::take(&mut self.replays));
    }
}

struct Quota {
    name: String,
    key: String,
    config: String,
    configured: AtomicBool,
    pending: Mutex<Pending>,
    /// Entitlements of the quota with their class (evictions).
    ents: Vec<(String, ServiceClass)>,
    /// When an admit of this instance last swept the quota (Redis full).
    swept: Mutex<Option<Instant>>,
}

struct Scripts {
    configure: Script,
    admit: Script,
    complete: Script,
    void: Script,
    sweep: Script,
}

impl Scripts {
    /// What this backend runs (`set_state` is the Python backend's alone).
    const CODES: [&'static str; 5] = [
        scripts::CONFIGURE,
        scripts::ADMIT,
        scripts::COMPLETE,
        scripts::VOID,
        scripts::SWEEP,
    ];

    fn new() -> Self {
        let [configure, admit, complete, void, sweep] = Self::CODES.map(Script::new);
        Self {
            configure,
            admit,
            complete,
            void,
            sweep,
        }
    }
}

/// Counts a call under way until dropped (what [`RedisAdmission::settled`] waits for).
struct Busy<'a>(&'a AtomicUsize);

impl<'a> Busy<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl From<RedisError> for FailureKind {
    fn from(e: RedisError) -> Self {
        FailureKind::of(&e)
    }
}

impl From<::redis::ParsingError> for FailureKind {
    fn from(_: ::redis::ParsingError) -> Self {
        FailureKind::Reply
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Seconds since the epoch: the clock replicas share.
fn wall_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Admission state in Redis, shared by every replica with the same prefix.
pub struct RedisAdmission {
    client: Client,
    connection: Mutex<Option<MultiplexedConnection>>,
    connecting: tokio::sync::Mutex<()>,
    scripts: Scripts,
    /// [`warm`](Self::warm) loaded the scripts.
    loaded: AtomicBool,
    quotas: Vec<Quota>,
    quota_of: HashMap<String, usize>,
    default_max_tokens: u64,
    failure_mode: FailureMode,
    unavailable_retry_s: f64,
    timeout: Duration,
    rid_prefix: String,
    failures: [AtomicU64; 4],
    /// Where failures are counted by kind (`routecore_faults_total`).
    metrics: Option<Arc<Metrics>>,
    /// The outage under way (no connection, timeouts, error replies).
    outage: Repeats,
    /// Redis full: admits refused for OOM.
    full: Repeats,
    /// The last call timed out: Redis may be stalled.
    stalled: AtomicBool,
    /// Held by the one call that asks a possibly stalled Redis.
    probe: tokio::sync::Mutex<()>,
    /// Tickets this instance admitted and has not completed.
    held: Mutex<HashSet<u64>>,
    /// Admits and completions under way.
    busy: AtomicUsize,
    /// When a call last went to Redis: nanoseconds after `born`, plus one
    /// (0: never). Each call settles a batch of what is pending first.
    last_call: AtomicU64,
    born: Instant,
    flush_timeout: Duration,
    /// Per entitlement: its SLO target (s) and the last priority `w_e` the
    /// admit script returned (f64 bits; 0: none yet), for flow control.
    flow_terms: HashMap<String, (f64, AtomicU64)>,
}

fn positive_setting(what: &str, v: f64) -> Result<f64, Error> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(invalid(format!(
            "admission.redis.{what} must be a finite number > 0, got {v}"
        )))
    }
}

impl RedisAdmission {
    /// Checks the configuration exactly as in memory; never connects.
    pub fn new(spec: &AdmissionSpec) -> Result<Self, Error> {
        let controller = spec.controller()?;
        let (quotas, ents) = spec.parts()?;
        let r = &spec.redis;
        if quotas.len() > MAX_QUOTAS {
            return Err(invalid(format!("at most {MAX_QUOTAS} quotas")));
        }
        let lease_s = positive_setting("lease_s", r.lease_s)?;
        let timeout = positive_setting("socket_timeout_s", r.socket_timeout_s)?;
        let unavailable_retry_s = positive_setting("unavailable_retry_s", r.unavailable_retry_s)?;
        let bounds = Bounds::new(
            r.max_window_entries,
            r.max_window_entries_per_quota,
            r.max_void_markers,
        )
        .map_err(|e| invalid(format!("admission.redis.{e}")))?;
        if !(r.flush_timeout_s.is_finite() && (0.0..=3600.0).contains(&r.flush_timeout_s)) {
            return Err(invalid(format!(
                "admission.redis.flush_timeout_s must be in [0, 3600], got {}",
                r.flush_timeout_s
            )));
        }
        if r.prefix.is_empty() {
            return Err(invalid("admission.redis.prefix must not be empty"));
        }
        if !["redis://", "rediss://", "unix://"]
            .iter()
            .any(|s| r.url.starts_with(s))
        {
            return Err(invalid(
                "admission.redis.url: expected a redis://, rediss:// or unix:// URL",
            ));
        }
        // The URL is not echoed in errors: it may hold a password.
        let client = Client::open(r.url.as_str())
            .map_err(|_| invalid("admission.redis.url: not a valid Redis URL"))?;
        let window_s = controller.window_s();
        let quotas: Vec<Quota> = quotas
            .iter()
            .map(|p| Quota {
                name: p.name.clone(),
                key: format!("{}:{{{}}}", r.prefix, p.name),
                config: scripts::quota_config(p, &ents, window_s, lease_s, &bounds),
                configured: AtomicBool::new(false),
                pending: Mutex::new(Pending::default()),
                ents: ents
                    .iter()
                    .filter(|e| e.quota == p.name)
                    .map(|e| (e.name.clone(), e.service_class))
                    .collect(),
                swept: Mutex::new(None),
            })
            .collect();
        let flow_terms = ents
            .iter()
            .map(|e| (e.name.clone(), (e.slo_target_ms / 1e3, AtomicU64::new(0))))
            .collect();
        let quota_of = ents
            .iter()
            .filter_map(|e| {
                Some((
                    e.name.clone(),
                    quotas.iter().position(|p| p.name == e.quota)?,
                ))
            })
            .collect();
        Ok(Self {
            client,
            connection: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            scripts: Scripts::new(),
            loaded: AtomicBool::new(false),
            quotas,
            quota_of,
            default_max_tokens: controller.default_max_tokens(),
            failure_mode: r.failure_mode,
            unavailable_retry_s,
            timeout: Duration::from_secs_f64(timeout),
            rid_prefix: format!("{:016x}:", rand_u64()),
            failures: Default::default(),
            metrics: None,
            outage: Repeats::default(),
            full: Repeats::default(),
            stalled: AtomicBool::new(false),
            probe: tokio::sync::Mutex::new(()),
            held: Mutex::new(HashSet::new()),
            busy: AtomicUsize::new(0),
            last_call: AtomicU64::new(0),
            born: Instant::now(),
            flush_timeout: Duration::from_secs_f64(r.flush_timeout_s),
            flow_terms,
        })
    }

    /// Flow control's terms of `entitlement`: the last priority the admit
    /// script returned for it and its SLO target in seconds.
    pub fn flow_terms(&self, entitlement: &str) -> (Option<f64>, Option<f64>) {
        self.flow_terms
            .get(entitlement)
            .map_or((None, None), |(slo_s, w)| {
                let w = f64::from_bits(w.load(Ordering::Relaxed));
                ((w > 0.0).then_some(w), Some(*slo_s))
            })
    }

    /// Counts failures in `metrics` too (`routecore_faults_total{source="redis", kind}`).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The connection, connecting first if there is none (one connect at a time).
    async fn connection(&self) -> Result<MultiplexedConnection, RedisError> {
        if let Some(c) = lock(&self.connection).clone() {
            return Ok(c);
        }
        let _one = self.connecting.lock().await;
        if let Some(c) = lock(&self.connection).clone() {
            return Ok(c);
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let c = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        *lock(&self.connection) = Some(c.clone());
        Ok(c)
    }

    /// Makes the first calls pay no set-up: connects, loads every script
    /// (one round trip) and writes each quota's configuration not yet
    /// written, each step bounded by `socket_timeout_s` and failing as any
    /// call does (counted, logged once per outage). True when warm; the
    /// data plane's readiness waits for it (`serve::runtime`).
    pub async fn warm(&self) -> bool {
        if self.warmed() {
            return true;
        }
        let load = async {
            let mut c = self.connection().await?;
            let mut pipe = ::redis::pipe();
            for code in Scripts::CODES {
                pipe.cmd("SCRIPT").arg("LOAD").arg(code);
            }
            let _: Vec<String> = pipe.query_async(&mut c).await?;
            self.loaded.store(true, Ordering::Release);
            Ok(c)
        };
        let Ok(mut c) = self.bounded(load).await else {
            return false;
        };
        for (p, quota) in self.quotas.iter().enumerate() {
            if !quota.configured.load(Ordering::Acquire)
                && self.bounded(self.configure(&mut c, p)).await.is_err()
            {
                return false;
            }
        }
        true
    }

    /// Whether the calls pay no set-up now: connected, the scripts loaded
    /// by [`warm`](Self::warm), every quota configured.
    pub fn warmed(&self) -> bool {
        lock(&self.connection).is_some()
            && self.loaded.load(Ordering::Acquire)
            && self
                .quotas
                .iter()
                .all(|q| q.configured.load(Ordering::Acquire))
    }

    /// What admits answer while Redis is unavailable.
    pub fn failure_mode(&self) -> FailureMode {
        self.failure_mode
    }

    /// Runs `call` within the socket timeout; a failure is counted, and after
    /// a connection failure or a timeout the connection is dropped (the next
    /// call connects again). While Redis may be stalled, only one call at a
    /// time runs; the others get `Err` at once, uncounted.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, FailureKind>>,
    ) -> Result<T, ()> {
        let _turn = if self.stalled.load(Ordering::Relaxed) {
            Some(self.probe.try_lock().map_err(|_| ())?)
        } else {
            None
        };
        let since_born = self.born.elapsed().as_nanos();
        self.last_call.store(
            u64::try_from(since_born).unwrap_or(u64::MAX - 1) + 1,
            Ordering::Relaxed,
        );
        let kind = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => {
                self.stalled.store(false, Ordering::Relaxed);
                if let Some(suppressed) = self.outage.end() {
                    tracing::info!(suppressed, "redis-recovered");
                }
                return Ok(v);
            }
            Ok(Err(kind)) => kind,
            Err(_) => FailureKind::Timeout,
        };
        self.failed(kind);
        Err(())
    }

    fn failed(&self, kind: FailureKind) {
        self.failures[kind as usize].fetch_add(1, Ordering::Relaxed);
        if let Some(m) = &self.metrics {
            m.fault("redis", kind.as_str());
        }
        // One line per state change: Redis full is its own (releases still
        // reach Redis meanwhile, ending an outage but not that).
        let (run, event) = match kind {
            FailureKind::Oom => (&self.full, "redis-full"),
            _ => (&self.outage, "redis-unavailable"),
        };
        if let Occurrence::Log { suppressed } = run.occur(Instant::now()) {
            tracing::warn!(
                kind = kind.as_str(),
                failure_mode = self.failure_mode.as_str(),
                suppressed,
                "{event}"
            );
        }
        if kind == FailureKind::Timeout {
            self.stalled.store(true, Ordering::Relaxed);
        }
        if kind != FailureKind::Reply {
            *lock(&self.connection) = None;
        }
    }

    /// Before a call on quota `p`: settles what failed calls left behind, then
    /// writes this instance's configuration once.
    async fn ready(
        &self,
        c: &mut MultiplexedConnection,
        p: usize,
        now: f64,
    ) -> Result<(), FailureKind> {
        self.settle(c, p, now).await?;
        let quota = &self.quotas[p];
        if !quota.configured.load(Ordering::Acquire) {
            self.configure(c, p).await?;
        }
        Ok(())
    }

    async fn configure(&self, c: &mut MultiplexedConnection, p: usize) -> Result<(), FailureKind> {
        let quota = &self.quotas[p];
        // A quota new to Redis numbers its tickets from the clock (ms * 1024),
        // so no ticket of an earlier, lost state can match a new one.
        let first = (wall_s() * 1000.0) as u64 * 1024;
        let _: i64 = self
            .scripts
            .configure
            .key(&quota.key)
            .arg(&quota.config)
            .arg(first)
            .invoke_async(c)
            .await?;
        quota.configured.store(true, Ordering::Release);
        Ok(())
    }

    /// Voids up to a batch of lost admits and replays up to a batch of failed
    /// completions of quota `p`; what Redis did not take is kept for later.
    async fn settle(
        &self,
        c: &mut MultiplexedConnection,
        p: usize,
        now: f64,
    ) -> Result<(), FailureKind> {
        let quota = &self.quotas[p];
        let mut taken = {
            let mut pending = lock(&quota.pending);
            if pending.voids.is_empty() && pending.replays.is_empty() {
                return Ok(());
            }
            Taken {
                pending: &quota.pending,
                voids: take(&mut pending.voids),
                replays: take(&mut pending.replays),
            }
        };
        let result: Result<(), RedisError> = async {
            if !taken.voids.is_empty() {
                let mut call = self.scripts.void.key(&quota.key);
                call.arg(now);
                for rid in &taken.voids {
                    call.arg(rid);
                }
                let _: i64 = call.invoke_async(c).await?;
                taken.voids.clear();
            }
            while let Some(&replay) = taken.replays.first() {
                self.run_complete(c, &quota.key, replay).await?;
                taken.replays.remove(0);
            }
            Ok(())
        }
        .await;
        // Dropping `taken` puts back what was not settled.
        result.map_err(Into::into)
    }

    /// Runs the completion script for `(seq, actual, latency_s, at)`: a first
    /// completion and a replayed one alike. 1 when it released the reservation.
    async fn run_complete(
        &self,
        c: &mut MultiplexedConnection,
        key: &str,
        (seq, actual, latency_s, at): Replay,
    ) -> Result<i64, RedisError> {
        self.scripts
            .complete
            .key(key)
            .arg(seq)
            .arg(actual)
            .arg(latency_s)
            .arg(at)
            .invoke_async(c)
            .await
    }

    fn unavailable(&self) -> Verdict {
        Verdict::unavailable(self.failure_mode, self.unavailable_retry_s)
    }

    /// Whether an admit refused because Redis is full may sweep quota `p`
    /// now (at most every [`SWEEP_EVERY`] per instance); marks it swept.
    fn may_sweep(&self, p: usize) -> bool {
        let mut last = lock(&self.quotas[p].swept);
        let now = Instant::now();
        if last.is_some_and(|t| now.saturating_duration_since(t) < SWEEP_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }

    pub async fn admit(
        &self,
        entitlement: &str,
        input_tokens: u64,
        max_tokens: Option<u64>,
        request_id: &str,
    ) -> Verdict {
        let output = max_tokens.unwrap_or(self.default_max_tokens);
        if input_tokens > MAX_TOKENS || output == 0 || output > MAX_TOKENS {
            return Verdict::invalid();
        }
        let Some(&p) = self.quota_of.get(entitlement) else {
            return Verdict::Refused {
                status: 401,
                reason: "unknown-entitlement".into(),
                retry_after_s: None,
            };
        };
        let quota = &self.quotas[p];
        let _busy = Busy::new(&self.busy);
        let now = wall_s();
        let rid = format!("{}{request_id}", self.rid_prefix);
        let sent = AtomicBool::new(false);
        let call = async {
            let mut c = self.connection().await?;
            self.ready(&mut c, p, now).await?;
            let mut out = Vec::new();
            let mut swept = false;
            for _ in 0..3 {
                sent.store(true, Ordering::Relaxed);
                let result = self
                    .scripts
                    .admit
                    .key(&quota.key)
                    .arg(entitlement)
                    .arg(input_tokens + output)
                    .arg(now)
                    .arg(&rid)
                    .invoke_async::<Vec<String>>(&mut c)
                    .await;
                out = match result {
                    // Refused at its start (Redis full): it never runs, so
                    // there is nothing to void. Free what expired, try again.
                    Err(e) if FailureKind::of(&e) == FailureKind::Oom => {
                        if swept || !self.may_sweep(p) {
                            sent.store(false, Ordering::Relaxed);
                            return Err(FailureKind::Oom);
                        }
                        swept = true;
                        let _: i64 = self
                            .scripts
                            .sweep
                            .key(&quota.key)
                            .arg(now)
                            .invoke_async(&mut c)
                            .await?;
                        continue;
                    }
                    result => result?,
                };
                if out.first().map(String::as_str) != Some("unconfigured") {
                    break;
                }
                self.configure(&mut c, p).await?; // Redis came back empty
            }
            Ok(out)
        };
        let out = match self.bounded(call).await {
            Ok(out) => out,
            Err(()) => return self.lost(p, rid, &sent),
        };
        if let Some(suppressed) = self.full.end() {
            tracing::info!(suppressed, "redis-writable");
        }
        let [status, reason, retry, seq, priority] = out.as_slice() else {
            // 'void' (a request id used twice) or 'unconfigured' twice.
            self.failed(FailureKind::Reply);
            return self.lost(p, rid, &sent);
        };
        let Ok(status) = status.parse::<u16>() else {
            self.failed(FailureKind::Reply);
            return self.lost(p, rid, &sent);
        };
        if let (Some((_, w)), Ok(priority)) =
            (self.flow_terms.get(entitlement), priority.parse::<f64>())
        {
            if priority.is_finite() && priority > 0.0 {
                w.store(priority.to_bits(), Ordering::Relaxed);
            }
        }
        if status != 200 {
            return Verdict::Refused {
                status,
                reason: reason.clone(),
                retry_after_s: retry.parse().ok(),
            };
        }
        let Ok(seq) = seq.parse::<u64>() else {
            self.failed(FailureKind::Reply);
            return self.lost(p, rid, &sent);
        };
        let ticket = seq * MAX_QUOTAS as u64 + p as u64;
        lock(&self.held).insert(ticket);
        Verdict::Admitted {
            ticket: Some(Ticket(ticket)),
        }
    }

    /// An admit whose outcome is unknown: if its script was sent, it may run
    /// (or have run) with nobody to complete it, so its id is voided when
    /// Redis answers again.
    fn lost(&self, p: usize, rid: String, sent: &AtomicBool) -> Verdict {
        if sent.load(Ordering::Relaxed) {
            defer(&mut lock(&self.quotas[p].pending).voids, rid);
        }
        self.unavailable()
    }

    pub async fn complete(&self, ticket: Ticket, input: u64, output: u64, latency_s: f64) -> bool {
        let actual = usage(input) as u64 + usage(output) as u64;
        self.finish(ticket, actual, latency(latency_s)).await
    }

    /// Gives back a ticket never served: the complete script with the
    /// latency [`UNSERVED`] charges nothing and learns nothing.
    pub async fn release(&self, ticket: Ticket) -> bool {
        self.finish(ticket, 0, UNSERVED).await
    }

    async fn finish(&self, ticket: Ticket, actual: u64, latency_s: f64) -> bool {
        // Busy before the ticket leaves `held`: `settled` sees one or the other.
        let _busy = Busy::new(&self.busy);
        if !lock(&self.held).remove(&ticket.0) {
            return false;
        }
        let (seq, p) = (
            ticket.0 / MAX_QUOTAS as u64,
            (ticket.0 % MAX_QUOTAS as u64) as usize,
        );
        let quota = &self.quotas[p];
        let now = wall_s();
        let call = async {
            let mut c = self.connection().await?;
            self.settle(&mut c, p, now).await?;
            let done = self
                .run_complete(&mut c, &quota.key, (seq, actual, latency_s, now))
                .await?;
            Ok(done == 1)
        };
        match self.bounded(call).await {
            Ok(done) => done,
            Err(()) => {
                // Replayed when Redis answers; a replay counts once.
                defer(
                    &mut lock(&quota.pending).replays,
                    (seq, actual, latency_s, now),
                );
                false
            }
        }
    }

    /// Preemptible requests to terminate now, read in one transaction per
    /// quota; none while Redis is unavailable.
    pub async fn evictions(&self) -> Vec<Ticket> {
        let now = wall_s();
        let mut out = Vec::new();
        for (p, quota) in self.quotas.iter().enumerate() {
            let call = async {
                let mut c = self.connection().await?;
                self.settle(&mut c, p, now).await?;
                let mut pipe = ::redis::pipe();
                pipe.atomic()
                    .hget(format!("{}:quota", quota.key), "in_flight")
                    .hget(format!("{}:quota", quota.key), "concurrency");
                for (e, _) in &quota.ents {
                    pipe.zrange_withscores(format!("{}:e:{e}:fl", quota.key), 0, -1)
                        .hget(format!("{}:e:{e}", quota.key), "priority");
                }
                let (head, rest): ((Option<f64>, Option<f64>), Vec<::redis::Value>) = {
                    let v: Vec<::redis::Value> = pipe.query_async(&mut c).await?;
                    let mut it = v.into_iter();
                    let a = it.next().map(::redis::from_redis_value::<Option<f64>>);
                    let b = it.next().map(::redis::from_redis_value::<Option<f64>>);
                    let (Some(a), Some(b)) = (a, b) else {
                        return Err(FailureKind::Reply);
                    };
                    ((a?, b?), it.collect())
                };
                Ok((head, rest))
            };
            let Ok(((in_flight, concurrency), rest)) = self.bounded(call).await else {
                return Vec::new();
            };
            let over = (in_flight.unwrap_or(0.0) - concurrency.unwrap_or(0.0)).max(0.0) as usize;
            let mut protected = false;
            let mut victims: Vec<(f64, f64, u64)> = Vec::new();
            for ((_, class), pair) in quota.ents.iter().zip(rest.chunks(2)) {
                let [flights, priority] = pair else { continue };
                let flights: Vec<(u64, f64)> =
                    ::redis::from_redis_value(flights.clone()).unwrap_or_default();
                let priority: f64 = ::redis::from_redis_value::<Option<f64>>(priority.clone())
                    .ok()
                    .flatten()
                    .unwrap_or(0.0);
                protected |= class.shrink() == Shrink::Never && !flights.is_empty();
                if class.shrink() == Shrink::Evict {
                    victims.extend(
                        flights.into_iter().map(|(seq, at)| {
                            (priority, now - at, seq * MAX_QUOTAS as u64 + p as u64)
                        }),
                    );
                }
            }
            if over == 0 || !protected {
                continue;
            }
            victims.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
            out.extend(victims.into_iter().take(over).map(|v| Ticket(v.2)));
        }
        out
    }

    /// Reservations this instance holds (admitted, not completed).
    pub fn in_flight(&self) -> u64 {
        lock(&self.held).len() as u64
    }

    /// Failures since construction.
    pub fn failures(&self) -> u64 {
        self.failures
            .iter()
            .map(|f| f.load(Ordering::Relaxed))
            .sum()
    }

    /// Failures since construction by kind.
    pub fn failures_by_kind(&self) -> [(FailureKind, u64); 4] {
        FailureKind::ALL.map(|k| (k, self.failures[k as usize].load(Ordering::Relaxed)))
    }

    /// Lost admits and failed completions not yet settled in Redis.
    pub fn pending(&self) -> usize {
        self.quotas
            .iter()
            .map(|p| {
                let q = lock(&p.pending);
                q.voids.len() + q.replays.len()
            })
            .sum()
    }

    /// Whether nothing is owed to Redis any more: no admit or completion
    /// under way, no ticket held, nothing pending (settling what it can now).
    pub async fn settled(&self) -> bool {
        {
            // Read under `held`'s lock: an admit adds its ticket before it
            // stops being busy, a completion is busy before it takes it out.
            let held = lock(&self.held);
            if !held.is_empty() || self.busy.load(Ordering::Acquire) > 0 {
                return false;
            }
        }
        self.pending() == 0 || self.reconcile().await
    }

    /// How long a shutdown waits for [`settled`](Self::settled).
    pub fn flush_timeout(&self) -> Duration {
        self.flush_timeout
    }

    /// Whether a call went to Redis within the last `period` (admits,
    /// completions and settlements alike; each settles a batch of what is
    /// pending before its own work).
    pub fn called_within(&self, period: Duration) -> bool {
        match self.last_call.load(Ordering::Relaxed) {
            0 => false,
            at => {
                let since = self.born.elapsed().as_nanos();
                since.saturating_sub(u128::from(at - 1)) < period.as_nanos()
            }
        }
    }

    /// Settles everything pending on every quota; true when nothing is left.
    pub async fn reconcile(&self) -> bool {
        let now = wall_s();
        for p in 0..self.quotas.len() {
            loop {
                let left = {
                    let q = lock(&self.quotas[p].pending);
                    !q.voids.is_empty() || !q.replays.is_empty()
                };
                if !left {
                    break;
                }
                let call = async {
                    let mut c = self.connection().await?;
                    self.settle(&mut c, p, now).await
                };
                if self.bounded(call).await.is_err() {
                    return false;
                }
            }
        }
        true
    }

    /// The state is in Redis already; what `old` has still to settle moves here.
    pub fn adopt(&self, old: &RedisAdmission) -> Result<(), Error> {
        for quota in &self.quotas {
            let Some(from) = old
                .quotas
                .iter()
                .find(|o| o.name == quota.name && o.key == quota.key)
            else {
                continue;
            };
            let taken = std::mem::take(&mut *lock(&from.pending));
            let mut to = lock(&quota.pending);
            for rid in taken.voids {
                defer(&mut to.voids, rid);
            }
            for r in taken.replays {
                defer(&mut to.replays, r);
            }
        }
        Ok(())
    }
}

/// 64 random bits for this instance's request-id prefix (replicas must not
/// share ids), from the OS through std's hasher seed.
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}
