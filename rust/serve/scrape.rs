//! The engines' state: every endpoint's Prometheus `/metrics`, scraped on a
//! thread of its own.
//!
//! One [`Probe`] per endpoint (shared by every engine of the data plane that
//! reads it with the same metric names, across reloads) polls
//! `GET /metrics?name[]=...` every `interval_s` over a kept-alive HTTP/1
//! connection. The `name[]` filter is prometheus_client's; vLLM (0.32) ignores
//! it and sends its whole page (about 55 KB, 644 lines), so only the lines of
//! the metrics read are kept ([`Reader`]: line by line, most lines ruled out
//! by their first 8 bytes, until only a name or two can still give a value,
//! then those are searched for in the rest of the page), and only those are
//! parsed by `prom_text_format_parser`.
//!
//! Every scrape (the HTTP exchange and the parsing) runs on the scraper's own
//! current-thread runtime (`routecore-scrape`), never on a thread that serves
//! conversations: a slow, huge or hostile page costs that thread only.
//!
//! A scrape fails when the endpoint refuses the connection, does not answer
//! within `timeout_s`, answers a status other than 200, a page over
//! `max_page_bytes` or with more than `max_series` series of the metrics read
//! (too large), or a page that is not the exposition format or has none of
//! the metrics read (garbage). Each outcome is counted
//! (`routecore_scrapes{endpoint, outcome}`); a run of failures is logged once
//! (`scrape-failed`, then a line a minute with the count held back, and one
//! when a scrape succeeds again: `logs::Repeats`). `unhealthy_after` failures
//! in a row make the endpoint unhealthy, the next success healthy again (a
//! `endpoint-unhealthy` / `endpoint-healthy` log event and
//! `routecore_endpoint_transitions{endpoint, to}` each way). A failed scrape
//! changes nothing else: the last values stay until they are older than
//! `stale_after` intervals, then they are unknown ([`Probe::reading`]).
//!
//! A reload keeps the probes of the endpoints that stay, with their health
//! and values; the new configuration's settings apply from the next scrape
//! ([`Probe::configure`]).
//!
//! The readings are atomics: the request path reads them without a lock,
//! and notices a new scrape by its sequence number.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::client::conn::http1::{Connection, SendRequest};
use hyper_util::rt::TokioIo;
use serde::Deserialize;

use super::logs::{Occurrence, Repeats};
use super::metrics::Metrics;
use crate::error::{invalid, Result};

/// The metric names read from one kind of engine. For each quantity the
/// first name present on the page is read (e.g. vLLM's current KV-cache name,
/// then the older one).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineMetrics {
    pub waiting: Vec<String>,
    pub running: Vec<String>,
    pub kv_usage: Vec<String>,
    /// The LoRA info gauge (vLLM's `vllm:lora_requests_info`), None: not read.
    pub adapters: Option<String>,
}

impl EngineMetrics {
    fn names(&self) -> impl Iterator<Item = &str> {
        self.waiting
            .iter()
            .chain(&self.running)
            .chain(&self.kv_usage)
            .chain(&self.adapters)
            .map(String::as_str)
    }
}

/// `scrape:` of the configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrapeSpec {
    /// false: endpoints are not scraped (always healthy, their state unknown).
    pub enabled: bool,
    pub interval_s: f64,
    pub timeout_s: f64,
    /// Failures in a row that make an endpoint unhealthy (K).
    pub unhealthy_after: u32,
    /// Intervals after which a value counts as unknown.
    pub stale_after: u32,
    pub max_page_bytes: u64,
    /// The most series of the metrics read on one page (more: too large).
    pub max_series: u64,
    /// Metric names by engine kind (`vllm`, `sglang`, or any name a pool's
    /// `engine` gives).
    pub engines: HashMap<String, EngineMetrics>,
}

impl ScrapeSpec {
    pub fn check(&self) -> Result<()> {
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if !pos(self.interval_s) || !pos(self.timeout_s) {
            return Err(invalid(
                "scrape.interval_s and scrape.timeout_s must be > 0",
            ));
        }
        if self.unhealthy_after == 0
            || self.stale_after == 0
            || self.max_page_bytes == 0
            || self.max_series == 0
        {
            return Err(invalid(
                "scrape.unhealthy_after, stale_after, max_page_bytes and max_series must be >= 1",
            ));
        }
        Ok(())
    }

    pub fn interval(&self) -> Duration {
        Duration::from_secs_f64(self.interval_s)
    }

    /// How long a value stays known after the scrape that read it.
    pub fn max_age(&self) -> Duration {
        self.interval() * self.stale_after
    }

    fn max_page(&self) -> usize {
        usize::try_from(self.max_page_bytes).unwrap_or(usize::MAX)
    }
}

/// Why a scrape failed (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Connect,
    Timeout,
    Status,
    TooLarge,
    Garbage,
}

impl Failure {
    pub fn label(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Timeout => "timeout",
            Failure::Status => "status",
            Failure::TooLarge => "too-large",
            Failure::Garbage => "garbage",
        }
    }
}

/// What one page said (None: the page did not carry it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub kv_usage: Option<f64>,
    /// None: the page does not report adapters.
    pub adapters: Option<Vec<String>>,
}

