//! The engines' state: every endpoint's Prometheus `/metrics`, scraped on the
//! data plane's runtime.
//!
//! One [`Probe`] per endpoint (shared by every engine of the data plane that
//! lists it with the same settings) polls `GET /metrics?name[]=...` every
//! `interval_s` over a kept-alive HTTP/1 connection, asking only for the
//! metrics it reads (prometheus_client's `name[]` filter, which vLLM's
//! exposition honours). Engines that ignore the filter send the whole page:
//! lines of other metrics are skipped before parsing, and the few kept are
//! parsed by `prom_text_format_parser`.
//!
//! A scrape fails when the endpoint refuses the connection, does not answer
//! within `timeout_s`, answers a status other than 200, a page over
//! `max_page_bytes`, or a page that is not the exposition format or has none
//! of the metrics read (garbage). Each outcome is counted
//! (`routecore_scrapes{endpoint, outcome}`); `unhealthy_after` failures in a
//! row make the endpoint unhealthy, the next success healthy again (a
//! `endpoint-unhealthy` / `endpoint-healthy` log event and
//! `routecore_endpoint_transitions{endpoint, to}` each way). A failed scrape
//! changes nothing else: the last values stay until they are older than
//! `stale_after` intervals, then they are unknown ([`Probe::reading`]).
//!
//! The readings are atomics: the request path reads them without a lock,
//! and notices a new scrape by its sequence number.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::Deserialize;

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
        if self.unhealthy_after == 0 || self.stale_after == 0 || self.max_page_bytes == 0 {
            return Err(invalid(
                "scrape.unhealthy_after, stale_after and max_page_bytes must be >= 1",
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

/// Does `line` hold a sample of one of `names`? (Comments are skipped: the
/// parser reads the kept samples as untyped values.)
fn wanted(line: &[u8], names: &EngineMetrics) -> bool {
    names.names().any(|n| {
        line.strip_prefix(n.as_bytes())
            .is_some_and(|rest| matches!(rest.first(), Some(b'{' | b' ' | b'\t')))
    })
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
    fn new(names: &EngineMetrics) -> Self {
        let mut heads = Vec::new();
        for n in names.names() {
            match head(n.as_bytes()) {
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

/// Reads one metrics page: keeps the lines of the metrics read (one pass,
/// newlines found with `memchr`, most lines skipped by [`Heads`]), parses them with the
/// exposition-format library and sums each quantity over its series (an
/// engine with several data-parallel ranks reports one series per rank; KV
/// use is their mean). Garbage: not the exposition format, or none of the
/// metrics read.
pub fn read_page(page: &[u8], names: &EngineMetrics) -> std::result::Result<Reading, Failure> {
    let heads = Heads::new(names);
    let mut kept = Vec::new();
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', page).chain(std::iter::once(page.len()));
    for end in ends {
        let line = &page[start..end];
        start = end + 1;
        if heads.may_be(line) && wanted(line, names) {
            kept.extend_from_slice(line.strip_suffix(b"\r").unwrap_or(line));
            kept.push(b'\n');
        }
    }
    let kept = String::from_utf8(kept).map_err(|_| Failure::Garbage)?;
    if kept.is_empty() {
        return Err(Failure::Garbage);
    }
    let scrape = prom_text_format_parser::Scrape::parse(&kept).map_err(|_| Failure::Garbage)?;
    let series = |name: &str| -> Option<Vec<f64>> {
        let m = scrape.metrics.iter().find(|m| m.name == name)?;
        let values: Vec<f64> = m
            .samples
            .iter()
            .map(|s| s.value.value.as_f64())
            .filter(|v| v.is_finite())
            .collect();
        (!values.is_empty()).then_some(values)
    };
    let first = |list: &[String]| list.iter().find_map(|n| series(n));
    let sum = |v: Vec<f64>| v.iter().sum::<f64>();
    let reading = Reading {
        waiting: first(&names.waiting).map(sum),
        running: first(&names.running).map(sum),
        kv_usage: first(&names.kv_usage).map(|v| (sum(v.clone()) / v.len() as f64).clamp(0.0, 1.0)),
        adapters: names.adapters.as_deref().and_then(|n| adapters(&scrape, n)),
    };
    if reading == Reading::default() {
        return Err(Failure::Garbage);
    }
    Ok(reading)
}

/// The adapters of the latest LoRA info sample (its value is a timestamp):
/// running and waiting, comma-separated label values.
fn adapters(scrape: &prom_text_format_parser::Scrape, name: &str) -> Option<Vec<String>> {
    let m = scrape.metrics.iter().find(|m| m.name == name)?;
    let latest = m
        .samples
        .iter()
        .max_by(|a, b| a.value.value.as_f64().total_cmp(&b.value.value.as_f64()))?;
    let mut out: Vec<String> = Vec::new();
    for key in ["running_lora_adapters", "waiting_lora_adapters"] {
        if let Some(l) = latest.labels.iter().find(|l| l.key == key) {
            for a in l.value.split(',').map(str::trim).filter(|a| !a.is_empty()) {
                if !out.iter().any(|o| o == a) {
                    out.push(a.to_string());
                }
            }
        }
    }
    Some(out)
}

const UNKNOWN: u64 = u64::MAX;

/// The latest state of one endpoint, written by its scrape task, read
/// lock-free by the request path (values as f64 bits; [`UNKNOWN`]: absent).
pub struct Probe {
    pub endpoint: String,
    spec: Arc<ScrapeSpec>,
    names: EngineMetrics,
    waiting: AtomicU64,
    running: AtomicU64,
    kv_usage: AtomicU64,
    adapters: Mutex<Option<Arc<Vec<String>>>>,
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
            spec,
            names,
            waiting: AtomicU64::new(UNKNOWN),
            running: AtomicU64::new(UNKNOWN),
            kv_usage: AtomicU64::new(UNKNOWN),
            adapters: Mutex::new(None),
            scraped_at: AtomicU64::new(UNKNOWN),
            seq: AtomicU64::new(0),
            // Healthy until it fails `unhealthy_after` scrapes in a row.
            healthy: AtomicBool::new(true),
            failures: AtomicU32::new(0),
            epoch: Instant::now(),
        }
    }

    fn nanos(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX - 1)
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
            && self.nanos(now).saturating_sub(at)
                <= u64::try_from(self.spec.max_age().as_nanos()).unwrap_or(u64::MAX);
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
        self.adapters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
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
                    *self.adapters.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(a));
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
                if n >= self.spec.unhealthy_after && self.healthy.swap(false, Ordering::AcqRel) {
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

/// The scrape tasks of one data plane: one probe per (endpoint, settings),
/// alive while an engine holds it.
pub struct Scraper {
    probes: Mutex<HashMap<(String, EngineMetrics), Weak<Probe>>>,
    metrics: Arc<Metrics>,
    handle: tokio::runtime::Handle,
}

impl Scraper {
    pub fn new(metrics: Arc<Metrics>, handle: tokio::runtime::Handle) -> Self {
        Self {
            probes: Mutex::new(HashMap::new()),
            metrics,
            handle,
        }
    }

    /// The probe of `endpoint` read as `engine`, started when no engine of the
    /// data plane scrapes it with these settings yet.
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
            if *p.spec == **spec {
                return Ok(p);
            }
        }
        let probe = Arc::new(Probe::new(endpoint, Arc::clone(spec), names));
        probes.insert(key, Arc::downgrade(&probe));
        self.metrics.endpoint_health(endpoint, true, false);
        self.handle
            .spawn(run(Arc::downgrade(&probe), Arc::clone(&self.metrics)));
        Ok(probe)
    }
}

type Conn = SendRequest<Empty<Bytes>>;

const READ_BUF: usize = 64 << 10;

/// One GET over the kept-alive connection (opened when there is none).
async fn fetch(
    conn: &mut Option<Conn>,
    endpoint: &str,
    path: &str,
    max: usize,
) -> std::result::Result<Bytes, Failure> {
    let mut sender = match conn.take() {
        Some(c) if !c.is_closed() => c,
        _ => {
            let stream = tokio::net::TcpStream::connect(endpoint)
                .await
                .map_err(|_| Failure::Connect)?;
            let _ = stream.set_nodelay(true);
            // Reads of 64 KiB: a whole page in one read, one body chunk.
            let (sender, driver) = hyper::client::conn::http1::Builder::new()
                .read_buf_exact_size(Some(READ_BUF))
                .handshake(TokioIo::new(stream))
                .await
                .map_err(|_| Failure::Connect)?;
            tokio::spawn(async move {
                let _ = driver.await;
            });
            sender
        }
    };
    sender.ready().await.map_err(|_| Failure::Connect)?;
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, endpoint)
        .body(Empty::<Bytes>::new())
        .map_err(|_| Failure::Connect)?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|_| Failure::Connect)?;
    if resp.status() != hyper::StatusCode::OK {
        return Err(Failure::Status);
    }
    let body = Limited::new(resp.into_body(), max)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                Failure::TooLarge
            } else {
                Failure::Connect
            }
        })?
        .to_bytes();
    *conn = Some(sender);
    Ok(body)
}

