//! The walk's own key of a block, its *link*: `link_i = mix(link_{i-1},
//! local(block_i) ^ seed)`, from `link_{-1} = seed` (the chain's seed, an
//! adapter's `lora_seed`), where `local` hashes one block's token ids
//! alone. A walk checks a run of slots by their links (`Table::walk`):
//! each slot's link from the slot before and the prompt's block, never from
//! the block just checked, and `local` is independent per block, so the
//! checks of a run are throughput-bound (four 64x64-bit products a block of
//! 16 ids, and one for the link); the chained block hash (xxh3 over the
//! previous hash and the block, six products and the avalanche) is computed
//! only where a run ends and the next block is looked up by it.
//!
//! The keys are random per process: the token ids are a KV publisher's
//! choice, and with keys it cannot see it cannot choose blocks whose links
//! collide (a link never leaves the process: `KvIndex::blocks` and the
//! lookups use the chained hashes).

use std::hash::BuildHasher;
use std::sync::OnceLock;

use foldhash::quality::RandomState;

use crate::prefix::BlockStep;

/// The block size the unrolled `local` serves (vLLM's default).
const IDS16: usize = 16;

/// The process's keys: 8 for `local`'s words, 2 for the link's mix.
fn keys() -> &'static [u64; 10] {
    static KEYS: OnceLock<[u64; 10]> = OnceLock::new();
    KEYS.get_or_init(|| {
        let s = RandomState::default();
        std::array::from_fn(|i| s.hash_one(i as u64))
    })
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
    keys: [u64; 10],
    /// Blocks of other sizes than 16: `local` is xxh3 of the block's ids
    /// under a key.
    other: Option<BlockStep>,
}

impl Links {
    pub(super) fn new(block_size: usize) -> Self {
        let keys = *keys();
        Self {
            keys,
            other: (block_size != IDS16).then(|| BlockStep::new(block_size, keys[0])),
        }
    }

    /// The link of `block` (of the block size) after the block linked
    /// `prev`, in the chain of `seed`.
    #[inline(always)]
    pub(super) fn link(&mut self, prev: u64, block: &[u32], seed: u64) -> u64 {
        let k = &self.keys;
        let local = match &mut self.other {
            None => {
                let w = |i: usize| u64::from(block[2 * i]) | u64::from(block[2 * i + 1]) << 32;
                mix(w(0) ^ k[0], w(1) ^ k[1])
                    .wrapping_add(mix(w(2) ^ k[2], w(3) ^ k[3]))
                    .wrapping_add(mix(w(4) ^ k[4], w(5) ^ k[5]))
                    .wrapping_add(mix(w(6) ^ k[6], w(7) ^ k[7]))
            }
            Some(step) => step.hash(k[1], block),
        };
        mix(prev ^ k[8], local ^ seed ^ k[9])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

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
