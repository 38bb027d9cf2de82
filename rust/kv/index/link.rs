//! The walk's own key of a block, its *link*: `link_i = mix(link_{i-1},
//! local(block_i) ^ seed)`, from `link_{-1} = seed` (the chain's seed, an
//! adapter's `lora_seed`), where `local` hashes one block's token ids
//! alone. A walk checks a run of slots by their links (`Table::walk`):
//! each slot's link from the slot before and the prompt's block, never from
//! the block just checked, and `local` is independent per block, so the
//! checks of a run are throughput-bound; the chained block hash (xxh3 over
//! the previous hash and the block, six products and the avalanche) is
//! computed only where a run ends and the next block is looked up by it.
//!
//! `local` of a block of 16 ids takes one of two forms, chosen once per
//! process (links are random-keyed per process and only ever compared
//! within it, so the two need not agree):
//!
//! - with AVX2 (detected at run time, `is_x86_feature_detected!`; never a
//!   build flag), NH (the hash of UMAC) twice, under keys shifted by four
//!   words (NH-Toeplitz): `sum (m[2j] + k[2j]) * (m[2j+1] + k[2j+1])` over
//!   the 8 pairs, words added mod 2^32, 32x32->64-bit products summed mod
//!   2^64; two such sums, 16 products a block, four at a time
//!   (`links_avx2`, a run's blocks in one call). The link is one folded
//!   64x64-bit product of the two sums with the previous link and the seed.
//!   How likely a false match is: two different blocks after the same link
//!   give the same two NH sums with probability at most 2^-64 (NH is
//!   2^-32-almost-universal for each key shift), and different sums the
//!   same link by a collision of the folded product (about 2^-64, as for
//!   xxh3's mix).
//! - without it (ARM, x86 before AVX2), four folded 64x64-bit products of
//!   the block's 8 words (two ids each) under 8 keys, summed
//!   (`local_products`: a 64x64->128-bit product is one or two
//!   instructions on every 64-bit CPU, where NH's sums one product at a
//!   time cost twice as much), then the same folded product with the
//!   previous link. How likely a false match is: this is xxh3's mixing of
//!   16-byte chunks (its 17-128-byte path) with random keys in place of
//!   its secret, so different blocks after the same link collide as
//!   xxh3's outputs do, about 2^-64, for ids chosen without the keys; a
//!   heuristic bound, not NH's proven one (a word equal to its key zeroes
//!   its product, which takes guessing a 64-bit key).
//!
//! Other block sizes: xxh3 of the block's ids under a key, on both paths.
//!
//! The keys are random per process: the token ids are a KV publisher's
//! choice, and with keys it cannot see it cannot choose blocks whose links
//! collide (a link never leaves the process: `KvIndex::blocks` and the
//! lookups use the chained hashes). A false match makes a walk read the
//! slot's block as the prompt's (a claim the chained hash would not make);
//! a failed check only sends the walk to a lookup by the chained hash,
//! which never claims a block it does not find.

use std::hash::BuildHasher;
use std::sync::OnceLock;

use foldhash::quality::RandomState;

use crate::prefix::BlockStep;

/// The block size the unrolled `local` serves (vLLM's default).
const IDS16: usize = 16;

/// The process's keys.
#[derive(Debug)]
struct Keys {
    /// The link's mix (and other block sizes' `local`).
    mix: [u64; 2],
    /// The portable `local`'s 8 words.
    words: [u64; 8],
    /// NH's 20 words (16 for a block and the shift of 4 for the second
    /// sum), stored as 24 to be read 8 at a time.
    nh: [u32; 24],
}

fn keys() -> &'static Keys {
    static KEYS: OnceLock<Keys> = OnceLock::new();
    KEYS.get_or_init(|| {
        let s = RandomState::default();
        let k = |i: usize| s.hash_one(i as u64);
        Keys {
            mix: std::array::from_fn(k),
            words: std::array::from_fn(|i| k(2 + i)),
            nh: std::array::from_fn(|i| k(10 + i) as u32),
        }
    })
}

