//! Prometheus metrics of one data plane, with the names and labels the Python
//! server had, served on their own port by a small HTTP/1 listener.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use super::counters::{FCounter, FGauge, PoolLabel};
pub use pd::{FallbackLabels, PdMetrics};

mod pd;

/// Decision latency buckets, in seconds (50 us to 50 ms).
pub const LATENCY_BUCKETS: [f64; 9] = [5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    pub endpoint: String,
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectionLabels {
    pub reason: String,
    pub service_class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CategoryLabel {
    pub category: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScrapeLabels {
    pub endpoint: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub endpoint: String,
    pub to: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    pub endpoint: String,
}

/// The scrape outcomes of one endpoint (`ok` or a failure's label).
pub struct ScrapeCounters {
    family: Family<ScrapeLabels, FCounter>,
    endpoint: String,
    ok: FCounter,
}

impl ScrapeCounters {
    pub fn count(&self, failure: Option<&str>) {
        match failure {
            None => self.ok.inc(),
            Some(outcome) => self
                .family
                .get_or_create(&ScrapeLabels {
                    endpoint: self.endpoint.clone(),
                    outcome: outcome.into(),
                })
                .inc(),
        };
    }
}

/// A fault of a peer or a client, by where it came from (`redis`,
/// `kv_events`, `scrape`, `client`, ...) and its kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FaultLabels {
    pub source: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    pub mode: String,
}

pub struct Metrics {
    registry: Registry,
    pub decisions: Family<PoolLabel, FCounter>,
    pub spillovers: Family<PoolLabel, FCounter>,
    /// Requests prefilled on another endpoint than their decode one (`crate::pd`).
    pub disaggregated: Family<PoolLabel, FCounter>,
    pub rejections: Family<RejectionLabels, FCounter>,
    pub calibration_ratio: Family<CategoryLabel, FGauge>,
    pub decision_seconds: Histogram,
    pub in_flight: Family<EndpointLabels, FGauge>,
    pub timeouts: Family<PoolLabel, FCounter>,
    pub absurd_usage: Family<PoolLabel, FCounter>,
    pub protocol_errors: FCounter,
    pub tokenize_skipped: FCounter,
    pub failures: Family<ModeLabel, FCounter>,
    pub faults: Family<FaultLabels, FCounter>,
    pub scrapes: Family<ScrapeLabels, FCounter>,
    pub endpoint_healthy: Family<EndpointLabel, FGauge>,
    pub endpoint_transitions: Family<TransitionLabels, FCounter>,
    /// Bytes the ext_proc streams' buffers hold (`limits.max_buffered_bytes`).
    pub buffered_bytes: FGauge,
    /// The KV-event metrics, read from the precise prefix index at each scrape.
    #[cfg(feature = "kv-events")]
    pub kv: Arc<super::kv_events::metrics::KvCollector>,
    /// Disaggregation: fallbacks of routecore's prefill sender, endpoint roles.
    pub pd: PdMetrics,
    /// The autoscaler's gauges (`serve::autoscale`).
    pub autoscale: Arc<super::autoscale::Gauges>,
    /// Flow control's queues (`serve::flow`).
    pub flow: super::flow::FlowMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::default();
        registry.register(
            "routecore_decisions",
            "Requests routed, per pool",
            decisions.clone(),
        );
        let spillovers = Family::default();
        registry.register(
            "routecore_spillovers",
            "Requests spilled off their target pool",
            spillovers.clone(),
        );
        let disaggregated = Family::default();
        registry.register(
            "routecore_disaggregated",
            "Requests split: prefilled on another endpoint than their decode endpoint, per pool",
            disaggregated.clone(),
        );
        let rejections = Family::default();
        registry.register(
            "routecore_rejections",
            "Requests refused, per service class and reason",
            rejections.clone(),
        );
        let calibration_ratio = Family::default();
        registry.register(
            "routecore_calibration_ratio",
            "Learned bytes per token, per category",
            calibration_ratio.clone(),
        );
        let decision_seconds = Histogram::new(LATENCY_BUCKETS);
        registry.register(
            "routecore_decision_seconds",
            "Time to decide one request (parse, admit, choose pool and endpoint)",
            decision_seconds.clone(),
        );
        let in_flight = Family::default();
        registry.register(
            "routecore_in_flight",
            "Requests in flight, per pool and endpoint",
            in_flight.clone(),
        );
        let timeouts = Family::default();
        registry.register(
            "routecore_timeouts",
            "Requests released because their response never came back",
            timeouts.clone(),
        );
        let absurd_usage = Family::default();
        registry.register(
            "routecore_absurd_usage",
            "Responses whose usage cannot be real (ignored for learning), per pool",
            absurd_usage.clone(),
        );
        let protocol_errors = FCounter::default();
        registry.register(
            "routecore_protocol_errors",
            "ext_proc streams ended for breaking the protocol (e.g. repeated request headers)",
            protocol_errors.clone(),
        );
        let tokenize_skipped = FCounter::default();
        registry.register(
            "routecore_tokenize_skipped",
            "Requests whose model's tokenizer or chat template failed (routed on the estimate)",
            tokenize_skipped.clone(),
        );
        let failures = Family::default();
        registry.register(
            "routecore_failures",
            "Internal failures, per failure mode applied (open or closed)",
            failures.clone(),
        );
        let faults = Family::default();
        registry.register(
            "routecore_faults",
            "Faults of peers and clients (Redis, KV-event publishers, engines, \
             clients), per source and kind; each counted whether or not it was logged",
            faults.clone(),
        );
        let scrapes = Family::default();
        registry.register(
            "routecore_scrapes",
            "Metrics scrapes of the endpoints, per endpoint and outcome \
             (ok, connect, timeout, status, too-large, garbage)",
            scrapes.clone(),
        );
        let endpoint_healthy = Family::default();
        registry.register(
            "routecore_endpoint_healthy",
            "1 while an endpoint is healthy (answers its metrics scrapes), else 0",
            endpoint_healthy.clone(),
        );
        let endpoint_transitions = Family::default();
        registry.register(
            "routecore_endpoint_transitions",
            "Endpoints turning healthy or unhealthy, per endpoint and state turned to",
            endpoint_transitions.clone(),
        );
        let buffered_bytes = FGauge::default();
        registry.register(
            "routecore_buffered_bytes",
            "Bytes held by the ext_proc streams' buffers (request bodies being \
             accumulated, response bodies read for their usage)",
            buffered_bytes.clone(),
        );
        let autoscale = Arc::new(super::autoscale::Gauges::register(&mut registry));
        #[cfg(feature = "kv-events")]
        let kv = Arc::new(super::kv_events::metrics::KvCollector::default());
        #[cfg(feature = "kv-events")]
        registry.register_collector(Box::new(Arc::clone(&kv)));
        let flow = super::flow::FlowMetrics::register(&mut registry);
        let pd = PdMetrics::register(&mut registry);
        Self {
            flow,
            pd,
            registry,
            #[cfg(feature = "kv-events")]
            kv,
            decisions,
            spillovers,
            disaggregated,
            rejections,
            calibration_ratio,
            decision_seconds,
            in_flight,
            timeouts,
            absurd_usage,
            protocol_errors,
            tokenize_skipped,
            failures,
            faults,
            scrapes,
            endpoint_healthy,
            endpoint_transitions,
            buffered_bytes,
            autoscale,
        }
    }

    pub fn scrape_counters(&self, endpoint: &str) -> ScrapeCounters {
        ScrapeCounters {
            family: self.scrapes.clone(),
            endpoint: endpoint.into(),
            ok: self.scrapes.get_or_create_owned(&ScrapeLabels {
                endpoint: endpoint.into(),
                outcome: "ok".into(),
            }),
        }
    }

    /// Sets an endpoint's health gauge; `transition`: counted as a change too.
    pub fn endpoint_health(&self, endpoint: &str, healthy: bool, transition: bool) {
        self.endpoint_healthy
            .get_or_create(&EndpointLabel {
                endpoint: endpoint.into(),
            })
            .set(if healthy { 1.0 } else { 0.0 });
        if transition {
            self.endpoint_transitions
                .get_or_create(&TransitionLabels {
                    endpoint: endpoint.into(),
                    to: if healthy { "healthy" } else { "unhealthy" }.into(),
                })
                .inc();
        }
    }

    pub fn pool(family: &Family<PoolLabel, FCounter>, pool: &str) -> FCounter {
        family.get_or_create_owned(&PoolLabel { pool: pool.into() })
    }

    pub fn in_flight_gauge(&self, pool: &str, endpoint: &str) -> FGauge {
        self.in_flight.get_or_create_owned(&EndpointLabels {
            endpoint: endpoint.into(),
            pool: pool.into(),
        })
    }

    pub fn reject(&self, service_class: &str, reason: &str) {
        self.rejections
            .get_or_create(&RejectionLabels {
                reason: reason.into(),
                service_class: service_class.into(),
            })
            .inc();
    }

    pub fn failure(&self, mode: &str) {
        self.failures
            .get_or_create(&ModeLabel { mode: mode.into() })
            .inc();
    }

    /// Counts one fault of `source` (`redis`, `kv_events`, ...) of `kind`.
    pub fn fault(&self, source: &str, kind: &str) {
        self.faults
            .get_or_create(&FaultLabels {
                source: source.into(),
                kind: kind.into(),
            })
            .inc();
    }

    /// The exposition text (OpenMetrics).
    pub fn text(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The current value of a metric by its Python attribute name and labels
    /// (in the Python label order), for tests and the control plane.
    pub fn value(&self, name: &str, labels: &[&str]) -> Option<f64> {
        let s = |i: usize| labels.get(i).map(|l| l.to_string());
        let pool = |f: &Family<PoolLabel, FCounter>| {
            Some(f.get_or_create(&PoolLabel { pool: s(0)? }).get())
        };
        match name {
            "decisions" => pool(&self.decisions),
            "spillovers" => pool(&self.spillovers),
            "disaggregated" => pool(&self.disaggregated),
            "timeouts" => pool(&self.timeouts),
            "absurd_usage" => pool(&self.absurd_usage),
            "protocol_errors" => Some(self.protocol_errors.get()),
            "tokenize_skipped" => Some(self.tokenize_skipped.get()),
            "buffered_bytes" => Some(self.buffered_bytes.get()),
            "rejections" => Some(
                self.rejections
                    .get_or_create(&RejectionLabels {
                        service_class: s(0)?,
                        reason: s(1)?,
                    })
                    .get(),
            ),
            "pd_fallbacks" => Some(
                self.pd
                    .fallbacks
                    .get_or_create(&FallbackLabels {
                        pool: s(0)?,
                        reason: s(1)?,
                    })
                    .get(),
            ),
            "failures" => Some(
                self.failures
                    .get_or_create(&ModeLabel { mode: s(0)? })
                    .get(),
            ),
            "faults" => Some(
                self.faults
                    .get_or_create(&FaultLabels {
                        source: s(0)?,
                        kind: s(1)?,
                    })
                    .get(),
            ),
            "flow_queue_requests" | "flow_queue_bytes" | "flow_outcomes" => {
                self.flow.value(name, labels)
            }
            "calibration_ratio" => Some(
                self.calibration_ratio
                    .get_or_create(&CategoryLabel { category: s(0)? })
                    .get(),
            ),
            "scrapes" => Some(
                self.scrapes
                    .get_or_create(&ScrapeLabels {
                        endpoint: s(0)?,
                        outcome: s(1)?,
                    })
                    .get(),
            ),
            "endpoint_healthy" => Some(
                self.endpoint_healthy
                    .get_or_create(&EndpointLabel { endpoint: s(0)? })
                    .get(),
            ),
            "endpoint_transitions" => Some(
                self.endpoint_transitions
                    .get_or_create(&TransitionLabels {
                        endpoint: s(0)?,
                        to: s(1)?,
                    })
                    .get(),
            ),
            "in_flight" => Some(
                self.in_flight
                    .get_or_create(&EndpointLabels {
                        pool: s(0)?,
                        endpoint: s(1)?,
                    })
                    .get(),
            ),
            _ => None,
        }
    }
}

/// Serves `GET /metrics` (any path) until `stop` turns true.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, mut stop: watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        let Ok((stream, _)) = accepted else { continue };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let service = service_fn(move |_req: Request<hyper::body::Incoming>| {
                let body = metrics.text();
                async move {
                    Response::builder()
                        .header(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )
                        .body(Full::new(Bytes::from(body)))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Binds the metrics listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
