//! Prefill/decode disaggregation: a fleet whose prompts are prefilled on one
//! pool of endpoints (role `prefill`) and decoded on another (role `decode`),
//! the prompt's KV moved between them, against the aggregated fleet (every
//! endpoint `both`) on the same workload and SLO.
//!
//! The assumptions are those of vLLM's disaggregated prefill (a prefill
//! instance runs the request with `max_tokens = 1`, its KV cache is sent by a
//! connector to the decode instance, which loads it and generates the reply)
//! and of the semantic-router fleet simulator's disaggregated fleets (prefill
//! throughput-bound, decode memory-bound, the transfer a delay). Each pool is
//! the engine model of [`super::engine`], one model, with the requests it
//! sees:
//!
//! - **Prefill pool.** A request is a prompt of `L_in` tokens with one output
//!   token: `a = ceil(L_in / C)` iterations of chunked prefill, the last of
//!   which samples the first token; its KV (`L_in` tokens) is held for them.
//!   The pool is bound by its prefill budget (`C` tokens per iteration) and
//!   the prompts' queue for it, which is what its sizing reports.
//! - **KV transfer.** `delay = latency + b L_in / B` for `b` KV bytes per
//!   token (the profile's, per GPU: each GPU of a tensor-parallel endpoint
//!   sends its shard over its own link) and a link of `B` bytes per second.
//! - **Decode pool.** The prompt's KV arrives; the decode endpoint computes
//!   the prompt's last token (vLLM's connector loads every block but the
//!   last token's) and samples the first token in its first iteration, then
//!   one per iteration: `a = L_out` iterations with one prompt token each,
//!   holding `L_total` tokens of KV at most. No prompt shares its
//!   iterations, so its iteration time is `W + H n_active` over decoding
//!   sequences alone: slot-, KV- or compute-bound (TPOT).
//! - **TTFT** = prefill-side waits + own prefill `(k + 1/2) t_p` + transfer +
//!   decode-side slot wait + `3/2 t_d` (the iteration under way and the
//!   first decode step); **TPOT** from the decode pool's iteration time.
//!
//! The SLO's miss budget `1 - q` is split between the sides: the decode side
//! meets its first-token time `d` at the quantile `1 - s (1 - q)` (`s =`
//! [`DECODE_TAIL_SHARE`]) with `d` at most [`DECODE_TTFT_SHARE`] of the
//! target; the prefill pool then meets the whole target at `1 - (1 - s)(1 -
//! q)` with the transfer and `d` added to every request's TTFT (a
//! [`TtftShift`]: the transfer is `latency + k C b / B - ...` for a prompt of
//! `k` chunks, at most `k C` tokens). The union of the two misses is within
//! `1 - q`. The decode pool is sized first (TPOT, slots, KV, its side of
//! the TTFT), then the prefill pool for what is left; the aggregated fleet is
//! the engine model's homogeneous pool, and the plan says which is cheaper.

use super::{size_engine, size_engine_shifted, EngineLoad, EngineSlo, PoolPlan, TtftShift};
use crate::error::{invalid, non_negative, positive, Result};
use crate::profile::Profile;
use crate::workload::{RangeMoments, ServiceTable, Workload};

/// The default link: one 200 Gb/s NIC per GPU, 25 GB/s.
pub const DEFAULT_BANDWIDTH_BYTES_S: f64 = 25e9;
/// The default fixed cost of one transfer (connection, metadata, the first
/// byte), seconds.
pub const DEFAULT_LATENCY_S: f64 = 0.002;
/// The share of the TTFT miss budget `1 - q` the decode side may use.
pub const DECODE_TAIL_SHARE: f64 = 0.25;
/// The most of the TTFT target the decode side's first token may take.
pub const DECODE_TTFT_SHARE: f64 = 0.25;

/// The KV transfer from a prefill endpoint to a decode endpoint, as a delay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transfer {
    /// KV bytes sent per prompt token.
    pub bytes_per_token: f64,
    /// Bytes per second of the link.
    pub bandwidth_bytes_s: f64,
    /// Fixed seconds per transfer.
    pub latency_s: f64,
}

impl Transfer {
    /// Checks each figure: bytes per token and latency finite and >= 0, the
    /// bandwidth finite and > 0.
    pub fn new(bytes_per_token: f64, bandwidth_bytes_s: f64, latency_s: f64) -> Result<Self> {
        non_negative("bytes_per_token", bytes_per_token)?;
        positive("bandwidth_bytes_s", bandwidth_bytes_s)?;
        non_negative("latency_s", latency_s)?;
        Ok(Self {
            bytes_per_token,
            bandwidth_bytes_s,
            latency_s,
        })
    }

