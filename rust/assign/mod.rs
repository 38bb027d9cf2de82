//! Batched model and endpoint assignment (RouteBalance, section 4).
//!
//! For each batch of waiting requests the scheduler assigns every request to a
//! concrete model endpoint, trading quality, latency and cost:
//!
//! 1. LPT order: requests are taken longest predicted output first (Graham's
//!    rule); the key is the max (or mean, or min) over models of the predicted
//!    output length, since the model is not chosen yet. Equal keys keep the
//!    batch order.
//! 2. Budget filter (the paper's Eq. 2): when a request carries a budget, the
//!    endpoints whose predicted cost `(in_tokens * price_in + out_len *
//!    price_out) / 1e6` exceeds it are dropped. If none is left the request gets
//!    -1 (`BudgetFallback::Reject`, the default) or the cheapest endpoint
//!    overall (`BudgetFallback::Cheapest`, relying on the dispatch-time
//!    `max_tokens` clamp to hold the budget).
//! 3. Score (Eq. 1), over the candidates that are left:
//!    `w_q * quality + w_l * (1 - latency / max latency) + w_c * (1 - cost /
//!    max cost)`, the maxima taken over the request's candidates (a term whose
//!    maximum is 0 counts 1). Latency is `prefill + wait + out_len * tpot`
//!    where `prefill = in_tokens * prefill_s_per_token` and `wait = (pending /
//!    max(batch, 1)) * tpot` only when the endpoint has no free decode slot
//!    (`batch >= max_batch`).
//! 4. The best score wins; ties (within 1e-12) go to the endpoint with the
//!    smaller batch, then to the one assigned least recently (never assigned
//!    counts oldest), then to the lower index.
//! 5. Dead reckoning: the chosen endpoint's local state is updated (`pending +=
//!    out_len`, `batch += 1`) before the next request is scored, so a batch
//!    does not herd onto the endpoint that looked idle when it formed.
//!
//! The scheduler's only own state is the recency order used by the tie-break;
//! it is carried across calls, so assigning a batch equals assigning its
//! requests one by one in LPT order with the endpoint state carried forward.

pub mod eval;
pub mod knn;

use std::sync::{Mutex, MutexGuard};

use crate::error::{invalid, non_negative, positive, unknown, Result};
use crate::snapshot::{Reader, Writer};

/// Most endpoints a scheduler may hold.
pub const MAX_ENDPOINTS: usize = 65_536;
/// Largest `max_batch` an endpoint may declare.
pub const MAX_BATCH: i64 = 1 << 20;
/// Scores closer than this are ties.
const TIE_EPS: f64 = 1e-12;
/// Default prefill time per prompt token as a fraction of one decode step:
/// a decode step is memory-bound, and about 200 prompt tokens of prefill cost
/// the same GPU time on the paper's tiers (an estimate; pass your own).
pub const DEFAULT_PREFILL_TOKENS_PER_STEP: f64 = 200.0;

/// One serving endpoint of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    pub name: String,
    pub model: String,
    /// Seconds per output token (decode step time).
    pub tpot_s: f64,
    /// USD per million input tokens.
    pub price_in_per_mtok: f64,
    /// USD per million output tokens.
    pub price_out_per_mtok: f64,
    /// Decode slots: the largest batch the endpoint runs at once.
    pub max_batch: u64,
    /// Seconds of prefill per prompt token.
    pub prefill_s_per_token: f64,
}

impl Endpoint {
    pub fn new(
        name: &str,
        model: &str,
        tpot_s: f64,
        price_in_per_mtok: f64,
        price_out_per_mtok: f64,
        max_batch: i64,
        prefill_s_per_token: Option<f64>,
    ) -> Result<Self> {
        if name.is_empty() || name.len() > 256 || model.is_empty() || model.len() > 256 {
            return Err(invalid("endpoint name and model must be 1 to 256 bytes"));
        }
        let tpot_s = positive("tpot_s", tpot_s)?;
        if !(1..=MAX_BATCH).contains(&max_batch) {
            return Err(invalid(format!(
                "max_batch must be in [1, {MAX_BATCH}], got {max_batch}"
            )));
        }
        let prefill_s_per_token = match prefill_s_per_token {
            Some(p) => non_negative("prefill_s_per_token", p)?,
            None => tpot_s / DEFAULT_PREFILL_TOKENS_PER_STEP,
        };
        Ok(Self {
            name: name.to_owned(),
            model: model.to_owned(),
            tpot_s,
            price_in_per_mtok: non_negative("price_in_per_mtok", price_in_per_mtok)?,
            price_out_per_mtok: non_negative("price_out_per_mtok", price_out_per_mtok)?,
            max_batch: max_batch as u64,
            prefill_s_per_token,
        })
    }

