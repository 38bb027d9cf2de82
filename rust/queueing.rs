//! M/M/c and M/G/c waiting: Erlang B and C, and the two-moment P99 wait that
//! FleetOpt sizes pools with.
//!
//! Erlang B is the Poisson ratio `B(c, A) = P(X = c) / P(X <= c)`, X ~
//! Poisson(A). `P(X > c) = P(X = c) sum_{n >= 1} prod_{i=1..n} A / (c + i)`
//! (a series whose terms shrink at least by `A / (c + 1) < 1` each) and
//! `1 / B = (1 - P(X > c)) / P(X = c)`, where `ln P(X = c)` comes from Loader's
//! saddle-point form `-stirlerr(c) - bd0(c, A) - ln(2 pi c) / 2` (C. Loader,
//! "Fast and accurate computation of binomial probabilities", 2000), accurate
//! to ~1e-15 relative where `lgamma` would lose digits at large c. Erlang C
//! then is `C = B / (1 - rho (1 - B))`, `rho = A / c`. Nothing overflows: when
//! `1 / P(X = c)` is beyond f64, B underflows to 0 and so does C.
//!
//! `ErlangScan` is the incremental form for sizing that scans c upward:
//! `1 / B_c = 1 + (c / A) / B_{c-1}` (the classical Erlang-B recursion), kept in
//! the log domain, O(1) per step and stable (the relative error shrinks each step).

use crate::error::{invalid, non_negative, positive, Result};
use crate::snapshot::{Reader, Writer};

const SCAN_MAGIC: &[u8; 4] = b"RCES";
const SCAN_VERSION: u16 = 1;

const LN_SQRT_2PI: f64 = 0.918_938_533_204_672_8;

/// `ln(n!) - (n + 1/2) ln n + n - ln sqrt(2 pi)`: the error of Stirling's formula.
fn stirlerr(n: f64) -> f64 {
    if n < 16.0 {
        // ln(n!) by summation is exact to a few ulps at these sizes (n integer).
        let ln_fact: f64 = (2..=n as u64).map(|k| (k as f64).ln()).sum();
        return ln_fact - (n + 0.5) * n.ln() + n - LN_SQRT_2PI;
    }
    const S0: f64 = 1.0 / 12.0;
    const S1: f64 = 1.0 / 360.0;
    const S2: f64 = 1.0 / 1260.0;
    const S3: f64 = 1.0 / 1680.0;
    const S4: f64 = 1.0 / 1188.0;
    // One division: the series in 1 / n^2 by multiplication.
    let inv = 1.0 / n;
    let r = inv * inv;
    (S0 - (S1 - (S2 - (S3 - S4 * r) * r) * r) * r) * inv
}

/// `x ln(x / m) + m - x`, without cancellation when x is near m.
fn bd0(x: f64, m: f64) -> f64 {
    if (x - m).abs() < 0.1 * (x + m) {
        let v = (x - m) / (x + m);
        let mut s = (x - m) * v;
        let mut ej = 2.0 * x * v;
        let v2 = v * v;
        let mut j = 1.0;
        loop {
            ej *= v2;
            let s1 = s + ej / (2.0 * j + 1.0);
            if s1 == s {
                return s1;
            }
            s = s1;
            j += 1.0;
        }
    }
    x * (x / m).ln() + m - x
}

/// `ln P(X = c)` for X ~ Poisson(a), c >= 1, a > 0.
fn ln_poisson_pmf(c: f64, a: f64) -> f64 {
    -stirlerr(c) - bd0(c, a) - 0.5 * (std::f64::consts::TAU * c).ln()
}

