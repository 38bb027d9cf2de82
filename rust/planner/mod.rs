//! The FleetOpt offline planner (Chen et al. 2026, Algorithm 1) and the
//! pool-routing cost model of the token-budget paper (Eq. 6-8).
//!
//! For every candidate short-pool boundary `B` and compression bandwidth
//! `gamma`:
//!
//! - `alpha = F(B)`, per category `beta_k = F_k(gamma B) - F_k(B)` (the
//!   borderline band), `alpha' = alpha + sum_k beta_k p_c,k` (Eq. 1, 14);
//!   `lambda_s = alpha' lambda`, `lambda_l = (1 - alpha') lambda`.
//! - The short pool runs at context `B` (`n_max = slots(B)`) and is
//!   calibrated on the requests with `L_total <= B` (Algorithm 1, line 5);
//!   compressed borderline requests are assumed to cost like them.
//! - The long pool runs at `long_context` and is recalibrated on the
//!   post-compression mix: every request with `L_total > gamma B` plus the
//!   uncompressed share `1 - p_c,k` of each category's band (line 6; with
//!   `p_c = 1` exactly the paper's `(gamma B, inf)`). Its prefill P99 is taken
//!   over `(gamma B, inf)` (over `(B, inf)` when that is empty).
//! - Each pool gets the smallest GPU count n with
//!   `n >= lambda_p / (rho_max mu_gpu)` (the utilization cap) and
//!   `W99(n n_max, 1 / E[S], Cs^2, lambda_p) <= T_slo - T_prefill,99 - t_iter`
//!   (Eq. 8, 11). W99 falls with n, so the search starts at the cap and
//!   doubles, then bisects: a few Erlang-C evaluations even for millions of
//!   slots, and the cap holds exactly for every pool of every candidate.
//! - That is the paper model ([`ServiceModel::Paper`]); the default engine
//!   model ([`engine`]) sizes each pool of the same sweep as the simulator's
//!   engines behind least-request dispatch, with no utilization cap.
//! - Cost `n_s + phi n_l` GPUs at the profile's $/GPU-hour (Eq. 9); the
//!   homogeneous fleet is one pool at `long_context` holding every request,
//!   priced as long-pool GPUs. Requests longer than `long_context` fit no
//!   pool; they are counted in the long pool's traffic as if they did.

pub mod disagg;
mod engine;
#[cfg(test)]
mod fleets_check;
mod isa;

use std::sync::Arc;

pub use engine::{
    engine_state, BuildChunks, EngineLoad, EngineShape, EngineState, TtftShift, MAX_LOOP,
};
use engine::{size_engine_pool, start_ratio, Chunks, Start, Targets};
pub(crate) use isa::Isa;

use crate::budget::compressible_category;
use crate::error::{invalid, non_negative, positive, Result};
use crate::profile::{Profile, Service};
use crate::queueing::p99_wait;
use crate::workload::{RangeMoments, ServiceTable, Span, Workload};

/// Hours in a year, for annual cost.
pub const HOURS_PER_YEAR: f64 = 8760.0;

/// FleetOpt's utilization cap (section 4.1), the paper model's default.
pub const DEFAULT_RHO_MAX: f64 = 0.85;

/// The default candidate boundaries: powers of two and their 1.5x between 256
/// and 49,152 tokens, kept when below the long context and when they give
/// more slots per GPU than the long pool.
pub const DEFAULT_B_SHORT: [u64; 15] = [
    256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
];

#[derive(Debug, Clone, PartialEq)]
pub struct PlanConfig {
    /// Fleet arrival rate lambda, requests per second.
    pub arrival_rate: f64,
    /// P99 TTFT target, seconds.
    pub slo_ttft_s: f64,
    /// The paper model's utilization cap per pool (None: FleetOpt's 0.85,
    /// [`DEFAULT_RHO_MAX`]). The engine model takes none: it is an error there
    /// (see [`ServiceModel::Engine`]).
    pub rho_max: Option<f64>,
    /// Candidate short-pool boundaries (empty: `DEFAULT_B_SHORT`).
    pub b_short: Vec<u64>,
    /// Compression bandwidths (empty: 1.0, 1.1, ..., 2.0).
    pub gammas: Vec<f64>,
    /// Context window of the long pool (and the homogeneous fleet), tokens.
    pub long_context: u64,
    /// Compressibility of borderline requests whose category is not listed
    /// and compressible ([`crate::budget::compressible_category`]: code is
    /// not, FleetOpt section 5.2, as the router decides).
    pub p_c: f64,
    /// Per-category compressibility, e.g. `("code", 1.0)`; it overrides `p_c`
    /// and the code default.
    pub p_c_by_category: Vec<(String, f64)>,
    /// Cost of a long-pool GPU relative to a short-pool GPU.
    pub phi: f64,
    /// Quantile of prefill time subtracted from the SLO (0.99); in the engine
    /// model, the share of requests whose TTFT must meet the target.
    pub prefill_quantile: f64,
    /// The service model (default [`ServiceModel::Engine`]).
    pub model: ServiceModel,
    /// TPOT target, seconds (engine model; None: no TPOT constraint).
    pub slo_tpot_s: Option<f64>,
}

impl PlanConfig {
    pub fn new(arrival_rate: f64, slo_ttft_s: f64) -> Self {
        Self {
            arrival_rate,
            slo_ttft_s,
            rho_max: None,
            b_short: Vec::new(),
            gammas: Vec::new(),
            long_context: 65_536,
            p_c: 1.0,
            p_c_by_category: Vec::new(),
            phi: 1.0,
            prefill_quantile: 0.99,
            model: ServiceModel::Engine,
            slo_tpot_s: None,
        }
    }

    /// The paper model's utilization cap: `rho_max`, or FleetOpt's 0.85.
    pub fn utilization_cap(&self) -> f64 {
        self.rho_max.unwrap_or(DEFAULT_RHO_MAX)
    }

    fn validate(&self) -> Result<()> {
        positive("arrival_rate", self.arrival_rate)?;
        positive("slo_ttft_s", self.slo_ttft_s)?;
        positive("phi", self.phi)?;
        if let Some(t) = self.slo_tpot_s {
            positive("slo_tpot_s", t)?;
        }
        if let Some(rho_max) = self.rho_max {
            if self.model == ServiceModel::Engine {
                return Err(invalid(
                    "rho_max is the paper model's utilization cap (FleetOpt section 4.1: it keeps \
                     Erlang-C and Kimura's bound in their range); the engine model sizes each pool \
                     by its SLO and stability and takes no cap: use model=\"paper\" or drop rho_max",
                ));
            }
            if !(rho_max > 0.0 && rho_max < 1.0) {
                return Err(invalid(format!("rho_max must be in (0, 1), got {rho_max}")));
            }
        }
        if !(0.0..=1.0).contains(&self.prefill_quantile) {
            return Err(invalid(format!(
                "prefill_quantile must be in [0, 1], got {}",
                self.prefill_quantile
            )));
        }
        if self.long_context == 0 {
            return Err(invalid("long_context must be >= 1"));
        }
        let unit = |what: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(invalid(format!("{what} must be in [0, 1], got {v}")))
            }
        };
        unit("p_c", self.p_c)?;
        for (name, v) in &self.p_c_by_category {
            unit(&format!("p_c for category {name:?}"), *v)?;
        }
        for &g in &self.gammas {
            if !(g.is_finite() && (1.0..=1e3).contains(&g)) {
                return Err(invalid(format!("gamma must be in [1, 1000], got {g}")));
            }
        }
        if self.b_short.len() > 10_000 || self.gammas.len() > 10_000 {
            return Err(invalid(
                "at most 10,000 b_short and 10,000 gamma candidates",
            ));
        }
        Ok(())
    }
}

