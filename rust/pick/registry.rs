//! The registry: every plugin's description ([`Describe`], given by its own
//! file), in the order docs/picker.md's plugin table lists them. A new
//! plugin is one file and one line here.

use serde_json::{Map, Value};

use super::plugin::{Built, Describe, Kind, Needs, Shared};
use super::{adapter, healthy, kv_usage, least_request, lora_affinity, max_score, prefix, queue};
use super::{random, round_robin, saturation, session, subset, vtc, PickConfig, PluginSpec};
use crate::error::{invalid, Result};

/// Every plugin, filters first, then scorers, then pickers.
pub static REGISTRY: &[&Describe] = &[
    &healthy::PLUGIN,
    &subset::PLUGIN,
    &adapter::PLUGIN,
    &saturation::PLUGIN,
    &least_request::PLUGIN,
    &queue::PLUGIN,
    &kv_usage::PLUGIN,
    &prefix::PREFIX,
    &prefix::PRECISE_PREFIX,
    &vtc::PLUGIN,
    &session::PLUGIN,
    &lora_affinity::PLUGIN,
    &max_score::PLUGIN,
    &random::PLUGIN,
    &round_robin::PLUGIN,
];

/// The plugin named `name`; an unknown name is refused with the known ones.
pub fn describe(name: &str) -> Result<&'static Describe> {
    REGISTRY
        .iter()
        .copied()
        .find(|d| d.name == name)
        .ok_or_else(|| invalid(format!("unknown plugin {name:?} ({})", known())))
}

/// The known plugins by kind: "filters: ...; scorers: ...; pickers: ...".
fn known() -> String {
    let of = |f: fn(Kind) -> bool| {
        REGISTRY
            .iter()
            .filter(|d| f(d.kind))
            .map(|d| d.name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "filters: {}; scorers: {}; pickers: {}",
        of(|k| matches!(k, Kind::Filter { .. })),
        of(|k| k == Kind::Scorer),
        of(|k| k == Kind::Picker)
    )
}

/// What the plugins of `specs` read, together (unknown names read nothing).
pub fn needs(specs: &[PluginSpec]) -> Needs {
    specs
        .iter()
        .filter_map(|s| describe(&s.name).ok())
        .fold(Needs::NOTHING, |a, d| Needs {
            scraped: a.scraped || d.needs.scraped,
            hashes: a.hashes || d.needs.hashes,
            token_ids: a.token_ids || d.needs.token_ids,
            kv_index: a.kv_index || d.needs.kv_index,
        })
}

/// Sets in `specs` the parameters each plugin takes from the data plane's
/// shared settings (their description's `shared`).
pub fn apply_shared(specs: &mut [PluginSpec], shared: &Shared) {
    for s in specs {
        if let Some(f) = describe(&s.name).ok().and_then(|d| d.shared) {
            s.params = f(shared);
        }
    }
}

/// The spec's parameters as an object without nulls (a null is the default).
fn object(spec: &PluginSpec) -> Result<Map<String, Value>> {
    match &spec.params {
        Value::Null => Ok(Map::new()),
        Value::Object(m) => Ok(m
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()),
        other => Err(invalid(format!(
            "params of {:?} must be an object, got {other}",
            spec.name
        ))),
    }
}

/// The plugin spec `i` of a pipeline names, with its parameters; errors
/// name the plugin and the key (`plugins[i] "name": key: ...`).
pub(super) fn build(i: usize, spec: &PluginSpec, config: &PickConfig) -> Result<(Kind, Built)> {
    let d = describe(&spec.name)?;
    let params = object(spec)?;
    let built = (d.build)(&Value::Object(params), config)
        .map_err(|e| invalid(format!("plugins[{i}] {:?}: {e}", spec.name)))?;
    Ok((d.kind, built))
}

/// The spec as the pipeline keeps it: what the plugin takes from the config
/// (a random seed) written into its parameters.
pub(super) fn resolved(spec: &PluginSpec, config: &PickConfig) -> PluginSpec {
    let mut spec = spec.clone();
    let Some(f) = describe(&spec.name).ok().and_then(|d| d.resolve) else {
        return spec;
    };
    let mut m = match &spec.params {
        Value::Object(m) => m.clone(),
        Value::Null => Map::new(),
        _ => return spec,
    };
    f(&mut m, config);
    if !(spec.params.is_null() && m.is_empty()) {
        spec.params = Value::Object(m);
    }
    spec
}

#[cfg(test)]
mod tests;
