//! The data plane's configuration: the JSON spec the Python control plane
//! produces from a validated `routecore serve` file (`routecore.config`).
//! Python validates and names the bad key; this side only re-checks what the
//! cores check anyway (pools, policies) and refuses anything malformed.
//!
//! [`Spec`] composes the sections: the engine's own (`server`, `router`,
//! `pools`, `tenants`, `models`) are here, every other one lives beside the
//! module it configures and checks itself there (`limits`:
//! [`LimitsSpec`] in `serve::limits`; `scrape`: `serve::scrape`;
//! `kv_events`: `serve::kv_events`; `autoscale`: `serve::autoscale`;
//! `flow_control`: `serve::flow`; `admission`: `serve::admission`, read
//! from its JSON value), and the one [`FailureMode`] in `serve::failure`
//! (a leaf: the front door and admission read it). A module a section's
//! type lives in never imports this one back (the autoscaler reads the
//! pools and tenants it needs as `autoscale::PlanePool`s and entitlements).

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;

use super::autoscale::AutoscaleSpec;
use super::failure::FailureMode;
use super::flow::FlowSpec;
use super::kv_events::KvEventsSpec;
use super::limits::LimitsSpec;
use super::scrape::ScrapeSpec;
use crate::endpoint::Saturation;
use crate::error::{invalid, Result};
use crate::tokenize::Tokenizer;

#[cfg(test)]
pub(crate) mod testing;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    pub key_header: String,
    pub failure_mode: FailureMode,
    pub default_pool: String,
    /// Request headers removed before the request leaves for the engine,
    /// beside the key header (which always is), lower case.
    #[serde(default)]
    pub strip_headers: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterSpec {
    /// The endpoint picker's preset (`crate::pick::PRESETS`).
    pub policy: String,
    pub compress_band: Option<f64>,
    pub prefix_block_size: usize,
    /// Endpoints offered after the chosen one, for Envoy's retries.
    #[serde(default = "default_fallbacks")]
    pub fallbacks: usize,
    /// Queue and KV-cache use above which an endpoint is saturated: the
    /// pipeline's saturation filter, and sheddable requests (priority < 0)
    /// are refused with 429 when every endpoint is.
    #[serde(default)]
    pub saturation: Saturation,
    /// Priority by objective name (`x-gateway-inference-objective`).
    #[serde(default)]
    pub objectives: HashMap<String, i64>,
}

fn default_fallbacks() -> usize {
    2
}

fn default_engine() -> String {
    "vllm".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: String,
    pub max_context: u64,
    pub budget: Option<u64>,
    pub queue_limit: Option<u64>,
    pub endpoints: Vec<String>,
    /// The engine kind whose metric names its endpoints are read with.
    #[serde(default = "default_engine")]
    pub engine: String,
    /// The models (base) and LoRA adapters the pool serves; both empty: any model.
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default)]
    pub adapters: Vec<String>,
    /// Prefill/decode disaggregation (`crate::pd`): every endpoint's role
    /// (`role`, or its entry in `roles`) and the decider.
    #[serde(default)]
    pub role: crate::pd::Role,
    #[serde(default)]
    pub roles: HashMap<String, crate::pd::Role>,
    #[serde(default)]
    pub disaggregation: Option<crate::pd::DisaggregationSpec>,
}

impl PoolSpec {
    /// Whether a request for `model` (None: names none) may go to this pool.
    pub fn serves(&self, model: Option<&str>) -> bool {
        let any = self.models.is_empty() && self.adapters.is_empty();
        any || model.is_some_and(|m| self.models.iter().chain(&self.adapters).any(|x| x == m))
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub name: String,
    /// SHA-256 digests of the tenant's API keys, hex (the keys never reach Rust).
    pub key_digests: Vec<String>,
    pub expires_at: Option<f64>,
    pub service_class: String,
    pub entitlement: Option<String>,
}

/// A model whose prompts are counted exactly: requests whose `model` is
/// `name` are tokenized (`crate::tokenize`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    /// The path of its Hugging Face `tokenizer.json`.
    pub tokenizer: String,
    /// Its chat template's Jinja source (None: chats count their texts).
    pub chat_template: Option<String>,
    /// The special tokens the template writes (`tokenizer_config.json`'s).
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The tokenizer, already loaded ([`Spec::with_tokenizers`]); None: the
    /// engine loads it from the fields above.
    #[serde(skip)]
    pub loaded: Option<Arc<Tokenizer>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    pub server: ServerSpec,
    pub limits: LimitsSpec,
    pub router: RouterSpec,
    pub pools: Vec<PoolSpec>,
    pub tenants: Vec<TenantSpec>,
    /// Models with a tokenizer (none: every prompt is estimated).
    #[serde(default)]
    pub models: Vec<ModelSpec>,
    /// The admission backend's spec (None: no entitlements, no admission).
    pub admission: Option<serde_json::Value>,
    /// The endpoints' metrics scrapes (None: not scraped).
    #[serde(default)]
    pub scrape: Option<ScrapeSpec>,
    /// KV-event sources (None: no precise prefix index).
    #[serde(default)]
    pub kv_events: Option<KvEventsSpec>,
    /// Autoscaling from the capacity model (None: off).
    #[serde(default)]
    pub autoscale: Option<AutoscaleSpec>,
    /// Flow control's queues (None: a request goes on or is refused at once).
    #[serde(default)]
    pub flow_control: Option<FlowSpec>,
}

impl Spec {
    pub fn from_json(text: &str) -> Result<Self> {
        let spec: Spec =
            serde_json::from_str(text).map_err(|e| invalid(format!("data plane spec: {e}")))?;
        if !spec
            .pools
            .iter()
            .any(|p| p.name == spec.server.default_pool)
        {
            return Err(invalid(format!(
                "server.default_pool: unknown pool {:?}",
                spec.server.default_pool
            )));
        }
        spec.limits.check()?;
        spec.router
            .saturation
            .check()
            .map_err(|e| invalid(format!("router.saturation: {e}")))?;
        if let Some(flow) = &spec.flow_control {
            flow.check()?;
        }
        if let Some(scrape) = &spec.scrape {
            scrape.check()?;
            for p in spec.pools.iter().filter(|p| !p.endpoints.is_empty()) {
                if !scrape.engines.contains_key(&p.engine) {
                    return Err(invalid(format!(
                        "pools: {:?}: engine {:?} has no scrape.engines entry",
                        p.name, p.engine
                    )));
                }
            }
        }
        if let Some(a) = &spec.autoscale {
            let names: Vec<&str> = spec.pools.iter().map(|p| p.name.as_str()).collect();
            a.check(&names)?;
        }
        Ok(spec)
    }

    /// Hands over the models' tokenizers, loaded by the caller (the Python
    /// control plane loads each while it validates the file), by model name.
    pub fn with_tokenizers(mut self, loaded: HashMap<String, Arc<Tokenizer>>) -> Result<Self> {
        for (name, tokenizer) in loaded {
            let model = self
                .models
                .iter_mut()
                .find(|m| m.name == name)
                .ok_or_else(|| {
                    invalid(format!("tokenizers: {name:?} is not a model of the spec"))
                })?;
            model.loaded = Some(tokenizer);
        }
        Ok(self)
    }
}

/// A SHA-256 digest from its hex form.
pub fn digest_from_hex(hex: &str) -> Result<[u8; 32]> {
    let bad = || invalid("a key digest must be 64 hex digits");
    if hex.len() != 64 {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16)
            .map_err(|_| bad())?;
    }
    Ok(out)
}
