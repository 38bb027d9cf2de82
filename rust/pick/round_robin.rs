//! Picker `round-robin`: the first candidate at or after the endpoint that
//! follows the one chosen last (in endpoint order, wrapping), scores ignored.

use std::sync::Arc;

use serde_json::Value;

use super::plugin::{params, Built, Describe, Kind, Needs, NoParams, Picker};
use super::{PickConfig, Ranking};
use crate::error::Result;

pub const PLUGIN: Describe = Describe {
    name: "round-robin",
    kind: Kind::Picker,
    needs: Needs::NOTHING,
    build,
    shared: None,
    resolve: None,
};

fn build(p: &Value, _: &PickConfig) -> Result<Built> {
    params::<NoParams>(p)?;
    Ok(Built::Picker(Arc::new(RoundRobin)))
}

/// The next candidate after the last chosen endpoint, scores ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RoundRobin;

impl Picker for RoundRobin {
    fn choose(&self, rank: &Ranking<'_>) -> usize {
        choose(rank)
    }
}

fn choose(r: &Ranking<'_>) -> usize {
    let rot = |i: usize| (i + r.n - r.cursor) % r.n;
    (0..r.cand.len())
        .min_by_key(|&p| rot(r.cand[p]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointState;
    use crate::pick::Ties;

    #[test]
    fn the_first_candidate_at_or_after_the_cursor_wrapping() {
        let states = vec![EndpointState::default(); 5];
        let cand = [0, 2, 4];
        let total = [1.0, 0.0, 0.5];
        let at = |cursor| {
            let r = Ranking {
                total: &total,
                cand: &cand,
                states: &states,
                ties: Ties::First,
                cursor,
                n: 5,
                draw: 0,
            };
            cand[choose(&r)]
        };
        assert_eq!([at(0), at(1), at(2), at(3), at(4)], [0, 2, 2, 4, 4]);
    }
}
