//! The in-process backend: the `AdmissionController` behind a mutex.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{latency, usage, AdmissionSpec, Ticket, Verdict};
use crate::admission::AdmissionController;
use crate::clock::monotonic;
use crate::error::Error;

/// The state of one configuration; after a reload, it forwards to the next.
enum State {
    Live {
        controller: AdmissionController,
        /// Tickets renumbered by a reload (old -> new), until completed.
        renumbered: HashMap<u64, u64>,
    },
    Moved(Arc<Mutex<State>>),
}

/// Admission state in this process.
pub struct MemoryAdmission {
    state: Arc<Mutex<State>>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock cannot leave the controller half-changed
    // (its calls check before they change), so a poisoned lock is still good.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemoryAdmission {
    pub fn new(spec: &AdmissionSpec) -> Result<Self, Error> {
        Ok(Self {
            state: Arc::new(Mutex::new(State::Live {
                controller: spec.controller()?,
                renumbered: HashMap::new(),
            })),
        })
    }

    /// Runs `f` on the live state, following reloads.
    fn with<T>(&self, f: impl FnOnce(&mut AdmissionController, &mut HashMap<u64, u64>) -> T) -> T {
        let mut at = self.state.clone();
        loop {
            let next = {
                let mut guard = lock(&at);
                match &mut *guard {
                    State::Live {
                        controller,
                        renumbered,
                    } => return f(controller, renumbered),
                    State::Moved(next) => next.clone(),
                }
            };
            at = next;
        }
    }

    pub fn admit(&self, entitlement: &str, input_tokens: u64, max_tokens: Option<u64>) -> Verdict {
        let (Ok(input), Ok(max)) = (
            i64::try_from(input_tokens),
            max_tokens.map(i64::try_from).transpose(),
        ) else {
            return Verdict::invalid();
        };
        let now = monotonic();
        self.with(|c, _| match c.admit(entitlement, input, max, now) {
            Ok(a) => Verdict::from_core(a),
            Err(_) => Verdict::invalid(),
        })
    }

    pub fn complete(&self, ticket: Ticket, input: u64, output: u64, latency_s: f64) -> bool {
        let now = monotonic();
        self.with(|c, renumbered| {
            let t = renumbered.remove(&ticket.0).unwrap_or(ticket.0);
            c.complete(t, usage(input), usage(output), latency(latency_s), now)
                .is_ok()
        })
    }

    /// Gives back a ticket never served, learning nothing
    /// (`AdmissionController::release`).
    pub fn release(&self, ticket: Ticket) -> bool {
        let now = monotonic();
        self.with(|c, renumbered| {
            let t = renumbered.remove(&ticket.0).unwrap_or(ticket.0);
            c.release(t, now).is_ok()
        })
    }

    /// Flow control's terms of `entitlement`: its priority `w_e` and its
    /// SLO target in seconds.
    pub fn flow_terms(&self, entitlement: &str) -> (Option<f64>, Option<f64>) {
        self.with(|c, _| {
            let slo_s = c
                .entitlements()
                .find(|e| e.name == entitlement)
                .map(|e| e.slo_target_ms / 1e3);
            (c.priority(entitlement).ok(), slo_s)
        })
    }

    pub fn evictions(&self) -> Vec<Ticket> {
        let now = monotonic();
        self.with(|c, _| c.evictions(now).unwrap_or_default())
            .into_iter()
            .map(Ticket)
            .collect()
    }

    pub fn in_flight(&self) -> u64 {
        self.with(|c, _| {
            let quotas: Vec<String> = c.quotas().map(|p| p.name.clone()).collect();
            quotas
                .iter()
                .map(|p| c.quota_in_flight(p).unwrap_or(0))
                .sum()
        })
    }

