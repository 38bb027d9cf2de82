//! The Redis admission scripts: one source for the Rust backend and the
//! Python `RedisAdmission` (which reads them through `_core.admission_lua`).
//!
//! Each script is `prelude.lua` (quota state, priority, release, purge) and
//! the operation's own file; KEYS[1] is the quota's key prefix. The constants
//! of rust/admission.rs and the service-class table reach Lua only through
//! [`quota_config`], the JSON argument of the configure script, so the
//! formulas have one set of numbers.

use serde_json::json;

use crate::admission::{
    Entitlement, Quota, ALPHA_BURST, ALPHA_DEBT, ALPHA_SLO, GAMMA_BURST, GAMMA_DEBT, GAMMA_LATENCY,
    MIN_RETRY_AFTER_S,
};

/// Writes a quota's configuration (ARGV[1]: [`quota_config`]; ARGV[2]: the
/// first ticket number if the quota is new).
pub const CONFIGURE: &str = concat!(include_str!("prelude.lua"), include_str!("configure.lua"));
/// Decides and reserves (ARGV: entitlement, tokens, now, request id).
pub const ADMIT: &str = concat!(include_str!("prelude.lua"), include_str!("admit.lua"));
/// Releases a ticket with its real usage (ARGV: ticket number, tokens,
/// latency_s, now); 1 when released.
pub const COMPLETE: &str = concat!(include_str!("prelude.lua"), include_str!("complete.lua"));
/// Voids the reservations of request ids whose reply was lost (ARGV: now,
/// request ids...), or refuses them in advance.
pub const VOID: &str = concat!(include_str!("prelude.lua"), include_str!("void.lua"));
/// Moves an entitlement to a state (ARGV: entitlement, state).
pub const SET_STATE: &str = concat!(include_str!("prelude.lua"), include_str!("set_state.lua"));

/// Every script by name.
pub const SCRIPTS: [(&str, &str); 5] = [
    ("configure", CONFIGURE),
    ("admit", ADMIT),
    ("complete", COMPLETE),
    ("void", VOID),
    ("set_state", SET_STATE),
];

/// Ticket numbers carry the quota's index in their low part: `seq * MAX_QUOTAS + quota`.
pub const MAX_QUOTAS: usize = 256;

/// The configure script's JSON for `quota`: its capacity, window and lease,
/// equation 1's constants and, per entitlement of the quota, its class's
/// weight, burst right and baseline (the paper's Table 1).
pub fn quota_config(
    quota: &Quota,
    entitlements: &[Entitlement],
    window_s: f64,
    lease_s: f64,
) -> String {
    let ents: Vec<_> = entitlements
        .iter()
        .filter(|e| e.quota == quota.name)
        .map(|e| {
            let c = e.service_class;
            json!({
                "name": e.name,
                "weight": c.weight(),
                "burstable": u8::from(c.can_burst()),
                "baseline": u8::from(c.has_baseline()),
                "slo_target_ms": e.slo_target_ms,
                "tokens_per_s": e.tokens_per_s,
                "kv_bytes": e.kv_bytes,
                "concurrency": e.concurrency,
                "state": e.state.as_str(),
            })
        })
        .collect();
    json!({
        "tokens_per_s": quota.tokens_per_s,
        "kv_bytes": quota.kv_bytes,
        "concurrency": quota.concurrency,
        "kv_bytes_per_token": quota.kv_bytes_per_token,
        "window_s": window_s,
        "lease_s": lease_s,
        "constants": {
            "alpha_slo": ALPHA_SLO,
            "alpha_burst": ALPHA_BURST,
            "alpha_debt": ALPHA_DEBT,
            "gamma_debt": GAMMA_DEBT,
            "gamma_burst": GAMMA_BURST,
            "gamma_latency": GAMMA_LATENCY,
            "min_retry": MIN_RETRY_AFTER_S,
        },
        "entitlements": ents,
    })
    .to_string()
}
