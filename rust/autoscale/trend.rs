//! The rate's trend over a window's sub-windows, telling a step from a ramp.
//!
//! A least-squares line through the sub-windows' rates reads a ramp well,
//! but a step inside the window (500 req/s, then 2,000) reads as a steep
//! ramp, which extrapolated past now sizes for a rate that never comes. So
//! the line is tested against a level shift first: two constant levels, the
//! later one from some sub-window to now (the sub-window just before it may
//! be left out: a step inside it mixes both levels). Each sub-window's rate
//! is weighted by its Poisson noise (`count / covered^2`); a shift is
//! declared when it explains the rates better than the line by more than
//! [`SHIFT_CHI2`] and leaves at most a [`SHIFT_RATIO`] of the line's misfit
//! (a ramp is fitted by the line to its noise, and no step does better).
//! After a shift only the sub-windows from it on count: their rate is the
//! level, and their slope the trend once [`MIN_SHIFTED`] of them are full
//! enough (until then no slope: one or two of them say nothing of one).
//!
//! Pure, O(n) in the number of sub-windows (prefix sums over the splits);
//! it runs once per sizing step, never on a request.

/// One sub-window: when it starts, how many seconds of it have passed
/// (its length once complete) and the requests it counted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SubWindow {
    pub start_s: f64,
    pub covered_s: f64,
    pub count: f64,
}

impl SubWindow {
    fn rate(&self) -> f64 {
        self.count / self.covered_s
    }

    fn mid(&self) -> f64 {
        self.start_s + self.covered_s / 2.0
    }

    /// The inverse of the variance of its rate (Poisson: `count` for the
    /// count, at least one request's worth).
    fn weight(&self) -> f64 {
        self.covered_s * self.covered_s / self.count.max(1.0)
    }
}

/// A shift's misfit must be this much below the line's (chi-square units:
/// a 5-sigma improvement) ...
pub const SHIFT_CHI2: f64 = 25.0;
/// ... and at most this share of it.
pub const SHIFT_RATIO: f64 = 0.25;
/// What leaving a sub-window out costs a split (chi-square units): only one
/// off both levels by more than 2 sigma is taken for the mix of a step.
pub const GAP_PENALTY: f64 = 4.0;
/// Sub-windows after a shift needed before their slope is read as a trend.
pub const MIN_SHIFTED: usize = 3;

/// What the sub-windows say about the rate now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Trend {
    /// Requests per second per second (0 with fewer than two sub-windows,
    /// or fewer than [`MIN_SHIFTED`] after a shift).
    pub slope: f64,
    /// The rate of the segment the trend reads (the whole window, or the
    /// sub-windows since the shift), over its seconds up to now.
    pub rate: f64,
    /// Seconds that segment covers up to now.
    pub span_s: f64,
    /// Where the level shift is, when one is found: the start of the
    /// first sub-window after it.
    pub shift_s: Option<f64>,
    /// How much the line moves with the arrivals' noise.
    pub noise: Noise,
}

impl Trend {
    /// The trend line's rate at now: the segment's rate moved by the
    /// slope from the segment's middle to now.
    pub fn level(&self) -> f64 {
        self.rate + self.slope * self.span_s / 2.0
    }
}

/// The standard error of the trend line's value under Poisson arrivals
/// (each fitted sub-window's rate of variance `rate / sub_s`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Noise {
    /// The variance of one sub-window's rate, and of the segment's rate.
    pub point_var: f64,
    pub rate_var: f64,
    /// With a slope: the fitted sub-windows, their midpoints' mean before
    /// now (seconds) and their sum of squares about it (0: no slope).
    pub n: f64,
    pub back_s: f64,
    pub sxx: f64,
}

impl Noise {
    /// The standard error of the line's rate `ahead_s` past now: of the
    /// least-squares line's prediction there, or of the level without a
    /// slope.
    pub fn se(&self, ahead_s: f64) -> f64 {
        if self.sxx <= 0.0 {
            return self.rate_var.sqrt();
        }
        let x = self.back_s + ahead_s;
        (self.point_var * (1.0 / self.n + x * x / self.sxx)).sqrt()
    }
}

/// The unweighted least-squares slope of `subs`' rates over their
/// midpoints (0 with fewer than two, or all at one time).
fn slope(subs: &[SubWindow]) -> f64 {
    let n = subs.len() as f64;
    let (mut st, mut sr, mut stt, mut str_) = (0.0f64, 0.0, 0.0, 0.0);
    for s in subs {
        let (t, r) = (s.mid(), s.rate());
        st += t;
        sr += r;
        stt += t * t;
        str_ += t * r;
    }
    let var = stt - st * st / n.max(1.0);
    if subs.len() < 2 || var <= 0.0 {
        return 0.0;
    }
    (str_ - st * sr / n) / var
}

