//! Flow control's configuration: the bands, their limits, TTLs and
//! policies, and which service class or objective goes to which band. It
//! checks itself; an error names the key (`flow.bands[1].max_requests`).
//!
//! ```json
//! {"bands": [{"name": "guaranteed", "share": 1000},
//!            {"name": "elastic", "share": 100, "fairness": "debt"},
//!            {"name": "spot", "share": 1, "max_requests": 2000, "ttl_s": 5}],
//!  "classes": {"dedicated": "guaranteed", "critical": "guaranteed"},
//!  "default_band": "spot", "max_requests": 10000, "max_bytes": 1000000000,
//!  "ttl_s": 30}
//! ```
//!
//! Bands are listed highest priority first. A request's band is
//! `classes[key]` for its service class or objective name `key`, else the
//! band named `key`, else `default_band` (the last band when absent).
//! `max_requests` and `max_bytes` bound each pool's queue (all bands
//! together); a band's own limits default to the pool's. Limits and TTLs
//! must be > 0: a queue that holds nothing is flow control turned off, which
//! the data plane says by leaving the section out.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::admission::ServiceClass;
use crate::error::{invalid, Result};

/// Most bands of one queue.
pub const MAX_BANDS: usize = 16;
/// Longest band, class or flow name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// The largest request a queue accepts, in bytes (1 TiB: a bound that keeps
/// byte sums far from overflow, not a limit anyone configures).
pub const MAX_REQUEST_BYTES: u64 = 1 << 40;
/// Defaults: the issue's 10,000 waiting requests per pool; the GIE's default
/// band capacity of 1 GB; the GIE guide's request TTL of 30 s.
pub const DEFAULT_MAX_REQUESTS: i64 = 10_000;
pub const DEFAULT_MAX_BYTES: i64 = 1_000_000_000;
pub const DEFAULT_TTL_S: f64 = 30.0;

/// How the flows (tenants, fairness ids) of one band share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fairness {
    /// One request per flow in turn (the GIE's round-robin fairness policy).
    #[default]
    RoundRobin,
    /// The flow that has been served the least cost first, an idle flow's
    /// counter lifted to the least active one when it returns (VTC: Sheng et
    /// al., "Fairness in Serving Large Language Models"; the GIE's
    /// vtc-fairness-policy).
    LeastAttainedService,
    /// Least attained service per unit of the flow's token-pool priority
    /// `w_e` (equation 1 of the paper: class, SLO, burst and debt), so flows
    /// share the band in proportion to `w_e`, and an underserved
    /// entitlement's share grows with its debt.
    Debt,
}

impl Fairness {
    pub fn as_str(self) -> &'static str {
        match self {
            Fairness::RoundRobin => "round-robin",
            Fairness::LeastAttainedService => "least-attained-service",
            Fairness::Debt => "debt",
        }
    }
}

/// The order of requests inside one flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ordering {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Earliest deadline first (the request's arrival plus its SLO target);
    /// requests without one after those with one, first come first served.
    Deadline,
}

impl Ordering {
    pub fn as_str(self) -> &'static str {
        match self {
            Ordering::Fcfs => "fcfs",
            Ordering::Deadline => "deadline",
        }
    }
}

fn one() -> f64 {
    1.0
}

/// One priority band as configured.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandConfig {
    pub name: String,
    /// Its weight in the weighted deficit round robin across bands (the
    /// paper's class weights in [`FlowConfig::service_classes`]).
    #[serde(default = "one")]
    pub share: f64,
    /// None: the pool's.
    #[serde(default)]
    pub max_requests: Option<i64>,
    #[serde(default)]
    pub max_bytes: Option<i64>,
    /// None: the pool's `ttl_s`.
    #[serde(default)]
    pub ttl_s: Option<f64>,
    #[serde(default)]
    pub fairness: Fairness,
    #[serde(default)]
    pub ordering: Ordering,
}

impl BandConfig {
    pub fn new(name: &str, share: f64) -> Self {
        Self {
            name: name.to_owned(),
            share,
            max_requests: None,
            max_bytes: None,
            ttl_s: None,
            fairness: Fairness::default(),
            ordering: Ordering::default(),
        }
    }
}

fn default_max_requests() -> i64 {
    DEFAULT_MAX_REQUESTS
}
fn default_max_bytes() -> i64 {
    DEFAULT_MAX_BYTES
}
fn default_ttl_s() -> f64 {
    DEFAULT_TTL_S
}

/// Flow control of one pool's queue.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowConfig {
    /// Highest priority first.
    pub bands: Vec<BandConfig>,
    /// Service class or objective name -> band name.
    #[serde(default)]
    pub classes: BTreeMap<String, String>,
    /// None: the last band.
    #[serde(default)]
    pub default_band: Option<String>,
    #[serde(default = "default_max_requests")]
    pub max_requests: i64,
    #[serde(default = "default_max_bytes")]
    pub max_bytes: i64,
    #[serde(default = "default_ttl_s")]
    pub ttl_s: f64,
}

