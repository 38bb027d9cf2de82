//! VTC fairness routing: AIBrix's `vtc-basic` (after Sheng et al., "Fairness
//! in Serving Large Language Models", OSDI 2024).
//!
//! Each user's service is a weighted token count over a sliding window:
//! `input_weight * input_tokens + output_weight * output_tokens`, charged with
//! the estimated tokens when a request is routed and corrected by the actual
//! usage when it completes (a correction never takes a count below zero).
//!
//! The window of `window_s` seconds is kept as `WINDOW_BUCKETS` buckets of
//! `window_s / WINDOW_BUCKETS` seconds: a user's count at time `now` is the sum
//! of the buckets of the last `WINDOW_BUCKETS` bucket periods, the current one
//! included, so old buckets expire a period at a time. Users whose window is
//! empty are forgotten; at most `max_users` are held (beyond that the least
//! recently active user is forgotten: the one whose latest charged bucket is
//! the oldest, the smallest name among equals), so memory is bounded. Users
//! are kept ordered by (latest bucket, name), so forgetting one costs
//! O(log users).
//!
//! Routing a request of user `u` over endpoints `0..n` (the paper leaves the
//! normalisation open; this is AIBrix's released form):
//!
//! ```text
//! lo, hi     = the smallest and largest count over active users
//!              (min_tokens and max_tokens while no user is active)
//! bucket     = max(min_tokens, (lo + hi) / 2)
//! x          = min(count(u) / bucket, n - 1)            the user's "ideal" endpoint
//! fairness_i = |i - x|
//! util_i     = min(running_i / max_endpoint_load, 1)
//! score_i    = fairness_weight * fairness_i + utilization_weight * util_i
//! ```
//!
//! and the lowest score wins (the lowest index on ties; AIBrix adds a random
//! jitter of up to 0.1, left out so decisions are reproducible). Heavy users
//! are steered towards the high-index endpoints and light users towards the low
//! ones, so a heavy user's backlog does not crowd every endpoint; the utilization
//! term moves requests off a endpoint as it fills.
//!
//! The router over these counts is `crate::pick::VtcRouter`.
//!
//! Time is passed in explicitly (seconds); it never runs backwards: an earlier
//! `now` than one already seen counts as the latest.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use crate::budget::MAX_TOKENS;
use crate::error::{finite, invalid, non_negative, positive, Error, Result};
use crate::snapshot::{Reader, Writer};

/// Buckets per window.
pub const WINDOW_BUCKETS: i64 = 10;
/// Default bound on users held.
pub const DEFAULT_MAX_USERS: usize = 100_000;
/// Largest `max_users`.
pub const MAX_USERS: usize = 10_000_000;
/// Longest user name, in bytes.
pub const MAX_USER_NAME_BYTES: usize = 256;

/// The router's settings, with AIBrix's names (see the module docs); also
/// the `vtc` scorer's parameters (a missing one takes its default).
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VtcConfig {
    pub window_s: f64,
    pub input_weight: f64,
    pub output_weight: f64,
    pub min_tokens: f64,
    pub max_tokens: f64,
    pub fairness_weight: f64,
    pub utilization_weight: f64,
    pub max_endpoint_load: f64,
    pub max_users: usize,
}

impl Default for VtcConfig {
    /// AIBrix's `vtc-basic` defaults (the Python `VtcRouter`'s keyword defaults).
    fn default() -> Self {
        Self {
            window_s: 300.0,
            input_weight: 1.0,
            output_weight: 2.0,
            min_tokens: 1000.0,
            max_tokens: 8000.0,
            fairness_weight: 1.0,
            utilization_weight: 1.0,
            max_endpoint_load: 100.0,
            max_users: DEFAULT_MAX_USERS,
        }
    }
}

