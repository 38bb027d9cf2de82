//! One request's way through the data plane, in the order of
//! [`crate::dispatch`]: route (the pool: the budget's decision, moved to a
//! pool serving the request's model) -> admit (a valid fairness id, the
//! saturation gate for sheddable requests, the admission backend) -> queue
//! (flow control: wait in the pool's queue while it has no room; at once
//! without `flow_control`) -> pick (the pool's
//! [`Chooser`](super::Chooser): its plugins learn only here) -> lease.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use super::{
    lock, Ask, Choice, Engine, Key, Lease, Outcome, Reject, Routed, Shared, Ticket, Verdict,
    ANONYMOUS,
};
use crate::budget::Decision;
use crate::dispatch::{dispatch, Steps};
use crate::error::{Error, Result};
use crate::flow::{Arrival, Refusal, MIN_WEIGHT};
use crate::pick::Recorded;
use crate::serve::flow::{Entry, Exit};

/// How the pool was chosen.
pub(super) enum Routing {
    /// By the token budget (not counted yet when it names no pool).
    Decided(Decision),
    /// The default pool, without a budget decision.
    Default,
}

/// What a step answers instead of going on.
enum Refused {
    Reject(Reject),
    Error(Error),
}

impl From<Error> for Refused {
    fn from(e: Error) -> Self {
        Refused::Error(e)
    }
}

/// What admission gave the request.
struct Admitted {
    ticket: Option<Ticket>,
    id: u128,
    request_id: String,
    /// The VTC user when it is not the tenant's name ([`Engine::vtc_user`]).
    scoped: Option<String>,
    /// Its quota is still to be taken when it is let out of its pool's
    /// queue: the admission refusal that made it wait (its quota at its
    /// limit), or an empty reason when it gave its ticket back to wait (a
    /// quota counts only dispatched requests).
    reserve: Option<String>,
}

/// Admission refusals that flow control turns into a wait: the quota at its
/// limit (the entitlement's concurrency, or the shared quota's).
fn quota_at_limit(status: u16, reason: &str) -> bool {
    status == 429 && matches!(reason, "concurrency" | "quota-contention")
}

/// Tells a pool's queue, when dropped, that the request it let out is placed.
struct Placed<'a>(&'a crate::serve::flow::PoolFlow);

impl Drop for Placed<'_> {
    fn drop(&mut self) {
        self.0.placed();
    }
}

/// One request's steps on this data plane.
struct Request<'a> {
    engine: &'a Arc<Engine>,
    shared: &'a Shared,
    routing: &'a Routing,
    tenant: Option<usize>,
    /// False: the admission backend is not asked (`failure_mode: open`
    /// after routing failed).
    admit: bool,
    est: (u64, u64),
    ask: Ask<'a>,
    now: f64,
    /// Let out of its pool's queue: placed by the pick.
    let_out: Option<Placed<'a>>,
}

impl<'a> Request<'a> {
    /// The entitlement admission is asked for (None: not accounted).
    fn entitlement(&self) -> Option<&'a str> {
        let engine = self.engine;
        self.tenant
            .and_then(|t| engine.tenants[t].entitlement.as_deref())
            .filter(|e| engine.entitlement_live(e, self.shared))
    }

    /// Takes the quota of a request let out of its pool's queue (`reserve`):
    /// Ok(None) when admitted (or not accounted), Ok(Some(reason)) when the
    /// quota is still at its limit (it waits again), Err for any other
    /// refusal.
    async fn reserve(
        &mut self,
        admitted: &mut Admitted,
        attempt: u32,
    ) -> std::result::Result<Option<String>, Refused> {
        let (Some(admission), Some(ent)) = (self.engine.admission.as_ref(), self.entitlement())
        else {
            return Ok(None);
        };
        self.shared.fault("admission")?;
        // A fresh id per try: a remote backend's retry-by-id must not find
        // the ticket given back before the wait.
        let request_id = format!("{}:{attempt}", admitted.request_id);
        let (est_in, est_out) = self.est;
        let verdict = admission
            .admit_detached(&self.shared.handle, ent, est_in, est_out, &request_id)
            .await;
        match verdict {
            Verdict::Admitted { ticket } => {
                admitted.ticket = ticket;
                Ok(None)
            }
            Verdict::Refused { status, reason, .. } if quota_at_limit(status, &reason) => {
                Ok(Some(reason))
            }
            Verdict::Refused {
                status,
                reason,
                retry_after_s,
            } => Err(self.not_admitted(status, &reason, retry_after_s)),
        }
    }

    /// Admission's refusal, answered to the client.
    fn not_admitted(&self, status: u16, reason: &str, retry_after_s: Option<f64>) -> Refused {
        let message = format!("not admitted: {reason}");
        self.reject(status, reason, message, retry_after_s.unwrap_or(0.0))
    }

    fn reject(&self, status: u16, reason: &str, message: String, retry: f64) -> Refused {
        Refused::Reject(
            self.engine
                .refuse(self.tenant, status, reason, message, retry),
        )
    }
}