/// `P(X > c) = P(X = c) * sum_{n >= 1} prod_{i=1..n} a / (c + i)` for a < c + 1,
/// summed until a term adds less than 1e-17 to it: since `P(X <= c) >= 1/2`
/// here, that is below the last bit of `P(X <= c)` (and costs no terms at all
/// when `P(X = c)` is astronomically small, the many-server regime).
///
/// Four terms a division: from a term `t` the next four, with `d_j = c + i +
/// j`, sum to `t a (d_2 d_3 d_4 + a (d_3 d_4 + a (d_4 + a))) / (d_1 d_2 d_3
/// d_4)` and the fourth is `t a^4 / (d_1 d_2 d_3 d_4)` (no overflow: `d^4 <
/// 2^170` below [`MAX_SERVERS`]). Both factors are independent of `t`, so the
/// divisions overlap and one multiply a group waits on the last: near
/// saturation, where the series is O(sqrt(c)) terms, about four times faster
/// than a division a term. The group that reaches the stopping term adds its
/// (smaller) rest, under 3e-17.
fn poisson_above(c: f64, a: f64, pmf: f64) -> f64 {
    let (mut term, mut sum, mut i) = (pmf, 0.0, 0.0);
    let a4 = (a * a) * (a * a);
    loop {
        let (d1, d2, d3, d4) = (c + i + 1.0, c + i + 2.0, c + i + 3.0, c + i + 4.0);
        let (d34, d12) = (d3 * d4, d1 * d2);
        let inv = 1.0 / (d12 * d34);
        let group = a * (d2 * d34 + a * (d34 + a * (d4 + a))) * inv;
        sum += term * group;
        term *= a4 * inv;
        if term <= 1e-17 {
            return sum;
        }
        i += 4.0;
    }
}

/// Most servers the exact evaluation accepts (~1.1e12): near saturation its
/// series costs O(sqrt(c)) terms. `p99_wait` answers larger systems in the
/// many-server regime from the O(1) bound alone.
pub const MAX_SERVERS: u64 = 1 << 40;

fn check(servers: u64, offered_load: f64) -> Result<()> {
    if servers == 0 || servers > MAX_SERVERS {
        return Err(invalid(format!(
            "servers must be in [1, {MAX_SERVERS}], got {servers}"
        )));
    }
    non_negative("offered_load", offered_load)?;
    Ok(())
}

/// `ln(1 / B(c, A))` (>= 0), for c >= 1 and 0 < A.
fn ln_inv_erlang_b(c: f64, a: f64) -> f64 {
    ln_inv_erlang_b_at(c, a, ln_poisson_pmf(c, a))
}

/// [`ln_inv_erlang_b`] given `ln_pmf = ln P(X = c)`.
fn ln_inv_erlang_b_at(c: f64, a: f64, ln_pmf: f64) -> f64 {
    // 1/B = P(X <= c) / P(X = c) = (1 - P(X > c)) / P(X = c).
    -ln_pmf + (-poisson_above(c, a, exp_or_zero(ln_pmf))).ln_1p()
}

/// `e^x`, 0 below -746 without calling `exp` (which returns the same 0 there
/// by a slow path that flags the underflow): many-server pmfs are far below.
pub(crate) fn exp_or_zero(x: f64) -> f64 {
    if x < -746.0 {
        0.0
    } else {
        x.exp()
    }
}

/// Erlang B, the blocking probability of M/M/c/c with offered load A = lambda / mu.
pub fn erlang_b(servers: u64, offered_load: f64) -> Result<f64> {
    check(servers, offered_load)?;
    if offered_load == 0.0 {
        return Ok(0.0);
    }
    let (c, a) = (servers as f64, offered_load);
    if a >= c + 1.0 {
        // 1/B = P(X <= c) / P(X = c) = sum_{j=0..c} prod_{i<j} (c - i) / A:
        // positive terms shrinking by at most c / A < 1 each, no pmf needed.
        let (mut term, mut sum, mut i) = (1.0f64, 1.0f64, 0.0f64);
        while i < c {
            term *= (c - i) / a;
            sum += term;
            if term <= 1e-17 * sum {
                break;
            }
            i += 1.0;
        }
        return Ok(1.0 / sum);
    }
    Ok((-ln_inv_erlang_b(c, a)).exp())
}

fn c_from_b(b: f64, rho: f64) -> f64 {
    b / (1.0 - rho * (1.0 - b))
}

