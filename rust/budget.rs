//! Token-budget pool dispatch (Chen et al. 2026, Algorithm 1), for N pools.
//!
//! `L_total = ceil(prompt_bytes / c*) + max_output_tokens` with `c*` the
//! calibrator's conservative ratio for the request's category. Then:
//!
//! 1. Hard constraint: a pool whose `max_context` is below `L_total` is never
//!    chosen. If no pool holds `L_total` the request is rejected, not routed.
//! 2. Budget: the target is the pool with the smallest budget that holds
//!    `L_total` (pools ordered by budget, then max_context). If no budget holds
//!    it but some pool's max_context does, the target is the pool with the
//!    largest max_context (the paper's long pool, whose budget is its window).
//! 3. Spillover: a pool is *overloaded* when its in-flight count is above its
//!    `queue_limit` (strictly: `in_flight > queue_limit`). When the target is
//!    overloaded and another pool that holds `L_total` is not, the request
//!    spills to the least loaded such pool (fewest in flight; ties to the pool
//!    earlier in budget order). That pool may be larger or smaller than the
//!    target, as in the paper, but always satisfies the hard constraint.
//!
//! 4. Compress-and-route (FleetOpt section 5.1), only with a `compress_band`
//!    gamma >= 1: a compressible request (any category but "code", known
//!    text) whose `L_total` is in `(B, gamma * B]` for the pool with the largest
//!    budget `B` below `L_total` is sent to that pool with action "compress" and
//!    target `T_c = B - L_out` prompt tokens (`crate::compress` does the
//!    cutting), unless that pool is overloaded, `T_c` < 1, or it is the pool
//!    the request would go to anyway.
//!
//! The router counts in-flight requests per pool: every routed request adds one
//! to its pool, `complete` removes one, and telemetry may overwrite the count.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::calibrate::{estimate, Calibrator, MAX_PROMPT_BYTES};
use crate::error::{invalid, not_in_flight, unknown, Result};

/// Largest `max_output_tokens` / context a request or pool may name: 2^30
/// tokens (about a billion) is far beyond any model and marks corrupt input.
pub const MAX_TOKENS: u64 = 1 << 30;

/// One pool of model instances that share a context window.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    pub name: String,
    /// The window every instance in the pool is configured with (vLLM's
    /// max_model_len). Requests with a larger L_total are never sent here.
    pub max_context: u64,
    /// The largest L_total the pool is meant for (B_short for the short pool);
    /// defaults to `max_context`; must not exceed it.
    pub budget: u64,
    /// Spill to another pool while more than this many requests are in flight.
    pub queue_limit: Option<u64>,
}

impl Pool {
    pub fn new(
        name: &str,
        max_context: i64,
        budget: Option<i64>,
        queue_limit: Option<i64>,
    ) -> Result<Self> {
        if name.is_empty() || name.len() > 256 {
            return Err(invalid("pool name must be 1 to 256 bytes"));
        }
        let max_context = check_tokens("max_context", max_context)?;
        let budget = match budget {
            Some(b) => check_tokens("budget", b)?,
            None => max_context,
        };
        if budget > max_context {
            return Err(invalid(format!(
                "pool {name:?}: budget {budget} exceeds max_context {max_context}"
            )));
        }
        let queue_limit = match queue_limit {
            Some(q) if q < 0 => return Err(invalid(format!("queue_limit must be >= 0, got {q}"))),
            q => q.map(|q| q as u64),
        };
        Ok(Self {
            name: name.to_owned(),
            max_context,
            budget,
            queue_limit,
        })
    }
}

fn check_tokens(what: &str, v: i64) -> Result<u64> {
    if v < 1 || v as u64 > MAX_TOKENS {
        return Err(invalid(format!(
            "{what} must be in [1, {MAX_TOKENS}], got {v}"
        )));
    }
    Ok(v as u64)
}

/// Why a decision came out as it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The smallest pool whose budget holds L_total.
    Budget,
    /// No budget holds L_total; the largest window does.
    LargestContext,
    /// The target was overloaded; moved to the least loaded pool that holds it.
    Spillover,
    /// No pool's max_context holds L_total.
    TooLong,
    /// Sent to a smaller pool once compressed to `compress_target_tokens`.
    Compress,
}

/// What the caller does with a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Send the request, as it is, to the pool.
    Route,
    /// Compress the prompt to `compress_target_tokens`, then send it.
    Compress,
    /// No pool can take it.
    Reject,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Route => "route",
            Action::Compress => "compress",
            Action::Reject => "reject",
        }
    }
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Budget => "budget",
            Reason::LargestContext => "largest-context",
            Reason::Spillover => "spillover",
            Reason::TooLong => "exceeds-max-context",
            Reason::Compress => "compress",
        }
    }
}

/// One routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Index of the chosen pool (in the order the pools were given), or None.
    pub pool: Option<usize>,
    pub est_input_tokens: u64,
    pub est_output_tokens: u64,
    pub est_total_tokens: u64,
    pub spilled: bool,
    pub reason: Reason,
    pub action: Action,
    /// `T_c = B - L_out` when the action is `Compress`.
    pub compress_target_tokens: Option<u64>,
}

/// The request fields routing needs, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub prompt_bytes: u64,
    pub category: Option<usize>,
    pub max_output_tokens: u64,
}

