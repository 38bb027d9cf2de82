use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use serde_json::{json, Value};

use super::*;

fn profile_json() -> Value {
    let p = Profile::llama3_70b_a100();
    json!({"name": p.name, "layers": p.layers, "kv_heads": p.kv_heads,
           "head_dim": p.head_dim, "dtype_bytes": p.dtype_bytes,
           "tensor_parallel": p.tensor_parallel, "gpu_memory_bytes": p.gpu_memory_bytes,
           "utilization": p.utilization, "model_memory_bytes": p.model_memory_bytes,
           "w_s": p.w_s, "h_s": p.h_s, "c_chunk": p.c_chunk,
           "price_per_gpu_hour": p.price_per_gpu_hour, "h_ref_tokens": p.h_ref_tokens})
}

/// The `autoscale` section: pool `p` scaled within [1, 3] for `slo_ttft_s`,
/// entitlement `gold` kept apart, 100 promised tokens/s.
pub(crate) fn autoscale(slo_ttft_s: f64) -> Value {
    json!({
        "config": {"period_s": 1.0, "window_s": 10.0, "sub_windows": 2,
                   "scale_down_delay_s": 5.0,
                   "pools": [{"name": "p", "context": 8192, "min_endpoints": 1,
                              "max_endpoints": 3, "slo_ttft_s": slo_ttft_s,
                              "entitlements": ["gold"]}]},
        "profiles": [profile_json()],
        "promised_tokens_per_s": [100.0],
    })
}

/// The data plane's pools `p` (scaled) and `q` (not), two addresses each.
const POOLS: [PlanePool<'static>; 2] = [
    PlanePool {
        name: "p",
        endpoints: 2,
    },
    PlanePool {
        name: "q",
        endpoints: 2,
    },
];

/// The tenants' entitlements: `demo`'s `gold`, `other` none.
const TENANTS: [Option<&str>; 2] = [Some("gold"), None];

/// The gauges in a registry of their own, and its exposition text.
struct Exposed {
    registry: Registry,
    gauges: Arc<Gauges>,
}

impl Exposed {
    fn new() -> Self {
        let mut registry = Registry::default();
        let gauges = Arc::new(Gauges::register(&mut registry));
        Self { registry, gauges }
    }

    fn text(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("text");
        out
    }
}

fn section(a: Value) -> AutoscaleSpec {
    serde_json::from_value(a).expect("section")
}

fn scaling_of(a: Value, gauges: &Exposed, previous: Option<&Scaling>, now: f64) -> Result<Scaling> {
    let gauges = Arc::clone(&gauges.gauges);
    Scaling::new(&section(a), &POOLS, &TENANTS, gauges, previous, now)
}

fn scaling(slo_ttft_s: f64, gauges: &Exposed) -> Scaling {
    scaling_of(autoscale(slo_ttft_s), gauges, None, 0.0).expect("scaling")
}

struct Held(f64);

impl PoolSignals for Held {
    fn queued_requests(&self, pool: usize) -> f64 {
        if pool == 0 {
            self.0
        } else {
            0.0
        }
    }
}

#[test]
fn a_pool_without_scaling_is_not_observed() {
    let metrics = Exposed::new();
    let s = scaling(2.0, &metrics);
    assert!(s.observe(0, Some(0), 1.0, 2000, 200));
    assert!(
        !s.observe(1, Some(0), 1.0, 2000, 200),
        "pool q is not scaled"
    );
    assert!(
        !s.observe(0, None, 1.0, u64::MAX, 200),
        "beyond the token bound"
    );
    assert!(!s.observe(9, None, 1.0, 2000, 200));
    assert_eq!(s.live(0, None, 1.0).expect("live").requests, 1);
}

