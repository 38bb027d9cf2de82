//! The RouteBalance model estimator (section 4.2): distance-weighted cosine
//! k-nearest neighbours over prompt embeddings. Each training prompt stores a
//! quality label and an output length per model; a query's prediction for
//! each model is the weighted mean of its k most cosine-similar training
//! prompts' labels, with weight `1 / (1 - cos + 1e-6)` (an exact match all but
//! decides). Equal similarities go to the lower training index.
//!
//! Embeddings are L2-normalised at `fit` and `predict`, so any embedding model
//! works; an all-zero (or non-finite) vector is refused. The search is exact
//! (no approximate index): the similarities of all queries to all rows are one
//! matrix product (GEMM, on every core); each query's `2k` best by it are scored
//! again with a fixed-order dot product and the `k` best by that are kept.

use rayon::prelude::*;

use crate::error::{invalid, Error, Result};
use crate::snapshot::{Reader, Writer};

/// Largest `k`.
pub const MAX_K: usize = 4096;
/// Largest embedding dimension.
pub const MAX_DIM: usize = 65_536;
const DIST_EPS: f64 = 1e-6;

/// A fitted index.
#[derive(Debug, Clone, PartialEq)]
pub struct KnnIndex {
    k: usize,
    dim: usize,
    models: usize,
    /// `[n, dim]`, rows unit-length.
    emb: Vec<f32>,
    /// `[n, models]` each.
    quality: Vec<f64>,
    out_len: Vec<f64>,
}

/// Checks `k` on its own (the estimator is built before it is fitted).
pub fn check_k(k: i64) -> Result<usize> {
    if (1..=MAX_K as i64).contains(&k) {
        Ok(k as usize)
    } else {
        Err(invalid(format!("k must be in [1, {MAX_K}], got {k}")))
    }
}

/// Normalises every `dim`-long row of `x` in place.
fn normalise(x: &mut [f32], dim: usize, what: &str) -> Result<()> {
    for (i, row) in x.chunks_exact_mut(dim).enumerate() {
        let norm = dot(row, row).sqrt();
        if !(norm.is_finite() && norm > 0.0) {
            return Err(invalid(format!(
                "{what} row {i} is zero or not finite: cannot take its cosine"
            )));
        }
        row.iter_mut().for_each(|v| *v /= norm);
    }
    Ok(())
}

/// Lanes of independent partial sums in `dot`: four AVX registers, so the
/// adds of one chunk do not wait on the previous chunk's.
const LANES: usize = 32;

/// Dot product with `LANES` independent accumulators, so it vectorises, and
/// fused multiply-adds (one instruction with FMA hardware, a correctly
/// rounded library call without). The summation order is fixed by the
/// source, so every instruction set gives the same result.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] = x[j].mul_add(y[j], acc[j]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Similarities held at once: queries are taken in blocks of at most this
/// many `(query, row)` pairs (64 MiB of `f32`).
const MAX_BLOCK_SIMS: usize = 1 << 24;

