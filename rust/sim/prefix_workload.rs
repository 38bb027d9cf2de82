//! A seeded workload with shared prefixes, for evaluating prefix-cache-aware
//! endpoint picking in the simulator.
//!
//! - `sessions` conversations are open at any time. A request picks one of
//!   them uniformly, appends a user message of `user_tokens` tokens (uniform in
//!   the range) to its context, and sends the whole context as its prompt; the
//!   reply of `output_tokens` tokens joins the context, so every turn's prompt
//!   extends the previous turn's prompt and reply. After `turns` turns
//!   (uniform in the range) the session closes and a new one opens.
//! - A new session starts with a system prompt of `system_tokens` tokens: with
//!   probability `shared_fraction` one of `system_prompts` shared prompts
//!   (chosen uniformly; the users of an application), otherwise a private
//!   prompt of its own.
//! - Arrivals are Poisson at `rate` requests per second; token ids are uniform
//!   32-bit values, so two texts share a block only where one was copied from
//!   the other.
//!
//! Each request carries the chained block hashes ([`crate::prefix::block_hashes`],
//! 16-token blocks, seed 0) of its prompt followed by its reply, which the
//! simulated endpoints' prefix caches key on, and those blocks' token ids
//! ([`super::RequestBlocks`]).
//! Everything is a function of the seed.

use crate::error::{invalid, positive, Result};
use crate::prefix::{block_hashes, Tokens};
use crate::rng::Rng;

use super::engine::BLOCK_TOKENS;
use super::RequestBlocks;

/// The generator's knobs (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixWorkloadConfig {
    pub requests: usize,
    pub rate: f64,
    pub sessions: usize,
    pub turns: (u64, u64),
    pub system_prompts: usize,
    pub shared_fraction: f64,
    pub system_tokens: (u64, u64),
    pub user_tokens: (u64, u64),
    pub output_tokens: (u64, u64),
    pub seed: u64,
}

impl Default for PrefixWorkloadConfig {
    fn default() -> Self {
        Self {
            requests: 2000,
            rate: 20.0,
            sessions: 64,
            turns: (1, 8),
            system_prompts: 8,
            shared_fraction: 0.9,
            system_tokens: (512, 2048),
            user_tokens: (20, 300),
            output_tokens: (50, 400),
            seed: 0,
        }
    }
}

/// Most requests one generation makes.
pub const MAX_REQUESTS: usize = 1_000_000;
/// Largest length any range may give (tokens or turns).
pub const MAX_RANGE: u64 = 1 << 20;

impl PrefixWorkloadConfig {
    fn check(&self) -> Result<()> {
        let count = |what: &str, v: usize, max: usize| {
            if v < 1 || v > max {
                return Err(invalid(format!("{what} must be in [1, {max}], got {v}")));
            }
            Ok(())
        };
        count("requests", self.requests, MAX_REQUESTS)?;
        count("sessions", self.sessions, MAX_REQUESTS)?;
        count("system_prompts", self.system_prompts, MAX_REQUESTS)?;
        positive("rate", self.rate)?;
        if !(0.0..=1.0).contains(&self.shared_fraction) {
            return Err(invalid(format!(
                "shared_fraction must be in [0, 1], got {}",
                self.shared_fraction
            )));
        }
        for (what, (lo, hi)) in [
            ("turns", self.turns),
            ("system_tokens", self.system_tokens),
            ("user_tokens", self.user_tokens),
            ("output_tokens", self.output_tokens),
        ] {
            if lo < 1 || lo > hi || hi > MAX_RANGE {
                return Err(invalid(format!(
                    "{what} must be a range 1 <= lo <= hi <= {MAX_RANGE}, got ({lo}, {hi})"
                )));
            }
        }
        Ok(())
    }
}

/// The generated requests, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixWorkload {
    pub arrival_s: Vec<f64>,
    pub input_tokens: Vec<u64>,
    pub output_tokens: Vec<u64>,
    /// Session id (in order of opening) per request.
    pub session: Vec<u64>,
    /// Turn within the session, from 0.
    pub turn: Vec<u64>,
    /// The shared system prompt the session started with; -1 for a private one.
    pub system_prompt: Vec<i64>,
    pub blocks: RequestBlocks,
}

struct Session {
    id: u64,
    system_prompt: i64,
    context: Vec<u32>,
    turns_left: u64,
    turn: u64,
}

