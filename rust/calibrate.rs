//! Self-calibrating bytes-per-token estimation (Chen et al. 2026, "Token-Budget-
//! Aware Pool Routing", section 2.1, Eq. 3-5 and Algorithm 1 `OnResponse`).
//!
//! Per traffic category k the calibrator keeps an EMA `c_hat` of the observed
//! bytes per token `c_obs = prompt_bytes / usage.prompt_tokens` and an EMA
//! `sigma_hat` of the absolute deviation `|c_obs - c_hat|`:
//!
//! ```text
//! c_hat     <- c_hat     + w * (c_obs - c_hat)
//! sigma_hat <- sigma_hat + w * (|c_obs - c_hat| - sigma_hat)      (c_hat already updated)
//! w = max(1/n, 1 - beta)                                          (n-th observation)
//! ```
//!
//! With `w = 1 - beta` this is the paper's Eq. 4. For the first `1/(1-beta)`
//! observations (20 at beta = 0.95) the weight is `1/n`, the bias-corrected
//! start: a plain EMA from the cold start c0 = 4.0 would still carry
//! `beta^50 = 7.7%` of the cold-start error after 50 CJK observations (7.5%
//! relative error for a true 2.01), where the paper reports 3.5%.
//!
//! Routing uses the conservative ratio of Eq. 5, `c_hat - gamma * sigma_hat`,
//! never below [`MIN_RATIO`]: a smaller ratio means more estimated tokens, the
//! safe direction (a short request sent long wastes a little throughput; a long
//! request sent short is preempted or rejected).

use std::collections::HashMap;

use crate::error::{finite, invalid, non_negative, unknown, Result};
use crate::snapshot::{Reader, Writer};

/// The smallest bytes-per-token ratio accepted from feedback, and the floor of
/// the conservative ratio. Byte-level BPE tokens hold at least one byte; chat
/// templates add tokens that have no bytes in the request, so very short chat
/// prompts can come out a little below 1, but below 0.5 the feedback does not
/// belong to the request it was reported for.
pub const MIN_RATIO: f64 = 0.5;
/// The largest bytes-per-token ratio accepted from feedback. Real tokenizers
/// stay under about 8 bytes per token even on repetitive English; 32 leaves room
/// for long whitespace runs while refusing nonsense.
pub const MAX_RATIO: f64 = 32.0;
/// Default EMA decay `beta` (the paper's 0.95; see `Calibrator::new`).
pub const DEFAULT_BETA: f64 = 0.95;
/// Default number of deviations `gamma` the conservative ratio subtracts.
pub const DEFAULT_GAMMA: f64 = 1.0;
/// Default ratio of a category with no feedback yet (English prose).
pub const DEFAULT_COLD_START: f64 = 4.0;
/// Default bound on distinct categories (see `Calibrator::new`).
pub const DEFAULT_MAX_CATEGORIES: usize = 1024;
/// The longest category name accepted, in bytes.
pub const MAX_CATEGORY_NAME_BYTES: usize = 128;
/// Largest prompt size, in bytes, the calibrator and routers accept (1 TiB):
/// larger values are taken as corrupt input, not as a request.
pub const MAX_PROMPT_BYTES: u64 = 1 << 40;

/// What the calibrator knows about one category.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CategoryStats {
    /// `c_hat`, the EMA of observed bytes per token.
    pub ratio: f64,
    /// `sigma_hat`, the EMA of the absolute deviation from `c_hat`.
    pub sigma: f64,
    /// Number of observations folded in.
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Calibrator {
    beta: f64,
    gamma: f64,
    cold_start: f64,
    max_categories: usize,
    names: Vec<String>,
    ids: HashMap<String, usize>,
    stats: Vec<CategoryStats>,
}

fn check_ratio(what: &str, x: f64) -> Result<f64> {
    let x = finite(what, x)?;
    if !(MIN_RATIO..=MAX_RATIO).contains(&x) {
        return Err(invalid(format!(
            "{what} must be within [{MIN_RATIO}, {MAX_RATIO}] bytes per token, got {x}"
        )));
    }
    Ok(x)
}