/// Scrapes one endpoint every interval until its probe is dropped.
async fn run(probe: Weak<Probe>, metrics: Arc<Metrics>) {
    let (endpoint, path, spec) = match probe.upgrade() {
        Some(p) => (p.endpoint.clone(), p.path(), Arc::clone(&p.spec)),
        None => return,
    };
    let max = usize::try_from(spec.max_page_bytes).unwrap_or(usize::MAX);
    // Spread the endpoints' scrapes over the interval.
    let offset = xxhash_rust::xxh3::xxh3_64(endpoint.as_bytes()) % 1000;
    tokio::time::sleep(spec.interval().mul_f64(offset as f64 / 1000.0)).await;
    let mut ticker = tokio::time::interval(spec.interval());
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut conn: Option<Conn> = None;
    let outcomes = metrics.scrape_counters(&endpoint);
    loop {
        ticker.tick().await;
        let Some(p) = probe.upgrade() else { return };
        let page = tokio::time::timeout(
            Duration::from_secs_f64(spec.timeout_s),
            fetch(&mut conn, &endpoint, &path, max),
        )
        .await
        .unwrap_or(Err(Failure::Timeout));
        let outcome = page.and_then(|b| read_page(&b, &p.names));
        if outcome.is_err() {
            conn = None;
        }
        outcomes.count(outcome.as_ref().err().map(|f| f.label()));
        if let Err(f) = outcome {
            tracing::debug!(
                endpoint = endpoint.as_str(),
                outcome = f.label(),
                "scrape-failed"
            );
        }
        if let Some(up) = p.record(outcome, Instant::now()) {
            metrics.endpoint_health(&endpoint, up, true);
            if up {
                tracing::info!(endpoint = endpoint.as_str(), "endpoint-healthy");
            } else {
                tracing::warn!(
                    endpoint = endpoint.as_str(),
                    failures = spec.unhealthy_after,
                    "endpoint-unhealthy"
                );
            }
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
            engines: [("vllm".to_string(), vllm())].into(),
        }
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
        assert_eq!(
            p.reading(t0 + Duration::from_millis(150)).kv_usage,
            Some(0.5)
        );
        assert_eq!(p.reading(t0 + Duration::from_millis(250)).kv_usage, None);
        let seq = p.seq();
        assert_eq!(p.record(ok, t0), Some(true));
        assert_eq!(p.seq(), seq + 1);
        assert_eq!(*p.adapters(), vec!["a", "b", "c"]);
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
}
