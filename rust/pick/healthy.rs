//! Filter `healthy`: keeps the endpoints whose health checks pass
//! (`EndpointState::healthy`, kept by the scraper). Hard: with none healthy
//! the answer is empty, never a dead address.

use super::EndpointState;

pub fn keep(s: &EndpointState) -> bool {
    s.healthy
}
