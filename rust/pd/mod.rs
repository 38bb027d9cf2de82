//! Prefill/decode disaggregation, the routing half (after llm-d's P/D
//! scheduling profiles, NVIDIA Dynamo's conditional disaggregation and the
//! vLLM / SGLang P/D documents): endpoints have a [`Role`], and a request
//! is placed in three phases ([`Split::pick`]):
//!
//! 1. the **decode** endpoint, by the pool's own pipeline (prefix, load,
//!    saturation as for any request) among the endpoints that decode
//!    (`decode` or `both`); it is started there at once (counted in flight,
//!    its prefix blocks recorded);
//! 2. the **decider** ([`Decider`]): whether to prefill elsewhere, from the
//!    prompt tokens the chosen decode endpoint does not hold (the prefix
//!    scorer's match on it) and the load of the prefill endpoints;
//! 3. the **prefill** endpoint, by a pipeline of its own (the same filters,
//!    the prefix scorer sharing the decode pipeline's index, queue depth
//!    and routecore's in-flight count: [`prefill_specs`]) among the
//!    endpoints that prefill (`prefill` or `both`) other than the decode
//!    endpoint; started there too.
//!
//! The routing half lives with the picker (`crate::pick::split`, re-exported
//! here): the pool picker (`crate::pick::PoolPicker`) places a request
//! through it, and its caller (the data plane's chooser, the Python picker)
//! holds both endpoints in the request's lease and releases each once.
//! This module keeps the pool's config and the engines' handoff
//! ([`handshake`]). Pure: no I/O, no runtime.

use serde::Deserialize;

use crate::error::{invalid, Result};
pub use crate::pick::split::{
    check_roles, pool_roles, prefill_specs, Decider, Pair, Role, Split, DECIDERS, ROLES,
};

/// A pool's `disaggregation` config: its decider by name, the decider's
/// threshold, and how a split request travels ([`handshake::Handoff`]:
/// with `vllm` and `sglang` routecore sends the prefill itself, waiting at
/// most `prefill_timeout_s` for it; `require_kv_transfer_params`: a vLLM
/// prefill answer without them falls back to an aggregated request;
/// `bootstrap_port`: the SGLang prefill engines' bootstrap server, None
/// for the engines' default).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DisaggregationSpec {
    pub decider: String,
    #[serde(default)]
    pub threshold: Option<f64>,
    #[serde(default)]
    pub handoff: handshake::Handoff,
    #[serde(default = "default_prefill_timeout")]
    pub prefill_timeout_s: f64,
    #[serde(default = "default_true")]
    pub require_kv_transfer_params: bool,
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// The longest `prefill_timeout_s` (an hour).
pub const MAX_PREFILL_TIMEOUT_S: f64 = 3600.0;

fn default_prefill_timeout() -> f64 {
    30.0
}

fn default_true() -> bool {
    true
}

impl DisaggregationSpec {
    /// Checks what the decider does not: the prefill timeout.
    pub fn check(&self) -> Result<()> {
        let t = self.prefill_timeout_s;
        if !(t.is_finite() && t > 0.0 && t <= MAX_PREFILL_TIMEOUT_S) {
            return Err(invalid(format!(
                "prefill_timeout_s must be in (0, {MAX_PREFILL_TIMEOUT_S}], got {t}"
            )));
        }
        Ok(())
    }
}

/// A pool's decider: the one its spec names, else `never` when every
/// endpoint is `both` (an aggregated pool) and `always` when roles split it.
/// The spec is checked ([`DisaggregationSpec::check`]).
pub fn pool_decider(spec: Option<&DisaggregationSpec>, roles: &[Role]) -> Result<Decider> {
    match spec {
        Some(s) => {
            s.check()?;
            Decider::new(&s.decider, s.threshold)
        }
        None if roles.iter().all(|&r| r == Role::Both) => Ok(Decider::Never),
        None => Ok(Decider::Always),
    }
}

pub mod handshake;