impl Request {
    pub fn new(prompt_bytes: i64, category: Option<usize>, max_output_tokens: i64) -> Result<Self> {
        if prompt_bytes < 0 || prompt_bytes as u64 > MAX_PROMPT_BYTES {
            return Err(invalid(format!(
                "prompt_bytes must be in [0, {MAX_PROMPT_BYTES}], got {prompt_bytes}"
            )));
        }
        Ok(Self {
            prompt_bytes: prompt_bytes as u64,
            category,
            max_output_tokens: check_tokens("max_output_tokens", max_output_tokens)?,
        })
    }
}

pub struct TokenBudgetRouter {
    pools: Vec<Pool>,
    /// Pool indices by (budget, max_context) ascending.
    order: Vec<usize>,
    in_flight: Vec<AtomicU64>,
    calibrator: Arc<RwLock<Calibrator>>,
    compress_band: Option<f64>,
}

impl TokenBudgetRouter {
    pub fn new(pools: Vec<Pool>, calibrator: Arc<RwLock<Calibrator>>) -> Result<Self> {
        if pools.is_empty() {
            return Err(invalid("at least one pool is required"));
        }
        for (i, p) in pools.iter().enumerate() {
            if pools[..i].iter().any(|q| q.name == p.name) {
                return Err(invalid(format!("duplicate pool name {:?}", p.name)));
            }
        }
        let mut order: Vec<usize> = (0..pools.len()).collect();
        order.sort_by_key(|&i| (pools[i].budget, pools[i].max_context));
        let in_flight = pools.iter().map(|_| AtomicU64::new(0)).collect();
        Ok(Self {
            pools,
            order,
            in_flight,
            calibrator,
            compress_band: None,
        })
    }

    /// Turns on compress-and-route with band `gamma` (finite, >= 1).
    pub fn with_compress_band(mut self, gamma: f64) -> Result<Self> {
        if !(gamma.is_finite() && gamma >= 1.0) {
            return Err(invalid(format!(
                "compress_band must be a finite number >= 1, got {gamma}"
            )));
        }
        self.compress_band = Some(gamma);
        Ok(self)
    }

    pub fn compress_band(&self) -> Option<f64> {
        self.compress_band
    }

    /// The pool and target `T_c` a compressible request of `total` tokens,
    /// `output` of them output, would be compressed for (see the module
    /// docs), without counting it.
    pub fn compress_target(&self, total: u64, output: u64) -> Option<(usize, u64)> {
        self.compress_target_by(total, output, |i| self.load(i))
    }

    #[inline]
    fn compress_target_by(
        &self,
        total: u64,
        output: u64,
        load: impl Fn(usize) -> u64 + Copy,
    ) -> Option<(usize, u64)> {
        let gamma = self.compress_band?;
        let pool = self
            .order
            .iter()
            .copied()
            .rfind(|&i| self.pools[i].budget < total)?;
        let budget = self.pools[pool].budget;
        let in_band = total as f64 <= gamma * budget as f64;
        let target = budget.checked_sub(output).filter(|&t| t >= 1)?;
        let elsewhere = self.choose_by(total, load).0 != Some(pool);
        (in_band && elsewhere && !self.overloaded(pool, load)).then_some((pool, target))
    }

    /// Counts a request compressed for `pool` (from `compress_target`).
    pub fn route_compressed(
        &self,
        pool: usize,
        est_input_tokens: u64,
        max_output_tokens: u64,
        target: u64,
    ) -> Decision {
        self.in_flight[pool].fetch_add(1, Ordering::Relaxed);
        Decision {
            pool: Some(pool),
            est_input_tokens,
            est_output_tokens: max_output_tokens,
            est_total_tokens: est_input_tokens.saturating_add(max_output_tokens),
            spilled: false,
            reason: Reason::Compress,
            action: Action::Compress,
            compress_target_tokens: Some(target),
        }
    }

    /// Routes a request, with compress-and-route when `compressible` and a
    /// band is set; counts it in flight.
    pub fn route_with(
        &self,
        est_input_tokens: u64,
        max_output_tokens: u64,
        compressible: bool,
    ) -> Decision {
        let total = est_input_tokens.saturating_add(max_output_tokens);
        let pick = self.pick(total, max_output_tokens, compressible, |i| self.load(i));
        if let Some(i) = pick.pool {
            self.in_flight[i].fetch_add(1, Ordering::Relaxed);
        }
        Decision {
            pool: pick.pool,
            est_input_tokens,
            est_output_tokens: max_output_tokens,
            est_total_tokens: total,
            spilled: pick.spilled,
            reason: pick.reason,
            action: match (pick.pool, pick.compress_target) {
                (None, _) => Action::Reject,
                (Some(_), None) => Action::Route,
                (Some(_), Some(_)) => Action::Compress,
            },
            compress_target_tokens: pick.compress_target,
        }
    }

    /// The whole decision for a request of `total` tokens under the given
    /// in-flight counts, without counting it.
    #[inline]
    fn pick(
        &self,
        total: u64,
        output: u64,
        compressible: bool,
        load: impl Fn(usize) -> u64 + Copy,
    ) -> Pick {
        if compressible {
            if let Some((pool, target)) = self.compress_target_by(total, output, load) {
                return Pick {
                    pool: Some(pool),
                    spilled: false,
                    reason: Reason::Compress,
                    compress_target: Some(target),
                };
            }
        }
        let (pool, spilled, reason) = self.choose_by(total, load);
        Pick {
            pool,
            spilled,
            reason,
            compress_target: None,
        }
    }

    pub fn pools(&self) -> &[Pool] {
        &self.pools
    }

