//! Endpoint basics, a leaf every layer reads: string names at the API,
//! dense indices inside ([`EndpointSet`]), the limits on both, what is known
//! of each endpoint at decision time ([`EndpointState`]) and the saturation
//! signal ([`Saturation`]: the picker's soft filter, the data plane's
//! shedding of sheddable requests and flow control's detector read the
//! same thresholds).
//!
//! The states are a `Vec<EndpointState>` owned by the pool picker
//! (`crate::pick::PoolPicker`), one per endpoint in set order. Counts of
//! requests in flight are either kept by the picker (one more on `start`,
//! one less on `complete`) or set wholesale from telemetry (`set_in_flight`).

use serde::Deserialize;

use crate::error::{invalid, non_negative, not_in_flight, unknown, Error, Result};
use crate::snapshot::{Reader, Writer};

/// Most endpoints one set holds.
pub const MAX_ENDPOINTS: usize = 4096;
/// Longest endpoint name, in bytes.
pub const MAX_ENDPOINT_NAME_BYTES: usize = 256;
/// Largest in-flight count accepted from telemetry: more marks corrupt input.
pub const MAX_IN_FLIGHT: i64 = 1 << 32;

/// Checks an endpoint name: 1 to `MAX_ENDPOINT_NAME_BYTES` bytes.
pub fn check_endpoint_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_ENDPOINT_NAME_BYTES {
        return Err(invalid(format!(
            "endpoint name must be 1 to {MAX_ENDPOINT_NAME_BYTES} bytes, got {} bytes",
            name.len()
        )));
    }
    Ok(())
}

/// What the picker knows about one endpoint at decision time.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointState {
    /// False: filtered out by `healthy` (scraper / health checks).
    pub healthy: bool,
    /// routecore's own dispatches not completed yet.
    pub in_flight: u64,
    /// Dispatches since the last scrape still in flight, added to `waiting`
    /// until the next scrape (at most `in_flight`: one that ended is in no
    /// queue).
    pub dispatched_since_scrape: u32,
    /// Engine queue (`vllm:num_requests_waiting`); None = unknown or stale.
    pub waiting: Option<f64>,
    /// Requests the engine runs (`vllm:num_requests_running`).
    pub running: Option<f64>,
    /// KV-cache use in [0, 1] (`vllm:kv_cache_usage_perc`).
    pub kv_usage: Option<f64>,
    /// LoRA adapters it serves (`vllm:lora_requests_info`); empty = base only.
    pub adapters: Vec<String>,
}

impl Default for EndpointState {
    /// Healthy, idle, nothing scraped yet.
    fn default() -> Self {
        Self {
            healthy: true,
            in_flight: 0,
            dispatched_since_scrape: 0,
            waiting: None,
            running: None,
            kv_usage: None,
            adapters: Vec::new(),
        }
    }
}

impl EndpointState {
    /// A request dispatched here: one more in flight, and dispatched since
    /// the last scrape.
    pub fn start_one(&mut self) {
        self.in_flight += 1;
        self.dispatched_since_scrape = self.dispatched_since_scrape.saturating_add(1);
    }

    /// A request here ended: one fewer in flight (refused when none is).
    /// The dispatches since the scrape are kept at most the requests in
    /// flight: which request ended is not known, but one that ended waits
    /// in no queue, so counting it would take a pool of fast engines for
    /// saturated (2 endpoints, a queue limit of 5 and a 50 ms scrape would
    /// cap the pool at 200 requests a second).
    pub fn finish_one(&mut self) -> Option<()> {
        self.set_in_flight_to(self.in_flight.checked_sub(1)?);
        Some(())
    }

    /// `n` requests in flight here, the dispatches since the scrape kept at
    /// most that many (see [`EndpointState::finish_one`]).
    pub fn set_in_flight_to(&mut self, n: u64) {
        self.in_flight = n;
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.dispatched_since_scrape = self.dispatched_since_scrape.min(n);
    }

    /// The requests an endpoint holds, the one load measure of the picker
    /// (least-request, the prefix guards, VTC's utilization): the engine's
    /// `waiting + running` plus the dispatches since that scrape when both
    /// are known, else routecore's own `in_flight`.
    pub fn load(&self) -> f64 {
        match (self.waiting, self.running) {
            (Some(w), Some(r)) => w + r + f64::from(self.dispatched_since_scrape),
            _ => self.in_flight as f64,
        }
    }

