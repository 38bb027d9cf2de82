//! Picker `max-score`: the candidate with the highest total; equal totals
//! are ordered by `Ties`.

use std::cmp::Ordering;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::plugin::{params, Built, Describe, Kind, Needs, Picker};
use super::{PickConfig, Ranking};
use crate::error::{invalid, Result};
use crate::rng::Rng;

pub const PLUGIN: Describe = Describe {
    name: "max-score",
    kind: Kind::Picker,
    needs: Needs::NOTHING,
    build,
    shared: None,
    resolve: Some(resolve),
};

/// The parameters: `ties` (default `round-robin`) and, for `random` ties,
/// `seed` (default the pipeline's).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Params {
    ties: Option<String>,
    seed: Option<u64>,
}

fn build(p: &Value, config: &PickConfig) -> Result<Built> {
    let p: Params = params(p)?;
    let ties = match p.ties.as_deref().unwrap_or("round-robin") {
        "first" => Ties::First,
        "least-request" => Ties::LeastRequest,
        "round-robin" => Ties::RoundRobin,
        "random" => Ties::Random {
            seed: p.seed.unwrap_or(config.seed),
        },
        other => {
            return Err(invalid(format!(
                "ties must be first, least-request, round-robin or random, got {other:?}"
            )))
        }
    };
    if p.seed.is_some() && !matches!(ties, Ties::Random { .. }) {
        return Err(invalid("seed: unknown parameter (ties random only)"));
    }
    Ok(Built::Picker(Arc::new(MaxScore { ties })))
}

/// The highest total; `ties` orders equal totals (the pipeline's picker
/// when it names none: ties round-robin).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxScore {
    pub ties: Ties,
}

impl Default for MaxScore {
    fn default() -> Self {
        Self {
            ties: Ties::RoundRobin,
        }
    }
}

impl Picker for MaxScore {
    fn choose(&self, rank: &Ranking<'_>) -> usize {
        choose(rank)
    }
    fn ties(&self) -> Ties {
        self.ties
    }
    fn seed(&self) -> u64 {
        match self.ties {
            Ties::Random { seed } => seed,
            _ => 0,
        }
    }
}

/// Random ties keep the pipeline's seed in their parameters.
fn resolve(p: &mut Map<String, Value>, config: &PickConfig) {
    if p.get("ties").and_then(Value::as_str) == Some("random")
        && p.get("seed").is_none_or(Value::is_null)
    {
        p.insert("seed".into(), Value::from(config.seed));
    }
}

/// How the max-score picker orders equal totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ties {
    /// Endpoint order.
    First,
    /// Fewer requests (`EndpointState::load`) first, then endpoint order.
    LeastRequest,
    /// Starting after the endpoint chosen last, in endpoint order.
    RoundRobin,
    /// A seeded random order, drawn anew for every pick.
    Random { seed: u64 },
}

/// Endpoint `a` before endpoint `b` among equal totals.
pub(super) fn tie_cmp(r: &Ranking<'_>, a: usize, b: usize) -> Ordering {
    match r.ties {
        Ties::First => a.cmp(&b),
        Ties::LeastRequest => r.states[a]
            .load()
            .total_cmp(&r.states[b].load())
            .then(a.cmp(&b)),
        Ties::RoundRobin => {
            let rot = |i: usize| (i + r.n - r.cursor) % r.n;
            rot(a).cmp(&rot(b))
        }
        Ties::Random { .. } => {
            let key = |i: usize| Rng::new(r.draw ^ i as u64).next_u64();
            key(a).cmp(&key(b)).then(a.cmp(&b))
        }
    }
}

/// The position of the best candidate.
fn choose(r: &Ranking<'_>) -> usize {
    (1..r.cand.len()).fold(0, |best, p| {
        if r.cmp(p, best) == Ordering::Less {
            p
        } else {
            best
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_build_the_tie_order() {
        let c = PickConfig {
            seed: 7,
            ..PickConfig::default()
        };
        let ties = |p: Value| match build(&p, &c) {
            Ok(Built::Picker(p)) => Ok(p.ties()),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(ties(serde_json::json!({})), Ok(Ties::RoundRobin));
        assert_eq!(ties(serde_json::json!({"ties": "first"})), Ok(Ties::First));
        assert_eq!(
            ties(serde_json::json!({"ties": "random"})),
            Ok(Ties::Random { seed: 7 })
        );
        assert_eq!(
            ties(serde_json::json!({"ties": "random", "seed": 3})),
            Ok(Ties::Random { seed: 3 })
        );
        let bad = ties(serde_json::json!({"ties": "last"})).expect_err("bad ties");
        assert!(bad.starts_with("ties must be"), "{bad}");
        let bad = ties(serde_json::json!({"ties": "first", "seed": 3})).expect_err("seed");
        assert!(bad.starts_with("seed: unknown parameter"), "{bad}");
        let mut m = Map::new();
        m.insert("ties".into(), "random".into());
        resolve(&mut m, &c);
        assert_eq!(m.get("seed"), Some(&Value::from(7)));
    }
}