/// One pool of a candidate fleet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolPlan {
    /// GPUs: 0 with no traffic (or no slot fits a request at this context);
    /// when prefill alone breaks the SLO, the cap-sized count.
    pub gpus: u64,
    /// Whether the pool meets the SLO (a pool with no traffic does).
    pub feasible: bool,
    pub context: u64,
    pub n_slots: u64,
    pub arrival_rate: f64,
    pub mu_gpu: f64,
    pub cs2: f64,
    /// The share of slot-time held, `occupancy / n_slots` (the paper model's
    /// `arrival_rate / (gpus * mu_gpu)` is the same quantity under its own
    /// service time, by Little's law); the simulator reports the same.
    pub utilization: f64,
    /// Sequences holding a slot per GPU, on average.
    pub occupancy: f64,
    /// Prefill budget utilization (engine model; 0 in the paper model).
    pub prefill_utilization: f64,
    /// KV utilization, an upper bound (engine model; 0 in the paper model).
    pub kv_utilization: f64,
    /// What sets the GPU count (or, infeasible, what no count satisfies).
    pub binding: Binding,
    pub t_iter_s: f64,
    pub prefill_p99_s: f64,
    /// P99 queue wait. Engine model: the slot wait (Kimura's bound at C = 1
    /// when that already meets the SLO, see `engine_eval`) plus the wait for
    /// the prefill budget at its share of the tail.
    pub p99_wait_s: f64,
    /// `p99_wait_s + prefill_p99_s + t_iter_s` (0 with no traffic).
    pub p99_ttft_s: f64,
}

impl PoolPlan {
    /// A pool with no traffic and no GPUs.
    pub const EMPTY: PoolPlan = PoolPlan {
        gpus: 0,
        feasible: true,
        context: 0,
        n_slots: 0,
        arrival_rate: 0.0,
        mu_gpu: 0.0,
        cs2: 0.0,
        utilization: 0.0,
        occupancy: 0.0,
        prefill_utilization: 0.0,
        kv_utilization: 0.0,
        binding: Binding::None,
        t_iter_s: 0.0,
        prefill_p99_s: 0.0,
        p99_wait_s: 0.0,
        p99_ttft_s: 0.0,
    };
}

/// One (B_short, gamma) fleet. The homogeneous fleet has `b_short = 0`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub b_short: u64,
    pub gamma: f64,
    pub alpha: f64,
    pub beta: f64,
    pub alpha_prime: f64,
    pub short: PoolPlan,
    pub long: PoolPlan,
    pub feasible: bool,
    pub gpus: u64,
    pub annual_cost_usd: f64,
    /// `1 - cost / homogeneous cost`; None when the homogeneous fleet misses
    /// the SLO (no baseline to save against).
    pub savings_vs_homogeneous: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct Plan {
    pub homogeneous: Candidate,
    pub sweep: Vec<Candidate>,
    /// Index into `sweep` of the cheapest feasible candidate.
    pub best: Option<usize>,
    /// Index into `sweep` of the cheapest feasible candidate at gamma = 1.
    pub pool_routing: Option<usize>,
}

impl Plan {
    /// The sweep entry at (`b_short`, `gamma`), gamma matched to 1e-9.
    pub fn candidate(&self, b_short: u64, gamma: f64) -> Option<&Candidate> {
        self.sweep
            .iter()
            .find(|c| c.b_short == b_short && (c.gamma - gamma).abs() < 1e-9)
    }
}

/// `alpha (1 - 1/rho)`: the fraction of GPUs pool routing saves (token-budget
/// paper Eq. 7), rho = short-pool over long-pool throughput per GPU.
pub fn pool_routing_savings(alpha: f64, rho: f64) -> Result<f64> {
    if !(0.0..=1.0).contains(&alpha) {
        return Err(invalid(format!("alpha must be in [0, 1], got {alpha}")));
    }
    positive("rho", rho)?;
    Ok(alpha * (1.0 - 1.0 / rho))
}

/// `alpha lambda / mu_s + (1 - alpha) lambda / mu_l`: the corrected dual-pool
/// fleet size (token-budget paper Eq. 8), mu_l measured on the long pool's own
/// traffic.
pub fn g_dual(alpha: f64, arrival_rate: f64, mu_short: f64, mu_long: f64) -> Result<f64> {
    if !(0.0..=1.0).contains(&alpha) {
        return Err(invalid(format!("alpha must be in [0, 1], got {alpha}")));
    }
    positive("mu_short", mu_short)?;
    positive("mu_long", mu_long)?;
    non_negative("arrival_rate", arrival_rate)?;
    Ok(alpha * arrival_rate / mu_short + (1.0 - alpha) * arrival_rate / mu_long)
}

/// `gpus * price_per_gpu_hour * hours_per_year`, USD.
pub fn annual_cost_usd(gpus: f64, price_per_gpu_hour: f64, hours_per_year: f64) -> Result<f64> {
    non_negative("gpus", gpus)?;
    non_negative("price_per_gpu_hour", price_per_gpu_hour)?;
    non_negative("hours_per_year", hours_per_year)?;
    Ok(gpus * price_per_gpu_hour * hours_per_year)
}

/// Which service model sizes the pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceModel {
    /// FleetOpt's Eq. 3-4: every iteration charged `W + H n_max` (a full
    /// batch), every slot busy for `S = (ceil(L_in / C) + L_out) t_iter`, all
    /// prompts prefilled in parallel; Erlang-C / Kimura wait plus the P99
    /// prefill; the utilization cap `rho_max`. Reproduces the paper's numbers.
    Paper,
    /// The model of the engine the simulator runs ([`engine_state`]): the
    /// iteration time at the occupancy it predicts, one shared prefill chunk
    /// per iteration, the TPOT target as a constraint. The default.
    Engine,
}

impl ServiceModel {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "paper" => Ok(Self::Paper),
            "engine" => Ok(Self::Engine),
            _ => Err(invalid(format!(
                "model must be \"engine\" or \"paper\", got {name:?}"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Paper => "paper",
            Self::Engine => "engine",
        }
    }
}

/// The resource that sets a pool's GPU count: with one GPU fewer, this is
/// the constraint that fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// No traffic, or one GPU already meets every constraint.
    None,
    /// Per-sequence iteration work: the iteration time (TPOT) or, in the
    /// paper model, the utilization cap.
    Compute,
    /// Sequence slots (`max_num_seqs`): occupancy or the wait for a slot.
    Slot,
    /// KV-cache blocks.
    Kv,
    /// The per-iteration prefill budget `C_chunk`: its utilization or the
    /// wait of prompts for it.
    Prefill,
}

impl Binding {
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Compute => "compute",
            Self::Slot => "slot",
            Self::Kv => "kv",
            Self::Prefill => "prefill",
        }
    }
}

