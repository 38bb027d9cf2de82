//! Flow control's queues in the engine (`serve::flow`): one per pool when
//! `flow_control` is configured, served when capacity appears (a lease
//! released, the ticker while a request waits) and drained at shutdown.

use std::sync::atomic::Ordering as AtomicOrdering;

use tokio::sync::watch;

use super::*;
use crate::serve::flow::{PoolFlow, TICK};

impl Engine {
    /// One queue per pool of `spec` (none without `flow_control`).
    pub(super) fn pool_flows(spec: &Spec, metrics: &Metrics) -> Result<Vec<PoolFlow>> {
        let Some(flow) = &spec.flow_control else {
            return Ok(Vec::new());
        };
        spec.pools
            .iter()
            .map(|p| PoolFlow::new(flow, &p.name, &metrics.flow))
            .collect()
    }

    /// Pool `pool`'s queue (None: flow control is off).
    pub fn flow(&self, pool: usize) -> Option<&PoolFlow> {
        self.flows.get(pool)
    }

    /// Whether pool `pool` has room for one more request, as its queue's
    /// detector reads the endpoints the picker sees.
    pub(super) fn room(&self, pool: usize) -> impl Fn(&PoolFlow) -> bool + '_ {
        move |flow| self.choosers[pool].room(flow)
    }

    /// Lets pool `pool`'s waiting requests out while it has room.
    pub(super) fn pump(&self, pool: usize, now: f64) {
        if let Some(flow) = self.flows.get(pool) {
            if let Err(e) = flow.pump(self.room(pool), now) {
                tracing::error!(pool = self.spec.pools[pool].name.as_str(), error = %e, "flow-failed");
            }
        }
    }

    /// Refuses the requests past their TTL and lets out what the pools have
    /// room for (the ticker: room a scrape or a health change shows).
    pub fn serve_queues(&self, now: f64) {
        for (pool, flow) in self.flows.iter().enumerate() {
            if let Err(e) = flow.expire(now) {
                tracing::error!(pool = self.spec.pools[pool].name.as_str(), error = %e, "flow-failed");
            }
            self.pump(pool, now);
        }
    }
}

impl Shared {
    /// [`Engine::serve_queues`] of every engine alive (each keeps its own
    /// queues: a request keeps the discipline that admitted it).
    pub fn serve_queues(&self) {
        let now = self.now();
        for engine in self.engines() {
            engine.serve_queues(now);
        }
    }

    /// Whether a request waits in any engine's queue.
    fn queued(&self) -> bool {
        self.engines()
            .iter()
            .any(|e| e.flows.iter().any(|f| !f.is_empty()))
    }

    /// The ticker: serves the queues every [`TICK`] while a request waits
    /// in one (expiries, and the room a scrape or a health change shows; a
    /// released lease serves its pool's queue at once), and sleeps while
    /// every queue is empty until a request starts to wait (`flow_queued`,
    /// told by the step that queues it), so an idle data plane, or one
    /// without flow control, never wakes for it.
    pub async fn serve_queues_forever(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            if !self.queued() {
                // A request queued since the check left its permit: no wait.
                tokio::select! {
                    _ = self.flow_queued.notified() => {}
                    _ = stop.changed() => return,
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(TICK) => {}
                _ = stop.changed() => return,
            }
            self.metrics.flow.ticks.inc();
            self.serve_queues();
        }
    }

