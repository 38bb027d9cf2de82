//! Test data planes' specs: the `server`, `limits` and `router` blocks every
//! test plane shares, written once; a test gives what differs (the policy,
//! the pools, then any key it changes in the JSON).

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The JSON of a data plane spec over `pools` (the first one the default
/// pool) routed by `policy`: API keys in `x-api-key`, failure mode closed,
/// 10,000-byte bodies, requests timing out after 30 s, 100 output tokens by
/// default; no tenants, no admission. Change any key before
/// `Spec::from_json` reads it (`json["tenants"] = ...`).
pub(crate) fn plane_json(policy: &str, pools: Value) -> Value {
    json!({
        "server": {"key_header": "x-api-key", "failure_mode": "closed",
                   "default_pool": pools[0]["name"]},
        "limits": {"max_body_bytes": 10000, "max_message_bytes": 1 << 20,
                   "request_timeout_s": 30.0, "default_max_tokens": 100,
                   "image_tokens": 765, "audio_tokens": 750},
        "router": {"policy": policy, "compress_band": null, "prefix_block_size": 16},
        "pools": pools,
        "tenants": [],
        "admission": null
    })
}

/// A tenant `name` whose API key is `key`, with `entitlement` (None: not
/// admitted by quota).
pub(crate) fn tenant(name: &str, key: &[u8], entitlement: Option<&str>) -> Value {
    let digest: String = Sha256::digest(key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    json!({"name": name, "key_digests": [digest], "expires_at": null,
           "service_class": "none", "entitlement": entitlement})
}
