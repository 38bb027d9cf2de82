//! Leases: a request in flight from its dispatch to its end. Every path
//! that ends one (the answer, `Feedback`, an error, a cancel, the request
//! timeout's reaper, shutdown) takes it out of the table once and releases
//! what it holds: the pool and endpoint counts, the stateful plugins'
//! charges, the admission ticket, and what its usage teaches the
//! calibrator.

use std::sync::Arc;
use std::time::Instant;

use super::*;

impl Shared {
    /// Releases the lease `id` (false when it is not in flight: released
    /// already). `usage` is learned from when it could be real.
    pub fn release(&self, id: u128, usage: Option<Usage>) -> bool {
        self.release_if(id, Caller::Trusted, usage)
    }

    /// `release` by the request id the front end was given, for `caller`:
    /// false when no lease of that id is in flight or `caller` may not end it
    /// (the two are not told apart).
    pub fn release_request(
        &self,
        request_id: &str,
        caller: Caller<'_>,
        usage: Option<Usage>,
    ) -> bool {
        self.parse_id(request_id)
            .is_some_and(|id| self.release_if(id, caller, usage))
    }

    fn release_if(&self, id: u128, caller: Caller<'_>, usage: Option<Usage>) -> bool {
        let found = {
            let mut leases = lock(&self.leases);
            let allowed = leases.get(&id).is_some_and(|(engine, lease)| match caller {
                Caller::Trusted => true,
                Caller::Tenant(name) => lease.feedback && engine.tenant_name(lease.tenant) == name,
            });
            if allowed {
                leases.remove(&id)
            } else {
                None
            }
        };
        match found {
            Some((engine, lease)) => {
                engine.finish(id, lease, usage, self);
                true
            }
            None => false,
        }
    }

    /// The gateway reports that `endpoint` served the lease `id` (Envoy's
    /// `x-gateway-destination-endpoint-served`, after its retries): when it
    /// is another endpoint of the lease's pool than the chosen one, the
    /// lease's in-flight count, what the prefix plugin recorded and the
    /// usage to come move there, once. False when nothing moved (the lease
    /// is not in flight, was served where it was sent, or `endpoint` is not
    /// in its pool: then the chosen endpoint keeps the accounting).
    pub fn served(&self, id: u128, endpoint: &str) -> bool {
        let mut leases = lock(&self.leases);
        let Some((engine, lease)) = leases.get_mut(&id) else {
            return false;
        };
        let chooser = &engine.choosers[lease.pool];
        let Some(to) = chooser.endpoints.iter().position(|e| e == endpoint) else {
            return false;
        };
        if to == lease.endpoint {
            return false;
        }
        let recorded = std::mem::take(&mut lease.recorded);
        if let Err(e) = chooser.moved(lease.endpoint, to, &recorded, self.now()) {
            tracing::error!(request_id = self.request_id(id), error = %e, "move-failed");
            return false;
        }
        let gauges = &engine.pool_metrics[lease.pool].in_flight;
        gauges[lease.endpoint].dec();
        gauges[to].inc();
        lease.endpoint = to;
        true
    }

    /// The prefill half of the split lease `id` ended before the lease (its
    /// prefill answered, or it fell back to an aggregated request): the
    /// prefill endpoint is released now, and not again with the lease.
    /// False when there is none (not split, released already, or the lease
    /// is not in flight).
    pub fn release_prefill(&self, id: u128) -> bool {
        let (engine, pool, endpoint, est) = {
            let mut leases = lock(&self.leases);
            let Some((engine, lease)) = leases.get_mut(&id) else {
                return false;
            };
            let Some(p) = lease.prefill.take() else {
                return false;
            };
            let est = (lease.est_input_tokens, lease.est_output_tokens);
            (Arc::clone(engine), lease.pool, p, est)
        };
        let now = self.now();
        if let Err(e) = engine.choosers[pool].release_prefill(endpoint, est, now) {
            tracing::error!(request_id = self.request_id(id), step = "prefill", error = %e, "release-failed");
        }
        engine.pool_metrics[pool].in_flight[endpoint].dec();
        engine.pump(pool, now);
        true
    }

    /// Lets a RouteCore `Feedback` from the lease's tenant end it (a request
    /// routed through the RouteCore API).
    pub fn accept_feedback(&self, id: u128) {
        if let Some((_, lease)) = lock(&self.leases).get_mut(&id) {
            lease.feedback = true;
        }
    }

    /// An observing filter's stream (Envoy's `observability_mode`, which
    /// reads the response without Envoy waiting) names the lease `id`: from
    /// now on its end, or the response's, ends the lease. False when the
    /// lease is not in flight.
    pub fn observe(&self, id: u128) -> bool {
        let mut leases = lock(&self.leases);
        let Some((_, lease)) = leases.get_mut(&id) else {
            return false;
        };
        lease.observed = true;
        lease.awaited = None;
        true
    }