/// The weighted misfit (chi-square) of the line of slope `b` through the
/// unweighted means of `subs`.
fn line_misfit(subs: &[SubWindow], b: f64) -> f64 {
    let n = subs.len() as f64;
    let t0 = subs.iter().map(SubWindow::mid).sum::<f64>() / n;
    let r0 = subs.iter().map(SubWindow::rate).sum::<f64>() / n;
    subs.iter()
        .map(|s| {
            let e = s.rate() - (r0 + b * (s.mid() - t0));
            s.weight() * e * e
        })
        .sum()
}

/// Weighted sums of a run of sub-windows: `sum w`, `sum w r`, `sum w r^2`.
#[derive(Debug, Clone, Copy, Default)]
struct Sums(f64, f64, f64);

impl Sums {
    fn add(self, s: &SubWindow) -> Self {
        let (w, r) = (s.weight(), s.rate());
        Self(self.0 + w, self.1 + w * r, self.2 + w * r * r)
    }

    fn sub(self, o: Self) -> Self {
        Self(self.0 - o.0, self.1 - o.1, self.2 - o.2)
    }

    /// The misfit of one constant level (the weighted mean).
    fn misfit(self) -> f64 {
        if self.0 <= 0.0 {
            return 0.0;
        }
        (self.2 - self.1 * self.1 / self.0).max(0.0)
    }
}

/// Where a level shift splits `full` (the index of the first sub-window
/// after it), when two levels explain the rates far better than `line`.
fn shift(full: &[SubWindow], line: f64) -> Option<usize> {
    let n = full.len();
    if n < 3 {
        return None;
    }
    let mut prefix = Vec::with_capacity(n + 1);
    prefix.push(Sums::default());
    for s in full {
        prefix.push(prefix[prefix.len() - 1].add(s));
    }
    let mut best: Option<(f64, usize)> = None;
    for j in 1..n {
        let after = prefix[n].sub(prefix[j]).misfit();
        // Before: up to j (no gap), or up to j - 1 (the sub-window before
        // the shift left out as a mix of both levels).
        let no_gap = prefix[j].misfit() + after;
        let gap = (j >= 2).then(|| prefix[j - 1].misfit() + after + GAP_PENALTY);
        for m in std::iter::once(no_gap).chain(gap) {
            if best.is_none_or(|(b, _)| m < b) {
                best = Some((m, j));
            }
        }
    }
    let (misfit, j) = best?;
    (line - misfit > SHIFT_CHI2 && misfit <= SHIFT_RATIO * line).then_some(j)
}

/// The trend of a window's sub-windows (oldest first, each `sub_s`
/// seconds long) at `now`. Only those at least half full are fitted (a
/// sub-window just begun says little); all count in the rate, which is
/// over at least one sub-window for the whole window (a burst in a young
/// window is not read as a huge rate).
pub fn estimate(subs: &[SubWindow], now: f64, sub_s: f64) -> Trend {
    let full: Vec<SubWindow> = subs
        .iter()
        .filter(|s| s.covered_s >= sub_s / 2.0)
        .copied()
        .collect();
    let b = slope(&full);
    let cut = shift(&full, line_misfit(&full, b));
    let (from, b, min_span) = match cut {
        Some(j) => {
            let after = &full[j..];
            let b = if after.len() >= MIN_SHIFTED {
                slope(after)
            } else {
                0.0
            };
            (full[j].start_s, b, 0.0)
        }
        None => (subs.first().map_or(now, |s| s.start_s), b, sub_s),
    };
    let count: f64 = subs
        .iter()
        .filter(|s| s.start_s >= from)
        .map(|s| s.count)
        .sum();
    let span_s = (now - from).max(min_span);
    let rate = if span_s > 0.0 { count / span_s } else { 0.0 };
    let mut noise = Noise {
        point_var: rate / sub_s,
        rate_var: if span_s > 0.0 { rate / span_s } else { 0.0 },
        ..Noise::default()
    };
    let fitted: Vec<f64> = full
        .iter()
        .filter(|s| s.start_s >= from)
        .map(SubWindow::mid)
        .collect();
    if b != 0.0 && fitted.len() >= 2 {
        let n = fitted.len() as f64;
        let mean = fitted.iter().sum::<f64>() / n;
        noise.n = n;
        noise.back_s = now - mean;
        noise.sxx = fitted.iter().map(|t| (t - mean) * (t - mean)).sum();
    }
    Trend {
        slope: b,
        rate,
        span_s,
        shift_s: cut.map(|_| from),
        noise,
    }
}
