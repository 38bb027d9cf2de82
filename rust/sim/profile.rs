//! Time-varying workloads (issue 26): a request rate over time and the
//! arrival times it gives, for the autoscaling simulation ([`super::autoscale`]).
//!
//! A [`RateProfile`] is written as a small spec:
//!
//! - `step:500@0,2000@600`: 500 req/s from 0 s, 2,000 req/s from 600 s
//!   (`RATE@SECONDS` pairs, the first at 0, times increasing);
//! - `diurnal:low=500,high=2000,period=1200`: a day-shaped curve,
//!   `low + (high - low) (1 - cos(2 pi t / period)) / 2`, from its trough at 0
//!   to its peak at `period / 2`;
//! - `burst:base=500,peak=2000,at=300,length=60[,every=600]`: `base` with a
//!   burst at `peak` for `length` seconds from `at` (and every `every`
//!   seconds after it).
//!
//! Arrivals come by time change: the epochs of a unit-rate process (a
//! Poisson process, or a trace's own timestamps scaled to a mean rate of 1,
//! keeping its burstiness) mapped through the inverse of the cumulative rate
//! `Lambda(t)`, the integral of the rate from 0 to `t`.

use crate::error::{finite, invalid, non_negative, positive, Result};
use crate::rng::Rng;

/// Most steps a `step:` spec may have.
pub const MAX_STEPS: usize = 10_000;

/// A request rate over time (requests per second, `t` in seconds from 0).
#[derive(Debug, Clone, PartialEq)]
pub enum RateProfile {
    /// Piecewise constant: `(from_s, rate)`, the first from 0, times increasing.
    Steps(Vec<(f64, f64)>),
    /// `low + (high - low) (1 - cos(2 pi t / period_s)) / 2`.
    Diurnal { low: f64, high: f64, period_s: f64 },
    /// `base`, and `peak` during `[at_s + k every_s, at_s + k every_s + length_s)`
    /// for `k = 0` (and every `k >= 0` when `every_s` is given).
    Burst {
        base: f64,
        peak: f64,
        at_s: f64,
        length_s: f64,
        every_s: Option<f64>,
    },
}

/// The `key=value` pairs of a spec's body, each key known and given once.
fn keyed(kind: &str, body: &str, keys: &[&str]) -> Result<Vec<Option<f64>>> {
    let mut values = vec![None; keys.len()];
    for part in body.split(',') {
        let (k, v) = part.split_once('=').ok_or_else(|| {
            invalid(format!(
                "rate profile {kind}: expected KEY=VALUE, got {part:?}"
            ))
        })?;
        let i = keys.iter().position(|&x| x == k.trim()).ok_or_else(|| {
            invalid(format!(
                "rate profile {kind}: unknown key {k:?} (keys: {})",
                keys.join(", ")
            ))
        })?;
        if values[i].is_some() {
            return Err(invalid(format!("rate profile {kind}: {k} given twice")));
        }
        values[i] = Some(number(kind, k, v)?);
    }
    Ok(values)
}

fn number(kind: &str, what: &str, text: &str) -> Result<f64> {
    let v: f64 = text.trim().parse().map_err(|_| {
        invalid(format!(
            "rate profile {kind}: {what} must be a number, got {text:?}"
        ))
    })?;
    finite(&format!("rate profile {kind}: {what}"), v)
}

fn required(kind: &str, key: &str, v: Option<f64>) -> Result<f64> {
    v.ok_or_else(|| invalid(format!("rate profile {kind}: {key}= is required")))
}

