//! The data plane (feature `server`): Envoy's ext_proc served by tonic on a
//! tokio runtime owned by the extension. A conversation never enters the
//! Python interpreter: parsing, admission, pool and endpoint choice,
//! compression, usage reading, lease release, metrics and logs run here;
//! Python is the control plane (configuration, signals, the RouteCore API).

pub mod admission;
pub mod autoscale;
pub mod config;
pub mod counters;
pub mod engine;
pub mod extproc;
pub mod failure;
pub mod flow;
pub mod front;
pub mod handoff;
pub mod kv_events;
pub mod limits;
pub mod loadgen;
pub mod logs;
pub mod metrics;
pub mod pd_send;
pub mod runtime;
pub mod scrape;
pub mod unix_socket;
pub mod usage;