    pub fn write(&self, w: &mut Writer) {
        w.u8(u8::from(self.healthy))
            .u64(self.in_flight)
            .u32(self.dispatched_since_scrape);
        for x in [self.waiting, self.running, self.kv_usage] {
            match x {
                Some(v) => w.u8(1).f64(v),
                None => w.u8(0).f64(0.0),
            };
        }
        w.u64(self.adapters.len() as u64);
        for a in &self.adapters {
            w.str(a);
        }
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self> {
        let healthy = match r.u8()? {
            0 => false,
            1 => true,
            b => return Err(Error::Snapshot(format!("bad health flag {b}"))),
        };
        let in_flight = r.u64()?;
        let dispatched_since_scrape = r.u32()?;
        let mut metric = || -> Result<Option<f64>> {
            match (r.u8()?, r.f64()?) {
                (0, _) => Ok(None),
                (1, v) if v.is_finite() && v >= 0.0 => Ok(Some(v)),
                _ => Err(Error::Snapshot("bad metric".into())),
            }
        };
        let (waiting, running, kv_usage) = (metric()?, metric()?, metric()?);
        let n = r.count(4)?;
        let mut adapters = Vec::with_capacity(n);
        for _ in 0..n {
            adapters.push(r.str()?);
        }
        Ok(Self {
            healthy,
            in_flight,
            dispatched_since_scrape,
            waiting,
            running,
            kv_usage,
            adapters,
        })
    }

    /// The engine's queue plus the dispatches since that scrape; routecore's
    /// `in_flight` while the queue is unknown.
    pub fn queue(&self) -> f64 {
        match self.waiting {
            Some(w) => w + f64::from(self.dispatched_since_scrape),
            None => self.in_flight as f64,
        }
    }
}

/// The GIE's default saturation thresholds: a queue of 5, 80% KV-cache use.
pub const DEFAULT_MAX_WAITING: f64 = 5.0;
pub const DEFAULT_MAX_KV_USAGE: f64 = 0.8;

fn default_max_waiting() -> f64 {
    DEFAULT_MAX_WAITING
}

fn default_max_kv_usage() -> f64 {
    DEFAULT_MAX_KV_USAGE
}

/// When an endpoint is saturated (the GIE's saturation detector): its
/// engine queue (scraped waiting requests plus the dispatches since that
/// scrape) above `max_waiting`, or its KV-cache use above `max_kv_usage`.
/// Unknown values are not saturated.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Saturation {
    #[serde(default = "default_max_waiting")]
    pub max_waiting: f64,
    #[serde(default = "default_max_kv_usage")]
    pub max_kv_usage: f64,
}

impl Default for Saturation {
    fn default() -> Self {
        Self {
            max_waiting: DEFAULT_MAX_WAITING,
            max_kv_usage: DEFAULT_MAX_KV_USAGE,
        }
    }
}

impl Saturation {
    /// Checks the thresholds: `max_waiting` >= 0, `max_kv_usage` in [0, 1].
    pub fn check(self) -> Result<Self> {
        non_negative("max_waiting", self.max_waiting)?;
        if !(0.0..=1.0).contains(&self.max_kv_usage) {
            return Err(invalid(format!(
                "max_kv_usage must be in [0, 1], got {}",
                self.max_kv_usage
            )));
        }
        Ok(self)
    }

    /// Whether `s` is above either threshold.
    pub fn saturated(&self, s: &EndpointState) -> bool {
        let queue = s.waiting.map(|w| w + f64::from(s.dispatched_since_scrape));
        queue.is_some_and(|q| q > self.max_waiting)
            || s.kv_usage.is_some_and(|k| k > self.max_kv_usage)
    }
}

/// Checks in-flight counts from telemetry (one per endpoint) without setting them.
pub fn check_in_flight(states: &[EndpointState], counts: &[i64]) -> Result<()> {
    if counts.len() != states.len() {
        return Err(invalid(format!(
            "running has {} counts for {} endpoints",
            counts.len(),
            states.len()
        )));
    }
    if let Some(c) = counts.iter().find(|&&c| !(0..=MAX_IN_FLIGHT).contains(&c)) {
        return Err(invalid(format!(
            "running counts must be in [0, {MAX_IN_FLIGHT}], got {c}"
        )));
    }
    Ok(())
}

/// Overwrites every endpoint's in-flight count (in set order) from telemetry.
pub fn set_in_flight(states: &mut [EndpointState], counts: &[i64]) -> Result<()> {
    check_in_flight(states, counts)?;
    for (s, &c) in states.iter_mut().zip(counts) {
        s.set_in_flight_to(c as u64);
    }
    Ok(())
}

/// Ends one request in flight on endpoint `name` (its state); refused when
/// none is.
pub fn complete_one(state: &mut EndpointState, name: &str) -> Result<()> {
    state.finish_one().ok_or_else(|| {
        not_in_flight(format!(
            "complete: endpoint {name:?} has no request in flight"
        ))
    })
}

/// Endpoint names in order, distinct and valid.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EndpointSet {
    names: Vec<String>,
}

