//! Admission on the data plane: one interface over two backends.
//!
//! [`Admission::Memory`] keeps the state in this process (the
//! [`AdmissionController`](crate::admission::AdmissionController) behind a
//! mutex); [`Admission::Redis`] keeps it in Redis, shared by many replicas,
//! one atomic Lua script per operation (the scripts in this directory, also
//! used by the Python `RedisAdmission`). Both decide with the same checks,
//! priority, debt and burst (rust/admission.rs).
//!
//! Neither ever fails a call: `admit` answers a [`Verdict`], and a backend
//! failure (Redis down, stalled past `socket_timeout_s`, an error reply such
//! as OOM) goes through [`FailureMode`], is counted in `failures()` and never
//! shows an internal detail in the reason.

pub mod memory;
pub mod redis;
pub mod scripts;

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use serde::Deserialize;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::admission::{AdmissionController, Entitlement, Quota};
use crate::budget::MAX_TOKENS;
use crate::error::{invalid, Error};
use crate::serve::metrics::Metrics;

pub use crate::serve::failure::FailureMode;
pub use memory::MemoryAdmission;
pub use redis::RedisAdmission;

/// Where the state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Memory,
    Redis,
}

/// A quota of the admission layer (`Quota`'s arguments).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaSpec {
    pub name: String,
    pub tokens_per_s: f64,
    pub kv_bytes: i64,
    pub concurrency: i64,
    #[serde(default)]
    pub kv_bytes_per_token: i64,
}

/// An entitlement (`Entitlement`'s arguments).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntitlementSpec {
    pub name: String,
    pub tenant: String,
    pub quota: String,
    pub service_class: String,
    pub slo_target_ms: f64,
    pub tokens_per_s: f64,
    pub kv_bytes: i64,
    pub concurrency: i64,
    #[serde(default = "bound")]
    pub state: String,
}

fn bound() -> String {
    "bound".into()
}

/// `admission.redis` of the configuration; defaults as the Python backend's.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisSpec {
    pub url: String,
    pub prefix: String,
    /// A reservation not completed within this time (its replica died) is
    /// released by the next call on its quota.
    pub lease_s: f64,
    pub failure_mode: FailureMode,
    /// Retry-After of a 503 while Redis is unavailable (fail-closed).
    pub unavailable_retry_s: f64,
    /// Bound of every call: connecting, the script, settling lost replies.
    pub socket_timeout_s: f64,
    /// Window entries one entitlement keeps in Redis (charges close in time
    /// share one past half of them; see `scripts::Bounds`).
    pub max_window_entries: u64,
    /// Window entries of all a quota's entitlements together.
    pub max_window_entries_per_quota: u64,
    /// Void markers (request ids refused in advance) a quota keeps.
    pub max_void_markers: u64,
    /// At shutdown, how long what is owed to Redis (releases of the streams
    /// that ended, lost replies) gets to reach it.
    pub flush_timeout_s: f64,
}

impl Default for RedisSpec {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/0".into(),
            prefix: "routecore".into(),
            lease_s: 300.0,
            failure_mode: FailureMode::Closed,
            unavailable_retry_s: 1.0,
            socket_timeout_s: 0.5,
            max_window_entries: 1024,
            max_window_entries_per_quota: 16384,
            max_void_markers: 1024,
            flush_timeout_s: 5.0,
        }
    }
}

/// The `admission` section as the Python config layer hands it over
/// (`AdmissionConfig.spec`, JSON): the keys of `admission_from_config`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionSpec {
    #[serde(default)]
    pub backend: Backend,
    #[serde(default)]
    pub quotas: Vec<QuotaSpec>,
    #[serde(default)]
    pub entitlements: Vec<EntitlementSpec>,
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: i64,
    #[serde(default = "window_s")]
    pub window_s: f64,
    #[serde(default)]
    pub redis: RedisSpec,
}

fn default_max_tokens() -> i64 {
    4096
}