/// Generates the workload of the module docs.
pub fn generate(cfg: &PrefixWorkloadConfig) -> Result<PrefixWorkload> {
    cfg.check()?;
    let mut rng = Rng::new(cfg.seed);
    let length = |rng: &mut Rng, (lo, hi): (u64, u64)| lo + rng.below(hi - lo + 1);
    let text = |rng: &mut Rng, n: u64| (0..n).map(|_| rng.next_u64() as u32).collect::<Vec<_>>();
    let shared: Vec<Vec<u32>> = (0..cfg.system_prompts)
        .map(|_| {
            let n = length(&mut rng, cfg.system_tokens);
            text(&mut rng, n)
        })
        .collect();
    let mut opened = 0u64;
    let mut open = |rng: &mut Rng| {
        let (system_prompt, context) = if rng.uniform() < cfg.shared_fraction {
            let k = rng.below(cfg.system_prompts as u64) as usize;
            (k as i64, shared[k].clone())
        } else {
            let n = length(rng, cfg.system_tokens);
            (-1, text(rng, n))
        };
        opened += 1;
        Session {
            id: opened - 1,
            system_prompt,
            context,
            turns_left: length(rng, cfg.turns),
            turn: 0,
        }
    };
    let mut sessions: Vec<Session> = (0..cfg.sessions).map(|_| open(&mut rng)).collect();
    let n = cfg.requests;
    let mut out = PrefixWorkload {
        arrival_s: Vec::with_capacity(n),
        input_tokens: Vec::with_capacity(n),
        output_tokens: Vec::with_capacity(n),
        session: Vec::with_capacity(n),
        turn: Vec::with_capacity(n),
        system_prompt: Vec::with_capacity(n),
        blocks: RequestBlocks::none(0),
    };
    let mut t = 0.0;
    for _ in 0..n {
        t += rng.exponential(cfg.rate);
        let k = rng.below(cfg.sessions as u64) as usize;
        let user = length(&mut rng, cfg.user_tokens);
        let reply = length(&mut rng, cfg.output_tokens);
        let s = &mut sessions[k];
        s.context.extend(text(&mut rng, user));
        let input = s.context.len() as u64;
        s.context.extend(text(&mut rng, reply));
        let hashes = block_hashes(Tokens::Ids(&s.context), BLOCK_TOKENS as usize, 0)?;
        let full = hashes.len() * BLOCK_TOKENS as usize;
        out.blocks.tokens.extend_from_slice(&s.context[..full]);
        out.blocks.hashes.extend(hashes);
        out.blocks.offsets.push(out.blocks.hashes.len());
        out.arrival_s.push(t);
        out.input_tokens.push(input);
        out.output_tokens.push(reply);
        out.session.push(s.id);
        out.turn.push(s.turn);
        out.system_prompt.push(s.system_prompt);
        s.turn += 1;
        s.turns_left -= 1;
        if s.turns_left == 0 {
            sessions[k] = open(&mut rng);
        }
    }
    // Each request's hashes are the chain of its tokens, by construction.
    out.blocks.chained = true;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(seed: u64) -> PrefixWorkloadConfig {
        PrefixWorkloadConfig {
            requests: 400,
            sessions: 16,
            system_tokens: (64, 256),
            seed,
            ..PrefixWorkloadConfig::default()
        }
    }

    fn hashes(w: &PrefixWorkload, i: usize) -> &[u64] {
        &w.blocks.hashes[w.blocks.offsets[i]..w.blocks.offsets[i + 1]]
    }

    #[test]
    fn same_seed_same_workload() {
        let a = generate(&small(3)).expect("workload");
        assert_eq!(a, generate(&small(3)).expect("workload"));
        assert_ne!(a, generate(&small(4)).expect("workload"));
        assert_eq!(a.input_tokens.len(), 400);
        assert!(a.arrival_s.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_turn_extends_the_previous_turn() {
        let w = generate(&small(1)).expect("workload");
        let mut last: std::collections::HashMap<u64, usize> = Default::default();
        let mut follow_ups = 0;
        for i in 0..w.input_tokens.len() {
            if let Some(&p) = last.get(&w.session[i]) {
                // The prompt holds the previous prompt and reply, then more.
                assert_eq!(w.turn[i], w.turn[p] + 1);
                assert!(w.input_tokens[i] > w.input_tokens[p] + w.output_tokens[p]);
                assert_eq!(&hashes(&w, i)[..hashes(&w, p).len()], hashes(&w, p));
                follow_ups += 1;
            } else {
                assert_eq!(w.turn[i], 0);
            }
            let blocks = (w.input_tokens[i] + w.output_tokens[i]) / BLOCK_TOKENS;
            assert_eq!(hashes(&w, i).len() as u64, blocks);
            // The blocks' token ids hash to the blocks' hashes.
            let range = w.blocks.offsets[i]..w.blocks.offsets[i + 1];
            let ids = w.blocks.tokens_of(range).expect("tokens");
            let rehashed = block_hashes(Tokens::Ids(ids), BLOCK_TOKENS as usize, 0);
            assert_eq!(rehashed.expect("hashes"), hashes(&w, i));
            last.insert(w.session[i], i);
        }
        assert!(follow_ups > 200, "{follow_ups}");
    }

    #[test]
    fn system_prompts_are_shared_as_configured() {
        for (fraction, lo, hi) in [(0.0, 0.0, 0.0), (0.5, 0.35, 0.65), (1.0, 1.0, 1.0)] {
            let cfg = PrefixWorkloadConfig {
                shared_fraction: fraction,
                ..small(5)
            };
            let w = generate(&cfg).expect("workload");
            let first = |i: usize| w.blocks.hashes[w.blocks.offsets[i]];
            let mut sessions = std::collections::BTreeMap::new();
            for i in 0..w.input_tokens.len() {
                sessions.entry(w.session[i]).or_insert(i);
            }
            let shared = sessions
                .values()
                .filter(|&&i| w.system_prompt[i] >= 0)
                .count();
            let share = shared as f64 / sessions.len() as f64;
            assert!((lo..=hi).contains(&share), "{fraction}: {share}");
            // Sessions of one shared prompt begin with the same blocks; a
            // private prompt begins like no other session.
            for &i in sessions.values() {
                for &j in sessions.values() {
                    let same = first(i) == first(j);
                    let expected = i == j
                        || (w.system_prompt[i] >= 0 && w.system_prompt[i] == w.system_prompt[j]);
                    assert_eq!(same, expected, "{i} {j}");
                }
            }
        }
    }

    #[test]
    fn bad_ranges_are_refused() {
        for cfg in [
            PrefixWorkloadConfig {
                requests: 0,
                ..small(0)
            },
            PrefixWorkloadConfig {
                rate: f64::NAN,
                ..small(0)
            },
            PrefixWorkloadConfig {
                shared_fraction: 1.5,
                ..small(0)
            },
            PrefixWorkloadConfig {
                turns: (3, 2),
                ..small(0)
            },
            PrefixWorkloadConfig {
                user_tokens: (0, 2),
                ..small(0)
            },
        ] {
            assert!(generate(&cfg).is_err(), "{cfg:?}");
        }
    }
}
