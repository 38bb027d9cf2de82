//! Flow control: a saturated pool holds requests in priority bands, shared
//! fairly among flows, instead of sending them to a saturated engine or
//! refusing them (llm-d / the Gateway API Inference Extension's flow
//! control, Dynamo's router queue, driven by the token-pool priorities of
//! Cunningham 2026).
//!
//! The pure discipline, with no I/O and no runtime:
//!
//! - [`FlowConfig`] (`config.rs`): bands named from service classes or
//!   objectives, limits per band and per pool in requests and bytes, a TTL,
//!   the fairness and ordering policies; it checks itself.
//! - [`FlowQueue`] (`queue.rs`): the queue, generic over what it holds, with
//!   explicit `now`: enqueue (accepted, refused with a reason and
//!   Retry-After, or accepted after displacing lower bands), dispatch,
//!   expiry, cancel by ticket, drain; counts and outcome counters per band,
//!   a wait-time histogram.
//! - [`SaturationDetector`] (`saturation.rs`): whether a pool must hold its
//!   requests, from its endpoints' state and the admission layer.
//!
//! The data plane, the Python API and the simulator wrap these (one
//! implementation, several front ends).

mod config;
mod heap;
mod queue;
mod saturation;
#[cfg(test)]
pub(crate) mod tests;

pub use config::{
    Band, BandConfig, Fairness, FlowConfig, Ordering, DEFAULT_MAX_BYTES, DEFAULT_MAX_REQUESTS,
    DEFAULT_TTL_S, MAX_BANDS, MAX_NAME_BYTES, MAX_REQUEST_BYTES,
};
pub use queue::{
    Arrival, BandStats, Enqueued, FlowQueue, Left, Outcome, Outcomes, Refusal, Ticket,
    WaitHistogram, MIN_WEIGHT, RATE_WINDOW_S, WAIT_BUCKETS_S,
};
pub use saturation::{Detector, SaturationConfig, SaturationDetector, DEFAULT_MAX_IN_FLIGHT};