/// The portable `local` of a block of 16 ids (see the module docs).
#[inline(always)]
fn local_products(k: &[u64; 8], block: &[u32; IDS16]) -> u64 {
    let w = |i: usize| u64::from(block[2 * i]) | u64::from(block[2 * i + 1]) << 32;
    mix(w(0) ^ k[0], w(1) ^ k[1])
        .wrapping_add(mix(w(2) ^ k[2], w(3) ^ k[3]))
        .wrapping_add(mix(w(4) ^ k[4], w(5) ^ k[5]))
        .wrapping_add(mix(w(6) ^ k[6], w(7) ^ k[7]))
}

/// The links of `blocks.len()` blocks of 16 ids after the links `prevs`
/// into `out`, by NH with AVX2 (see the module docs).
///
/// # Safety
/// The CPU has AVX2 (`is_x86_feature_detected!("avx2")`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn links_avx2(keys: &Keys, seed: u64, prevs: &[u64], blocks: &[u32], out: &mut [u64]) {
    use std::arch::x86_64::*;
    let nh = &keys.nh;
    // SAFETY: every load reads 8 u32 inside `nh` (24 words) or inside
    // the block's 16 ids (`chunks_exact`).
    let load = |p: *const u32| unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
    let (ka0, ka1) = (load(nh.as_ptr()), load(nh[8..].as_ptr()));
    let (kb0, kb1) = (load(nh[4..].as_ptr()), load(nh[12..].as_ptr()));
    for ((o, block), &prev) in out.iter_mut().zip(blocks.chunks_exact(IDS16)).zip(prevs) {
        let (m0, m1) = (load(block.as_ptr()), load(block[8..].as_ptr()));
        // Lanes of 64 bits: the even id plus its key times the odd one's.
        let pairs = |m: __m256i, k: __m256i| {
            let a = _mm256_add_epi32(m, k);
            _mm256_mul_epu32(a, _mm256_srli_epi64::<32>(a))
        };
        let a = _mm256_add_epi64(pairs(m0, ka0), pairs(m1, ka1));
        let b = _mm256_add_epi64(pairs(m0, kb0), pairs(m1, kb1));
        // The four lanes of each summed: [a0+a1 b0+b1 a2+a3 b2+b3], halves.
        let s = _mm256_add_epi64(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
        let s = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let (a, b) = (
            _mm_cvtsi128_si64(s) as u64,
            _mm_extract_epi64::<1>(s) as u64,
        );
        *o = link_of(&keys.mix, prev, (a, b), seed);
    }
}

/// The link from the previous one and a block's `local` (two words; the
/// portable forms give one, as the second).
#[inline(always)]
fn link_of(k: &[u64; 2], prev: u64, (a, b): (u64, u64), seed: u64) -> u64 {
    mix(prev ^ a ^ k[0], b ^ seed ^ k[1])
}

/// The 128-bit product of `a` and `b`, folded to 64 bits (xxh3's mix).
#[inline(always)]
fn mix(a: u64, b: u64) -> u64 {
    let m = u128::from(a) * u128::from(b);
    m as u64 ^ (m >> 64) as u64
}

/// Computes links for blocks of one size.
#[derive(Debug, Clone)]
pub(super) struct Links {
    keys: &'static Keys,
    /// Blocks of other sizes than 16: `local` is xxh3 of the block's ids
    /// under a key.
    other: Option<BlockStep>,
    /// Blocks of 16 by NH with AVX2 (this CPU has it).
    avx2: bool,
}

impl Links {
    pub(super) fn new(block_size: usize) -> Self {
        let keys = keys();
        Self {
            keys,
            other: (block_size != IDS16).then(|| BlockStep::new(block_size, keys.mix[0])),
            avx2: avx2(),
        }
    }

    /// Whether these are the links `Links::new` makes now (a test may
    /// force the portable path on its thread).
    pub(super) fn current(&self) -> bool {
        self.avx2 == avx2()
    }

