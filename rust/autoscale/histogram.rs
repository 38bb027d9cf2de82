//! A fixed log-linear histogram of token counts (the layout of HDR
//! histograms): every value below `2^SUB_BITS` has its own bucket, and each
//! octave `[2^e, 2^(e+1))` above is split into `2^SUB_BITS` equal buckets.
//!
//! Error: a quantile is reported as the upper edge of its bucket, so it is
//! never below the exact quantile and at most `1 / 2^SUB_BITS` (3.125 %)
//! above it, relative (exact below 32). Memory: [`BUCKETS`] `u32` counts,
//! 3.3 KiB, whatever the traffic. Recording is two shifts and an add.

use crate::budget::MAX_TOKENS;

/// Buckets per octave: `2^SUB_BITS`.
pub const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;
/// Octaves above the exact range, up to `MAX_TOKENS = 2^30` inclusive.
const OCTAVES: u64 = (MAX_TOKENS.trailing_zeros() - SUB_BITS + 1) as u64;
/// Buckets of one histogram.
pub const BUCKETS: usize = (SUB + OCTAVES * SUB) as usize;
/// The largest relative error of a reported quantile.
pub const RELATIVE_ERROR: f64 = 1.0 / SUB as f64;

/// Counts of token counts in `[0, MAX_TOKENS]`, in fixed log-linear buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogHistogram {
    counts: Box<[u32; BUCKETS]>,
    total: u64,
}

impl Default for LogHistogram {
    fn default() -> Self {
        Self {
            counts: Box::new([0; BUCKETS]),
            total: 0,
        }
    }
}

/// The bucket of `v` (`v <= MAX_TOKENS`).
fn bucket(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let e = 63 - v.leading_zeros() as u64; // floor(log2 v) >= SUB_BITS
    let shift = e - SUB_BITS as u64;
    (SUB + shift * SUB + ((v >> shift) - SUB)) as usize
}

/// The largest value of bucket `i`.
fn upper_edge(i: usize) -> u64 {
    let i = i as u64;
    if i < SUB {
        return i;
    }
    let shift = (i - SUB) / SUB;
    let sub = (i - SUB) % SUB;
    ((SUB + sub + 1) << shift) - 1
}

impl LogHistogram {
    /// Counts `v` (clamped to `MAX_TOKENS`; callers check their input).
    pub fn record(&mut self, v: u64) {
        self.counts[bucket(v.min(MAX_TOKENS))] += 1;
        self.total += 1;
    }

    /// Adds every count of `other`, or removes them (`remove`; `other` was
    /// added before).
    pub fn add(&mut self, other: &LogHistogram, remove: bool) {
        for (c, o) in self.counts.iter_mut().zip(other.counts.iter()) {
            *c = if remove { *c - o } else { *c + o };
        }
        self.total = if remove {
            self.total - other.total
        } else {
            self.total + other.total
        };
    }

    /// Forgets every count.
    pub fn clear(&mut self) {
        self.counts.fill(0);
        self.total = 0;
    }

    /// Values counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// `(value, count)` of every non-empty bucket, ascending, the value its
    /// upper edge (exact below 32).
    pub fn buckets(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(i, &c)| (upper_edge(i), c))
    }

    /// The `q` quantile (q in [0, 1]), the smallest value `x` with
    /// `F(x) >= q` as the planner's workload defines it, reported as its
    /// bucket's upper edge: in `[exact, exact * (1 + RELATIVE_ERROR)]`.
    /// 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let target = (q.clamp(0.0, 1.0) * self.total as f64).ceil().max(1.0) as u64;
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c as u64;
            if seen >= target {
                return upper_edge(i);
            }
        }
        MAX_TOKENS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn buckets_tile_the_range() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(31), 31);
        assert_eq!(bucket(32), 32);
        assert_eq!(bucket(63), 63);
        assert_eq!(bucket(64), 64);
        assert_eq!(bucket(65), 64);
        assert_eq!(bucket(MAX_TOKENS), BUCKETS - SUB as usize);
        // Every bucket's upper edge is in it, and the next value is in the next.
        for i in 0..BUCKETS - 1 {
            assert_eq!(bucket(upper_edge(i)), i);
            assert_eq!(bucket(upper_edge(i) + 1), i + 1);
        }
        assert_eq!(upper_edge(BUCKETS - 1), 2 * MAX_TOKENS - 1);
        assert_eq!(
            upper_edge(BUCKETS - SUB as usize),
            MAX_TOKENS + (MAX_TOKENS >> SUB_BITS) - 1
        );
    }

    /// The exact quantile as the planner's workload defines it.
    fn exact(sorted: &[u64], q: f64) -> u64 {
        let target = (q * sorted.len() as f64).ceil().max(1.0) as usize;
        sorted[target - 1]
    }

    #[test]
    fn quantiles_within_the_stated_error_on_random_data() {
        let mut rng = Rng::new(7);
        for case in 0..200 {
            let n = 1 + rng.below(3000) as usize;
            // Log-uniform over a random range: short chats to long documents.
            let top = 1 + rng.below(24) as u32;
            let mut values: Vec<u64> = (0..n)
                .map(|_| (2f64.powf(rng.uniform() * top as f64)) as u64)
                .collect();
            let mut h = LogHistogram::default();
            for &v in &values {
                h.record(v);
            }
            values.sort_unstable();
            for q in [0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 0.995, 1.0] {
                let (x, got) = (exact(&values, q), h.quantile(q));
                assert!(got >= x, "case {case} q {q}: {got} < {x}");
                assert!(
                    got as f64 <= x as f64 * (1.0 + RELATIVE_ERROR),
                    "case {case} q {q}: {got} vs {x}"
                );
                if x < 32 {
                    assert_eq!(got, x);
                }
            }
        }
    }

    #[test]
    fn add_and_remove_round_trip() {
        let (mut a, mut b) = (LogHistogram::default(), LogHistogram::default());
        for v in [1, 100, 5000] {
            a.record(v);
        }
        b.record(7);
        let before = a.clone();
        a.add(&b, false);
        assert_eq!(a.total(), 4);
        a.add(&b, true);
        assert_eq!(a, before);
        a.clear();
        assert_eq!(a.quantile(0.5), 0);
    }
}