/// A band with its limits resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Band {
    pub name: String,
    pub share: f64,
    pub max_requests: u64,
    pub max_bytes: u64,
    pub ttl_s: f64,
    pub fairness: Fairness,
    pub ordering: Ordering,
}

fn check_name(key: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(invalid(format!(
            "{key} must be 1 to {MAX_NAME_BYTES} bytes, got {}",
            name.len()
        )));
    }
    Ok(())
}

fn check_limit(key: &str, v: i64) -> Result<u64> {
    if v < 1 {
        return Err(invalid(format!("{key} must be >= 1, got {v}")));
    }
    Ok(v as u64)
}

fn check_positive(key: &str, v: f64) -> Result<f64> {
    if !(v.is_finite() && v > 0.0) {
        return Err(invalid(format!(
            "{key} must be a finite number > 0, got {v}"
        )));
    }
    Ok(v)
}

impl FlowConfig {
    /// One band per service class of the paper's Table 1, highest first, each
    /// with its class weight as its share (1000, 1000, 100, 1, 0.1) and the
    /// token-pool debt fairness; the last (preemptible) is the default.
    pub fn service_classes() -> Self {
        Self {
            bands: ServiceClass::ALL
                .iter()
                .map(|c| BandConfig {
                    fairness: Fairness::Debt,
                    ..BandConfig::new(c.as_str(), c.weight())
                })
                .collect(),
            classes: BTreeMap::new(),
            default_band: None,
            max_requests: DEFAULT_MAX_REQUESTS,
            max_bytes: DEFAULT_MAX_BYTES,
            ttl_s: DEFAULT_TTL_S,
        }
    }

    /// Parses and checks the JSON form (unknown keys refused).
    pub fn from_json(text: &str) -> Result<Self> {
        let v = serde_json::from_str(text).map_err(|e| invalid(format!("flow: {e}")))?;
        Self::from_value(v)
    }

    /// [`FlowConfig::from_json`] of a parsed value.
    pub fn from_value(v: serde_json::Value) -> Result<Self> {
        let c: Self = serde_json::from_value(v).map_err(|e| invalid(format!("flow: {e}")))?;
        c.check()?;
        Ok(c)
    }

    /// The bands with their limits resolved; every error names its key.
    pub fn resolve(&self) -> Result<Vec<Band>> {
        let max_requests = check_limit("flow.max_requests", self.max_requests)?;
        let max_bytes = check_limit("flow.max_bytes", self.max_bytes)?;
        let ttl_s = check_positive("flow.ttl_s", self.ttl_s)?;
        if self.bands.is_empty() || self.bands.len() > MAX_BANDS {
            return Err(invalid(format!(
                "flow.bands must hold 1 to {MAX_BANDS} bands, got {}",
                self.bands.len()
            )));
        }
        let mut out: Vec<Band> = Vec::with_capacity(self.bands.len());
        for (i, b) in self.bands.iter().enumerate() {
            let key = |k: &str| format!("flow.bands[{i}].{k}");
            check_name(&key("name"), &b.name)?;
            if out.iter().any(|o| o.name == b.name) {
                return Err(invalid(format!(
                    "{}: duplicate band {:?}",
                    key("name"),
                    b.name
                )));
            }
            out.push(Band {
                name: b.name.clone(),
                share: check_positive(&key("share"), b.share)?,
                max_requests: match b.max_requests {
                    Some(v) => check_limit(&key("max_requests"), v)?,
                    None => max_requests,
                },
                max_bytes: match b.max_bytes {
                    Some(v) => check_limit(&key("max_bytes"), v)?,
                    None => max_bytes,
                },
                ttl_s: match b.ttl_s {
                    Some(v) => check_positive(&key("ttl_s"), v)?,
                    None => ttl_s,
                },
                fairness: b.fairness,
                ordering: b.ordering,
            });
        }
        let known = |name: &str| out.iter().any(|b| b.name == name);
        if let Some(d) = &self.default_band {
            if !known(d) {
                return Err(invalid(format!("flow.default_band: unknown band {d:?}")));
            }
        }
        for (class, band) in &self.classes {
            check_name("flow.classes key", class)?;
            if !known(band) {
                return Err(invalid(format!(
                    "flow.classes.{class}: unknown band {band:?}"
                )));
            }
        }
        Ok(out)
    }

    pub fn check(&self) -> Result<()> {
        self.resolve().map(|_| ())
    }

    /// The index of the band a request of service class or objective `key`
    /// waits in (see the module docs); `key` None: the default band.
    pub fn band_of(&self, key: Option<&str>) -> usize {
        let by_name = |name: &str| self.bands.iter().position(|b| b.name == name);
        key.and_then(|k| self.classes.get(k).map(String::as_str).or(Some(k)))
            .and_then(by_name)
            .or_else(|| self.default_band.as_deref().and_then(by_name))
            .unwrap_or(self.bands.len().saturating_sub(1))
    }

