//! The data plane's configuration: the JSON spec the Python control plane
//! produces from a validated `routecore serve` file (`routecore.config`).
//! Python validates and names the bad key; this side only re-checks what the
//! cores check anyway (pools, policies) and refuses anything malformed.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;

use super::flow::FlowSpec;
use super::scrape::ScrapeSpec;
use crate::endpoint::Saturation;
use crate::error::{invalid, Result};
use crate::tokenize::Tokenizer;

/// What a failure does to a request, the one enum of `server.failure_mode`
/// (routing failed) and `admission.redis.failure_mode` (the backend
/// failed): `Open` lets it through unaccounted (the default pool without
/// admission; admitted without a ticket), `Closed` refuses it with 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    Open,
    #[default]
    Closed,
}

impl FailureMode {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureMode::Open => "open",
            FailureMode::Closed => "closed",
        }
    }
}

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
pub struct LimitsSpec {
    pub max_body_bytes: u64,
    pub max_message_bytes: u64,
    pub request_timeout_s: f64,
    pub default_max_tokens: u64,
    /// Tokens charged per image and per audio part of a request.
    pub image_tokens: u64,
    pub audio_tokens: u64,
    /// Bodies at least this long are tokenized off the async worker.
    #[serde(default = "default_tokenize_inline_bytes")]
    pub tokenize_inline_bytes: u64,
    /// What a client can make the data plane hold (`serve::limits`): the
    /// time from a stream's opening to its routing, the bytes all streams
    /// buffer together, streams per connection, connections.
    #[serde(default = "default_body_timeout_s")]
    pub body_timeout_s: f64,
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: u64,
    #[serde(default = "default_max_streams_per_connection")]
    pub max_streams_per_connection: u64,
    #[serde(default = "default_max_connections")]
    pub max_connections: u64,
}

// The defaults of `routecore.config.Limits` (the Python side fills them in).
fn default_body_timeout_s() -> f64 {
    60.0
}

fn default_max_buffered_bytes() -> u64 {
    256 << 20
}

fn default_max_streams_per_connection() -> u64 {
    1024
}

fn default_max_connections() -> u64 {
    64
}

/// Below this, tokenizing inline costs less than handing it to another
/// thread (benches/RESULTS.md, "Tokenizing off the worker").
pub const TOKENIZE_INLINE_BYTES: u64 = 512;

fn default_tokenize_inline_bytes() -> u64 {
    TOKENIZE_INLINE_BYTES
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

/// One endpoint's KV-event source (`kv_events.endpoints` of the config).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvSourceSpec {
    pub endpoint: String,
    pub zmq: String,
    pub topic: String,
    pub replay: Option<String>,
}

/// The precise prefix index and its subscribers (`kv_events`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsSpec {
    pub block_size: usize,
    pub seed: u64,
    pub capacity_blocks: usize,
    pub stale_after_s: Option<f64>,
    /// What a peer may send (`kv_events::subscriber::PeerLimits`).
    pub max_message_bytes: u64,
    pub max_batch_events: usize,
    pub max_batch_blocks: usize,
    pub sources: Vec<KvSourceSpec>,
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
    pub autoscale: Option<super::autoscale::AutoscaleSpec>,
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
        for (name, s) in [
            ("request_timeout_s", spec.limits.request_timeout_s),
            ("body_timeout_s", spec.limits.body_timeout_s),
        ] {
            if !(s.is_finite() && s > 0.0) {
                return Err(invalid(format!("limits.{name} must be > 0")));
            }
        }
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
            a.check(&spec.pools)?;
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
