//! Precise prefix routing from the engines' KV-cache events: the pure
//! index (`index`) of what each endpoint's engine caches, keyed by
//! routecore's own block hashes, configured by [`KvConfig`]. The wire
//! format and the ZeroMQ subscribers that feed it live in the data plane
//! (`serve::kv_events`).

pub mod index;

pub use index::{Event, KvConfig, KvHeld, KvIndex, KvStats, KvWalked, Seq, Skip, Stored};
