//! Workloads: the request-length distribution a fleet is planned for.
//!
//! A `Workload` is a list of requests, each with input (prompt) tokens, output
//! tokens, a weight (1 for a trace row), an optional arrival time and a
//! category. It answers, exactly and fast:
//!
//! - the CDF `F(x)` of total tokens `L_total = L_in + L_out` and its quantiles;
//! - the moments of any per-request quantity of the form
//!   `S = k * (a0 + a1 * L_total)` with `k = ceil(L_in / C_chunk) + L_out`
//!   (FleetOpt Eq. 4 with a constant or a length-scaled iteration time),
//!   restricted to any total-token range `(lo, hi]` and category, from
//!   prefix sums over the requests sorted by total tokens: every range costs two
//!   binary searches and a few subtractions, O(log n), never Monte Carlo;
//! - weighted quantiles of the prefill chunk count `ceil(L_in / C_chunk)` over
//!   any such range, from a wavelet matrix (O(log n + log max_chunks)).
//!
//! Requests are stored in the order given; `order` sorts them by total tokens.

use std::sync::{Arc, Mutex};

use crate::error::{invalid, Result};

/// Largest token count of one request (input or output) the core accepts.
pub const MAX_REQUEST_TOKENS: u64 = 1 << 32;
/// Most distinct category labels a workload may carry.
pub const MAX_CATEGORIES: usize = 256;
/// Most breakpoints (and most distinct token lengths) `from_cdf` expands.
pub const MAX_CDF_TOKENS: u64 = 1 << 22;

/// Indices into the total-token-sorted order: requests `start..end` have
/// `lo < L_total <= hi`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

#[derive(Debug)]
pub struct Workload {
    input: Vec<u64>,
    output: Vec<u64>,
    weight: Vec<f64>,
    arrival_s: Option<Vec<f64>>,
    category_names: Vec<String>,
    category: Vec<u32>,
    /// Request indices sorted by total tokens (stable).
    order: Vec<u32>,
    sorted_total: Vec<u64>,
    /// `buckets[j]`: how many of `sorted_total` are below `j << bucket_shift`
    /// (at most [`MAX_BUCKETS`] + 1 of them): a span's ends are searched in
    /// one bucket, not the whole trace (the planner's sweep asks for about
    /// 200 of them).
    bucket_shift: u32,
    buckets: Vec<u32>,
    /// Prefix sums of weight over `order`, length n + 1.
    cum_weight: Vec<f64>,
    /// Prefix sums of weight per category over `order`, each length n + 1.
    cum_weight_by_category: Vec<Vec<f64>>,
    /// Prefix sums of weight * total tokens over `order`.
    cum_tokens: Vec<f64>,
    tables: Mutex<Vec<Arc<ServiceTable>>>,
}

/// Most buckets of a workload's span index (see [`Workload`]).
const MAX_BUCKETS: u64 = 4096;

/// The span index of sorted totals: the shift that makes at most
/// [`MAX_BUCKETS`] buckets, and how many totals lie below each bucket's start
/// (one more entry, past the largest total).
fn buckets(sorted_total: &[u64]) -> (u32, Vec<u32>) {
    let max = sorted_total.last().copied().unwrap_or(0);
    let shift = (u64::BITS - (max / MAX_BUCKETS).leading_zeros()).min(63);
    let count = (max >> shift) as usize + 2;
    let mut buckets = Vec::with_capacity(count);
    let mut below = 0usize;
    for j in 0..count as u64 {
        let start = j.saturating_mul(1 << shift);
        while below < sorted_total.len() && sorted_total[below] < start {
            below += 1;
        }
        buckets.push(below as u32);
    }
    (shift, buckets)
}

/// The weighted moments of one range of a workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RangeMoments {
    /// Sum of weights in the range.
    pub weight: f64,
    /// E[S] over the range (0 when empty).
    pub mean: f64,
    /// E[S^2] over the range (0 when empty).
    pub second: f64,
}

impl RangeMoments {
    pub const EMPTY: RangeMoments = RangeMoments {
        weight: 0.0,
        mean: 0.0,
        second: 0.0,
    };

    /// The moments of the union of two disjoint ranges (the mixture).
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn merge(self, other: RangeMoments) -> RangeMoments {
        let weight = self.weight + other.weight;
        if weight <= 0.0 {
            return RangeMoments::EMPTY;
        }
        let (a, b) = (self.weight / weight, other.weight / weight);
        RangeMoments {
            weight,
            mean: a * self.mean + b * other.mean,
            second: a * self.second + b * other.second,
        }
    }

    /// `Var[S] / E[S]^2`, the squared coefficient of variation (0 when empty).
    pub fn cs2(&self) -> f64 {
        if self.mean > 0.0 {
            ((self.second - self.mean * self.mean) / (self.mean * self.mean)).max(0.0)
        } else {
            0.0
        }
    }
}

fn check_tokens(what: &str, i: usize, v: i64) -> Result<u64> {
    if v < 0 || v as u64 > MAX_REQUEST_TOKENS {
        return Err(invalid(format!(
            "{what}[{i}] must be in [0, {MAX_REQUEST_TOKENS}], got {v}"
        )));
    }
    Ok(v as u64)
}

impl Workload {
    /// A workload from per-request token counts (each in `[0, 2^32]`, total >= 1),
    /// optional arrival times in seconds (finite, >= 0, non-decreasing) and
    /// optional category labels (at most `MAX_CATEGORIES` distinct ones).
    pub fn new(
        input: &[i64],
        output: &[i64],
        arrival_s: Option<&[f64]>,
        categories: Option<&[String]>,
    ) -> Result<Self> {
        let n = input.len();
        let ones = vec![1.0; n];
        Self::build(input, output, &ones, arrival_s, categories)
    }