fn window_s() -> f64 {
    60.0
}

impl AdmissionSpec {
    pub fn from_json(json: &str) -> Result<Self, Error> {
        serde_json::from_str(json).map_err(|e| invalid(format!("admission: {e}")))
    }

    /// The quotas and entitlements, each checked as on construction.
    pub fn parts(&self) -> Result<(Vec<Quota>, Vec<Entitlement>), Error> {
        let quotas = self
            .quotas
            .iter()
            .map(|p| {
                Quota::new(
                    &p.name,
                    p.tokens_per_s,
                    p.kv_bytes,
                    p.concurrency,
                    p.kv_bytes_per_token,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ents = self
            .entitlements
            .iter()
            .map(|e| {
                Entitlement::new(
                    &e.name,
                    &e.tenant,
                    &e.quota,
                    &e.service_class,
                    e.slo_target_ms,
                    e.tokens_per_s,
                    e.kv_bytes,
                    e.concurrency,
                    &e.state,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((quotas, ents))
    }

    /// A controller of this configuration (every value checked).
    pub fn controller(&self) -> Result<AdmissionController, Error> {
        let (quotas, ents) = self.parts()?;
        AdmissionController::new(quotas, ents, self.default_max_tokens, self.window_s)
    }
}

/// An admitted request, to hand back to `complete`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);

/// One admission decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// `ticket` None: admitted unaccounted (fail-open), nothing to complete.
    Admitted { ticket: Option<Ticket> },
    /// 401 unknown entitlement, 403 not bound, 413 over the whole budget, 429
    /// throttled, 503 the state is unavailable (fail-closed).
    Refused {
        status: u16,
        reason: String,
        retry_after_s: Option<f64>,
    },
}

impl Verdict {
    fn from_core(a: crate::admission::Admission) -> Self {
        if a.admitted {
            Verdict::Admitted {
                ticket: a.ticket.map(Ticket),
            }
        } else {
            Verdict::Refused {
                status: a.status,
                reason: a.reason.to_owned(),
                retry_after_s: a.retry_after_s,
            }
        }
    }

    /// A request the backend cannot decide (bad numbers).
    fn invalid() -> Self {
        Verdict::Refused {
            status: 400,
            reason: "invalid-request".into(),
            retry_after_s: None,
        }
    }

    /// The state is unavailable: what `failure_mode` says.
    fn unavailable(mode: FailureMode, retry_after_s: f64) -> Self {
        match mode {
            FailureMode::Open => Verdict::Admitted { ticket: None },
            FailureMode::Closed => Verdict::Refused {
                status: 503,
                reason: "admission-unavailable".into(),
                retry_after_s: Some(retry_after_s),
            },
        }
    }

    pub fn admitted(&self) -> bool {
        matches!(self, Verdict::Admitted { .. })
    }

    pub fn ticket(&self) -> Option<Ticket> {
        match self {
            Verdict::Admitted { ticket } => *ticket,
            Verdict::Refused { .. } => None,
        }
    }
}

/// Usage that cannot be real is capped: a completion always releases its
/// ticket (issue 12), whatever the upstream reported.
fn usage(tokens: u64) -> i64 {
    tokens.min(MAX_TOKENS) as i64
}

fn latency(latency_s: f64) -> f64 {
    if latency_s.is_finite() && latency_s >= 0.0 {
        latency_s
    } else {
        0.0
    }
}

/// The admission layer of the data plane (one per configuration, so the
/// variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
pub enum Admission {
    Memory(MemoryAdmission),
    Redis(RedisAdmission),
}

impl Admission {
    /// The backend the spec names; every value checked. Never connects.
    pub fn from_spec(spec: &AdmissionSpec) -> Result<Self, Error> {
        Ok(match spec.backend {
            Backend::Memory => Admission::Memory(MemoryAdmission::new(spec)?),
            Backend::Redis => Admission::Redis(RedisAdmission::new(spec)?),
        })
    }

    /// Counts a remote backend's failures in `metrics` too
    /// (`routecore_faults_total{source, kind}`).
    pub fn with_metrics(self, metrics: Arc<Metrics>) -> Self {
        match self {
            Admission::Redis(r) => Admission::Redis(r.with_metrics(metrics)),
            memory => memory,
        }
    }

    /// Decides one request. `request_id` must be unique per call (the data
    /// plane makes it; never a client's header): Redis reserves under it so
    /// that a reservation whose reply was lost is voided.
    pub async fn admit(
        &self,
        entitlement: &str,
        input_tokens: u64,
        max_tokens: Option<u64>,
        request_id: &str,
    ) -> Verdict {
        match self {
            Admission::Memory(m) => m.admit(entitlement, input_tokens, max_tokens),
            Admission::Redis(r) => {
                r.admit(entitlement, input_tokens, max_tokens, request_id)
                    .await
            }
        }
    }

    /// [`admit`](Self::admit) for a caller that may be dropped while it
    /// waits (a cancelled stream): a decision not ready at once (Redis) runs
    /// on its own task on `handle`, and a ticket granted after the caller
    /// left is completed at once (see `Detached`).
    pub async fn admit_detached(
        self: &Arc<Self>,
        handle: &Handle,
        entitlement: &str,
        input_tokens: u64,
        max_tokens: u64,
        request_id: &str,
    ) -> Verdict {
        let owned = Arc::clone(self);
        let (ent, rid) = (entitlement.to_owned(), request_id.to_owned());
        let mut decision = Box::pin(async move {
            owned
                .admit(&ent, input_tokens, Some(max_tokens), &rid)
                .await
        });
        if let Some(v) = decision.as_mut().now_or_never() {
            return v;
        }
        let (tx, rx) = oneshot::channel();
        let mut waiting = Detached {
            rx,
            admission: Arc::clone(self),
            handle: handle.clone(),
            input_tokens,
        };
        let owned = Arc::clone(self);
        handle.spawn(async move {
            if let Err(verdict) = tx.send(decision.await) {
                unclaimed(owned, verdict, input_tokens).await;
            }
        });
        (&mut waiting.rx).await.unwrap_or(Verdict::Refused {
            status: 503,
            reason: "internal-error".into(),
            retry_after_s: None,
        })
    }

    /// Ends an admitted request with what it used (capped at the largest
    /// count the core takes; a bad latency counts as 0). True when this call
    /// released the ticket; completing twice never counts twice.
    pub async fn complete(
        &self,
        ticket: Ticket,
        actual_input: u64,
        actual_output: u64,
        latency_s: f64,
    ) -> bool {
        match self {
            Admission::Memory(m) => m.complete(ticket, actual_input, actual_output, latency_s),
            Admission::Redis(r) => {
                r.complete(ticket, actual_input, actual_output, latency_s)
                    .await
            }
        }
    }

    /// Gives back the ticket of a request that was never served (it left
    /// flow control's queue without reaching an endpoint): no tokens are
    /// charged and nothing is learned of it (served rate, debt, burst,
    /// latency). True when this call released the ticket.
    pub async fn release(&self, ticket: Ticket) -> bool {
        match self {
            Admission::Memory(m) => m.release(ticket),
            Admission::Redis(r) => r.release(ticket).await,
        }
    }

    /// Preemptible requests to terminate now (see `AdmissionController::evictions`).
    pub async fn evictions(&self) -> Vec<Ticket> {
        match self {
            Admission::Memory(m) => m.evictions(),
            Admission::Redis(r) => r.evictions().await,
        }
    }

    /// Requests in flight: exact in memory; for Redis, this instance's
    /// reservations not yet completed.
    /// Flow control's terms for a request of `entitlement` (its arrival's
    /// weight and deadline in the queue): its token-pool priority `w_e`
    /// (None: not known; Redis: the last one its admit script returned) and
    /// its SLO target in seconds.
    pub fn flow_terms(&self, entitlement: &str) -> (Option<f64>, Option<f64>) {
        match self {
            Admission::Memory(m) => m.flow_terms(entitlement),
            Admission::Redis(r) => r.flow_terms(entitlement),
        }
    }

    pub fn in_flight(&self) -> u64 {
        match self {
            Admission::Memory(m) => m.in_flight(),
            Admission::Redis(r) => r.in_flight(),
        }
    }

    /// Carries `old`'s state over a reload. Memory: its requests in flight and
    /// what it learned move here, and `old` forwards to this backend from now
    /// on (streams that began on it complete here). Redis: the state is
    /// shared already; lost replies still to settle move here.
    pub fn adopt(&self, old: &Admission) -> Result<(), Error> {
        match (self, old) {
            (Admission::Memory(new), Admission::Memory(old)) => new.adopt(old),
            (Admission::Redis(new), Admission::Redis(old)) => new.adopt(old),
            _ => Ok(()),
        }
    }

    /// Readies a remote backend for the first requests (see
    /// `RedisAdmission::warm`); true when warm (memory: always).
    pub async fn warm(&self) -> bool {
        match self {
            Admission::Memory(_) => true,
            Admission::Redis(r) => r.warm().await,
        }
    }

    /// What a remote backend's calls answer while it is unavailable (None:
    /// in memory, never unavailable).
    pub fn failure_mode(&self) -> Option<FailureMode> {
        match self {
            Admission::Memory(_) => None,
            Admission::Redis(r) => Some(r.failure_mode()),
        }
    }

    /// Settles what a remote backend still has to (lost admits voided, failed
    /// completions replayed) once no call has gone to it for `idle`. The
    /// data plane's reaper calls it every tick, so this happens without new
    /// traffic; with traffic each call settles a batch before its own work,
    /// so the reaper adds no call of its own (in an outage, no failure
    /// beside the requests' own).
    pub async fn reconcile_idle(&self, idle: std::time::Duration) {
        if let Admission::Redis(r) = self {
            if r.pending() > 0 && !r.called_within(idle) {
                r.reconcile().await;
            }
        }
    }

    /// Backend failures counted since construction (0 in memory).
    pub fn failures(&self) -> u64 {
        match self {
            Admission::Memory(_) => 0,
            Admission::Redis(r) => r.failures(),
        }
    }

    /// Whether a remote backend has nothing left to send (settling what it
    /// can now; see `RedisAdmission::settled`). Always true in memory.
    pub async fn settled(&self) -> bool {
        match self {
            Admission::Memory(_) => true,
            Admission::Redis(r) => r.settled().await,
        }
    }

    /// How long a shutdown waits for [`settled`](Self::settled)
    /// (`admission.redis.flush_timeout_s`; 0 in memory).
    pub fn flush_timeout(&self) -> Duration {
        match self {
            Admission::Memory(_) => Duration::ZERO,
            Admission::Redis(r) => r.flush_timeout(),
        }
    }
}

/// The caller's end of a detached decision. Dropped before the verdict is
/// read, it closes the channel: a verdict sent later comes back to the
/// deciding task (`send` fails), and one sent already is taken out here, so
/// a ticket granted to a caller that left is completed either way.
struct Detached {
    rx: oneshot::Receiver<Verdict>,
    admission: Arc<Admission>,
    handle: Handle,
    input_tokens: u64,
}

impl Drop for Detached {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok(verdict) = self.rx.try_recv() {
            let admission = Arc::clone(&self.admission);
            self.handle
                .spawn(unclaimed(admission, verdict, self.input_tokens));
        }
    }
}

/// Completes the ticket of a verdict nobody will use (nothing was served).
async fn unclaimed(admission: Arc<Admission>, verdict: Verdict, input_tokens: u64) {
    if let Verdict::Admitted { ticket: Some(t) } = verdict {
        admission.complete(t, input_tokens, 0, 0.0).await;
    }
}

#[cfg(test)]
pub(crate) mod tests;
