//! PLACEHOLDER until `dp-admission` lands its backends: the contract's
//! interface over the in-memory controller only (dp-admission owns this file).

use std::sync::Mutex;
use std::time::Instant;

use serde::Deserialize;

use crate::admission::{AdmissionController, Entitlement, TokenPool};
use crate::error::{invalid, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    Open,
    #[default]
    Closed,
}

#[derive(Debug, Clone, Deserialize)]
struct PoolSpec {
    name: String,
    tokens_per_s: f64,
    kv_bytes: i64,
    concurrency: i64,
    #[serde(default)]
    kv_bytes_per_token: i64,
}

fn active() -> String {
    "bound".into()
}

#[derive(Debug, Clone, Deserialize)]
struct EntSpec {
    name: String,
    tenant: String,
    pool: String,
    service_class: String,
    slo_target_ms: f64,
    tokens_per_s: f64,
    kv_bytes: i64,
    concurrency: i64,
    #[serde(default = "active")]
    state: String,
}

fn default_max_tokens() -> i64 {
    4096
}
fn window_s() -> f64 {
    60.0
}
fn memory() -> String {
    "memory".into()
}

#[derive(Debug, Clone, Deserialize)]
pub struct AdmissionSpec {
    #[serde(default = "memory")]
    backend: String,
    #[serde(default)]
    pools: Vec<PoolSpec>,
    #[serde(default)]
    entitlements: Vec<EntSpec>,
    #[serde(default = "default_max_tokens")]
    default_max_tokens: i64,
    #[serde(default = "window_s")]
    window_s: f64,
}

impl AdmissionSpec {
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        serde_json::from_value(v.clone()).map_err(|e| invalid(format!("admission: {e}")))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Admitted {
        ticket: Option<Ticket>,
    },
    Refused {
        status: u16,
        reason: String,
        retry_after_s: Option<f64>,
    },
}

pub struct MemoryAdmission {
    controller: Mutex<AdmissionController>,
    epoch: Instant,
}

pub enum Admission {
    Memory(MemoryAdmission),
}

impl Admission {
    pub fn from_spec(spec: &AdmissionSpec) -> Result<Self> {
        if spec.backend != "memory" {
            return Err(invalid("admission.backend: only memory is built in yet"));
        }
        let pools = spec
            .pools
            .iter()
            .map(|p| {
                TokenPool::new(
                    &p.name,
                    p.tokens_per_s,
                    p.kv_bytes,
                    p.concurrency,
                    p.kv_bytes_per_token,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let ents = spec
            .entitlements
            .iter()
            .map(|e| {
                Entitlement::new(
                    &e.name,
                    &e.tenant,
                    &e.pool,
                    &e.service_class,
                    e.slo_target_ms,
                    e.tokens_per_s,
                    e.kv_bytes,
                    e.concurrency,
                    &e.state,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let c = AdmissionController::new(pools, ents, spec.default_max_tokens, spec.window_s)?;
        Ok(Admission::Memory(MemoryAdmission {
            controller: Mutex::new(c),
            epoch: Instant::now(),
        }))
    }

    fn memory(&self) -> (std::sync::MutexGuard<'_, AdmissionController>, f64) {
        let Admission::Memory(m) = self;
        (
            m.controller.lock().unwrap_or_else(|e| e.into_inner()),
            m.epoch.elapsed().as_secs_f64(),
        )
    }

    pub async fn admit(
        &self,
        entitlement: &str,
        input_tokens: u64,
        max_tokens: Option<u64>,
        _request_id: &str,
    ) -> Verdict {
        let (mut c, now) = self.memory();
        let input = input_tokens.min(i64::MAX as u64) as i64;
        let max = max_tokens.map(|m| m.min(i64::MAX as u64) as i64);
        match c.admit(entitlement, input, max, now) {
            Ok(a) if a.admitted => Verdict::Admitted {
                ticket: a.ticket.map(Ticket),
            },
            Ok(a) => Verdict::Refused {
                status: a.status,
                reason: a.reason.into(),
                retry_after_s: a.retry_after_s,
            },
            Err(_) => Verdict::Refused {
                status: 400,
                reason: "invalid-request".into(),
                retry_after_s: None,
            },
        }
    }

    pub async fn complete(
        &self,
        ticket: Ticket,
        actual_input: u64,
        actual_output: u64,
        latency_s: f64,
    ) -> bool {
        let (mut c, now) = self.memory();
        c.complete(
            ticket.0,
            actual_input.min(1 << 30) as i64,
            actual_output.min(1 << 30) as i64,
            latency_s.max(0.0),
            now,
        )
        .is_ok()
    }

    pub fn pool_in_flight(&self, pool: &str) -> Option<u64> {
        self.memory().0.pool_in_flight(pool).ok()
    }

    pub fn in_flight(&self) -> u64 {
        let (c, _) = self.memory();
        let names: Vec<String> = c.pools().map(|p| p.name.clone()).collect();
        names.iter().filter_map(|n| c.pool_in_flight(n).ok()).sum()
    }

    pub fn adopt(&self, old: &Admission) -> Result<()> {
        let bytes = old.memory().0.to_bytes();
        let restored = AdmissionController::from_bytes(&bytes)?;
        let (mut c, _) = self.memory();
        // Keep the new configuration; in-flight state is not carried in this placeholder
        // unless the configurations are the same.
        if restored.pools().count() == c.pools().count() {
            *c = restored;
        }
        Ok(())
    }

    pub fn failures(&self) -> u64 {
        0
    }
}
