//! Quotas: multi-tenant admission control (Cunningham, "Token Management
//! in Multi-Tenant AI Inference Platforms", 2026).
//!
//! A [`Quota`] is a capacity shared by tenants, in inference-native units
//! (tokens/s, KV bytes, concurrency; the paper's "token pool", named apart
//! from the router's context pools); an [`Entitlement`] is a tenant's baseline share of
//! one quota with a [`ServiceClass`] (the paper's Table 1). The
//! [`AdmissionController`] decides each request at the gateway with the
//! paper's checks, in order (section 4.3):
//!
//! 1. state: the entitlement must be bound (401 when unknown, 403 otherwise);
//! 2. output bound: a request without `max_tokens` is charged the default;
//! 3. concurrency: in-flight requests below the entitlement's `concurrency`;
//! 4. token budget: `input + max_tokens` fits in `tokens_per_s * window_s`
//!    minus what the entitlement was charged over the rolling window;
//! 5. quota contention: when the quota is full (in-flight requests at its
//!    concurrency, or KV bytes at its capacity), the request's priority must
//!    beat the lowest priority among the entitlements with admitted requests.
//!
//! Classes with burst rights (dedicated, elastic, spot, preemptible) may pass
//! checks 3 and 4 above their baseline while the quota has room; guaranteed may
//! not. A rejection carries HTTP 429 and a Retry-After computed from the
//! state: the expected time between completions of the blocking requests
//! (Little's law: latency EWMA over requests in flight, for the entitlement
//! or summed over the quota) or when enough tokens leave the window.
//!
//! Priority (equation 1): `w_e = w_class / (1 + a_slo * l_e / l_mean) /
//! (1 + a_burst * b_e) * (1 + a_debt * d_e)`, `l_mean` the mean SLO target of
//! the quota's bound entitlements. `complete` updates the debt (equation 2)
//! `d_e <- g_d d_e + (1 - g_d) (lambda_e - lambda_hat_e) / lambda_e`, with
//! `lambda_hat_e` the entitlement's served token rate (an exponentially
//! decaying average of completed tokens, time constant `window_s`), for the
//! classes with a baseline (dedicated, guaranteed, elastic), and the burst
//! intensity (equation 3) `b_e <- g_b b_e + (1 - g_b) delta_e`, `delta_e` the
//! overshoot of served rate, KV bytes and concurrency in flight over baseline.
//!
//! Time is passed in explicitly (seconds, any origin). A time earlier than one
//! already seen counts as the latest seen, so callers on several threads need
//! not serialise their clocks.

use std::collections::{BTreeMap, VecDeque};

use crate::budget::MAX_TOKENS;
use crate::error::{finite, invalid, non_negative, not_in_flight, positive, unknown, Result};
use crate::snapshot::{restore, Reader, Writer};

/// Coefficients of equation 1 (the paper's typical values).
pub const ALPHA_SLO: f64 = 2.0;
pub const ALPHA_BURST: f64 = 1.0;
pub const ALPHA_DEBT: f64 = 4.0;
/// EWMA decay of the service debt (equation 2).
pub const GAMMA_DEBT: f64 = 0.7;
/// EWMA decay of the burst intensity; the paper leaves it open: 0.9 makes a
/// single burst cost little and sustained bursting cost progressively more.
pub const GAMMA_BURST: f64 = 0.9;
/// EWMA decay of the observed request latency behind Retry-After.
pub const GAMMA_LATENCY: f64 = 0.7;
/// The shortest Retry-After given, in seconds.
pub const MIN_RETRY_AFTER_S: f64 = 0.05;
/// 16 MiB of KV cache per token is far beyond any model (the paper: tens of
/// KB to several MB).
pub const MAX_KV_BYTES_PER_TOKEN: i64 = 1 << 24;
/// Entitlement indices live in the low bits of a ticket.
const TICKET_ENT_BITS: u32 = 20;
const MAX_ENTITLEMENTS: usize = 1 << TICKET_ENT_BITS;

/// The paper's Table 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceClass {
    Dedicated,
    Guaranteed,
    Elastic,
    Spot,
    Preemptible,
}

/// What may happen to an entitlement when protected classes need capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shrink {
    Never,
    Yes,
    Evict,
}

impl ServiceClass {
    pub const ALL: [ServiceClass; 5] = [
        ServiceClass::Dedicated,
        ServiceClass::Guaranteed,
        ServiceClass::Elastic,
        ServiceClass::Spot,
        ServiceClass::Preemptible,
    ];

    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str() == name)
            .ok_or_else(|| {
                invalid(format!(
                    "service_class must be one of dedicated, guaranteed, elastic, spot, preemptible; got {name:?}"
                ))
            })
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceClass::Dedicated => "dedicated",
            ServiceClass::Guaranteed => "guaranteed",
            ServiceClass::Elastic => "elastic",
            ServiceClass::Spot => "spot",
            ServiceClass::Preemptible => "preemptible",
        }
    }
    /// The class weight `w_kappa`.
    pub fn weight(self) -> f64 {
        match self {
            ServiceClass::Dedicated | ServiceClass::Guaranteed => 1000.0,
            ServiceClass::Elastic => 100.0,
            ServiceClass::Spot => 1.0,
            ServiceClass::Preemptible => 0.1,
        }
    }
    /// May exceed its baseline while the quota has room.
    pub fn can_burst(self) -> bool {
        self != ServiceClass::Guaranteed
    }
    pub fn shrink(self) -> Shrink {
        match self {
            ServiceClass::Dedicated | ServiceClass::Guaranteed => Shrink::Never,
            ServiceClass::Elastic | ServiceClass::Spot => Shrink::Yes,
            ServiceClass::Preemptible => Shrink::Evict,
        }
    }
    /// Has a baseline (reserved or time-averaged) and so accumulates debt.
    pub fn has_baseline(self) -> bool {
        matches!(
            self,
            ServiceClass::Dedicated | ServiceClass::Guaranteed | ServiceClass::Elastic
        )
    }
    fn index(self) -> u8 {
        Self::ALL.iter().position(|&c| c == self).unwrap_or(0) as u8
    }
}

/// An entitlement's lifecycle state; only `Bound` entitlements are admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Pending,
    Bound,
    Degraded,
    Expired,
}

impl State {
    pub const ALL: [State; 4] = [
        State::Pending,
        State::Bound,
        State::Degraded,
        State::Expired,
    ];

    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|s| s.as_str() == name)
            .ok_or_else(|| {
                invalid(format!(
                    "state must be one of pending, bound, degraded, expired; got {name:?}"
                ))
            })
    }
    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::Bound => "bound",
            State::Degraded => "degraded",
            State::Expired => "expired",
        }
    }
    fn index(self) -> u8 {
        Self::ALL.iter().position(|&s| s == self).unwrap_or(0) as u8
    }
}

fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 256 {
        return Err(invalid(format!("{what} name must be 1 to 256 bytes")));
    }
    Ok(())
}

fn check_count(what: &str, v: i64, min: i64) -> Result<u64> {
    if v < min || v as u64 > MAX_TOKENS {
        return Err(invalid(format!(
            "{what} must be in [{min}, {MAX_TOKENS}], got {v}"
        )));
    }
    Ok(v as u64)
}

fn check_bytes(what: &str, v: i64) -> Result<u64> {
    if v < 1 {
        return Err(invalid(format!("{what} must be >= 1, got {v}")));
    }
    Ok(v as u64)
}

/// A quota's capacity. `kv_bytes_per_token` (the paper's `c = 2 L H_kv d_h b`)
/// turns a request's tokens into KV bytes; 0 leaves KV out of admission.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    pub name: String,
    pub tokens_per_s: f64,
    pub kv_bytes: u64,
    pub concurrency: u64,
    pub kv_bytes_per_token: u64,
}

impl Quota {
    pub fn new(
        name: &str,
        tokens_per_s: f64,
        kv_bytes: i64,
        concurrency: i64,
        kv_bytes_per_token: i64,
    ) -> Result<Self> {
        check_name("quota", name)?;
        let mut quota = Self {
            name: name.to_owned(),
            tokens_per_s: 0.0,
            kv_bytes: 0,
            concurrency: 0,
            kv_bytes_per_token: 0,
        };
        quota.set_capacity(
            Some(tokens_per_s),
            Some(kv_bytes),
            Some(concurrency),
            Some(kv_bytes_per_token),
        )?;
        Ok(quota)
    }

    /// Changes the given parts of the capacity; all checked before any change.
    pub fn set_capacity(
        &mut self,
        tokens_per_s: Option<f64>,
        kv_bytes: Option<i64>,
        concurrency: Option<i64>,
        kv_bytes_per_token: Option<i64>,
    ) -> Result<()> {
        let t = match tokens_per_s {
            Some(t) => positive("tokens_per_s", t)?,
            None => self.tokens_per_s,
        };
        let kv = match kv_bytes {
            Some(b) => check_bytes("kv_bytes", b)?,
            None => self.kv_bytes,
        };
        let c = match concurrency {
            Some(c) => check_count("concurrency", c, 1)?,
            None => self.concurrency,
        };
        let per = match kv_bytes_per_token {
            Some(p) if !(0..=MAX_KV_BYTES_PER_TOKEN).contains(&p) => {
                return Err(invalid(format!(
                    "kv_bytes_per_token must be in [0, {MAX_KV_BYTES_PER_TOKEN}], got {p}"
                )))
            }
            Some(p) => p as u64,
            None => self.kv_bytes_per_token,
        };
        self.tokens_per_s = t;
        self.kv_bytes = kv;
        self.concurrency = c;
        self.kv_bytes_per_token = per;
        Ok(())
    }

    /// Tokens/s one concurrency slot serves: the latency guess before any
    /// request of an entitlement has completed.
    fn slot_rate(&self) -> f64 {
        self.tokens_per_s / self.concurrency as f64
    }
}

/// A tenant's baseline share of one quota.
#[derive(Debug, Clone, PartialEq)]
pub struct Entitlement {
    pub name: String,
    pub tenant: String,
    pub quota: String,
    pub service_class: ServiceClass,
    pub slo_target_ms: f64,
    pub tokens_per_s: f64,
    pub kv_bytes: u64,
    pub concurrency: u64,
    pub state: State,
}

impl Entitlement {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        tenant: &str,
        quota: &str,
        service_class: &str,
        slo_target_ms: f64,
        tokens_per_s: f64,
        kv_bytes: i64,
        concurrency: i64,
        state: &str,
    ) -> Result<Self> {
        check_name("entitlement", name)?;
        check_name("tenant", tenant)?;
        check_name("quota", quota)?;
        Ok(Self {
            name: name.to_owned(),
            tenant: tenant.to_owned(),
            quota: quota.to_owned(),
            service_class: ServiceClass::parse(service_class)?,
            slo_target_ms: positive("slo_target_ms", slo_target_ms)?,
            tokens_per_s: positive("tokens_per_s", tokens_per_s)?,
            kv_bytes: check_bytes("kv_bytes", kv_bytes)?,
            concurrency: check_count("concurrency", concurrency, 1)?,
            state: State::parse(state)?,
        })
    }
}

/// A token or KV-byte count read from a snapshot: bounded so that sums of
/// them cannot overflow.
fn snapshot_tokens(v: u64) -> Result<u64> {
    if v > 1 << 56 {
        return Err(crate::error::Error::Snapshot(format!(
            "count {v} out of range"
        )));
    }
    Ok(v)
}

fn checked_sum(mut xs: impl Iterator<Item = u64>) -> Result<u64> {
    xs.try_fold(0u64, |s, x| s.checked_add(x))
        .ok_or_else(|| crate::error::Error::Snapshot("counts overflow".into()))
}

/// Equation 1: the priority weight from its parts.
pub fn priority_weight(
    class: ServiceClass,
    slo_target_ms: f64,
    quota_mean_slo_ms: f64,
    burst: f64,
    debt: f64,
) -> f64 {
    class.weight()
        / (1.0 + ALPHA_SLO * slo_target_ms / quota_mean_slo_ms)
        / (1.0 + ALPHA_BURST * burst)
        * (1.0 + ALPHA_DEBT * debt)
}

/// One admission decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Admission {
    pub admitted: bool,
    /// HTTP status: 200 admitted, 401 unknown entitlement, 403 not bound,
    /// 413 larger than the entitlement's whole token budget, 429 throttled.
    pub status: u16,
    pub reason: &'static str,
    pub retry_after_s: Option<f64>,
    pub ticket: Option<u64>,
    /// The entitlement's priority weight when decided (0 when unknown).
    pub priority: f64,
}

impl Admission {
    fn rejected(status: u16, reason: &'static str, retry: Option<f64>, priority: f64) -> Self {
        Self {
            admitted: false,
            status,
            reason,
            retry_after_s: retry.map(|r| r.max(MIN_RETRY_AFTER_S)),
            ticket: None,
            priority,
        }
    }
}

/// An admitted request still in flight.
#[derive(Debug, Clone, Copy, PartialEq)]
struct InFlight {
    admitted_at: f64,
    tokens: u64,
    kv: u64,
}

/// One charge in an entitlement's rolling token window.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Charge {
    at: f64,
    ticket: u64,
    tokens: u64,
}

/// What the controller learns about an entitlement.
#[derive(Debug, Clone, PartialEq)]
struct EntState {
    spec: Entitlement,
    quota: usize,
    in_flight: BTreeMap<u64, InFlight>,
    tokens_in_flight: u64,
    kv_in_flight: u64,
    window: VecDeque<Charge>,
    window_tokens: u64,
    served_rate: f64,
    served_at: Option<f64>,
    debt: f64,
    burst: f64,
    latency_s: Option<f64>,
    priority: f64,
}