    /// The routing stream of lease `id` ended before the response, which
    /// Envoy does not send it (Envoy 1.40 closes that stream once it expects
    /// nothing more of it): the lease is left to the observing filter's
    /// stream, which names it at once ([`Shared::observe`]); one that has not
    /// within `grace` is released by the reaper (no observing filter: the
    /// response is never read).
    pub fn hand_over(&self, id: u128, grace: std::time::Duration) {
        if let Some((_, lease)) = lock(&self.leases).get_mut(&id) {
            if !lease.observed {
                lease.awaited = Some(Instant::now() + grace);
            }
        }
    }

    /// Releases every lease past its deadline, or left to an observing
    /// filter that did not name it in time; returns how many.
    pub fn reap(&self) -> usize {
        let now = Instant::now();
        let expired: Vec<(u128, Arc<Engine>, Lease)> = {
            let mut leases = lock(&self.leases);
            let ids: Vec<u128> = leases
                .iter()
                .filter(|(_, (_, l))| l.deadline <= now || l.awaited.is_some_and(|t| t <= now))
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| leases.remove(&id).map(|(e, l)| (id, e, l)))
                .collect()
        };
        let n = expired.len();
        for (id, engine, lease) in expired {
            engine.pool_metrics[lease.pool].timeouts.inc();
            engine.finish(id, lease, None, self);
        }
        if n > 0 {
            tracing::warn!(count = n as u64, "requests-timed-out");
        }
        n
    }
}

impl Engine {
    /// Releases a lease taken out of the table: every step runs even when
    /// another fails (logged as `release-failed`); usage that cannot be real
    /// (more tokens than the pool's context, whoever reported it: the
    /// engine's response or a RouteCore `Feedback`) is ignored for learning
    /// and charging (logged, counted), as is usage without prompt tokens,
    /// and the admission ticket is completed with the estimate.
    pub(super) fn finish(&self, id: u128, lease: Lease, usage: Option<Usage>, shared: &Shared) {
        let now = shared.now();
        let m = &self.pool_metrics[lease.pool];
        let context = self.spec.pools[lease.pool].max_context;
        let usage = usage.and_then(|u| {
            if plausible(u, context) {
                return Some(u);
            }
            m.absurd_usage.inc();
            tracing::warn!(
                request_id = shared.request_id(id),
                pool = self.spec.pools[lease.pool].name.as_str(),
                endpoint = self.choosers[lease.pool].endpoints[lease.endpoint].as_str(),
                prompt_tokens = u.0,
                completion_tokens = u.1,
                "absurd-usage"
            );
            None
        });
        let usage = usage.filter(|u| u.0 > 0);
        let fail = |step: &str, e: Error| {
            tracing::error!(request_id = shared.request_id(id), step, error = %e, "release-failed");
        };
        if let Err(e) = self.router.complete(lease.pool) {
            fail("router", e);
        }
        let user = lease
            .user
            .as_deref()
            .or(self.tenant_name(lease.tenant))
            .unwrap_or(ANONYMOUS);
        let est = (lease.est_input_tokens, lease.est_output_tokens);
        if let Err(e) = self.choosers[lease.pool].release(lease.endpoint, user, est, usage, now) {
            fail("chooser", e);
        }
        m.in_flight[lease.endpoint].dec();
        if let Some(p) = lease.prefill {
            if let Err(e) = self.choosers[lease.pool].release_prefill(p, est, now) {
                fail("prefill", e);
            }
            m.in_flight[p].dec();
        }
        // Without a usage: the prompt's count (exact with a tokenizer, else
        // the calibrated estimate) and no output, as admission charges it.
        let actual = usage.unwrap_or((lease.est_input_tokens, 0));
        if let Some(s) = &self.autoscale {
            s.observe(lease.pool, lease.tenant, now, actual.0, actual.1);
        }
        if let Some(ticket) = lease.ticket {
            let latency = lease.started.elapsed().as_secs_f64();
            self.complete_ticket(shared, ticket, actual, latency);
        }
        // Capacity appeared (an endpoint's slot, and its quota once the
        // ticket is completed): the pool's queue may let a request out.
        self.pump(lease.pool, now);
        if let Err(e) = shared
            .fault("finish")
            .and_then(|()| self.learn(lease.learn, usage, shared))
        {
            fail("learn", e);
        }
    }

    pub(super) fn learn(
        &self,
        learn: Option<(u64, &'static str)>,
        usage: Option<Usage>,
        shared: &Shared,
    ) -> Result<()> {
        let (Some((bytes, category)), Some((prompt, _))) = (learn, usage) else {
            return Ok(());
        };
        if bytes == 0 {
            return Ok(());
        }
        let ratio = {
            let mut cal = self.router.write_calibrator();
            if cal.observe(category, int(bytes), int(prompt)).is_err() {
                return Ok(()); // a ratio the calibrator refuses: not learned from
            }
            cal.stats(category).ratio
        };
        shared
            .metrics
            .calibration_ratio
            .get_or_create(&crate::serve::metrics::CategoryLabel {
                category: category.into(),
            })
            .set(ratio);
        Ok(())
    }
}