impl RateProfile {
    /// Parses a spec (see the module's documentation); the error says what
    /// is wrong and where.
    pub fn parse(spec: &str) -> Result<Self> {
        let (kind, body) = spec.split_once(':').ok_or_else(|| {
            invalid(format!(
                "rate profile {spec:?}: expected step:RATE@SECONDS,..., \
                 diurnal:low=,high=,period= or burst:base=,peak=,at=,length=[,every=]"
            ))
        })?;
        let profile = match kind.trim() {
            "step" => {
                let mut steps = Vec::new();
                for part in body.split(',') {
                    let (rate, at) = part.split_once('@').ok_or_else(|| {
                        invalid(format!(
                            "rate profile step: expected RATE@SECONDS, got {part:?}"
                        ))
                    })?;
                    steps.push((number("step", "time", at)?, number("step", "rate", rate)?));
                }
                Self::Steps(steps)
            }
            "diurnal" => {
                let v = keyed("diurnal", body, &["low", "high", "period"])?;
                Self::Diurnal {
                    low: required("diurnal", "low", v[0])?,
                    high: required("diurnal", "high", v[1])?,
                    period_s: required("diurnal", "period", v[2])?,
                }
            }
            "burst" => {
                let v = keyed("burst", body, &["base", "peak", "at", "length", "every"])?;
                Self::Burst {
                    base: required("burst", "base", v[0])?,
                    peak: required("burst", "peak", v[1])?,
                    at_s: required("burst", "at", v[2])?,
                    length_s: required("burst", "length", v[3])?,
                    every_s: v[4],
                }
            }
            other => {
                return Err(invalid(format!(
                    "rate profile {spec:?}: unknown kind {other:?} (step, diurnal or burst)"
                )))
            }
        };
        profile.validate()?;
        Ok(profile)
    }

