//! One step of the block-hash chain over token ids, `h = xxh3_64(le8(prev)
//! ++ block, seed)` (see the module docs of `prefix`), through one buffer
//! kept for the whole chain instead of a new one per block.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// One step of the chain for blocks of a given size: the previous hash and
/// the block's ids laid out little-endian in a buffer of the step's own.
#[derive(Debug, Clone)]
pub struct BlockStep {
    seed: u64,
    buf: Vec<u8>,
}

impl BlockStep {
    pub fn new(block_size: usize, seed: u64) -> Self {
        Self {
            seed,
            buf: vec![0; 8 + 4 * block_size],
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
