//! The live workload of one pool (or one entitlement of it): over a sliding
//! window, the arrival rate, the moments the engine model needs and the
//! distributions of prompt and output tokens.
//!
//! The window is a ring of `sub_windows` sub-windows of `window_s /
//! sub_windows` seconds; the oldest is forgotten as time enters a new one,
//! so the window covers between `window_s - window_s / sub_windows` and
//! `window_s` seconds of the past. Each sub-window holds exact sums (count,
//! `k`, `k^2`, `k L_total`, `L_in`, `L_in^2`, `L_out` with
//! `k = ceil(L_in / C) + L_out`, the planner's definitions) and three
//! [`LogHistogram`]s (prompt tokens, output tokens, prefill chunks
//! `ceil(L_in / C)`), so the moments are exact and the quantiles within
//! `RELATIVE_ERROR` (3.125 %, exact below 32: a prefill quantile below 32
//! chunks is exact). Running totals of the histograms make a quantile one
//! scan of a histogram's buckets.
//!
//! Memory is fixed at construction: `(sub_windows + 1) * 3` histograms of
//! 3.3 KiB. Observing a request allocates nothing and costs O(1): a few
//! adds, and when time enters new sub-windows, forgetting at most
//! `sub_windows` of them (fixed-size work, once per sub-window).

use crate::budget::MAX_TOKENS;
use crate::error::{finite, invalid, positive, Result};
use crate::workload::RangeMoments;

use super::histogram::LogHistogram;
use super::trend::{self, Noise, SubWindow, Trend};

/// Most sub-windows of one window.
pub const MAX_SUB_WINDOWS: usize = 600;

/// Exact sums over the requests of a sub-window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums {
    /// Requests arrived ([`LiveWindow::arrive`]).
    arrivals: f64,
    /// Requests finished ([`LiveWindow::observe`]) and their sums.
    n: f64,
    k: f64,
    k2: f64,
    kl: f64,
    prompt: f64,
    prompt2: f64,
    output: f64,
}

impl Sums {
    fn add(&mut self, o: &Sums) {
        self.arrivals += o.arrivals;
        self.n += o.n;
        self.k += o.k;
        self.k2 += o.k2;
        self.kl += o.kl;
        self.prompt += o.prompt;
        self.prompt2 += o.prompt2;
        self.output += o.output;
    }
}

#[derive(Debug, Clone, Default)]
struct Hists {
    prompt: LogHistogram,
    output: LogHistogram,
    chunks: LogHistogram,
}

impl Hists {
    fn add(&mut self, o: &Hists, remove: bool) {
        self.prompt.add(&o.prompt, remove);
        self.output.add(&o.output, remove);
        self.chunks.add(&o.chunks, remove);
    }

    fn clear(&mut self) {
        self.prompt.clear();
        self.output.clear();
        self.chunks.clear();
    }
}

#[derive(Debug, Clone, Default)]
struct Slot {
    sums: Sums,
    hists: Hists,
}

/// Token percentiles (p50, p90, p99) of a window, each within the
/// histogram's stated error above the exact one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Percentiles {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
}

impl Percentiles {
    fn of(h: &LogHistogram) -> Self {
        Self {
            p50: h.quantile(0.50),
            p90: h.quantile(0.90),
            p99: h.quantile(0.99),
        }
    }
}

/// What a window saw: its rate, the engine model's moments and the token
/// distributions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LiveWorkload {
    /// Requests finished in the window (the token distributions' count).
    pub requests: u64,
    /// Seconds the window covers now (at least one sub-window, so a burst in
    /// a young window is not read as a huge rate).
    pub span_s: f64,
    /// Requests per second: arrivals over `span_s` once the window counts
    /// arrivals ([`LiveWindow::arrive`]), else `requests / span_s`.
    pub rate: f64,
    /// How fast the rate moves, requests per second per second: the
    /// least-squares slope of the sub-windows' rates over their midpoints
    /// (sub-windows under half full left out; 0 with fewer than two), over
    /// the sub-windows since a level shift when there is one (0 until three
    /// of them: [`super::trend`]).
    pub trend: f64,
    /// The rate the trend line reads now: the rate of the window (or of
    /// the sub-windows since a level shift) moved by `trend` from their
    /// middle to now.
    pub level: f64,
    /// Where a level shift (a step) in the window is, when one is found:
    /// the start of the first sub-window after it.
    pub shift_s: Option<f64>,
    /// How far the trend line moves with the arrivals' Poisson noise.
    pub noise: Noise,
    /// The rate of the newest sub-window at least half full (the window's
    /// rate when none is): the current rate a forecast is bounded by.
    pub newest_rate: f64,
    /// Moments of `k = ceil(L_in / C) + L_out`, of `k L_total` and of `L_in`
    /// (weight: the request count), as the planner's `EngineLoad` takes them.
    pub k: RangeMoments,
    pub kl: RangeMoments,
    pub prompt: RangeMoments,
    /// Mean output tokens.
    pub output_mean: f64,
    pub prompt_tokens: Percentiles,
    pub output_tokens: Percentiles,
    /// The `(1 + q) / 2` quantile of `ceil(L_in / C)` for the `q` asked,
    /// and the fewest chunks of any request.
    pub prefill_chunks_q: f64,
    pub prefill_chunks_min: f64,
}

