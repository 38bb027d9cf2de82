//! Filter `subset-hint`: keeps the endpoints of the request's subset hint
//! (Envoy's `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`,
//! resolved to indices by the caller); every endpoint when it has none. Hard:
//! a hint naming no live endpoint gives an empty answer, as the protocol asks.

use super::plugin::{filter_without_params, Describe, Filter, Kind, Needs};
use super::PickRequest;
use crate::endpoint::EndpointState;

pub const PLUGIN: Describe = Describe {
    name: "subset-hint",
    kind: Kind::Filter { soft: false },
    needs: Needs::NOTHING,
    build: filter_without_params::<SubsetHint>,
    shared: None,
    resolve: None,
};

#[derive(Debug, Clone, Copy, Default)]
pub struct SubsetHint;

impl Filter for SubsetHint {
    fn keep(&self, req: &PickRequest<'_>, i: usize, _: &EndpointState) -> bool {
        req.subset.is_none_or(|s| s.contains(&i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_hint_or_everything_without_one() {
        let s = EndpointState::default();
        let none = PickRequest::default();
        assert!((0..3).all(|i| SubsetHint.keep(&none, i, &s)));
        let hint = [2, 0];
        let req = PickRequest {
            subset: Some(&hint),
            ..PickRequest::default()
        };
        let kept: Vec<usize> = (0..4).filter(|&i| SubsetHint.keep(&req, i, &s)).collect();
        assert_eq!(kept, vec![0, 2]);
        let empty = PickRequest {
            subset: Some(&[]),
            ..PickRequest::default()
        };
        assert!((0..3).all(|i| !SubsetHint.keep(&empty, i, &s)));
    }
}