    /// Predicted serving cost in USD of `in_tokens` in and `out_len` out.
    pub fn cost(&self, in_tokens: f64, out_len: f64) -> f64 {
        self.cost_micro_usd(in_tokens, out_len) / 1e6
    }

    /// The cost in micro-USD (no division on the hot path).
    fn cost_micro_usd(&self, in_tokens: f64, out_len: f64) -> f64 {
        in_tokens * self.price_in_per_mtok + out_len * self.price_out_per_mtok
    }

    /// Seconds a new request waits for a decode slot: `pending / max(batch,
    /// 1) * tpot` when no slot is free (`batch >= max_batch`), else 0.
    pub fn wait(&self, pending: f64, batch: u64) -> f64 {
        if batch >= self.max_batch {
            pending / batch.max(1) as f64 * self.tpot_s
        } else {
            0.0
        }
    }

    /// Predicted end-to-end latency in seconds on this endpoint given its
    /// pending decode tokens and current batch size.
    pub fn latency(&self, in_tokens: f64, out_len: f64, pending: f64, batch: u64) -> f64 {
        self.service_s(in_tokens, out_len) + self.wait(pending, batch)
    }

    /// Prefill plus own decode, without waiting.
    fn service_s(&self, in_tokens: f64, out_len: f64) -> f64 {
        in_tokens * self.prefill_s_per_token + out_len * self.tpot_s
    }
}

/// The named operating points on the weight simplex, (quality, latency, cost).
pub const PRESETS: [(&str, [f64; 3]); 4] = [
    ("quality", [0.8, 0.1, 0.1]),
    ("latency", [0.1, 0.8, 0.1]),
    ("cost", [0.1, 0.1, 0.8]),
    ("balanced", [1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0]),
];

/// Weights on the 3-simplex: non-negative, normalised to sum 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub quality: f64,
    pub latency: f64,
    pub cost: f64,
}

impl Weights {
    pub fn new(quality: f64, latency: f64, cost: f64) -> Result<Self> {
        let q = non_negative("quality weight", quality)?;
        let l = non_negative("latency weight", latency)?;
        let c = non_negative("cost weight", cost)?;
        let sum = q + l + c;
        if !(sum > 0.0 && sum.is_finite()) {
            return Err(invalid("weights must not all be zero"));
        }
        Ok(Self {
            quality: q / sum,
            latency: l / sum,
            cost: c / sum,
        })
    }

    pub fn preset(name: &str) -> Result<Self> {
        let (_, [q, l, c]) = PRESETS
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| unknown("preset", name))?;
        Self::new(*q, *l, *c)
    }
}

/// Which per-model output length orders the batch (LPT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LptKey {
    Max,
    Mean,
    Min,
}

impl LptKey {
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "max" => Ok(Self::Max),
            "mean" => Ok(Self::Mean),
            "min" => Ok(Self::Min),
            _ => Err(invalid(format!(
                "lpt_key must be \"max\", \"mean\" or \"min\", got {name:?}"
            ))),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Max => "max",
            Self::Mean => "mean",
            Self::Min => "min",
        }
    }
    fn key(self, lens: &[f64]) -> f64 {
        match self {
            Self::Max => lens.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            Self::Min => lens.iter().copied().fold(f64::INFINITY, f64::min),
            Self::Mean => lens.iter().sum::<f64>() / lens.len().max(1) as f64,
        }
    }
}

/// What a request whose budget no endpoint fits gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetFallback {
    /// -1: not assigned.
    Reject,
    /// The cheapest endpoint overall.
    Cheapest,
}

impl BudgetFallback {
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "reject" => Ok(Self::Reject),
            "cheapest" => Ok(Self::Cheapest),
            _ => Err(invalid(format!(
                "budget_fallback must be \"reject\" or \"cheapest\", got {name:?}"
            ))),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Cheapest => "cheapest",
        }
    }
}

/// A batch of requests: row-major `[B, M]` predictions, `[B]` prompt lengths
/// and optional `[B]` budgets in USD (`+inf` means none).
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub quality: &'a [f64],
    pub out_len: &'a [f64],
    pub in_tokens: &'a [u64],
    pub budget: Option<&'a [f64]>,
}