    pub fn calibrator(&self) -> &Arc<RwLock<Calibrator>> {
        &self.calibrator
    }

    /// The calibrator, read-locked. A poisoned lock is still usable: the
    /// calibrator is updated only after every check passed, so it is consistent.
    pub fn read_calibrator(&self) -> RwLockReadGuard<'_, Calibrator> {
        self.calibrator.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write_calibrator(&self) -> RwLockWriteGuard<'_, Calibrator> {
        self.calibrator.write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn pool_index(&self, name: &str) -> Result<usize> {
        self.pools
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| unknown("pool", name))
    }

    fn check_index(&self, pool: usize) -> Result<usize> {
        if pool < self.pools.len() {
            Ok(pool)
        } else {
            Err(unknown("pool index", pool.to_string()))
        }
    }

    pub fn in_flight(&self, pool: usize) -> Result<u64> {
        Ok(self.in_flight[self.check_index(pool)?].load(Ordering::Relaxed))
    }

    /// Telemetry: the pool's in-flight count as measured elsewhere.
    pub fn set_in_flight(&self, pool: usize, n: u64) -> Result<()> {
        self.in_flight[self.check_index(pool)?].store(n, Ordering::Relaxed);
        Ok(())
    }

    /// Counts one request in flight on `pool` without a decision (a request
    /// sent to a fixed pool, e.g. a server's default pool).
    pub fn start(&self, pool: usize) -> Result<()> {
        self.in_flight[self.check_index(pool)?].fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Ends one in-flight request on `pool`. Refused when none is in flight.
    pub fn complete(&self, pool: usize) -> Result<()> {
        let counter = &self.in_flight[self.check_index(pool)?];
        counter
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .map(|_| ())
            .map_err(|_| {
                not_in_flight(format!(
                    "complete: pool {:?} has no request in flight",
                    self.pools[pool].name
                ))
            })
    }

    #[inline]
    fn load(&self, pool: usize) -> u64 {
        self.in_flight[pool].load(Ordering::Relaxed)
    }

    /// Above its queue limit; the load is read only for a pool that has one.
    #[inline]
    fn overloaded(&self, pool: usize, load: impl Fn(usize) -> u64) -> bool {
        self.pools[pool]
            .queue_limit
            .is_some_and(|limit| load(pool) > limit)
    }

    /// The pool for a request of `total` tokens, without counting it.
    pub fn choose(&self, total: u64) -> (Option<usize>, bool, Reason) {
        self.choose_by(total, |i| self.load(i))
    }

    #[inline]
    fn choose_by(
        &self,
        total: u64,
        load: impl Fn(usize) -> u64 + Copy,
    ) -> (Option<usize>, bool, Reason) {
        let fits = |i: &usize| self.pools[*i].max_context >= total;
        let target = self
            .order
            .iter()
            .copied()
            .find(|&i| self.pools[i].budget >= total)
            .map(|i| (i, Reason::Budget))
            .or_else(|| {
                self.order
                    .iter()
                    .copied()
                    .filter(fits)
                    .max_by_key(|&i| self.pools[i].max_context)
                    .map(|i| (i, Reason::LargestContext))
            });
        let Some((target, reason)) = target else {
            return (None, false, Reason::TooLong);
        };
        if !self.overloaded(target, load) {
            return (Some(target), false, reason);
        }
        let alternate = self
            .order
            .iter()
            .copied()
            .filter(|&i| i != target && fits(&i) && !self.overloaded(i, load))
            .min_by_key(|&i| load(i));
        match alternate {
            Some(i) => (Some(i), true, Reason::Spillover),
            None => (Some(target), false, reason),
        }
    }

    /// Routes one request and counts it in flight on the chosen pool.
    pub fn route(&self, req: Request) -> Decision {
        let (est_input_tokens, compressible) = {
            let cal = self.read_calibrator();
            (
                cal.estimate_tokens_id(req.prompt_bytes, req.category),
                compressible(&cal, req.category),
            )
        };
        self.route_with(est_input_tokens, req.max_output_tokens, compressible)
    }

    /// Routes a request whose input tokens are already estimated (or known),
    /// without compression.
    pub fn route_estimated(&self, est_input_tokens: u64, max_output_tokens: u64) -> Decision {
        self.route_with(est_input_tokens, max_output_tokens, false)
    }

    /// Routes a batch in order, exactly as `route` one by one would from a
    /// single thread. Returns pool indices, -1 for a rejected request. The
    /// calibrator is read once, and the batch decides against the in-flight
    /// counts at its start plus its own dispatches, which are published (one
    /// atomic add per pool) when it ends.
    pub fn route_many(&self, requests: &[Request]) -> Vec<i64> {
        let cal = self.read_calibrator();
        self.route_batch(&cal, requests.len(), |i| requests[i])
    }

    /// `route_many` over parallel arrays (as NumPy hands them over), checked
    /// whole before anything is counted: on an error no request is counted.
    /// Category ids index the calibrator's categories.
    pub fn route_arrays(
        &self,
        prompt_bytes: &[i64],
        category_ids: &[i64],
        max_output_tokens: &[i64],
    ) -> Result<Vec<i64>> {
        let n = prompt_bytes.len();
        if category_ids.len() != n || max_output_tokens.len() != n {
            return Err(invalid(format!(
                "arrays differ in length: {n}, {}, {}",
                category_ids.len(),
                max_output_tokens.len()
            )));
        }
        let cal = self.read_calibrator();
        if let Some(steps) = self.steps() {
            let ratios: Vec<f64> = (0..cal.categories().len())
                .map(|id| cal.conservative_ratio_id(Some(id)))
                .collect();
            let batch = [prompt_bytes, category_ids, max_output_tokens];
            if let Some((chosen, counts)) = steps.route(&ratios, batch) {
                for (j, &k) in counts.iter().enumerate() {
                    self.in_flight[j].fetch_add(k, Ordering::Relaxed);
                }
                return Ok(chosen);
            }
        }
        check_arrays(&cal, prompt_bytes, category_ids, max_output_tokens)?;
        // Every entry was checked above, so the casts below are exact.
        Ok(self.route_batch(&cal, n, |i| Request {
            prompt_bytes: prompt_bytes[i] as u64,
            category: Some(category_ids[i] as usize),
            max_output_tokens: max_output_tokens[i] as u64,
        }))
    }

    /// The decisions as a step function of `L_total`, when they depend on
    /// nothing else: no pool has a queue limit (so nothing spills) and no
    /// compress band is set. `choose` compares the total only with budgets
    /// and windows (`v >= total`), so it is constant on each interval
    /// `(e_{k-1}, e_k]` between consecutive ones and equal to its value at
    /// `e_k` there; above the largest, the hard constraint rejects.
    fn steps(&self) -> Option<Steps> {
        if self.compress_band.is_some() || self.pools.iter().any(|p| p.queue_limit.is_some()) {
            return None;
        }
        let mut ends: Vec<u64> = self
            .pools
            .iter()
            .flat_map(|p| [p.budget, p.max_context])
            .collect();
        ends.sort_unstable();
        ends.dedup();
        let pool_at = |total: u64| {
            let (pool, _, _) = self.choose_by(total, |_| 0);
            pool.map_or(-1, |p| p as i64)
        };
        let mut steps: Vec<(u64, i64)> = Vec::with_capacity(ends.len() + 1);
        let last = ends.last().map_or(0, |&e| e + 1);
        for (end, pool) in ends.into_iter().map(|e| (e, pool_at(e))) {
            match steps.last_mut() {
                Some(prev) if prev.1 == pool => prev.0 = end,
                _ => steps.push((end, pool)),
            }
        }
        let above = pool_at(last);
        match steps.last() {
            Some(&(_, pool)) if pool == above => {}
            _ => steps.push((u64::MAX, above)),
        }
        Some(Steps {
            steps,
            pools: self.pools.len(),
        })
    }

    fn route_batch(
        &self,
        cal: &Calibrator,
        n: usize,
        request: impl Fn(usize) -> Request,
    ) -> Vec<i64> {
        // Per category: the conservative ratio and whether it may be compressed.
        let table: Vec<(f64, bool)> = (0..cal.categories().len())
            .map(|id| {
                (
                    cal.conservative_ratio_id(Some(id)),
                    compressible(cal, Some(id)),
                )
            })
            .collect();
        let cold = (cal.conservative_ratio_id(None), compressible(cal, None));
        let start: Vec<u64> = (0..self.pools.len()).map(|i| self.load(i)).collect();
        let mut loads = start.clone();
        let chosen = (0..n)
            .map(|i| {
                let r = request(i);
                let (ratio, may_compress) = r
                    .category
                    .and_then(|c| table.get(c).copied())
                    .unwrap_or(cold);
                let total = estimate(r.prompt_bytes, ratio).saturating_add(r.max_output_tokens);
                let pick = self.pick(total, r.max_output_tokens, may_compress, |j| loads[j]);
                match pick.pool {
                    Some(j) => {
                        loads[j] += 1;
                        j as i64
                    }
                    None => -1,
                }
            })
            .collect();
        for (j, (now, before)) in loads.iter().zip(&start).enumerate() {
            self.in_flight[j].fetch_add(now - before, Ordering::Relaxed);
        }
        chosen
    }
}