#[test]
fn a_step_publishes_the_gauges_and_the_queued_demand_reaches_the_sizing() {
    let metrics = Exposed::new();
    let s = scaling(2.0, &metrics);
    assert!(s.last().is_empty());
    // No traffic: min endpoints.
    s.step(0.5, &Held(0.0)).expect("step");
    let d = &s.last()[0];
    assert_eq!((d.endpoints, d.target.reason), (1, Reason::NoTraffic));
    for i in 0..100 {
        assert!(s.observe(0, None, 1.0 + f64::from(i) / 100.0, 2000, 200));
    }
    s.step(2.0, &Held(30.0)).expect("step");
    let d = &s.last()[0];
    assert_eq!(d.target.queued_rate, 30.0, "30 held over a 1 s period");
    assert_eq!(d.target.rate, d.target.observed_rate + 30.0);
    assert!(d.target.promised_rate > 0.0);
    let text = metrics.text();
    let line = |l: &str| text.lines().any(|x| x == l);
    assert!(line(&format!(
        "routecore_pool_desired_endpoints{{pool=\"p\"}} {:?}",
        d.endpoints as f64
    )));
    assert!(line(&format!(
        "routecore_pool_model_endpoints{{pool=\"p\"}} {:?}",
        d.target.model_endpoints as f64
    )));
    assert!(line(
        "routecore_pool_arrival_rate{pool=\"p\",source=\"queued\"} 30.0"
    ));
    assert!(line(&format!(
        "routecore_pool_binding{{pool=\"p\",resource=\"{}\"}} 1.0",
        d.target.binding.name()
    )));
    assert!(line(&format!(
        "routecore_pool_prompt_tokens{{pool=\"p\",quantile=\"0.5\"}} {:?}",
        d.target.prompt_tokens.p50 as f64
    )));
    assert!(line(&format!(
        "routecore_pool_scaling_reason{{pool=\"p\",reason=\"{}\"}} 1.0",
        d.target.reason.name()
    )));
    assert!(!text.contains("pool=\"q\""), "q is not scaled");
    // A queue that is not a count changes nothing.
    let before = s.last();
    assert!(s.step(3.0, &Held(f64::NAN)).is_err());
    assert_eq!(s.last(), before);
}

#[test]
fn an_slo_no_fleet_meets_says_max_and_warns_once_per_change() {
    let metrics = Exposed::new();
    let s = scaling(1e-6, &metrics);
    for i in 0..100 {
        s.observe(0, None, f64::from(i) / 100.0, 2000, 200);
    }
    let changed = s.step(1.0, &Held(0.0)).expect("step");
    let d = s.last()[0].clone();
    assert_eq!(d.target.reason, Reason::SloUnreachable);
    assert_eq!((d.target.endpoints, d.endpoints), (3, 3));
    assert_eq!(changed, vec![("p".to_owned(), at_max(&d))]);
    assert_ne!(
        d.target.binding,
        Binding::None,
        "names the binding constraint"
    );
    assert!(
        s.step(2.0, &Held(0.0)).expect("step").is_empty(),
        "logged once"
    );
    // The traffic leaves the window: back to min, one more change.
    let changed = s.step(30.0, &Held(0.0)).expect("step");
    assert_eq!(changed, vec![("p".to_owned(), None)]);
    assert!(s.step(31.0, &Held(0.0)).expect("step").is_empty());
}

/// One endpoint ready, whatever else the pool runs.
struct OneReady;

impl PoolSignals for OneReady {
    fn queued_requests(&self, _: usize) -> f64 {
        0.0
    }

    fn ready_endpoints(&self, _: usize) -> Option<u64> {
        Some(1)
    }
}

/// A pool that lists an address for every endpoint it may run (2 of at
/// most 2) reads its endpoints' health as their readiness: the endpoints
/// its count asked for that are not ready yet are cancelled as soon as the
/// target falls, without the scale-down delay. A pool listing fewer (2 of
/// at most 3: one address in front of several) cannot tell, and waits.
#[test]
fn starting_endpoints_are_cancelled_where_the_pool_lists_every_endpoint() {
    for (max, want) in [(2, 1), (3, 3)] {
        let mut a = autoscale(1e-6);
        a["config"]["pools"][0]["max_endpoints"] = json!(max);
        let metrics = Exposed::new();
        let s = scaling_of(a, &metrics, None, 0.0).expect("scaling");
        for i in 0..100 {
            s.observe(0, None, f64::from(i) / 100.0, 2000, 200);
        }
        s.step(1.0, &OneReady).expect("step");
        assert_eq!(s.last()[0].endpoints, max, "an SLO no count meets: max");
        // The traffic left the window: the target is 1, 5 s of delay.
        s.step(30.0, &OneReady).expect("step");
        let d = &s.last()[0];
        assert_eq!((d.target.endpoints, d.endpoints), (1, want), "max {max}");
    }
}

#[test]
fn a_reload_with_the_same_section_keeps_the_windows_and_another_starts_afresh() {
    let metrics = Exposed::new();
    let first = scaling(2.0, &metrics);
    first.observe(0, None, 1.0, 2000, 200);
    first.step(1.5, &Held(0.0)).expect("step");
    let reason = format!(
        "routecore_pool_scaling_reason{{pool=\"p\",reason=\"{}\"}} 1.0",
        first.last()[0].target.reason.name()
    );
    assert!(metrics.text().contains(&reason));
    let same = scaling_of(autoscale(2.0), &metrics, Some(&first), 2.0).expect("same");
    assert_eq!(same.last(), first.last());
    assert_eq!(same.live(0, None, 2.0).expect("live").requests, 1);
    let other = scaling_of(autoscale(3.0), &metrics, Some(&first), 2.0).expect("other");
    assert!(other.last().is_empty());
    assert_eq!(other.live(0, None, 2.0).expect("live").requests, 0);
    // Its series start afresh: the minimum until the first step, the
    // previous model count and reasons gone.
    let text = metrics.text();
    assert!(text.contains("routecore_pool_desired_endpoints{pool=\"p\"} 1.0\n"));
    assert!(text.contains("routecore_pool_model_endpoints{pool=\"p\"} 0.0\n"));
    assert!(!text.contains(&reason));
}

