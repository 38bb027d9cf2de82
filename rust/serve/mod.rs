//! The data plane: Envoy's ext_proc on tonic, admission, load client; runs on
//! a tokio runtime owned by the extension (feature `server`).

pub mod admission;
pub mod loadgen;
