//! The engines' KV-cache events on the data plane: their wire format
//! (`decode`, msgpack via `rmp`), the ZeroMQ subscribers on the data
//! plane's runtime (`subscriber`) behind a size guard (`guard`), and their
//! metrics (feature `kv-events`); they feed the pure index (`crate::kv`).

#[cfg(feature = "kv-events")]
pub mod decode;
#[cfg(feature = "kv-events")]
pub mod guard;
#[cfg(feature = "kv-events")]
pub mod metrics;
#[cfg(feature = "kv-events")]
pub mod subscriber;

use std::sync::Arc;

use crate::error::Result;
use crate::kv::{KvConfig, KvIndex};

/// One endpoint's KV-event source (`kv_events.endpoints` of the config),
/// what its subscriber connects to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvSourceSpec {
    pub endpoint: String,
    /// The engine's PUB address, e.g. `tcp://10.0.0.5:5557`.
    pub zmq: String,
    pub topic: String,
    /// The engine's replay ROUTER address; None: gaps are not recovered.
    pub replay: Option<String>,
}

/// The precise prefix index and its subscribers (`kv_events`).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsSpec {
    pub block_size: usize,
    pub seed: u64,
    pub capacity_blocks: usize,
    pub stale_after_s: Option<f64>,
    /// What a peer may send (`kv_events::subscriber::PeerLimits`).
    pub max_message_bytes: u64,
    pub max_batch_events: usize,
    pub max_batch_blocks: usize,
    pub sources: Vec<KvSourceSpec>,
}

/// The data plane's index from the spec's `kv_events` (an empty default
/// index without: every endpoint then scores by the approximate index).
pub fn index_for(spec: Option<&KvEventsSpec>) -> Result<Arc<KvIndex>> {
    let Some(k) = spec else {
        return Ok(Arc::default());
    };
    Ok(Arc::new(KvIndex::new(KvConfig {
        block_size: k.block_size,
        seed: k.seed,
        capacity_blocks: k.capacity_blocks,
        stale_after_s: k.stale_after_s,
    })?))
}

/// Starts a subscriber per source of `spec` on `runtime`, until `stop`;
/// `faults` counts the peers' faults by kind.
#[cfg(feature = "kv-events")]
pub fn subscribe(
    spec: Option<&KvEventsSpec>,
    index: &Arc<KvIndex>,
    runtime: &tokio::runtime::Handle,
    stop: &tokio::sync::watch::Receiver<bool>,
    faults: Faults,
) -> Result<()> {
    use subscriber::{check, spawn, PeerLimits};
    let Some(spec) = spec else { return Ok(()) };
    let limits = PeerLimits {
        max_message_bytes: spec.max_message_bytes,
        max_batch_events: spec.max_batch_events,
        max_batch_blocks: spec.max_batch_blocks,
    }
    .check()?;
    spec.sources.iter().try_for_each(check)?;
    spawn(runtime, index, &spec.sources, limits, &faults, stop);
    Ok(())
}

/// Without the `kv-events` feature a spec with sources is refused.
#[cfg(not(feature = "kv-events"))]
pub fn subscribe(
    spec: Option<&KvEventsSpec>,
    _index: &Arc<KvIndex>,
    _runtime: &tokio::runtime::Handle,
    _stop: &tokio::sync::watch::Receiver<bool>,
    _faults: Faults,
) -> Result<()> {
    match spec {
        Some(k) if !k.sources.is_empty() => Err(crate::error::invalid(
            "kv_events: this build has no KV-event subscribers (cargo feature kv-events)",
        )),
        _ => Ok(()),
    }
}

/// Counts one fault of a KV-event peer by kind (the data plane's
/// `routecore_faults_total{source="kv_events", kind}`).
pub type Faults = std::sync::Arc<dyn Fn(&'static str) + Send + Sync>;
