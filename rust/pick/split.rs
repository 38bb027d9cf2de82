//! The prefill/decode split of a pool picker (the routing half of
//! disaggregation: see `crate::pd` for the module story and the engines'
//! handoff): endpoints' [`Role`]s, the [`Decider`], and [`Split::pick`]
//! placing a request in three phases, decode, decider, prefill.

use std::fmt;
use std::sync::Arc;

use serde::Deserialize;

use super::{Kind, PickConfig, PickRequest, Pipeline, PluginSpec, Recorded};
use crate::endpoint::{complete_one, EndpointState};
use crate::error::Error;
use crate::error::{finite, invalid, Result};
use crate::snapshot::{Reader, Writer};

/// What an endpoint does in a disaggregated pool: the word of llm-d's
/// `llm-d.ai/role` label (`prefill-decode` is `both`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs only the prefill of requests decoded elsewhere.
    Prefill,
    /// Decodes; prefills only its own requests when they are not split.
    Decode,
    /// Either (an aggregated endpoint: the default).
    #[default]
    Both,
}

/// The role names, as config and metrics spell them.
pub const ROLES: [&str; 3] = ["prefill", "decode", "both"];

impl Role {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            _ => Err(invalid(format!(
                "unknown role {s:?} (roles: {})",
                ROLES.join(", ")
            ))),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
    /// May be the request's decode endpoint.
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }
    /// May run the prefill of a request decoded elsewhere.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a request is prefilled on another endpoint than its decode one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decider {
    /// Every request (llm-d's `always-disagg`).
    Always,
    /// None: the pool runs aggregated.
    Never,
    /// When the prompt tokens the decode endpoint does not hold exceed
    /// `threshold` (llm-d's prefix-based decider; Dynamo's prompt length).
    UncachedTokens { threshold: u64 },
    /// While the least-loaded prefill endpoint holds at most `threshold`
    /// requests (waiting + running, or routecore's in-flight count); above
    /// it the decode endpoint prefills itself (Dynamo's prefill-queue
    /// limit).
    PrefillLoad { threshold: f64 },
}

/// The decider names, as config spells them.
pub const DECIDERS: [&str; 4] = ["always", "never", "uncached-tokens", "prefill-load"];