impl EndpointSet {
    /// Endpoints in the given order; names must be valid and distinct.
    pub fn new<S: AsRef<str>>(names: &[S]) -> Result<Self> {
        let mut set = Self::default();
        for name in names {
            set.add(name.as_ref())?;
        }
        Ok(set)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The index of `name` (a linear scan: pools hold tens of endpoints).
    pub fn index(&self, name: &str) -> Result<usize> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| unknown("endpoint", name))
    }

    /// Checks that `name` may be added.
    pub fn check_add(&self, name: &str) -> Result<()> {
        check_endpoint_name(name)?;
        if self.names.iter().any(|n| n == name) {
            return Err(invalid(format!("endpoint {name:?} is already present")));
        }
        if self.names.len() >= MAX_ENDPOINTS {
            return Err(invalid(format!("at most {MAX_ENDPOINTS} endpoints")));
        }
        Ok(())
    }

    /// Appends an endpoint; returns its index.
    pub fn add(&mut self, name: &str) -> Result<usize> {
        self.check_add(name)?;
        self.names.push(name.to_owned());
        Ok(self.names.len() - 1)
    }

    /// Removes an endpoint; the ones after it move down one index. Returns
    /// the index it had.
    pub fn remove(&mut self, name: &str) -> Result<usize> {
        let i = self.index(name)?;
        self.names.remove(i);
        Ok(i)
    }

    pub fn write(&self, w: &mut Writer) {
        w.u64(self.names.len() as u64);
        for name in &self.names {
            w.str(name);
        }
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self> {
        let n = r.count(5)?;
        let mut set = Self::default();
        for _ in 0..n {
            // A bad name is reported as a bad snapshot by `snapshot::restore`.
            set.add(&r.str()?)?;
        }
        Ok(set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_counts_and_errors() {
        let mut e = EndpointSet::new(&["a", "b", "c"]).expect("endpoints");
        let mut states = vec![EndpointState::default(); 3];
        set_in_flight(&mut states, &[3, 1, 1]).expect("set");
        assert_eq!(states[1].load(), 1.0);
        assert!(set_in_flight(&mut states, &[1, 2]).is_err());
        assert!(set_in_flight(&mut states, &[1, -2, 0]).is_err());
        assert!(set_in_flight(&mut states, &[1, MAX_IN_FLIGHT + 1, 0]).is_err());
        assert_eq!(states[0].in_flight, 3);
        assert!(e.add("a").is_err());
        assert!(e.add("").is_err());
        assert!(e.add(&"x".repeat(257)).is_err());
        assert_eq!(e.index("zz"), Err(unknown("endpoint", "zz")));
        assert_eq!(e.remove("b"), Ok(1));
        assert_eq!(e.names(), &["a".to_owned(), "c".to_owned()]);

        let mut w = Writer::new(b"TEST", 1);
        e.write(&mut w);
        let bytes = w.finish();
        let mut r = Reader::new(&bytes, b"TEST", 1, "test").expect("header");
        assert_eq!(EndpointSet::read(&mut r), Ok(e));
        assert!(r.finish().is_ok());
    }

    #[test]
    fn load_adds_own_dispatches_to_the_scraped_queue() {
        let mut s = EndpointState {
            in_flight: 7,
            ..EndpointState::default()
        };
        assert_eq!((s.load(), s.queue()), (7.0, 7.0), "nothing scraped");
        s.waiting = Some(2.0);
        s.running = Some(3.0);
        s.dispatched_since_scrape = 4;
        assert_eq!((s.load(), s.queue()), (9.0, 6.0));
    }

    #[test]
    fn ended_requests_leave_the_dispatches_since_the_scrape() {
        // Fast engines: each request ends before the next scrape.
        let mut s = EndpointState {
            waiting: Some(0.0),
            running: Some(0.0),
            ..EndpointState::default()
        };
        for _ in 0..100 {
            s.start_one();
            s.finish_one().expect("in flight");
        }
        assert_eq!((s.dispatched_since_scrape, s.queue()), (0, 0.0));
        // Two requests from before the scrape, three after: the old ones
        // ending leave the three counted, the next two ending leave one.
        s.in_flight = 2;
        for _ in 0..3 {
            s.start_one();
        }
        s.finish_one().expect("in flight");
        s.finish_one().expect("in flight");
        assert_eq!((s.in_flight, s.dispatched_since_scrape), (3, 3));
        s.finish_one().expect("in flight");
        s.finish_one().expect("in flight");
        assert_eq!((s.in_flight, s.dispatched_since_scrape), (1, 1));
        s.finish_one().expect("in flight");
        assert_eq!(s.finish_one(), None, "none left");
        assert_eq!((s.in_flight, s.dispatched_since_scrape), (0, 0));
    }
}
