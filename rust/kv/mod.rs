//! Precise prefix routing from the engines' KV-cache events.
//!
//! `index` (pure Rust, always built) holds what each endpoint's engine caches,
//! keyed by routecore's own block hashes; the feature `kv-events` adds the
//! wire format (`decode`, msgpack via `rmpv`), the ZeroMQ subscribers on the
//! data plane's runtime (`subscriber`) and their metrics.

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

    /// Starts a subscriber per source of `spec` on `runtime`, until `stop`.
    #[cfg(feature = "kv-events")]
    pub fn subscribe(
        spec: Option<&KvEventsSpec>,
        index: &Arc<KvIndex>,
        runtime: &tokio::runtime::Handle,
        stop: &tokio::sync::watch::Receiver<bool>,
    ) -> Result<()> {
        use super::subscriber::{check, spawn, Source};
        let sources: Vec<Source> = spec
            .map(|k| &k.sources[..])
            .unwrap_or_default()
            .iter()
            .map(|s| Source {
                endpoint: s.endpoint.clone(),
                zmq: s.zmq.clone(),
                topic: s.topic.clone(),
                replay: s.replay.clone(),
            })
            .collect();
        sources.iter().try_for_each(check)?;
        spawn(runtime, index, &sources, stop);
        Ok(())
    }

    /// Without the `kv-events` feature a spec with sources is refused.
    #[cfg(not(feature = "kv-events"))]
    pub fn subscribe(
        spec: Option<&KvEventsSpec>,
        _index: &Arc<KvIndex>,
        _runtime: &tokio::runtime::Handle,
        _stop: &tokio::sync::watch::Receiver<bool>,
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
