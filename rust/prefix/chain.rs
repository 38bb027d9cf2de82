//! One step of the block-hash chain over token ids, `h = xxh3_64(le8(prev)
//! ++ block, seed)` (see the module docs of `prefix`), without copying the
//! block into a buffer first.
//!
//! For inputs of 17 to 128 bytes (blocks of 3 to 30 token ids) xxh3-64 is a
//! sum of `mix16` terms over 16-byte windows of the input, each a 64x64-bit
//! product folded to 64 bits, then an avalanche; the xxHash specification
//! (`doc/xxhash_spec.md`, "XXH3 algorithm description", the 17-128-byte
//! case) gives the windows and the secret. Written out here over the input's
//! 32-bit words, only the windows that overlap `le8(prev)` wait for the
//! previous hash: the others, and the next block's, are computed while the
//! chain's one product and avalanche per block run. Blocks of 4, 8 and 16
//! token ids (16 is vLLM's default) take this way; the result is the same
//! number as `xxhash_rust::xxh3::xxh3_64_with_seed` over the bytes (the
//! tests compare them), which hashes the other block sizes.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The first 128 bytes of xxh3's default secret (the specification's
/// `kSecret`) as little-endian words: the part the 17-128-byte case reads.
const SECRET: [u64; 16] = [
    0xbe4b_a423_396c_feb8,
    0x1cad_21f7_2c81_017c,
    0xdb97_9083_e96d_d4de,
    0x1f67_b3b7_a4a4_4072,
    0x78e5_c0cc_4ee6_79cb,
    0x2172_ffcc_7dd0_5a82,
    0x8e24_43f7_7446_08b8,
    0x4c26_3a81_e690_35e0,
    0xcb00_c391_bb52_283c,
    0xa32e_531b_8b65_d088,
    0x4ef9_0da2_9748_6471,
    0xd8ac_dea9_46ef_1938,
    0x3f34_9ce3_3f76_faa8,
    0x1d4f_0bc7_c7bb_dcf9,
    0x3159_b4cd_4be0_518a,
    0x6473_78d9_c97e_9fc8,
];
const PRIME64_1: u64 = 0x9e37_79b1_85eb_ca87;
const PRIME_MX: u64 = 0x1656_6791_9e37_79f9;

fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ (p >> 64) as u64
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(PRIME_MX);
    h ^ (h >> 32)
}

/// `xxh3_64_with_seed(le8(prev) ++ le4(block[0]) ++ ... ++ le4(block[N - 1]), seed)`
/// for `N` in 3..=30 (17-128-byte inputs): the block size is a constant, so
/// every window's place is too.
#[inline(always)]
fn step<const N: usize>(prev: u64, block: &[u32], seed: u64) -> u64 {
    let block = &block[..N];
    let len = 8 + 4 * N;
    // The input's 32-bit words: prev's two halves, then the block.
    let word = |k: usize| match k {
        0 => prev & 0xffff_ffff,
        1 => prev >> 32,
        _ => u64::from(block[k - 2]),
    };
    let read = |offset: usize| word(offset / 4) | word(offset / 4 + 1) << 32;
    let mix = |offset: usize, s: usize| {
        fold(
            read(offset) ^ SECRET[s].wrapping_add(seed),
            read(offset + 8) ^ SECRET[s + 1].wrapping_sub(seed),
        )
    };
    let mut acc = (len as u64).wrapping_mul(PRIME64_1);
    if len > 32 {
        if len > 64 {
            if len > 96 {
                acc = acc
                    .wrapping_add(mix(48, 12))
                    .wrapping_add(mix(len - 64, 14));
            }
            acc = acc.wrapping_add(mix(32, 8)).wrapping_add(mix(len - 48, 10));
        }
        acc = acc.wrapping_add(mix(16, 4)).wrapping_add(mix(len - 32, 6));
    }
    acc = acc.wrapping_add(mix(0, 0)).wrapping_add(mix(len - 16, 2));
    avalanche(acc)
}