impl Steps for Request<'_> {
    type Pool = usize;
    type Admitted = Admitted;
    type Picked = (Vec<usize>, Recorded, Option<usize>);
    type Refused = Refused;

    fn route(&mut self) -> std::result::Result<usize, Refused> {
        let engine = self.engine;
        let d = match self.routing {
            Routing::Default => {
                engine.router.start(engine.default_pool)?;
                return Ok(engine.default_pool);
            }
            Routing::Decided(d) => d,
        };
        let Some(pool) = d.pool else {
            let message = format!(
                "request needs {} tokens, more than any pool's context",
                d.est_total_tokens
            );
            return Err(self.reject(400, d.reason.as_str(), message, 0.0));
        };
        let model = self.ask.model;
        if engine.spec.pools[pool].serves(model) {
            return Ok(pool);
        }
        engine.router.complete(pool)?;
        match engine.pool_for_model(model, d.est_total_tokens) {
            Ok(p) => {
                engine.router.start(p)?;
                Ok(p)
            }
            Err(status) => {
                let name = model.unwrap_or("");
                let (reason, message) = if status == 404 {
                    (
                        "model-not-found",
                        format!("The model `{name}` does not exist."),
                    )
                } else {
                    (
                        "context-too-long",
                        format!(
                            "request needs {} tokens, more than the context of any pool \
                             serving `{name}`",
                            d.est_total_tokens
                        ),
                    )
                };
                Err(self.reject(status, reason, message, 0.0))
            }
        }
    }

    async fn admit(&mut self, &pool: &usize) -> std::result::Result<Admitted, Refused> {
        let (engine, shared, hints) = (self.engine, self.shared, self.ask.hints);
        let scoped = match engine.vtc_user(self.tenant, hints.fairness_id.as_deref()) {
            Ok(u) => u,
            Err(e) => {
                let message = format!("fairness id: {e}");
                return Err(self.reject(400, "invalid-request", message, 0.0));
            }
        };
        let sheddable = hints
            .objective
            .as_ref()
            .and_then(|o| engine.spec.router.objectives.get(o))
            .is_some_and(|&p| p < 0);
        // With flow control a sheddable request waits in its band instead.
        if sheddable && engine.flow(pool).is_none() && engine.choosers[pool].saturated(hints) {
            let message = "every endpoint is saturated; sheddable requests are dropped";
            return Err(self.reject(429, "saturated", message.into(), 0.0));
        }
        let id = shared.ids.next();
        let request_id = shared.request_id(id);
        let mut ticket = None;
        let mut reserve = None;
        let entitlement = self.entitlement();
        if let (Some(admission), Some(ent), true) =
            (engine.admission.as_ref(), entitlement, self.admit)
        {
            shared.fault("admission")?;
            let (est_in, est_out) = self.est;
            let verdict = admission
                .admit_detached(&shared.handle, ent, est_in, est_out, &request_id)
                .await;
            match verdict {
                Verdict::Admitted { ticket: t } => ticket = t,
                // With flow control, a quota at its limit waits in the queue.
                Verdict::Refused { status, reason, .. }
                    if engine.flow(pool).is_some() && quota_at_limit(status, &reason) =>
                {
                    reserve = Some(reason);
                }
                Verdict::Refused {
                    status,
                    reason,
                    retry_after_s,
                } => return Err(self.not_admitted(status, &reason, retry_after_s)),
            }
        }
        Ok(Admitted {
            ticket,
            id,
            request_id,
            scoped,
            reserve,
        })
    }

    /// Flow control: the request waits in its pool's queue while the pool
    /// has no room or its quota is at its limit (see `serve::flow`), holding
    /// no quota while it waits: it gives its ticket back and takes it again
    /// when let out, waiting again (within its TTL) while its quota is still
    /// at its limit. Dropped while it waits (its client went away), it
    /// leaves the queue; `dispatch` gives back the rest.
    async fn queue(
        &mut self,
        &pool: &usize,
        admitted: &mut Admitted,
    ) -> std::result::Result<(), Refused> {
        let engine = self.engine;
        let Some(flow) = engine.flow(pool) else {
            return Ok(());
        };
        let tenant = self.tenant.map(|t| &engine.tenants[t]);
        let key = self
            .ask
            .hints
            .objective
            .as_deref()
            .or(tenant.map(|t| t.service_class.as_str()));
        let bytes = match self.ask.key {
            Key::Body(b) => b.len() as u64,
            Key::Ids(t) => 4 * t.len() as u64,
            Key::None => 0,
        };
        let band = flow.band_of(key);
        let closed = &self.shared.flow_closed;
        let name = &engine.spec.pools[pool].name;
        // Admission may have waited (Redis): the queue's clock is read now.
        let started = self.shared.now();
        let ttl = flow.ttl(band);
        let entitlement = self.entitlement();
        let mut attempt = 0u32;
        loop {
            let user = admitted
                .scoped
                .as_deref()
                .or(tenant.map(|t| t.name.as_str()))
                .unwrap_or(ANONYMOUS);
            let now = self.shared.now();
            let arrival = || {
                // The token-pool terms: the entitlement's priority `w_e` as
                // its flow's weight (debt fairness), its SLO as a deadline.
                let (w, slo_s) = match (engine.admission.as_ref(), entitlement) {
                    (Some(a), Some(ent)) => a.flow_terms(ent),
                    _ => (None, None),
                };
                Arrival {
                    bytes,
                    cost: (self.est.0 + self.est.1).max(1) as f64,
                    weight: w.map_or(1.0, |w| w.max(MIN_WEIGHT)),
                    deadline: slo_s.map(|s| started + s),
                    ..Arrival::new(band, user)
                }
            };
            // A quota at its limit is no room, whatever the endpoints say.
            let quota_room = admitted.reserve.is_none();
            let room = engine.room(pool);
            let waiting = match flow.enter(arrival, |f| quota_room && room(f), closed, now)? {
                Entry::Now => return Ok(()),
                Entry::Wait(w) => {
                    self.shared.flow_queued.notify_one();
                    w
                }
                Entry::Closed => {
                    let message = "routecore is shutting down; retry".into();
                    return Err(self.reject(503, "shutting-down", message, 1.0));
                }
                Entry::Refused {
                    reason: Refusal::TooLarge,
                    ..
                } => {
                    let message =
                        format!("request of {bytes} bytes is larger than pool {name:?}'s queue");
                    return Err(self.reject(413, "too-large", message, 0.0));
                }
                Entry::Refused {
                    reason,
                    retry_after_s,
                } => {
                    let message = format!(
                        "pool {name:?} is saturated and its queue is full ({})",
                        reason.as_str()
                    );
                    let retry = retry_after_s.unwrap_or(0.0);
                    return Err(self.reject(429, "queue-full", message, retry));
                }
            };
            // A waiting request holds no quota: only dispatched ones count.
            if let Some(ticket) = admitted.ticket.take() {
                engine.release_ticket(self.shared, ticket);
                admitted.reserve = Some(String::new());
            }
            if attempt == 0 {
                if let Some(notice) = &self.ask.hints.on_wait {
                    let _ = notice.0.send(ttl + crate::serve::flow::WAIT_MARGIN);
                }
                // Room may have appeared since the others were queued (not
                // on a second wait: its quota, not the pool, held it back).
                engine.pump(pool, now);
            }
            // The TTL counts from the first wait; the queue's own expiry
            // ends the first, this bound the next ones.
            let exit = if attempt == 0 {
                waiting.exit().await
            } else {
                let left = ttl.saturating_sub(Duration::from_secs_f64((now - started).max(0.0)));
                match tokio::time::timeout(left, waiting.exit()).await {
                    Ok(exit) => exit,
                    Err(_) => Exit::Expired {
                        retry_after_s: ttl.as_secs_f64(),
                        waited_s: self.shared.now() - started,
                    },
                }
            };
            match exit {
                Exit::Go => {
                    let placed = Placed(flow);
                    if admitted.reserve.take().is_none() {
                        self.let_out = Some(placed);
                        return Ok(());
                    }
                    attempt += 1;
                    match self.reserve(admitted, attempt).await? {
                        None => {
                            self.let_out = Some(placed);
                            return Ok(());
                        }
                        // Still at its limit: it waits again (its place
                        // given back when `placed` drops).
                        Some(reason) => admitted.reserve = Some(reason),
                    }
                }
                Exit::Expired {
                    retry_after_s,
                    waited_s,
                } => {
                    // The refusal it would have had without a queue.
                    return Err(match admitted.reserve.as_deref() {
                        Some(reason) if !reason.is_empty() => {
                            let message = format!(
                                "not admitted: {reason} (waited {waited_s:.1} s in pool {name:?}'s queue)"
                            );
                            self.reject(429, reason, message, retry_after_s)
                        }
                        _ if engine.choosers[pool].states().iter().any(|s| s.healthy) => {
                            let message = format!(
                                "waited {waited_s:.1} s in pool {name:?}'s queue; every endpoint is saturated"
                            );
                            self.reject(429, "saturated", message, retry_after_s)
                        }
                        _ => {
                            let message = format!("pool {name:?} has no healthy endpoint");
                            self.reject(503, "no-endpoint", message, retry_after_s)
                        }
                    });
                }
                Exit::Displaced { retry_after_s } => {
                    let message = format!("displaced from pool {name:?}'s queue by a higher band");
                    return Err(self.reject(429, "displaced", message, retry_after_s));
                }
                Exit::Drained => {
                    let message = "routecore is shutting down; retry".into();
                    return Err(self.reject(503, "shutting-down", message, 1.0));
                }
            }
        }
    }

    fn pick(
        &mut self,
        &pool: &usize,
        admitted: &Admitted,
    ) -> std::result::Result<(Vec<usize>, Recorded, Option<usize>), Refused> {
        let engine = self.engine;
        // Let out of the queue: counted on its endpoint below (or refused),
        // so no longer pending once this returns.
        let _placed = self.let_out.take();
        let spec = &engine.spec.pools[pool];
        let user = admitted
            .scoped
            .as_deref()
            .or(engine.tenant_name(self.tenant))
            .unwrap_or(ANONYMOUS);
        let adapter = self
            .ask
            .model
            .filter(|m| spec.adapters.iter().any(|a| a == m));
        let chosen = self.shared.fault("routing").and_then(|()| {
            engine.choosers[pool].choose(
                self.ask.key,
                user,
                adapter,
                self.ask.hints,
                self.est,
                self.now,
            )
        })?;
        match chosen {
            Choice::Ranked(ranked, recorded, prefill) => Ok((ranked, recorded, prefill)),
            Choice::NoEndpoint => {
                let message = format!("pool {:?} has no healthy endpoint", spec.name);
                Err(self.reject(503, "no-endpoint", message, 0.0))
            }
        }
    }

    fn unadmit(&mut self, _pool: &usize, admitted: Admitted) {
        if let Some(ticket) = admitted.ticket {
            // Never reached an endpoint: nothing charged, nothing learned.
            self.engine.release_ticket(self.shared, ticket);
        }
    }

    fn unroute(&mut self, pool: usize) {
        if let Err(e) = self.engine.router.complete(pool) {
            tracing::error!(step = "router", error = %e, "release-failed");
        }
    }
}

