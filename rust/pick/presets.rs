//! The presets: lists of plugin specs with weights (the plugins and their
//! parameters are in the registry, `registry.rs`, and their own files).

use super::PluginSpec;
use crate::error::{invalid, Result};

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