impl LiveWorkload {
    /// Mean prompt plus output tokens of a request (0 with no traffic).
    pub fn mean_tokens(&self) -> f64 {
        self.prompt.mean + self.output_mean
    }
}

/// Refuses a request a window cannot count: `now` not finite, a token count
/// above `MAX_TOKENS`.
pub fn check(now: f64, prompt: u64, output: u64) -> Result<()> {
    finite("now", now)?;
    for (what, v) in [("prompt_tokens", prompt), ("output_tokens", output)] {
        if v > MAX_TOKENS {
            return Err(invalid(format!(
                "{what} must be in [0, {MAX_TOKENS}], got {v}"
            )));
        }
    }
    Ok(())
}

/// A sliding window over the requests of one pool or entitlement.
#[derive(Debug, Clone)]
pub struct LiveWindow {
    sub_s: f64,
    c_chunk: u64,
    start_s: f64,
    last_s: f64,
    /// The sub-window `now` falls in, counted from `start_s`.
    epoch: u64,
    slots: Vec<Slot>,
    totals: Hists,
    /// Whether arrivals are counted: then the rate is theirs, else the
    /// finished requests'.
    counts_arrivals: bool,
}

impl LiveWindow {
    /// A window of `window_s` seconds in `sub_windows` parts, starting at
    /// `now`, for engines whose prefill chunk is `c_chunk` tokens.
    pub fn new(window_s: f64, sub_windows: usize, c_chunk: u64, now: f64) -> Result<Self> {
        positive("window_s", window_s)?;
        finite("now", now)?;
        if !(1..=MAX_SUB_WINDOWS).contains(&sub_windows) {
            return Err(invalid(format!(
                "sub_windows must be in [1, {MAX_SUB_WINDOWS}], got {sub_windows}"
            )));
        }
        if c_chunk == 0 {
            return Err(invalid("c_chunk must be >= 1"));
        }
        Ok(Self {
            sub_s: window_s / sub_windows as f64,
            c_chunk,
            start_s: now,
            last_s: now,
            epoch: 0,
            slots: vec![Slot::default(); sub_windows],
            totals: Hists::default(),
            counts_arrivals: false,
        })
    }

    /// Moves the window to `now` (never backwards: an earlier `now` is taken
    /// as the latest seen), forgetting the sub-windows that left it.
    fn advance(&mut self, now: f64) {
        self.last_s = self.last_s.max(now);
        let e = ((self.last_s - self.start_s) / self.sub_s).floor() as u64;
        if e <= self.epoch {
            return;
        }
        let n = self.slots.len() as u64;
        // The slots of epochs epoch+1 ..= e held epochs up to `n` before:
        // all left the window. At most `n` of them.
        for epoch in self.epoch + 1..=e.min(self.epoch + n) {
            let slot = &mut self.slots[(epoch % n) as usize];
            if slot.sums.n > 0.0 || slot.sums.arrivals > 0.0 {
                self.totals.add(&slot.hists, true);
                slot.hists.clear();
                slot.sums = Sums::default();
            }
        }
        self.epoch = e;
    }

    /// Counts one request arriving at `now` (seconds, the caller's
    /// monotonic clock): once a window is told of arrivals, its rate is the
    /// arrivals' (a pool whose endpoints fall behind finishes requests at
    /// the rate they serve, not at the rate that comes). Allocation-free.
    pub fn arrive(&mut self, now: f64) -> Result<()> {
        finite("now", now)?;
        self.advance(now);
        let n = self.slots.len() as u64;
        self.slots[(self.epoch % n) as usize].sums.arrivals += 1.0;
        self.counts_arrivals = true;
        Ok(())
    }