/// The smallest n >= 1 with `arrival_rate / (n mu_gpu) <= rho_max`.
fn utilization_floor(arrival_rate: f64, mu_gpu: f64, rho_max: f64) -> u64 {
    let mut n = (arrival_rate / (rho_max * mu_gpu)).ceil().max(1.0) as u64;
    // Guard the float division: step until the cap holds as computed.
    while arrival_rate / (n as f64 * mu_gpu) > rho_max {
        n += 1;
    }
    while n > 1 && arrival_rate / ((n - 1) as f64 * mu_gpu) <= rho_max {
        n -= 1;
    }
    n
}

/// Sizes one pool for `arrival_rate` given its service.
fn size_pool(
    arrival_rate: f64,
    svc: &Service,
    context: u64,
    rho_max: f64,
    slo: f64,
) -> Result<PoolPlan> {
    let mut pool = PoolPlan {
        gpus: 0,
        feasible: true,
        context,
        n_slots: svc.n_slots,
        arrival_rate,
        mu_gpu: svc.mu_gpu,
        cs2: svc.cs2,
        utilization: 0.0,
        occupancy: 0.0,
        prefill_utilization: 0.0,
        kv_utilization: 0.0,
        binding: Binding::None,
        t_iter_s: svc.t_iter_s,
        prefill_p99_s: svc.prefill_p99_s,
        p99_wait_s: 0.0,
        p99_ttft_s: 0.0,
    };
    if arrival_rate <= 0.0 || svc.mean_s <= 0.0 {
        return Ok(pool);
    }
    if svc.n_slots == 0 {
        pool.feasible = false;
        pool.binding = Binding::Kv;
        return Ok(pool);
    }
    let budget = slo - svc.prefill_p99_s - svc.t_iter_s;
    let mu_slot = 1.0 / svc.mean_s;
    let wait = |n: u64| -> Result<f64> {
        let servers = n
            .checked_mul(svc.n_slots)
            .ok_or_else(|| invalid("fleet size overflows"))?;
        p99_wait(servers, mu_slot, svc.cs2, arrival_rate)
    };
    let lo = utilization_floor(arrival_rate, svc.mu_gpu, rho_max);
    let mut n = lo;
    let mut w = wait(lo)?;
    if budget < 0.0 {
        // Prefill alone breaks the SLO: no GPU count helps. Report the
        // cap-sized pool and its TTFT, marked infeasible.
        pool.feasible = false;
        pool.binding = Binding::Prefill;
    } else if w > budget {
        pool.binding = Binding::Slot;
        // W99 falls with n: double until it fits, then bisect (lo fails, hi fits).
        let (mut bad, mut hi) = (lo, lo.saturating_mul(2));
        let mut w_hi = wait(hi)?;
        while w_hi > budget {
            bad = hi;
            hi = hi
                .checked_mul(2)
                .ok_or_else(|| invalid("fleet size overflows"))?;
            w_hi = wait(hi)?;
        }
        while hi - bad > 1 {
            let mid = bad + (hi - bad) / 2;
            let w_mid = wait(mid)?;
            if w_mid <= budget {
                hi = mid;
                w_hi = w_mid;
            } else {
                bad = mid;
            }
        }
        n = hi;
        w = w_hi;
    }
    pool.gpus = n;
    if pool.binding == Binding::None && n > 1 {
        pool.binding = Binding::Compute;
    }
    pool.utilization = arrival_rate / (n as f64 * svc.mu_gpu);
    pool.occupancy = pool.utilization * svc.n_slots as f64;
    pool.p99_wait_s = w;
    pool.p99_ttft_s = w + svc.prefill_p99_s + svc.t_iter_s;
    Ok(pool)
}

struct Ctx<'a> {
    w: &'a Workload,
    profile: &'a Profile,
    cfg: &'a PlanConfig,
    table: Arc<ServiceTable>,
    p_c: Vec<f64>,
    long_slots: u64,
    /// The engine model's targets, the same for every pool of the sweep.
    targets: Targets,
}

impl Ctx<'_> {
    /// Service of moments `m`; prefill P99 and mean length from `prefill_span`.
    fn service(&self, prefill_span: Span, n_slots: u64, m: RangeMoments) -> Service {
        let q = self.cfg.prefill_quantile;
        self.profile
            .service_from(self.w, prefill_span, n_slots, m, &self.table, q)
    }

    /// The engine-model moments of the requests of `span` (of one category
    /// channel, or all), each request weighted by `scale`.
    #[inline(always)]
    fn mix(&self, span: Span, category: Option<usize>, scale: f64) -> Mix {
        let t = &self.table;
        let (k, kl, prompt) = match category {
            None => {
                // Loops, not `fold`s: `Iterator::fold` was compiled apart from
                // the x86-64-v3 clone.
                let mut prompt = RangeMoments::EMPTY;
                for c in 0..self.w.category_channels() {
                    prompt = prompt.merge(t.prompt_moments(self.w, span, c));
                }
                (
                    t.moments_all(self.w, span, 1.0, 0.0),
                    t.moments_all(self.w, span, 0.0, 1.0),
                    prompt,
                )
            }
            Some(c) => (
                t.moments(self.w, span, c, 1.0, 0.0),
                t.moments(self.w, span, c, 0.0, 1.0),
                t.prompt_moments(self.w, span, c),
            ),
        };
        let scaled = |mut m: RangeMoments| {
            m.weight *= scale;
            m
        };
        Mix {
            k: scaled(k),
            kl: scaled(kl),
            prompt: scaled(prompt),
        }
    }

    /// The band's requests after compress-and-route, `weight` of them: each
    /// is cut to `L_total = b` (the compressor's target `T_c = b - L_out`), so
    /// `L_in' = b - L_out`. From the mean output of the requests compressed
    /// (each category's band weighted by its `p_c`: code, never compressed by
    /// default, has outputs a tenth of conversation's), taking `L_out` at its
    /// mean: `L_in' = b - E[L_out]`, `k' = ceil(L_in' / C) + E[L_out]`, `k' L
    /// = k' b` (second moments of a point mass). Without this the short pool
    /// would be sized as if compressed prompts were as short as its own.
    /// Returns the moments and the compressed prompts' chunk count.
    #[inline(always)]
    fn compressed_mix(&self, band: Span, b: u64, weight: f64) -> (Mix, u64) {
        let mut outputs = RangeMoments::EMPTY;
        for c in 0..self.w.category_channels() {
            let mut o = self.table.output_moments(self.w, band, c);
            o.weight *= self.p_c[c];
            outputs = outputs.merge(o);
        }
        let out = outputs.mean.max(0.0);
        let p = (b as f64 - out).max(1.0);
        let chunks = (p / self.profile.c_chunk as f64).ceil();
        let k = chunks + out;
        let point = |x: f64| RangeMoments {
            weight,
            mean: x,
            second: x * x,
        };
        let mix = Mix {
            k: point(k),
            kl: point(k * b as f64),
            prompt: point(p),
        };
        (mix, chunks as u64)
    }

    /// The `(1 + q) / 2` quantile of `ceil(L_in / C)` over `span` (see
    /// [`engine_eval`]).
    #[inline(always)]
    fn chunks_quantile(&self, span: Span) -> f64 {
        let q = self.cfg.prefill_quantile;
        self.table.prefill_chunks_quantile(span, (1.0 + q) / 2.0) as f64
    }

    /// What the engine model needs of the mixture `mix`, with the prefill
    /// quantile `chunks_q` (from [`Self::chunks_quantile`]).
    #[inline(always)]
    fn engine_load(&self, mix: Mix, chunks_q: f64) -> EngineLoad {
        EngineLoad::from_moments(mix.k, mix.kl, mix.prompt, chunks_q, 0.0)
    }

    /// Sizes a pool at `context` for `arrival_rate` requests of `load` under
    /// the engine model, the search starting at `start`; `sources` give its
    /// chunk histogram when the search needs it.
    #[inline(always)]
    fn size_engine(
        &self,
        arrival_rate: f64,
        load: &EngineLoad,
        sources: Sources,
        context: u64,
        n_slots: u64,
        start: Start<'_>,
    ) -> Result<PoolPlan> {
        // The fewest chunks of any of the pool's requests (a loop: the
        // iterator's `min` was compiled apart from the x86-64-v3 clone).
        let mut fewest = None;
        for (span, scale) in sources.spans {
            if scale > 0.0 && span.end > span.start {
                let k = self.table.prefill_chunks_min(span);
                fewest = Some(fewest.map_or(k, |f: u64| f.min(k)));
            }
        }
        if sources.point.1 > 0.0 {
            fewest = Some(fewest.map_or(sources.point.0, |f| f.min(sources.point.0)));
        }
        let fewest = fewest.unwrap_or(0);
        let load = &EngineLoad {
            prefill_chunks_min: fewest as f64,
            ..*load
        };
        let pool = (context, n_slots, arrival_rate);
        size_engine_from(
            self.profile,
            pool,
            load,
            self.targets,
            // Called through `Chunks`' `&dyn Fn`: forced inline where that
            // call is made direct (in the x86-64-v3 clone, once inlined).
            #[inline(always)]
            |out: &mut Vec<(u64, f64)>| {
                for (span, scale) in sources.spans {
                    if scale > 0.0 {
                        self.table.prefill_chunks_histogram(span, scale, out);
                    }
                }
                if sources.point.1 > 0.0 {
                    out.push(sources.point);
                }
            },
            start,
        )
    }

    /// The long pool's share of each category's band, `1 - p_c`, for the
    /// categories present in `band` and not all compressed (the long pool's
    /// tail moments are merged with these, in this order). A method forced
    /// inline, not a closure called twice (see [`cheapest`]).
    #[inline(always)]
    fn kept_bands(&self, band: Span) -> impl Iterator<Item = (usize, f64)> + '_ {
        (self.p_c.iter().enumerate())
            .filter(move |&(k, &pc)| pc < 1.0 && self.w.category_fraction(band, k) > 0.0)
            .map(|(k, &pc)| (k, 1.0 - pc))
    }

    #[inline(always)]
    fn cost(&self, short_gpus: u64, long_gpus: u64) -> f64 {
        (short_gpus as f64 + self.cfg.phi * long_gpus as f64)
            * self.profile.price_per_gpu_hour
            * HOURS_PER_YEAR
    }
}

