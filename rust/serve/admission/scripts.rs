//! The Redis admission scripts: one source for the Rust backend and the
//! Python `RedisAdmission` (which reads them through `_core.admission_lua`).
//!
//! Each script is a shebang, `prelude.lua` (quota state, priority, release,
//! purge, window charges) and the operation's own file; KEYS[1] is the
//! quota's key prefix. The constants of rust/admission.rs, the service-class
//! table and the [`Bounds`] on what the scripts keep reach Lua only through
//! [`quota_config`], the JSON argument of the configure script, so the
//! formulas have one set of numbers.
//!
//! Redis full (over `maxmemory` with `noeviction`): Redis 7 refuses a
//! script declared with flags (a shebang) at its start unless it is flagged
//! `allow-oom`, and then lets every command of it run; a script without a
//! shebang is refused only at its first write if that write may grow memory,
//! after any earlier write runs unchecked (a half-run script could leave the
//! counters wrong). So every script declares its flags: those that may grow
//! the state (admit, configure, set_state) are refused whole while Redis is
//! full, and those that end or free what is held (complete, void, sweep) run
//! anyway, growing it at most by a bounded number of void markers. Redis 7.0
//! or later is required (earlier versions do not parse the shebang).

use serde_json::json;

use crate::admission::{
    Entitlement, Quota, ALPHA_BURST, ALPHA_DEBT, ALPHA_SLO, GAMMA_BURST, GAMMA_DEBT, GAMMA_LATENCY,
    MIN_RETRY_AFTER_S,
};
use crate::error::{invalid, Error};

/// Refused while Redis is full: the script may grow the state.
macro_rules! grows {
    ($file:literal) => {
        concat!("#!lua\n", include_str!("prelude.lua"), include_str!($file))
    };
}

/// Runs while Redis is full: the script ends or frees what is held.
macro_rules! frees {
    ($file:literal) => {
        concat!(
            "#!lua flags=allow-oom\n",
            include_str!("prelude.lua"),
            include_str!($file)
        )
    };
}

/// Writes a quota's configuration (ARGV[1]: [`quota_config`]; ARGV[2]: the
/// first ticket number if the quota is new).
pub const CONFIGURE: &str = grows!("configure.lua");
/// Decides and reserves (ARGV: entitlement, tokens, now, request id).
pub const ADMIT: &str = grows!("admit.lua");
/// Releases a ticket with its real usage (ARGV: ticket number, tokens,
/// latency_s, now); 1 when released.
pub const COMPLETE: &str = frees!("complete.lua");
/// Voids the reservations of request ids whose reply was lost (ARGV: now,
/// request ids...), or refuses them in advance.
pub const VOID: &str = frees!("void.lua");
/// Moves an entitlement to a state (ARGV: entitlement, state).
pub const SET_STATE: &str = grows!("set_state.lua");
/// Frees what the quota no longer needs (ARGV: now): expired leases, void
/// markers and the window charges of every entitlement older than the window
/// (an admit only drops its own entitlement's). Run when Redis is full.
pub const SWEEP: &str = frees!("sweep.lua");

/// Every script by name.
pub const SCRIPTS: [(&str, &str); 6] = [
    ("configure", CONFIGURE),
    ("admit", ADMIT),
    ("complete", COMPLETE),
    ("void", VOID),
    ("set_state", SET_STATE),
    ("sweep", SWEEP),
];

/// Ticket numbers carry the quota's index in their low part: `seq * MAX_QUOTAS + quota`.
pub const MAX_QUOTAS: usize = 256;

/// The largest value of a [`Bounds`] field.
pub const MAX_BOUND: u64 = 1 << 24;

/// How much the scripts keep per quota; `admission.redis.max_*` of the
/// configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Window entries of one entitlement.
    pub window_entries: u64,
    /// Window entries of all a quota's entitlements together: each gets an
    /// equal share (at least one).
    pub window_entries_per_quota: u64,
    /// Void markers of a quota (request ids refused in advance).
    pub void_markers: u64,
}

impl Bounds {
    /// Each value in [1, [`MAX_BOUND`]], else an error naming its key.
    pub fn new(
        max_window_entries: u64,
        max_window_entries_per_quota: u64,
        max_void_markers: u64,
    ) -> Result<Self, Error> {
        let check = |what: &str, v: u64| {
            if (1..=MAX_BOUND).contains(&v) {
                Ok(v)
            } else {
                Err(invalid(format!(
                    "{what} must be in [1, {MAX_BOUND}], got {v}"
                )))
            }
        };
        Ok(Self {
            window_entries: check("max_window_entries", max_window_entries)?,
            window_entries_per_quota: check(
                "max_window_entries_per_quota",
                max_window_entries_per_quota,
            )?,
            void_markers: check("max_void_markers", max_void_markers)?,
        })
    }

    /// The window entries each of `n` entitlements of one quota may keep.
    pub fn per_entitlement(&self, n: usize) -> u64 {
        let share = self.window_entries_per_quota / (n.max(1) as u64);
        self.window_entries.min(share).max(1)
    }
}

/// The configure script's JSON for `quota`: its capacity, window and lease,
/// the bounds on what it keeps, equation 1's constants and, per entitlement
/// of the quota, its class's weight, burst right and baseline (the paper's
/// Table 1).
pub fn quota_config(
    quota: &Quota,
    entitlements: &[Entitlement],
    window_s: f64,
    lease_s: f64,
    bounds: &Bounds,
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
        "window_entries": bounds.per_entitlement(ents.len()),
        "void_markers": bounds.void_markers,
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