/// One step of the chain for blocks of a given size: unrolled for the
/// block sizes engines use (vLLM's default is 16), else through a buffer.
#[derive(Debug, Clone)]
pub struct BlockStep {
    seed: u64,
    unrolled: Unrolled,
}

#[derive(Debug, Clone)]
enum Unrolled {
    N4,
    N8,
    N16,
    Buffer(Vec<u8>),
}

impl BlockStep {
    pub fn new(block_size: usize, seed: u64) -> Self {
        let unrolled = match block_size {
            4 => Unrolled::N4,
            8 => Unrolled::N8,
            16 => Unrolled::N16,
            _ => Unrolled::Buffer(vec![0; 8 + 4 * block_size]),
        };
        Self { seed, unrolled }
    }

    /// The hash of `block` (of the block size) after the block hashed `prev`.
    #[inline(always)]
    pub fn hash(&mut self, prev: u64, block: &[u32]) -> u64 {
        let seed = self.seed;
        match &mut self.unrolled {
            Unrolled::N4 => step::<4>(prev, block, seed),
            Unrolled::N8 => step::<8>(prev, block, seed),
            Unrolled::N16 => step::<16>(prev, block, seed),
            Unrolled::Buffer(buf) => {
                buf[..8].copy_from_slice(&prev.to_le_bytes());
                for (d, id) in buf[8..].chunks_exact_mut(4).zip(block) {
                    d.copy_from_slice(&id.to_le_bytes());
                }
                xxh3_64_with_seed(buf, seed)
            }
        }
    }
}

/// The chained hashes of `ids`' full blocks of `block_size`, the first
/// chained to `prev`, one at a time: a caller that stops early hashes no
/// further. `block_size` must be at least 1.
#[derive(Debug, Clone)]
pub struct IdChain<'a> {
    blocks: std::slice::ChunksExact<'a, u32>,
    prev: u64,
    step: BlockStep,
}

impl<'a> IdChain<'a> {
    pub fn new(ids: &'a [u32], block_size: usize, seed: u64, prev: u64) -> Self {
        Self {
            blocks: ids.chunks_exact(block_size),
            prev,
            step: BlockStep::new(block_size, seed),
        }
    }
}

impl Iterator for IdChain<'_> {
    type Item = u64;

    #[inline]
    fn next(&mut self) -> Option<u64> {
        let block = self.blocks.next()?;
        self.prev = self.step.hash(self.prev, block);
        Some(self.prev)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl ExactSizeIterator for IdChain<'_> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// The chain as the module docs of `prefix` define it, byte by byte.
    fn reference(ids: &[u32], block_size: usize, seed: u64, mut prev: u64) -> Vec<u64> {
        ids.chunks_exact(block_size)
            .map(|block| {
                let mut bytes = prev.to_le_bytes().to_vec();
                block
                    .iter()
                    .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                prev = xxh3_64_with_seed(&bytes, seed);
                prev
            })
            .collect()
    }

    #[test]
    fn the_unrolled_step_is_xxh3_for_every_block_size_and_seed() {
        let mut rng = Rng::new(11);
        for block_size in 1..=40 {
            for _ in 0..50 {
                let n = rng.below(6 * block_size as u64 + 1) as usize;
                let ids: Vec<u32> = (0..n).map(|_| rng.next_u64() as u32).collect();
                let seed = match rng.below(3) {
                    0 => 0,
                    1 => u64::MAX - rng.below(4),
                    _ => rng.next_u64(),
                };
                let prev = rng.next_u64();
                let got: Vec<u64> = IdChain::new(&ids, block_size, seed, prev).collect();
                assert_eq!(got, reference(&ids, block_size, seed, prev), "{block_size}");
            }
        }
    }

    #[test]
    fn the_chain_stops_where_the_caller_stops() {
        let ids: Vec<u32> = (0..100).collect();
        let mut chain = IdChain::new(&ids, 16, 5, 5);
        assert_eq!(chain.len(), 6);
        let first = chain.next();
        assert_eq!(chain.len(), 5, "one block hashed, five left");
        assert_eq!(first, reference(&ids, 16, 5, 5).first().copied());
    }
}