    /// The profile's KV bytes per token per GPU over the default link.
    pub fn for_profile(profile: &Profile) -> Self {
        Self {
            bytes_per_token: profile.kv_bytes_per_token_per_gpu(),
            bandwidth_bytes_s: DEFAULT_BANDWIDTH_BYTES_S,
            latency_s: DEFAULT_LATENCY_S,
        }
    }

    /// `latency + bytes_per_token * prompt_tokens / bandwidth`, seconds.
    pub fn delay_s(&self, prompt_tokens: u64) -> f64 {
        self.latency_s + self.bytes_per_token * prompt_tokens as f64 / self.bandwidth_bytes_s
    }

    /// The transfer time of one prefill chunk of `chunk` tokens, seconds.
    fn per_chunk_s(&self, chunk: u64) -> f64 {
        self.bytes_per_token * chunk as f64 / self.bandwidth_bytes_s
    }
}

/// What a disaggregated plan is asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DisaggConfig {
    pub arrival_rate: f64,
    /// P(TTFT <= ttft) >= quantile, TPOT at most `tpot` (None: no target).
    pub slo: EngineSlo,
    /// Every endpoint's context window, tokens.
    pub context: u64,
    pub transfer: Transfer,
}

impl DisaggConfig {
    fn validate(&self) -> Result<()> {
        positive("arrival_rate", self.arrival_rate)?;
        positive("slo_ttft_s", self.slo.ttft_s)?;
        if let Some(t) = self.slo.tpot_s {
            positive("slo_tpot_s", t)?;
        }
        if !(self.slo.quantile > 0.5 && self.slo.quantile < 1.0) {
            return Err(invalid(format!(
                "quantile must be in (0.5, 1), got {}",
                self.slo.quantile
            )));
        }
        if self.context == 0 {
            return Err(invalid("context must be >= 1"));
        }
        Transfer::new(
            self.transfer.bytes_per_token,
            self.transfer.bandwidth_bytes_s,
            self.transfer.latency_s,
        )
        .map(|_| ())
    }
}

/// A disaggregated fleet beside the aggregated one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DisaggPlan {
    /// The prefill pool; its `p99_ttft_s` is the whole request's TTFT bound
    /// (its waits and prefill, the transfer, the decode side).
    pub prefill: PoolPlan,
    /// The decode pool; its `p99_ttft_s` is the decode side's share (slot
    /// wait and first step), its `t_iter_s` the mean TPOT.
    pub decode: PoolPlan,
    /// Every request on one pool of `both` endpoints (the homogeneous fleet
    /// of the engine model).
    pub aggregated: PoolPlan,
    /// The transfer of the `(1 + q) / 2` quantile prompt (its chunks' tokens).
    pub transfer_q_s: f64,
    /// Both pools meet the SLO.
    pub feasible: bool,
    /// `prefill.gpus + decode.gpus`.
    pub gpus: u64,
    /// The aggregated fleet meets the SLO with no more GPUs (or the
    /// disaggregated one does not meet it).
    pub aggregated_cheaper: bool,
}

/// Weighted first and second moments.
#[derive(Default)]
struct Acc {
    w: f64,
    s1: f64,
    s2: f64,
}

impl Acc {
    fn add(&mut self, w: f64, x: f64) {
        self.w += w;
        self.s1 += w * x;
        self.s2 += w * x * x;
    }

    fn moments(&self) -> RangeMoments {
        if self.w <= 0.0 {
            return RangeMoments::EMPTY;
        }
        RangeMoments {
            weight: self.w,
            mean: self.s1 / self.w,
            second: self.s2 / self.w,
        }
    }
}

/// The engine-model loads of the three pools and the chunk histogram of the
/// prompts, from the workload's requests (outputs of 0 tokens count as 1);
/// the chunk counts' histogram, quantile and fewest from the workload's
/// cached [`ServiceTable`] (its wavelet matrix), the moments in one pass.
struct Loads {
    aggregated: EngineLoad,
    prefill: EngineLoad,
    decode: EngineLoad,
    /// `(ceil(L_in / C), weight)`, ascending.
    chunks: Vec<(u64, f64)>,
}

