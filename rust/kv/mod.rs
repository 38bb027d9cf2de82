//! Precise prefix routing from the engines' KV-cache events.
//!
//! `index` (pure Rust, always built) holds what each endpoint's engine caches,
//! keyed by routecore's own block hashes; the feature `kv-events` adds the
//! wire format (`decode`, msgpack via `rmp`), the ZeroMQ subscribers on the
//! data plane's runtime (`subscriber`) behind a size guard (`guard`) and
//! their metrics.

#[cfg(feature = "kv-events")]
pub mod decode;
#[cfg(feature = "kv-events")]
pub mod guard;
pub mod index;
#[cfg(feature = "kv-events")]
pub mod metrics;
#[cfg(feature = "kv-events")]
pub mod subscriber;

pub use index::{Event, KvConfig, KvIndex, KvStats, Seq, Skip, Stored};

#[cfg(feature = "server")]
mod plane {
    use std::sync::Arc;

    use super::{KvConfig, KvIndex};
    use crate::error::Result;
    use crate::serve::config::KvEventsSpec;

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
        faults: super::Faults,
    ) -> Result<()> {
        use super::subscriber::{check, spawn, PeerLimits, Source};
        let Some(spec) = spec else { return Ok(()) };
        let limits = PeerLimits {
            max_message_bytes: spec.max_message_bytes,
            max_batch_events: spec.max_batch_events,
            max_batch_blocks: spec.max_batch_blocks,
        }
        .check()?;
        let sources: Vec<Source> = spec
            .sources
            .iter()
            .map(|s| Source {
                endpoint: s.endpoint.clone(),
                zmq: s.zmq.clone(),
                topic: s.topic.clone(),
                replay: s.replay.clone(),
            })
            .collect();
        sources.iter().try_for_each(check)?;
        spawn(runtime, index, &sources, limits, &faults, stop);
        Ok(())
    }

    /// Without the `kv-events` feature a spec with sources is refused.
    #[cfg(not(feature = "kv-events"))]
    pub fn subscribe(
        spec: Option<&KvEventsSpec>,
        _index: &Arc<KvIndex>,
        _runtime: &tokio::runtime::Handle,
        _stop: &tokio::sync::watch::Receiver<bool>,
        _faults: super::Faults,
    ) -> Result<()> {
        match spec {
            Some(k) if !k.sources.is_empty() => Err(crate::error::invalid(
                "kv_events: this build has no KV-event subscribers (cargo feature kv-events)",
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(feature = "server")]
pub use plane::{index_for, subscribe};

/// Counts one fault of a KV-event peer by kind (the data plane's
/// `routecore_faults_total{source="kv_events", kind}`).
#[cfg(feature = "server")]
pub type Faults = std::sync::Arc<dyn Fn(&'static str) + Send + Sync>;
