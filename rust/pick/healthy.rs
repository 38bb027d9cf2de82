//! Filter `healthy`: keeps the endpoints whose health checks pass
//! (`EndpointState::healthy`, kept by the scraper). Hard: with none healthy
//! the answer is empty, never a dead address.

use crate::endpoint::EndpointState;

pub fn keep(s: &EndpointState) -> bool {
    s.healthy
}
