//! Hardware and model profiles: what one GPU of a pool can hold and how fast
//! it serves a workload (FleetOpt Sections 2.2 and 3.1; the token-budget
//! paper's Eq. 1-2 and Appendix A).
//!
//! - KV bytes per token `= 2 * layers * kv_heads * head_dim * dtype_bytes`
//!   (Eq. 1); per GPU under tensor parallelism the KV heads are split across
//!   the `tp` GPUs, at least one each: `ceil(kv_heads / tp)`.
//! - Slots (concurrent sequences per GPU) at a context window `C_max`:
//!   `floor((gpu_memory * utilization - model_memory) / (kv_per_token_per_gpu * C_max))` (Eq. 2).
//! - Iteration time `t_iter = W + H * n_slots` (FleetOpt Eq. 3). With
//!   `h_ref_tokens` set, the per-slot cost scales with the request's length:
//!   `t_iter = W + H * (L_total / h_ref_tokens) * n_slots`, the slot model of
//!   FleetOpt's public implementation (H calibrated at `h_ref_tokens`).
//! - Service time `S = (ceil(L_in / C_chunk) + L_out) * t_iter` (Eq. 4);
//!   `mu_gpu = n_slots / E[S]`, `Cs^2 = Var[S] / E[S]^2`, exact over the
//!   workload range (prefix sums, see `workload`).

use serde::Deserialize;

use crate::error::{invalid, non_negative, positive, Result};
use crate::workload::{RangeMoments, Span, Workload};

/// Deserialized from the constructor's fields (`routecore.Profile.fields()`,
/// all of them: the data plane's spec carries each pool's profile so).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: f64,
    pub tensor_parallel: u32,
    /// HBM per GPU, bytes.
    pub gpu_memory_bytes: f64,
    /// Fraction of HBM the engine may use (vLLM `gpu_memory_utilization`).
    pub utilization: f64,
    /// Weights, activations and runtime buffers per GPU, bytes.
    pub model_memory_bytes: f64,
    /// Base iteration time W, seconds.
    pub w_s: f64,
    /// Per-slot iteration cost H, seconds.
    pub h_s: f64,
    /// Prefill chunk size C_chunk, tokens.
    pub c_chunk: u64,
    /// Price of one GPU-hour, USD.
    pub price_per_gpu_hour: f64,
    /// When set, H is the per-slot cost of a sequence of this many tokens and
    /// scales linearly with each request's total length.
    pub h_ref_tokens: Option<u64>,
}

/// The service of one workload range on one pool's GPUs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Service {
    /// Slots per GPU at the pool's context window.
    pub n_slots: u64,
    /// Fraction of the workload's weight in the range.
    pub fraction: f64,
    /// E[S], seconds.
    pub mean_s: f64,
    /// Var[S] / E[S]^2.
    pub cs2: f64,
    /// n_slots / E[S], requests per second per GPU.
    pub mu_gpu: f64,
    /// Iteration time at full occupancy with the range's mean length, seconds.
    pub t_iter_s: f64,
    /// P99 prefill time `ceil(L_in / C_chunk)_99 * t_iter_s`, seconds.
    pub prefill_p99_s: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

