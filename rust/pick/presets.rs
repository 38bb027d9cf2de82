//! The registry (plugin names -> plugins, with their parameters) and the
//! presets (lists of plugin specs with weights).
//!
//! | name | kind | parameters (defaults) |
//! |---|---|---|
//! | `healthy` | filter | |
//! | `subset-hint` | filter | |
//! | `serves-adapter` | filter | |
//! | `saturation` | filter | `max_waiting` (5), `max_kv_usage` (0.8) |
//! | `least-request` | scorer | |
//! | `queue-depth` | scorer | |
//! | `kv-usage` | scorer | |
//! | `prefix` | scorer | `block_size` (16), `seed` (0), `imbalance_abs_count` (16), `std_factor` (2.0), `capacity_blocks` (200000), `ttl_s` (none) |
//! | `precise-prefix` | scorer | those of `prefix`, for its approximate fallback (the KV-event index is `PickConfig::kv_index`) |
//! | `vtc` | scorer | `window_s` (300), `input_weight` (1), `output_weight` (2), `min_tokens` (1000), `max_tokens` (8000), `fairness_weight` (1), `utilization_weight` (1), `max_endpoint_load` (100), `max_users` (100000) |
//! | `session-affinity` | scorer | `max_sessions` (100000) |
//! | `max-score` | picker | `ties`: `first`, `least-request`, `round-robin` (default) or `random`; `seed` |
//! | `random` | picker | `seed` |
//! | `round-robin` | picker | |
//!
//! A weight matters for scorers only (finite, >= 0). An unknown plugin or
//! parameter name is refused.

use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};

use super::prefix::PrefixScorer;
use super::session::{SessionAffinity, DEFAULT_MAX_SESSIONS};
use super::vtc::VtcScorer;
use super::{Filter, PickConfig, Picker, PluginSpec, Scorer, Ties};
use crate::endpoint::{Saturation, DEFAULT_MAX_KV_USAGE, DEFAULT_MAX_WAITING};
use crate::error::{invalid, Result};
use crate::kv::KvIndex;
use crate::prefix::{PrefixConfig, PrefixIndex, DEFAULT_CAPACITY_BLOCKS};
use crate::vtc::VtcConfig;

/// The presets, by name.
pub const PRESETS: [&str; 9] = [
    "random",
    "round-robin",
    "least-request",
    "queue+kv",
    "prefix",
    "prefix+queue+kv",
    "precise-prefix",
    "precise-prefix+queue+kv",
    "vtc",
];

/// The scorer that reads the engines' KV events (`PickConfig::kv_index`).
pub(super) const PRECISE_PREFIX: &str = "precise-prefix";

/// The filters of every preset: health, the subset hint, the adapter.
const BASE_FILTERS: [&str; 3] = ["healthy", "subset-hint", "serves-adapter"];

/// The plugin specs of a preset:
///
/// - `random`, `round-robin`: the base filters and that picker;
/// - `least-request`: the least-request scorer, ties to the first;
/// - `queue+kv` (the GIE's default): saturation filter, queue-depth and
///   kv-usage scorers (weights 2, 2), ties random;
/// - `prefix` (AIBrix, `PrefixCacheRouter`): the prefix scorer, ties to the
///   least-loaded;
/// - `prefix+queue+kv` (the default): saturation filter, prefix,
///   queue-depth and kv-usage scorers (weights 3, 2, 2, llm-d's), ties random;
/// - `precise-prefix`, `precise-prefix+queue+kv`: `prefix` and
///   `prefix+queue+kv` with the precise-prefix scorer in place of prefix;
/// - `vtc` (`VtcRouter`): the vtc scorer, ties to the first.
pub fn preset_specs(name: &str) -> Result<Vec<PluginSpec>> {
    let ties = |t: &str| PluginSpec::with("max-score", 1.0, serde_json::json!({ "ties": t }));
    let mut specs: Vec<PluginSpec> = BASE_FILTERS
        .iter()
        .map(|f| PluginSpec::new(f, 1.0))
        .collect();
    let rest = match name {
        "random" => vec![PluginSpec::new("random", 1.0)],
        "round-robin" => vec![PluginSpec::new("round-robin", 1.0)],
        "least-request" => vec![PluginSpec::new("least-request", 1.0), ties("first")],
        "queue+kv" => vec![
            PluginSpec::new("saturation", 1.0),
            PluginSpec::new("queue-depth", 2.0),
            PluginSpec::new("kv-usage", 2.0),
            ties("random"),
        ],
        "prefix" => vec![PluginSpec::new("prefix", 1.0), ties("least-request")],
        "prefix+queue+kv" => vec![
            PluginSpec::new("saturation", 1.0),
            PluginSpec::new("prefix", 3.0),
            PluginSpec::new("queue-depth", 2.0),
            PluginSpec::new("kv-usage", 2.0),
            ties("random"),
        ],
        "precise-prefix" => vec![
            PluginSpec::new("precise-prefix", 1.0),
            ties("least-request"),
        ],
        "precise-prefix+queue+kv" => vec![
            PluginSpec::new("saturation", 1.0),
            PluginSpec::new("precise-prefix", 3.0),
            PluginSpec::new("queue-depth", 2.0),
            PluginSpec::new("kv-usage", 2.0),
            ties("random"),
        ],
        "vtc" => vec![PluginSpec::new("vtc", 1.0), ties("first")],
        _ => {
            return Err(invalid(format!(
                "unknown preset {name:?} (presets: {})",
                PRESETS.join(", ")
            )))
        }
    };
    specs.extend(rest);
    Ok(specs)
}