/// Erlang C: the probability that an arrival waits in M/M/c with offered load
/// A = lambda / mu < c (an `InvalidArgument` at or above c). 0 when A = 0.
pub fn erlang_c(servers: u64, offered_load: f64) -> Result<f64> {
    check(servers, offered_load)?;
    let c = servers as f64;
    if offered_load >= c {
        return Err(invalid(format!(
            "offered_load ({offered_load}) must be below servers ({servers}): the queue is unstable"
        )));
    }
    let b = erlang_b(servers, offered_load)?;
    Ok(c_from_b(b, offered_load / c))
}

/// `erlang_c` over pairs of arrays of equal length; the first bad pair's error.
pub fn erlang_c_many(servers: &[i64], offered_load: &[f64]) -> Result<Vec<f64>> {
    if servers.len() != offered_load.len() {
        return Err(invalid(format!(
            "servers has {} entries but offered_load has {}",
            servers.len(),
            offered_load.len()
        )));
    }
    servers
        .iter()
        .zip(offered_load)
        .map(|(&c, &a)| {
            if c < 1 {
                return Err(invalid(format!("servers must be >= 1, got {c}")));
            }
            erlang_c(c as u64, a)
        })
        .collect()
}

/// The Kimura-style two-moment P99 queue wait of M/G/c used by FleetOpt (Eq. 6,
/// after T. Kimura, "Two-moment approximations for the mean waiting time in
/// the M/G/c queue", J. Oper. Res. Soc. Japan 37(3), 1994):
/// `W99 = ln(C / 0.01) (1 + Cs^2) / (2 (c mu - lambda))`, 0 when `C <= 0.01`;
/// C is Erlang C at `A = lambda / mu`. The M/M/c tail `P(W > t) = C e^{-(c mu - lambda) t}`
/// scaled by `(1 + Cs^2) / 2`. `+inf` when `lambda >= c mu` (unstable).
pub fn p99_wait(servers: u64, service_rate: f64, cs2: f64, arrival_rate: f64) -> Result<f64> {
    if servers == 0 {
        return Err(invalid("servers must be >= 1"));
    }
    positive("service_rate", service_rate)?;
    non_negative("cs2", cs2)?;
    non_negative("arrival_rate", arrival_rate)?;
    let capacity = servers as f64 * service_rate;
    if arrival_rate >= capacity {
        return Ok(f64::INFINITY);
    }
    let load = arrival_rate / service_rate;
    if load > 0.0 && erlang_c_bound(servers as f64, load) <= 0.005 {
        // C <= bound <= 0.01: the many-server regime, no series needed.
        return Ok(0.0);
    }
    let c = erlang_c(servers, load)?;
    Ok(wait_from_c(c, capacity - arrival_rate, cs2))
}

/// An upper bound on Erlang C for 0 < A < c in O(1): `C <= B / (1 - rho)` and
/// `B = P(X = c) / P(X <= c) <= 2 P(X = c)`, since the Poisson median is at
/// most `ceil(A) <= c` so `P(X <= c) >= 1/2`.
pub(crate) fn erlang_c_bound(c: f64, a: f64) -> f64 {
    erlang_c_bounds(c, a).1
}

/// Erlang C bracketed in O(1) for 0 < A < c, from one Poisson pmf: the
/// upper bound of [`erlang_c_bound`], and below it `C >= pmf / (1 - rho (1 -
/// pmf))` (C increases with B, and `B = P(X = c) / P(X <= c) >= P(X = c)`).
pub(crate) fn erlang_c_bounds(c: f64, a: f64) -> (f64, f64) {
    ErlangC::new(c, a).bounds()
}

/// Erlang C of `c` servers at offered load `a` (0 < A < c) from one Poisson
/// log-pmf, computed once for its O(1) bounds and, where they do not
/// decide, the exact value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ErlangC {
    c: f64,
    a: f64,
    ln_pmf: f64,
}

impl ErlangC {
    pub(crate) fn new(c: f64, a: f64) -> Self {
        Self {
            c,
            a,
            ln_pmf: ln_poisson_pmf(c, a),
        }
    }

