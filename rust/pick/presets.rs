//! The presets: lists of plugins with weights, by name (the plugins and
//! their parameters are in the registry, `registry.rs`, and their own
//! files). Each starts with the base filters: health, the subset hint, the
//! adapter.

use super::PluginSpec;
use crate::error::{invalid, Result};

/// One preset: its plugins (name, weight) after the base filters, and the
/// max-score picker's ties (None: the plugins end with their own picker).
struct Preset {
    name: &'static str,
    plugins: &'static [(&'static str, f64)],
    ties: Option<&'static str>,
}

/// The GIE's saturation filter and its default scorers (queue depth and
/// KV use, weight 2 each).
const SATURATION: (&str, f64) = ("saturation", 1.0);
const QUEUE: (&str, f64) = ("queue-depth", 2.0);
const KV: (&str, f64) = ("kv-usage", 2.0);

/// The presets:
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
const TABLE: [Preset; 9] = [
    Preset {
        name: "random",
        plugins: &[("random", 1.0)],
        ties: None,
    },
    Preset {
        name: "round-robin",
        plugins: &[("round-robin", 1.0)],
        ties: None,
    },
    Preset {
        name: "least-request",
        plugins: &[("least-request", 1.0)],
        ties: Some("first"),
    },
    Preset {
        name: "queue+kv",
        plugins: &[SATURATION, QUEUE, KV],
        ties: Some("random"),
    },
    Preset {
        name: "prefix",
        plugins: &[("prefix", 1.0)],
        ties: Some("least-request"),
    },
    Preset {
        name: "prefix+queue+kv",
        plugins: &[SATURATION, ("prefix", 3.0), QUEUE, KV],
        ties: Some("random"),
    },
    Preset {
        name: "precise-prefix",
        plugins: &[("precise-prefix", 1.0)],
        ties: Some("least-request"),
    },
    Preset {
        name: "precise-prefix+queue+kv",
        plugins: &[SATURATION, ("precise-prefix", 3.0), QUEUE, KV],
        ties: Some("random"),
    },
    Preset {
        name: "vtc",
        plugins: &[("vtc", 1.0)],
        ties: Some("first"),
    },
];

/// The presets' names, in the table's order.
pub const PRESETS: [&str; TABLE.len()] = {
    let mut names = [""; TABLE.len()];
    let mut i = 0;
    while i < TABLE.len() {
        names[i] = TABLE[i].name;
        i += 1;
    }
    names
};

/// The filters of every preset: health, the subset hint, the adapter.
const BASE_FILTERS: [&str; 3] = ["healthy", "subset-hint", "serves-adapter"];

/// The plugin specs of a preset (see [`TABLE`]); an unknown name is refused
/// with the known ones.
pub fn preset_specs(name: &str) -> Result<Vec<PluginSpec>> {
    let preset = TABLE.iter().find(|p| p.name == name).ok_or_else(|| {
        invalid(format!(
            "unknown preset {name:?} (presets: {})",
            PRESETS.join(", ")
        ))
    })?;
    let base = BASE_FILTERS.iter().map(|&f| (f, 1.0));
    let mut specs: Vec<PluginSpec> = base
        .chain(preset.plugins.iter().copied())
        .map(|(n, w)| PluginSpec::new(n, w))
        .collect();
    if let Some(t) = preset.ties {
        specs.push(PluginSpec::with(
            "max-score",
            1.0,
            serde_json::json!({ "ties": t }),
        ));
    }
    Ok(specs)
}