/// The engine model's targets for one pool: P(TTFT <= `ttft_s`) >=
/// `quantile`, and the TPOT at most `tpot_s` (None: no TPOT target).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineSlo {
    pub ttft_s: f64,
    pub tpot_s: Option<f64>,
    pub quantile: f64,
}

/// Sizes one pool of `n_slots`-slot engines of `profile` with a context
/// window of `context` tokens for `arrival_rate` requests per second of
/// `load` under the engine model, the search starting at `hint`; `chunks`
/// appends the pool's `(prefill chunks, weight)` pairs when the search needs
/// them. The planner's sweep sizes each of its pools here and the autoscaler
/// (rust/autoscale/) its live pools: one model.
#[allow(clippy::too_many_arguments)]
pub fn size_engine(
    profile: &Profile,
    context: u64,
    n_slots: u64,
    arrival_rate: f64,
    load: &EngineLoad,
    slo: EngineSlo,
    chunks: BuildChunks<'_>,
    hint: Option<u64>,
) -> Result<PoolPlan> {
    let pool = (context, n_slots, arrival_rate);
    let ttft = (slo.quantile, TtftShift::NONE);
    size_engine_shifted(profile, pool, load, slo, ttft, chunks, hint)
}

/// [`size_engine`] for a pool `(context, n_slots, arrival_rate)` whose
/// requests' TTFT is met at its own quantile and holds `shift` beyond the
/// pool's own waits and prefill, `ttft = (quantile, shift)` (a side of a
/// disaggregated fleet: the TTFT's miss budget split between the sides, the
/// KV transfer and the other side added); `slo.quantile` is the TPOT's.
pub fn size_engine_shifted(
    profile: &Profile,
    pool: (u64, u64, f64),
    load: &EngineLoad,
    slo: EngineSlo,
    ttft: (f64, TtftShift),
    chunks: BuildChunks<'_>,
    hint: Option<u64>,
) -> Result<PoolPlan> {
    let start = Start::At(hint);
    let targets = engine_targets(slo, ttft);
    size_engine_from(profile, pool, load, targets, chunks, start)
}

/// The engine model's targets for `slo`, the TTFT met at its own quantile
/// and holding `shift` beyond the pool's waits and prefill, `ttft =
/// (quantile, shift)`.
fn engine_targets(slo: EngineSlo, (quantile, shift): (f64, TtftShift)) -> Targets {
    Targets {
        shift,
        quantile,
        ..Targets::new(
            slo.ttft_s,
            slo.tpot_s.unwrap_or(f64::INFINITY),
            slo.quantile,
        )
    }
}

/// [`size_engine_shifted`] with the search starting at `start`, its
/// `targets` from [`engine_targets`].
#[inline(always)]
fn size_engine_from(
    profile: &Profile,
    (context, n_slots, arrival_rate): (u64, u64, f64),
    load: &EngineLoad,
    targets: Targets,
    chunks: impl Fn(&mut Vec<(u64, f64)>),
    start: Start<'_>,
) -> Result<PoolPlan> {
    let shape = EngineShape {
        w_s: profile.w_s,
        h_s: profile.h_s,
        chunk: profile.c_chunk,
        n_slots,
        kv_tokens: n_slots as f64 * context as f64,
    };
    let pool = PoolPlan {
        context,
        n_slots,
        arrival_rate,
        cs2: load.iterations_cs2,
        ..PoolPlan::EMPTY
    };
    let mut chunks = Chunks::new(chunks);
    size_engine_pool(
        arrival_rate,
        load,
        &shape,
        targets,
        start,
        &mut chunks,
        pool,
    )
}

/// The moments the engine model needs of a mixture of requests: of
/// `k = ceil(L_in / C) + L_out`, of `k L_total` and of `L_in`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Mix {
    k: RangeMoments,
    kl: RangeMoments,
    prompt: RangeMoments,
}

impl Mix {
    const EMPTY: Mix = Mix {
        k: RangeMoments::EMPTY,
        kl: RangeMoments::EMPTY,
        prompt: RangeMoments::EMPTY,
    };

    #[inline(always)]
    fn merge(self, o: Mix) -> Mix {
        Mix {
            k: self.k.merge(o.k),
            kl: self.kl.merge(o.kl),
            prompt: self.prompt.merge(o.prompt),
        }
    }
}