    /// Shutdown: every waiting request is refused (503, retry elsewhere) and
    /// no request waits any more; returns how many were waiting.
    pub fn drain_queues(&self) -> usize {
        self.flow_closed.store(true, AtomicOrdering::Release);
        let now = self.now();
        let mut n = 0;
        for engine in self.engines() {
            for flow in &engine.flows {
                match flow.drain(now) {
                    Ok(k) => n += k,
                    Err(e) => tracing::error!(error = %e, "flow-failed"),
                }
            }
        }
        if n > 0 {
            tracing::info!(count = n as u64, "queue-drained");
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{plane_json, plane_of};
    use super::*;
    use tokio::task::JoinHandle;

    const BODY: &[u8] = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}"#;

    /// Four endpoints, each full at one request in flight (the concurrency
    /// detector: nothing is scraped); `demo` (tenant 0) is guaranteed and
    /// `other` (1) spot, both with an entitlement of one quota; `flow` is
    /// the queue's section.
    fn flow_plane(flow: serde_json::Value) -> (Arc<Shared>, Arc<Engine>) {
        flow_plane_with(flow, 1000)
    }

    /// `flow_plane` with the quota's concurrency set to `concurrency`.
    fn flow_plane_with(flow: serde_json::Value, concurrency: u64) -> (Arc<Shared>, Arc<Engine>) {
        let quota = serde_json::json!({"name": "q", "tokens_per_s": 1e9, "kv_bytes": 1_i64 << 40,
                                       "concurrency": concurrency});
        let entitlement = |name: &str, class: &str| {
            serde_json::json!({"name": name, "tenant": name, "quota": "q",
                               "service_class": class, "slo_target_ms": 1000.0,
                               "tokens_per_s": 1e8, "kv_bytes": 1_i64 << 38, "concurrency": 1000})
        };
        let admission = serde_json::json!({"quotas": [quota], "entitlements": [
            entitlement("demo", "guaranteed"), entitlement("other", "spot")]});
        let mut json = plane_json("least-request", admission);
        json["tenants"][0]["service_class"] = "guaranteed".into();
        json["tenants"][1]["service_class"] = "spot".into();
        json["flow_control"] = serde_json::json!({
            "queue": flow,
            "saturation": {"detector": "concurrency", "max_in_flight": 1}});
        plane_of(json)
    }

    fn bands() -> serde_json::Value {
        serde_json::json!([{"name": "guaranteed", "share": 1000}, {"name": "spot", "share": 1}])
    }

    fn send(engine: &Arc<Engine>, tenant: usize) -> JoinHandle<Outcome> {
        let engine = Arc::clone(engine);
        tokio::spawn(async move {
            engine
                .route_body(BODY, Some(tenant), &Hints::default())
                .await
                .expect("no error")
        })
    }

    /// Lets the spawned requests run until none can go on.
    async fn settle() {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    }

    /// Four requests of `demo`, placed at once: the pool is full.
    async fn fill(engine: &Arc<Engine>) -> Vec<Routed> {
        let mut out = Vec::new();
        for _ in 0..4 {
            let r = engine.route_body(BODY, Some(0), &Hints::default()).await;
            out.push(r.expect("ok").expect("placed at once"));
        }
        out
    }

    async fn outcome(h: JoinHandle<Outcome>) -> Outcome {
        h.await.expect("joined")
    }

    fn gauge(shared: &Shared, name: &str, band: &str) -> f64 {
        shared
            .metrics
            .value(name, &["p", band])
            .expect("a flow metric")
    }

    /// How many times the ticker served the queues, as exported.
    fn ticks(shared: &Shared) -> f64 {
        let text = shared.metrics.text();
        text.lines()
            .find_map(|l| l.strip_prefix("routecore_flow_ticks_total "))
            .and_then(|v| v.parse().ok())
            .expect("routecore_flow_ticks_total exported")
    }

    /// What a request path holds: requests in the pool, admission's in
    /// flight, per endpoint in flight, waiting, let out.
    fn held(shared: &Shared, engine: &Engine) -> (u64, u64, Vec<u64>, u64, u64, usize) {
        let flow = engine.flow(0).expect("flow control");
        (
            engine.router.in_flight(0).expect("pool"),
            engine.admission.as_ref().map_or(0, |a| a.in_flight()),
            engine.choosers[0].loads(),
            flow.len(),
            flow.pending(),
            shared.lease_count(),
        )
    }

    #[tokio::test]
    async fn requests_that_ended_before_the_next_scrape_saturate_no_pool() {
        // The GIE's utilization detector (a queue of 5) over four scraped,
        // idle engines that answer each request before the next scrape: 40
        // requests one after another all go on at once. Counting the ended
        // ones in the queue held the 21st (the pool of fast engines capped
        // at 4 x 5 requests a scrape).
        let mut json = plane_json("least-request", serde_json::Value::Null);
        json["flow_control"] = serde_json::json!({"queue": {"bands": bands()}});
        let (shared, engine) = plane_of(json);
        {
            let mut st = engine.choosers[0].state.lock().expect("state");
            for s in &mut st.picker.states {
                (s.waiting, s.running, s.kv_usage) = (Some(0.0), Some(0.0), Some(0.0));
            }
        }
        let hints = Hints::default();
        for i in 0..40 {
            let r = engine.route_body(BODY, Some(0), &hints);
            let r = tokio::time::timeout(std::time::Duration::from_secs(5), r)
                .await
                .unwrap_or_else(|_| panic!("request {i} waited in the queue"));
            let routed = r.expect("ok").expect("placed");
            assert!(shared.release(routed.id, Some((10, 5))));
        }
        let flow = engine.flow(0).expect("flow control");
        assert_eq!((flow.len(), flow.pending()), (0, 0));
    }

    #[tokio::test]
    async fn a_full_pool_holds_requests_and_lets_the_higher_band_out_first_on_release() {
        let (shared, engine) = flow_plane(serde_json::json!({"bands": bands()}));
        let placed = fill(&engine).await;
        let spot = [send(&engine, 1), send(&engine, 1)];
        settle().await;
        let gold = send(&engine, 0);
        settle().await;
        assert_eq!(engine.flow(0).expect("flow").len(), 3);
        assert!(spot.iter().all(|h| !h.is_finished()) && !gold.is_finished());
        // Counted in the pool while waiting, on no endpoint, and not in its
        // quota: only dispatched requests hold one.
        assert_eq!(held(&shared, &engine), (7, 4, vec![1; 4], 3, 0, 4));
        assert_eq!(gauge(&shared, "flow_queue_requests", "spot"), 2.0);

        // A release is room for one: guaranteed first, though it came last.
        assert!(shared.release(placed[0].id, Some((10, 5))));
        settle().await;
        assert!(gold.is_finished() && spot.iter().all(|h| !h.is_finished()));
        let gold = outcome(gold).await.expect("placed");
        assert_eq!(held(&shared, &engine), (6, 4, vec![1; 4], 2, 0, 4));
        for p in &placed[1..] {
            assert!(shared.release(p.id, None));
        }
        assert!(shared.release(gold.id, None));
        settle().await;
        for h in spot {
            let r = outcome(h).await.expect("placed");
            assert!(shared.release(r.id, None));
        }
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
        for band in ["guaranteed", "spot"] {
            assert_eq!(gauge(&shared, "flow_queue_requests", band), 0.0);
            assert_eq!(gauge(&shared, "flow_queue_bytes", band), 0.0);
        }
    }

    #[tokio::test]
    async fn a_client_gone_while_waiting_leaves_the_queue_and_gives_everything_back_once() {
        let (shared, engine) = flow_plane(serde_json::json!({"bands": bands()}));
        let placed = fill(&engine).await;
        let waiting = send(&engine, 1);
        settle().await;
        assert_eq!(held(&shared, &engine), (5, 4, vec![1; 4], 1, 0, 4));
        waiting.abort();
        settle().await;
        assert_eq!(held(&shared, &engine), (4, 4, vec![1; 4], 0, 0, 4));
        let q = engine.flow(0).expect("flow");
        assert_eq!(q.len(), 0);
        // Its room is not given to anyone: the next release finds no one.
        assert!(shared.release(placed[0].id, None));
        assert_eq!(held(&shared, &engine), (3, 3, vec![0, 1, 1, 1], 0, 0, 3));
        for p in &placed[1..] {
            assert!(shared.release(p.id, None));
        }
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
    }

    #[tokio::test]
    async fn a_quota_at_its_limit_waits_and_the_release_of_its_entitlement_lets_it_out() {
        // The quota holds one request; the pool has room for four.
        let (shared, engine) = flow_plane_with(serde_json::json!({"bands": bands()}), 1);
        let first = engine
            .route_body(BODY, Some(1), &Hints::default())
            .await
            .expect("ok")
            .expect("placed at once");
        let second = send(&engine, 1);
        settle().await;
        assert!(
            !second.is_finished(),
            "waits instead of a 429 quota-contention"
        );
        // It waits holding no quota, though its pool has room.
        assert_eq!(held(&shared, &engine), (2, 1, vec![1, 0, 0, 0], 1, 0, 1));
        // A guaranteed request still passes (its priority is above the spot
        // one in flight): a quota at its limit holds only those it refuses.
        let demo = engine
            .route_body(BODY, Some(0), &Hints::default())
            .await
            .expect("ok");
        let demo = match demo {
            Ok(r) => r,
            Err(rej) => panic!("demo waits behind other's quota: {rej:?}"),
        };
        assert!(shared.release(demo.id, None));
        settle().await;
        assert!(!second.is_finished(), "its quota is still at its limit");
        // Its entitlement's release frees the quota: it is let out, admitted.
        assert!(shared.release(first.id, Some((10, 5))));
        settle().await;
        let second = outcome(second).await.expect("placed");
        assert_eq!(held(&shared, &engine), (1, 1, vec![1, 0, 0, 0], 0, 0, 1));
        assert!(shared.release(second.id, None));
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
    }

    #[tokio::test]
    async fn a_quota_at_its_limit_until_the_ttl_is_refused_as_admission_would_have() {
        let flow = serde_json::json!({"bands": bands(), "ttl_s": 0.05});
        let (shared, engine) = flow_plane_with(flow, 1);
        let first = engine
            .route_body(BODY, Some(1), &Hints::default())
            .await
            .expect("ok")
            .expect("placed at once");
        let second = send(&engine, 1);
        settle().await;
        assert!(!second.is_finished(), "waits");
        tokio::time::sleep(Duration::from_millis(60)).await;
        shared.serve_queues();
        let rej = outcome(second).await.expect_err("expired");
        assert_eq!((rej.status, rej.reason.as_str()), (429, "quota-contention"));
        assert!(rej.retry_after_s > 0.0, "{rej:?}");
        assert_eq!(held(&shared, &engine), (1, 1, vec![1, 0, 0, 0], 0, 0, 1));
        assert!(shared.release(first.id, None));
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
    }

    /// Both tenants elastic, in one band with debt fairness: `demo` with a
    /// 100 ms SLO, `other` with 10 s, so `demo`'s priority `w_e` is higher.
    fn debt_plane() -> (Arc<Shared>, Arc<Engine>) {
        let quota = serde_json::json!({"name": "q", "tokens_per_s": 1e9, "kv_bytes": 1_i64 << 40,
                                       "concurrency": 1000});
        let entitlement = |name: &str, slo_ms: f64| {
            serde_json::json!({"name": name, "tenant": name, "quota": "q",
                               "service_class": "elastic", "slo_target_ms": slo_ms,
                               "tokens_per_s": 1e8, "kv_bytes": 1_i64 << 38, "concurrency": 1000})
        };
        let admission = serde_json::json!({"quotas": [quota], "entitlements": [
            entitlement("demo", 100.0), entitlement("other", 10_000.0)]});
        let mut json = plane_json("least-request", admission);
        json["tenants"][0]["service_class"] = "elastic".into();
        json["tenants"][1]["service_class"] = "elastic".into();
        json["flow_control"] = serde_json::json!({
            "queue": {"bands": [{"name": "elastic", "fairness": "debt"}]},
            "saturation": {"detector": "concurrency", "max_in_flight": 1}});
        plane_of(json)
    }

    #[tokio::test]
    async fn with_debt_fairness_the_entitlement_of_higher_priority_goes_first() {
        let (shared, engine) = debt_plane();
        let admission = engine.admission.as_ref().expect("admission");
        let (w_demo, w_other) = (
            admission.flow_terms("demo").0.expect("w"),
            admission.flow_terms("other").0.expect("w"),
        );
        assert!(w_demo > 2.0 * w_other, "{w_demo} {w_other}");
        let placed = fill(&engine).await;
        let mut waiting = Vec::new();
        for tenant in [1, 1, 0, 0] {
            waiting.push((tenant, send(&engine, tenant)));
            settle().await;
        }
        // One slot at a time: the order the queue lets them out.
        let mut order = Vec::new();
        let mut ids: Vec<u128> = placed.iter().map(|p| p.id).collect();
        for _ in 0..4 {
            assert!(shared.release(ids.remove(0), None));
            settle().await;
            let k = waiting
                .iter()
                .position(|(_, h)| h.is_finished())
                .expect("one let out");
            let (tenant, h) = waiting.remove(k);
            order.push(tenant);
            ids.push(outcome(h).await.expect("placed").id);
        }
        // Equal weights alternate (1, 0, 1, 0); the token-pool weights let
        // the flow of higher priority take two turns for the other's one.
        assert_eq!(order, vec![1, 0, 0, 1]);
        for id in ids {
            assert!(shared.release(id, None));
        }
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
    }

    #[tokio::test]
    async fn ttl_expiry_is_the_refusal_it_would_have_had_with_retry_after() {
        let (shared, engine) = flow_plane(serde_json::json!({"bands": bands(), "ttl_s": 0.05}));
        let placed = fill(&engine).await;
        let waiting = send(&engine, 1);
        settle().await;
        tokio::time::sleep(Duration::from_millis(60)).await;
        shared.serve_queues();
        let rej = outcome(waiting).await.expect_err("expired");
        assert_eq!((rej.status, rej.reason.as_str()), (429, "saturated"));
        assert!(
            rej.retry_after_s > 0.0 && rej.retry_after_s <= 0.05,
            "{rej:?}"
        );
        assert_eq!(held(&shared, &engine), (4, 4, vec![1; 4], 0, 0, 4));
        for p in &placed {
            assert!(shared.release(p.id, None));
        }
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
    }

    #[tokio::test]
    async fn a_pool_with_no_endpoint_is_a_waiting_room_then_503() {
        let mut json = plane_json("least-request", serde_json::Value::Null);
        json["pools"][0]["endpoints"] = serde_json::json!([]);
        json["flow_control"] = serde_json::json!({"queue": {"bands": bands(), "ttl_s": 0.05},
            "saturation": {"detector": "concurrency"}});
        let (shared, engine) = plane_of(json);
        let waiting = send(&engine, 0);
        settle().await;
        assert_eq!(engine.flow(0).expect("flow").len(), 1);
        tokio::time::sleep(Duration::from_millis(60)).await;
        shared.serve_queues();
        let rej = outcome(waiting).await.expect_err("expired");
        assert_eq!((rej.status, rej.reason.as_str()), (503, "no-endpoint"));
        assert!(rej.retry_after_s > 0.0);
        assert_eq!(engine.router.in_flight(0).expect("pool"), 0);
    }

    #[tokio::test]
    async fn a_higher_band_displaces_a_lower_one_at_a_full_queue() {
        let (shared, engine) = flow_plane(serde_json::json!({"bands": bands(), "max_requests": 1}));
        let placed = fill(&engine).await;
        let spot = send(&engine, 1);
        settle().await;
        let gold = send(&engine, 0);
        settle().await;
        let rej = outcome(spot).await.expect_err("displaced");
        assert_eq!((rej.status, rej.reason.as_str()), (429, "displaced"));
        assert!(rej.retry_after_s > 0.0);
        // A spot request now finds the queue full of a higher band.
        let full = outcome(send(&engine, 1)).await.expect_err("full");
        assert_eq!((full.status, full.reason.as_str()), (429, "queue-full"));
        assert!(shared.release(placed[0].id, None));
        settle().await;
        let gold = outcome(gold).await.expect("placed");
        for id in placed[1..].iter().map(|p| p.id).chain([gold.id]) {
            assert!(shared.release(id, None));
        }
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
        let count = |outcome: &str| {
            shared
                .metrics
                .value("flow_outcomes", &["p", "spot", outcome])
                .expect("a flow metric")
        };
        assert_eq!((count("displaced"), count("refused")), (1.0, 1.0));
    }

    #[tokio::test]
    async fn shutdown_refuses_every_waiting_request_and_lets_none_wait_after() {
        let (shared, engine) = flow_plane(serde_json::json!({"bands": bands()}));
        let placed = fill(&engine).await;
        let waiting = [send(&engine, 0), send(&engine, 1)];
        settle().await;
        assert_eq!(shared.drain_queues(), 2);
        for h in waiting {
            let rej = outcome(h).await.expect_err("drained");
            assert_eq!((rej.status, rej.reason.as_str()), (503, "shutting-down"));
        }
        let late = outcome(send(&engine, 0)).await.expect_err("closed");
        assert_eq!(late.status, 503);
        for p in &placed {
            assert!(shared.release(p.id, None));
        }
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
    }

    #[tokio::test]
    async fn a_reload_leaves_waiting_requests_in_the_queue_that_admitted_them() {
        let (shared, old) = flow_plane(serde_json::json!({"bands": bands()}));
        let placed = fill(&old).await;
        let waiting = send(&old, 1);
        settle().await;
        // The new configuration has one band only, and its own queues.
        let mut spec = old.spec.clone();
        if let Some(f) = spec.flow_control.as_mut() {
            f.queue = crate::flow::FlowConfig::from_json(r#"{"bands": [{"name": "all"}]}"#)
                .expect("config");
        }
        let new = Engine::build(spec, &shared, Some(&old)).expect("reload");
        assert!(new.flow(0).expect("flow").is_empty());
        assert_eq!(old.flow(0).expect("flow").len(), 1);
        assert!(!waiting.is_finished());
        assert!(shared.release(placed[0].id, None));
        settle().await;
        let r = outcome(waiting)
            .await
            .expect("placed by the old engine's queue");
        for id in placed[1..].iter().map(|p| p.id).chain([r.id]) {
            assert!(shared.release(id, None));
        }
        assert_eq!(held(&shared, &old), (0, 0, vec![0; 4], 0, 0, 0));
    }

    #[tokio::test]
    async fn the_ticker_sleeps_until_a_request_waits_and_still_expires_it() {
        let flow = serde_json::json!({"bands": bands(), "ttl_s": 0.05});
        let (shared, engine) = flow_plane(flow);
        let (stop, stopped) = watch::channel(false);
        let ticker = tokio::spawn(Arc::clone(&shared).serve_queues_forever(stopped));
        // Idle, then busy with nothing waiting (the pool has room for each):
        // ten ticks' time each, not one tick (it ticked every TICK before).
        tokio::time::sleep(TICK * 10).await;
        assert_eq!(ticks(&shared), 0.0, "an idle flow control ticks");
        let placed = fill(&engine).await;
        tokio::time::sleep(TICK * 10).await;
        assert_eq!(ticks(&shared), 0.0, "requests that never waited woke it");
        // A request waits in the full pool: the ticker wakes and refuses it
        // at its TTL, with no release or scrape to serve the queue.
        let started = std::time::Instant::now();
        let waiting = send(&engine, 0);
        let rej = tokio::time::timeout(Duration::from_secs(10), outcome(waiting))
            .await
            .expect("its TTL fired")
            .expect_err("expired");
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!((rej.status, rej.reason.as_str()), (429, "saturated"));
        let ticked = ticks(&shared);
        assert!(ticked >= 1.0);
        // The queue is empty again: it sleeps.
        tokio::time::sleep(TICK * 10).await;
        assert_eq!(ticks(&shared), ticked, "ticks with nothing waiting");
        let _ = stop.send(true);
        ticker.await.expect("the ticker stops");
        for p in placed {
            assert!(shared.release(p.id, None));
        }
        assert_eq!(held(&shared, &engine), (0, 0, vec![0; 4], 0, 0, 0));
    }
}