#[derive(Debug, Clone, PartialEq)]
struct QuotaState {
    spec: Quota,
    in_flight: u64,
    kv_in_flight: u64,
    mean_slo_ms: f64,
}

/// The admission layer of one gateway: quotas, entitlements and their state.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionController {
    quotas: Vec<QuotaState>,
    ents: Vec<EntState>,
    default_max_tokens: u64,
    window_s: f64,
    next_seq: u64,
    clock: f64,
}

/// A summary of one entitlement's state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EntitlementStats {
    pub in_flight: u64,
    pub window_tokens: u64,
    pub served_tokens_per_s: f64,
    pub debt: f64,
    pub burst: f64,
    pub priority: f64,
}

impl AdmissionController {
    pub fn new(
        quotas: Vec<Quota>,
        entitlements: Vec<Entitlement>,
        default_max_tokens: i64,
        window_s: f64,
    ) -> Result<Self> {
        if quotas.is_empty() {
            return Err(invalid("at least one quota is required"));
        }
        if entitlements.len() >= MAX_ENTITLEMENTS {
            return Err(invalid(format!(
                "at most {} entitlements",
                MAX_ENTITLEMENTS - 1
            )));
        }
        for (i, p) in quotas.iter().enumerate() {
            if quotas[..i].iter().any(|q| q.name == p.name) {
                return Err(invalid(format!("duplicate quota name {:?}", p.name)));
            }
        }
        let mut ents = Vec::with_capacity(entitlements.len());
        for (i, e) in entitlements.into_iter().enumerate() {
            if ents.iter().any(|s: &EntState| s.spec.name == e.name) {
                return Err(invalid(format!("duplicate entitlement name {:?}", e.name)));
            }
            let quota = quotas
                .iter()
                .position(|p| p.name == e.quota)
                .ok_or_else(|| unknown("quota", e.quota.as_str()))?;
            debug_assert!(i < MAX_ENTITLEMENTS);
            ents.push(EntState {
                served_rate: e.tokens_per_s,
                spec: e,
                quota,
                in_flight: BTreeMap::new(),
                tokens_in_flight: 0,
                kv_in_flight: 0,
                window: VecDeque::new(),
                window_tokens: 0,
                served_at: None,
                debt: 0.0,
                burst: 0.0,
                latency_s: None,
                priority: 0.0,
            });
        }
        let mut c = Self {
            quotas: quotas
                .into_iter()
                .map(|spec| QuotaState {
                    spec,
                    in_flight: 0,
                    kv_in_flight: 0,
                    mean_slo_ms: 0.0,
                })
                .collect(),
            ents,
            default_max_tokens: check_count("default_max_tokens", default_max_tokens, 1)?,
            window_s: positive("window_s", window_s)?,
            next_seq: 1,
            clock: f64::NEG_INFINITY,
        };
        for p in 0..c.quotas.len() {
            c.refresh_quota(p);
        }
        Ok(c)
    }

    pub fn quotas(&self) -> impl Iterator<Item = &Quota> {
        self.quotas.iter().map(|p| &p.spec)
    }
    pub fn entitlements(&self) -> impl Iterator<Item = &Entitlement> {
        self.ents.iter().map(|e| &e.spec)
    }
    pub fn default_max_tokens(&self) -> u64 {
        self.default_max_tokens
    }
    pub fn window_s(&self) -> f64 {
        self.window_s
    }

    fn ent_index(&self, name: &str) -> Result<usize> {
        self.ents
            .iter()
            .position(|e| e.spec.name == name)
            .ok_or_else(|| unknown("entitlement", name))
    }
    fn quota_index(&self, name: &str) -> Result<usize> {
        self.quotas
            .iter()
            .position(|p| p.spec.name == name)
            .ok_or_else(|| unknown("quota", name))
    }

    fn tick(&mut self, now: f64) -> Result<f64> {
        finite("now", now)?;
        self.clock = self.clock.max(now);
        Ok(self.clock)
    }

    /// Recomputes the quota-average SLO and every priority in quota `p`.
    fn refresh_quota(&mut self, p: usize) {
        let (sum, n) = self
            .ents
            .iter()
            .filter(|e| e.quota == p && e.spec.state == State::Bound)
            .fold((0.0, 0usize), |(s, n), e| (s + e.spec.slo_target_ms, n + 1));
        let mean = if n == 0 { 1.0 } else { sum / n as f64 };
        self.quotas[p].mean_slo_ms = mean;
        for e in self.ents.iter_mut().filter(|e| e.quota == p) {
            e.priority = priority_weight(
                e.spec.service_class,
                e.spec.slo_target_ms,
                mean,
                e.burst,
                e.debt,
            );
        }
    }

    /// The priority weight `w_e` of an entitlement now (equation 1).
    pub fn priority(&self, entitlement: &str) -> Result<f64> {
        Ok(self.ents[self.ent_index(entitlement)?].priority)
    }

    pub fn stats(&self, entitlement: &str) -> Result<EntitlementStats> {
        let e = &self.ents[self.ent_index(entitlement)?];
        Ok(EntitlementStats {
            in_flight: e.in_flight.len() as u64,
            window_tokens: e.window_tokens,
            served_tokens_per_s: e.served_rate,
            debt: e.debt,
            burst: e.burst,
            priority: e.priority,
        })
    }

    /// Requests in flight in a quota.
    pub fn quota_in_flight(&self, quota: &str) -> Result<u64> {
        Ok(self.quotas[self.quota_index(quota)?].in_flight)
    }

    pub fn set_state(&mut self, entitlement: &str, state: &str) -> Result<()> {
        let i = self.ent_index(entitlement)?;
        self.ents[i].spec.state = State::parse(state)?;
        let p = self.ents[i].quota;
        self.refresh_quota(p);
        Ok(())
    }

    /// Changes a quota's capacity at run time (an outage, a recovery, scaling).
    /// Requests in flight stay admitted; new ones see the new capacity.
    pub fn set_capacity(
        &mut self,
        quota: &str,
        tokens_per_s: Option<f64>,
        kv_bytes: Option<i64>,
        concurrency: Option<i64>,
    ) -> Result<()> {
        let p = self.quota_index(quota)?;
        self.quotas[p]
            .spec
            .set_capacity(tokens_per_s, kv_bytes, concurrency, None)
    }

    /// Drops the window charges that are older than `window_s`.
    fn expire_window(e: &mut EntState, now: f64, window_s: f64) {
        while let Some(c) = e.window.front() {
            if c.at + window_s > now {
                break;
            }
            e.window_tokens -= c.tokens;
            e.window.pop_front();
        }
    }

