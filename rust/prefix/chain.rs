//! One step of the block-hash chain over token ids, `h = xxh3_64(le8(prev)
//! ++ block, seed)` (see the module docs of `prefix`), through one buffer
//! kept for the whole chain instead of a new one per block; blocks of 16
//! ids (vLLM's default block size) without a buffer (`Keys16`).

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The block size `Keys16` serves: 8 + 64 bytes, xxh3's 17-128-byte path.
const IDS16: usize = 16;

/// xxh3-64's default secret (the xxHash specification's `kSecret`), its
/// first 96 bytes as little-endian words: what the 17-128-byte path reads
/// for an input of 72 bytes.
const SECRET: [u64; 12] = [
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
];
/// xxh64's first prime and xxh3's avalanche multiplier (the specification's).
const PRIME64_1: u64 = 0x9e37_79b1_85eb_ca87;
const PRIME_MX1: u64 = 0x1656_6791_9e37_79f9;

/// xxh3-64 of `le8(prev) ++ block` for a block of 16 ids, computed from
/// registers: the previous hash never goes through memory. xxh3's
/// accumulator for 72 bytes is the sum of six 16-byte mixes; five read the
/// block's ids alone, so only the mix of the first 16 bytes (the previous
/// hash and ids 0-1) and the avalanche wait for the previous block (about
/// 10 cycles a block); written to a buffer and read back by the library,
/// the previous hash waited on store forwarding as well, and how long
/// depended on how the step was compiled (512 blocks: 2.4 to 5.6 us
/// through the buffer in the kv-dynamo bench's builds, 2.5 from registers:
/// benches/RESULTS.md, issue 28). Equal to the library's hash for every
/// seed (`the_step_is_xxh3_for_every_block_size_and_seed`).
#[derive(Debug, Clone)]
struct Keys16 {
    /// `SECRET` with the seed added (even words) or subtracted (odd ones).
    keys: [u64; 12],
}

impl Keys16 {
    fn new(seed: u64) -> Self {
        Self {
            keys: std::array::from_fn(|k| match k % 2 {
                0 => SECRET[k].wrapping_add(seed),
                _ => SECRET[k].wrapping_sub(seed),
            }),
        }
    }

    #[inline(always)]
    fn hash(&self, prev: u64, block: &[u32]) -> u64 {
        let p: [u64; 8] =
            std::array::from_fn(|i| u64::from(block[2 * i]) | u64::from(block[2 * i + 1]) << 32);
        let mix = |lo: u64, hi: u64, k: usize| {
            let m = u128::from(lo ^ self.keys[k]) * u128::from(hi ^ self.keys[k + 1]);
            m as u64 ^ (m >> 64) as u64
        };
        // The 16-byte chunks at 16, 72 - 32, 32 and 72 - 48 (xxh3's order),
        // then 72 - 16: the block's ids alone.
        let ids = 72u64
            .wrapping_mul(PRIME64_1)
            .wrapping_add(mix(p[1], p[2], 4))
            .wrapping_add(mix(p[4], p[5], 6))
            .wrapping_add(mix(p[3], p[4], 8))
            .wrapping_add(mix(p[2], p[3], 10))
            .wrapping_add(mix(p[6], p[7], 2));
        let mut h = ids.wrapping_add(mix(prev, p[0], 0));
        h ^= h >> 37;
        h = h.wrapping_mul(PRIME_MX1);
        h ^ (h >> 32)
    }
}

/// One step of the chain for blocks of a given size: the previous hash and
/// the block's ids laid out little-endian in a buffer of the step's own, or
/// for 16 ids, `Keys16`.
#[derive(Debug, Clone)]
pub struct BlockStep {
    seed: u64,
    buf: Vec<u8>,
    ids16: Option<Keys16>,
}

impl BlockStep {
    pub fn new(block_size: usize, seed: u64) -> Self {
        let ids16 = (block_size == IDS16).then(|| Keys16::new(seed));
        Self {
            seed,
            buf: match ids16 {
                Some(_) => Vec::new(),
                None => vec![0; 8 + 4 * block_size],
            },
            ids16,
        }
    }

    /// The hash of `block` (of the block size) after the block hashed `prev`.
    ///
    /// The ids go in two at a time, as one 8-byte store: xxh3 reads the
    /// buffer 8 bytes at a time, and a load spanning two 4-byte stores
    /// cannot take its bytes from them; it waits until they reach the cache,
    /// which is after the store of `prev` before them, so along a chain
    /// every block waited for the previous block's hash to be written back
    /// (13 ns a block of 16 ids against 3.9 ns; see benches/RESULTS.md,
    /// issue 28).
    #[inline]
    pub fn hash(&mut self, prev: u64, block: &[u32]) -> u64 {
        if let Some(k) = &self.ids16 {
            return k.hash(prev, block);
        }
        let (head, body) = self.buf.split_at_mut(8);
        head.copy_from_slice(&prev.to_le_bytes());
        let mut pairs = block.chunks_exact(2);
        for (d, p) in body.chunks_exact_mut(8).zip(&mut pairs) {
            d.copy_from_slice(&(u64::from(p[0]) | u64::from(p[1]) << 32).to_le_bytes());
        }
        if let [last] = pairs.remainder() {
            let n = body.len();
            body[n - 4..].copy_from_slice(&last.to_le_bytes());
        }
        xxh3_64_with_seed(&self.buf, self.seed)
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
    fn the_step_is_xxh3_for_every_block_size_and_seed() {
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
