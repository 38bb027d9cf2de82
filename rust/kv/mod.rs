//! Precise prefix routing from the engines' KV-cache events.
//!
//! `index` (pure Rust, always built) holds what each endpoint's engine caches,
//! keyed by routecore's own block hashes; the feature `kv-events` adds the
//! wire format (`decode`, msgpack via `rmpv`), the ZeroMQ subscribers on the
//! data plane's runtime (`subscriber`) and their metrics.

#[cfg(feature = "kv-events")]
pub mod decode;
pub mod index;
#[cfg(feature = "kv-events")]
pub mod metrics;
#[cfg(feature = "kv-events")]
pub mod subscriber;

pub use index::{Event, KvConfig, KvIndex, KvStats, Seq, Skip, Stored};