/// One name read: the quantity it gives (waiting, running, KV use,
/// adapters: 0 to 3), whether it is the quantity's first choice, and a
/// searcher for its lines (`\n` and the name).
struct Name {
    text: String,
    quantity: usize,
    first: bool,
    finder: memchr::memmem::Finder<'static>,
}

impl Name {
    fn all(names: &EngineMetrics) -> Vec<Self> {
        let quantities = [
            &names.waiting[..],
            &names.running[..],
            &names.kv_usage[..],
            names.adapters.as_slice(),
        ];
        let mut out = Vec::new();
        for (quantity, list) in quantities.into_iter().enumerate() {
            for (rank, text) in list.iter().enumerate() {
                out.push(Self {
                    finder: memchr::memmem::Finder::new(&format!("\n{text}")).into_owned(),
                    text: text.clone(),
                    quantity,
                    first: rank == 0,
                });
            }
        }
        out
    }

    /// Does `line` hold a sample of this name? (Comments never do: the
    /// parser reads the kept samples as untyped values.) The exact name only:
    /// `vllm:num_requests_waiting_by_reason` is not `vllm:num_requests_waiting`.
    fn holds(&self, line: &[u8]) -> bool {
        line.strip_prefix(self.text.as_bytes())
            .is_some_and(|rest| matches!(rest.first(), Some(b'{' | b' ' | b'\t')))
    }
}

/// The first 8 bytes of the names read, as integers: most lines of a page
/// (comments, histograms) differ from all of them there, and are skipped
/// after a few integer comparisons. A name shorter than 8 bytes turns the
/// test off.
struct Heads(Option<Vec<u64>>);

fn head(b: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?))
}

impl Heads {
    fn new(names: &[Name]) -> Self {
        let mut heads = Vec::new();
        for n in names {
            match head(n.text.as_bytes()) {
                Some(h) if !heads.contains(&h) => heads.push(h),
                Some(_) => {}
                None => return Self(None),
            }
        }
        Self(Some(heads))
    }

    fn may_be(&self, line: &[u8]) -> bool {
        match (&self.0, head(line)) {
            (None, _) => true,
            (Some(heads), Some(h)) => heads.contains(&h),
            (Some(_), None) => false,
        }
    }
}

/// The kept lines' buffer is given back past this size (a huge page once
/// does not hold its memory for good).
const KEEP_BUF: usize = 64 << 10;

/// Past how many names still to find the line-by-line pass goes on
/// (each is then searched for in the rest of the page).
const SEARCHED: usize = 2;

/// Reads the metrics pages of one endpoint: the names read, the series
/// limit, and a buffer for the kept lines reused from page to page.
pub struct Reader {
    names: EngineMetrics,
    list: Vec<Name>,
    heads: Heads,
    max_series: usize,
    kept: Vec<u8>,
    /// Per name of `list`: its group of lines has ended on this page.
    closed: Vec<bool>,
}

impl Reader {
    pub fn new(names: EngineMetrics, max_series: u64) -> Self {
        let list = Name::all(&names);
        Self {
            heads: Heads::new(&list),
            closed: vec![false; list.len()],
            list,
            names,
            max_series: usize::try_from(max_series).unwrap_or(usize::MAX),
            kept: Vec::new(),
        }
    }

    /// Reads one metrics page: keeps the lines of the metrics read (more
    /// than `max_series` of them: too large, before any parsing), parses them
    /// with the exposition-format library and sums each quantity over its
    /// series (an engine with several data-parallel ranks reports one series
    /// per rank; KV use is their mean). Garbage: not the exposition format,
    /// or none of the metrics read.
    pub fn read(&mut self, page: &[u8]) -> std::result::Result<Reading, Failure> {
        self.kept.clear();
        self.closed.iter_mut().for_each(|c| *c = false);
        let out = self.keep(page).and_then(|()| self.parse());
        if self.kept.capacity() > KEEP_BUF {
            self.kept = Vec::new();
        }
        out
    }

    /// The name whose sample `line` is.
    fn which(&self, line: &[u8]) -> Option<usize> {
        if !self.heads.may_be(line) {
            return None;
        }
        self.list.iter().position(|n| n.holds(line))
    }

    fn take(&mut self, line: &[u8], series: &mut usize) -> std::result::Result<(), Failure> {
        *series += 1;
        if *series > self.max_series {
            return Err(Failure::TooLarge);
        }
        self.kept
            .extend_from_slice(line.strip_suffix(b"\r").unwrap_or(line));
        self.kept.push(b'\n');
        Ok(())
    }