    /// What the rate counts in `s`: arrivals when they are counted, else
    /// finished requests.
    fn count(&self, s: &Sums) -> f64 {
        if self.counts_arrivals {
            s.arrivals
        } else {
            s.n
        }
    }

    /// Counts one finished request of `prompt` and `output` tokens at `now`
    /// (seconds, the caller's monotonic clock): its token counts, and the
    /// rate while no arrival is counted. Allocation-free.
    pub fn observe(&mut self, now: f64, prompt: u64, output: u64) -> Result<()> {
        check(now, prompt, output)?;
        self.advance(now);
        let n = self.slots.len() as u64;
        let slot = &mut self.slots[(self.epoch % n) as usize];
        let chunks = prompt.div_ceil(self.c_chunk);
        let k = (chunks + output) as f64;
        let (p, total) = (prompt as f64, (prompt + output) as f64);
        slot.sums.add(&Sums {
            arrivals: 0.0,
            n: 1.0,
            k,
            k2: k * k,
            kl: k * total,
            prompt: p,
            prompt2: p * p,
            output: output as f64,
        });
        for h in [&mut slot.hists, &mut self.totals] {
            h.prompt.record(prompt);
            h.output.record(output);
            h.chunks.record(chunks);
        }
        Ok(())
    }

    /// The window at `now`; `quantile` is the SLO's share `q` (the prefill
    /// chunk quantile is taken at `(1 + q) / 2`, as the planner does).
    pub fn live(&mut self, now: f64, quantile: f64) -> Result<LiveWorkload> {
        finite("now", now)?;
        if !(0.0..=1.0).contains(&quantile) {
            return Err(invalid(format!(
                "quantile must be in [0, 1], got {quantile}"
            )));
        }
        self.advance(now);
        let mut s = Sums::default();
        for slot in &self.slots {
            s.add(&slot.sums);
        }
        let n = self.slots.len() as f64;
        let oldest = self.start_s + (self.epoch as f64 + 1.0 - n).max(0.0) * self.sub_s;
        let span_s = (self.last_s - oldest).max(self.sub_s);
        let moments = |sum: f64, second: f64| {
            if s.n > 0.0 {
                RangeMoments {
                    weight: s.n,
                    mean: sum / s.n,
                    second: second / s.n,
                }
            } else {
                RangeMoments::EMPTY
            }
        };
        let (trend, newest) = self.trend();
        let rate = self.count(&s) / span_s;
        Ok(LiveWorkload {
            requests: s.n as u64,
            span_s,
            rate,
            trend: trend.slope,
            level: trend.level(),
            shift_s: trend.shift_s,
            noise: trend.noise,
            newest_rate: newest.unwrap_or(rate),
            k: moments(s.k, s.k2),
            kl: moments(s.kl, 0.0),
            prompt: moments(s.prompt, s.prompt2),
            output_mean: if s.n > 0.0 { s.output / s.n } else { 0.0 },
            prompt_tokens: Percentiles::of(&self.totals.prompt),
            output_tokens: Percentiles::of(&self.totals.output),
            prefill_chunks_q: self.totals.chunks.quantile((1.0 + quantile) / 2.0) as f64,
            prefill_chunks_min: self.totals.chunks.quantile(0.0) as f64,
        })
    }

    /// The trend of the sub-windows' rates ([`super::trend::estimate`])
    /// and the newest counted sub-window's rate.
    fn trend(&self) -> (Trend, Option<f64>) {
        let n = self.slots.len() as u64;
        let subs: Vec<SubWindow> = (self.epoch.saturating_sub(n - 1)..=self.epoch)
            .map(|e| {
                let start_s = self.start_s + e as f64 * self.sub_s;
                SubWindow {
                    start_s,
                    covered_s: (self.last_s.min(start_s + self.sub_s) - start_s).max(0.0),
                    count: self.count(&self.slots[(e % n) as usize].sums),
                }
            })
            .collect();
        let newest = subs
            .iter()
            .rev()
            .find(|s| s.covered_s >= self.sub_s / 2.0)
            .map(|s| s.count / s.covered_s);
        (trend::estimate(&subs, self.last_s, self.sub_s), newest)
    }

    /// Appends the window's `(prefill chunks, count)` pairs (the planner's
    /// chunk distribution; exact below 32 chunks, each bucket at its upper
    /// edge above). Reads the window as its last `live` or `observe` left it.
    pub fn chunk_distribution(&self, out: &mut Vec<(u64, f64)>) {
        out.extend(self.totals.chunks.buckets().map(|(k, c)| (k, c as f64)));
    }
}