impl Profile {
    /// Checks every field; the error names the first one out of range.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("tensor_parallel", self.tensor_parallel),
        ] {
            if v == 0 {
                return Err(invalid(format!("{what} must be >= 1")));
            }
        }
        positive("dtype_bytes", self.dtype_bytes)?;
        positive("gpu_memory_bytes", self.gpu_memory_bytes)?;
        positive("utilization", self.utilization)?;
        if self.utilization > 1.0 {
            return Err(invalid(format!(
                "utilization must be in (0, 1], got {}",
                self.utilization
            )));
        }
        non_negative("model_memory_bytes", self.model_memory_bytes)?;
        if self.kv_memory_bytes() <= 0.0 {
            return Err(invalid(format!(
                "model_memory_bytes ({}) leaves no KV memory in gpu_memory_bytes * utilization ({})",
                self.model_memory_bytes,
                self.gpu_memory_bytes * self.utilization
            )));
        }
        non_negative("w_s", self.w_s)?;
        non_negative("h_s", self.h_s)?;
        if self.w_s + self.h_s <= 0.0 {
            return Err(invalid("w_s + h_s must be > 0"));
        }
        if self.c_chunk == 0 {
            return Err(invalid("c_chunk must be >= 1"));
        }
        non_negative("price_per_gpu_hour", self.price_per_gpu_hour)?;
        if self.h_ref_tokens == Some(0) {
            return Err(invalid("h_ref_tokens must be >= 1"));
        }
        Ok(())
    }

    /// Llama-3-70B (BF16: 80 layers, 8 KV heads, head_dim 128) on A100-80GB,
    /// tensor parallel 8, the FleetOpt evaluation profile: W = 8 ms,
    /// H = 0.65 ms, C_chunk = 512, $2.21/GPU-hour (FleetOpt Section 7.1). KV
    /// is 320 KiB/token for the model, 40 KiB/token per GPU. Memory: 80 GiB at
    /// 0.90 utilization minus 32 GiB for weights (140 GB / 8) plus activations
    /// and runtime buffers leaves 40 GiB of KV per GPU: 1,048,576 tokens, the
    /// 65,536 16-token blocks of FleetOpt's public profile, so 16 slots at 64K,
    /// 128 at 8K, 256 at 4K and 682 at 1.5K (the paper's n_max).
    pub fn llama3_70b_a100() -> Self {
        Self {
            name: "llama3-70b-a100".into(),
            layers: 80,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2.0,
            tensor_parallel: 8,
            gpu_memory_bytes: 80.0 * GIB,
            utilization: 0.90,
            model_memory_bytes: 32.0 * GIB,
            w_s: 0.008,
            h_s: 0.00065,
            c_chunk: 512,
            price_per_gpu_hour: 2.21,
            h_ref_tokens: None,
        }
    }

    /// Qwen3-235B-A22B in FP8 (94 layers, 4 KV heads, head_dim 128) on AMD
    /// MI300X (192 GB HBM3), tensor parallel 8: the token-budget paper's case
    /// study (Section 4.7). 4 KV heads over 8 GPUs leave one head per GPU:
    /// 23.5 KiB/token/GPU. 192 GB at 0.90 minus 29.4 GB of weights and 10 GB
    /// of activations leaves 133.4 GB of KV: 676 slots at 8K, 169 at 32K.
    /// Price $3.67/GPU-hour (the paper's cloud rate). The paper gives no
    /// timing constants for this pair: W and H are the A100 values scaled by
    /// MI300X's HBM bandwidth (5.3 TB/s vs 2.0 TB/s): W = 3 ms, H = 0.25 ms;
    /// calibrate them for real use.
    pub fn qwen3_235b_mi300x() -> Self {
        Self {
            name: "qwen3-235b-a22b-fp8-mi300x".into(),
            layers: 94,
            kv_heads: 4,
            head_dim: 128,
            dtype_bytes: 1.0,
            tensor_parallel: 8,
            gpu_memory_bytes: 192e9,
            utilization: 0.90,
            model_memory_bytes: 39.4e9,
            w_s: 0.003,
            h_s: 0.00025,
            c_chunk: 512,
            price_per_gpu_hour: 3.67,
            h_ref_tokens: None,
        }
    }

    /// `2 * layers * kv_heads * head_dim * dtype_bytes`: the whole model's KV
    /// bytes per token.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * self.layers as f64 * self.kv_heads as f64 * self.head_dim as f64 * self.dtype_bytes
    }

    /// KV bytes per token on one GPU: the KV heads split over `tensor_parallel`
    /// GPUs, at least one head each.
    pub fn kv_bytes_per_token_per_gpu(&self) -> f64 {
        let heads = self.kv_heads.div_ceil(self.tensor_parallel);
        2.0 * self.layers as f64 * heads as f64 * self.head_dim as f64 * self.dtype_bytes
    }

    /// `gpu_memory * utilization - model_memory`, bytes of KV per GPU.
    pub fn kv_memory_bytes(&self) -> f64 {
        self.gpu_memory_bytes * self.utilization - self.model_memory_bytes
    }

    /// Concurrent sequences per GPU at a context window of `max_context` tokens.
    pub fn slots(&self, max_context: u64) -> Result<u64> {
        if max_context == 0 {
            return Err(invalid("max_context must be >= 1"));
        }
        let per_seq = self.kv_bytes_per_token_per_gpu() * max_context as f64;
        // A relative nudge so exact fits (the presets) survive rounding.
        Ok(((self.kv_memory_bytes() / per_seq) * (1.0 + 1e-12)).floor() as u64)
    }

    /// `W + H * n`, seconds (the per-slot cost at `h_ref_tokens` when set).
    pub fn t_iter(&self, n: f64) -> f64 {
        self.w_s + self.h_s * n
    }

    /// The coefficients `(a0, a1)` with `S = k (a0 + a1 L_total)` on a GPU
    /// running `n_slots` sequences.
    pub fn service_coefficients(&self, n_slots: u64) -> (f64, f64) {
        let n = n_slots as f64;
        match self.h_ref_tokens {
            None => (self.t_iter(n), 0.0),
            Some(r) => (self.w_s, self.h_s * n / r as f64),
        }
    }

    /// Service of the requests in `span` by GPUs whose context window is
    /// `max_context` (so `n_slots = slots(max_context)`); `prefill_quantile`
    /// is the quantile of prefill time reported (0.99 for the paper's P99).
    pub fn service(
        &self,
        workload: &Workload,
        span: Span,
        max_context: u64,
        prefill_quantile: f64,
    ) -> Result<Service> {
        let n_slots = self.slots(max_context)?;
        let table = workload.service_table(self.c_chunk)?;
        let (a0, a1) = self.service_coefficients(n_slots);
        let m = table.moments_all(workload, span, a0, a1);
        Ok(self.service_from(workload, span, n_slots, m, &table, prefill_quantile))
    }

    /// Assembles a `Service` from range moments already computed.
    pub fn service_from(
        &self,
        workload: &Workload,
        span: Span,
        n_slots: u64,
        m: RangeMoments,
        table: &crate::workload::ServiceTable,
        prefill_quantile: f64,
    ) -> Service {
        let (a0, a1) = self.service_coefficients(n_slots);
        let t_iter_s = a0 + a1 * workload.mean_tokens(span);
        let chunks = table.prefill_chunks_quantile(span, prefill_quantile);
        Service {
            n_slots,
            fraction: m.weight / workload.total_weight(),
            mean_s: m.mean,
            cs2: m.cs2(),
            mu_gpu: if m.mean > 0.0 {
                n_slots as f64 / m.mean
            } else {
                0.0
            },
            t_iter_s,
            prefill_p99_s: chunks as f64 * t_iter_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_the_papers() {
        let l = Profile::llama3_70b_a100();
        l.validate().expect("valid");
        assert_eq!(l.kv_bytes_per_token(), 320.0 * 1024.0);
        assert_eq!(l.slots(65536), Ok(16));
        assert_eq!(l.slots(8192), Ok(128));
        assert_eq!(l.slots(4096), Ok(256));
        assert_eq!(l.slots(1536), Ok(682));
        assert!((l.t_iter(16.0) - 0.0184).abs() < 1e-12);
        let q = Profile::qwen3_235b_mi300x();
        q.validate().expect("valid");
        assert_eq!(q.kv_bytes_per_token_per_gpu(), 23.5 * 1024.0);
        assert_eq!(q.slots(8192), Ok(676));
        assert_eq!(q.slots(32768), Ok(169));
    }

    #[test]
    fn service_time_by_hand() {
        // One request: L_in = 1000, L_out = 100, C = 512: k = 2 + 100 = 102.
        let w = Workload::new(&[1000], &[100], None, None).expect("ok");
        let p = Profile::llama3_70b_a100();
        let s = p.service(&w, w.span(0.0, 1e9), 65536, 0.99).expect("ok");
        let t = 0.008 + 0.00065 * 16.0;
        assert!((s.mean_s - 102.0 * t).abs() < 1e-12);
        assert!((s.mu_gpu - 16.0 / (102.0 * t)).abs() < 1e-9);
        assert_eq!(s.cs2, 0.0);
        assert!((s.prefill_p99_s - 2.0 * t).abs() < 1e-12);
        let scaled = Profile {
            h_ref_tokens: Some(8192),
            ..p
        };
        let s = scaled
            .service(&w, w.span(0.0, 1e9), 65536, 0.99)
            .expect("ok");
        let t = 0.008 + 0.00065 * 1100.0 / 8192.0 * 16.0;
        assert!((s.mean_s - 102.0 * t).abs() < 1e-12);
    }

    #[test]
    fn bad_profiles_are_refused() {
        let ok = Profile::llama3_70b_a100();
        for bad in [
            Profile {
                layers: 0,
                ..ok.clone()
            },
            Profile {
                utilization: 1.5,
                ..ok.clone()
            },
            Profile {
                utilization: f64::NAN,
                ..ok.clone()
            },
            Profile {
                model_memory_bytes: 1e12,
                ..ok.clone()
            },
            Profile {
                c_chunk: 0,
                ..ok.clone()
            },
            Profile {
                w_s: 0.0,
                h_s: 0.0,
                ..ok.clone()
            },
            Profile {
                price_per_gpu_hour: -1.0,
                ..ok.clone()
            },
            Profile {
                h_ref_tokens: Some(0),
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(ok.slots(0).is_err());
    }
}