    /// The link of `block` (of the block size) after the block linked
    /// `prev`, in the chain of `seed`.
    #[inline(always)]
    pub(super) fn link(&mut self, prev: u64, block: &[u32], seed: u64) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 && self.other.is_none() {
            let mut out = [0];
            // SAFETY: `avx2` says the CPU has AVX2.
            unsafe { links_avx2(self.keys, seed, &[prev], block, &mut out) };
            return out[0];
        }
        self.portable(prev, block, seed)
    }

    /// `link` without SIMD.
    #[inline(always)]
    fn portable(&mut self, prev: u64, block: &[u32], seed: u64) -> u64 {
        let Links { keys, other, .. } = self;
        let local = match (other, <&[u32; IDS16]>::try_from(block)) {
            (None, Ok(block)) => local_products(&keys.words, block),
            (other, _) => other.as_mut().map_or(0, |s| s.hash(keys.mix[1], block)),
        };
        link_of(&keys.mix, prev, (0, local), seed)
    }

    /// The links of `blocks` (whole blocks of the block size, one after
    /// each link of `prevs`) into `out` (as many): `link` each, for blocks
    /// of 16 ids with AVX2 where the CPU has it.
    #[inline(always)]
    pub(super) fn links(&mut self, prevs: &[u64], blocks: &[u32], seed: u64, out: &mut [u64]) {
        if out.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.avx2 && self.other.is_none() {
            // SAFETY: `avx2` says the CPU has AVX2.
            unsafe { links_avx2(self.keys, seed, prevs, blocks, out) };
            return;
        }
        let size = blocks.len() / out.len();
        for ((o, block), &prev) in out.iter_mut().zip(blocks.chunks_exact(size)).zip(prevs) {
            *o = self.portable(prev, block, seed);
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Links made on this thread take the portable path (tests of it on a
    /// CPU with AVX2).
    pub(super) static PORTABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether links of 16 ids take the AVX2 path: the CPU has it (asked once).
fn avx2() -> bool {
    #[cfg(test)]
    if PORTABLE.get() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        static AVX2: OnceLock<bool> = OnceLock::new();
        *AVX2.get_or_init(|| is_x86_feature_detected!("avx2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use std::hint::black_box;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::rng::Rng;

    /// NH's two sums of a block of 16 ids, one product at a time: what
    /// `links_avx2` computes four at a time.
    fn nh_sums(nh: &[u32; 24], block: &[u32; IDS16]) -> (u64, u64) {
        let sum = |k: &[u32]| {
            (0..IDS16 / 2).fold(0u64, |s, j| {
                let a = u64::from(block[2 * j].wrapping_add(k[2 * j]));
                let b = u64::from(block[2 * j + 1].wrapping_add(k[2 * j + 1]));
                s.wrapping_add(a * b)
            })
        };
        (sum(&nh[..IDS16]), sum(&nh[4..4 + IDS16]))
    }

    /// The link of `links`' path computed without SIMD: NH's sums one
    /// product at a time on the AVX2 path, the portable link otherwise.
    fn scalar(links: &mut Links, prev: u64, block: &[u32], seed: u64) -> u64 {
        match (links.avx2, &links.other, <&[u32; IDS16]>::try_from(block)) {
            (true, None, Ok(b)) => link_of(&links.keys.mix, prev, nh_sums(&links.keys.nh, b), seed),
            _ => links.portable(prev, block, seed),
        }
    }

    /// Links made with the portable path forced on this thread (`PORTABLE`).
    fn forced(portable: bool, bs: usize) -> Links {
        PORTABLE.set(portable);
        let links = Links::new(bs);
        PORTABLE.set(false);
        assert!(!portable || !links.avx2, "forced");
        links
    }

    /// The links of a run computed together and one by one are the scalar
    /// sums' links, on both paths (AVX2 on a CPU that has it, as on the
    /// project's machines; the portable path forced), at 16 ids and at
    /// other sizes, for runs of every length a walk asks; the two paths'
    /// links of 16 ids differ (two functions: each process uses one).
    #[test]
    fn links_together_are_the_links_one_by_one() {
        let mut rng = Rng::new(4);
        for portable in [false, true] {
            for bs in [16usize, 2, 17] {
                let mut links = forced(portable, bs);
                let mut nh = forced(false, bs);
                for len in 0..=9 {
                    let blocks: Vec<u32> = (0..len * bs).map(|_| rng.next_u64() as u32).collect();
                    let prevs: Vec<u64> = (0..len).map(|_| rng.next_u64()).collect();
                    let seed = rng.below(3);
                    let mut together = vec![0; len];
                    links.links(&prevs, &blocks, seed, &mut together);
                    let pairs = || prevs.iter().zip(blocks.chunks_exact(bs));
                    let one_by_one: Vec<u64> =
                        pairs().map(|(&p, b)| links.link(p, b, seed)).collect();
                    let want: Vec<u64> = pairs()
                        .map(|(&p, b)| scalar(&mut links, p, b, seed))
                        .collect();
                    assert_eq!(together, want, "{portable} {bs} x {len}");
                    assert_eq!(one_by_one, want, "{portable} {bs} x {len}");
                    if nh.avx2 && links.avx2 != nh.avx2 && bs == IDS16 {
                        for (&p, b) in pairs() {
                            assert_ne!(links.link(p, b, seed), nh.link(p, b, seed));
                        }
                    }
                }
            }
        }
    }

    /// Links tell blocks, seeds and predecessors apart, on both paths, at
    /// 16 ids and at other sizes: a changed id (in any position), another
    /// seed or another previous link changes the link.
    #[test]
    fn a_link_depends_on_every_id_the_seed_and_the_previous_link() {
        let mut rng = Rng::new(3);
        for portable in [false, true] {
            for bs in [1usize, 2, 5, 16, 17, 32] {
                let mut links = forced(portable, bs);
                for _ in 0..200 {
                    let block: Vec<u32> = (0..bs).map(|_| rng.next_u64() as u32).collect();
                    let (prev, seed) = (rng.next_u64(), rng.below(3));
                    let l = links.link(prev, &block, seed);
                    assert_eq!(
                        l,
                        links.link(prev, &block, seed),
                        "a function of its inputs"
                    );
                    for i in 0..bs {
                        let mut other = block.clone();
                        other[i] ^= 1 << rng.below(32);
                        assert_ne!(l, links.link(prev, &other, seed), "{bs}: id {i}");
                    }
                    assert_ne!(l, links.link(prev, &block, seed + 1), "{bs}: seed");
                    assert_ne!(l, links.link(prev ^ 1, &block, seed), "{bs}: prev");
                }
            }
        }
    }

    /// Not a test: the links of a run of 512 blocks of 16 random ids (each
    /// after a random link, as a walk checks a run), the best of 50 x 200,
    /// in chunks of 8 as a walk asks, by the AVX2 path, the portable path, and
    /// NH's sums one product at a time (the portable path before).
    /// `cargo test --release --lib -- --ignored --nocapture link_timing`
    #[test]
    #[ignore]
    fn link_timing() {
        let mut rng = Rng::new(9);
        let blocks: Vec<u32> = (0..512 * IDS16).map(|_| rng.next_u64() as u32).collect();
        let prevs: Vec<u64> = (0..512).map(|_| rng.next_u64()).collect();
        let mut out = vec![0u64; 512];
        let mut time = |f: &mut dyn FnMut(&mut [u64])| {
            let mut best = Duration::MAX;
            for _ in 0..50 {
                let t = Instant::now();
                for _ in 0..200 {
                    f(&mut out);
                    black_box(&out);
                }
                best = best.min(t.elapsed() / 200);
            }
            best
        };
        let mut avx2 = forced(false, IDS16);
        let mut portable = forced(true, IDS16);
        let in_chunks = |links: &mut Links, o: &mut [u64]| {
            let (p, b) = (black_box(&prevs), black_box(&blocks));
            for ((p, b), o) in p.chunks(8).zip(b.chunks(8 * IDS16)).zip(o.chunks_mut(8)) {
                links.links(p, b, 7, o);
            }
        };
        let nh = avx2.keys.nh;
        let rows = [
            (
                "AVX2 NH (chunks of 8)",
                avx2.avx2,
                time(&mut |o| in_chunks(&mut avx2, o)),
            ),
            (
                "portable: four folded products",
                true,
                time(&mut |o| in_chunks(&mut portable, o)),
            ),
            (
                "NH's sums one product at a time (the portable path before)",
                true,
                time(&mut |o| {
                    let (p, b) = (black_box(&prevs), black_box(&blocks));
                    for ((o, b), &p) in o.iter_mut().zip(b.chunks_exact(IDS16)).zip(p) {
                        let b = <&[u32; IDS16]>::try_from(b).expect("16");
                        *o = link_of(&[1, 2], p, nh_sums(&nh, b), 7);
                    }
                }),
            ),
        ];
        for (name, _, t) in rows.iter().filter(|(_, ran, _)| *ran) {
            println!("{name}: {:.3} us per 512 blocks", t.as_secs_f64() * 1e6);
        }
    }
}