    /// The names that can still give a value: those of the quantities whose
    /// first choice has not been read, whose lines have not ended yet.
    fn to_find(&self) -> impl Iterator<Item = usize> + '_ {
        let settled = |q: usize| {
            self.list
                .iter()
                .zip(&self.closed)
                .any(|(n, &c)| n.quantity == q && n.first && c)
        };
        (0..self.list.len()).filter(move |&i| !self.closed[i] && !settled(self.list[i].quantity))
    }

    /// Keeps the lines of the metrics read. The exposition format writes the
    /// lines of one metric as one group: line by line (newlines found with
    /// `memchr`, most lines ruled out by [`Heads`]) until at most
    /// [`SEARCHED`] names can still give a value (on vLLM's page: its
    /// LoRA gauge, near the end, once the queue, running and KV lines are
    /// read near the start), then the rest of the page is searched for
    /// those names only (`memmem`). Lines of a metric after its group has
    /// ended (a page that breaks the format) are not read.
    fn keep(&mut self, page: &[u8]) -> std::result::Result<(), Failure> {
        let mut series = 0;
        let mut current: Option<usize> = None;
        let mut start = 0;
        let mut rest = page.len();
        while start < page.len() {
            let end = memchr::memchr(b'\n', &page[start..]).map_or(page.len(), |e| start + e);
            let line = &page[start..end];
            start = end + 1;
            match self.which(line) {
                Some(i) => {
                    if let Some(c) = current.filter(|&c| c != i) {
                        self.closed[c] = true;
                    }
                    current = Some(i);
                    self.take(line, &mut series)?;
                }
                None => {
                    if let Some(c) = current.take() {
                        self.closed[c] = true;
                        if self.to_find().count() <= SEARCHED {
                            rest = end;
                            break;
                        }
                    }
                }
            }
        }
        // The rest (from the newline before the next line), name by name.
        let left: Vec<usize> = self.to_find().collect();
        let tail = page.get(rest..).unwrap_or_default();
        for i in left {
            let mut from = 0;
            while let Some(hit) = self.list[i].finder.find(&tail[from..]) {
                // The group starts after the newline: read it to its end.
                let mut at = from + hit + 1;
                while at < tail.len() {
                    let end = memchr::memchr(b'\n', &tail[at..]).map_or(tail.len(), |e| at + e);
                    let line = &tail[at..end];
                    if !self.list[i].holds(line) {
                        break;
                    }
                    self.take(line, &mut series)?;
                    at = end + 1;
                }
                from = at.min(tail.len());
            }
        }
        Ok(())
    }

    fn parse(&self) -> std::result::Result<Reading, Failure> {
        let kept = std::str::from_utf8(&self.kept).map_err(|_| Failure::Garbage)?;
        if kept.is_empty() {
            return Err(Failure::Garbage);
        }
        let scrape = prom_text_format_parser::Scrape::parse(kept).map_err(|_| Failure::Garbage)?;
        let names = &self.names;
        let series = |name: &str| -> Option<(f64, usize)> {
            let m = scrape.metrics.iter().find(|m| m.name == name)?;
            let (sum, n) = m
                .samples
                .iter()
                .map(|s| s.value.value.as_f64())
                .filter(|v| v.is_finite())
                .fold((0.0, 0), |(sum, n), v| (sum + v, n + 1));
            (n > 0).then_some((sum, n))
        };
        let first = |list: &[String]| list.iter().find_map(|n| series(n));
        let reading = Reading {
            waiting: first(&names.waiting).map(|(sum, _)| sum),
            running: first(&names.running).map(|(sum, _)| sum),
            kv_usage: first(&names.kv_usage).map(|(sum, n)| (sum / n as f64).clamp(0.0, 1.0)),
            adapters: names.adapters.as_deref().and_then(|n| adapters(&scrape, n)),
        };
        if reading == Reading::default() {
            return Err(Failure::Garbage);
        }
        Ok(reading)
    }
}

/// The adapters of the latest LoRA info sample (its value is a timestamp):
/// running and waiting, comma-separated label values, each once, in the
/// order of the page (linear in their number, however many a page lists).
fn adapters(scrape: &prom_text_format_parser::Scrape, name: &str) -> Option<Vec<String>> {
    let m = scrape.metrics.iter().find(|m| m.name == name)?;
    let latest = m
        .samples
        .iter()
        .max_by(|a, b| a.value.value.as_f64().total_cmp(&b.value.value.as_f64()))?;
    let mut seen = HashSet::new();
    let mut out: Vec<String> = Vec::new();
    for key in ["running_lora_adapters", "waiting_lora_adapters"] {
        if let Some(l) = latest.labels.iter().find(|l| l.key == key) {
            for a in l.value.split(',').map(str::trim).filter(|a| !a.is_empty()) {
                if seen.insert(a) {
                    out.push(a.to_string());
                }
            }
        }
    }
    Some(out)
}

const UNKNOWN: u64 = u64::MAX;

fn as_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The latest state of one endpoint, written by its scrape task, read
/// lock-free by the request path (values as f64 bits; [`UNKNOWN`]: absent).
pub struct Probe {
    pub endpoint: String,
    names: EngineMetrics,
    /// The settings of the newest configuration that reads the endpoint.
    spec: Mutex<Arc<ScrapeSpec>>,
    /// `spec.max_age()` in ns (read by the request path without the lock).
    max_age: AtomicU64,
    waiting: AtomicU64,
    running: AtomicU64,
    kv_usage: AtomicU64,
    /// Replaced only when the list changes: the request path copies it when
    /// the pointer differs from the one it copied last.
    adapters: Mutex<Arc<Vec<String>>>,
    /// When the values were read, in ns after `epoch` (UNKNOWN: never).
    scraped_at: AtomicU64,
    /// Successful scrapes so far: a reader sees a new scrape when it changes.
    seq: AtomicU64,
    healthy: AtomicBool,
    failures: AtomicU32,
    epoch: Instant,
}

/// What the request path takes from a probe.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub healthy: bool,
    pub seq: u64,
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub kv_usage: Option<f64>,
}

fn load(a: &AtomicU64) -> Option<f64> {
    match a.load(Ordering::Acquire) {
        UNKNOWN => None,
        bits => Some(f64::from_bits(bits)),
    }
}