    fn build(
        input: &[i64],
        output: &[i64],
        weight: &[f64],
        arrival_s: Option<&[f64]>,
        categories: Option<&[String]>,
    ) -> Result<Self> {
        let n = input.len();
        if n == 0 {
            return Err(invalid("a workload needs at least one request"));
        }
        if n > u32::MAX as usize {
            return Err(invalid(format!("at most {} requests, got {n}", u32::MAX)));
        }
        if output.len() != n {
            return Err(invalid(format!(
                "input_tokens has {n} entries but output_tokens has {}",
                output.len()
            )));
        }
        let mut inp = Vec::with_capacity(n);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let a = check_tokens("input_tokens", i, input[i])?;
            let b = check_tokens("output_tokens", i, output[i])?;
            if a + b == 0 {
                return Err(invalid(format!(
                    "request {i} has no tokens (input + output must be >= 1)"
                )));
            }
            inp.push(a);
            out.push(b);
        }
        let arrival = match arrival_s {
            None => None,
            Some(t) => {
                if t.len() != n {
                    return Err(invalid(format!(
                        "arrival_s has {} entries for {n} requests",
                        t.len()
                    )));
                }
                let mut prev = 0.0;
                for (i, &x) in t.iter().enumerate() {
                    if !x.is_finite() || x < prev {
                        return Err(invalid(format!(
                            "arrival_s must be finite, >= 0 and non-decreasing; arrival_s[{i}] = {x}"
                        )));
                    }
                    prev = x;
                }
                Some(t.to_vec())
            }
        };
        let (category_names, category) = match categories {
            None => (Vec::new(), vec![0u32; n]),
            Some(labels) => {
                if labels.len() != n {
                    return Err(invalid(format!(
                        "categories has {} entries for {n} requests",
                        labels.len()
                    )));
                }
                let mut names: Vec<String> = Vec::new();
                let mut ids = Vec::with_capacity(n);
                for (i, label) in labels.iter().enumerate() {
                    if label.is_empty() {
                        return Err(invalid(format!("categories[{i}] is empty")));
                    }
                    let id = match names.iter().position(|x| x == label) {
                        Some(id) => id,
                        None => {
                            if names.len() == MAX_CATEGORIES {
                                return Err(invalid(format!(
                                    "at most {MAX_CATEGORIES} distinct categories"
                                )));
                            }
                            names.push(label.clone());
                            names.len() - 1
                        }
                    };
                    ids.push(id as u32);
                }
                (names, ids)
            }
        };
        let total: Vec<u64> = inp.iter().zip(&out).map(|(a, b)| a + b).collect();
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by_key(|&i| total[i as usize]);
        let sorted_total: Vec<u64> = order.iter().map(|&i| total[i as usize]).collect();
        let (bucket_shift, buckets) = buckets(&sorted_total);
        let n_cat = category_names.len().max(1);
        let mut cum_weight = Vec::with_capacity(n + 1);
        let mut cum_tokens = Vec::with_capacity(n + 1);
        let mut by_cat = vec![Vec::with_capacity(n + 1); n_cat];
        let (mut w_sum, mut t_sum) = (0.0, 0.0);
        let mut cat_sum = vec![0.0; n_cat];
        cum_weight.push(0.0);
        cum_tokens.push(0.0);
        for c in by_cat.iter_mut() {
            c.push(0.0);
        }
        for &i in &order {
            let i = i as usize;
            w_sum += weight[i];
            t_sum += weight[i] * total[i] as f64;
            cat_sum[category[i] as usize] += weight[i];
            cum_weight.push(w_sum);
            cum_tokens.push(t_sum);
            for (c, s) in by_cat.iter_mut().zip(&cat_sum) {
                c.push(*s);
            }
        }
        Ok(Self {
            input: inp,
            output: out,
            weight: weight.to_vec(),
            arrival_s: arrival,
            category_names,
            category,
            order,
            sorted_total,
            bucket_shift,
            buckets,
            cum_weight,
            cum_weight_by_category: by_cat,
            cum_tokens,
            tables: Mutex::new(Vec::new()),
        })
    }

    /// The distribution given by a piecewise-linear CDF of total tokens.
    ///
    /// `points` are `(tokens, F)` breakpoints, tokens strictly increasing
    /// integers >= 1, F non-decreasing in [0, 1] ending at 1; `F(0) = 0`. The
    /// mass `F(t_k) - F(t_{k-1})` spreads uniformly over the integer lengths
    /// `t_{k-1} + 1 ..= t_k` (linear interpolation of the CDF, the way the
    /// FleetOpt planner's public implementation samples it), so the workload
    /// holds one weighted request per integer length. Each length `L` splits
    /// into `L_in = max(1, floor(input_fraction * L))` and `L_out = L - L_in`.
    pub fn from_cdf(points: &[(i64, f64)], input_fraction: f64) -> Result<Self> {
        if points.is_empty() {
            return Err(invalid("a CDF needs at least one breakpoint"));
        }
        if !(input_fraction.is_finite() && input_fraction > 0.0 && input_fraction <= 1.0) {
            return Err(invalid(format!(
                "input_fraction must be in (0, 1], got {input_fraction}"
            )));
        }
        let (mut prev_t, mut prev_f) = (0i64, 0.0f64);
        for &(t, f) in points {
            if t <= prev_t || t as u64 > MAX_CDF_TOKENS {
                return Err(invalid(format!(
                    "CDF tokens must be strictly increasing integers in [1, {MAX_CDF_TOKENS}], got {t} after {prev_t}"
                )));
            }
            if !(f.is_finite() && (prev_f..=1.0).contains(&f)) {
                return Err(invalid(format!(
                    "CDF values must be non-decreasing in [0, 1], got {f} after {prev_f}"
                )));
            }
            prev_t = t;
            prev_f = f;
        }
        if (prev_f - 1.0).abs() > 1e-9 {
            return Err(invalid(format!("the CDF must end at 1, got {prev_f}")));
        }
        let (mut input, mut output, mut weight) = (Vec::new(), Vec::new(), Vec::new());
        let (mut prev_t, mut prev_f) = (0i64, 0.0f64);
        for &(t, f) in points {
            let mass = f - prev_f;
            if mass > 0.0 {
                let w = mass / (t - prev_t) as f64;
                for len in prev_t + 1..=t {
                    let l_in = ((input_fraction * len as f64).floor() as i64).max(1);
                    input.push(l_in);
                    output.push(len - l_in);
                    weight.push(w);
                }
            }
            prev_t = t;
            prev_f = f;
        }
        Self::build(&input, &output, &weight, None, None)
    }

    pub fn len(&self) -> usize {
        self.input.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input.is_empty()
    }

    pub fn input_tokens(&self) -> &[u64] {
        &self.input
    }

    pub fn output_tokens(&self) -> &[u64] {
        &self.output
    }

    pub fn weights(&self) -> &[f64] {
        &self.weight
    }

    pub fn arrival_s(&self) -> Option<&[f64]> {
        self.arrival_s.as_deref()
    }

    /// Distinct category labels in first-seen order (empty if none were given).
    pub fn category_names(&self) -> &[String] {
        &self.category_names
    }

    /// Per-request category ids into `category_names` (all 0 if none were given).
    pub fn category_ids(&self) -> &[u32] {
        &self.category
    }

    pub fn total_weight(&self) -> f64 {
        self.cum_weight[self.len()]
    }

    /// The requests with `lo < L_total <= hi`, as a span of the sorted order.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn span(&self, lo: f64, hi: f64) -> Span {
        let start = self.at_most(lo);
        Span {
            start,
            end: self.at_most(hi).max(start),
        }
    }

    /// The span `lo < L_total <= hi` given that `from` requests (in sorted
    /// order) are known to have `L_total <= lo`.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn span_from(&self, from: usize, hi: f64) -> Span {
        Span {
            start: from,
            end: self.at_most(hi).max(from.min(self.len())),
        }
    }

    /// How many requests have `L_total <= x`: a binary search inside the
    /// bucket of `x`.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    fn at_most(&self, x: f64) -> usize {
        if x.is_nan() || x < 0.0 {
            return 0;
        }
        // The cast truncates (the floor of x >= 0, without the call `floor`
        // is on a CPU without SSE4.1) and saturates at u64::MAX beyond u64.
        let j = (x as u64 >> self.bucket_shift) as usize;
        let bucket = |k: Option<usize>| k.and_then(|k| self.buckets.get(k)).copied();
        let (Some(lo), Some(hi)) = (bucket(Some(j)), bucket(j.checked_add(1))) else {
            return self.len();
        };
        let (lo, hi) = (lo as usize, hi as usize);
        lo + partition_point(&self.sorted_total[lo..hi], |&t| (t as f64) <= x)
    }

    /// Weight of a span divided by the total weight.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn fraction(&self, span: Span) -> f64 {
        (self.cum_weight[span.end] - self.cum_weight[span.start]) / self.total_weight()
    }

    /// Weight fraction of category `category` in a span.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn category_fraction(&self, span: Span, category: usize) -> f64 {
        let c = &self.cum_weight_by_category[category];
        (c[span.end] - c[span.start]) / self.total_weight()
    }

    /// Number of category channels (1 when the workload has no labels).
    pub fn category_channels(&self) -> usize {
        self.cum_weight_by_category.len()
    }

    /// `F(x)`: the weight fraction of requests with `L_total <= x`.
    pub fn cdf(&self, x: f64) -> f64 {
        self.fraction(self.span(f64::NEG_INFINITY, x))
    }

    /// The smallest total `x` in the workload with `F(x) >= q`, q in [0, 1].
    pub fn quantile(&self, q: f64) -> Result<u64> {
        if !(q.is_finite() && (0.0..=1.0).contains(&q)) {
            return Err(invalid(format!("q must be in [0, 1], got {q}")));
        }
        let target = q * self.total_weight();
        // First sorted position whose cumulative weight reaches the target,
        // with a relative tolerance so q = 1 lands on the largest request.
        let tol = 1e-12 * self.total_weight();
        let pos = self.cum_weight[1..].partition_point(|&c| c < target - tol);
        Ok(self.sorted_total[pos.min(self.len() - 1)])
    }

    /// Weighted mean total tokens of a span (0 when empty).
    pub fn mean_tokens(&self, span: Span) -> f64 {
        let w = self.cum_weight[span.end] - self.cum_weight[span.start];
        if w > 0.0 {
            (self.cum_tokens[span.end] - self.cum_tokens[span.start]) / w
        } else {
            0.0
        }
    }

    /// `n` requests drawn with replacement in proportion to their weights
    /// (seeded, `crate::rng`), unit weights, categories kept, no arrival
    /// times: a trace-shaped sample of a `from_cdf` distribution, or a
    /// bootstrap of a trace. `n` in [1, 10^8].
    pub fn sample(&self, n: usize, seed: u64) -> Result<Workload> {
        if n == 0 || n > 100_000_000 {
            return Err(invalid(format!("n must be in [1, 100000000], got {n}")));
        }
        let mut rng = crate::rng::Rng::new(seed);
        let total = self.total_weight();
        let (mut input, mut output, mut labels) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::new());
        for _ in 0..n {
            let u = rng.uniform() * total;
            let pos = self.cum_weight[1..]
                .partition_point(|&c| c <= u)
                .min(self.len() - 1);
            let i = self.order[pos] as usize;
            input.push(self.input[i] as i64);
            output.push(self.output[i] as i64);
            if !self.category_names.is_empty() {
                labels.push(self.category_names[self.category[i] as usize].clone());
            }
        }
        let cats = (!self.category_names.is_empty()).then_some(labels.as_slice());
        Workload::new(&input, &output, None, cats)
    }

    /// The prefix-sum table for chunk size `c_chunk` (built once, then shared).
    pub fn service_table(&self, c_chunk: u64) -> Result<Arc<ServiceTable>> {
        if c_chunk == 0 {
            return Err(invalid("c_chunk must be >= 1"));
        }
        let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = tables.iter().find(|t| t.c_chunk == c_chunk) {
            return Ok(Arc::clone(t));
        }
        let table = Arc::new(ServiceTable::new(self, c_chunk));
        tables.push(Arc::clone(&table));
        Ok(table)
    }
}