/// A decision before it is counted.
struct Pick {
    pool: Option<usize>,
    spilled: bool,
    reason: Reason,
    compress_target: Option<u64>,
}

/// Checks a batch of arrays (lengths already equal) as `route_arrays` needs
/// them; the first bad entry is the error.
fn check_arrays(
    cal: &Calibrator,
    prompt_bytes: &[i64],
    category_ids: &[i64],
    max_output_tokens: &[i64],
) -> Result<()> {
    let n_categories = cal.categories().len() as i64;
    for ((&b, &c), &o) in prompt_bytes.iter().zip(category_ids).zip(max_output_tokens) {
        if !(0..n_categories).contains(&c) {
            return Err(invalid(format!(
                "category id {c} is not one of the {n_categories} ids from category_id()"
            )));
        }
        Request::new(b, Some(c as usize), o)?;
    }
    Ok(())
}

/// Requests per block of a batch on the step path (`Steps::kernel`).
const BLOCK: usize = 512;

/// 2^52: adding and removing it rounds a float in [0, 2^51] to an integer.
const TWO_52: f64 = 4_503_599_627_370_496.0;

/// `v as f64` for `0 <= v < 2^52` (exact) in operations SIMD lanes have
/// without AVX-512: `v` becomes the low mantissa bits of `2^52`. Garbage
/// for other `v`, which the batch's range check refuses.
#[inline(always)]
fn small_f64(v: i64) -> f64 {
    f64::from_bits(TWO_52.to_bits() | v as u64) - TWO_52
}