#[test]
fn a_bad_section_is_refused_naming_the_key() {
    let names = POOLS.map(|p| p.name);
    let err = |a: Value| section(a).check(&names).expect_err("refused").to_string();
    let mut a = autoscale(2.0);
    a["config"]["pools"][0]["min_endpoints"] = json!(5);
    assert!(err(a).contains("autoscale.pools[0].min_endpoints (5) is above max_endpoints (3)"));
    let mut a = autoscale(2.0);
    a["config"]["period_s"] = json!(0.0);
    assert!(err(a).contains("autoscale.period_s"));
    let mut a = autoscale(2.0);
    a["config"]["pools"][0]["name"] = json!("nope");
    assert!(err(a).contains("autoscale.pools[0].name: unknown pool \"nope\""));
    let mut a = autoscale(2.0);
    a["profiles"] = json!([]);
    assert!(err(a).contains("1 pools but 0 profiles"));
    let mut a = autoscale(2.0);
    a["promised_tokens_per_s"] = json!([1.0, 2.0]);
    assert!(err(a).contains("promised rates"));
}

/// The data plane's share, Rust alone: one observed request through
/// [`Scaling::observe`] (the pool and entitlement look-ups, the lock, the
/// window) beside the pure [`Autoscaler::observe`] in the same run, and one
/// [`Scaling::step`] of eight pools with its gauges published. Prints,
/// never asserts.
/// `cargo test --release --features server --lib -- --ignored --nocapture serve_autoscale_timing`
#[test]
#[ignore]
fn serve_autoscale_timing() {
    let names: Vec<String> = (0..8).map(|i| format!("p{i}")).collect();
    let pools: Vec<PlanePool<'_>> = names
        .iter()
        .map(|n| PlanePool {
            name: n,
            endpoints: 1,
        })
        .collect();
    let tenants = [Some("gold")];
    let spec: AutoscaleSpec = serde_json::from_value(json!({
        "config": {"pools": names.iter().map(|n| json!({
            "name": n, "context": 8192, "max_endpoints": 1 << 20, "slo_ttft_s": 1.5,
            "slo_tpot_s": 0.08, "entitlements": ["gold"]})).collect::<Vec<_>>()},
        "profiles": vec![profile_json(); 8],
    }))
    .expect("spec");
    let gauges = Arc::new(Gauges::register(&mut Registry::default()));
    let s = Scaling::new(&spec, &pools, &tenants, gauges, None, 0.0).expect("scaling");
    let mut pure = Autoscaler::new(spec.config.clone(), spec.profiles.clone(), 0.0).expect("ok");
    let n = 4_000_000usize;
    let req = |k: usize| {
        (
            k % 8,
            k as f64 / 12_800.0,
            256 + (k % 4096) as u64,
            1 + (k % 700) as u64,
        )
    };
    for round in 0..2 {
        let start = std::time::Instant::now();
        for k in 0..n {
            let (p, t, i, o) = req(k);
            std::hint::black_box(pure.observe(p, Some(0), t, i, o).is_ok());
        }
        let bare = start.elapsed().as_nanos() as f64 / n as f64;
        let start = std::time::Instant::now();
        for k in 0..n {
            let (p, t, i, o) = req(k);
            std::hint::black_box(s.observe(p, Some(0), t, i, o));
        }
        let wired = start.elapsed().as_nanos() as f64 / n as f64;
        println!("round {round}: observe {bare:.1} ns pure, {wired:.1} ns in the data plane");
    }
    let now = n as f64 / 12_800.0;
    let rounds = 2_000;
    for round in 0..2 {
        let start = std::time::Instant::now();
        for r in 0..rounds {
            std::hint::black_box(pure.step(now + r as f64 * 1e-6, &[]).expect("step"));
        }
        let bare = start.elapsed().as_secs_f64() * 1e6 / rounds as f64;
        let start = std::time::Instant::now();
        for r in 0..rounds {
            s.step(now + r as f64 * 1e-6, &Held(0.0)).expect("step");
        }
        let wired = start.elapsed().as_secs_f64() * 1e6 / rounds as f64;
        println!(
            "round {round}: step, 8 pools: {bare:.1} us pure, {wired:.1} us with the gauges published"
        );
    }
}