/// Column names `Workload::from_csv_text` reads.
#[derive(Debug, Clone, PartialEq)]
pub struct CsvColumns<'a> {
    pub input: &'a str,
    pub output: &'a str,
    /// Arrival times: seconds as numbers, or `YYYY-MM-DD HH:MM:SS[.fraction]`
    /// timestamps (UTC); rebased so the earliest arrival is at 0 s.
    pub arrival: Option<&'a str>,
    pub category: Option<&'a str>,
}

/// Seconds since 1970-01-01 of a `YYYY-MM-DD[ T]HH:MM:SS[.fraction]` stamp.
fn parse_timestamp(s: &str) -> Option<f64> {
    let s = s.trim();
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-');
    let y: i64 = d.next()?.parse().ok()?;
    let m: i64 = d.next()?.parse().ok()?;
    let day: i64 = d.next()?.parse().ok()?;
    if d.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let mut t = time.split(':');
    let hh: i64 = t.next()?.parse().ok()?;
    let mm: i64 = t.next()?.parse().ok()?;
    let ss: f64 = t.next()?.parse().ok()?;
    if t.next().is_some() || !(0..24).contains(&hh) || !(0..60).contains(&mm) {
        return None;
    }
    if !(0.0..61.0).contains(&ss) {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + (hh * 3600 + mm * 60) as f64 + ss)
}