/// Where a pool's requests come from, for its chunk histogram: up to two
/// spans, each with its weight scale (the uncompressed share of a band), and
/// the compressed requests as one point `(chunks, weight)`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sources {
    spans: [(Span, f64); 2],
    point: (u64, f64),
}

impl Sources {
    fn span(span: Span) -> Self {
        Self {
            spans: [(span, 1.0), (span, 0.0)],
            point: (0, 0.0),
        }
    }
}

/// A long pool of the engine model's sweep, sized for the candidates whose
/// band ends at `floor(gamma B)` (the homogeneous pool at 0).
#[derive(Debug, Clone, Copy)]
struct LongPool {
    /// Where its tail starts in the sorted order (the tail runs to the end).
    tail: usize,
    arrival_rate: f64,
    /// Its count over its stability bound plus one ([`start_ratio`]).
    ratio: f64,
    /// The pool (an index into [`LongPools::alone`]), when it holds its
    /// tail alone (no share of a band).
    pool: Option<usize>,
}

/// The long pools of a sweep sized so far, ascending by their boundary
/// `floor(gamma B)` (`at`, a vector of its own for the searches): where the
/// next one's search starts, and the pools that a candidate with the same
/// tail reuses (candidates of different `B` and `gamma` often cut at the
/// same point: 768 is 512 x 1.5 and 768 x 1.0).
struct LongPools {
    at: Vec<f64>,
    pools: Vec<LongPool>,
    alone: Vec<PoolPlan>,
    /// Where the last search ended: the sweep's boundaries rise with gamma,
    /// so the next is a step or two away (a binary search's mispredicted
    /// branches cost more).
    cursor: std::cell::Cell<usize>,
}

impl LongPools {
    /// The first index whose boundary is not below `at` (`or_equal`: above
    /// it), walked from the last search's.
    #[inline(always)]
    fn position(&self, at: f64, or_equal: bool) -> usize {
        let below = |a: f64| a < at || (or_equal && a == at);
        let mut i = self.cursor.get().min(self.at.len());
        while i > 0 && !below(self.at[i - 1]) {
            i -= 1;
        }
        while i < self.at.len() && below(self.at[i]) {
            i += 1;
        }
        self.cursor.set(i);
        i
    }

    /// The nearest pools at or below `at` and at or above it.
    #[inline(always)]
    fn around(&self, at: f64) -> (Option<&LongPool>, Option<&LongPool>) {
        let i = self.position(at, false);
        let above = self.pools.get(i);
        let below = if self.at.get(i) == Some(&at) {
            above
        } else {
            i.checked_sub(1).and_then(|j| self.pools.get(j))
        };
        (below, above)
    }

    /// A pool sized alone for the same tail at an arrival rate equal to
    /// `arrival_rate` but for rounding (the candidates' shares of the
    /// traffic are sums in different orders): the same requests, the same
    /// pool. Equal tails are neighbours in the order.
    #[inline(always)]
    fn same(&self, at: f64, tail: usize, arrival_rate: f64) -> Option<PoolPlan> {
        let (below, above) = self.around(at);
        // A loop: `find_map`'s closure was compiled apart from the clone.
        for p in [below, above].into_iter().flatten() {
            let close = (p.arrival_rate - arrival_rate).abs() <= 1e-12 * arrival_rate;
            match p.pool {
                Some(i) if p.tail == tail && close => return Some(self.alone[i]),
                _ => {}
            }
        }
        None
    }

    /// The start ratio at `at`: interpolated between the nearest pools
    /// below and above (bracketed from both sides), or the one there is.
    #[inline(always)]
    fn ratio(&self, at: f64) -> Option<f64> {
        let i = self.position(at, false);
        match (i.checked_sub(1), self.at.get(i)) {
            (Some(j), Some(&hi)) if hi > at => {
                let (lo, f) = (self.at[j], &self.pools);
                let t = (at - lo) / (hi - lo);
                Some(f[j].ratio + t * (f[i].ratio - f[j].ratio))
            }
            (_, Some(_)) => Some(self.pools[i].ratio),
            (Some(j), None) => Some(self.pools[j].ratio),
            (None, None) => None,
        }
    }

    /// Adds a pool at `at`, to be reused if `alone` (see [`Self::same`]).
    #[inline(always)]
    fn insert(&mut self, at: f64, mut pool: LongPool, alone: Option<PoolPlan>) {
        if let Some(p) = alone {
            pool.pool = Some(self.alone.len());
            self.alone.push(p);
        }
        let i = self.position(at, true);
        self.at.insert(i, at);
        self.pools.insert(i, pool);
    }
}

/// The error for an SLO that no fleet meets, naming the binding constraint
/// of the homogeneous pool (every request, the long context).
fn no_fleet(pool: &PoolPlan, cfg: &PlanConfig, profile: &Profile) -> crate::error::Error {
    let why = match pool.binding {
        Binding::Compute => format!(
            "the TPOT target {} s is at or below the iteration's base time W = {} s",
            cfg.slo_tpot_s.unwrap_or(f64::INFINITY),
            profile.w_s
        ),
        Binding::Prefill => format!(
            "the TTFT target {} s is below the prefill of the P{} prompt alone, {:.3} s \
             at t_iter = {:.4} s",
            cfg.slo_ttft_s,
            100.0 * cfg.prefill_quantile,
            pool.prefill_p99_s,
            pool.t_iter_s
        ),
        Binding::Kv => format!(
            "no sequence of {} tokens fits one GPU's KV memory",
            pool.context
        ),
        Binding::Slot | Binding::None => "the wait for a slot cannot be bounded".to_string(),
    };
    invalid(format!(
        "no fleet meets the SLO (binding: {}): {why}",
        pool.binding.name()
    ))
}

/// Runs the sweep. Errors on invalid configuration or profile, on a workload
/// with requests longer than `long_context`, and when no fleet meets the SLO
/// (the error names the binding constraint).
pub fn plan(w: &Workload, profile: &Profile, cfg: &PlanConfig) -> Result<Plan> {
    plan_on(Isa::detect(), w, profile, cfg)
}