/// `qs · embᵀ`: the `[b, n]` similarities of `b` queries to `n` rows, both
/// row-major with `dim` columns, as one GEMM on every core (the `gemm` crate).
fn similarities(emb: &[f32], qs: &[f32], dim: usize) -> Vec<f32> {
    let (n, b) = (emb.len() / dim, qs.len() / dim);
    let mut sims = vec![0.0f32; b * n];
    // SAFETY: `sims` is `b x n` (row stride n, column stride 1), `qs` is
    // `b x dim` (row stride dim), and `emb` (`n x dim`, row stride dim) is
    // read as its transpose `dim x n` (row stride 1, column stride dim): every
    // index the product touches lies inside its slice. `read_dst` is false,
    // so `sims` is only written: `sims = 1.0 * qs * embᵀ`.
    unsafe {
        gemm::gemm(
            b,
            n,
            dim,
            sims.as_mut_ptr(),
            1,
            n as isize,
            false,
            qs.as_ptr(),
            1,
            dim as isize,
            emb.as_ptr(),
            dim as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
    sims
}

/// Keeps `(sim, row)` in `top` if it is among the `k` best, best first;
/// equal similarities keep the lower (earlier) row.
#[inline(always)]
fn offer(top: &mut Vec<(f32, usize)>, k: usize, sim: f32, row: usize) {
    if top.len() == k && top.last().is_some_and(|&(s, _)| sim <= s) {
        return;
    }
    let at = top.partition_point(|&(s, _)| s >= sim);
    top.insert(at, (sim, row));
    top.truncate(k);
}

/// Candidates kept from the matrix product per neighbour wanted: the GEMM
/// orders rows by a sum in its own order, so the `CANDIDATES * k` best by it
/// are scored again with `dot` and the `k` best by that are kept.
const CANDIDATES: usize = 2;

/// Per query, the `k` most similar `(similarity, row)`, best first, each
/// similarity the fixed-order `dot`: candidates from one GEMM per block of
/// queries, then each query's selection on its own thread (rayon). The result
/// does not depend on the other queries of the call (the GEMM's rounding,
/// which does, only proposes candidates).
fn nearest(emb: &[f32], qs: &[f32], dim: usize, k: usize) -> Vec<Vec<(f32, usize)>> {
    let n = emb.len() / dim;
    let wide = (CANDIDATES * k).min(n);
    let block = (MAX_BLOCK_SIMS / n).max(1) * dim;
    let mut top = Vec::with_capacity(qs.len() / dim);
    for q in qs.chunks(block) {
        let sims = similarities(emb, q, dim);
        top.par_extend(sims.par_chunks_exact(n).zip(q.par_chunks_exact(dim)).map(
            |(row, query)| {
                let mut candidates = Vec::with_capacity(wide + 1);
                for (i, &s) in row.iter().enumerate() {
                    offer(&mut candidates, wide, s, i);
                }
                candidates.sort_unstable_by_key(|&(_, i)| i);
                let mut t = Vec::with_capacity(k + 1);
                for (_, i) in candidates {
                    offer(&mut t, k, dot(&emb[i * dim..(i + 1) * dim], query), i);
                }
                t
            },
        ));
    }
    top
}

impl KnnIndex {
    /// `emb` is `[n, dim]` row-major, `quality` and `out_len` `[n, models]`.
    pub fn fit(
        k: usize,
        emb: Vec<f32>,
        dim: usize,
        quality: Vec<f64>,
        out_len: Vec<f64>,
        models: usize,
    ) -> Result<Self> {
        let mut index = Self::from_parts(k, emb, dim, quality, out_len, models)?;
        normalise(&mut index.emb, dim, "embeddings")?;
        Ok(index)
    }

    /// Checks every shape and label; the embeddings are taken as they are.
    fn from_parts(
        k: usize,
        emb: Vec<f32>,
        dim: usize,
        quality: Vec<f64>,
        out_len: Vec<f64>,
        models: usize,
    ) -> Result<Self> {
        check_k(i64::try_from(k).unwrap_or(i64::MAX))?;
        if dim == 0 || dim > MAX_DIM || emb.len() % dim != 0 || emb.is_empty() {
            return Err(invalid(format!(
                "embeddings must be a non-empty [n, d] array with 1 <= d <= {MAX_DIM}"
            )));
        }
        let n = emb.len() / dim;
        if models == 0 || quality.len() != n * models || out_len.len() != n * models {
            return Err(invalid(format!(
                "quality and out_len must both be [{n}, M] with M >= 1"
            )));
        }
        if emb.iter().any(|x| !x.is_finite()) {
            return Err(invalid("embeddings must be finite"));
        }
        for &q in &quality {
            crate::error::finite("quality", q)?;
        }
        for &l in &out_len {
            crate::error::non_negative("out_len", l)?;
        }
        Ok(Self {
            k,
            dim,
            models,
            emb,
            quality,
            out_len,
        })
    }

    pub fn k(&self) -> usize {
        self.k
    }
    pub fn dim(&self) -> usize {
        self.dim
    }
    pub fn models(&self) -> usize {
        self.models
    }
    pub fn len(&self) -> usize {
        self.emb.len() / self.dim
    }
    pub fn is_empty(&self) -> bool {
        self.emb.is_empty()
    }

    /// Predicted `(quality, out_len)`, each `[b, models]` row-major, for the
    /// `[b, dim]` queries.
    pub fn predict(&self, queries: &[f32]) -> Result<(Vec<f64>, Vec<f64>)> {
        if queries.len() % self.dim != 0 {
            return Err(invalid(format!(
                "queries must be [B, {}] like the fitted embeddings",
                self.dim
            )));
        }
        let mut qs = queries.to_vec();
        normalise(&mut qs, self.dim, "queries")?;
        let b = qs.len() / self.dim;
        let k = self.k.min(self.len());
        // per query: the k best (similarity, row), best first
        let top = nearest(&self.emb, &qs, self.dim, k);
        let m = self.models;
        let mut quality = vec![0.0; b * m];
        let mut out_len = vec![0.0; b * m];
        for (j, t) in top.iter().enumerate() {
            let mut total = 0.0;
            for &(sim, row) in t {
                let w = 1.0 / ((1.0 - sim as f64).max(0.0) + DIST_EPS);
                total += w;
                for c in 0..m {
                    quality[j * m + c] += w * self.quality[row * m + c];
                    out_len[j * m + c] += w * self.out_len[row * m + c];
                }
            }
            for c in 0..m {
                quality[j * m + c] /= total;
                out_len[j * m + c] /= total;
            }
        }
        Ok((quality, out_len))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(MAGIC, VERSION);
        w.u64(self.k as u64)
            .u64(self.dim as u64)
            .u64(self.models as u64)
            .u64(self.len() as u64);
        for &x in &self.emb {
            w.u32(x.to_bits());
        }
        for &x in self.quality.iter().chain(&self.out_len) {
            w.f64(x);
        }
        w.finish()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, MAGIC, VERSION, "KnnEstimator")?;
        let k = r.u64()?;
        let dim = r.u64()?;
        let models = r.u64()?;
        if dim == 0 || dim > MAX_DIM as u64 || models == 0 || models > MAX_DIM as u64 {
            return Err(Error::Snapshot("bad dimensions".into()));
        }
        let (dim, models) = (dim as usize, models as usize);
        let n = r.count(4 * dim + 16 * models)?;
        let emb = (0..n * dim)
            .map(|_| r.u32().map(f32::from_bits))
            .collect::<Result<Vec<_>>>()?;
        let mut labels = (0..2 * n * models)
            .map(|_| r.f64())
            .collect::<Result<Vec<_>>>()?;
        r.finish()?;
        let out_len = labels.split_off(n * models);
        Self::from_parts(
            usize::try_from(k).unwrap_or(usize::MAX),
            emb,
            dim,
            labels,
            out_len,
            models,
        )
    }
}

const MAGIC: &[u8; 4] = b"RCKN";
const VERSION: u16 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn weighted_mean_of_nearest_by_hand() {
        // rows along x, y and 45 degrees; two models
        let s = std::f32::consts::FRAC_1_SQRT_2;
        let emb = vec![1.0, 0.0, 0.0, 2.0, s, s];
        let quality = vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.5];
        let out_len = vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
        let idx = KnnIndex::fit(2, emb, 2, quality, out_len, 2).expect("fit");
        // query (3, 0) equals row 0 (cos 1, weight 1e6) and then row 2
        // (cos 0.7071, weight 1 / (0.2929 + 1e-6) = 3.4142).
        let (q, l) = idx.predict(&[3.0, 0.0]).expect("predict");
        let (w0, w2) = (1.0 / DIST_EPS, 1.0 / (1.0 - s as f64 + DIST_EPS));
        let want_q0 = (w0 * 1.0 + w2 * 0.5) / (w0 + w2);
        let want_l1 = (w0 * 20.0 + w2 * 60.0) / (w0 + w2);
        assert!(close(q[0], want_q0), "{}", q[0]);
        assert!(close(l[1], want_l1), "{}", l[1]);
        // query between x and y at 30 degrees from x: cos 0.866 to row 0,
        // 0.966 to row 2, 0.5 to row 1; k = 2 keeps rows 2 and 0.
        let (c, sn) = (30f32.to_radians().cos(), 30f32.to_radians().sin());
        let (_, l) = idx.predict(&[c, sn]).expect("predict");
        let (wa, wb) = (
            1.0 / (1.0 - (15f64.to_radians()).cos() + DIST_EPS),
            1.0 / (1.0 - (30f64.to_radians()).cos() + DIST_EPS),
        );
        let want = (wa * 50.0 + wb * 10.0) / (wa + wb);
        assert!((l[0] - want).abs() < 1e-3, "{} vs {want}", l[0]);
    }

    /// The exact search the GEMM replaced, in f64: every row's cosine, sorted
    /// best first (ties to the lower row), the first `k` weighted.
    fn exact(idx: &KnnIndex, query: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let norm = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        let qn = norm(query);
        let mut sims: Vec<(f64, usize)> = idx
            .emb
            .chunks_exact(idx.dim)
            .enumerate()
            .map(|(r, e)| {
                let d: f64 = e
                    .iter()
                    .zip(query)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                (d / norm(e) / qn, r)
            })
            .collect();
        sims.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let m = idx.models;
        let (mut q, mut l, mut total) = (vec![0.0; m], vec![0.0; m], 0.0);
        for &(sim, r) in sims.iter().take(idx.k) {
            let w = 1.0 / ((1.0 - sim).max(0.0) + DIST_EPS);
            total += w;
            for c in 0..m {
                q[c] += w * idx.quality[r * m + c];
                l[c] += w * idx.out_len[r * m + c];
            }
        }
        (
            q.iter().map(|x| x / total).collect(),
            l.iter().map(|x| x / total).collect(),
        )
    }

    /// The scan the GEMM replaced: `dot` against every row, in row order.
    fn scan(emb: &[f32], qs: &[f32], dim: usize, k: usize) -> Vec<Vec<(f32, usize)>> {
        qs.chunks_exact(dim)
            .map(|q| {
                let mut t = Vec::new();
                for (row, e) in emb.chunks_exact(dim).enumerate() {
                    offer(&mut t, k, dot(e, q), row);
                }
                t
            })
            .collect()
    }

    #[test]
    fn neighbours_are_those_of_the_old_scan_bit_for_bit() {
        let mut rng = crate::rng::Rng::new(3);
        for (n, dim, b, k) in [
            (2000, 384, 32, 8),
            (500, 17, 5, 1),
            (40, 8, 3, 40),
            (9, 4, 1, 3),
        ] {
            let mut draw = |len: usize| (0..len).map(|_| rng.normal() as f32).collect::<Vec<_>>();
            let mut emb = draw(n * dim);
            // a duplicated row: equal similarities go to the lower row
            let first = emb[..dim].to_vec();
            emb[(n - 1) * dim..].copy_from_slice(&first);
            let mut qs = draw(b * dim);
            normalise(&mut emb, dim, "e").expect("finite");
            normalise(&mut qs, dim, "q").expect("finite");
            assert_eq!(nearest(&emb, &qs, dim, k), scan(&emb, &qs, dim, k));
        }
    }

    #[test]
    fn gemm_search_matches_the_exact_scan() {
        let mut rng = crate::rng::Rng::new(11);
        for (n, dim, b, k, models) in [(300, 24, 9, 5, 3), (1000, 64, 33, 8, 2), (7, 3, 4, 7, 1)] {
            let mut draw = |len: usize| (0..len).map(|_| rng.normal() as f32).collect::<Vec<_>>();
            let emb = draw(n * dim);
            let queries = draw(b * dim);
            let quality: Vec<f64> = draw(n * models).iter().map(|&x| x as f64).collect();
            let out_len: Vec<f64> = quality.iter().map(|x| 100.0 + 50.0 * x.abs()).collect();
            let idx = KnnIndex::fit(k, emb, dim, quality, out_len, models).expect("fit");
            let (q, l) = idx.predict(&queries).expect("predict");
            for (j, query) in queries.chunks_exact(dim).enumerate() {
                let (want_q, want_l) = exact(&idx, query);
                for c in 0..models {
                    let (got_q, got_l) = (q[j * models + c], l[j * models + c]);
                    assert!((got_q - want_q[c]).abs() < 1e-4, "{got_q} vs {}", want_q[c]);
                    assert!((got_l - want_l[c]).abs() < 1e-3, "{got_l} vs {}", want_l[c]);
                }
                // one query alone gives the same row as the batch
                let (q1, l1) = idx.predict(query).expect("predict");
                assert_eq!(q1, q[j * models..(j + 1) * models]);
                assert_eq!(l1, l[j * models..(j + 1) * models]);
            }
        }
    }

    #[test]
    fn refuses_bad_input_and_round_trips() {
        assert!(KnnIndex::fit(0, vec![1.0], 1, vec![1.0], vec![1.0], 1).is_err());
        assert!(KnnIndex::fit(1, vec![0.0], 1, vec![1.0], vec![1.0], 1).is_err());
        assert!(KnnIndex::fit(1, vec![1.0], 1, vec![1.0], vec![-1.0], 1).is_err());
        assert!(KnnIndex::fit(1, vec![1.0, 2.0], 2, vec![1.0], vec![1.0, 2.0], 1).is_err());
        let idx = KnnIndex::fit(
            3,
            vec![1.0, 2.0, 3.0, 4.0],
            2,
            vec![0.1, 0.2],
            vec![5.0, 6.0],
            1,
        )
        .expect("fit");
        assert!(idx.predict(&[1.0, 2.0, 3.0]).is_err());
        assert!(idx.predict(&[0.0, 0.0]).is_err());
        let bytes = idx.to_bytes();
        assert_eq!(KnnIndex::from_bytes(&bytes).expect("restore"), idx);
        for cut in 0..bytes.len() {
            assert!(KnnIndex::from_bytes(&bytes[..cut]).is_err());
        }
    }
}