impl Workload {
    /// A workload from CSV text with a header row (comma-separated, no quoted
    /// fields). Token columns hold non-negative integers. With an arrival
    /// column the rows are ordered by arrival (stable) and rebased to start
    /// at 0 s. Errors name the missing column or the line and value at fault.
    pub fn from_csv_text(text: &str, cols: &CsvColumns<'_>) -> Result<Self> {
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let (_, header) = lines.next().ok_or_else(|| invalid("the CSV is empty"))?;
        let names: Vec<&str> = header
            .split(',')
            .map(|h| h.trim().trim_start_matches('\u{feff}'))
            .collect();
        let find = |col: &str| {
            names.iter().position(|h| *h == col).ok_or_else(|| {
                invalid(format!(
                    "the CSV has no column {col:?} (columns: {})",
                    names.join(", ")
                ))
            })
        };
        let i_in = find(cols.input)?;
        let i_out = find(cols.output)?;
        let i_arr = cols.arrival.map(find).transpose()?;
        let i_cat = cols.category.map(find).transpose()?;
        let (mut input, mut output, mut arrival, mut cats) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (n, line) in lines {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            if fields.len() != names.len() {
                return Err(invalid(format!(
                    "line {}: {} fields, the header has {}",
                    n + 1,
                    fields.len(),
                    names.len()
                )));
            }
            let int = |i: usize, col: &str| -> Result<i64> {
                fields[i]
                    .parse::<i64>()
                    .ok()
                    .filter(|v| *v >= 0)
                    .ok_or_else(|| {
                        invalid(format!(
                            "line {}: column {col:?} must be a non-negative integer, got {:?}",
                            n + 1,
                            fields[i]
                        ))
                    })
            };
            input.push(int(i_in, cols.input)?);
            output.push(int(i_out, cols.output)?);
            if let Some(i) = i_arr {
                let v = fields[i]
                    .parse::<f64>()
                    .ok()
                    .or_else(|| parse_timestamp(fields[i]));
                match v {
                    Some(t) if t.is_finite() => arrival.push(t),
                    _ => {
                        return Err(invalid(format!(
                            "line {}: column {:?} must be seconds or a YYYY-MM-DD HH:MM:SS timestamp, got {:?}",
                            n + 1,
                            cols.arrival.unwrap_or_default(),
                            fields[i]
                        )))
                    }
                }
            }
            if let Some(i) = i_cat {
                cats.push(fields[i].to_string());
            }
        }
        if i_arr.is_some() {
            let mut idx: Vec<usize> = (0..input.len()).collect();
            idx.sort_by(|&a, &b| arrival[a].total_cmp(&arrival[b]));
            let t0 = idx.first().map_or(0.0, |&i| arrival[i]);
            let pick = |v: &[i64]| idx.iter().map(|&i| v[i]).collect::<Vec<_>>();
            let (inp, out) = (pick(&input), pick(&output));
            let arr: Vec<f64> = idx.iter().map(|&i| arrival[i] - t0).collect();
            let cat: Vec<String> = if i_cat.is_some() {
                idx.iter().map(|&i| cats[i].clone()).collect()
            } else {
                Vec::new()
            };
            return Self::new(&inp, &out, Some(&arr), i_cat.map(|_| cat.as_slice()));
        }
        Self::new(&input, &output, None, i_cat.map(|_| cats.as_slice()))
    }
}

/// Per-chunk-size prefix sums over the sorted order of a workload, per
/// category: `w k`, `w k L`, `w k^2`, `w k^2 L`, `w k^2 L^2`, `w L_in`,
/// `w L_in^2`, `w L_out`, `w L_out^2` with `k = ceil(L_in / C_chunk) + L_out` and `L = L_total`; and a weighted
/// wavelet matrix over the prefill chunk counts `ceil(L_in / C_chunk)`.
#[derive(Debug)]
pub struct ServiceTable {
    pub c_chunk: u64,
    sums: Vec<Vec<[f64; 9]>>,
    chunks: WaveletMatrix,
    /// The fewest chunks of the first `i` requests, and of those from `i`
    /// on (`u64::MAX` for none): a pool's prefix or tail span in O(1).
    fewest_before: Vec<u64>,
    fewest_from: Vec<u64>,
}

impl ServiceTable {
    fn new(w: &Workload, c_chunk: u64) -> Self {
        let n = w.len();
        let mut sums = vec![Vec::with_capacity(n + 1); w.category_channels()];
        for s in sums.iter_mut() {
            s.push([0.0; 9]);
        }
        let mut acc = vec![[0.0f64; 9]; w.category_channels()];
        let mut prefill = Vec::with_capacity(n);
        let mut weights = Vec::with_capacity(n);
        for &i in &w.order {
            let i = i as usize;
            let chunks = w.input[i].div_ceil(c_chunk);
            let k = (chunks + w.output[i]) as f64;
            let l = (w.input[i] + w.output[i]) as f64;
            let wt = w.weight[i];
            let a = &mut acc[w.category[i] as usize];
            a[0] += wt * k;
            a[1] += wt * k * l;
            a[2] += wt * k * k;
            a[3] += wt * k * k * l;
            a[4] += wt * k * k * l * l;
            let p = w.input[i] as f64;
            a[5] += wt * p;
            a[6] += wt * p * p;
            let o = w.output[i] as f64;
            a[7] += wt * o;
            a[8] += wt * o * o;
            for (s, a) in sums.iter_mut().zip(&acc) {
                s.push(*a);
            }
            prefill.push(chunks);
            weights.push(wt);
        }
        let mut fewest_before = Vec::with_capacity(n + 1);
        fewest_before.push(u64::MAX);
        for &c in &prefill {
            fewest_before.push(c.min(fewest_before[fewest_before.len() - 1]));
        }
        let mut fewest_from = vec![u64::MAX; n + 1];
        for (i, &c) in prefill.iter().enumerate().rev() {
            fewest_from[i] = c.min(fewest_from[i + 1]);
        }
        Self {
            c_chunk,
            sums,
            chunks: WaveletMatrix::new(&prefill, &weights),
            fewest_before,
            fewest_from,
        }
    }