impl Engine {
    /// Runs a request's steps ([`crate::dispatch`]) and gives it its lease.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn dispatch(
        self: &Arc<Self>,
        routing: Routing,
        est: (u64, u64),
        tenant: Option<usize>,
        admit: bool,
        learn: Option<(u64, &'static str)>,
        ask: Ask<'_>,
        body: Option<Vec<u8>>,
    ) -> Result<Outcome> {
        let shared = self.shared()?;
        let mut steps = Request {
            engine: self,
            shared: &shared,
            routing: &routing,
            tenant,
            admit,
            est,
            ask,
            now: shared.now(),
            let_out: None,
        };
        let d = match dispatch(&mut steps).await {
            Ok(d) => d,
            Err(Refused::Reject(rej)) => return Ok(Err(rej)),
            Err(Refused::Error(e)) => return Err(e),
        };
        let (pool, endpoint) = (d.pool, d.picked.0[0]);
        let (ranked, recorded, prefill) = d.picked;
        let admitted = d.admitted;
        let started = Instant::now();
        let lease = Lease {
            pool,
            endpoint,
            tenant,
            user: admitted.scoped,
            feedback: false,
            est_input_tokens: est.0,
            est_output_tokens: est.1,
            learn,
            started,
            deadline: started + self.timeout,
            ticket: admitted.ticket,
            recorded,
            prefill,
            observed: false,
            awaited: None,
        };
        // 128 random bits: two ids in flight at once never meet (2^-128 a pair).
        lock(&shared.leases).insert(admitted.id, (Arc::clone(self), lease));
        if let Some(s) = &self.autoscale {
            s.arrive(pool, tenant, shared.now());
        }
        let m = &self.pool_metrics[pool];
        m.decisions.inc();
        m.in_flight[endpoint].inc();
        if let Some(p) = prefill {
            m.in_flight[p].inc();
            m.disaggregated.inc();
        }
        let (spilled, reason, compress_target_tokens) = match &routing {
            Routing::Decided(d) => (
                d.spilled,
                d.reason.as_str(),
                d.compress_target_tokens.unwrap_or(0),
            ),
            Routing::Default => (false, "default", 0),
        };
        if spilled {
            m.spillovers.inc();
        }
        let names = self.choosers[pool].endpoints();
        Ok(Ok(Routed {
            id: admitted.id,
            request_id: admitted.request_id,
            pool: self.spec.pools[pool].name.clone(),
            endpoint: names[endpoint].clone(),
            fallbacks: ranked[1..].iter().map(|&i| names[i].clone()).collect(),
            prefill_endpoint: prefill.map(|p| names[p].clone()),
            est_input_tokens: est.0,
            est_output_tokens: est.1,
            spilled,
            reason,
            compress_target_tokens,
            body,
        }))
    }

