//! The KV-event metrics, read from the index at each scrape (a Prometheus
//! collector: the counters live in `KvIndex`, nothing is counted twice).

use std::sync::{Arc, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::kv::index::{KvIndex, KvStats};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: String,
}

type Read = fn(&KvStats) -> u64;

/// Counters: (name, help, value).
const COUNTERS: [(&str, &str, Read); 9] = [
    ("routecore_kv_event_batches", "KV-event batches applied, per endpoint", |s| s.batches),
    ("routecore_kv_events_applied", "KV events applied to the precise index, per endpoint", |s| s.events),
    ("routecore_kv_events_skipped", "KV events skipped (bad field, other block size or medium, unknown tag or block), per endpoint", |s| s.skipped),
    ("routecore_kv_event_garbage", "KV-event frames that were not a batch, per endpoint", |s| s.garbage),
    ("routecore_kv_event_duplicates", "KV-event batches seen twice, per endpoint", |s| s.duplicates),
    ("routecore_kv_event_gaps", "KV-event sequence gaps seen, per endpoint", |s| s.gaps),
    ("routecore_kv_event_replays", "KV-event gaps closed by replay, per endpoint", |s| s.replays),
    ("routecore_kv_event_unrecovered", "KV-event gaps replay could not close (the endpoint was cleared), per endpoint", |s| s.unrecovered),
    ("routecore_kv_event_restarts", "Engine restarts seen in the KV-event stream, per endpoint", |s| s.restarts),
];

/// The collector; `set` gives it the data plane's index.
#[derive(Debug, Default)]
pub struct KvCollector {
    index: RwLock<Option<Arc<KvIndex>>>,
}

impl KvCollector {
    pub fn set(&self, index: Arc<KvIndex>) {
        *self.index.write().unwrap_or_else(|p| p.into_inner()) = Some(index);
    }
}

impl Collector for KvCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(index) = self.index.read().unwrap_or_else(|p| p.into_inner()).clone() else {
            return Ok(());
        };
        let stats: Vec<(EndpointLabel, KvStats)> = index
            .endpoints()
            .into_iter()
            .filter_map(|endpoint| {
                let s = index.stats(&endpoint).ok()?;
                Some((EndpointLabel { endpoint }, s))
            })
            .collect();
        for (name, help, read) in COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (label, s) in &stats {
                ConstCounter::new(read(s)).encode(family.encode_family(label)?)?;
            }
        }
        let gauges: [(&str, &str, Read); 2] = [
            ("routecore_kv_blocks", "Blocks the precise index holds, per endpoint", |s| s.blocks),
            ("routecore_kv_events_live", "1 while an endpoint's prefix score comes from its KV events, 0 while it falls back to the approximate index", |s| u64::from(s.live)),
        ];
        for (name, help, read) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (label, s) in &stats {
                ConstGauge::new(read(s) as i64).encode(family.encode_family(label)?)?;
            }
        }
        Ok(())
    }
}