impl Calibrator {
    /// `beta` in [0, 1): EMA decay (0.95 in the paper). `gamma` >= 0: how many
    /// deviations the conservative ratio subtracts (1.0). `cold_start`: the ratio
    /// of a category with no feedback yet (4.0, English prose). At most
    /// `max_categories` distinct names are learned; feedback for a new name
    /// beyond that is refused, so a flood of names cannot grow memory.
    pub fn new(beta: f64, gamma: f64, cold_start: f64, max_categories: usize) -> Result<Self> {
        let beta = non_negative("beta", beta)?;
        if beta >= 1.0 {
            return Err(invalid(format!("beta must be in [0, 1), got {beta}")));
        }
        let gamma = non_negative("gamma", gamma)?;
        let cold_start = check_ratio("cold_start", cold_start)?;
        if max_categories == 0 {
            return Err(invalid("max_categories must be >= 1"));
        }
        Ok(Self {
            beta,
            gamma,
            cold_start,
            max_categories,
            names: Vec::new(),
            ids: HashMap::new(),
            stats: Vec::new(),
        })
    }

    /// A calibrator with the defaults: [`DEFAULT_BETA`], [`DEFAULT_GAMMA`],
    /// [`DEFAULT_COLD_START`], [`DEFAULT_MAX_CATEGORIES`].
    pub fn with_defaults() -> Self {
        Self {
            beta: DEFAULT_BETA,
            gamma: DEFAULT_GAMMA,
            cold_start: DEFAULT_COLD_START,
            max_categories: DEFAULT_MAX_CATEGORIES,
            names: Vec::new(),
            ids: HashMap::new(),
            stats: Vec::new(),
        }
    }

    pub fn beta(&self) -> f64 {
        self.beta
    }
    pub fn gamma(&self) -> f64 {
        self.gamma
    }
    pub fn cold_start(&self) -> f64 {
        self.cold_start
    }
    pub fn max_categories(&self) -> usize {
        self.max_categories
    }
    /// Names of the categories learned so far, in id order.
    pub fn categories(&self) -> &[String] {
        &self.names
    }

    /// The dense id of a known category.
    pub fn id(&self, name: &str) -> Option<usize> {
        self.ids.get(name).copied()
    }

    /// The id of `name`, registering it (with cold-start stats) if new.
    pub fn intern(&mut self, name: &str) -> Result<usize> {
        if let Some(id) = self.id(name) {
            return Ok(id);
        }
        if name.is_empty() || name.len() > MAX_CATEGORY_NAME_BYTES {
            return Err(invalid(format!(
                "category name must be 1 to {MAX_CATEGORY_NAME_BYTES} bytes, got {} bytes",
                name.len()
            )));
        }
        if self.names.len() >= self.max_categories {
            return Err(invalid(format!(
                "category limit reached ({} categories); raise max_categories or reuse names",
                self.max_categories
            )));
        }
        let id = self.names.len();
        self.names.push(name.to_owned());
        self.ids.insert(name.to_owned(), id);
        self.stats.push(CategoryStats {
            ratio: self.cold_start,
            sigma: 0.0,
            count: 0,
        });
        Ok(id)
    }

    /// Stats of a category id; `None` for an id never handed out.
    pub fn stats_id(&self, id: usize) -> Option<CategoryStats> {
        self.stats.get(id).copied()
    }

    /// Stats of a category by name; an unseen name has the cold-start stats.
    pub fn stats(&self, name: &str) -> CategoryStats {
        self.id(name)
            .and_then(|id| self.stats_id(id))
            .unwrap_or(CategoryStats {
                ratio: self.cold_start,
                sigma: 0.0,
                count: 0,
            })
    }

    fn conservative(&self, s: CategoryStats) -> f64 {
        (s.ratio - self.gamma * s.sigma).max(MIN_RATIO)
    }

    /// `c_hat - gamma * sigma_hat`, never below [`MIN_RATIO`].
    pub fn conservative_ratio(&self, name: &str) -> f64 {
        self.conservative(self.stats(name))
    }

    /// Conservative ratio for an id; unknown ids (`None`) use the cold start.
    pub fn conservative_ratio_id(&self, id: Option<usize>) -> f64 {
        match id.and_then(|i| self.stats_id(i)) {
            Some(s) => self.conservative(s),
            None => self.cold_start.max(MIN_RATIO),
        }
    }

    /// `ceil(prompt_bytes / conservative_ratio)` (Eq. 3, the L_in term).
    pub fn estimate_tokens_id(&self, prompt_bytes: u64, id: Option<usize>) -> u64 {
        estimate(prompt_bytes, self.conservative_ratio_id(id))
    }