    /// The bounds of [`erlang_c_bounds`].
    pub(crate) fn bounds(&self) -> (f64, f64) {
        let (pmf, rho) = (exp_or_zero(self.ln_pmf), self.a / self.c);
        (pmf / (1.0 - rho * (1.0 - pmf)), 2.0 * pmf / (1.0 - rho))
    }

    /// [`erlang_c`] of `servers` (`c`), its checks and errors included, the
    /// same value without the pmf computed again.
    pub(crate) fn exact(&self, servers: u64) -> Result<f64> {
        check(servers, self.a)?;
        if self.a >= self.c {
            return erlang_c(servers, self.a);
        }
        if self.a == 0.0 {
            return Ok(0.0);
        }
        let b = (-ln_inv_erlang_b_at(self.c, self.a, self.ln_pmf)).exp();
        Ok(c_from_b(b, self.a / self.c))
    }
}

fn wait_from_c(c: f64, drain: f64, cs2: f64) -> f64 {
    if c <= 0.01 {
        0.0
    } else {
        (c / 0.01).ln() * (1.0 + cs2) / (2.0 * drain)
    }
}

/// Erlang B and C for c = c0, c0 + 1, ... at a fixed offered load, each
/// step O(1) by the recursion `1 / B_c = 1 + (c / A) / B_{c-1}` in log form.
#[derive(Debug, Clone)]
pub struct ErlangScan {
    load: f64,
    servers: u64,
    /// ln(1 / B) at `servers`.
    ln_inv_b: f64,
}

impl ErlangScan {
    /// Starts at `servers` (>= 1) with offered load `offered_load` (> 0).
    pub fn new(servers: u64, offered_load: f64) -> Result<Self> {
        check(servers, offered_load)?;
        if offered_load == 0.0 {
            return Err(invalid("offered_load must be > 0 for a scan"));
        }
        let b = erlang_b(servers, offered_load)?;
        let ln_inv_b = if b > 0.0 {
            -b.ln()
        } else {
            ln_inv_erlang_b(servers as f64, offered_load)
        };
        Ok(Self {
            load: offered_load,
            servers,
            ln_inv_b,
        })
    }

    pub fn servers(&self) -> u64 {
        self.servers
    }

    pub fn offered_load(&self) -> f64 {
        self.load
    }

    /// Erlang B at the current server count.
    pub fn erlang_b(&self) -> f64 {
        (-self.ln_inv_b).exp()
    }

    /// Erlang C at the current server count; 1 when the load is at or above it.
    pub fn erlang_c(&self) -> f64 {
        let rho = self.load / self.servers as f64;
        if rho >= 1.0 {
            1.0
        } else {
            c_from_b(self.erlang_b(), rho)
        }
    }