    /// Completes an admission ticket with what the request used (in memory
    /// at once; a remote backend finishes on the runtime).
    pub(super) fn complete_ticket(
        &self,
        shared: &Shared,
        ticket: Ticket,
        used: (u64, u64),
        latency_s: f64,
    ) {
        self.on_admission(shared, move |a| async move {
            a.complete(ticket, used.0, used.1, latency_s).await;
        });
    }

    /// Gives back the ticket of a request that never reached an endpoint
    /// (refused by a later step, or gone while it waited in the queue):
    /// nothing charged, nothing learned.
    pub(super) fn release_ticket(&self, shared: &Shared, ticket: Ticket) {
        self.on_admission(shared, move |a| async move {
            a.release(ticket).await;
        });
    }

    /// Runs `call` on the admission backend: at once in memory, on the
    /// runtime for a remote backend.
    fn on_admission<F, Fut>(&self, shared: &Shared, call: F)
    where
        F: FnOnce(Arc<super::Admission>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let Some(admission) = self.admission.as_ref() else {
            return;
        };
        let mut done = Box::pin(call(Arc::clone(admission)));
        // Polled in the runtime's context: the caller may be a Python thread
        // (`DataPlane.finish`), and Redis's future needs the runtime's timers.
        let _runtime = shared.handle.enter();
        if done.as_mut().now_or_never().is_none() {
            shared.handle.spawn(done);
        }
    }
}