    /// Checks the profile: rates >= 0 and some above 0, times in order.
    pub fn validate(&self) -> Result<()> {
        match self {
            Self::Steps(steps) => {
                if steps.is_empty() || steps.len() > MAX_STEPS {
                    return Err(invalid(format!(
                        "rate profile step: 1 to {MAX_STEPS} steps, got {}",
                        steps.len()
                    )));
                }
                if steps[0].0 != 0.0 {
                    return Err(invalid(format!(
                        "rate profile step: the first step must be at 0 s, got {} s",
                        steps[0].0
                    )));
                }
                for w in steps.windows(2) {
                    if w[1].0 <= w[0].0 {
                        return Err(invalid(format!(
                            "rate profile step: times must increase, got {} s after {} s",
                            w[1].0, w[0].0
                        )));
                    }
                }
                for &(_, r) in steps {
                    non_negative("rate profile step: rate", r)?;
                }
                if steps.iter().all(|&(_, r)| r == 0.0) {
                    return Err(invalid("rate profile step: every rate is 0"));
                }
            }
            &Self::Diurnal {
                low,
                high,
                period_s,
            } => {
                non_negative("rate profile diurnal: low", low)?;
                positive("rate profile diurnal: high", high)?;
                positive("rate profile diurnal: period", period_s)?;
                if low > high {
                    return Err(invalid(format!(
                        "rate profile diurnal: low ({low}) is above high ({high})"
                    )));
                }
            }
            &Self::Burst {
                base,
                peak,
                at_s,
                length_s,
                every_s,
            } => {
                non_negative("rate profile burst: base", base)?;
                positive("rate profile burst: peak", peak)?;
                non_negative("rate profile burst: at", at_s)?;
                positive("rate profile burst: length", length_s)?;
                if let Some(e) = every_s {
                    positive("rate profile burst: every", e)?;
                    if e <= length_s {
                        return Err(invalid(format!(
                            "rate profile burst: every ({e}) must be above length ({length_s})"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// The rate at `t` (requests per second).
    pub fn rate(&self, t: f64) -> f64 {
        match self {
            Self::Steps(steps) => {
                let i = steps.partition_point(|&(from, _)| from <= t);
                steps[i.saturating_sub(1)].1
            }
            &Self::Diurnal {
                low,
                high,
                period_s,
            } => low + (high - low) * (1.0 - (std::f64::consts::TAU * t / period_s).cos()) / 2.0,
            &Self::Burst {
                base,
                peak,
                at_s,
                length_s,
                every_s,
            } => {
                let k = match every_s {
                    Some(e) if t >= at_s => ((t - at_s) / e).floor(),
                    _ => 0.0,
                };
                let start = at_s + k * every_s.unwrap_or(0.0);
                if t >= start && t < start + length_s {
                    peak
                } else {
                    base
                }
            }
        }
    }

    /// `Lambda(t)`: the expected requests in `[0, t]`.
    pub fn cumulative(&self, t: f64) -> f64 {
        let t = t.max(0.0);
        match self {
            Self::Steps(steps) => {
                let mut sum = 0.0;
                for (i, &(from, r)) in steps.iter().enumerate() {
                    if from >= t {
                        break;
                    }
                    let to = steps.get(i + 1).map_or(t, |s| s.0.min(t));
                    sum += r * (to - from);
                }
                sum
            }
            &Self::Diurnal {
                low,
                high,
                period_s,
            } => {
                let w = std::f64::consts::TAU / period_s;
                low * t + (high - low) / 2.0 * (t - (w * t).sin() / w)
            }
            &Self::Burst { base, peak, .. } => base * t + (peak - base) * self.burst_time(0.0, t),
        }
    }

    /// Seconds of `[a, b]` inside a burst (0 for other profiles).
    fn burst_time(&self, a: f64, b: f64) -> f64 {
        let &Self::Burst {
            at_s,
            length_s,
            every_s,
            ..
        } = self
        else {
            return 0.0;
        };
        let overlap = |start: f64| (b.min(start + length_s) - a.max(start)).max(0.0);
        let Some(every) = every_s else {
            return overlap(at_s);
        };
        if b <= at_s {
            return 0.0;
        }
        // Bursts k with start in (a - length, b): whole ones between.
        let first = ((a - at_s - length_s) / every).floor().max(0.0) as u64;
        let last = ((b - at_s) / every).floor() as u64;
        (first..=last)
            .map(|k| overlap(at_s + k as f64 * every))
            .sum()
    }

    /// The highest rate in `[0, until]`.
    pub fn peak(&self, until: f64) -> f64 {
        match self {
            Self::Steps(steps) => steps
                .iter()
                .filter(|&&(from, _)| from <= until)
                .map(|&(_, r)| r)
                .fold(0.0, f64::max),
            &Self::Diurnal { period_s, .. } => self.rate(until.min(period_s / 2.0)),
            &Self::Burst {
                base, peak, at_s, ..
            } => {
                if until >= at_s {
                    peak.max(base)
                } else {
                    base
                }
            }
        }
    }

    /// The times in `(0, until)` where the rate jumps up (a step or the start
    /// of a burst): the autoscaling figures leave out the start-up delay
    /// after each.
    pub fn rises(&self, until: f64) -> Vec<f64> {
        match self {
            Self::Steps(steps) => steps
                .windows(2)
                .filter(|w| w[1].1 > w[0].1 && w[1].0 < until)
                .map(|w| w[1].0)
                .collect(),
            Self::Diurnal { .. } => Vec::new(),
            &Self::Burst {
                base,
                peak,
                at_s,
                every_s,
                ..
            } => {
                if peak <= base {
                    return Vec::new();
                }
                let mut out = Vec::new();
                let mut t = at_s;
                while t < until && out.len() < MAX_STEPS {
                    out.push(t);
                    match every_s {
                        Some(e) => t += e,
                        None => break,
                    }
                }
                out
            }
        }
    }

    /// The first `t >= lo` with `Lambda(t) >= s`, given `Lambda(lo) <= s`;
    /// None when it is after `until`. Newton's method inside a bracket.
    fn time_of(&self, s: f64, mut lo: f64, until: f64) -> Option<f64> {
        let mut step = 1.0;
        let mut hi = lo + step;
        while self.cumulative(hi) < s {
            if hi > until {
                return None;
            }
            lo = hi;
            step *= 2.0;
            hi = lo + step;
        }
        let mut t = lo;
        for _ in 0..100 {
            let f = self.cumulative(t) - s;
            if f.abs() <= 1e-9 * s.max(1.0) || hi - lo <= 1e-12 * hi.max(1.0) {
                break;
            }
            if f < 0.0 {
                lo = t;
            } else {
                hi = t;
            }
            let r = self.rate(t);
            let newton = t - f / r;
            t = if r > 0.0 && newton > lo && newton < hi {
                newton
            } else {
                (lo + hi) / 2.0
            };
        }
        (t <= until).then_some(t)
    }

    /// The arrival times in `[0, duration_s]` of the unit-rate epochs
    /// `unit` (non-decreasing) under this profile.
    pub fn map(&self, unit: impl IntoIterator<Item = f64>, duration_s: f64) -> Vec<f64> {
        let mut out = Vec::new();
        let mut t = 0.0;
        for s in unit {
            match self.time_of(s, t, duration_s) {
                Some(x) => {
                    t = x;
                    out.push(x);
                }
                None => break,
            }
        }
        out
    }

    /// Poisson arrivals in `[0, duration_s]` (seeded).
    pub fn poisson(&self, duration_s: f64, seed: u64) -> Result<Vec<f64>> {
        positive("duration", duration_s)?;
        let mut rng = Rng::new(seed ^ 0x0005_EED0_FA11_7A7E);
        let mut s = 0.0;
        let epochs = std::iter::from_fn(move || {
            s += rng.exponential(1.0);
            Some(s)
        });
        Ok(self.map(epochs, duration_s))
    }

    /// A trace's own timestamps under this profile: shifted to 0, scaled to
    /// a mean rate of 1 and repeated end to end (each copy one mean gap
    /// after the last), then mapped; its burstiness is kept and its mean
    /// rate becomes the profile's. Timestamps that go backwards are refused.
    pub fn scaled_trace(&self, timestamps: &[f64], duration_s: f64) -> Result<Vec<f64>> {
        positive("duration", duration_s)?;
        check_timestamps(timestamps)?;
        let n = timestamps.len();
        let span = timestamps[n - 1] - timestamps[0];
        if n < 2 || span <= 0.0 {
            return Err(invalid(
                "a trace needs at least two distinct timestamps to scale",
            ));
        }
        let scale = (n - 1) as f64 / span;
        let t0 = timestamps[0];
        let epochs = (0u64..).flat_map(move |copy| {
            timestamps
                .iter()
                .map(move |&t| (t - t0) * scale + (copy * n as u64) as f64)
        });
        Ok(self.map(epochs, duration_s))
    }
}

/// Refuses timestamps that are not finite or go backwards, naming the first
/// such row.
pub fn check_timestamps(timestamps: &[f64]) -> Result<()> {
    if timestamps.is_empty() {
        return Err(invalid("the trace has no timestamps"));
    }
    for (i, &t) in timestamps.iter().enumerate() {
        finite(&format!("trace timestamp {i}"), t)?;
        if i > 0 && t < timestamps[i - 1] {
            return Err(invalid(format!(
                "trace timestamps go backwards at row {i}: {t} after {}",
                timestamps[i - 1]
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_to_their_profiles() {
        assert_eq!(
            RateProfile::parse("step:500@0,2000@600").expect("ok"),
            RateProfile::Steps(vec![(0.0, 500.0), (600.0, 2000.0)])
        );
        assert_eq!(
            RateProfile::parse("diurnal:low=1,high=3,period=100").expect("ok"),
            RateProfile::Diurnal {
                low: 1.0,
                high: 3.0,
                period_s: 100.0
            }
        );
        assert_eq!(
            RateProfile::parse("burst:base=1,peak=5,at=10,length=2,every=20").expect("ok"),
            RateProfile::Burst {
                base: 1.0,
                peak: 5.0,
                at_s: 10.0,
                length_s: 2.0,
                every_s: Some(20.0)
            }
        );
    }

    #[test]
    fn bad_specs_are_refused_with_the_reason() {
        for (spec, says) in [
            ("500", "expected step:"),
            ("ramp:1@0", "unknown kind"),
            ("step:500@10", "first step must be at 0"),
            ("step:500@0,2000@600,100@300", "times must increase"),
            ("step:500@0,x@10", "rate must be a number"),
            ("step:-5@0", "must be >= 0"),
            ("step:0@0", "every rate is 0"),
            ("step:500", "RATE@SECONDS"),
            ("diurnal:low=5,high=1,period=10", "above high"),
            ("diurnal:low=1,high=5", "period= is required"),
            ("diurnal:low=1,high=5,period=10,low=2", "given twice"),
            ("diurnal:low=1,high=5,period=nan", "finite"),
            ("diurnal:lo=1,high=5,period=10", "unknown key"),
            ("burst:base=1,peak=5,at=0,length=10,every=5", "above length"),
        ] {
            let e = RateProfile::parse(spec).expect_err("refused").to_string();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }

    /// Lambda is the integral of the rate: checked against a midpoint sum.
    #[test]
    fn cumulative_is_the_integral_of_the_rate() {
        for spec in [
            "step:500@0,2000@60,100@130",
            "diurnal:low=100,high=900,period=200",
            "burst:base=100,peak=400,at=30,length=15,every=50",
            "burst:base=100,peak=400,at=30,length=15",
        ] {
            let p = RateProfile::parse(spec).expect("ok");
            let dt = 0.001;
            let mut sum = 0.0;
            for k in 0..300_000 {
                sum += p.rate((k as f64 + 0.5) * dt) * dt;
                if (k + 1) % 50_000 == 0 {
                    let t = (k + 1) as f64 * dt;
                    let want = p.cumulative(t);
                    assert!(
                        (sum - want).abs() <= 1e-6 * want + 0.5,
                        "{spec} at {t}: {sum} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn rates_by_hand() {
        let d = RateProfile::parse("diurnal:low=100,high=300,period=200").expect("ok");
        assert_eq!(d.rate(0.0), 100.0);
        assert!((d.rate(100.0) - 300.0).abs() < 1e-9);
        assert!((d.rate(50.0) - 200.0).abs() < 1e-9);
        assert!((d.peak(1000.0) - 300.0).abs() < 1e-9);
        let b = RateProfile::parse("burst:base=1,peak=5,at=10,length=2,every=20").expect("ok");
        assert_eq!(
            (b.rate(9.9), b.rate(10.0), b.rate(11.9), b.rate(12.0)),
            (1.0, 5.0, 5.0, 1.0)
        );
        assert_eq!(b.rate(31.0), 5.0);
        assert_eq!(b.rises(55.0), vec![10.0, 30.0, 50.0]);
        let s = RateProfile::parse("step:500@0,2000@600,100@900").expect("ok");
        assert_eq!(
            (s.rate(599.0), s.rate(600.0), s.rate(1e6)),
            (500.0, 2000.0, 100.0)
        );
        assert_eq!(s.rises(1e6), vec![600.0]);
        assert_eq!(s.cumulative(700.0), 500.0 * 600.0 + 2000.0 * 100.0);
    }

    /// Poisson arrivals under a step: each segment's count is its expected
    /// count within 4 standard deviations, and times increase.
    #[test]
    fn poisson_arrivals_follow_the_profile() {
        let p = RateProfile::parse("step:200@0,1000@50").expect("ok");
        let t = p.poisson(100.0, 3).expect("ok");
        assert!(t.windows(2).all(|w| w[1] >= w[0]));
        assert!(t.iter().all(|&x| (0.0..=100.0).contains(&x)));
        let before = t.iter().filter(|&&x| x < 50.0).count() as f64;
        let after = t.len() as f64 - before;
        assert!(
            (before - 10_000.0).abs() < 4.0 * 10_000f64.sqrt(),
            "{before}"
        );
        assert!((after - 50_000.0).abs() < 4.0 * 50_000f64.sqrt(), "{after}");
    }

    /// A trace mapped through a constant profile is the trace scaled; under
    /// a step its requests keep their order and the count follows Lambda.
    #[test]
    fn a_scaled_trace_keeps_its_gaps() {
        let trace = [10.0, 10.5, 12.0, 12.25, 14.0];
        let flat = RateProfile::parse("step:2@0").expect("ok");
        let t = flat.scaled_trace(&trace, 4.1).expect("ok");
        // Unit epochs 0, 0.5, 2, 2.25, 4 (span 4 over 4 gaps), then copy two
        // from 5; at rate 2 each is halved.
        let want = [0.0, 0.25, 1.0, 1.125, 2.0, 2.5, 2.75, 3.5, 3.625];
        assert_eq!(t.len(), want.len(), "{t:?}");
        for (a, b) in t.iter().zip(want) {
            assert!((a - b).abs() < 1e-9, "{t:?}");
        }
        let step = RateProfile::parse("step:1@0,10@100").expect("ok");
        let t = step.scaled_trace(&trace, 200.0).expect("ok");
        assert!(
            (t.len() as f64 - step.cumulative(200.0)).abs() <= 2.0,
            "{}",
            t.len()
        );
    }

    #[test]
    fn timestamps_that_go_backwards_are_refused() {
        let p = RateProfile::parse("step:2@0").expect("ok");
        let e = p
            .scaled_trace(&[0.0, 2.0, 1.0], 10.0)
            .expect_err("refused")
            .to_string();
        assert!(e.contains("go backwards at row 2"), "{e}");
        let e = p
            .scaled_trace(&[0.0, f64::NAN], 10.0)
            .expect_err("refused")
            .to_string();
        assert!(e.contains("finite"), "{e}");
        assert!(p.scaled_trace(&[1.0, 1.0], 10.0).is_err());
    }
}
