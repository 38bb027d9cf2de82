//! One request's way through the data plane, in the order of
//! [`crate::dispatch`]: route (the pool: the budget's decision, moved to a
//! pool serving the request's model) -> admit (a valid fairness id, the
//! saturation gate for sheddable requests, the admission backend) -> queue
//! (flow control: wait in the pool's queue while it has no room; at once
//! without `flow_control`) -> pick (the pool's
//! [`Chooser`](super::Chooser): its plugins learn only here) -> lease.

use std::sync::Arc;
use std::time::Instant;

use futures_util::FutureExt;

use super::{
    lock, Ask, Choice, Engine, Key, Lease, Outcome, Reject, Routed, Shared, Ticket, Verdict,
    ANONYMOUS,
};
use crate::budget::Decision;
use crate::dispatch::{dispatch, Steps};
use crate::error::{Error, Result};
use crate::flow::{Arrival, Refusal};
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
    let_out: bool,
}

impl Request<'_> {
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
        let entitlement = self
            .tenant
            .and_then(|t| engine.tenants[t].entitlement.as_deref())
            .filter(|e| engine.entitlement_live(e, shared));
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
                Verdict::Refused {
                    status,
                    reason,
                    retry_after_s,
                } => {
                    let message = format!("not admitted: {reason}");
                    let retry = retry_after_s.unwrap_or(0.0);
                    return Err(self.reject(status, &reason, message, retry));
                }
            }
        }
        Ok(Admitted {
            ticket,
            id,
            request_id,
            scoped,
        })
    }

    /// Flow control: the request waits in its pool's queue while the pool
    /// has no room (see `serve::flow`). Dropped while it waits (its client
    /// went away), it leaves the queue; `dispatch` gives back the rest.
    async fn queue(
        &mut self,
        &pool: &usize,
        admitted: &Admitted,
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
        let user = admitted
            .scoped
            .as_deref()
            .or(tenant.map(|t| t.name.as_str()))
            .unwrap_or(ANONYMOUS);
        let bytes = match self.ask.key {
            Key::Body(b) => b.len() as u64,
            Key::Ids(t) => 4 * t.len() as u64,
            Key::None => 0,
        };
        let band = flow.band_of(key);
        let arrival = Arrival {
            bytes,
            cost: (self.est.0 + self.est.1).max(1) as f64,
            ..Arrival::new(band, user)
        };
        let closed = &self.shared.flow_closed;
        let name = &engine.spec.pools[pool].name;
        // Admission may have waited (Redis): the queue's clock is read now.
        let now = self.shared.now();
        let waiting = match flow.enter(arrival, engine.room(pool), closed, now)? {
            Entry::Now => return Ok(()),
            Entry::Wait(w) => w,
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
                return Err(self.reject(429, "queue-full", message, retry_after_s.unwrap_or(0.0)));
            }
        };
        if let Some(notice) = &self.ask.hints.on_wait {
            let _ = notice
                .0
                .send(flow.ttl(band) + crate::serve::flow::WAIT_MARGIN);
        }
        // Room may have appeared since the others were queued.
        engine.pump(pool, now);
        match waiting.exit().await {
            Exit::Go => {
                self.let_out = true;
                Ok(())
            }
            Exit::Expired {
                retry_after_s,
                waited_s,
            } => {
                // The refusal it would have had without a queue.
                if engine.choosers[pool].states().iter().any(|s| s.healthy) {
                    let message = format!(
                        "waited {waited_s:.1} s in pool {name:?}'s queue; every endpoint is saturated"
                    );
                    Err(self.reject(429, "saturated", message, retry_after_s))
                } else {
                    let message = format!("pool {name:?} has no healthy endpoint");
                    Err(self.reject(503, "no-endpoint", message, retry_after_s))
                }
            }
            Exit::Displaced { retry_after_s } => {
                let message = format!("displaced from pool {name:?}'s queue by a higher band");
                Err(self.reject(429, "displaced", message, retry_after_s))
            }
            Exit::Drained => {
                let message = "routecore is shutting down; retry".into();
                Err(self.reject(503, "shutting-down", message, 1.0))
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
        let _placed = std::mem::take(&mut self.let_out)
            .then(|| engine.flow(pool))
            .flatten()
            .map(Placed);
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
            let_out: false,
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
        };
        // 128 random bits: two ids in flight at once never meet (2^-128 a pair).
        lock(&shared.leases).insert(admitted.id, (Arc::clone(self), lease));
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