impl Loads {
    fn new(w: &Workload, table: &ServiceTable, quantile: f64) -> Self {
        let chunk = table.c_chunk;
        // [k, k L_total, L_in] of the aggregated, prefill and decode requests.
        let mut acc: [[Acc; 3]; 3] = Default::default();
        let weights = w.weights();
        for (i, (&p, &o)) in w.input_tokens().iter().zip(w.output_tokens()).enumerate() {
            let (wt, o) = (weights[i], o.max(1));
            let ch = p.div_ceil(chunk);
            let total = (p + o) as f64;
            let rows = [
                (ch + o, total, p),
                (ch + 1, (p + 1) as f64, p),
                (1 + o, total, 1),
            ];
            for (a, (k, kv_tokens, prompt)) in acc.iter_mut().zip(rows) {
                a[0].add(wt, k as f64);
                a[1].add(wt, k as f64 * kv_tokens);
                a[2].add(wt, prompt as f64);
            }
        }
        let all = w.span(0.0, f64::INFINITY);
        let mut chunks = Vec::new();
        table.prefill_chunks_histogram(all, 1.0, &mut chunks);
        let q = table.prefill_chunks_quantile(all, (1.0 + quantile) / 2.0) as f64;
        let fewest = table.prefill_chunks_min(all) as f64;
        let load = |a: &[Acc; 3], q: f64, fewest: f64| {
            EngineLoad::from_moments(a[0].moments(), a[1].moments(), a[2].moments(), q, fewest)
        };
        Loads {
            aggregated: load(&acc[0], q, fewest),
            prefill: load(&acc[1], q, fewest),
            decode: load(&acc[2], 1.0, 1.0),
            chunks,
        }
    }
}

/// Plans the disaggregated fleet of `cfg` for workload `w` on `profile`
/// (see the module docs) and the aggregated fleet beside it. Errors on bad
/// configuration and on requests longer than the context; a pool that no
/// GPU count serves is returned infeasible with its binding resource.
pub fn plan_disagg(w: &Workload, profile: &Profile, cfg: &DisaggConfig) -> Result<DisaggPlan> {
    cfg.validate()?;
    profile.validate()?;
    if w.is_empty() {
        return Err(invalid("the workload has no requests"));
    }
    let longest = w
        .input_tokens()
        .iter()
        .zip(w.output_tokens())
        .map(|(&p, &o)| p + o.max(1))
        .max()
        .unwrap_or(0);
    if longest > cfg.context {
        return Err(invalid(format!(
            "the workload's longest request ({longest} tokens) exceeds the context {}",
            cfg.context
        )));
    }
    let c = profile.c_chunk;
    let (slo, rate, context) = (cfg.slo, cfg.arrival_rate, cfg.context);
    let slots = profile.slots(context)?;
    let loads = Loads::new(w, w.service_table(c)?.as_ref(), slo.quantile);
    let hist = |out: &mut Vec<(u64, f64)>| out.extend_from_slice(&loads.chunks);
    let aggregated = size_engine(
        profile,
        context,
        slots,
        rate,
        &loads.aggregated,
        slo,
        &hist,
        None,
    )?;
    // The decode side: the prompt's last token is its one "chunk".
    let miss = 1.0 - slo.quantile;
    let decode_slo = EngineSlo {
        ttft_s: slo.ttft_s * DECODE_TTFT_SHARE,
        ..slo
    };
    let decode_ttft = (1.0 - DECODE_TAIL_SHARE * miss, TtftShift::NONE);
    let one = |out: &mut Vec<(u64, f64)>| out.push((1, 1.0));
    let pool = (context, slots, rate);
    let decode = size_engine_shifted(
        profile,
        pool,
        &loads.decode,
        decode_slo,
        decode_ttft,
        &one,
        None,
    )?;
    let per_chunk = cfg.transfer.per_chunk_s(c);
    let shift = TtftShift {
        offset_s: cfg.transfer.latency_s - 0.5 * per_chunk + decode.p99_ttft_s,
        per_chunk_s: per_chunk,
    };
    let prefill_slo = EngineSlo {
        tpot_s: None,
        ..slo
    };
    let prefill_ttft = (1.0 - (1.0 - DECODE_TAIL_SHARE) * miss, shift);
    let prefill = size_engine_shifted(
        profile,
        pool,
        &loads.prefill,
        prefill_slo,
        prefill_ttft,
        &hist,
        None,
    )?;
    let feasible = prefill.feasible && decode.feasible;
    let gpus = prefill.gpus + decode.gpus;
    Ok(DisaggPlan {
        prefill,
        decode,
        aggregated,
        transfer_q_s: cfg
            .transfer
            .delay_s(loads.prefill.prefill_chunks_q as u64 * c),
        feasible,
        gpus,
        aggregated_cheaper: aggregated.feasible && (!feasible || aggregated.gpus <= gpus),
    })
}

#[cfg(test)]
mod tests;