fn store(a: &AtomicU64, v: Option<f64>) {
    a.store(v.map_or(UNKNOWN, f64::to_bits), Ordering::Release);
}

impl Probe {
    fn new(endpoint: &str, spec: Arc<ScrapeSpec>, names: EngineMetrics) -> Self {
        Self {
            endpoint: endpoint.to_string(),
            names,
            max_age: AtomicU64::new(as_nanos(spec.max_age())),
            spec: Mutex::new(spec),
            waiting: AtomicU64::new(UNKNOWN),
            running: AtomicU64::new(UNKNOWN),
            kv_usage: AtomicU64::new(UNKNOWN),
            adapters: Mutex::default(),
            scraped_at: AtomicU64::new(UNKNOWN),
            seq: AtomicU64::new(0),
            // Healthy until it fails `unhealthy_after` scrapes in a row.
            healthy: AtomicBool::new(true),
            failures: AtomicU32::new(0),
            epoch: Instant::now(),
        }
    }

    fn spec(&self) -> Arc<ScrapeSpec> {
        Arc::clone(&self.spec.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Scrapes with `spec` from the next scrape on (a reload's settings);
    /// the health, the values and the connection stay.
    pub fn configure(&self, spec: &Arc<ScrapeSpec>) {
        let mut current = self.spec.lock().unwrap_or_else(|e| e.into_inner());
        if !Arc::ptr_eq(&current, spec) {
            self.max_age
                .store(as_nanos(spec.max_age()), Ordering::Release);
            *current = Arc::clone(spec);
        }
    }

    fn nanos(&self, t: Instant) -> u64 {
        as_nanos(t.saturating_duration_since(self.epoch)).min(u64::MAX - 1)
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    pub fn seq(&self) -> u64 {
        self.seq.load(Ordering::Acquire)
    }

    /// The endpoint's state at `now`: values older than `stale_after`
    /// intervals are unknown.
    pub fn reading(&self, now: Instant) -> Snapshot {
        let seq = self.seq();
        let at = self.scraped_at.load(Ordering::Acquire);
        let fresh = at != UNKNOWN
            && self.nanos(now).saturating_sub(at) <= self.max_age.load(Ordering::Acquire);
        let v = |a: &AtomicU64| if fresh { load(a) } else { None };
        Snapshot {
            healthy: self.healthy(),
            seq,
            waiting: v(&self.waiting),
            running: v(&self.running),
            kv_usage: v(&self.kv_usage),
        }
    }

    /// The adapters the endpoint reported last (empty: none or not reported).
    pub fn adapters(&self) -> Arc<Vec<String>> {
        Arc::clone(&self.adapters.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records a scrape's outcome; returns the health transition it caused.
    pub fn record(
        &self,
        outcome: std::result::Result<Reading, Failure>,
        now: Instant,
    ) -> Option<bool> {
        match outcome {
            Ok(r) => {
                store(&self.waiting, r.waiting);
                store(&self.running, r.running);
                store(&self.kv_usage, r.kv_usage);
                if let Some(a) = r.adapters {
                    let mut current = self.adapters.lock().unwrap_or_else(|e| e.into_inner());
                    if **current != a {
                        *current = Arc::new(a);
                    }
                }
                self.scraped_at.store(self.nanos(now), Ordering::Release);
                self.seq.fetch_add(1, Ordering::AcqRel);
                self.failures.store(0, Ordering::Release);
                (!self.healthy.swap(true, Ordering::AcqRel)).then_some(true)
            }
            Err(_) => {
                let n = self
                    .failures
                    .fetch_add(1, Ordering::AcqRel)
                    .saturating_add(1);
                if n >= self.spec().unhealthy_after && self.healthy.swap(false, Ordering::AcqRel) {
                    return Some(false);
                }
                None
            }
        }
    }

    /// The request line's path: `/metrics` with a `name[]` per metric read.
    fn path(&self) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        for n in self.names.names() {
            q.append_pair("name[]", n);
        }
        format!("/metrics?{}", q.finish())
    }
}

/// The scraper's thread: a current-thread runtime that runs every scrape
/// task, and the sender that stops it.
struct Worker {
    handle: tokio::runtime::Handle,
    halt: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

/// The name of the scraper's thread.
pub const THREAD: &str = "routecore-scrape";

impl Worker {
    fn start() -> Result<Self> {
        let fail = |e: std::io::Error| invalid(format!("cannot start the scraper: {e}"));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(fail)?;
        let handle = runtime.handle().clone();
        let (halt, halted) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(THREAD.into())
            .spawn(move || {
                // Until stopped (or the scraper is dropped); the scrapes in
                // flight are dropped with the runtime.
                let _ = runtime.block_on(halted);
                runtime.shutdown_background();
            })
            .map_err(fail)?;
        Ok(Self {
            handle,
            halt,
            thread,
        })
    }
}

/// The scrape tasks of one data plane: one probe per (endpoint, names),
/// alive while an engine holds it, scraped on the scraper's own thread
/// (started with the first probe).
pub struct Scraper {
    probes: Mutex<HashMap<(String, EngineMetrics), Weak<Probe>>>,
    metrics: Arc<Metrics>,
    worker: Mutex<Option<Worker>>,
}

impl Scraper {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            probes: Mutex::new(HashMap::new()),
            metrics,
            worker: Mutex::new(None),
        }
    }

    /// The probe of `endpoint` read as `engine`, started when no engine of the
    /// data plane scrapes it yet. An existing probe keeps its settings until
    /// [`Probe::configure`] (the caller's configuration is valid as a whole).
    pub fn probe(
        &self,
        endpoint: &str,
        spec: &Arc<ScrapeSpec>,
        engine: &str,
    ) -> Result<Arc<Probe>> {
        let names = spec
            .engines
            .get(engine)
            .ok_or_else(|| {
                invalid(format!(
                    "scrape.engines: no metric names for engine {engine:?}"
                ))
            })?
            .clone();
        let mut probes = self.probes.lock().unwrap_or_else(|e| e.into_inner());
        probes.retain(|_, w| w.strong_count() > 0);
        let key = (endpoint.to_string(), names.clone());
        if let Some(p) = probes.get(&key).and_then(Weak::upgrade) {
            return Ok(p);
        }
        let handle = {
            let mut worker = self.worker.lock().unwrap_or_else(|e| e.into_inner());
            let worker = match worker.take() {
                Some(w) => worker.insert(w),
                None => worker.insert(Worker::start()?),
            };
            worker.handle.clone()
        };
        let probe = Arc::new(Probe::new(endpoint, Arc::clone(spec), names));
        probes.insert(key, Arc::downgrade(&probe));
        self.metrics.endpoint_health(endpoint, true, false);
        handle.spawn(run(Arc::downgrade(&probe), Arc::clone(&self.metrics)));
        Ok(probe)
    }

    /// Stops every scrape and the scraper's thread (waits for it).
    pub fn stop(&self) {
        let worker = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = worker {
            let _ = w.halt.send(());
            let _ = w.thread.join();
        }
    }
}

impl Drop for Scraper {
    /// A scraper dropped without `stop` still ends its thread.
    fn drop(&mut self) {
        let worker = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = worker {
            let _ = w.halt.send(());
        }
    }
}

/// A kept-alive HTTP/1 connection to an endpoint, driven by its scrape task
/// itself (no task of its own: no wakeup between two tasks per scrape).
struct Link {
    sender: SendRequest<Empty<Bytes>>,
    conn: Connection<TokioIo<tokio::net::TcpStream>, Empty<Bytes>>,
}

const READ_BUF: usize = 64 << 10;

impl Link {
    async fn open(endpoint: &str) -> std::result::Result<Self, Failure> {
        let stream = tokio::net::TcpStream::connect(endpoint)
            .await
            .map_err(|_| Failure::Connect)?;
        let _ = stream.set_nodelay(true);
        // Reads of 64 KiB: a whole page in one read, one body chunk.
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .read_buf_exact_size(Some(READ_BUF))
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|_| Failure::Connect)?;
        Ok(Self { sender, conn })
    }

    /// Whether the endpoint closed the connection while it was idle.
    fn closed(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        Pin::new(&mut self.conn).poll(&mut cx).is_ready()
    }

    /// One GET, the connection driven meanwhile. The page is the body as
    /// hyper read it (one chunk: no copy), at most `max` bytes.
    async fn get(
        &mut self,
        request: hyper::Request<Empty<Bytes>>,
        max: usize,
    ) -> std::result::Result<Bytes, Failure> {
        let answer = answer(&mut self.sender, request, max);
        let mut answer = std::pin::pin!(answer);
        let conn = &mut self.conn;
        std::future::poll_fn(|cx| match answer.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(out),
            // The connection ended before the answer did.
            Poll::Pending if Pin::new(&mut *conn).poll(cx).is_ready() => {
                Poll::Ready(Err(Failure::Connect))
            }
            Poll::Pending => Poll::Pending,
        })
        .await
    }
}

/// One request's answer on `sender`: the body of a 200, at most `max`
/// bytes (also the prefill sender's, `serve::pd_send`).
pub(super) async fn answer<B>(
    sender: &mut SendRequest<B>,
    request: hyper::Request<B>,
    max: usize,
) -> std::result::Result<Bytes, Failure>
where
    B: hyper::body::Body + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    sender.ready().await.map_err(|_| Failure::Connect)?;
    let resp = sender
        .send_request(request)
        .await
        .map_err(|_| Failure::Connect)?;
    if resp.status() != hyper::StatusCode::OK {
        return Err(Failure::Status);
    }
    let announced = resp
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max as u64) {
        return Err(Failure::TooLarge);
    }
    Ok(Limited::new(resp.into_body(), max)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                Failure::TooLarge
            } else {
                Failure::Connect
            }
        })?
        .to_bytes())
}