    /// Moments of `S = k (a0 + a1 L)` over a span and one category channel,
    /// given that channel's weight in the span.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn moments(
        &self,
        w: &Workload,
        span: Span,
        category: usize,
        a0: f64,
        a1: f64,
    ) -> RangeMoments {
        let c = &w.cum_weight_by_category[category];
        let weight = c[span.end] - c[span.start];
        if weight <= 0.0 {
            return RangeMoments::EMPTY;
        }
        let s = &self.sums[category];
        // Written out: `array::from_fn`'s closure was compiled apart from
        // the planner's x86-64-v3 clone.
        let (hi, lo) = (&s[span.end], &s[span.start]);
        let d = [
            hi[0] - lo[0],
            hi[1] - lo[1],
            hi[2] - lo[2],
            hi[3] - lo[3],
            hi[4] - lo[4],
        ];
        RangeMoments {
            weight,
            mean: (a0 * d[0] + a1 * d[1]) / weight,
            second: (a0 * a0 * d[2] + 2.0 * a0 * a1 * d[3] + a1 * a1 * d[4]) / weight,
        }
    }

    /// Moments of the prompt length `L_in` over a span and one category
    /// channel (`mean` = E[L_in], `second` = E[L_in^2]).
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn prompt_moments(&self, w: &Workload, span: Span, category: usize) -> RangeMoments {
        self.length_moments(w, span, category, 5)
    }

    /// Moments of the output length `L_out` over a span and one category
    /// channel (`mean` = E[L_out], `second` = E[L_out^2]).
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn output_moments(&self, w: &Workload, span: Span, category: usize) -> RangeMoments {
        self.length_moments(w, span, category, 7)
    }

    /// The moments of the length whose `w x` and `w x^2` sums are columns
    /// `col` and `col + 1`.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    fn length_moments(
        &self,
        w: &Workload,
        span: Span,
        category: usize,
        col: usize,
    ) -> RangeMoments {
        let c = &w.cum_weight_by_category[category];
        let weight = c[span.end] - c[span.start];
        if weight <= 0.0 {
            return RangeMoments::EMPTY;
        }
        let s = &self.sums[category];
        RangeMoments {
            weight,
            mean: (s[span.end][col] - s[span.start][col]) / weight,
            second: (s[span.end][col + 1] - s[span.start][col + 1]) / weight,
        }
    }

    /// Moments of `S = k (a0 + a1 L)` over a span, all categories together.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn moments_all(&self, w: &Workload, span: Span, a0: f64, a1: f64) -> RangeMoments {
        // A loop: `Iterator::fold` was compiled apart from the clone.
        let mut m = RangeMoments::EMPTY;
        for c in 0..w.category_channels() {
            m = m.merge(self.moments(w, span, c, a0, a1));
        }
        m
    }

    /// The weighted `q`-quantile of the prefill chunk count over a span: the
    /// smallest `p` such that requests with `ceil(L_in / C) <= p` hold at least
    /// `q` of the span's weight. 0 for an empty span.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn prefill_chunks_quantile(&self, span: Span, q: f64) -> u64 {
        self.chunks.quantile(span.start, span.end, q)
    }

    /// The fewest prefill chunks of a span's requests (0 for a span of no
    /// weight): `prefill_chunks_quantile(span, 0.0)`, in O(1) for a prefix or
    /// a tail of the sorted requests.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn prefill_chunks_min(&self, span: Span) -> u64 {
        if span.end <= span.start || self.chunks.weight(span.start, span.end) <= 0.0 {
            0
        } else if span.start == 0 {
            self.fewest_before[span.end]
        } else if span.end + 1 == self.fewest_from.len() {
            self.fewest_from[span.start]
        } else {
            self.chunks.quantile(span.start, span.end, 0.0)
        }
    }

    /// The weighted distribution of the prefill chunk count over a span:
    /// `(chunks, weight)` for each count present, ascending, appended to `out`
    /// with every weight times `scale`.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    pub fn prefill_chunks_histogram(&self, span: Span, scale: f64, out: &mut Vec<(u64, f64)>) {
        self.chunks.histogram(span.start, span.end, scale, out);
    }
}

/// [`slice::partition_point`] forced inline, so that the planner's x86-64-v3
/// clone (rust/planner/isa.rs) holds it (std's is compiled apart, for the
/// baseline CPU): the first index where `pred` is false, `pred` true on a
/// prefix of `s`; the same bisection as std's (the answer is unique).
#[inline(always)]
pub(crate) fn partition_point<T>(s: &[T], mut pred: impl FnMut(&T) -> bool) -> usize {
    let (mut base, mut size) = (0, s.len());
    if size == 0 {
        return 0;
    }
    while size > 1 {
        let half = size / 2;
        let mid = base + half;
        if pred(&s[mid]) {
            base = mid;
        }
        size -= half;
    }
    base + usize::from(pred(&s[base]))
}

/// The most levels a [`WaveletMatrix`] has (one per bit of a `u64`): its
/// histogram's walk holds at most this many halves at once.
const MAX_LEVELS: usize = 64;

/// A wavelet matrix over non-negative integers with weights: the weighted
/// quantile of any index range in O(bits) steps (Claude, Navarro and Ordonez,
/// "The wavelet matrix", 2015; the weights ride along as per-level prefix sums).
#[derive(Debug)]
struct WaveletMatrix {
    /// Per level, from the top bit down: prefix counts of zero bits (len n+1),
    /// prefix weights of zero-bit entries (len n+1), the number of zeros, and
    /// prefix weights of all entries in this level's order (len n+1).
    levels: Vec<Level>,
}

#[derive(Debug)]
struct Level {
    zeros: Vec<u32>,
    zero_weight: Vec<f64>,
    all_weight: Vec<f64>,
    n_zeros: usize,
}