impl Decider {
    /// A decider by name; `threshold` is required by (and only allowed for)
    /// `uncached-tokens` (a whole number of tokens) and `prefill-load`.
    pub fn new(name: &str, threshold: Option<f64>) -> Result<Self> {
        let need = |t: Option<f64>| {
            let t = t.ok_or_else(|| invalid(format!("decider {name:?} needs a threshold")))?;
            finite("threshold", t)?;
            if t < 0.0 {
                return Err(invalid(format!("threshold must be >= 0, got {t}")));
            }
            Ok(t)
        };
        let none = |d: Decider| match threshold {
            None => Ok(d),
            Some(_) => Err(invalid(format!("decider {name:?} takes no threshold"))),
        };
        match name {
            "always" => none(Decider::Always),
            "never" => none(Decider::Never),
            "uncached-tokens" => {
                let t = need(threshold)?;
                if t.fract() != 0.0 || t > u32::MAX as f64 {
                    return Err(invalid(format!(
                        "uncached-tokens threshold must be a whole number of tokens, got {t}"
                    )));
                }
                Ok(Decider::UncachedTokens {
                    threshold: t as u64,
                })
            }
            "prefill-load" => Ok(Decider::PrefillLoad {
                threshold: need(threshold)?,
            }),
            _ => Err(invalid(format!(
                "unknown decider {name:?} (deciders: {})",
                DECIDERS.join(", ")
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Decider::Always => "always",
            Decider::Never => "never",
            Decider::UncachedTokens { .. } => "uncached-tokens",
            Decider::PrefillLoad { .. } => "prefill-load",
        }
    }

    /// The decision for a request whose decode endpoint lacks
    /// `uncached_tokens` of its prompt, when the least-loaded prefill
    /// endpoint holds `prefill_load` requests.
    pub fn split(self, uncached_tokens: u64, prefill_load: f64) -> bool {
        match self {
            Decider::Always => true,
            Decider::Never => false,
            Decider::UncachedTokens { threshold } => uncached_tokens > threshold,
            Decider::PrefillLoad { threshold } => prefill_load <= threshold,
        }
    }
}

/// The roles of a pool's endpoints, in order: `role` for each, or its
/// entry in `per_endpoint` (whose names must be endpoints of the pool).
pub fn pool_roles(
    endpoints: &[String],
    role: Role,
    per_endpoint: &std::collections::HashMap<String, Role>,
) -> Result<Vec<Role>> {
    if let Some(name) = per_endpoint.keys().find(|k| !endpoints.contains(k)) {
        return Err(invalid(format!(
            "roles names {name:?}, not an endpoint of the pool"
        )));
    }
    Ok(endpoints
        .iter()
        .map(|e| per_endpoint.get(e).copied().unwrap_or(role))
        .collect())
}

/// Checks a pool's roles for `decider`: some endpoint must decode, and a
/// pool that can split (`decider` not `never`) with `decode` endpoints
/// needs an endpoint that prefills. An empty pool passes (filled later).
pub fn check_roles(roles: &[Role], decider: Decider) -> Result<()> {
    if roles.is_empty() {
        return Ok(());
    }
    if !roles.iter().any(|r| r.decodes()) {
        return Err(invalid(
            "every endpoint is a prefill endpoint: none can serve a request \
             (give one the role decode or both)",
        ));
    }
    let decode_only = roles.contains(&Role::Decode);
    if decider != Decider::Never && decode_only && !roles.iter().any(|r| r.prefills()) {
        return Err(invalid(format!(
            "decode endpoints and no prefill endpoint, and the decider {:?} may split \
             requests (add a prefill endpoint or use the decider never)",
            decider.name()
        )));
    }
    Ok(())
}

/// The prefill pipeline's specs from the decode pipeline's: its filters
/// (health, subset, adapter, saturation), its prefix scorer (the scorer
/// that reads block hashes; weight 2, same parameters: it shares the decode
/// pipeline's index), queue depth and the requests in flight (weight 1
/// each), the highest total with ties to the least loaded.
pub fn prefill_specs(decode: &[PluginSpec]) -> Vec<PluginSpec> {
    let described = |s: &PluginSpec| super::describe(&s.name).ok();
    let mut specs: Vec<PluginSpec> = decode
        .iter()
        .filter(|s| described(s).is_some_and(|d| matches!(d.kind, Kind::Filter { .. })))
        .cloned()
        .collect();
    specs.extend(
        decode
            .iter()
            .filter(|s| described(s).is_some_and(|d| d.needs.hashes))
            .map(|s| PluginSpec::with(&s.name, 2.0, s.params.clone())),
    );
    specs.push(PluginSpec::new("queue-depth", 1.0));
    specs.push(PluginSpec::new("least-request", 1.0));
    specs.push(PluginSpec::with(
        "max-score",
        1.0,
        serde_json::json!({"ties": "least-request"}),
    ));
    specs
}

/// Where one request runs: its decode endpoint (what the decode pipeline
/// recorded there) and, when split, its prefill endpoint (and what the
/// prefill pipeline recorded there).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pair {
    pub decode: usize,
    pub recorded: Recorded,
    pub prefill: Option<(usize, Recorded)>,
    /// The prompt tokens the decode endpoint did not hold at the pick, by
    /// routecore's prefix index (counted for the `uncached-tokens` decider
    /// only; the whole prompt otherwise).
    pub uncached_tokens: u64,
}

/// A pool's disaggregation: its endpoints' roles, its decider and its
/// prefill pipeline (over the same endpoints, in the same order, as the
/// decode pipeline it is used with).
#[derive(Debug, Clone)]
pub struct Split {
    roles: Vec<Role>,
    decider: Decider,
    prefill: Pipeline,
    /// The decode pipeline's prefix block size (0: no prefix scorer).
    block_size: usize,
    // Scratch, reused by every pick.
    decode_sub: Vec<usize>,
    prefill_sub: Vec<usize>,
}

impl Split {
    /// The split of a pool served by `decode` (whose endpoints `roles`
    /// follows in order). `decode` must have the `subset-hint` filter: the
    /// roles are applied through it.
    pub fn new(decode: &Pipeline, roles: Vec<Role>, decider: Decider) -> Result<Self> {
        if roles.len() != decode.endpoints().len() {
            return Err(invalid(format!(
                "{} roles for {} endpoints",
                roles.len(),
                decode.endpoints().len()
            )));
        }
        check_roles(&roles, decider)?;
        if !decode.specs().iter().any(|s| s.name == "subset-hint") {
            return Err(invalid(
                "disaggregation needs the subset-hint filter in the pool's pipeline",
            ));
        }
        let prefix = decode.prefix();
        let config = PickConfig {
            prefix_index: prefix.map(|p| Arc::clone(p.index())),
            kv_index: prefix.and_then(|p| p.kv().cloned()),
            ..PickConfig::default()
        };
        let mut prefill = Pipeline::from_specs(
            &prefill_specs(decode.specs()),
            decode.endpoints().names(),
            &config,
        )?;
        prefill.prepare()?;
        Ok(Self {
            roles,
            decider,
            prefill,
            block_size: prefix.map_or(0, |p| p.config().block_size),
            decode_sub: Vec::new(),
            prefill_sub: Vec::new(),
        })
    }

    /// [`Split::new`], or None for a pool that never splits (every
    /// endpoint `both`, the decider `never`).
    pub fn of_pool(decode: &Pipeline, roles: Vec<Role>, decider: Decider) -> Result<Option<Self>> {
        if decider == Decider::Never && roles.iter().all(|&r| r == Role::Both) {
            return Ok(None);
        }
        Self::new(decode, roles, decider).map(Some)
    }

    pub fn roles(&self) -> &[Role] {
        &self.roles
    }
    pub fn decider(&self) -> Decider {
        self.decider
    }
    pub fn prefill_pipeline(&self) -> &Pipeline {
        &self.prefill
    }

    /// Writes the roles and the decider (the prefill pipeline learns
    /// nothing of its own: its prefix index is the decode pipeline's).
    pub fn write(&self, w: &mut Writer) {
        w.u64(self.roles.len() as u64);
        for r in &self.roles {
            w.str(r.as_str());
        }
        let threshold = match self.decider {
            Decider::UncachedTokens { threshold } => Some(threshold as f64),
            Decider::PrefillLoad { threshold } => Some(threshold),
            Decider::Always | Decider::Never => None,
        };
        w.str(self.decider.name());
        match threshold {
            Some(t) => w.u8(1).f64(t),
            None => w.u8(0),
        };
    }

    /// Reads what `write` wrote, for `decode` (restored before it).
    pub fn read(r: &mut Reader<'_>, decode: &Pipeline) -> Result<Self> {
        let n = r.count(1)?;
        let roles = (0..n)
            .map(|_| Role::parse(&r.str()?).map_err(|e| Error::Snapshot(e.to_string())))
            .collect::<Result<Vec<_>>>()?;
        let name = r.str()?;
        let threshold = match r.u8()? {
            0 => None,
            1 => Some(r.f64()?),
            b => return Err(Error::Snapshot(format!("bad threshold flag {b}"))),
        };
        let decider = Decider::new(&name, threshold)?;
        Self::new(decode, roles, decider)
    }

    /// Places a request (see the module docs): the decode endpoint ranked
    /// first in `ranked` with its fallbacks (endpoints that decode), both
    /// endpoints started (their plugins told, one more in flight and
    /// dispatched in `states`). Ok(None) when no endpoint can decode it
    /// (nothing changed); Err only on bad input (nothing changed).
    pub fn pick(
        &mut self,
        decode: &mut Pipeline,
        req: &PickRequest<'_>,
        states: &mut [EndpointState],
        ranked: &mut Vec<usize>,
    ) -> Result<Option<Pair>> {
        decode.check(req, states)?;
        let roles = &self.roles;
        let allowed = |i: &usize| req.subset.is_none_or(|s| s.contains(i));
        self.decode_sub.clear();
        self.decode_sub
            .extend((0..roles.len()).filter(|i| roles[*i].decodes() && allowed(i)));
        let phase = PickRequest {
            subset: Some(&self.decode_sub),
            ..*req
        };
        decode.pick(&phase, states, ranked)?;
        let Some(&d) = ranked.first() else {
            return Ok(None);
        };
        let cached = match self.decider {
            Decider::UncachedTokens { .. } => decode.prefix_held(req, d)? * self.block_size,
            _ => 0,
        };
        let uncached_tokens = req.input_tokens.saturating_sub(cached as u64);
        let recorded = decode.started_recorded(&phase, d)?;
        states[d].start_one();
        self.prefill_sub.clear();
        self.prefill_sub.extend(
            (0..roles.len())
                .filter(|&i| i != d && roles[i].prefills() && allowed(&i) && states[i].healthy),
        );
        let prefill_load = self
            .prefill_sub
            .iter()
            .map(|&i| states[i].load())
            .fold(f64::INFINITY, f64::min);
        let mut pair = Pair {
            decode: d,
            recorded,
            prefill: None,
            uncached_tokens,
        };
        if self.prefill_sub.is_empty() || !self.decider.split(uncached_tokens, prefill_load) {
            return Ok(Some(pair));
        }
        let phase = PickRequest {
            subset: Some(&self.prefill_sub),
            ..*req
        };
        if let Some(p) = self.prefill.pick_one(&phase, states)? {
            let recorded = self.prefill.started_recorded(&phase, p)?;
            states[p].start_one();
            pair.prefill = Some((p, recorded));
        }
        Ok(Some(pair))
    }

    /// A request's prefill on `endpoint` ended (its decode is released on
    /// the decode pipeline): one less in flight (`NotInFlight` when none
    /// is, nothing changed), the prefill plugins told (`req`: the request
    /// as picked; the prefill used `input_tokens`).
    pub fn prefill_done(
        &mut self,
        req: &PickRequest<'_>,
        endpoint: usize,
        input_tokens: u64,
        states: &mut [EndpointState],
    ) -> Result<()> {
        finite("now", req.now)?;
        let names = self.prefill.endpoints().names();
        let (Some(name), Some(s)) = (names.get(endpoint), states.get_mut(endpoint)) else {
            return Err(invalid(format!(
                "endpoint index {endpoint} out of range for {} endpoints",
                names.len()
            )));
        };
        complete_one(s, name)?;
        self.prefill
            .completed_request(req, endpoint, input_tokens, 0)
    }
}

#[cfg(test)]
mod tests;