/// Endpoint state as seen by the scheduler: pending decode tokens and current
/// decode batch size per endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub pending: Vec<f64>,
    pub batch: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
struct Recency {
    clock: u64,
    last: Vec<u64>,
}

/// The RouteBalance scheduler over a fixed endpoint set.
#[derive(Debug)]
pub struct BatchScheduler {
    endpoints: Vec<Endpoint>,
    models: Vec<String>,
    model_of: Vec<usize>,
    /// Endpoints that predict alike (same model, speeds and prices) share a
    /// class: cost and service time are computed once per class per request.
    classes: Vec<Class>,
    class_of: Vec<usize>,
    weights: Weights,
    lpt_key: LptKey,
    fallback: BudgetFallback,
    recency: Mutex<Recency>,
}

const MAGIC: &[u8; 4] = b"RCBS";
const VERSION: u16 = 1;

impl BatchScheduler {
    pub fn new(
        endpoints: Vec<Endpoint>,
        weights: Weights,
        lpt_key: LptKey,
        fallback: BudgetFallback,
    ) -> Result<Self> {
        if endpoints.is_empty() || endpoints.len() > MAX_ENDPOINTS {
            return Err(invalid(format!(
                "a scheduler needs 1 to {MAX_ENDPOINTS} endpoints, got {}",
                endpoints.len()
            )));
        }
        let mut models: Vec<String> = Vec::new();
        let mut model_of = Vec::with_capacity(endpoints.len());
        for (i, inst) in endpoints.iter().enumerate() {
            if endpoints[..i].iter().any(|o| o.name == inst.name) {
                return Err(invalid(format!("duplicate endpoint name {:?}", inst.name)));
            }
            let m = match models.iter().position(|m| *m == inst.model) {
                Some(m) => m,
                None => {
                    models.push(inst.model.clone());
                    models.len() - 1
                }
            };
            model_of.push(m);
        }
        let mut classes: Vec<Class> = Vec::new();
        let mut class_of = Vec::with_capacity(endpoints.len());
        for (inst, &model) in endpoints.iter().zip(&model_of) {
            let class = Class::of(inst, model);
            let c = match classes.iter().position(|k| *k == class) {
                Some(c) => c,
                None => {
                    classes.push(class);
                    classes.len() - 1
                }
            };
            class_of.push(c);
        }
        let n = endpoints.len();
        Ok(Self {
            endpoints,
            models,
            model_of,
            classes,
            class_of,
            weights,
            lpt_key,
            fallback,
            recency: Mutex::new(Recency {
                clock: 0,
                last: vec![0; n],
            }),
        })
    }

    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }
    /// Distinct models in order of first appearance: the columns of `quality`
    /// and `out_len`.
    pub fn models(&self) -> &[String] {
        &self.models
    }
    /// The model column of each endpoint.
    pub fn model_of(&self) -> &[usize] {
        &self.model_of
    }
    pub fn weights(&self) -> Weights {
        self.weights
    }
    pub fn lpt_key(&self) -> LptKey {
        self.lpt_key
    }
    pub fn budget_fallback(&self) -> BudgetFallback {
        self.fallback
    }

    fn lock(&self) -> MutexGuard<'_, Recency> {
        self.recency.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The batch's LPT order: indices by descending key, equal keys in batch order.
    pub fn lpt_order(&self, out_len: &[f64]) -> Vec<usize> {
        let m = self.models.len();
        // descending key as an order-preserving integer, then the index, in
        // one u128: an unstable sort of distinct integers gives the stable order
        let mut keyed: Vec<u128> = out_len
            .chunks_exact(m)
            .enumerate()
            .map(|(i, r)| (u128::from(!ordered_bits(self.lpt_key.key(r))) << 64) | i as u128)
            .collect();
        keyed.sort_unstable();
        keyed.into_iter().map(|k| k as u64 as usize).collect()
    }

    fn check(&self, batch: &Batch<'_>, load: &Load) -> Result<usize> {
        let m = self.models.len();
        let b = batch.in_tokens.len();
        if batch.quality.len() != b * m || batch.out_len.len() != b * m {
            return Err(invalid(format!(
                "quality and out_len must be [{b}, {m}] (batch x models)"
            )));
        }
        if batch.budget.is_some_and(|x| x.len() != b) {
            return Err(invalid(format!("budget must have {b} entries")));
        }
        let n = self.endpoints.len();
        if load.pending.len() != n || load.batch.len() != n {
            return Err(invalid(format!(
                "pending_decode and batch_size must have one entry per endpoint ({n})"
            )));
        }
        for &q in batch.quality {
            crate::error::finite("quality", q)?;
        }
        for &l in batch.out_len.iter().chain(&load.pending) {
            non_negative("out_len and pending_decode", l)?;
        }
        if let Some(budget) = batch.budget {
            for &x in budget {
                if x.is_nan() || x < 0.0 {
                    return Err(invalid(format!("budget must be >= 0 or inf, got {x}")));
                }
            }
        }
        Ok(b)
    }

    /// Assigns every request of the batch (see the module docs). Returns the
    /// endpoint index per request (batch order), -1 when the budget filter left
    /// none and the fallback is `Reject`. Validates everything first: on error
    /// nothing changes. `load` is the endpoint state the batch starts from.
    pub fn assign(&self, batch: &Batch<'_>, load: &Load) -> Result<Vec<i64>> {
        let b = self.check(batch, load)?;
        let mut load = load.clone();
        let mut recency = self.lock();
        let mut chosen = vec![-1i64; b];
        let mut scratch = Scratch::new(self.classes.len(), &self.endpoints, &load);
        for r in self.lpt_order(batch.out_len) {
            if let Some(i) = self.choose(batch, r, &load, &recency.last, &mut scratch) {
                let m = self.models.len();
                load.pending[i] += batch.out_len[r * m + self.model_of[i]];
                load.batch[i] += 1;
                scratch.wait[i] = self.endpoints[i].wait(load.pending[i], load.batch[i]);
                recency.clock += 1;
                let clock = recency.clock;
                recency.last[i] = clock;
                chosen[r] = i as i64;
            }
        }
        Ok(chosen)
    }

    fn choose(
        &self,
        batch: &Batch<'_>,
        r: usize,
        load: &Load,
        last: &[u64],
        s: &mut Scratch,
    ) -> Option<usize> {
        let m = self.models.len();
        let q = &batch.quality[r * m..(r + 1) * m];
        let len = &batch.out_len[r * m..(r + 1) * m];
        let tokens = batch.in_tokens[r] as f64;
        let budget = batch.budget.map_or(f64::INFINITY, |x| x[r]);
        let (mut max_lat, mut max_cost, mut any) = (0.0f64, 0.0f64, false);
        for (c, k) in self.classes.iter().enumerate() {
            let out = len[k.model];
            s.cost[c] = k.inst.cost_micro_usd(tokens, out);
            s.service[c] = k.inst.service_s(tokens, out);
            s.ok[c] = budget == f64::INFINITY || s.cost[c] / 1e6 <= budget;
            if s.ok[c] {
                max_cost = larger(max_cost, s.cost[c]);
                any = true;
            }
        }
        if !any && self.fallback == BudgetFallback::Reject {
            return None;
        }
        let n = self.endpoints.len();
        let (class_of, lat, wait) = (&self.class_of[..n], &mut s.lat[..n], &s.wait[..n]);
        for i in 0..n {
            let c = class_of[i];
            lat[i] = s.service[c] + wait[i];
            if s.ok[c] {
                max_lat = larger(max_lat, lat[i]);
            }
        }
        // w_q q + w_l (1 - lat / max_lat) + w_c (1 - cost / max_cost) as a
        // per-class part minus a latency slope; without candidates (the
        // `Cheapest` fallback) the value is minus the cost
        let w = &self.weights;
        let (kl, kc) = (slope(w.latency, max_lat), slope(w.cost, max_cost));
        for (c, k) in self.classes.iter().enumerate() {
            s.part[c] = if any {
                w.quality * q[k.model] + w.latency + w.cost - kc * s.cost[c]
            } else {
                -s.cost[c]
            };
        }
        let kl = if any { kl } else { 0.0 };
        let (mut best, mut best_value) = (usize::MAX, f64::NEG_INFINITY);
        for i in 0..n {
            let c = class_of[i];
            if any && !s.ok[c] {
                continue;
            }
            let value = s.part[c] - kl * lat[i];
            // better by more than TIE_EPS, or tied and less busy / less recent
            let wins = best == usize::MAX
                || value > best_value + TIE_EPS
                || (value >= best_value - TIE_EPS
                    && (load.batch[i], last[i]) < (load.batch[best], last[best]));
            if wins {
                (best, best_value) = (i, value);
            }
        }
        Some(best)
    }

    /// A snapshot of the configuration and the recency state.
    pub fn to_bytes(&self) -> Vec<u8> {
        let recency = self.lock();
        let mut w = Writer::new(MAGIC, VERSION);
        w.u64(self.endpoints.len() as u64);
        for inst in &self.endpoints {
            w.str(&inst.name)
                .str(&inst.model)
                .f64(inst.tpot_s)
                .f64(inst.price_in_per_mtok)
                .f64(inst.price_out_per_mtok)
                .u64(inst.max_batch)
                .f64(inst.prefill_s_per_token);
        }
        w.f64(self.weights.quality)
            .f64(self.weights.latency)
            .f64(self.weights.cost)
            .str(self.lpt_key.as_str())
            .str(self.fallback.as_str())
            .u64(recency.clock);
        for &t in &recency.last {
            w.u64(t);
        }
        w.finish()
    }

    /// Restores a snapshot written by `to_bytes`, validating every field.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, MAGIC, VERSION, "BatchScheduler")?;
        let n = r.count(48)?;
        let mut endpoints = Vec::with_capacity(n);
        for _ in 0..n {
            let (name, model) = (r.str()?, r.str()?);
            let (tpot, pin, pout) = (r.f64()?, r.f64()?, r.f64()?);
            let max_batch = i64::try_from(r.u64()?).unwrap_or(i64::MAX);
            let prefill = r.f64()?;
            endpoints.push(Endpoint::new(
                &name,
                &model,
                tpot,
                pin,
                pout,
                max_batch,
                Some(prefill),
            )?);
        }
        let weights = Weights::new(r.f64()?, r.f64()?, r.f64()?)?;
        let lpt_key = LptKey::from_name(&r.str()?)?;
        let fallback = BudgetFallback::from_name(&r.str()?)?;
        let clock = r.u64()?;
        let mut last = Vec::with_capacity(n);
        for _ in 0..n {
            let t = r.u64()?;
            if t > clock {
                return Err(crate::error::Error::Snapshot(
                    "recency beyond the clock".into(),
                ));
            }
            last.push(t);
        }
        r.finish()?;
        let s = Self::new(endpoints, weights, lpt_key, fallback)?;
        *s.lock() = Recency { clock, last };
        Ok(s)
    }
}

