//! The data plane's configuration: the JSON spec the Python control plane
//! produces from a validated `routecore serve` file (`routecore.config`).
//! Python validates and names the bad key; this side only re-checks what the
//! cores check anyway (pools, policies) and refuses anything malformed.

use serde::Deserialize;

use crate::error::{invalid, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    Open,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Policy {
    #[serde(rename = "least-request")]
    LeastRequest,
    #[serde(rename = "prefix")]
    Prefix,
    #[serde(rename = "vtc")]
    Vtc,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    pub key_header: String,
    pub failure_mode: FailureMode,
    pub default_pool: String,
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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterSpec {
    pub policy: Policy,
    pub compress_band: Option<f64>,
    pub prefix_block_size: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: String,
    pub max_context: u64,
    pub budget: Option<u64>,
    pub queue_limit: Option<u64>,
    pub endpoints: Vec<String>,
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
    /// The admission backend's spec (None: no entitlements, no admission).
    pub admission: Option<serde_json::Value>,
    /// KV-event sources (None: no precise prefix index).
    #[serde(default)]
    pub kv_events: Option<KvEventsSpec>,
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
        if !(spec.limits.request_timeout_s.is_finite() && spec.limits.request_timeout_s > 0.0) {
            return Err(invalid("limits.request_timeout_s must be > 0"));
        }
        Ok(spec)
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
