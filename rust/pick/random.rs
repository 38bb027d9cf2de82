//! Picker `random`: a seeded draw weighted by the totals (uniform when they
//! are all zero, as in a pipeline without scorers).

use std::sync::Arc;

use serde_json::{Map, Value};

use super::plugin::{params, Built, Describe, Kind, Needs, Picker};
use super::{PickConfig, Ranking};
use crate::error::Result;
use crate::rng::Rng;

pub const PLUGIN: Describe = Describe {
    name: "random",
    kind: Kind::Picker,
    needs: Needs::NOTHING,
    build,
    shared: None,
    resolve: Some(resolve),
};

/// The parameters: `seed` (default the pipeline's).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Params {
    seed: Option<u64>,
}

fn build(p: &Value, config: &PickConfig) -> Result<Built> {
    let p: Params = params(p)?;
    Ok(Built::Picker(Arc::new(Random {
        seed: p.seed.unwrap_or(config.seed),
    })))
}

/// A draw weighted by the totals (uniform when they are all zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Random {
    seed: u64,
}

impl Picker for Random {
    fn choose(&self, rank: &Ranking<'_>) -> usize {
        choose(rank)
    }
    fn seed(&self) -> u64 {
        self.seed
    }
}

/// The draws' seed is kept in the parameters.
fn resolve(p: &mut Map<String, Value>, config: &PickConfig) {
    if p.get("seed").is_none_or(Value::is_null) {
        p.insert("seed".into(), Value::from(config.seed));
    }
}

fn choose(r: &Ranking<'_>) -> usize {
    let mut rng = Rng::new(r.draw);
    let sum: f64 = r.total.iter().sum();
    if sum <= 0.0 {
        return rng.below(r.cand.len() as u64) as usize;
    }
    let mut x = rng.uniform() * sum;
    for (p, &t) in r.total.iter().enumerate() {
        if x < t {
            return p;
        }
        x -= t;
    }
    // Rounding left x at or past the last positive total.
    r.total.iter().rposition(|&t| t > 0.0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointState;
    use crate::pick::Ties;

    fn ranking<'a>(
        total: &'a [f64],
        cand: &'a [usize],
        states: &'a [EndpointState],
        draw: u64,
    ) -> Ranking<'a> {
        Ranking {
            total,
            cand,
            states,
            ties: Ties::First,
            cursor: 0,
            n: states.len(),
            draw,
        }
    }

    #[test]
    fn draws_follow_the_totals_and_never_a_zero() {
        let states = vec![EndpointState::default(); 3];
        let cand = [0, 1, 2];
        let total = [0.0, 3.0, 1.0];
        let mut hits = [0u32; 3];
        for draw in 0..4000 {
            hits[choose(&ranking(&total, &cand, &states, draw))] += 1;
        }
        assert_eq!(hits[0], 0, "a zero total is never drawn");
        // 3:1 expected; 4,000 draws keep the share within a few percent.
        let share = f64::from(hits[1]) / 4000.0;
        assert!((share - 0.75).abs() < 0.04, "{hits:?}");
        let zeros = [0.0; 3];
        let mut seen = [false; 3];
        for draw in 0..200 {
            seen[choose(&ranking(&zeros, &cand, &states, draw))] = true;
        }
        assert_eq!(seen, [true; 3], "all zero: uniform");
        let c = PickConfig {
            seed: 9,
            ..PickConfig::default()
        };
        let Ok(Built::Picker(p)) = build(&serde_json::json!({}), &c) else {
            panic!("a picker");
        };
        assert_eq!((p.seed(), p.ties()), (9, Ties::First));
    }
}