/// The larger of two numbers known not to be NaN: one `maxsd`, unlike
/// `f64::max`, whose NaN handling lengthens the scoring loop's critical path.
fn larger(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

/// The bits of `x` as an integer in the same order as `f64::total_cmp`.
fn ordered_bits(x: f64) -> u64 {
    let b = x.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | (1 << 63)
    }
}

/// `w / max`, or 0 when the maximum is 0 (then every term is 0 and counts 1).
fn slope(w: f64, max: f64) -> f64 {
    if max > 0.0 {
        w / max
    } else {
        0.0
    }
}

/// What the score needs of an endpoint besides its load.
#[derive(Debug, Clone, PartialEq)]
struct Class {
    model: usize,
    inst: Endpoint,
}

impl Class {
    fn of(inst: &Endpoint, model: usize) -> Self {
        Self {
            model,
            inst: Endpoint {
                name: String::new(),
                model: String::new(),
                ..inst.clone()
            },
        }
    }
}

/// Working values of one `assign` call.
struct Scratch {
    /// Per class: micro-USD cost, prefill + decode seconds, within budget,
    /// the score's per-class part.
    cost: Vec<f64>,
    service: Vec<f64>,
    ok: Vec<bool>,
    part: Vec<f64>,
    /// Per endpoint: latency, and `Endpoint::wait` under the dead-reckoned load.
    lat: Vec<f64>,
    wait: Vec<f64>,
}

impl Scratch {
    fn new(classes: usize, endpoints: &[Endpoint], load: &Load) -> Self {
        Self {
            cost: vec![0.0; classes],
            service: vec![0.0; classes],
            ok: vec![false; classes],
            part: vec![0.0; classes],
            lat: vec![0.0; endpoints.len()],
            wait: endpoints
                .iter()
                .zip(load.pending.iter().zip(&load.batch))
                .map(|(inst, (&p, &b))| inst.wait(p, b))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests;