    /// The flows (band, fairness id) remembered at once, idle ones
    /// forgotten oldest first: one more than the requests that may wait, so
    /// that an arrival always finds a record (a flow with a request waiting
    /// is never forgotten) while distinct fairness ids sent by clients
    /// cannot grow the table past the pool's own bound.
    pub fn flows_bound(&self) -> u64 {
        self.max_requests.max(1) as u64 + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        match FlowConfig::from_json(text) {
            Err(e) => e.to_string(),
            Ok(c) => panic!("accepted {c:?}"),
        }
    }

    #[test]
    fn bad_values_name_their_key() {
        let band = r#"{"name": "a"}"#;
        for (text, says) in [
            (
                format!(r#"{{"bands": [{band}], "max_requests": 0}}"#),
                "flow.max_requests must be >= 1, got 0",
            ),
            (
                format!(r#"{{"bands": [{band}], "max_bytes": -5}}"#),
                "flow.max_bytes must be >= 1, got -5",
            ),
            (
                format!(r#"{{"bands": [{band}], "ttl_s": 0}}"#),
                "flow.ttl_s must be a finite number > 0, got 0",
            ),
            (
                r#"{"bands": [{"name": "a"}, {"name": "b", "max_requests": -1}]}"#.into(),
                "flow.bands[1].max_requests must be >= 1, got -1",
            ),
            (
                r#"{"bands": [{"name": "a", "ttl_s": 0.0}]}"#.into(),
                "flow.bands[0].ttl_s must be a finite number > 0, got 0",
            ),
            (
                r#"{"bands": [{"name": "a", "share": 0}]}"#.into(),
                "flow.bands[0].share must be a finite number > 0",
            ),
            (
                r#"{"bands": [{"name": "a", "max_bytes": 0}]}"#.into(),
                "flow.bands[0].max_bytes must be >= 1, got 0",
            ),
            (
                r#"{"bands": [{"name": "a"}, {"name": "a"}]}"#.into(),
                "flow.bands[1].name: duplicate band \"a\"",
            ),
            (
                r#"{"bands": [{"name": ""}]}"#.into(),
                "flow.bands[0].name must be 1 to 256 bytes",
            ),
            (
                r#"{"bands": [{"name": "a"}], "default_band": "gold"}"#.into(),
                "flow.default_band: unknown band \"gold\"",
            ),
            (
                r#"{"bands": [{"name": "a"}], "classes": {"spot": "low"}}"#.into(),
                "flow.classes.spot: unknown band \"low\"",
            ),
            (r#"{"bands": []}"#.into(), "flow.bands must hold 1 to 16"),
            (
                r#"{"bands": [{"name": "a", "fairness": "lottery"}]}"#.into(),
                "unknown variant `lottery`",
            ),
            (
                r#"{"bands": [{"name": "a", "ordering": "lifo"}]}"#.into(),
                "unknown variant `lifo`",
            ),
            (
                r#"{"bands": [{"name": "a", "weight": 2}]}"#.into(),
                "unknown field `weight`",
            ),
        ] {
            let got = err(&text);
            assert!(got.contains(says), "{text}: {got}");
        }
    }

    #[test]
    fn limits_default_to_the_pools_and_bands_resolve_by_class() {
        let c = FlowConfig::from_json(
            r#"{"bands": [{"name": "high", "share": 10, "fairness": "debt"},
                          {"name": "low", "max_requests": 3, "ordering": "deadline"}],
                "classes": {"guaranteed": "high"}, "max_requests": 50,
                "max_bytes": 4096, "ttl_s": 2.5}"#,
        )
        .expect("config");
        let bands = c.resolve().expect("bands");
        assert_eq!(
            bands[0],
            Band {
                name: "high".into(),
                share: 10.0,
                max_requests: 50,
                max_bytes: 4096,
                ttl_s: 2.5,
                fairness: Fairness::Debt,
                ordering: Ordering::Fcfs,
            }
        );
        assert_eq!(
            (bands[1].max_requests, bands[1].ordering),
            (3, Ordering::Deadline)
        );
        assert_eq!(c.band_of(Some("guaranteed")), 0);
        assert_eq!(c.band_of(Some("high")), 0);
        assert_eq!(c.band_of(Some("low")), 1);
        assert_eq!(c.band_of(Some("spot")), 1, "the default: the last band");
        assert_eq!(c.band_of(None), 1);
        assert_eq!(c.flows_bound(), 51);
    }

    #[test]
    fn service_classes_are_the_papers_table() {
        let c = FlowConfig::service_classes();
        let bands = c.resolve().expect("bands");
        let shares: Vec<(&str, f64)> = bands.iter().map(|b| (b.name.as_str(), b.share)).collect();
        assert_eq!(
            shares,
            [
                ("dedicated", 1000.0),
                ("guaranteed", 1000.0),
                ("elastic", 100.0),
                ("spot", 1.0),
                ("preemptible", 0.1)
            ]
        );
        assert_eq!(c.band_of(Some("spot")), 3);
        assert_eq!(c.band_of(Some("unknown-objective")), 4);
    }
}