impl WaveletMatrix {
    fn new(values: &[u64], weights: &[f64]) -> Self {
        let max = values.iter().copied().max().unwrap_or(0);
        let bits = (64 - max.leading_zeros()).max(1) as usize;
        let mut cur: Vec<(u64, f64)> = values
            .iter()
            .copied()
            .zip(weights.iter().copied())
            .collect();
        let mut levels = Vec::with_capacity(bits);
        for b in (0..bits).rev() {
            let n = cur.len();
            let mut zeros = Vec::with_capacity(n + 1);
            let mut zero_weight = Vec::with_capacity(n + 1);
            let mut all_weight = Vec::with_capacity(n + 1);
            let (mut z, mut zw, mut aw) = (0u32, 0.0, 0.0);
            zeros.push(0);
            zero_weight.push(0.0);
            all_weight.push(0.0);
            for &(v, w) in &cur {
                if v >> b & 1 == 0 {
                    z += 1;
                    zw += w;
                }
                aw += w;
                zeros.push(z);
                zero_weight.push(zw);
                all_weight.push(aw);
            }
            let (lo, hi): (Vec<_>, Vec<_>) = cur.iter().partition(|&&(v, _)| v >> b & 1 == 0);
            cur = lo.into_iter().chain(hi).collect();
            levels.push(Level {
                zeros,
                zero_weight,
                all_weight,
                n_zeros: z as usize,
            });
        }
        Self { levels }
    }

    /// The weight of the values in `l..r`.
    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    fn weight(&self, l: usize, r: usize) -> f64 {
        self.levels
            .first()
            .map_or(0.0, |top| top.all_weight[r] - top.all_weight[l])
    }

    /// `(value, weight * scale)` of every value in `l..r`, ascending: a walk of
    /// the levels that splits the range into its zero and one halves, O(levels)
    /// per distinct value. Depth first, the halves still to walk on a stack of
    /// its own (at most one per level, and the two just split): a recursive
    /// function is never inlined, and this one is, into the planner's x86-64-v3
    /// clone (rust/planner/isa.rs).
    #[inline(always)]
    fn histogram(&self, l: usize, r: usize, scale: f64, out: &mut Vec<(u64, f64)>) {
        let Some(last) = self.levels.len().checked_sub(1) else {
            return;
        };
        if r <= l {
            return;
        }
        // (level, range, value of the bits above): the zero half on top.
        let mut stack = [(0usize, 0usize, 0usize, 0u64); MAX_LEVELS];
        stack[0] = (0, l, r, 0);
        let mut top = 1;
        while top > 0 {
            top -= 1;
            let (depth, l, r, value) = stack[top];
            let lev = &self.levels[depth];
            let (zl, zr) = (lev.zeros[l] as usize, lev.zeros[r] as usize);
            let w0 = lev.zero_weight[r] - lev.zero_weight[l];
            let w1 = (lev.all_weight[r] - lev.all_weight[l]) - w0;
            let halves = [
                (0, (zl, zr), w0),
                (1, (lev.n_zeros + (l - zl), lev.n_zeros + (r - zr)), w1),
            ];
            if depth == last {
                for (bit, (a, b), w) in halves {
                    if b > a && w > 0.0 {
                        out.push((value << 1 | bit, w * scale));
                    }
                }
            } else {
                for (bit, (a, b), w) in halves.into_iter().rev() {
                    if b > a && w > 0.0 {
                        stack[top] = (depth + 1, a, b, value << 1 | bit);
                        top += 1;
                    }
                }
            }
        }
    }