    /// Requests of `e` expected to finish per second, by Little's law:
    /// in flight / latency, the latency being the EWMA of observed ones (before
    /// any, the mean charge in flight over one slot's token rate).
    fn completion_rate(e: &EntState, quota: &Quota) -> f64 {
        let n = e.in_flight.len() as f64;
        if n == 0.0 {
            return 0.0;
        }
        let latency = e
            .latency_s
            .unwrap_or(e.tokens_in_flight as f64 / n / quota.slot_rate());
        n / latency.max(MIN_RETRY_AFTER_S)
    }

    /// The request's token charge (`input + max_tokens`, the default output
    /// bound when `max_tokens` is None), checked.
    fn charge(&self, input_tokens: i64, max_tokens: Option<i64>) -> Result<u64> {
        let input = check_count("input_tokens", input_tokens, 0)?;
        let output = match max_tokens {
            Some(m) => check_count("max_tokens", m, 1)?,
            None => self.default_max_tokens,
        };
        Ok(input + output)
    }

    /// The dense id of an entitlement, for `admit_many`.
    pub fn entitlement_id(&self, name: &str) -> Result<usize> {
        self.ent_index(name)
    }

    /// Decides one request (`max_tokens` None: the default output bound).
    /// Unknown entitlements are a 401 decision, not an error; bad numbers are
    /// an error and change nothing.
    pub fn admit(
        &mut self,
        entitlement: &str,
        input_tokens: i64,
        max_tokens: Option<i64>,
        now: f64,
    ) -> Result<Admission> {
        let tokens = self.charge(input_tokens, max_tokens)?;
        let now = self.tick(now)?;
        Ok(match self.ent_index(entitlement) {
            Ok(i) => self.decide(i, tokens, now),
            Err(_) => Admission::rejected(401, "unknown-entitlement", None, 0.0),
        })
    }

    /// `admit` for a batch at one instant, in order, exactly as one by one.
    /// Everything is checked first: an error admits nothing.
    pub fn admit_many(
        &mut self,
        entitlement_ids: &[i64],
        input_tokens: &[i64],
        max_tokens: Option<&[i64]>,
        now: f64,
    ) -> Result<Vec<Admission>> {
        let n = entitlement_ids.len();
        if input_tokens.len() != n || max_tokens.is_some_and(|m| m.len() != n) {
            return Err(invalid("arrays differ in length"));
        }
        let mut batch = Vec::with_capacity(n);
        for (k, (&id, &input)) in entitlement_ids.iter().zip(input_tokens).enumerate() {
            if id < 0 || id as usize >= self.ents.len() {
                return Err(invalid(format!(
                    "entitlement id {id} is not one of the {} ids from entitlement_id()",
                    self.ents.len()
                )));
            }
            batch.push((id as usize, self.charge(input, max_tokens.map(|m| m[k]))?));
        }
        let now = self.tick(now)?;
        Ok(batch
            .into_iter()
            .map(|(i, tokens)| self.decide(i, tokens, now))
            .collect())
    }

    /// The checks of the module docs for entitlement `i`, and the admission.
    fn decide(&mut self, i: usize, tokens: u64, now: f64) -> Admission {
        let window_s = self.window_s;
        let e = &mut self.ents[i];
        let quota = &self.quotas[e.quota];
        let w = e.priority;
        if e.spec.state != State::Bound {
            return Admission::rejected(403, e.spec.state.as_str(), None, w);
        }
        let kv = tokens.saturating_mul(quota.spec.kv_bytes_per_token);
        let quota_room = quota.in_flight < quota.spec.concurrency
            && quota.kv_in_flight.saturating_add(kv) <= quota.spec.kv_bytes;
        let may_burst = quota_room && e.spec.service_class.can_burst();

        if e.in_flight.len() as u64 >= e.spec.concurrency && !may_burst {
            let retry = 1.0 / Self::completion_rate(e, &quota.spec);
            return Admission::rejected(429, "concurrency", Some(retry), w);
        }

        Self::expire_window(e, now, window_s);
        let limit = e.spec.tokens_per_s * window_s;
        let excess = (e.window_tokens + tokens) as f64 - limit;
        if excess > 0.0 && !may_burst {
            if tokens as f64 > limit {
                return Admission::rejected(413, "exceeds-token-budget", None, w);
            }
            let mut freed = 0.0;
            let mut retry = window_s;
            for c in &e.window {
                freed += c.tokens as f64;
                if freed >= excess {
                    retry = c.at + window_s - now;
                    break;
                }
            }
            return Admission::rejected(429, "token-budget", Some(retry), w);
        }

        if !quota_room {
            let p = e.quota;
            let mut lowest = f64::INFINITY;
            let mut rate = 0.0;
            for o in self.ents.iter().filter(|o| o.quota == p) {
                if !o.in_flight.is_empty() {
                    lowest = lowest.min(o.priority);
                    rate += Self::completion_rate(o, &self.quotas[p].spec);
                }
            }
            if w <= lowest {
                let retry = (rate > 0.0).then(|| 1.0 / rate);
                return Admission::rejected(429, "quota-contention", retry, w);
            }
        }

        let ticket = (self.next_seq << TICKET_ENT_BITS) | i as u64;
        self.next_seq += 1;
        let e = &mut self.ents[i];
        e.in_flight.insert(
            ticket,
            InFlight {
                admitted_at: now,
                tokens,
                kv,
            },
        );
        e.tokens_in_flight += tokens;
        e.kv_in_flight += kv;
        e.window.push_back(Charge {
            at: now,
            ticket,
            tokens,
        });
        e.window_tokens += tokens;
        let quota = &mut self.quotas[e.quota];
        quota.in_flight += 1;
        quota.kv_in_flight += kv;
        Admission {
            admitted: true,
            status: 200,
            reason: "admitted",
            retry_after_s: None,
            ticket: Some(ticket),
            priority: w,
        }
    }