/// `ceil(x)` for `0 <= x <= 2^51`, equal to [`estimate`]'s: `r`, `x`
/// rounded to the nearest integer (exact in this range), or `r + 1` when
/// `r < x`.
#[inline(always)]
fn ceil_small(x: f64) -> f64 {
    let r = (x + TWO_52) - TWO_52;
    if r < x {
        r + 1.0
    } else {
        r
    }
}

/// A batch's decisions as a step function of `L_total` (see
/// `TokenBudgetRouter::steps`).
#[derive(Debug, Clone, PartialEq)]
struct Steps {
    /// (largest total of the step, its pool or -1), ascending; the last
    /// step holds every larger total.
    steps: Vec<(u64, i64)>,
    pools: usize,
}

impl Steps {
    /// Routes `[prompt_bytes, category_ids, max_output_tokens]` in one pass:
    /// the pools chosen and the requests counted per pool. None when the
    /// batch holds a bad entry (the caller then finds it) or has more steps
    /// than the kernels take.
    fn route(&self, ratios: &[f64], batch: [&[i64]; 3]) -> Option<(Vec<i64>, Vec<u64>)> {
        let bounds = self.steps.len() - 1;
        let (chosen, above, check) = if bounds <= 2 {
            self.kernel::<2>(ratios, batch)
        } else if bounds <= 4 {
            self.kernel::<4>(ratios, batch)
        } else if bounds <= 8 {
            self.kernel::<8>(ratios, batch)
        } else {
            return None;
        };
        if check < 0 {
            return None;
        }
        let n = batch[0].len() as u64;
        let mut counts = vec![0; self.pools];
        for (j, &(_, pool)) in self.steps.iter().enumerate() {
            let into = if j == 0 { n } else { above[j - 1] };
            let past = above.get(j).copied().unwrap_or(0);
            if let Ok(p) = usize::try_from(pool) {
                counts[p] += into - past;
            }
        }
        Some((chosen, counts))
    }

    /// The pass of `route` with the step bounds padded to `N` (+inf, no
    /// change of pool): per request, the range check folded into `check`
    /// (negative when an entry is out of range), `L_total` computed as
    /// `estimate` does (the same division, an exact ceiling, an exact sum:
    /// every value stays below 2^53), the pool from the bounds it exceeds.
    /// Returns the pools, the requests above each bound and `check`.
    fn kernel<const N: usize>(
        &self,
        ratios: &[f64],
        [bytes, categories, outputs]: [&[i64]; 3],
    ) -> (Vec<i64>, Vec<u64>, i64) {
        let mut bounds = [f64::INFINITY; N];
        let mut deltas = [0i64; N];
        for (k, pair) in self.steps.windows(2).enumerate() {
            bounds[k] = pair[0].0 as f64;
            deltas[k] = pair[1].1 - pair[0].1;
        }
        let first = self.steps[0].1;
        // A power-of-two table, so a masked id is always in range.
        let mut table = vec![1.0; ratios.len().next_power_of_two()];
        table[..ratios.len()].copy_from_slice(ratios);
        let mask = table.len() - 1;
        let last_id = ratios.len() as i64 - 1;
        let (max_bytes, max_tokens) = (MAX_PROMPT_BYTES as i64, MAX_TOKENS as i64);
        let mut above = [0u64; N];
        let mut check = 0i64;
        let mut chosen = Vec::with_capacity(bytes.len());
        // In blocks: the totals first (the range check, the division), then
        // the pools and counts from them, each loop simple enough to vectorise.
        let mut totals = [0.0f64; BLOCK];
        for ((b, c), o) in bytes
            .chunks(BLOCK)
            .zip(categories.chunks(BLOCK))
            .zip(outputs.chunks(BLOCK))
        {
            let totals = &mut totals[..b.len()];
            for (t, ((&b, &c), &o)) in totals.iter_mut().zip(b.iter().zip(c).zip(o)) {
                // Each term is negative exactly when its bound is broken.
                check |= b | max_bytes.wrapping_sub(b);
                check |= c | last_id.wrapping_sub(c);
                check |= o.wrapping_sub(1) | max_tokens.wrapping_sub(o);
                let x = small_f64(b) / table[c as usize & mask];
                *t = ceil_small(x) + small_f64(o);
            }
            chosen.extend(totals.iter().map(|&t| {
                let mut pool = first;
                for k in 0..N {
                    pool += deltas[k] & -i64::from(t > bounds[k]);
                }
                pool
            }));
            for k in 0..N {
                above[k] += totals.iter().filter(|&&t| t > bounds[k]).count() as u64;
            }
        }
        (chosen, above.to_vec(), check)
    }
}

/// The categories never compressed: code (FleetOpt section 5.2's safety
/// gate). The planner's default compressibility and the simulator's follow it.
pub const INCOMPRESSIBLE_CATEGORIES: [&str; 1] = ["code"];

/// Whether a category may be compressed: every category but those of
/// [`INCOMPRESSIBLE_CATEGORIES`].
pub fn compressible_category(name: &str) -> bool {
    !INCOMPRESSIBLE_CATEGORIES.contains(&name)
}