impl VtcConfig {
    /// Checks every field: a positive window, load and `min_tokens`,
    /// `max_tokens >= min_tokens`, non-negative weights, 1 to `MAX_USERS` users.
    pub fn check(self) -> Result<Self> {
        positive("window_s", self.window_s)?;
        non_negative("input_weight", self.input_weight)?;
        non_negative("output_weight", self.output_weight)?;
        positive("min_tokens", self.min_tokens)?;
        finite("max_tokens", self.max_tokens)?;
        if self.max_tokens < self.min_tokens {
            return Err(invalid(format!(
                "max_tokens ({}) must be >= min_tokens ({})",
                self.max_tokens, self.min_tokens
            )));
        }
        non_negative("fairness_weight", self.fairness_weight)?;
        non_negative("utilization_weight", self.utilization_weight)?;
        positive("max_endpoint_load", self.max_endpoint_load)?;
        if self.max_users == 0 || self.max_users > MAX_USERS {
            return Err(invalid(format!(
                "max_users must be in [1, {MAX_USERS}], got {}",
                self.max_users
            )));
        }
        Ok(self)
    }

    /// The parameters of the `vtc` plugin with these settings.
    pub fn to_params(&self) -> serde_json::Value {
        serde_json::json!({
            "window_s": self.window_s,
            "input_weight": self.input_weight,
            "output_weight": self.output_weight,
            "min_tokens": self.min_tokens,
            "max_tokens": self.max_tokens,
            "fairness_weight": self.fairness_weight,
            "utilization_weight": self.utilization_weight,
            "max_endpoint_load": self.max_endpoint_load,
            "max_users": self.max_users,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
struct User {
    /// (bucket id, weighted tokens), oldest first, at most `WINDOW_BUCKETS`.
    buckets: VecDeque<(i64, f64)>,
    /// `sum()`, kept for the multiset of totals.
    total: f64,
}

impl User {
    /// The sum of the buckets, never below zero.
    fn sum(&self) -> f64 {
        let s = self.raw_sum();
        // Not `max`: -0.0 must not reach the multiset (its bits sort last).
        if s > 0.0 {
            s
        } else {
            0.0
        }
    }
    fn raw_sum(&self) -> f64 {
        self.buckets.iter().map(|&(_, t)| t).sum()
    }
    /// The id of the latest bucket charged (a held user has one).
    fn last_bucket(&self) -> i64 {
        self.buckets.back().map_or(i64::MIN, |&(id, _)| id)
    }
}

/// Counts of non-negative floats, ordered: the bits of a non-negative f64
/// order as the number does.
type Multiset = BTreeMap<u64, u32>;

fn multiset_add(m: &mut Multiset, x: f64) {
    *m.entry(x.to_bits()).or_insert(0) += 1;
}

fn multiset_remove(m: &mut Multiset, x: f64) {
    if let Some(c) = m.get_mut(&x.to_bits()) {
        *c -= 1;
        if *c == 0 {
            m.remove(&x.to_bits());
        }
    }
}

pub fn check_user(user: &str) -> Result<()> {
    if user.is_empty() || user.len() > MAX_USER_NAME_BYTES {
        return Err(invalid(format!(
            "user name must be 1 to {MAX_USER_NAME_BYTES} bytes, got {} bytes",
            user.len()
        )));
    }
    Ok(())
}

pub(crate) fn check_tokens(what: &str, v: i64) -> Result<f64> {
    if v < 0 || v as u64 > MAX_TOKENS {
        return Err(invalid(format!(
            "{what} must be in [0, {MAX_TOKENS}], got {v}"
        )));
    }
    Ok(v as f64)
}

/// Every user's weighted token count over the sliding window (see the
/// module docs): the state of the `vtc` scorer.
#[derive(Debug, Clone, PartialEq)]
pub struct Fairness {
    config: VtcConfig,
    users: HashMap<String, User>,
    /// Every held user as (latest bucket, name): the first is the least
    /// recently active, the one forgotten at `max_users`.
    recency: BTreeSet<(i64, String)>,
    totals: Multiset,
    /// The latest bucket id seen.
    bucket: i64,
}

impl Fairness {
    pub fn new(config: VtcConfig) -> Result<Self> {
        Ok(Self {
            config: config.check()?,
            users: HashMap::new(),
            recency: BTreeSet::new(),
            totals: Multiset::new(),
            bucket: i64::MIN,
        })
    }

    pub fn config(&self) -> &VtcConfig {
        &self.config
    }
    /// Users with a non-empty window (as of the latest time seen).
    pub fn users_len(&self) -> usize {
        self.users.len()
    }

    fn bucket_of(&self, now: f64) -> i64 {
        // `as` saturates: times beyond i64 bucket ids are the last bucket.
        (now / (self.config.window_s / WINDOW_BUCKETS as f64)).floor() as i64
    }

    /// Moves the window to `now` (finite): expires old buckets, forgets
    /// idle users.
    pub fn advance(&mut self, now: f64) {
        let b = self.bucket_of(now);
        if b <= self.bucket {
            return;
        }
        self.bucket = b;
        let oldest = b.saturating_sub(WINDOW_BUCKETS - 1);
        self.totals.clear();
        // A user whose buckets all expire is one whose latest is older.
        self.recency = self.recency.split_off(&(oldest, String::new()));
        self.users.retain(|_, u| {
            while u.buckets.front().is_some_and(|&(id, _)| id < oldest) {
                u.buckets.pop_front();
            }
            // Corrections may outlive the charges they corrected: the
            // count stays at zero rather than going negative.
            let deficit = u.raw_sum();
            if let Some((_, t)) = u.buckets.back_mut().filter(|_| deficit < 0.0) {
                *t -= deficit;
            }
            u.total = u.sum();
            !u.buckets.is_empty()
        });
        for u in self.users.values() {
            multiset_add(&mut self.totals, u.total);
        }
    }

    /// The weighted tokens of a request.
    pub fn cost(&self, input_tokens: f64, output_tokens: f64) -> f64 {
        self.config.input_weight * input_tokens + self.config.output_weight * output_tokens
    }

    /// Adds `tokens` (may be negative: a correction) to `user` in the current
    /// bucket; the user's count never goes below zero.
    pub fn charge(&mut self, user: &str, tokens: f64) {
        let bucket = self.bucket;
        if !self.users.contains_key(user) {
            if tokens <= 0.0 {
                return;
            }
            if self.users.len() >= self.config.max_users {
                self.forget_least_recent();
            }
            self.users.insert(
                user.to_owned(),
                User {
                    buckets: VecDeque::new(),
                    total: 0.0,
                },
            );
            multiset_add(&mut self.totals, 0.0);
        }
        let Some(u) = self.users.get_mut(user) else {
            return;
        };
        let tokens = tokens.max(-u.total);
        match u.buckets.back_mut() {
            Some((id, t)) if *id == bucket => *t += tokens,
            last => {
                if let Some(&mut (id, _)) = last {
                    self.recency.remove(&(id, user.to_owned()));
                }
                u.buckets.push_back((bucket, tokens));
                self.recency.insert((bucket, user.to_owned()));
            }
        }
        let old = u.total;
        u.total = u.sum();
        let new = u.total;
        multiset_remove(&mut self.totals, old);
        multiset_add(&mut self.totals, new);
    }

    fn forget_least_recent(&mut self) {
        if let Some((_, name)) = self.recency.pop_first() {
            if let Some(u) = self.users.remove(&name) {
                multiset_remove(&mut self.totals, u.total);
            }
        }
    }

    /// The user's weighted token count in the window (as of the latest
    /// `advance`).
    pub fn tokens(&self, user: &str) -> f64 {
        self.users.get(user).map_or(0.0, |u| u.total)
    }

    /// The user's "ideal" endpoint `x` among `n` (see the module docs).
    pub fn ideal(&self, user: &str, n: usize) -> f64 {
        let c = &self.config;
        let (lo, hi) = match (self.totals.keys().next(), self.totals.keys().next_back()) {
            (Some(&lo), Some(&hi)) => (f64::from_bits(lo), f64::from_bits(hi)),
            _ => (c.min_tokens, c.max_tokens),
        };
        let bucket = c.min_tokens.max((lo + hi) / 2.0);
        (self.tokens(user) / bucket).min(n.saturating_sub(1) as f64)
    }

    /// Settings and every user's buckets (users in name order, so equal
    /// states give equal bytes).
    pub fn write(&self, w: &mut Writer) {
        let c = &self.config;
        for x in [
            c.window_s,
            c.input_weight,
            c.output_weight,
            c.min_tokens,
            c.max_tokens,
            c.fairness_weight,
            c.utilization_weight,
            c.max_endpoint_load,
        ] {
            w.f64(x);
        }
        w.u64(c.max_users as u64);
        w.u64(self.bucket as u64);
        let mut names: Vec<&String> = self.users.keys().collect();
        names.sort();
        w.u64(names.len() as u64);
        for name in names {
            let u = &self.users[name];
            w.str(name).u64(u.buckets.len() as u64);
            for &(id, t) in &u.buckets {
                w.u64(id as u64).f64(t);
            }
        }
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self> {
        let mut f = [0.0; 8];
        for x in &mut f {
            *x = r.f64()?;
        }
        let config = VtcConfig {
            window_s: f[0],
            input_weight: f[1],
            output_weight: f[2],
            min_tokens: f[3],
            max_tokens: f[4],
            fairness_weight: f[5],
            utilization_weight: f[6],
            max_endpoint_load: f[7],
            max_users: usize::try_from(r.u64()?).unwrap_or(usize::MAX),
        };
        let mut fair = Self::new(config)?;
        fair.bucket = r.u64()? as i64;
        let n = r.count(20)?;
        if n > config.max_users {
            return Err(Error::Snapshot(format!("{n} users exceed max_users")));
        }
        for _ in 0..n {
            let name = r.str()?;
            check_user(&name)?;
            let k = r.count(16)?;
            if k == 0 || k > WINDOW_BUCKETS as usize {
                return Err(Error::Snapshot(format!("user {name:?} has {k} buckets")));
            }
            let mut buckets = VecDeque::with_capacity(k);
            for _ in 0..k {
                let id = r.u64()? as i64;
                let t = finite("bucket tokens", r.f64()?)?;
                if buckets.back().is_some_and(|&(prev, _)| prev >= id) || id > fair.bucket {
                    return Err(Error::Snapshot("bucket ids out of order".into()));
                }
                buckets.push_back((id, t));
            }
            let mut user = User {
                buckets,
                total: 0.0,
            };
            user.total = user.sum();
            multiset_add(&mut fair.totals, user.total);
            fair.recency.insert((user.last_bucket(), name.clone()));
            if fair.users.insert(name, user).is_some() {
                return Err(Error::Snapshot("a user appears twice".into()));
            }
        }
        Ok(fair)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recency order is exactly the users' (latest bucket, name), so the
    /// user forgotten is the one a scan over all users would pick.
    #[test]
    fn eviction_forgets_the_least_recent_by_latest_bucket_then_name() {
        let config = VtcConfig {
            max_users: 20,
            ..VtcConfig::default()
        };
        let mut fair = Fairness::new(config).expect("fairness");
        let mut state = 12_345u64;
        let mut next = |m: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % m
        };
        let order = |fair: &Fairness| -> BTreeSet<(i64, String)> {
            fair.users
                .iter()
                .map(|(n, u)| (u.last_bucket(), n.clone()))
                .collect()
        };
        for step in 0..3000 {
            let now = step as f64 * 0.7;
            let user = format!("u{}", next(60));
            fair.advance(now);
            let gone = (fair.users_len() == 20 && !fair.users.contains_key(&user))
                .then(|| order(&fair).pop_first());
            // A charge, or (one in four) a correction of one.
            let tokens = if next(4) == 0 {
                -(next(300) as f64)
            } else {
                fair.cost(next(500) as f64, 10.0)
            };
            fair.charge(&user, tokens);
            if let Some(Some((_, gone))) = gone {
                if fair.users.contains_key(&user) {
                    assert!(!fair.users.contains_key(&gone), "step {step}");
                }
            }
            assert_eq!(fair.recency, order(&fair), "step {step}");
            assert!(fair.users_len() <= 20);
        }
    }
}