    pub fn estimate_tokens(&self, prompt_bytes: u64, name: &str) -> u64 {
        self.estimate_tokens_id(prompt_bytes, self.id(name))
    }

    /// Checks one piece of feedback; returns its ratio `c_obs`.
    pub fn check_observation(prompt_bytes: i64, prompt_tokens: i64) -> Result<f64> {
        if prompt_bytes <= 0 || prompt_bytes as u64 > MAX_PROMPT_BYTES {
            return Err(invalid(format!(
                "prompt_bytes must be in [1, {MAX_PROMPT_BYTES}], got {prompt_bytes}"
            )));
        }
        if prompt_tokens <= 0 {
            return Err(invalid(format!(
                "prompt_tokens must be >= 1, got {prompt_tokens}"
            )));
        }
        check_ratio(
            "observed ratio prompt_bytes / prompt_tokens",
            prompt_bytes as f64 / prompt_tokens as f64,
        )
    }

    /// Folds one response's `usage.prompt_tokens` into the category's EMA
    /// (Algorithm 1, `OnResponse`). Refused feedback changes nothing.
    pub fn observe(&mut self, name: &str, prompt_bytes: i64, prompt_tokens: i64) -> Result<()> {
        let c_obs = Self::check_observation(prompt_bytes, prompt_tokens)?;
        let id = self.intern(name)?;
        self.observe_ratio_id(id, c_obs)
    }

    /// Folds an already checked ratio into a known category id.
    pub fn observe_ratio_id(&mut self, id: usize, c_obs: f64) -> Result<()> {
        let c_obs = check_ratio("observed ratio", c_obs)?;
        let beta = self.beta;
        let s = self
            .stats
            .get_mut(id)
            .ok_or_else(|| unknown("category id", id.to_string()))?;
        s.count += 1;
        let w = (1.0 / s.count as f64).max(1.0 - beta);
        s.ratio += w * (c_obs - s.ratio);
        s.sigma += w * ((c_obs - s.ratio).abs() - s.sigma);
        Ok(())
    }

    const MAGIC: &'static [u8; 4] = b"RCCA";
    const VERSION: u16 = 1;

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(Self::MAGIC, Self::VERSION);
        w.f64(self.beta)
            .f64(self.gamma)
            .f64(self.cold_start)
            .u64(self.max_categories as u64)
            .u64(self.names.len() as u64);
        for (name, s) in self.names.iter().zip(&self.stats) {
            w.str(name).f64(s.ratio).f64(s.sigma).u64(s.count);
        }
        w.finish()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::MAGIC, Self::VERSION, "Calibrator")?;
        let (beta, gamma, cold_start) = (r.f64()?, r.f64()?, r.f64()?);
        let max_categories = usize::try_from(r.u64()?).map_err(|_| invalid("max_categories"))?;
        let mut cal = Self::new(beta, gamma, cold_start, max_categories)?;
        let n = r.count(4 + 24)?;
        for _ in 0..n {
            let name = r.str()?;
            let (ratio, sigma, count) = (r.f64()?, r.f64()?, r.u64()?);
            let id = cal.intern(&name)?;
            if id + 1 != cal.names.len() {
                return Err(invalid(format!("duplicate category {name:?} in snapshot")));
            }
            // A restored ratio is either the cold start or an EMA of checked observations.
            check_ratio("snapshot ratio", ratio)?;
            non_negative("snapshot sigma", sigma)?;
            cal.stats[id] = CategoryStats {
                ratio,
                sigma,
                count,
            };
        }
        r.finish()?;
        Ok(cal)
    }
}