/// `compressible_category` for a category id (an unknown id is compressible).
pub fn compressible(cal: &Calibrator, category: Option<usize>) -> bool {
    category
        .and_then(|id| cal.categories().get(id))
        .is_none_or(|name| compressible_category(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, max_context, budget, queue_limit) of a pool.
    type PoolSpec<'a> = (&'a str, i64, Option<i64>, Option<i64>);

    fn router(pools: &[PoolSpec]) -> TokenBudgetRouter {
        let pools = pools
            .iter()
            .map(|&(n, c, b, q)| Pool::new(n, c, b, q).expect("pool"))
            .collect();
        let cal = Calibrator::new(0.95, 1.0, 4.0, 16).expect("cal");
        TokenBudgetRouter::new(pools, Arc::new(RwLock::new(cal))).expect("router")
    }

    fn req(bytes: i64, out: i64) -> Request {
        Request::new(bytes, None, out).expect("request")
    }

    #[test]
    fn total_budget_not_prompt_length() {
        let r = router(&[("short", 8192, None, None), ("long", 65536, None, None)]);
        // 200 tokens of prompt (800 bytes at 4.0) with max_tokens 8192: 8392 > 8192.
        let d = r.route(req(800, 8192));
        assert_eq!(
            (d.pool, d.est_input_tokens, d.est_total_tokens),
            (Some(1), 200, 8392)
        );
        let d = r.route(req(800, 7992));
        assert_eq!((d.pool, d.est_total_tokens), (Some(0), 8192));
    }

    #[test]
    fn hard_constraint_and_rejection() {
        // A short pool with a budget of 4096 but a window of 8192; a 16K long pool.
        let r = router(&[
            ("long", 16384, None, None),
            ("short", 8192, Some(4096), None),
        ]);
        // 1000 + 3000 tokens fit the short budget; 2000 + 3000 fit its window but
        // not its budget, so they go long.
        assert_eq!(r.route(req(4000, 3000)).pool, Some(1));
        assert_eq!(r.route(req(8000, 3000)).pool, Some(0));
        let d = r.route(req(4 * 16384, 1));
        assert_eq!((d.pool, d.reason), (None, Reason::TooLong));
        assert_eq!(r.in_flight(0).expect("pool"), 1);
        assert_eq!(r.in_flight(1).expect("pool"), 1);
    }

    #[test]
    fn largest_context_when_no_budget_holds() {
        let r = router(&[
            ("a", 8192, Some(2048), None),
            ("b", 32768, Some(4096), None),
        ]);
        let d = r.route(req(4 * 6000, 100));
        assert_eq!((d.pool, d.reason), (Some(1), Reason::LargestContext));
    }

    #[test]
    fn spillover_both_ways_only_when_target_holds() {
        let r = router(&[
            ("short", 8192, Some(4096), Some(2)),
            ("long", 65536, None, Some(2)),
        ]);
        for _ in 0..3 {
            assert_eq!(r.route(req(400, 100)).pool, Some(0));
        }
        // Short is above its limit (3 > 2): a small request spills up to long.
        let d = r.route(req(400, 100));
        assert_eq!(
            (d.pool, d.spilled, d.reason),
            (Some(1), true, Reason::Spillover)
        );
        // Long gets loaded past its limit; a request that fits short spills down,
        // one that does not fit short stays long although long is overloaded.
        r.set_in_flight(0, 0).expect("pool");
        r.set_in_flight(1, 3).expect("pool");
        let d = r.route(req(24_000, 100)); // 6,100 tokens: over short's budget, in its window
        assert_eq!((d.pool, d.spilled), (Some(0), true));
        let d = r.route(req(40_000, 100)); // 10,100 tokens: only long holds it
        assert_eq!(
            (d.pool, d.spilled, d.reason),
            (Some(1), false, Reason::Budget)
        );
        // Short overloaded too: nowhere to spill, the target keeps it.
        r.set_in_flight(0, 3).expect("pool");
        let d = r.route(req(24_000, 100));
        assert_eq!(
            (d.pool, d.spilled, d.reason),
            (Some(1), false, Reason::Budget)
        );
    }

    #[test]
    fn complete_and_batch_equivalence() {
        let r = router(&[
            ("s", 4096, None, Some(3)),
            ("m", 16384, None, Some(5)),
            ("l", 65536, None, None),
        ]);
        assert!(r.complete(0).is_err());
        let reqs: Vec<Request> = (0..200)
            .map(|i| req((i * 977) % 200_000, 1 + (i * 131) % 3000))
            .collect();
        let one_by_one: Vec<i64> = reqs
            .iter()
            .map(|q| r.route(*q).pool.map_or(-1, |p| p as i64))
            .collect();
        let r2 = router(&[
            ("s", 4096, None, Some(3)),
            ("m", 16384, None, Some(5)),
            ("l", 65536, None, None),
        ]);
        assert_eq!(r2.route_many(&reqs), one_by_one);
        for p in 0..3 {
            assert_eq!(r.in_flight(p), r2.in_flight(p));
        }
        r.complete(2).expect("in flight");
    }

    #[test]
    fn route_arrays_equals_route_many_and_checks_first() {
        let pools = &[("s", 4096, None, Some(3)), ("l", 65536, None, None)];
        let (a, b) = (router(pools), router(pools));
        let id = a.write_calibrator().intern("prose").expect("id");
        b.write_calibrator().intern("prose").expect("id");
        let bytes: Vec<i64> = (0..300).map(|i| (i * 977) % 100_000).collect();
        let cats = vec![id as i64; 300];
        let outs: Vec<i64> = (0..300).map(|i| 1 + (i * 131) % 3000).collect();
        let reqs: Vec<Request> = (0..300)
            .map(|i| Request::new(bytes[i], Some(id), outs[i]).expect("request"))
            .collect();
        assert_eq!(
            a.route_arrays(&bytes, &cats, &outs),
            Ok(b.route_many(&reqs))
        );
        let before = (a.in_flight(0), a.in_flight(1));
        assert!(a.route_arrays(&[1, 2], &[0, 5], &[1, 1]).is_err());
        assert!(a.route_arrays(&[1, -2], &[0, 0], &[1, 1]).is_err());
        assert!(a.route_arrays(&[1], &[0, 0], &[1]).is_err());
        assert_eq!((a.in_flight(0), a.in_flight(1)), before);
    }

    /// A calibrated router over `pools` (no queue limits: the step path) and
    /// its three category ids.
    fn calibrated(pools: &[PoolSpec]) -> (TokenBudgetRouter, [i64; 3]) {
        let r = router(pools);
        let mut ids = [0; 3];
        for (k, (name, bytes, tokens)) in [
            ("prose", 4500, 1000),
            ("code", 3500, 999),
            ("cjk", 2000, 1003),
        ]
        .into_iter()
        .enumerate()
        {
            r.write_calibrator()
                .observe(name, bytes, tokens)
                .expect("observe");
            ids[k] = r.write_calibrator().intern(name).expect("id") as i64;
        }
        (r, ids)
    }

    #[test]
    fn step_path_decides_and_counts_as_route_one_by_one() {
        let configs: &[&[PoolSpec]] = &[
            &[("short", 8192, None, None), ("long", 65536, None, None)],
            &[
                ("long", 16384, None, None),
                ("short", 8192, Some(4096), None),
            ],
            &[
                ("a", 8192, Some(2048), None),
                ("b", 32768, Some(4096), None),
            ],
            &[
                ("s", 4096, Some(1000), None),
                ("m", 16384, Some(4096), None),
                ("l", 131072, Some(65536), None),
                ("x", 131072, Some(4096), None),
            ],
            &[("only", 1000, None, None)],
        ];
        let mut rng = crate::rng::Rng::new(7);
        for pools in configs {
            let (one, ids) = calibrated(pools);
            let (many, _) = calibrated(pools);
            assert!(many.steps().is_some());
            let ratios: Vec<f64> = (0..3)
                .map(|i| one.read_calibrator().conservative_ratio_id(Some(i)))
                .collect();
            let (mut bytes, mut cats, mut outs) = (vec![], vec![], vec![]);
            for i in 0..5000 {
                let c = rng.below(3) as usize;
                let out = 1 + rng.below(3000) as i64;
                // Half the prompts land within a few bytes of a pool's bound.
                let b = if i % 2 == 0 {
                    let p = &pools[rng.below(pools.len() as u64) as usize];
                    let edge = p.2.unwrap_or(p.1) - out;
                    ((edge as f64 * ratios[c]) as i64 + rng.below(7) as i64 - 3).max(0)
                } else {
                    rng.below(600_000) as i64
                };
                bytes.push(b);
                cats.push(ids[c]);
                outs.push(out);
            }
            let singles: Vec<i64> = (0..bytes.len())
                .map(|i| {
                    let req = Request::new(bytes[i], Some(cats[i] as usize), outs[i]).expect("req");
                    one.route(req).pool.map_or(-1, |p| p as i64)
                })
                .collect();
            assert_eq!(many.route_arrays(&bytes, &cats, &outs), Ok(singles));
            for p in 0..pools.len() {
                assert_eq!(one.in_flight(p), many.in_flight(p));
            }
        }
    }

    #[test]
    fn step_path_refuses_a_bad_entry_as_the_check_does_and_counts_nothing() {
        let (r, ids) = calibrated(&[("short", 8192, None, None), ("long", 65536, None, None)]);
        let p = ids[0];
        let max = MAX_PROMPT_BYTES as i64;
        let big = MAX_TOKENS as i64;
        for (bytes, cats, outs, what) in [
            (vec![1, -1], vec![p, p], vec![1, 1], "prompt_bytes"),
            (vec![1, max + 1], vec![p, p], vec![1, 1], "prompt_bytes"),
            (vec![1, i64::MIN], vec![p, p], vec![1, 1], "prompt_bytes"),
            (vec![1, 1], vec![p, 3], vec![1, 1], "category id 3"),
            (vec![1, 1], vec![p, -1], vec![1, 1], "category id -1"),
            (vec![1, 1], vec![p, i64::MIN], vec![1, 1], "category id"),
            (vec![1, 1], vec![p, p], vec![1, 0], "max_output_tokens"),
            (
                vec![1, 1],
                vec![p, p],
                vec![1, big + 1],
                "max_output_tokens",
            ),
            (
                vec![1, 1],
                vec![p, p],
                vec![1, i64::MIN],
                "max_output_tokens",
            ),
        ] {
            let err = r.route_arrays(&bytes, &cats, &outs).expect_err(what);
            assert!(err.to_string().contains(what), "{err}");
        }
        assert_eq!((r.in_flight(0), r.in_flight(1)), (Ok(0), Ok(0)));
        // The largest values in range are routed (rejected: too long).
        assert_eq!(
            r.route_arrays(&[max, 0], &[p, p], &[big, 1]),
            Ok(vec![-1, 0])
        );
        assert_eq!((r.in_flight(0), r.in_flight(1)), (Ok(1), Ok(0)));
    }

    #[test]
    fn exact_ceiling_of_the_step_path() {
        // ceil_small is the ceiling estimate() takes, also where x is an
        // integer, just above or below one, and at the largest prompt.
        let mut rng = crate::rng::Rng::new(3);
        let mut xs = vec![0.0, 0.25, 0.5, 1.0, 1.5, 2.5, (1u64 << 51) as f64];
        for _ in 0..100_000 {
            let b = rng.below(MAX_PROMPT_BYTES + 1);
            let ratio = 0.5 + rng.uniform() * 31.5;
            xs.push(b as f64 / ratio);
            let x = (b >> rng.below(40)) as f64;
            xs.extend([
                x,
                f64::from_bits(x.to_bits() + 1),
                f64::from_bits(x.to_bits().saturating_sub(1)),
            ]);
        }
        for x in xs {
            assert_eq!(ceil_small(x), x.ceil(), "{x}");
        }
        for v in [0, 1, 3, 1 << 30, 1 << 40, (1 << 52) - 1] {
            assert_eq!(small_f64(v), v as f64);
        }
    }

    /// `cargo test --release -- --ignored --nocapture route_arrays_timing`
    #[test]
    #[ignore]
    fn route_arrays_timing() {
        let (r, ids) = calibrated(&[("short", 8192, None, None), ("long", 65536, None, None)]);
        let mut rng = crate::rng::Rng::new(0);
        let n = 1_000_000;
        let bytes: Vec<i64> = (0..n).map(|_| 100 + rng.below(59_900) as i64).collect();
        let cats: Vec<i64> = (0..n).map(|_| ids[rng.below(3) as usize]).collect();
        let outs: Vec<i64> = (0..n)
            .map(|_| [256, 1024, 4096][rng.below(3) as usize])
            .collect();
        let mut best = f64::INFINITY;
        for _ in 0..50 {
            let start = std::time::Instant::now();
            let out = r.route_arrays(&bytes, &cats, &outs).expect("routed");
            best = best.min(start.elapsed().as_secs_f64());
            assert_eq!(out.len(), n);
        }
        println!(
            "route_arrays, 1M requests: {:.2} ms (min of 50)",
            best * 1e3
        );
    }

    #[test]
    fn invalid_construction() {
        assert!(Pool::new("x", 0, None, None).is_err());
        assert!(Pool::new("x", 100, Some(200), None).is_err());
        assert!(Pool::new("", 100, None, None).is_err());
        assert!(Pool::new("x", 100, None, Some(-1)).is_err());
        assert!(Request::new(-1, None, 10).is_err());
        assert!(Request::new(10, None, 0).is_err());
        let p = Pool::new("x", 100, None, None).expect("pool");
        let cal = Arc::new(RwLock::new(
            Calibrator::new(0.95, 1.0, 4.0, 4).expect("cal"),
        ));
        assert!(TokenBudgetRouter::new(vec![p.clone(), p], cal.clone()).is_err());
        assert!(TokenBudgetRouter::new(vec![], cal).is_err());
    }

    #[test]
    fn compress_band_sends_borderline_requests_short() {
        let r = router(&[("short", 8192, None, None), ("long", 65536, None, None)])
            .with_compress_band(1.5)
            .expect("band");
        // 10,000 prompt + 500 out = 10,500 in (8192, 12288]: compress to 8192 - 500.
        let d = r.route_with(10_000, 500, true);
        assert_eq!(
            (d.pool, d.action, d.reason, d.compress_target_tokens),
            (Some(0), Action::Compress, Reason::Compress, Some(7692))
        );
        assert_eq!(d.est_total_tokens, 10_500);
        // Not compressible (code), above the band, or below the budget: plain routing.
        assert_eq!(r.route_with(10_000, 500, false).pool, Some(1));
        assert_eq!(r.route_with(11_789, 500, true).pool, Some(1));
        assert_eq!(r.route_with(11_788, 500, true).action, Action::Compress);
        let d = r.route_with(7_000, 500, true);
        assert_eq!((d.pool, d.action), (Some(0), Action::Route));
        // Output alone over the budget: no target.
        assert_eq!(r.route_with(100, 8192, true).action, Action::Route);
        assert_eq!(r.in_flight(0).expect("pool"), 3);
        // An overloaded short pool takes no compressed request.
        let r = router(&[("short", 8192, None, Some(0)), ("long", 65536, None, None)])
            .with_compress_band(2.0)
            .expect("band");
        r.set_in_flight(0, 1).expect("pool");
        assert_eq!(r.route_with(10_000, 500, true).action, Action::Route);
        // Too long for every window, yet within the band of the largest budget.
        let r = router(&[("only", 8192, None, None)])
            .with_compress_band(1.5)
            .expect("band");
        let d = r.route_with(9_000, 100, true);
        assert_eq!((d.pool, d.compress_target_tokens), (Some(0), Some(8092)));
        assert_eq!(r.route_with(20_000, 100, true).action, Action::Reject);
        for bad in [0.5, f64::NAN, f64::INFINITY] {
            assert!(router(&[("x", 10, None, None)])
                .with_compress_band(bad)
                .is_err());
        }
    }

    #[test]
    fn code_category_is_never_compressed() {
        let r = router(&[("short", 8192, None, None), ("long", 65536, None, None)])
            .with_compress_band(1.5)
            .expect("band");
        let code = r.write_calibrator().intern("code").expect("id");
        let prose = r.write_calibrator().intern("prose").expect("id");
        let reqs = [
            Request::new(40_000, Some(code), 500).expect("request"),
            Request::new(40_000, Some(prose), 500).expect("request"),
            Request::new(40_000, None, 500).expect("request"),
        ];
        assert_eq!(r.route_many(&reqs), vec![1, 0, 0]);
        assert_eq!(r.route(reqs[0]).action, Action::Route);
        assert_eq!(r.route(reqs[1]).action, Action::Compress);
    }
}