    /// Ends an admitted request with what it really used: releases its slot,
    /// charges its real tokens to the window, and updates the served rate,
    /// the debt (equation 2), the burst intensity (equation 3), the latency
    /// estimate and the priority. `NotInFlight` for a ticket not in flight.
    pub fn complete(
        &mut self,
        ticket: u64,
        actual_input: i64,
        actual_output: i64,
        latency_s: f64,
        now: f64,
    ) -> Result<()> {
        let actual = check_count("actual_input", actual_input, 0)?
            + check_count("actual_output", actual_output, 0)?;
        let latency_s = non_negative("latency_s", latency_s)?;
        finite("now", now)?;
        let i = (ticket & (MAX_ENTITLEMENTS as u64 - 1)) as usize;
        if self
            .ents
            .get(i)
            .is_none_or(|e| !e.in_flight.contains_key(&ticket))
        {
            return Err(not_in_flight(format!(
                "complete: ticket {ticket} is not in flight"
            )));
        }
        let now = self.tick(now)?;
        let window_s = self.window_s;
        let e = &mut self.ents[i];
        let spec = &e.spec;

        let decay = e.served_at.map_or(1.0, |t| (-(now - t) / window_s).exp());
        e.served_rate = e.served_rate * decay + actual as f64 / window_s;
        e.served_at = Some(now);
        let over = |used: f64, base: f64| (used / base - 1.0).max(0.0);
        let delta = over(e.served_rate, spec.tokens_per_s)
            + over(e.kv_in_flight as f64, spec.kv_bytes as f64)
            + over(e.in_flight.len() as f64, spec.concurrency as f64);
        e.burst = GAMMA_BURST * e.burst + (1.0 - GAMMA_BURST) * delta;
        if spec.service_class.has_baseline() {
            let gap = (spec.tokens_per_s - e.served_rate) / spec.tokens_per_s;
            e.debt = GAMMA_DEBT * e.debt + (1.0 - GAMMA_DEBT) * gap;
        }
        e.latency_s = Some(match e.latency_s {
            Some(l) => GAMMA_LATENCY * l + (1.0 - GAMMA_LATENCY) * latency_s,
            None => latency_s,
        });

        self.give_back(i, ticket, actual);
        let e = &mut self.ents[i];
        let mean = self.quotas[e.quota].mean_slo_ms;
        e.priority = priority_weight(
            e.spec.service_class,
            e.spec.slo_target_ms,
            mean,
            e.burst,
            e.debt,
        );
        Ok(())
    }

    /// Ends an admitted request that was never served (it left flow
    /// control's queue: expired, displaced, cancelled, drained): its slot
    /// and its window charge are given back, and nothing is learned (the
    /// served rate, debt, burst, latency and priority stay as they were).
    /// `NotInFlight` for a ticket not in flight.
    pub fn release(&mut self, ticket: u64, now: f64) -> Result<()> {
        finite("now", now)?;
        let i = (ticket & (MAX_ENTITLEMENTS as u64 - 1)) as usize;
        if self
            .ents
            .get(i)
            .is_none_or(|e| !e.in_flight.contains_key(&ticket))
        {
            return Err(not_in_flight(format!(
                "release: ticket {ticket} is not in flight"
            )));
        }
        self.tick(now)?;
        self.give_back(i, ticket, 0);
        Ok(())
    }

    /// Takes `ticket` of entitlement `i` out of flight, its window charge
    /// set to `actual` tokens.
    fn give_back(&mut self, i: usize, ticket: u64, actual: u64) {
        let e = &mut self.ents[i];
        if let Some(req) = e.in_flight.remove(&ticket) {
            e.tokens_in_flight -= req.tokens;
            e.kv_in_flight -= req.kv;
            if let Ok(k) = e.window.binary_search_by_key(&ticket, |c| c.ticket) {
                e.window_tokens = e.window_tokens - e.window[k].tokens + actual;
                e.window[k].tokens = actual;
            }
            let quota = &mut self.quotas[e.quota];
            quota.in_flight -= 1;
            quota.kv_in_flight -= req.kv;
        }
    }

    /// The preemptible requests to terminate now: in every quota holding more
    /// requests than its concurrency while protected (never-shrunk) classes
    /// have requests in flight, the overshoot's worth of preemptible requests,
    /// lowest priority first, then the youngest (least work lost). Changes
    /// nothing: the caller terminates them and calls `complete` for each.
    pub fn evictions(&self, now: f64) -> Result<Vec<u64>> {
        finite("now", now)?;
        let mut out = Vec::new();
        for (p, quota) in self.quotas.iter().enumerate() {
            let over = quota.in_flight.saturating_sub(quota.spec.concurrency) as usize;
            let protected = self.ents.iter().any(|e| {
                e.quota == p
                    && e.spec.service_class.shrink() == Shrink::Never
                    && !e.in_flight.is_empty()
            });
            if over == 0 || !protected {
                continue;
            }
            let mut victims: Vec<(f64, f64, u64)> = self
                .ents
                .iter()
                .filter(|e| e.quota == p && e.spec.service_class.shrink() == Shrink::Evict)
                .flat_map(|e| {
                    e.in_flight
                        .iter()
                        .map(move |(&t, r)| (e.priority, now - r.admitted_at, t))
                })
                .collect();
            victims.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
            out.extend(victims.into_iter().take(over).map(|v| v.2));
        }
        Ok(out)
    }

    /// Carries what `old` learned into this controller (a reload with a new
    /// configuration): for every entitlement of both, by name, its requests in
    /// flight, window charges, served rate, debt, burst and latency; the
    /// ticket counter and clock move forward to `old`'s. Capacities and states
    /// stay this controller's. Returns `(old ticket, new ticket)` for the
    /// tickets whose number changed (the entitlement's index moved); requests
    /// of entitlements this controller does not have are dropped.
    pub fn carry_over(&mut self, old: &AdmissionController) -> Vec<(u64, u64)> {
        let mut moved = Vec::new();
        for o in &old.ents {
            let Ok(i) = self.ent_index(&o.spec.name) else {
                continue;
            };
            let renumber = |t: u64| (t & !(MAX_ENTITLEMENTS as u64 - 1)) | i as u64;
            let e = &mut self.ents[i];
            e.in_flight = o
                .in_flight
                .iter()
                .map(|(&t, r)| (renumber(t), *r))
                .collect();
            moved.extend(
                o.in_flight
                    .keys()
                    .filter(|&&t| renumber(t) != t)
                    .map(|&t| (t, renumber(t))),
            );
            e.window = o
                .window
                .iter()
                .map(|c| Charge {
                    ticket: renumber(c.ticket),
                    ..*c
                })
                .collect();
            e.tokens_in_flight = o.tokens_in_flight;
            e.kv_in_flight = o.kv_in_flight;
            e.window_tokens = o.window_tokens;
            e.served_rate = o.served_rate;
            e.served_at = o.served_at;
            e.debt = o.debt;
            e.burst = o.burst;
            e.latency_s = o.latency_s;
            let quota = &mut self.quotas[e.quota];
            quota.in_flight += e.in_flight.len() as u64;
            quota.kv_in_flight += e.kv_in_flight;
        }
        self.next_seq = self.next_seq.max(old.next_seq);
        self.clock = self.clock.max(old.clock);
        for p in 0..self.quotas.len() {
            self.refresh_quota(p);
        }
        moved
    }

    const MAGIC: &'static [u8; 4] = b"RCAD";
    const VERSION: u16 = 1;