/// `ceil(bytes / ratio)`; `ratio` > 0. Rounded up by comparing with the
/// truncation, which compiles to two instructions where `f64::ceil` is a libm
/// call on baseline x86-64.
pub fn estimate(prompt_bytes: u64, ratio: f64) -> u64 {
    let x = prompt_bytes as f64 / ratio;
    let t = x as u64;
    if (t as f64) < x {
        t + 1
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cal() -> Calibrator {
        Calibrator::new(0.95, 1.0, 4.0, 8).expect("valid")
    }

    #[test]
    fn the_defaults_are_a_valid_calibrator() {
        let checked = Calibrator::new(
            DEFAULT_BETA,
            DEFAULT_GAMMA,
            DEFAULT_COLD_START,
            DEFAULT_MAX_CATEGORIES,
        );
        assert_eq!(checked, Ok(Calibrator::with_defaults()));
    }

    #[test]
    fn cold_start_and_estimate() {
        let c = cal();
        assert_eq!(c.conservative_ratio("prose"), 4.0);
        assert_eq!(c.estimate_tokens(4001, "prose"), 1001);
        assert_eq!(c.estimate_tokens(0, "prose"), 0);
    }

    #[test]
    fn estimate_rounds_up_like_ceil() {
        let mut r = crate::rng::Rng::new(3);
        for _ in 0..100_000 {
            let bytes = r.below(1 << 40);
            let ratio = MIN_RATIO + r.uniform() * (MAX_RATIO - MIN_RATIO);
            assert_eq!(estimate(bytes, ratio), (bytes as f64 / ratio).ceil() as u64);
        }
        assert_eq!(
            (estimate(8, 4.0), estimate(9, 4.0), estimate(0, 4.0)),
            (2, 3, 0)
        );
    }

    #[test]
    fn ema_by_hand() {
        let mut c = cal();
        c.observe("code", 300, 100).expect("ok"); // n=1: w=1 -> ratio 3, sigma 0
        let s = c.stats("code");
        assert_eq!((s.ratio, s.sigma, s.count), (3.0, 0.0, 1));
        c.observe("code", 400, 100).expect("ok"); // n=2: w=1/2 -> 3.5, sigma 0.25
        let s = c.stats("code");
        assert!((s.ratio - 3.5).abs() < 1e-12 && (s.sigma - 0.25).abs() < 1e-12);
        assert!((c.conservative_ratio("code") - 3.25).abs() < 1e-12);
        // After 20 observations the weight is 1 - beta = 0.05 (the paper's EMA).
        for _ in 2..20 {
            c.observe("code", 350, 100).expect("ok");
        }
        let before = c.stats("code");
        c.observe("code", 450, 100).expect("ok");
        let after = c.stats("code");
        assert!((after.ratio - (0.95 * before.ratio + 0.05 * 4.5)).abs() < 1e-12);
    }

    #[test]
    fn bad_feedback_changes_nothing() {
        let mut c = cal();
        c.observe("prose", 450, 100).expect("ok");
        let before = c.clone();
        for (b, t) in [(0, 10), (-5, 10), (10, 0), (10, -1), (1000, 1), (1, 100)] {
            assert!(c.observe("prose", b, t).is_err(), "{b}/{t}");
        }
        assert!(c.observe("", 400, 100).is_err());
        assert_eq!(c, before);
    }

    #[test]
    fn categories_are_bounded() {
        let mut c = Calibrator::new(0.95, 1.0, 4.0, 2).expect("valid");
        c.observe("a", 400, 100).expect("ok");
        c.observe("b", 400, 100).expect("ok");
        let before = c.clone();
        assert!(c.observe("c", 400, 100).is_err());
        assert_eq!(c, before);
        // Unknown names still estimate with the cold start, without allocating.
        assert_eq!(c.estimate_tokens(400, "c"), 100);
        assert_eq!(c.categories().len(), 2);
    }

    #[test]
    fn conservative_floor() {
        let mut c = Calibrator::new(0.95, 100.0, 4.0, 8).expect("valid");
        c.observe("x", 100, 100).expect("ok");
        c.observe("x", 3000, 100).expect("ok");
        assert_eq!(c.conservative_ratio("x"), MIN_RATIO);
    }

    #[test]
    fn snapshot_round_trip() {
        let mut c = cal();
        c.observe("prose", 449, 100).expect("ok");
        c.observe("cjk", 201, 100).expect("ok");
        c.observe("cjk", 207, 100).expect("ok");
        let bytes = c.to_bytes();
        let back = Calibrator::from_bytes(&bytes).expect("round trip");
        assert_eq!(back, c);
        assert_eq!(back.to_bytes(), bytes);
        assert!(Calibrator::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(Calibrator::from_bytes(&extra).is_err());
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(Calibrator::new(1.0, 1.0, 4.0, 8).is_err());
        assert!(Calibrator::new(f64::NAN, 1.0, 4.0, 8).is_err());
        assert!(Calibrator::new(0.9, -1.0, 4.0, 8).is_err());
        assert!(Calibrator::new(0.9, 1.0, 0.0, 8).is_err());
        assert!(Calibrator::new(0.9, 1.0, 4.0, 0).is_err());
    }
}