/// [`plan`] compiled for `isa` (the tests force [`Isa::Portable`]).
pub(crate) fn plan_on(isa: Isa, w: &Workload, profile: &Profile, cfg: &PlanConfig) -> Result<Plan> {
    match isa {
        Isa::Portable => plan_portable(w, profile, cfg),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::X86V3` is only returned by `Isa::detect` once the CPU
        // reported every feature `plan_x86_v3` enables (or built by a test
        // that checked the same), so its instructions exist on this CPU.
        Isa::X86V3 => unsafe { plan_x86_v3(w, profile, cfg) },
    }
}

#[inline(never)]
fn plan_portable(w: &Workload, profile: &Profile, cfg: &PlanConfig) -> Result<Plan> {
    plan_body(w, profile, cfg)
}

/// The same sweep with x86-64-v3's features (`Isa::X86V3`): `plan_body`
/// and its hot callees, `#[inline(always)]`, are compiled into this function
/// with them (a function the inliner leaves apart runs the portable code).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,avx2,bmi1,bmi2,fma,lzcnt,popcnt")]
#[inline(never)]
fn plan_x86_v3(w: &Workload, profile: &Profile, cfg: &PlanConfig) -> Result<Plan> {
    plan_body(w, profile, cfg)
}

#[inline(always)]
fn plan_body(w: &Workload, profile: &Profile, cfg: &PlanConfig) -> Result<Plan> {
    cfg.validate()?;
    profile.validate()?;
    let names = w.category_names();
    for (name, _) in &cfg.p_c_by_category {
        if !names.iter().any(|n| n == name) {
            return Err(crate::error::unknown("category", name.clone()));
        }
    }
    let p_c: Vec<f64> = (0..w.category_channels())
        .map(|k| {
            names
                .get(k)
                .and_then(|n| cfg.p_c_by_category.iter().find(|(c, _)| c == n))
                .map_or_else(
                    || {
                        let never = names.get(k).is_some_and(|n| !compressible_category(n));
                        if never {
                            0.0
                        } else {
                            cfg.p_c
                        }
                    },
                    |(_, v)| *v,
                )
        })
        .collect();
    let ctx = Ctx {
        w,
        profile,
        cfg,
        table: w.service_table(profile.c_chunk)?,
        p_c,
        long_slots: profile.slots(cfg.long_context)?,
        targets: engine_targets(
            EngineSlo {
                ttft_s: cfg.slo_ttft_s,
                tpot_s: cfg.slo_tpot_s,
                quantile: cfg.prefill_quantile,
            },
            (cfg.prefill_quantile, TtftShift::NONE),
        ),
    };
    let lam = cfg.arrival_rate;
    let everything = w.span(f64::NEG_INFINITY, f64::INFINITY);

    let engine = cfg.model == ServiceModel::Engine;
    if engine && profile.h_ref_tokens.is_some() {
        return Err(invalid(
            "the engine model's iteration time is W + H * n_active: a profile with \
             h_ref_tokens (length-scaled H) needs model=\"paper\"",
        ));
    }
    let longest = w.quantile(1.0)?;
    if longest > cfg.long_context {
        let fits = w.fraction(w.span(f64::NEG_INFINITY, cfg.long_context as f64));
        return Err(invalid(format!(
            "{:.3}% of the workload's requests (the longest {longest} tokens) exceed \
             long_context = {}: no pool can serve them; raise long_context or drop them",
            100.0 * (1.0 - fits),
            cfg.long_context
        )));
    }

    // Homogeneous: one pool at the long context holding every request.
    let mut homo_found = (0, 0);
    let homo_pool = if engine {
        let load = ctx.engine_load(
            ctx.mix(everything, None, 1.0),
            ctx.chunks_quantile(everything),
        );
        let all = Sources::span(everything);
        let start = Start::Near {
            ratio: None,
            found: &mut homo_found,
        };
        ctx.size_engine(lam, &load, all, cfg.long_context, ctx.long_slots, start)?
    } else {
        let (a0, a1) = profile.service_coefficients(ctx.long_slots);
        let m_all = ctx.table.moments_all(w, everything, a0, a1);
        let homo_svc = ctx.service(everything, ctx.long_slots, m_all);
        size_pool(
            lam,
            &homo_svc,
            cfg.long_context,
            cfg.utilization_cap(),
            cfg.slo_ttft_s,
        )?
    };
    let homo_cost = ctx.cost(0, homo_pool.gpus);
    let homogeneous = Candidate {
        b_short: 0,
        gamma: 1.0,
        alpha: 0.0,
        beta: 0.0,
        alpha_prime: 0.0,
        short: PoolPlan::EMPTY,
        long: homo_pool,
        feasible: homo_pool.feasible,
        gpus: homo_pool.gpus,
        annual_cost_usd: homo_cost,
        savings_vs_homogeneous: homo_pool.feasible.then_some(0.0),
    };

    let b_list: Vec<u64> = if cfg.b_short.is_empty() {
        DEFAULT_B_SHORT
            .iter()
            .copied()
            .filter(|&b| b < cfg.long_context)
            .filter(|&b| profile.slots(b).is_ok_and(|s| s > ctx.long_slots))
            .collect()
    } else {
        for &b in &cfg.b_short {
            if b == 0 || b >= cfg.long_context {
                return Err(invalid(format!(
                    "b_short must be in [1, long_context = {}), got {b}",
                    cfg.long_context
                )));
            }
        }
        cfg.b_short.clone()
    };
    let gammas: Vec<f64> = if cfg.gammas.is_empty() {
        (10..=20).map(|k| k as f64 / 10.0).collect()
    } else {
        cfg.gammas.clone()
    };

    let (la0, la1) = profile.service_coefficients(ctx.long_slots);
    let mut sweep = Vec::with_capacity(b_list.len() * gammas.len());
    // Neighbouring candidates need similar counts (see `Start::Near`): each
    // short pool's search starts near the last short pool's (the first near
    // the homogeneous pool's), each long pool's between the long pools of
    // the nearest boundaries below and above its own.
    let mut short_last = homo_found;
    let candidates = b_list.len() * gammas.len() + 1;
    let mut longs = LongPools {
        at: Vec::with_capacity(candidates),
        pools: Vec::with_capacity(candidates),
        alone: Vec::with_capacity(candidates),
        cursor: std::cell::Cell::new(0),
    };
    let homo_long = LongPool {
        tail: 0,
        arrival_rate: lam,
        ratio: start_ratio(homo_found),
        pool: None,
    };
    longs.insert(0.0, homo_long, None);
    for &b in &b_list {
        let b_f = b as f64;
        let short_span = w.span(f64::NEG_INFINITY, b_f);
        let alpha = w.fraction(short_span);
        let n_short = profile.slots(b)?;
        let short_mix = if engine {
            Some((
                ctx.mix(short_span, None, 1.0),
                ctx.chunks_quantile(short_span),
            ))
        } else {
            None
        };
        let short_svc = if engine {
            None
        } else {
            let (s0, s1) = profile.service_coefficients(n_short);
            let m_short = ctx.table.moments_all(w, short_span, s0, s1);
            Some(ctx.service(short_span, n_short, m_short))
        };
        let mut short_cache: Option<(f64, PoolPlan)> = None;
        for &gamma in &gammas {
            let gb = (gamma * b_f).floor();
            let band = w.span_from(short_span.end, gb);
            let tail = Span {
                start: band.end,
                end: w.len(),
            };
            let (mut beta, mut moved, mut kept) = (0.0, 0.0, 0.0);
            for (k, &pc) in ctx.p_c.iter().enumerate() {
                let bk = w.category_fraction(band, k);
                beta += bk;
                moved += bk * pc;
                kept += bk * (1.0 - pc);
            }
            let alpha_prime = (alpha + moved).min(1.0);
            let lam_s = alpha_prime * lam;
            let lam_l = (1.0 - alpha_prime) * lam;
            let long_prefill_span = if tail.end > tail.start {
                tail
            } else {
                Span {
                    start: short_span.end,
                    end: w.len(),
                }
            };
            let short = match (short_cache, &short_svc) {
                (Some((l, p)), _) if l == lam_s => p,
                (_, Some(svc)) => {
                    let p = size_pool(lam_s, svc, b, cfg.utilization_cap(), cfg.slo_ttft_s)?;
                    short_cache = Some((lam_s, p));
                    p
                }
                (_, None) => {
                    let (mut mix, mut chunks_q) = short_mix.unwrap_or((Mix::EMPTY, 0.0));
                    let mut sources = Sources::span(short_span);
                    if moved > 0.0 {
                        let weight = moved * w.total_weight();
                        let (compressed, chunks) = ctx.compressed_mix(band, b, weight);
                        mix = mix.merge(compressed);
                        chunks_q = chunks_q.max(chunks as f64);
                        sources.point = (chunks, weight);
                    }
                    let load = ctx.engine_load(mix, chunks_q);
                    let start = Start::Near {
                        ratio: Some(start_ratio(short_last)),
                        found: &mut short_last,
                    };
                    let p = ctx.size_engine(lam_s, &load, sources, b, n_short, start)?;
                    short_cache = Some((lam_s, p));
                    p
                }
            };
            // A long pool of its tail alone (no share of the band) is the
            // same for every candidate with the same tail.
            let alone = kept <= 0.0 && tail.end > tail.start;
            let reused = (engine && alone)
                .then(|| longs.same(gb, tail.start, lam_l))
                .flatten();
            let long = match reused {
                Some(p) => p,
                None if engine => {
                    let mut mix = ctx.mix(tail, None, 1.0);
                    for (k, share) in ctx.kept_bands(band) {
                        mix = mix.merge(ctx.mix(band, Some(k), share));
                    }
                    let load = ctx.engine_load(mix, ctx.chunks_quantile(long_prefill_span));
                    let sources = Sources {
                        spans: [
                            (tail, 1.0),
                            (band, if beta > 0.0 { kept / beta } else { 0.0 }),
                        ],
                        point: (0, 0.0),
                    };
                    let (context, slots) = (cfg.long_context, ctx.long_slots);
                    let mut found = (0, 0);
                    let start = Start::Near {
                        ratio: longs.ratio(gb),
                        found: &mut found,
                    };
                    let p = ctx.size_engine(lam_l, &load, sources, context, slots, start)?;
                    let long = LongPool {
                        tail: tail.start,
                        arrival_rate: lam_l,
                        ratio: start_ratio(found),
                        pool: None,
                    };
                    longs.insert(gb, long, alone.then_some(p));
                    p
                }
                None => {
                    let all = ctx.table.moments_all(w, tail, la0, la1);
                    let mut m_long = all;
                    for (k, share) in ctx.kept_bands(band) {
                        let mut mk = ctx.table.moments(w, band, k, la0, la1);
                        mk.weight *= share;
                        m_long = m_long.merge(mk);
                    }
                    let long_svc = ctx.service(long_prefill_span, ctx.long_slots, m_long);
                    size_pool(
                        lam_l,
                        &long_svc,
                        cfg.long_context,
                        cfg.utilization_cap(),
                        cfg.slo_ttft_s,
                    )?
                }
            };
            let cost = ctx.cost(short.gpus, long.gpus);
            sweep.push(Candidate {
                b_short: b,
                gamma,
                alpha,
                beta,
                alpha_prime,
                short,
                long,
                feasible: short.feasible && long.feasible,
                gpus: short.gpus + long.gpus,
                annual_cost_usd: cost,
                savings_vs_homogeneous: (homogeneous.feasible && homo_cost > 0.0)
                    .then(|| 1.0 - cost / homo_cost),
            });
        }
    }
    let best = cheapest(&sweep, false);
    let pool_routing = cheapest(&sweep, true);
    if best.is_none() && !homogeneous.feasible {
        return Err(no_fleet(&homogeneous.long, cfg, profile));
    }
    Ok(Plan {
        homogeneous,
        sweep,
        best,
        pool_routing,
    })
}

/// The cheapest feasible candidate of `sweep`, the first of equals, by
/// index (`only_gamma_one`: of those at gamma 1, pool routing). A function
/// forced inline, not a closure called twice, and a loop (`min_by` was
/// compiled apart from the x86-64-v3 clone).
#[inline(always)]
fn cheapest(sweep: &[Candidate], only_gamma_one: bool) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, c) in sweep.iter().enumerate() {
        let wanted = c.feasible && (!only_gamma_one || (c.gamma - 1.0).abs() < 1e-9);
        // A match: `is_none_or`'s closure was compiled apart too.
        let cheaper = match best {
            None => true,
            Some(b) => {
                c.annual_cost_usd.total_cmp(&sweep[b].annual_cost_usd) == std::cmp::Ordering::Less
            }
        };
        if wanted && cheaper {
            best = Some(i);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_forms_from_the_papers() {
        // Token-budget paper, Section 3: alpha 0.80, rho 4 -> 60 %.
        let s = pool_routing_savings(0.80, 4.0).expect("ok");
        assert!((s - 0.60).abs() < 1e-15);
        // Eq. 8 worked: 917/13.5 + 83/0.37 = 67.9 + 224.3 = 292.2.
        let g = g_dual(0.917, 1000.0, 13.5, 0.37).expect("ok");
        assert!((g - (917.0 / 13.5 + 83.0 / 0.37)).abs() < 1e-9);
        assert_eq!(g.round(), 292.0);
        // FleetOpt Table 3: 284 GPUs at $2.21 for 8,760 h = $5,498 K.
        let c = annual_cost_usd(284.0, 2.21, HOURS_PER_YEAR).expect("ok");
        assert_eq!((c / 1000.0).round(), 5498.0);
        assert!(pool_routing_savings(1.5, 4.0).is_err());
        assert!(g_dual(0.5, 1.0, 0.0, 1.0).is_err());
    }

    /// The main job's FleetOpt short pool (B = 1,024, gamma 2.0) was planned
    /// at 89 GPUs where the simulator needs 97: its compressed requests were
    /// charged the band's mean output over every category, and code (never
    /// compressed, outputs a tenth of conversation's) pulled it from 353 to
    /// 286 tokens. The case in small: the short pool's iteration time is the
    /// engine model's with the compressed requests' own output (300), not the
    /// band's (155).
    #[test]
    fn compressed_requests_cost_their_own_outputs() {
        let (mut inputs, mut outputs, mut cats) = (Vec::new(), Vec::new(), Vec::new());
        for (n, input, output, cat) in [
            (600, 200, 100, "conversation"),
            (300, 1200, 300, "conversation"),
            (300, 1400, 10, "code"),
            (100, 5000, 100, "conversation"),
        ] {
            inputs.extend(std::iter::repeat_n(input, n));
            outputs.extend(std::iter::repeat_n(output, n));
            cats.extend(std::iter::repeat_n(cat.to_string(), n));
        }
        let w = Workload::new(&inputs, &outputs, None, Some(&cats)).expect("valid");
        let profile = Profile::llama3_70b_a100();
        let cfg = PlanConfig {
            b_short: vec![1024],
            gammas: vec![2.0],
            slo_tpot_s: Some(0.08),
            ..PlanConfig::new(200.0, 2.0)
        };
        let p = plan(&w, &profile, &cfg).expect("plan");
        let short = p.candidate(1024, 2.0).expect("candidate").short;
        // 600 short requests (k = 1 + 100, L_in 200) and 300 compressed to
        // L_in = 1024 - 300 = 724 (k = 2 + 300); code stays in the long pool.
        let point = |weight: f64, x: f64| RangeMoments {
            weight,
            mean: x,
            second: x * x,
        };
        let mix = |a: f64, b: f64| point(600.0, a).merge(point(300.0, b));
        let load = EngineLoad::from_moments(
            mix(101.0, 302.0),
            mix(101.0 * 300.0, 302.0 * 1024.0),
            mix(200.0, 724.0),
            2.0,
            1.0,
        );
        let shape = EngineShape {
            w_s: profile.w_s,
            h_s: profile.h_s,
            chunk: profile.c_chunk,
            n_slots: short.n_slots,
            kv_tokens: short.n_slots as f64 * 1024.0,
        };
        assert!((short.arrival_rate - 200.0 * 900.0 / 1300.0).abs() < 1e-9);
        let n = short.gpus;
        let at = engine_state(short.arrival_rate / n as f64, n, &load, &shape);
        assert!(
            (short.t_iter_s - at.t_iter_s).abs() < 1e-12 * at.t_iter_s,
            "{short:?} vs {at:?}"
        );
        assert!((short.occupancy - at.occupancy).abs() < 1e-9 * at.occupancy);
    }

    /// The warm sweep of `benches/bench_planner.py` in Rust alone (no Python
    /// call), min and median of 3,000: the engine model on the Azure trace
    /// with its categories and without (the bench's workload), and the paper
    /// model; each by the sweep `plan` dispatches to on this CPU and by the
    /// portable one. The trace is read from the CSV `ROUTECORE_AZURE_CSV` names:
    /// `gzip -dc python/routecore/data/azure-llm-2023/azure_llm_2023.csv.gz >
    /// /tmp/azure.csv; ROUTECORE_AZURE_CSV=/tmp/azure.csv cargo test --release
    /// --lib -- --ignored --nocapture planner_sweep_timing`.
    #[test]
    #[ignore]
    fn planner_sweep_timing() {
        let Ok(path) = std::env::var("ROUTECORE_AZURE_CSV") else {
            eprintln!("ROUTECORE_AZURE_CSV is not set: nothing timed");
            return;
        };
        let text = std::fs::read_to_string(path).expect("the trace");
        let cols = crate::workload::CsvColumns {
            input: "ContextTokens",
            output: "GeneratedTokens",
            arrival: None,
            category: Some("category"),
        };
        let labelled = Workload::from_csv_text(&text, &cols).expect("csv");
        let as_i64 = |v: &[u64]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
        let (inputs, outputs) = (
            as_i64(labelled.input_tokens()),
            as_i64(labelled.output_tokens()),
        );
        let bench = Workload::new(&inputs, &outputs, None, None).expect("workload");
        let sweep = |ttft| PlanConfig {
            b_short: DEFAULT_B_SHORT.to_vec(),
            gammas: (10..=20).map(|k| k as f64 / 10.0).collect(),
            ..PlanConfig::new(1000.0, ttft)
        };
        let engine = PlanConfig {
            slo_tpot_s: Some(0.08),
            ..sweep(2.0)
        };
        let paper = PlanConfig {
            model: ServiceModel::Paper,
            ..sweep(0.5)
        };
        let a100 = Profile::llama3_70b_a100();
        let h_ref = Profile {
            h_ref_tokens: Some(8192),
            ..a100.clone()
        };
        for (name, w, profile, cfg) in [
            (
                "engine, the trace with its categories",
                &labelled,
                &a100,
                &engine,
            ),
            ("engine, the bench's workload", &bench, &a100, &engine),
            ("paper, the bench's workload", &bench, &h_ref, &paper),
        ] {
            for (isa, path) in [("dispatched", Isa::detect()), ("portable", Isa::Portable)] {
                plan_on(path, w, profile, cfg).expect("plan");
                let mut took: Vec<f64> = (0..3000)
                    .map(|_| {
                        let start = std::time::Instant::now();
                        std::hint::black_box(plan_on(path, w, profile, cfg).expect("plan"));
                        start.elapsed().as_secs_f64() * 1e6
                    })
                    .collect();
                took.sort_by(f64::total_cmp);
                println!(
                    "{name}, {isa}: min {:.1} us, median {:.1} us",
                    took[0], took[1500]
                );
            }
        }
    }

    /// A sweep's long pools: reused for the same tail at the same rate
    /// (to rounding) only, each search's start ratio interpolated between
    /// the nearest boundaries, whatever order they come in.
    #[test]
    fn long_pools_by_boundary() {
        let mut longs = LongPools {
            at: Vec::new(),
            pools: Vec::new(),
            alone: Vec::new(),
            cursor: std::cell::Cell::new(0),
        };
        let pool = |gpus| PoolPlan {
            gpus,
            ..PoolPlan::EMPTY
        };
        let long = |tail, arrival_rate, ratio| LongPool {
            tail,
            arrival_rate,
            ratio,
            pool: None,
        };
        assert_eq!(longs.ratio(100.0), None);
        longs.insert(0.0, long(0, 1000.0, 1.5), None);
        assert_eq!(longs.ratio(512.0), Some(1.5));
        // Boundaries out of order, as a sweep's rows overlap.
        longs.insert(1024.0, long(900, 300.0, 1.1), Some(pool(30)));
        longs.insert(512.0, long(700, 500.0, 1.3), Some(pool(50)));
        longs.insert(768.0, long(800, 400.0, 1.2), None);
        assert_eq!(longs.at, [0.0, 512.0, 768.0, 1024.0]);
        let close = |a: Option<f64>, b: f64| (a.expect("ratio") - b).abs() < 1e-12;
        assert!(close(longs.ratio(256.0), 1.4));
        assert!(close(longs.ratio(896.0), 1.15));
        assert!(close(longs.ratio(768.0), 1.2));
        assert!(close(longs.ratio(4096.0), 1.1));
        // The same tail at the same rate but for rounding, at a boundary
        // that cuts it in the same place (no request between).
        let near = 500.0 * (1.0 + 1e-15);
        assert_eq!(longs.same(530.0, 700, near).map(|p| p.gpus), Some(50));
        assert_eq!(longs.same(1000.0, 900, 300.0).map(|p| p.gpus), Some(30));
        // Another tail, another rate, or a pool that held a band's share.
        assert_eq!(longs.same(530.0, 701, 500.0), None);
        assert_eq!(longs.same(530.0, 700, 500.1), None);
        assert_eq!(longs.same(768.0, 800, 400.0), None);
    }

    #[test]
    fn utilization_floor_is_exact() {
        assert_eq!(utilization_floor(85.0, 1.0, 0.85), 100);
        assert_eq!(utilization_floor(85.01, 1.0, 0.85), 101);
        assert_eq!(utilization_floor(1e-9, 1.0, 0.85), 1);
    }

    #[test]
    fn small_fleet_needs_more_than_the_cap() {
        // One slot per GPU, mean service 1 s, lambda 0.5: the cap says 1 GPU
        // (rho 0.5) but M/M/1 W99 = ln(50) s > 1 s, so more GPUs are needed.
        let svc = Service {
            n_slots: 1,
            fraction: 1.0,
            mean_s: 1.0,
            cs2: 1.0,
            mu_gpu: 1.0,
            t_iter_s: 0.0,
            prefill_p99_s: 0.0,
        };
        let p = size_pool(0.5, &svc, 1, 0.85, 1.0).expect("ok");
        assert!(p.gpus > 1);
        assert!(p.p99_wait_s <= 1.0);
        let fewer = p99_wait(p.gpus - 1, 1.0, 1.0, 0.5).expect("ok");
        assert!(fewer > 1.0);
    }
}