/// One GET over the kept-alive connection (opened when there is none, or
/// when the endpoint closed it); a failure drops the connection.
async fn fetch(
    link: &mut Option<Link>,
    endpoint: &str,
    request: &hyper::Request<Empty<Bytes>>,
    max: usize,
) -> std::result::Result<Bytes, Failure> {
    let open = link.as_mut().is_some_and(|l| !l.closed());
    let mut l = match link.take() {
        Some(l) if open => l,
        _ => Link::open(endpoint).await?,
    };
    let mut req = hyper::Request::new(Empty::<Bytes>::new());
    *req.uri_mut() = request.uri().clone();
    *req.headers_mut() = request.headers().clone();
    let page = l.get(req, max).await?;
    *link = Some(l);
    Ok(page)
}

/// Scrapes one endpoint every interval until its probe is dropped, with the
/// probe's current settings.
async fn run(probe: Weak<Probe>, metrics: Arc<Metrics>) {
    let (endpoint, mut spec, mut reader, request) = match probe.upgrade() {
        Some(p) => {
            let spec = p.spec();
            let reader = Reader::new(p.names.clone(), spec.max_series);
            let request = hyper::Request::get(p.path())
                .header(hyper::header::HOST, p.endpoint.as_str())
                .body(Empty::<Bytes>::new());
            (p.endpoint.clone(), spec, reader, request)
        }
        None => return,
    };
    let Ok(request) = request else {
        // An endpoint that is no host:port (the configuration checks it).
        return;
    };
    // Spread the endpoints' scrapes over the interval.
    let offset = xxhash_rust::xxh3::xxh3_64(endpoint.as_bytes()) % 1000;
    tokio::time::sleep(spec.interval().mul_f64(offset as f64 / 1000.0)).await;
    let ticker = |period: Duration| {
        let mut t = tokio::time::interval(period);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    };
    let mut ticks = ticker(spec.interval());
    let mut link: Option<Link> = None;
    let outcomes = metrics.scrape_counters(&endpoint);
    let failing = Repeats::default();
    loop {
        ticks.tick().await;
        let Some(p) = probe.upgrade() else { return };
        let now_spec = p.spec();
        if !Arc::ptr_eq(&now_spec, &spec) {
            if now_spec.interval() != spec.interval() {
                ticks = ticker(now_spec.interval());
                ticks.tick().await; // the first tick is now
            }
            reader = Reader::new(p.names.clone(), now_spec.max_series);
            spec = now_spec;
        }
        let fetched = tokio::time::timeout(
            Duration::from_secs_f64(spec.timeout_s),
            fetch(&mut link, &endpoint, &request, spec.max_page()),
        )
        .await
        .unwrap_or(Err(Failure::Timeout));
        let outcome = fetched.and_then(|page| reader.read(&page));
        if outcome.is_err() {
            link = None;
        }
        outcomes.count(outcome.as_ref().err().map(|f| f.label()));
        let now = Instant::now();
        let recovered = match &outcome {
            Err(f) => {
                if let Occurrence::Log { suppressed } = failing.occur(now) {
                    tracing::warn!(
                        endpoint = endpoint.as_str(),
                        outcome = f.label(),
                        suppressed,
                        "scrape-failed"
                    );
                }
                None
            }
            Ok(_) => failing.end(),
        };
        match (p.record(outcome, now), recovered) {
            (Some(true), suppressed) => {
                metrics.endpoint_health(&endpoint, true, true);
                tracing::info!(
                    endpoint = endpoint.as_str(),
                    suppressed = suppressed.unwrap_or(0),
                    "endpoint-healthy"
                );
            }
            (Some(false), _) => {
                metrics.endpoint_health(&endpoint, false, true);
                tracing::warn!(
                    endpoint = endpoint.as_str(),
                    failures = spec.unhealthy_after,
                    "endpoint-unhealthy"
                );
            }
            (None, Some(suppressed)) => {
                tracing::info!(endpoint = endpoint.as_str(), suppressed, "scrape-recovered");
            }
            (None, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm() -> EngineMetrics {
        EngineMetrics {
            waiting: vec!["vllm:num_requests_waiting".into()],
            running: vec!["vllm:num_requests_running".into()],
            kv_usage: vec![
                "vllm:kv_cache_usage_perc".into(),
                "vllm:gpu_cache_usage_perc".into(),
            ],
            adapters: Some("vllm:lora_requests_info".into()),
        }
    }

    fn spec() -> ScrapeSpec {
        ScrapeSpec {
            enabled: true,
            interval_s: 0.05,
            timeout_s: 0.5,
            unhealthy_after: 3,
            stale_after: 4,
            max_page_bytes: 1 << 20,
            max_series: 1000,
            engines: [("vllm".to_string(), vllm())].into(),
        }
    }

    fn read_page(page: &[u8], names: &EngineMetrics) -> std::result::Result<Reading, Failure> {
        Reader::new(names.clone(), 1000).read(page)
    }

    const PAGE: &str = "# HELP vllm:num_requests_waiting Requests waiting.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2.0\n\
# TYPE vllm:num_requests_waiting_total counter\n\
vllm:num_requests_waiting_total{engine=\"0\"} 99.0\n\
# TYPE vllm:gpu_cache_usage_perc gauge\n\
vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
vllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.75\n\
# TYPE vllm:e2e_request_latency_seconds histogram\n\
vllm:e2e_request_latency_seconds_bucket{le=\"0.5\",model_name=\"m\"} 7.0\n\
# TYPE vllm:lora_requests_info gauge\n\
vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a, b\",waiting_lora_adapters=\"c\"} 1.7e9\n\
vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 1.6e9\n";

    #[test]
    fn page_sums_series_takes_the_older_kv_name_and_the_latest_adapters() {
        let r = read_page(PAGE.as_bytes(), &vllm()).expect("page");
        assert_eq!(r.waiting, Some(5.0)); // not the _total counter sharing its prefix
        assert_eq!(r.running, None);
        assert_eq!(r.kv_usage, Some(0.5));
        assert_eq!(
            r.adapters,
            Some(vec!["a".to_string(), "b".to_string(), "c".to_string()])
        );
    }

    /// vLLM 0.32's page as captured (tests/fixtures/vllm/metrics.txt), idle,
    /// and busy (5 running, 5 waiting, KV 0.93).
    const FIXTURE: &str = include_str!("../../tests/fixtures/vllm/metrics.txt");
    const BUSY: &str = include_str!("../../tests/fixtures/vllm/metrics-busy.txt");

    /// The value of the sample line of `name` (the first) on `page`.
    fn value(page: &str, name: &str) -> f64 {
        page.lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} on the page"))
    }

    #[test]
    fn the_real_page_is_read_by_its_exact_names() {
        for page in [FIXTURE, BUSY] {
            let r = read_page(page.as_bytes(), &vllm()).expect("the captured page");
            assert_eq!(r.running, Some(value(page, "vllm:num_requests_running")));
            assert_eq!(r.kv_usage, Some(value(page, "vllm:kv_cache_usage_perc")));
            // No LoRA: no adapters gauge, so the adapters are not reported.
            assert_eq!(r.adapters, None);
        }
        // `vllm:num_requests_waiting_by_reason` starts with the queue's name;
        // its series (capacity 5, deferred 0) are not the queue (5, not 10).
        let waiting = "vllm:num_requests_waiting";
        assert!(BUSY.contains(&format!("\n{waiting}_by_reason{{")));
        let r = read_page(BUSY.as_bytes(), &vllm()).expect("page");
        assert_eq!((r.waiting, r.running), (Some(5.0), Some(5.0)));
        assert!(r.kv_usage.is_some_and(|kv| (kv - 0.926).abs() < 1e-3));
        assert_eq!(
            read_page(FIXTURE.as_bytes(), &vllm())
                .expect("page")
                .waiting,
            Some(0.0)
        );
    }

    #[test]
    fn names_still_to_find_are_searched_in_the_rest_of_the_page() {
        const LORA: &str = include_str!("../../tests/fixtures/vllm/metrics_lora.txt");
        let want = Reading {
            waiting: Some(value(LORA, "vllm:num_requests_waiting")),
            running: Some(value(LORA, "vllm:num_requests_running")),
            kv_usage: Some(value(LORA, "vllm:kv_cache_usage_perc")),
            adapters: Some(vec!["sql-lora".into()]),
        };
        // The LoRA gauge is near the end, long after the other groups.
        assert_eq!(read_page(LORA.as_bytes(), &vllm()), Ok(want.clone()));
        assert_eq!(
            read_page(LORA.replace('\n', "\r\n").as_bytes(), &vllm()),
            Ok(want.clone())
        );
        // Only the older KV name (the second choice): both KV names are
        // still looked for after it, the first choice would win.
        let old = LORA.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc");
        assert_eq!(read_page(old.as_bytes(), &vllm()), Ok(want.clone()));
        let moved = format!("{old}vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.5\n");
        let r = read_page(moved.as_bytes(), &vllm()).expect("page");
        assert_eq!(r.kv_usage, Some(0.5));
        // Data-parallel ranks: a group of several lines, each read.
        let ranks = LORA.replace(
            "vllm:lora_requests_info{",
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a\",\
             waiting_lora_adapters=\"\"} 1.0\nvllm:lora_requests_info{",
        );
        assert_eq!(read_page(ranks.as_bytes(), &vllm()), Ok(want));
    }

    #[test]
    fn series_past_the_limit_are_too_large_before_parsing() {
        let series = |n: usize| -> String {
            (0..n)
                .map(|i| format!("vllm:num_requests_waiting{{engine=\"{i}\"}} 1\n"))
                .collect()
        };
        // Lines of other metrics do not count.
        let others = "vllm:e2e_request_latency_seconds_bucket{le=\"1\"} 7\n".repeat(50);
        let page = format!("{others}{}", series(10));
        let mut reader = Reader::new(vllm(), 10);
        assert_eq!(
            reader.read(page.as_bytes()).expect("10 series").waiting,
            Some(10.0)
        );
        // One more, even a broken one that parsing would refuse: too large.
        let page = format!("{}vllm:num_requests_running{{ broken\n", series(10));
        assert_eq!(reader.read(page.as_bytes()), Err(Failure::TooLarge));
        // The reader is reused: the next page is read alone.
        assert_eq!(
            reader.read(series(3).as_bytes()).expect("3").waiting,
            Some(3.0)
        );
    }

    #[test]
    fn adapters_are_listed_once_in_page_order_however_many() {
        let n = 20_000;
        let names: Vec<String> = (0..n).map(|i| format!("lora-{i}")).collect();
        // Running: all of them, each twice; waiting: the first half again and a new one.
        let running = names
            .iter()
            .chain(&names)
            .cloned()
            .collect::<Vec<_>>()
            .join(",");
        let waiting = format!("{},new", names[..n / 2].join(", "));
        let page = format!(
            "vllm:num_requests_waiting 0\nvllm:lora_requests_info{{max_lora=\"4\",\
             running_lora_adapters=\"{running}\",waiting_lora_adapters=\"{waiting}\"}} 1.7e9\n"
        );
        let got = read_page(page.as_bytes(), &vllm())
            .expect("page")
            .adapters
            .expect("adapters");
        let mut want = names;
        want.push("new".into());
        assert_eq!(got, want);
    }

    #[test]
    fn sglang_names_are_read_by_configuration() {
        let names = EngineMetrics {
            waiting: vec!["sglang:num_queue_reqs".into()],
            running: vec!["sglang:num_running_reqs".into()],
            kv_usage: vec!["sglang:token_usage".into()],
            adapters: None,
        };
        let page = "sglang:num_queue_reqs{model_name=\"m\"} 4\n\
                    sglang:num_running_reqs{model_name=\"m\"} 8\n\
                    sglang:token_usage{model_name=\"m\"} 0.9\n";
        let r = read_page(page.as_bytes(), &names).expect("page");
        assert_eq!(
            (r.waiting, r.running, r.kv_usage, r.adapters),
            (Some(4.0), Some(8.0), Some(0.9), None)
        );
    }

    #[test]
    fn garbage_pages_are_failures() {
        for page in [
            &b"<html>not metrics</html>"[..],
            b"",
            b"\xff\xfe\x00 vllm:num_requests_waiting 1",
            b"vllm:num_requests_waiting{engine=\"0\" 3\n",
            b"vllm:num_requests_waiting NaN\n",
        ] {
            assert_eq!(
                read_page(page, &vllm()),
                Err(Failure::Garbage),
                "{:?}",
                String::from_utf8_lossy(page)
            );
        }
    }

    #[test]
    fn k_failures_in_a_row_make_unhealthy_one_success_healthy_values_go_stale() {
        let p = Probe::new("127.0.0.1:1", Arc::new(spec()), vllm());
        let t0 = Instant::now();
        let ok = read_page(PAGE.as_bytes(), &vllm());
        assert_eq!(p.record(ok.clone(), t0), None);
        assert_eq!(p.reading(t0).waiting, Some(5.0));
        assert_eq!(p.record(Err(Failure::Connect), t0), None);
        assert_eq!(p.record(Err(Failure::Timeout), t0), None);
        assert!(p.healthy());
        assert_eq!(p.record(Err(Failure::Garbage), t0), Some(false));
        assert!(!p.healthy());
        assert_eq!(p.record(Err(Failure::Garbage), t0), None); // once per transition
                                                               // A failure keeps the last values until they are stale (4 x 50 ms).
        let later = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(p.reading(later(150)).kv_usage, Some(0.5));
        assert_eq!(p.reading(later(250)).kv_usage, None);
        let seq = p.seq();
        assert_eq!(p.record(ok.clone(), t0), Some(true));
        assert_eq!(p.seq(), seq + 1);
        assert_eq!(*p.adapters(), vec!["a", "b", "c"]);
        // The same adapters again: the list the request path copied stays.
        let before = p.adapters();
        assert_eq!(p.record(ok, t0), None);
        assert!(Arc::ptr_eq(&before, &p.adapters()));
    }

    #[test]
    fn configure_changes_the_settings_and_keeps_the_state() {
        let p = Probe::new("127.0.0.1:1", Arc::new(spec()), vllm());
        let t0 = Instant::now();
        p.record(read_page(PAGE.as_bytes(), &vllm()), t0);
        for _ in 0..3 {
            p.record(Err(Failure::Connect), t0);
        }
        assert!(!p.healthy());
        let mut slower = spec();
        slower.stale_after = 10;
        slower.unhealthy_after = 1;
        p.configure(&Arc::new(slower));
        // Still unhealthy, its values kept, now stale after 10 x 50 ms.
        let r = p.reading(t0 + Duration::from_millis(400));
        assert_eq!((r.healthy, r.kv_usage), (false, Some(0.5)));
        p.record(read_page(PAGE.as_bytes(), &vllm()), t0);
        assert_eq!(p.record(Err(Failure::Connect), t0), Some(false)); // K = 1 now
    }

    #[test]
    fn path_asks_only_for_the_metrics_read() {
        let p = Probe::new("127.0.0.1:1", Arc::new(spec()), vllm());
        assert_eq!(
            p.path(),
            "/metrics?name%5B%5D=vllm%3Anum_requests_waiting&name%5B%5D=vllm%3Anum_requests_running\
             &name%5B%5D=vllm%3Akv_cache_usage_perc&name%5B%5D=vllm%3Agpu_cache_usage_perc\
             &name%5B%5D=vllm%3Alora_requests_info"
        );
    }

    #[test]
    fn scrapes_run_on_the_scraper_thread_and_stop_with_it() {
        // No runtime here: a scrape that connects ran on the scraper's thread
        // (Linux shows a thread's name cut to 15 bytes).
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = listener.local_addr().expect("addr").to_string();
        let scraper = Scraper::new(Arc::new(Metrics::new()));
        let probe = scraper
            .probe(&endpoint, &Arc::new(spec()), "vllm")
            .expect("probe");
        let threads = || -> Vec<String> {
            std::fs::read_dir("/proc/self/task")
                .map(|d| {
                    d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                        .map(|c| c.trim().to_string())
                        .collect()
                })
                .unwrap_or_default()
        };
        let scraping = || {
            threads()
                .iter()
                .any(|t| !t.is_empty() && THREAD.starts_with(t.as_str()))
        };
        let (_conn, _) = listener.accept().expect("a scrape connects");
        assert!(scraping(), "{:?}", threads());
        scraper.stop();
        assert!(!scraping());
        drop(probe);
    }
}
