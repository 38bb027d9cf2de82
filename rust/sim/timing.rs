//! How long one engine iteration takes.
//!
//! The papers' model (token-budget paper Appendix A Eq. 9, FleetOpt Eq. 3) is
//! the linear-overhead roofline `t_iter = W + H * n_active`: `W` is the
//! per-iteration cost of reading the weights, `H` the cost each active sequence
//! adds (its KV reads, sampling, scheduling). It is a trait so that a profiled
//! model (a table measured on real hardware) can replace it.

use crate::error::{non_negative, positive, Result};

/// What an iteration's duration may depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    /// Sequences in the iteration: every decoding sequence plus every sequence
    /// that got part of the prefill chunk.
    pub n_active: usize,
    /// Prompt tokens prefilled in the iteration (at most the chunk size).
    pub prefill_tokens: u64,
}

/// The duration, in seconds, of one continuous-batching iteration.
pub trait TimingModel: Send + Sync + std::fmt::Debug {
    fn iteration_time(&self, batch: Batch) -> f64;
}

/// `t_iter = W + H * n_active`, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearTiming {
    pub w: f64,
    pub h: f64,
}

impl LinearTiming {
    /// `w` > 0 and `h` >= 0, in seconds (the papers' A100 / Llama-3-70B
    /// calibration is W = 8 ms, H = 0.65 ms).
    pub fn new(w: f64, h: f64) -> Result<Self> {
        Ok(Self {
            w: positive("W", w)?,
            h: non_negative("H", h)?,
        })
    }
}

impl TimingModel for LinearTiming {
    fn iteration_time(&self, batch: Batch) -> f64 {
        self.w + self.h * batch.n_active as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn papers_figures() {
        let t = LinearTiming::new(0.008, 0.00065).expect("timing");
        let at = |n| {
            t.iteration_time(Batch {
                n_active: n,
                prefill_tokens: 0,
            })
        };
        // Appendix A: 18.4 ms at 16 sequences, about 91 ms at 128.
        assert!((at(16) - 0.0184).abs() < 1e-12);
        assert!((at(128) - 0.0912).abs() < 1e-12);
        assert!(LinearTiming::new(0.0, 0.1).is_err());
        assert!(LinearTiming::new(0.01, -1.0).is_err());
        assert!(LinearTiming::new(f64::NAN, 0.1).is_err());
    }
}
