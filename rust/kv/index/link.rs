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
//! `local` of a block of 16 ids is NH (the hash of UMAC) twice, under keys
//! shifted by four words (NH-Toeplitz): `sum (m[2j] + k[2j]) * (m[2j+1] +
//! k[2j+1])` over the 8 pairs, words added mod 2^32, 32x32->64-bit products
//! summed mod 2^64; two such sums, 16 products a block, which AVX2 does
//! four at a time (`links_avx2`, chosen at run time: never a build flag)
//! and `local_portable` one at a time, with the same result. The link is
//! one folded 64x64-bit product of the two sums with the previous link and
//! the seed. Other block sizes: xxh3 of the block's ids under a key.
//!
//! The keys are random per process: the token ids are a KV publisher's
//! choice, and with keys it cannot see it cannot choose blocks whose links
//! collide (a link never leaves the process: `KvIndex::blocks` and the
//! lookups use the chained hashes). How likely a false match is: two
//! different blocks after the same link give the same two NH sums with
//! probability at most 2^-64 (NH is 2^-32-almost-universal for each key
//! shift), and different sums the same link by a collision of the folded
//! product (about 2^-64, as for xxh3's mix). A false match makes a walk
//! read the slot's block as the prompt's (a claim the chained hash would
//! not make); a failed check only sends the walk to a lookup by the
//! chained hash, which never claims a block it does not find.

use std::hash::BuildHasher;
use std::sync::OnceLock;

use foldhash::quality::RandomState;

use crate::prefix::BlockStep;

/// The block size the unrolled `local` serves (vLLM's default).
const IDS16: usize = 16;

/// The process's keys: 2 words of 64 bits for the link's mix (and other
/// block sizes' `local`), and NH's 20 words of 32 bits (16 for a block and
/// the shift of 4 for the second sum), stored as 24 to be read 8 at a time.
fn keys() -> &'static ([u64; 2], [u32; 24]) {
    static KEYS: OnceLock<([u64; 2], [u32; 24])> = OnceLock::new();
    KEYS.get_or_init(|| {
        let s = RandomState::default();
        let k = |i: usize| s.hash_one(i as u64);
        (
            std::array::from_fn(k),
            std::array::from_fn(|i| k(2 + i) as u32),
        )
    })
}

/// NH's two sums of a block of 16 ids (see the module docs).
#[inline(always)]
fn local_portable(nh: &[u32; 24], block: &[u32; IDS16]) -> (u64, u64) {
    let sum = |k: &[u32]| {
        (0..IDS16 / 2).fold(0u64, |s, j| {
            let a = u64::from(block[2 * j].wrapping_add(k[2 * j]));
            let b = u64::from(block[2 * j + 1].wrapping_add(k[2 * j + 1]));
            s.wrapping_add(a * b)
        })
    };
    (sum(&nh[..IDS16]), sum(&nh[4..4 + IDS16]))
}

/// `local_portable` for `blocks.len()` blocks after the links `prevs`,
/// their links into `out`, with AVX2.
///
/// # Safety
/// The CPU has AVX2 (`is_x86_feature_detected!("avx2")`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn links_avx2(
    keys: &([u64; 2], [u32; 24]),
    seed: u64,
    prevs: &[u64],
    blocks: &[u32],
    out: &mut [u64],
) {
    use std::arch::x86_64::*;
    let (k64, nh) = keys;
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
        *o = link_of(k64, prev, (a, b), seed);
    }
}

/// The link from the previous one and a block's `local` (its two sums).
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
    keys: ([u64; 2], [u32; 24]),
    /// Blocks of other sizes than 16: `local` is xxh3 of the block's ids
    /// under a key (the second sum 0).
    other: Option<BlockStep>,
    /// Blocks of 16 with AVX2 (`links`; this CPU has it).
    avx2: bool,
}

impl Links {
    pub(super) fn new(block_size: usize) -> Self {
        let keys = *keys();
        Self {
            keys,
            other: (block_size != IDS16).then(|| BlockStep::new(block_size, keys.0[0])),
            avx2: avx2(),
        }
    }

    /// The link of `block` (of the block size) after the block linked
    /// `prev`, in the chain of `seed`.
    #[inline(always)]
    pub(super) fn link(&mut self, prev: u64, block: &[u32], seed: u64) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 && self.other.is_none() {
            let mut out = [0];
            // SAFETY: `avx2` says the CPU has AVX2.
            unsafe { links_avx2(&self.keys, seed, &[prev], block, &mut out) };
            return out[0];
        }
        self.portable(prev, block, seed)
    }

    /// `link` without SIMD.
    #[inline(always)]
    fn portable(&mut self, prev: u64, block: &[u32], seed: u64) -> u64 {
        let Links {
            keys: (k64, nh),
            other,
            ..
        } = self;
        let local = match (other, <&[u32; IDS16]>::try_from(block)) {
            (None, Ok(block)) => local_portable(nh, block),
            (other, _) => (other.as_mut().map_or(0, |s| s.hash(k64[1], block)), 0),
        };
        link_of(k64, prev, local, seed)
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
            unsafe { links_avx2(&self.keys, seed, prevs, blocks, out) };
            return;
        }
        let size = blocks.len() / out.len();
        for ((o, block), &prev) in out.iter_mut().zip(blocks.chunks_exact(size)).zip(prevs) {
            *o = self.portable(prev, block, seed);
        }
    }
}

/// Whether this CPU has AVX2 (asked once).
fn avx2() -> bool {
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
    use super::*;
    use crate::rng::Rng;

    /// The links of a run computed together and one by one (AVX2 on a CPU
    /// that has it, as on the project's machines) are the portable sums'
    /// links, at 16 ids and at other sizes, for runs of every length a walk
    /// asks.
    #[test]
    fn links_together_are_the_links_one_by_one() {
        let mut rng = Rng::new(4);
        for bs in [16usize, 2, 17] {
            let mut links = Links::new(bs);
            for len in 0..=9 {
                let blocks: Vec<u32> = (0..len * bs).map(|_| rng.next_u64() as u32).collect();
                let prevs: Vec<u64> = (0..len).map(|_| rng.next_u64()).collect();
                let seed = rng.below(3);
                let mut together = vec![0; len];
                links.links(&prevs, &blocks, seed, &mut together);
                let pairs = || prevs.iter().zip(blocks.chunks_exact(bs));
                let one_by_one: Vec<u64> = pairs().map(|(&p, b)| links.link(p, b, seed)).collect();
                let portable: Vec<u64> =
                    pairs().map(|(&p, b)| links.portable(p, b, seed)).collect();
                assert_eq!(together, portable, "{bs} x {len}");
                assert_eq!(one_by_one, portable, "{bs} x {len}");
            }
        }
    }

    /// Links tell blocks, seeds and predecessors apart, at 16 ids and at
    /// other sizes: a changed id (in any position), another seed or
    /// another previous link changes the link.
    #[test]
    fn a_link_depends_on_every_id_the_seed_and_the_previous_link() {
        let mut rng = Rng::new(3);
        for bs in [1usize, 2, 5, 16, 17, 32] {
            let mut links = Links::new(bs);
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