    // Inlined into the planner's x86-64-v3 clone (rust/planner/isa.rs).
    #[inline(always)]
    fn quantile(&self, mut l: usize, mut r: usize, q: f64) -> u64 {
        let Some(top) = self.levels.first() else {
            return 0;
        };
        let total = top.all_weight[r] - top.all_weight[l];
        if r <= l || total <= 0.0 {
            return 0;
        }
        let mut target = (q.clamp(0.0, 1.0) * total).max(f64::MIN_POSITIVE);
        let tol = 1e-12 * total;
        let mut value = 0u64;
        for lev in &self.levels {
            let zl = lev.zeros[l] as usize;
            let zr = lev.zeros[r] as usize;
            let w0 = lev.zero_weight[r] - lev.zero_weight[l];
            value <<= 1;
            if target <= w0 + tol && zr > zl {
                l = zl;
                r = zr;
            } else {
                target -= w0;
                value |= 1;
                l = lev.n_zeros + (l - zl);
                r = lev.n_zeros + (r - zr);
            }
        }
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Workload {
        // totals: 10, 3, 7, 20, 7
        Workload::new(&[8, 1, 5, 16, 6], &[2, 2, 2, 4, 1], None, None).expect("valid")
    }

    #[test]
    fn cdf_quantile_and_spans() {
        let w = small();
        assert_eq!(w.len(), 5);
        assert_eq!(w.cdf(2.0), 0.0);
        assert_eq!(w.cdf(3.0), 0.2);
        assert_eq!(w.cdf(7.0), 0.6);
        assert_eq!(w.cdf(100.0), 1.0);
        assert_eq!(w.quantile(0.0), Ok(3));
        assert_eq!(w.quantile(0.2), Ok(3));
        assert_eq!(w.quantile(0.21), Ok(7));
        assert_eq!(w.quantile(0.6), Ok(7));
        assert_eq!(w.quantile(1.0), Ok(20));
        assert!(w.quantile(1.5).is_err());
        let s = w.span(3.0, 10.0);
        assert_eq!((s.end - s.start), 3);
        assert_eq!(w.span_from(1, 10.0), s);
        assert!((w.mean_tokens(s) - 8.0).abs() < 1e-12);
    }

    /// The bucketed search counts what a scan of the totals counts, at and
    /// between bucket edges, for small and large totals (shift 0 and > 0).
    #[test]
    fn spans_by_bucket_match_a_scan() {
        let mut rng = crate::rng::Rng::new(7);
        for top in [1u64, 50, 4095, 4096, 9000, 70_000, 3_000_000] {
            let inputs: Vec<i64> = (0..500).map(|_| 1 + rng.below(top) as i64).collect();
            let outputs: Vec<i64> = (0..500).map(|_| rng.below(4) as i64).collect();
            let w = Workload::new(&inputs, &outputs, None, None).expect("valid");
            assert!(w.buckets.len() as u64 <= MAX_BUCKETS + 1);
            let totals: Vec<u64> = inputs
                .iter()
                .zip(&outputs)
                .map(|(a, b)| (a + b) as u64)
                .collect();
            let scan = |x: f64| totals.iter().filter(|&&t| (t as f64) <= x).count();
            let edge = 1u64 << w.bucket_shift;
            let mut xs = vec![f64::NEG_INFINITY, -1.0, 0.0, f64::NAN, f64::INFINITY, 1e300];
            for &t in totals.iter().take(60) {
                let b = t / edge * edge;
                for x in [
                    t,
                    t.saturating_sub(1),
                    t + 1,
                    b,
                    b.saturating_sub(1),
                    b + edge,
                ] {
                    xs.extend([x as f64, x as f64 + 0.5, x as f64 - 0.25]);
                }
            }
            for x in xs {
                assert_eq!(w.span(f64::NEG_INFINITY, x).end, scan(x), "top {top} x {x}");
                let s = w.span(x, x + 1.5 * edge as f64);
                assert_eq!(
                    (s.start, s.end),
                    (scan(x), scan(x + 1.5 * edge as f64).max(scan(x)))
                );
                assert_eq!(w.span_from(s.start, x + 1.5 * edge as f64), s);
            }
        }
    }

    #[test]
    fn range_moments_match_direct_sums() {
        let w = small();
        let t = w.service_table(4).expect("table");
        // k = ceil(in/4) + out: [2+2, 1+2, 2+2, 4+4, 2+1] = [4, 3, 4, 8, 3]
        // totals [10, 3, 7, 20, 7]. Range (3, 10] holds requests 0, 2, 4.
        let s = w.span(3.0, 10.0);
        let (a0, a1) = (0.5, 0.01);
        let m = t.moments_all(&w, s, a0, a1);
        let direct: Vec<f64> = [(4.0, 10.0), (4.0, 7.0), (3.0, 7.0)]
            .iter()
            .map(|(k, l)| k * (a0 + a1 * l))
            .collect();
        let mean = direct.iter().sum::<f64>() / 3.0;
        let second = direct.iter().map(|x| x * x).sum::<f64>() / 3.0;
        assert!((m.mean - mean).abs() < 1e-12);
        assert!((m.second - second).abs() < 1e-12);
        assert_eq!(m.weight, 3.0);
        // prefill chunks in that range: [2, 2, 2]; over all: [2, 1, 2, 4, 2]
        assert_eq!(t.prefill_chunks_quantile(s, 0.99), 2);
        let all = w.span(0.0, 1e9);
        assert_eq!(t.prefill_chunks_quantile(all, 0.2), 1);
        assert_eq!(t.prefill_chunks_quantile(all, 0.5), 2);
        assert_eq!(t.prefill_chunks_quantile(all, 0.99), 4);
        assert_eq!(t.prefill_chunks_quantile(w.span(50.0, 60.0), 0.99), 0);
        // the table is built once per chunk size
        assert!(Arc::ptr_eq(&t, &w.service_table(4).expect("table")));
    }

    #[test]
    fn categories_split_the_weight() {
        let cats: Vec<String> = ["a", "b", "a", "b", "b"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let w = Workload::new(&[8, 1, 5, 16, 6], &[2, 2, 2, 4, 1], None, Some(&cats)).expect("ok");
        assert_eq!(w.category_names(), ["a".to_string(), "b".to_string()]);
        let s = w.span(3.0, 10.0);
        assert!((w.category_fraction(s, 0) - 0.4).abs() < 1e-12);
        assert!((w.category_fraction(s, 1) - 0.2).abs() < 1e-12);
        let t = w.service_table(4).expect("table");
        let merged = t
            .moments(&w, s, 0, 1.0, 0.0)
            .merge(t.moments(&w, s, 1, 1.0, 0.0));
        assert!((merged.mean - 11.0 / 3.0).abs() < 1e-12);
    }

    /// The O(1) fewest chunks of a prefix or tail equal the range quantile at 0.
    #[test]
    fn chunk_minimum_matches_the_quantile() {
        let mut rng = crate::rng::Rng::new(5);
        let n = 200;
        let input: Vec<i64> = (0..n)
            .map(|_| 1 + (rng.uniform() * 9000.0) as i64)
            .collect();
        let output: Vec<i64> = (0..n).map(|_| (rng.uniform() * 3000.0) as i64).collect();
        let w = Workload::new(&input, &output, None, None).expect("ok");
        let t = w.service_table(512).expect("table");
        for (lo, hi) in [
            (0.0, 1e9),
            (f64::NEG_INFINITY, 700.0),
            (2000.0, 1e9),
            (900.0, 4000.0),
        ] {
            for span in [
                w.span(lo, hi),
                w.span(f64::NEG_INFINITY, lo),
                w.span(hi, f64::INFINITY),
            ] {
                assert_eq!(
                    t.prefill_chunks_min(span),
                    t.prefill_chunks_quantile(span, 0.0),
                    "{span:?}"
                );
            }
        }
    }

    /// Every span's chunk histogram equals a count over its requests.
    #[test]
    fn chunk_histogram_matches_a_scan() {
        let mut rng = crate::rng::Rng::new(3);
        let n = 300;
        let input: Vec<i64> = (0..n)
            .map(|_| 1 + (rng.uniform() * 5000.0) as i64)
            .collect();
        let output: Vec<i64> = (0..n).map(|_| (rng.uniform() * 300.0) as i64).collect();
        let w = Workload::new(&input, &output, None, None).expect("ok");
        let t = w.service_table(512).expect("table");
        for (lo, hi) in [
            (0.0, 1e9),
            (0.0, 800.0),
            (1000.0, 2500.0),
            (4000.0, 4100.0),
            (9e9, 1e10),
        ] {
            let span = w.span(lo, hi);
            let mut got = Vec::new();
            t.prefill_chunks_histogram(span, 2.0, &mut got);
            let mut want = std::collections::BTreeMap::new();
            for &i in &w.order[span.start..span.end] {
                *want.entry(w.input[i as usize].div_ceil(512)).or_insert(0.0) += 2.0;
            }
            let want: Vec<(u64, f64)> = want.into_iter().collect();
            assert_eq!(got, want, "({lo}, {hi}]");
        }
    }

    /// The histogram's walk at its deepest, a matrix of 64 levels (values
    /// up to `u64::MAX`): every value of a range, ascending, with its weight
    /// (prefix sums' differences: to rounding), as a count over the range.
    #[test]
    fn histogram_of_64_levels_matches_a_count() {
        let mut rng = crate::rng::Rng::new(11);
        let values: Vec<u64> = (0..400u64)
            .map(|i| {
                let u = rng.uniform();
                match i % 4 {
                    0 => u64::MAX - (u * 8.0) as u64,
                    1 => (u * 16.0) as u64,
                    2 => 1 << (u * 63.0) as u32,
                    _ => (u * 2f64.powi(63)) as u64,
                }
            })
            .collect();
        let weights: Vec<f64> = (0..400).map(|_| 0.5 + rng.uniform()).collect();
        let m = WaveletMatrix::new(&values, &weights);
        assert_eq!(m.levels.len(), MAX_LEVELS);
        for (l, r) in [(0, 400), (0, 1), (17, 93), (150, 400), (399, 400), (5, 5)] {
            let mut got = Vec::new();
            m.histogram(l, r, 3.0, &mut got);
            let mut want = std::collections::BTreeMap::new();
            for i in l..r {
                *want.entry(values[i]).or_insert(0.0) += 3.0 * weights[i];
            }
            let got_values: Vec<u64> = got.iter().map(|&(v, _)| v).collect();
            assert_eq!(got_values, want.keys().copied().collect::<Vec<_>>());
            for ((_, g), w) in got.iter().zip(want.values()) {
                assert!((g - w).abs() <= 1e-9 * w, "{l}..{r}: {g} vs {w}");
            }
        }
    }

    /// The inlined `partition_point` is std's: every split of every sorted
    /// slice up to 40 long, the empty one included.
    #[test]
    fn partition_point_is_std() {
        for n in 0..40u64 {
            let s: Vec<u64> = (0..n).map(|i| i / 3).collect();
            for x in 0..=n / 3 + 1 {
                assert_eq!(
                    partition_point(&s, |&v| v < x),
                    s.partition_point(|&v| v < x),
                    "{n} {x}"
                );
            }
        }
    }

    #[test]
    fn from_cdf_spreads_mass_uniformly() {
        let w = Workload::from_cdf(&[(4, 0.5), (8, 1.0)], 0.8).expect("ok");
        assert_eq!(w.len(), 8);
        assert!((w.cdf(2.0) - 0.25).abs() < 1e-12);
        assert!((w.cdf(6.0) - 0.75).abs() < 1e-12);
        assert_eq!(w.quantile(0.5), Ok(4));
        assert_eq!(w.input_tokens()[7], 6); // floor(0.8 * 8)
        assert_eq!(w.output_tokens()[7], 2);
        assert_eq!(w.input_tokens()[0], 1); // max(1, floor(0.8))
        assert!(Workload::from_cdf(&[(4, 0.5)], 0.8).is_err());
        assert!(Workload::from_cdf(&[(4, 0.5), (4, 1.0)], 0.8).is_err());
        assert!(Workload::from_cdf(&[(4, 0.6), (8, 0.5)], 0.8).is_err());
        assert!(Workload::from_cdf(&[(4, 1.0)], 0.0).is_err());
    }

    #[test]
    fn sample_follows_the_weights() {
        let w = Workload::from_cdf(&[(4, 0.5), (8, 1.0)], 0.8).expect("ok");
        let s = w.sample(20_000, 7).expect("ok");
        assert_eq!(s.len(), 20_000);
        assert!((s.cdf(4.0) - 0.5).abs() < 0.02);
        assert!((s.cdf(2.0) - 0.25).abs() < 0.02);
        let again = w.sample(20_000, 7).expect("ok");
        assert_eq!(again.input_tokens(), s.input_tokens());
        assert!(w.sample(0, 1).is_err());
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(Workload::new(&[], &[], None, None).is_err());
        assert!(Workload::new(&[1], &[1, 2], None, None).is_err());
        assert!(Workload::new(&[-1], &[1], None, None).is_err());
        assert!(Workload::new(&[0], &[0], None, None).is_err());
        assert!(Workload::new(&[1, 1], &[1, 1], Some(&[1.0, 0.5]), None).is_err());
        assert!(Workload::new(&[1], &[1], Some(&[f64::NAN]), None).is_err());
        assert!(Workload::new(&[1], &[1], None, Some(&[String::new()])).is_err());
        assert!(Workload::new(&[1 << 40], &[1], None, None).is_err());
    }

    #[test]
    fn csv_columns_timestamps_and_errors() {
        let cols = CsvColumns {
            input: "ContextTokens",
            output: "GeneratedTokens",
            arrival: Some("TIMESTAMP"),
            category: Some("category"),
        };
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens,category\n\
                    2023-11-16 18:15:47.5,100,10,code\n\
                    2023-11-16 18:15:46.0,200,20,conversation\n";
        let w = Workload::from_csv_text(text, &cols).expect("ok");
        assert_eq!(w.input_tokens(), [200, 100]);
        assert_eq!(w.arrival_s(), Some(&[0.0, 1.5][..]));
        assert_eq!(
            w.category_names(),
            ["conversation".to_string(), "code".to_string()]
        );
        assert_eq!(parse_timestamp("1970-01-02 00:00:01"), Some(86_401.0));
        assert_eq!(parse_timestamp("2000-03-01T00:00:00"), Some(951_868_800.0));
        let missing = Workload::from_csv_text("a,b\n1,2\n", &cols).expect_err("missing");
        assert!(missing.to_string().contains("ContextTokens"));
        let plain = CsvColumns {
            arrival: None,
            category: None,
            ..cols.clone()
        };
        for bad in [
            "ContextTokens,GeneratedTokens\n-1,2\n",
            "ContextTokens,GeneratedTokens\nx,2\n",
            "ContextTokens,GeneratedTokens\n1\n",
            "",
        ] {
            assert!(Workload::from_csv_text(bad, &plain).is_err(), "{bad:?}");
        }
        let bad_time = "TIMESTAMP,ContextTokens,GeneratedTokens,category\nyesterday,1,1,a\n";
        assert!(Workload::from_csv_text(bad_time, &cols).is_err());
    }
}