pub(super) enum Plugin {
    Filter(Filter),
    Scorer(Scorer),
    Picker(Picker),
}

/// A spec's parameters, each read once; unknown names are refused.
struct Params<'a> {
    plugin: &'a str,
    map: Map<String, Value>,
}

impl<'a> Params<'a> {
    fn new(spec: &'a PluginSpec) -> Result<Self> {
        let map = match &spec.params {
            Value::Null => Map::new(),
            Value::Object(m) => m.clone(),
            other => {
                return Err(invalid(format!(
                    "params of {:?} must be an object, got {other}",
                    spec.name
                )))
            }
        };
        Ok(Self {
            plugin: &spec.name,
            map,
        })
    }

    fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key).filter(|v| !v.is_null())
    }

    fn f64(&mut self, key: &str, default: f64) -> Result<f64> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.bad(key, &v, "a number")),
        }
    }

    fn opt_f64(&mut self, key: &str) -> Result<Option<f64>> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.bad(key, &v, "a number")),
        }
    }

    fn u64(&mut self, key: &str, default: u64) -> Result<u64> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| self.bad(key, &v, "a non-negative integer")),
        }
    }

    fn usize(&mut self, key: &str, default: usize) -> Result<usize> {
        let v = self.u64(key, default as u64)?;
        usize::try_from(v).map_err(|_| invalid(format!("{}: {key} is too large", self.plugin)))
    }

    fn str(&mut self, key: &str, default: &str) -> Result<String> {
        match self.take(key) {
            None => Ok(default.to_owned()),
            Some(Value::String(s)) => Ok(s),
            Some(v) => Err(self.bad(key, &v, "a string")),
        }
    }

    fn bad(&self, key: &str, v: &Value, want: &str) -> crate::error::Error {
        invalid(format!("{}: {key} must be {want}, got {v}", self.plugin))
    }

    fn finish(self) -> Result<()> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(k) => Err(invalid(format!(
                "unknown parameter {k:?} of plugin {:?}",
                self.plugin
            ))),
        }
    }
}

/// The `prefix` scorer from its parameters (also `precise-prefix`'s, for its
/// approximate fallback); `kv`: the KV-event index of a precise one.
fn prefix_scorer(
    p: &mut Params<'_>,
    config: &PickConfig,
    kv: Option<Arc<KvIndex>>,
) -> Result<PrefixScorer> {
    let block_size = p.usize("block_size", 16)?;
    let seed = p.u64("seed", 0)?;
    let imbalance = p.u64("imbalance_abs_count", 16)?;
    let imbalance = i64::try_from(imbalance)
        .map_err(|_| invalid("prefix: imbalance_abs_count is too large"))?;
    let std_factor = p.f64("std_factor", 2.0)?;
    let capacity = p.usize("capacity_blocks", DEFAULT_CAPACITY_BLOCKS)?;
    let ttl = p.opt_f64("ttl_s")?;
    let prefix = PrefixConfig::new(block_size, imbalance, std_factor, seed)?;
    let index = match &config.prefix_index {
        Some(ix) => Arc::clone(ix),
        None => Arc::new(Mutex::new(PrefixIndex::new(capacity, ttl)?)),
    };
    Ok(PrefixScorer::new(prefix, index, kv))
}

