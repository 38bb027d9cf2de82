//! The value types the data plane's metrics count with, and the pool label
//! they share, a leaf: a module that defines a metric family of its own
//! (flow control's queues, the autoscaler's gauges, ...) imports them from
//! here, so `serve::metrics` can compose that family
//! without the two importing each other.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

pub type FCounter = Counter<f64, AtomicU64>;
pub type FGauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    pub pool: String,
}