    /// Takes over `old`'s live state (requests in flight, windows, what it
    /// learned) into this configuration; `old` then forwards here.
    pub fn adopt(&self, old: &MemoryAdmission) -> Result<(), Error> {
        if Arc::ptr_eq(&self.state, &old.state) {
            return Ok(());
        }
        // Find old's live state, holding its lock while it moves.
        let mut at = old.state.clone();
        loop {
            if Arc::ptr_eq(&at, &self.state) {
                return Ok(()); // adopted already
            }
            let mut guard = lock(&at);
            let next = match &mut *guard {
                State::Moved(next) => next.clone(),
                State::Live {
                    controller: old_controller,
                    renumbered: old_renumbered,
                } => {
                    let mut mine = lock(&self.state);
                    let State::Live {
                        controller,
                        renumbered,
                    } = &mut *mine
                    else {
                        return Err(crate::error::invalid("this admission was adopted already"));
                    };
                    let moved: HashMap<u64, u64> =
                        controller.carry_over(old_controller).into_iter().collect();
                    // A ticket renumbered twice maps straight to its last number.
                    for (first, second) in old_renumbered.drain() {
                        renumbered.insert(first, moved.get(&second).copied().unwrap_or(second));
                    }
                    renumbered.extend(moved);
                    drop(mine);
                    *guard = State::Moved(self.state.clone());
                    return Ok(());
                }
            };
            drop(guard);
            at = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Admission, AdmissionSpec, Verdict};

    pub(crate) fn spec(concurrency: i64) -> AdmissionSpec {
        AdmissionSpec::from_json(&format!(
            r#"{{"quotas": [{{"name": "p", "tokens_per_s": 1000, "kv_bytes": 1073741824,
                 "concurrency": 16}}],
               "entitlements": [{{"name": "g", "tenant": "t", "quota": "p",
                 "service_class": "guaranteed", "slo_target_ms": 1000,
                 "tokens_per_s": 1000, "kv_bytes": 1048576, "concurrency": {concurrency}}}]}}"#
        ))
        .expect("spec")
    }

    #[tokio::test]
    async fn memory_admits_to_concurrency_and_completes_once() {
        let a = Admission::from_spec(&spec(2)).expect("admission");
        let t1 = a.admit("g", 10, Some(10), "r1").await.ticket().expect("t1");
        let t2 = a.admit("g", 10, None, "r2").await.ticket().expect("t2");
        let third = a.admit("g", 10, Some(10), "r3").await;
        assert!(
            matches!(&third, Verdict::Refused { status: 429, reason, .. } if reason == "concurrency"),
            "{third:?}"
        );
        assert_eq!(a.in_flight(), 2);
        // Usage that cannot be real still releases the ticket.
        assert!(a.complete(t1, u64::MAX, 1 << 40, f64::NAN).await);
        assert!(!a.complete(t1, 1, 1, 0.1).await);
        assert!(a.complete(t2, 1, 1, 0.1).await);
        assert_eq!(a.in_flight(), 0);
        let unknown = a.admit("nobody", 1, Some(1), "r4").await;
        assert!(matches!(unknown, Verdict::Refused { status: 401, .. }));
        let bad = a.admit("g", 1, Some(0), "r5").await;
        assert!(matches!(bad, Verdict::Refused { status: 400, .. }));
        assert_eq!(a.failures(), 0);
    }

    #[tokio::test]
    async fn adopt_carries_in_flight_tickets_over_reloads() {
        let first = Admission::from_spec(&spec(2)).expect("admission");
        let t1 = first.admit("g", 1, Some(1), "a").await.ticket().expect("t");
        let t2 = first.admit("g", 1, Some(1), "b").await.ticket().expect("t");
        // Reload with a new entitlement in front: g's tickets are renumbered.
        let mut s = spec(2);
        let mut other = s.entitlements[0].clone();
        other.name = "first".into();
        s.entitlements.insert(0, other);
        let second = Admission::from_spec(&s).expect("admission");
        second.adopt(&first).expect("adopt");
        assert_eq!(second.in_flight(), 2);
        let refused = second.admit("g", 1, Some(1), "c").await;
        assert!(matches!(refused, Verdict::Refused { status: 429, .. }));
        // A stream that began on the first configuration completes there.
        assert!(first.complete(t1, 1, 1, 0.1).await);
        assert_eq!(second.in_flight(), 1);
        // A second reload: the old ticket still finds its request.
        let third = Admission::from_spec(&spec(2)).expect("admission");
        third.adopt(&second).expect("adopt");
        assert!(first.complete(t2, 1, 1, 0.1).await);
        assert!(!first.complete(t2, 1, 1, 0.1).await);
        assert_eq!(third.in_flight(), 0);
        assert!(third.admit("g", 1, Some(1), "d").await.admitted());
    }
}
