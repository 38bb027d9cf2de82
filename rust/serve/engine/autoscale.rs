//! What the autoscaler (`serve::autoscale`) reads of the engine: the demand
//! flow control holds and the endpoints' readiness, per pool, and the
//! engine's autoscaler for the periodic actor.

use super::Engine;
use crate::serve::autoscale::{PoolSignals, Scaled, Scaling};

impl PoolSignals for Engine {
    /// The requests waiting in the pool's flow-control queue (issue 32;
    /// 0 when flow control is off).
    fn queued_requests(&self, pool: usize) -> f64 {
        self.flow(pool).map_or(0.0, |f| f.len() as f64)
    }

    /// Its healthy endpoints (scraped, answering).
    fn ready_endpoints(&self, pool: usize) -> Option<u64> {
        let states = self.choosers.get(pool)?.states();
        Some(states.iter().filter(|s| s.healthy).count() as u64)
    }
}

impl Scaled for Engine {
    fn scaling(&self) -> Option<&Scaling> {
        self.autoscale.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::error::Result;
    use crate::serve::autoscale::tests::autoscale;
    use crate::serve::config::testing::{plane_json, tenant};
    use crate::serve::config::Spec;
    use crate::serve::engine::{test_plane, Hints};

    /// A data plane spec of pools `p` (scaled) and `q` (not), tenants `demo`
    /// (entitlement `gold`) and `other` (none), with this `autoscale` section.
    fn spec(autoscale: Value) -> Result<Spec> {
        let pool = |name: &str| {
            json!({"name": name, "max_context": 8192, "budget": null, "queue_limit": null,
                   "endpoints": ["10.0.0.1:1", "10.0.0.2:1"]})
        };
        let mut json = plane_json("least-request", json!([pool("p"), pool("q")]));
        json["tenants"] = json!([
            tenant("demo", b"demo", Some("gold")),
            tenant("other", b"other", None)
        ]);
        json["autoscale"] = autoscale;
        Spec::from_json(&json.to_string())
    }

    #[tokio::test]
    async fn every_lease_that_ends_is_observed_with_its_usage_or_its_estimate() {
        let (shared, engine) = test_plane(spec(autoscale(2.0)).expect("spec"));
        let body = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}"#;
        let mut estimated = 0;
        for i in 0..6 {
            // demo (tenant 0, entitlement gold) then other (tenant 1).
            let r = engine
                .route_body(body, Some(i % 2), &Hints::default())
                .await;
            let routed = r.expect("ok").expect("routed");
            estimated = routed.est_input_tokens;
            let usage = (i < 4).then_some((20, 10));
            assert!(shared.release(routed.id, usage));
        }
        let s = engine.autoscale.as_ref().expect("autoscale on");
        let now = shared.now();
        let pool = s.live(0, None, now).expect("live");
        assert_eq!(pool.requests, 6);
        // 4 with usage (20 prompt, 10 output), 2 without: the estimate, no output.
        assert_eq!(
            pool.prompt.mean,
            (4.0 * 20.0 + 2.0 * estimated as f64) / 6.0
        );
        assert_eq!(pool.output_mean, 40.0 / 6.0);
        let gold = s.live(0, Some(0), now).expect("live");
        assert_eq!(gold.requests, 3, "demo's requests only");
    }

    /// A lease counts as an arrival when it is given (the rate a pool that
    /// falls behind still sees), in its pool's window and its entitlement's;
    /// the entitlement's inputs are on the metrics port after a step.
    #[tokio::test]
    async fn every_lease_given_is_an_arrival_and_the_entitlements_gauges_show_it() {
        let (shared, engine) = test_plane(spec(autoscale(2.0)).expect("spec"));
        let body = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}"#;
        let mut ids = Vec::new();
        for tenant in [0, 0, 1] {
            let r = engine
                .route_body(body, Some(tenant), &Hints::default())
                .await;
            ids.push(r.expect("ok").expect("routed").id);
        }
        let s = engine.autoscale.as_ref().expect("autoscale on");
        let now = shared.now();
        // None finished yet; 3 arrived (2 of demo's gold) within the first
        // 5 s sub-window of the 10 s window: 3 / 5 and 2 / 5 req/s.
        let pool = s.live(0, None, now).expect("live");
        assert_eq!((pool.requests, pool.rate), (0, 3.0 / 5.0));
        assert_eq!(s.live(0, Some(0), now).expect("live").rate, 2.0 / 5.0);
        for id in ids {
            assert!(shared.release(id, Some((20, 10))));
        }
        s.step(shared.now(), &*engine).expect("step");
        let text = shared.metrics.text();
        let line = |l: &str| text.lines().any(|x| x == l);
        assert!(
            line(&format!(
                "routecore_entitlement_arrival_rate{{pool=\"p\",entitlement=\"gold\"}} {:?}",
                2.0 / 5.0
            )),
            "{text}"
        );
        assert!(line(
            "routecore_entitlement_prompt_tokens{pool=\"p\",entitlement=\"gold\",quantile=\"0.5\"} 20.0"
        ));
        assert!(line(
            "routecore_entitlement_output_tokens{pool=\"p\",entitlement=\"gold\",quantile=\"0.99\"} 10.0"
        ));
    }

    /// The data plane's spec checks its `autoscale` section against its
    /// pools (the section's own checks: `serve::autoscale`'s tests).
    #[test]
    fn a_section_naming_an_unknown_pool_is_refused() {
        let mut a = autoscale(2.0);
        a["config"]["pools"][0]["name"] = json!("nope");
        let err = spec(a).map(|_| ()).expect_err("refused").to_string();
        assert!(
            err.contains("autoscale.pools[0].name: unknown pool \"nope\""),
            "{err}"
        );
        let mut a = autoscale(2.0);
        a["config"]["period_s"] = json!(0.0);
        assert!(spec(a).is_err());
        assert!(spec(autoscale(2.0)).is_ok());
    }
}