    /// Everything: specs, capacities, states, windows, requests in flight.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(Self::MAGIC, Self::VERSION);
        w.u64(self.default_max_tokens)
            .f64(self.window_s)
            .u64(self.next_seq)
            .f64(self.clock)
            .u64(self.quotas.len() as u64);
        for p in &self.quotas {
            let s = &p.spec;
            w.str(&s.name)
                .f64(s.tokens_per_s)
                .u64(s.kv_bytes)
                .u64(s.concurrency)
                .u64(s.kv_bytes_per_token);
        }
        w.u64(self.ents.len() as u64);
        for e in &self.ents {
            let s = &e.spec;
            w.str(&s.name)
                .str(&s.tenant)
                .str(&s.quota)
                .u8(s.service_class.index())
                .f64(s.slo_target_ms)
                .f64(s.tokens_per_s)
                .u64(s.kv_bytes)
                .u64(s.concurrency)
                .u8(s.state.index())
                .f64(e.served_rate)
                .f64(e.served_at.unwrap_or(f64::NAN))
                .f64(e.debt)
                .f64(e.burst)
                .f64(e.latency_s.unwrap_or(f64::NAN))
                .u64(e.in_flight.len() as u64);
            for (&t, r) in &e.in_flight {
                w.u64(t).f64(r.admitted_at).u64(r.tokens).u64(r.kv);
            }
            w.u64(e.window.len() as u64);
            for c in &e.window {
                w.f64(c.at).u64(c.ticket).u64(c.tokens);
            }
        }
        w.finish()
    }

    /// Restores `to_bytes` exactly; every field is checked as on construction,
    /// and bytes that fail a check are `Error::Snapshot`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        restore(
            bytes,
            Self::MAGIC,
            Self::VERSION,
            "AdmissionController",
            Self::read,
        )
    }

    fn read(r: &mut Reader<'_>) -> Result<Self> {
        let default_max_tokens = r.u64()? as i64;
        let window_s = r.f64()?;
        let next_seq = r.u64()?;
        if next_seq >= 1 << (64 - TICKET_ENT_BITS) {
            return Err(crate::error::Error::Snapshot(
                "ticket counter out of range".into(),
            ));
        }
        let clock = r.f64()?;
        let n = r.count(36)?;
        let mut quotas = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.str()?;
            let (t, kv, c, per) = (r.f64()?, r.u64()?, r.u64()?, r.u64()?);
            quotas.push(Quota::new(&name, t, kv as i64, c as i64, per as i64)?);
        }
        let n = r.count(90)?;
        let mut specs = Vec::with_capacity(n);
        let mut learned = Vec::with_capacity(n);
        for _ in 0..n {
            let (name, tenant, quota) = (r.str()?, r.str()?, r.str()?);
            let class = *ServiceClass::ALL
                .get(r.u8()? as usize)
                .ok_or_else(|| crate::error::Error::Snapshot("bad service class".into()))?;
            let (slo, tps, kv, conc) = (r.f64()?, r.f64()?, r.u64()?, r.u64()?);
            let state = *State::ALL
                .get(r.u8()? as usize)
                .ok_or_else(|| crate::error::Error::Snapshot("bad state".into()))?;
            specs.push(Entitlement::new(
                &name,
                &tenant,
                &quota,
                class.as_str(),
                slo,
                tps,
                kv as i64,
                conc as i64,
                state.as_str(),
            )?);
            let (rate, at, debt, burst, lat) = (r.f64()?, r.f64()?, r.f64()?, r.f64()?, r.f64()?);
            let mut in_flight = BTreeMap::new();
            for _ in 0..r.count(32)? {
                let t = r.u64()?;
                let req = InFlight {
                    admitted_at: r.f64()?,
                    tokens: snapshot_tokens(r.u64()?)?,
                    kv: snapshot_tokens(r.u64()?)?,
                };
                in_flight.insert(t, req);
            }
            let mut window = VecDeque::new();
            for _ in 0..r.count(24)? {
                window.push_back(Charge {
                    at: r.f64()?,
                    ticket: r.u64()?,
                    tokens: snapshot_tokens(r.u64()?)?,
                });
            }
            learned.push((rate, at, debt, burst, lat, in_flight, window));
        }
        let mut c = Self::new(quotas, specs, default_max_tokens, window_s)?;
        c.next_seq = next_seq;
        c.clock = clock;
        for (i, (rate, at, debt, burst, lat, in_flight, window)) in learned.into_iter().enumerate()
        {
            let e = &mut c.ents[i];
            e.served_rate = rate;
            e.served_at = (!at.is_nan()).then_some(at);
            e.debt = debt;
            e.burst = burst;
            e.latency_s = (!lat.is_nan()).then_some(lat);
            e.tokens_in_flight = checked_sum(in_flight.values().map(|r| r.tokens))?;
            e.kv_in_flight = checked_sum(in_flight.values().map(|r| r.kv))?;
            e.window_tokens = checked_sum(window.iter().map(|c| c.tokens))?;
            let quota = &mut c.quotas[e.quota];
            quota.in_flight += in_flight.len() as u64;
            quota.kv_in_flight = checked_sum([quota.kv_in_flight, e.kv_in_flight].into_iter())?;
            e.in_flight = in_flight;
            e.window = window;
        }
        for p in 0..c.quotas.len() {
            c.refresh_quota(p);
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(concurrency: i64) -> Quota {
        Quota::new("p", 240.0, 1 << 30, concurrency, 0).expect("quota")
    }

    fn ent(name: &str, class: &str, slo: f64, tps: f64, conc: i64, state: &str) -> Entitlement {
        Entitlement::new(name, "t", "p", class, slo, tps, 1 << 20, conc, state).expect("ent")
    }

    fn ticket(c: &mut AdmissionController, e: &str, input: i64, max: i64, now: f64) -> u64 {
        let a = c.admit(e, input, Some(max), now).expect("admit");
        a.ticket.expect("admitted")
    }

    fn paper_quota() -> AdmissionController {
        AdmissionController::new(
            vec![quota(16)],
            vec![
                ent("copilot", "elastic", 500.0, 75.0, 5, "bound"),
                ent("synth", "elastic", 30_000.0, 75.0, 5, "bound"),
                ent("reports", "elastic", 5_000.0, 75.0, 5, "pending"),
            ],
            4096,
            60.0,
        )
        .expect("controller")
    }

    #[test]
    fn a_release_gives_back_the_slot_and_charge_and_learns_nothing() {
        // Guaranteed has a baseline: a completion with no usage raises its
        // debt (it was served nothing); a release (the request never
        // reached an endpoint) leaves every learned value as it was.
        let mut c = AdmissionController::new(
            vec![quota(4)],
            vec![ent("g", "guaranteed", 1000.0, 100.0, 2, "bound")],
            4096,
            60.0,
        )
        .expect("controller");
        let served = ticket(&mut c, "g", 100, 50, 0.0);
        c.complete(served, 100, 50, 0.5, 1.0).expect("complete");
        let before = c.stats("g").expect("stats");
        let t = ticket(&mut c, "g", 1000, 1000, 2.0);
        assert_eq!(c.stats("g").expect("stats").window_tokens, 150 + 2000);
        assert_eq!(c.quota_in_flight("p").expect("p"), 1);
        c.release(t, 3.0).expect("release");
        let after = c.stats("g").expect("stats");
        assert_eq!(after, before, "nothing learned, nothing charged");
        assert_eq!(c.quota_in_flight("p").expect("p"), 0);
        assert!(c.release(t, 3.0).is_err(), "twice: not in flight");
        assert!(c.complete(t, 0, 0, 0.0, 3.0).is_err());
        // What a completion with no usage would have done instead.
        let t = ticket(&mut c, "g", 1000, 1000, 4.0);
        c.complete(t, 0, 0, 0.0, 5.0).expect("complete");
        assert!(c.stats("g").expect("stats").debt > after.debt);
    }

    #[test]
    fn paper_priorities() {
        // 100 / (1 + 2 * 500 / 15250) and 100 / (1 + 2 * 30000 / 15250).
        let c = paper_quota();
        let copilot = c.priority("copilot").expect("w");
        let synth = c.priority("synth").expect("w");
        assert!((copilot - 93.846).abs() < 1e-3, "{copilot}");
        assert!((synth - 20.266).abs() < 1e-3, "{synth}");
        assert!((copilot / synth - 4.6).abs() < 0.05);
        let at_debt = priority_weight(ServiceClass::Elastic, 30_000.0, 15_250.0, 0.0, 0.775);
        assert!((at_debt - 83.2).abs() < 0.15, "{at_debt}");
        // Reports joins: the quota mean becomes (500 + 30000 + 5000) / 3.
        let mut c = c;
        c.set_state("reports", "bound").expect("state");
        let mean = 35_500.0 / 3.0;
        let expect = 100.0 / (1.0 + 2.0 * 5_000.0 / mean);
        assert!((c.priority("reports").expect("w") - expect).abs() < 1e-9);
        assert_eq!(ServiceClass::Preemptible.weight(), 0.1);
        assert!(!ServiceClass::Guaranteed.can_burst() && ServiceClass::Dedicated.can_burst());
        assert_eq!(ServiceClass::Preemptible.shrink(), Shrink::Evict);
    }

    #[test]
    fn checks_in_order_with_retry_after_from_state() {
        let mut c = AdmissionController::new(
            vec![quota(4)],
            vec![
                ent("g", "guaranteed", 1000.0, 10.0, 2, "bound"),
                ent("s", "spot", 1000.0, 1000.0, 4, "bound"),
                ent("x", "elastic", 1000.0, 10.0, 2, "expired"),
            ],
            50,
            10.0,
        )
        .expect("c");
        let a = c.admit("nobody", 1, Some(1), 0.0).expect("a");
        assert_eq!(
            (a.admitted, a.status, a.reason),
            (false, 401, "unknown-entitlement")
        );
        let a = c.admit("x", 1, Some(1), 0.0).expect("a");
        assert_eq!(
            (a.status, a.reason, a.retry_after_s),
            (403, "expired", None)
        );
        // Token budget of g: 10 tokens/s * 10 s = 100 tokens; the default
        // output bound (50) counts: 10 + 50 = 60 fits, a second 60 does not.
        let first = c.admit("g", 10, None, 0.0).expect("a");
        assert!(first.admitted && first.status == 200);
        let a = c.admit("g", 10, None, 2.0).expect("a");
        assert_eq!((a.status, a.reason), (429, "token-budget"));
        // The first charge leaves the window at 0 + 10 s.
        assert_eq!(a.retry_after_s, Some(8.0));
        let a = c.admit("g", 100, Some(1), 2.0).expect("a");
        assert_eq!(
            (a.status, a.reason, a.retry_after_s),
            (413, "exceeds-token-budget", None)
        );
        // Completing with fewer real tokens frees budget: 10 + 20 = 30 charged.
        c.complete(first.ticket.expect("t"), 10, 20, 1.5, 3.0)
            .expect("complete");
        let second = c.admit("g", 10, Some(30), 3.0).expect("a");
        assert!(second.admitted);
        let third = c.admit("g", 0, Some(10), 3.0).expect("a");
        assert!(third.admitted);
        // Concurrency 2 reached; guaranteed may not burst. Retry-After: two
        // requests of the observed 1.5 s latency end one per 0.75 s.
        let a = c.admit("g", 0, Some(1), 4.0).expect("a");
        assert_eq!((a.status, a.reason), (429, "concurrency"));
        assert!((a.retry_after_s.expect("r") - 0.75).abs() < 1e-12);
        // Spot fills the quota to 4; the next spot request loses to the lowest
        // priority in flight (spot's own): quota contention. No latency seen
        // for spot yet: the guess is 60 tokens / (240 tokens/s / 4 slots) =
        // 1 s, so the quota completes 2 / 1.5 + 2 / 1 requests a second.
        assert!(c.admit("s", 30, Some(30), 4.0).expect("a").admitted);
        assert!(c.admit("s", 30, Some(30), 4.0).expect("a").admitted);
        let a = c.admit("s", 30, Some(30), 5.0).expect("a");
        assert_eq!((a.status, a.reason), (429, "quota-contention"));
        let expect = 1.0 / (2.0 / 1.5 + 2.0 / 1.0);
        assert!((a.retry_after_s.expect("r") - expect).abs() < 1e-12);
        assert_eq!(c.quota_in_flight("p").expect("n"), 4);
    }

    #[test]
    fn contention_admits_higher_priority_and_evicts_preemptible() {
        let mut c = AdmissionController::new(
            vec![quota(2)],
            vec![
                ent("g", "guaranteed", 1000.0, 1000.0, 2, "bound"),
                ent("pre", "preemptible", 1000.0, 1000.0, 2, "bound"),
            ],
            50,
            10.0,
        )
        .expect("c");
        let p1 = ticket(&mut c, "pre", 1, 1, 0.0);
        let p2 = ticket(&mut c, "pre", 1, 1, 1.0);
        assert_eq!(c.evictions(1.0).expect("e"), Vec::<u64>::new());
        // Quota full; guaranteed (1000 / 3) beats preemptible (0.1 / 3).
        let g = c.admit("g", 1, Some(1), 2.0).expect("a");
        assert!(g.admitted);
        // One over capacity with a protected class in flight: evict the
        // youngest preemptible request.
        assert_eq!(c.evictions(2.0).expect("e"), vec![p2]);
        c.complete(p2, 1, 0, 1.0, 2.0).expect("c");
        assert_eq!(c.evictions(2.0).expect("e"), Vec::<u64>::new());
        assert!(c.complete(p2, 1, 0, 1.0, 2.0).is_err());
        assert!(c.complete(p1, 1, 0, 1.0, 2.0).is_ok());
    }

    #[test]
    fn debt_and_burst_follow_equations_2_and_3() {
        let mut c = AdmissionController::new(
            vec![quota(16)],
            vec![ent("e", "elastic", 1000.0, 100.0, 2, "bound")],
            50,
            10.0,
        )
        .expect("c");
        let t = ticket(&mut c, "e", 50, 50, 0.0);
        c.complete(t, 50, 50, 1.0, 1.0).expect("c");
        // Served rate starts at the baseline 100; + 100 tokens / 10 s = 110.
        let gap1 = (100.0 - 110.0) / 100.0;
        let d1 = 0.3 * gap1;
        let b1 = 0.1 * (110.0 / 100.0 - 1.0);
        let s = c.stats("e").expect("s");
        assert!((s.served_tokens_per_s - 110.0).abs() < 1e-12);
        assert!((s.debt - d1).abs() < 1e-12 && (s.burst - b1).abs() < 1e-12);
        let t = ticket(&mut c, "e", 50, 50, 10.0);
        c.complete(t, 50, 50, 1.0, 11.0).expect("c");
        let rate = 110.0 * (-1.0f64).exp() + 10.0;
        let d2 = 0.7 * d1 + 0.3 * (100.0 - rate) / 100.0;
        let s = c.stats("e").expect("s");
        assert!((s.served_tokens_per_s - rate).abs() < 1e-9);
        assert!((s.debt - d2).abs() < 1e-12);
        assert!((s.burst - 0.9 * b1).abs() < 1e-12);
        let w = priority_weight(ServiceClass::Elastic, 1000.0, 1000.0, 0.9 * b1, d2);
        assert!((c.priority("e").expect("w") - w).abs() < 1e-12);
    }

    #[test]
    fn bad_input_changes_nothing() {
        let mut c = paper_quota();
        let t = ticket(&mut c, "copilot", 5, 5, 1.0);
        let before = c.clone();
        assert!(c.admit("copilot", -1, Some(5), 2.0).is_err());
        assert!(c.admit("copilot", 1, Some(0), 2.0).is_err());
        assert!(c.admit("copilot", 1, Some(1 << 40), 2.0).is_err());
        assert!(c.admit("copilot", 1, Some(5), f64::NAN).is_err());
        assert!(c.complete(t, 1, 1, -1.0, 2.0).is_err());
        assert!(c.complete(t, 1, 1, 1.0, f64::INFINITY).is_err());
        assert!(c.complete(t + 1, 1, 1, 1.0, 2.0).is_err());
        assert!(c.set_state("copilot", "gone").is_err());
        assert!(c.set_capacity("p", Some(-1.0), None, None).is_err());
        assert!(c.set_capacity("p", None, None, Some(0)).is_err());
        assert!(c.set_capacity("nope", None, None, Some(1)).is_err());
        assert_eq!(c, before);
        assert!(Quota::new("", 1.0, 1, 1, 0).is_err());
        assert!(Quota::new("p", f64::NAN, 1, 1, 0).is_err());
        assert!(Quota::new("p", 1.0, 1, 1, -1).is_err());
        assert!(Entitlement::new("e", "t", "p", "gold", 1.0, 1.0, 1, 1, "bound").is_err());
        assert!(Entitlement::new("e", "t", "p", "spot", 0.0, 1.0, 1, 1, "bound").is_err());
        let dup = vec![
            ent("a", "spot", 1.0, 1.0, 1, "bound"),
            ent("a", "spot", 1.0, 1.0, 1, "bound"),
        ];
        assert!(AdmissionController::new(vec![quota(1)], dup, 1, 1.0).is_err());
        let mut orphan = ent("a", "spot", 1.0, 1.0, 1, "bound");
        orphan.quota = "q".into();
        assert!(matches!(
            AdmissionController::new(vec![quota(1)], vec![orphan], 1, 1.0),
            Err(crate::error::Error::UnknownName { .. })
        ));
    }

    #[test]
    fn snapshot_round_trip_is_exact() {
        let mut c = paper_quota();
        let t = ticket(&mut c, "copilot", 5, 5, 1.0);
        c.admit("synth", 7, None, 1.5).expect("a");
        c.complete(t, 5, 3, 0.7, 2.0).expect("c");
        c.set_capacity("p", None, None, Some(8)).expect("cap");
        let bytes = c.to_bytes();
        let mut back = AdmissionController::from_bytes(&bytes).expect("restore");
        assert_eq!(back, c);
        assert_eq!(back.to_bytes(), bytes);
        assert_eq!(
            back.admit("copilot", 1, Some(1), 3.0),
            c.admit("copilot", 1, Some(1), 3.0)
        );
        for cut in 0..bytes.len() {
            assert!(AdmissionController::from_bytes(&bytes[..cut]).is_err());
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(AdmissionController::from_bytes(&extra).is_err());
        // An entitlement naming a quota the snapshot lacks is a bad snapshot,
        // not an unknown name (the quota's name is "p", the only lone b'p').
        let at = bytes
            .windows(5)
            .rposition(|w| w == [1, 0, 0, 0, b'p'])
            .expect("the entitlement's quota");
        let mut orphan = bytes.clone();
        orphan[at + 4] = b'q';
        assert!(matches!(
            AdmissionController::from_bytes(&orphan),
            Err(crate::error::Error::Snapshot(_))
        ));
    }

    #[test]
    fn carry_over_keeps_requests_in_flight_under_new_tickets() {
        let mut old = paper_quota();
        let t = ticket(&mut old, "synth", 5, 5, 1.0);
        let gone = ticket(&mut old, "copilot", 5, 5, 1.0);
        // The new configuration drops copilot: synth moves from index 1 to 0.
        let mut new = AdmissionController::new(
            vec![quota(16)],
            vec![
                ent("synth", "elastic", 30_000.0, 75.0, 1, "bound"),
                ent("reports", "elastic", 5_000.0, 75.0, 5, "bound"),
            ],
            4096,
            60.0,
        )
        .expect("controller");
        let moved = new.carry_over(&old);
        assert_eq!(moved.len(), 1);
        let (from, to) = moved[0];
        assert_eq!(from, t);
        assert_eq!(new.quota_in_flight("p").expect("n"), 1);
        assert_eq!(new.stats("synth").expect("s").window_tokens, 10);
        // synth's concurrency is now 1 and its request is still in flight.
        let a = new.admit("synth", 1, Some(1), 2.0).expect("a");
        assert!(a.admitted, "the quota has room: elastic may burst");
        assert!(new.complete(to, 5, 5, 1.0, 3.0).is_ok());
        assert!(new.complete(gone, 5, 5, 1.0, 3.0).is_err());
        assert!(
            a.ticket.expect("t") > to,
            "new tickets never reuse old numbers"
        );
    }

    /// `cargo test --release -- --ignored --nocapture admit_complete_timing`
    #[test]
    #[ignore]
    fn admit_complete_timing() {
        let mut c = paper_quota();
        let n = 2_000_000u32;
        let start = std::time::Instant::now();
        for k in 0..n {
            let now = f64::from(k) * 1e-3;
            let a = c.admit("copilot", 64, Some(64), now).expect("a");
            c.complete(a.ticket.expect("t"), 64, 64, 0.5, now)
                .expect("c");
        }
        let ns = start.elapsed().as_nanos() as f64 / f64::from(n);
        println!("admit+complete: {ns:.0} ns per pair");
    }
}
