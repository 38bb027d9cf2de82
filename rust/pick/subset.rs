//! Filter `subset-hint`: keeps the endpoints of the request's subset hint
//! (Envoy's `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`,
//! resolved to indices by the caller); every endpoint when it has none. Hard:
//! a hint naming no live endpoint gives an empty answer, as the protocol asks.

use super::PickRequest;

pub fn keep(req: &PickRequest<'_>, i: usize) -> bool {
    req.subset.is_none_or(|s| s.contains(&i))
}