    /// The scan's state as bytes; `from_bytes` restores it exactly.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(SCAN_MAGIC, SCAN_VERSION);
        w.u64(self.servers).f64(self.load).f64(self.ln_inv_b);
        w.finish()
    }

    /// Restores `to_bytes`; a snapshot error for anything else.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, SCAN_MAGIC, SCAN_VERSION, "ErlangScan")?;
        let (servers, load, ln_inv_b) = (r.u64()?, r.f64()?, r.f64()?);
        r.finish()?;
        let valid = servers >= 1 && load.is_finite() && load > 0.0 && ln_inv_b >= 0.0;
        if !valid || !ln_inv_b.is_finite() {
            return Err(crate::error::Error::Snapshot(
                "ErlangScan fields out of range".into(),
            ));
        }
        Ok(Self {
            load,
            servers,
            ln_inv_b,
        })
    }

    /// One more server, O(1).
    pub fn advance(&mut self) {
        self.servers += 1;
        // ln(1 + e^x) with x = ln(c / A) + ln(1/B_{c-1}) >= ln(c / A).
        let x = (self.servers as f64 / self.load).ln() + self.ln_inv_b;
        self.ln_inv_b = if x > 0.0 {
            x + (-x).exp().ln_1p()
        } else {
            x.exp().ln_1p()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recursion_b(c: u64, a: f64) -> f64 {
        let mut inv_b = 1.0f64;
        for k in 1..=c {
            inv_b = 1.0 + (k as f64 / a) * inv_b;
        }
        1.0 / inv_b
    }

    fn rel(a: f64, b: f64) -> f64 {
        ((a - b) / b).abs()
    }

    #[test]
    fn matches_the_recursion() {
        for &(c, a) in &[
            (1u64, 0.5),
            (2, 1.0),
            (5, 4.9),
            (10, 3.0),
            (16, 13.6),
            (50, 40.0),
            (100, 99.0),
            (300, 250.0),
            // Near saturation: hundreds of the series' terms, four a group.
            (4000, 3960.0),
            (20000, 19990.0),
        ] {
            let b = erlang_b(c, a).expect("ok");
            assert!(rel(b, recursion_b(c, a)) < 1e-12, "B({c}, {a})");
            let rho = a / c as f64;
            let direct = recursion_b(c, a) / (1.0 - rho * (1.0 - recursion_b(c, a)));
            assert!(rel(erlang_c(c, a).expect("ok"), direct) < 1e-12);
        }
        for &(c, a) in &[(1u64, 2.0), (5, 6.0), (40, 41.5), (300, 1000.0)] {
            let b = erlang_b(c, a).expect("ok");
            assert!(rel(b, recursion_b(c, a)) < 1e-12, "B({c}, {a})");
        }
        assert!(erlang_b(1 << 40, 1e13).is_ok_and(|b| b > 0.0 && b < 1.0));
        assert!(erlang_c((1 << 40) + 1, 1.0).is_err());
        // M/M/1: C = rho. M/M/2 at A = 1: C = 1/3.
        assert!(rel(erlang_c(1, 0.3).expect("ok"), 0.3) < 1e-14);
        assert!(rel(erlang_c(2, 1.0).expect("ok"), 1.0 / 3.0) < 1e-14);
    }

    #[test]
    fn scan_steps_like_fresh_evaluations() {
        let mut s = ErlangScan::new(100, 150.0).expect("ok");
        for _ in 0..2000 {
            s.advance();
            let fresh = erlang_b(s.servers(), 150.0).expect("ok");
            if fresh > 1e-300 {
                assert!(rel(s.erlang_b(), fresh) < 1e-11, "c = {}", s.servers());
            }
        }
        assert_eq!(s.servers(), 2100);
        let back = ErlangScan::from_bytes(&s.to_bytes()).expect("round trip");
        assert_eq!(back.ln_inv_b.to_bits(), s.ln_inv_b.to_bits());
        let bytes = s.to_bytes();
        for cut in 0..bytes.len() {
            assert!(ErlangScan::from_bytes(&bytes[..cut]).is_err());
        }
        let mut zero = ErlangScan::new(1, 1.0).expect("ok");
        zero.servers = 0;
        assert!(ErlangScan::from_bytes(&zero.to_bytes()).is_err());
        assert_eq!(erlang_c_many(&[1, 2], &[0.3, 1.0]).map(|v| v.len()), Ok(2));
        assert!(erlang_c_many(&[1, 0], &[0.3, 1.0]).is_err());
        assert!(erlang_c_many(&[1], &[0.3, 1.0]).is_err());
        assert!(s.erlang_c() < 1e-300);
    }

    #[test]
    fn large_and_near_saturation_are_finite() {
        for &(c, rho) in &[
            (32_768u64, 0.85),
            (32_768, 0.999),
            (1_000_000, 0.9999),
            (1_000_000, 0.5),
        ] {
            let v = erlang_c(c, rho * c as f64).expect("ok");
            assert!(
                v.is_finite() && (0.0..1.0).contains(&v),
                "C({c}, {rho}) = {v}"
            );
        }
        assert!(erlang_c(10, 10.0).is_err());
        assert!(erlang_c(0, 1.0).is_err());
        assert!(erlang_c(10, f64::NAN).is_err());
        assert_eq!(erlang_c(10, 0.0), Ok(0.0));
    }

    #[test]
    fn the_bound_holds() {
        for &(c, rho) in &[
            (1u64, 0.5),
            (3, 0.9),
            (10, 0.3),
            (100, 0.85),
            (4000, 0.99),
            (1 << 20, 0.999),
        ] {
            let a = rho * c as f64;
            let exact = erlang_c(c, a).expect("ok");
            assert!(exact <= erlang_c_bound(c as f64, a), "C({c}, {a})");
            let (lower, upper) = erlang_c_bounds(c as f64, a);
            assert_eq!(upper, erlang_c_bound(c as f64, a));
            assert!(lower <= exact && exact <= upper, "C({c}, {a})");
        }
        // Lightly loaded, few servers: B is nearly P(X = c) and the lower
        // bound nearly exact; near saturation it is within a few times.
        for &(c, rho, within) in &[(2u64, 0.05, 1.01), (50, 0.5, 1.2), (4000, 0.99, 8.0)] {
            let a = rho * c as f64;
            let exact = erlang_c(c, a).expect("ok");
            let (lower, _) = erlang_c_bounds(c as f64, a);
            assert!(
                lower <= exact && exact <= within * lower,
                "C({c}, {a}) {lower}"
            );
        }
    }

    #[test]
    fn p99_wait_by_hand() {
        // M/M/1, mu = 1, lambda = 0.5: C = 0.5, W99 = ln(50) * (1 + 1) / (2 * 0.5).
        let w = p99_wait(1, 1.0, 1.0, 0.5).expect("ok");
        assert!(rel(w, 50f64.ln() * 2.0) < 1e-14);
        assert_eq!(p99_wait(100, 1.0, 1.0, 10.0), Ok(0.0));
        assert_eq!(p99_wait(1, 1.0, 1.0, 1.0), Ok(f64::INFINITY));
        assert!(p99_wait(1, 0.0, 1.0, 0.5).is_err());
        assert!(p99_wait(1, 1.0, -1.0, 0.5).is_err());
    }

    /// The exact value from the bounds' pmf is `erlang_c`'s, bit for bit,
    /// with its errors; the bounds bracket it.
    #[test]
    fn erlang_c_from_one_pmf_is_erlang_c() {
        for &c in &[1u64, 2, 15, 16, 17, 100, 2_880, 40_000, 1 << 20] {
            for &rho in &[1e-3, 0.1, 0.5, 0.85, 0.95, 0.99, 0.9999] {
                let a = rho * c as f64;
                let e = ErlangC::new(c as f64, a);
                let exact = e.exact(c).expect("exact");
                assert_eq!(
                    exact.to_bits(),
                    erlang_c(c, a).expect("C").to_bits(),
                    "C({c}, {a})"
                );
                let (lower, upper) = e.bounds();
                assert_eq!((lower, upper), erlang_c_bounds(c as f64, a));
                assert!(
                    lower <= exact * (1.0 + 1e-12) && exact <= upper,
                    "C({c}, {a})"
                );
            }
        }
        assert!(ErlangC::new(10.0, 10.0).exact(10).is_err());
        assert!(ErlangC::new(10.0, 12.0).exact(10).is_err());
        assert!(ErlangC::new(0.0, 1.0).exact(0).is_err());
    }

    /// `exp_or_zero` is `exp` everywhere, the subnormal results near -745
    /// and the zeros below included.
    #[test]
    fn exp_or_zero_is_exp() {
        let mut x = -800.0;
        while x < 5.0 {
            assert_eq!(exp_or_zero(x).to_bits(), x.exp().to_bits(), "{x}");
            x += if (-750.0..-740.0).contains(&x) {
                0.001
            } else {
                0.37
            };
        }
        assert_eq!(exp_or_zero(-746.0), 0.0);
        assert!(exp_or_zero(-745.0) > 0.0);
        assert!(exp_or_zero(f64::NAN).is_nan());
        assert_eq!(exp_or_zero(f64::NEG_INFINITY), 0.0);
    }
}