/// The plugin a spec names, with its parameters.
pub(super) fn build(spec: &PluginSpec, config: &PickConfig) -> Result<Plugin> {
    let mut p = Params::new(spec)?;
    let plugin = match spec.name.as_str() {
        "healthy" => Plugin::Filter(Filter::Healthy),
        "subset-hint" => Plugin::Filter(Filter::SubsetHint),
        "serves-adapter" => Plugin::Filter(Filter::ServesAdapter),
        "saturation" => {
            let max_waiting = p.f64("max_waiting", DEFAULT_MAX_WAITING)?;
            let max_kv_usage = p.f64("max_kv_usage", DEFAULT_MAX_KV_USAGE)?;
            let t = Saturation {
                max_waiting,
                max_kv_usage,
            };
            Plugin::Filter(Filter::Saturation(t.check()?))
        }
        "least-request" => Plugin::Scorer(Scorer::LeastRequest),
        "queue-depth" => Plugin::Scorer(Scorer::QueueDepth),
        "kv-usage" => Plugin::Scorer(Scorer::KvUsage),
        "prefix" => Plugin::Scorer(Scorer::Prefix(Box::new(prefix_scorer(
            &mut p, config, None,
        )?))),
        PRECISE_PREFIX => Plugin::Scorer(Scorer::Prefix(Box::new(prefix_scorer(
            &mut p,
            config,
            config.kv_index.clone(),
        )?))),
        "vtc" => {
            let d = VtcConfig::default();
            let c = VtcConfig {
                window_s: p.f64("window_s", d.window_s)?,
                input_weight: p.f64("input_weight", d.input_weight)?,
                output_weight: p.f64("output_weight", d.output_weight)?,
                min_tokens: p.f64("min_tokens", d.min_tokens)?,
                max_tokens: p.f64("max_tokens", d.max_tokens)?,
                fairness_weight: p.f64("fairness_weight", d.fairness_weight)?,
                utilization_weight: p.f64("utilization_weight", d.utilization_weight)?,
                max_endpoint_load: p.f64("max_endpoint_load", d.max_endpoint_load)?,
                max_users: p.usize("max_users", d.max_users)?,
            };
            Plugin::Scorer(Scorer::Vtc(Box::new(VtcScorer::new(c)?)))
        }
        "session-affinity" => Plugin::Scorer(Scorer::SessionAffinity(Box::new(
            SessionAffinity::new(p.usize("max_sessions", DEFAULT_MAX_SESSIONS)?)?,
        ))),
        "max-score" => {
            let ties = match p.str("ties", "round-robin")?.as_str() {
                "first" => Ties::First,
                "least-request" => Ties::LeastRequest,
                "round-robin" => Ties::RoundRobin,
                "random" => Ties::Random {
                    seed: p.u64("seed", config.seed)?,
                },
                other => {
                    return Err(invalid(format!(
                        "max-score: ties must be first, least-request, round-robin or random, got {other:?}"
                    )))
                }
            };
            Plugin::Picker(Picker::MaxScore { ties })
        }
        "random" => Plugin::Picker(Picker::Random {
            seed: p.u64("seed", config.seed)?,
        }),
        "round-robin" => Plugin::Picker(Picker::RoundRobin),
        other => {
            return Err(invalid(format!(
                "unknown plugin {other:?} (filters: healthy, subset-hint, serves-adapter, \
                 saturation; scorers: least-request, queue-depth, kv-usage, prefix, precise-prefix, vtc, \
                 session-affinity; pickers: max-score, random, round-robin)"
            )))
        }
    };
    p.finish()?;
    Ok(plugin)
}

/// The spec as the pipeline keeps it: a random seed taken from the config
/// is written into its parameters, so a snapshot restores the same draws.
pub(super) fn resolved(spec: &PluginSpec, config: &PickConfig) -> PluginSpec {
    let mut spec = spec.clone();
    let random_ties = spec.params.get("ties").and_then(Value::as_str) == Some("random");
    let seeded = spec.name == "random" || (spec.name == "max-score" && random_ties);
    if seeded && spec.params.get("seed").is_none_or(Value::is_null) {
        if spec.params.is_null() {
            spec.params = Value::Object(Map::new());
        }
        if let Value::Object(m) = &mut spec.params {
            m.insert("seed".into(), Value::from(config.seed));
        }
    }
    spec
}
