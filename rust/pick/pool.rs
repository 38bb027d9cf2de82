//! The pool picker: a pipeline and routecore's own count of requests in
//! flight per endpoint.

use super::{PickRequest, Pipeline};
use crate::endpoint::{complete_one, set_in_flight, EndpointState};
use crate::error::Result;
use crate::snapshot::{Reader, Writer};

/// A pipeline and routecore's own count of requests in flight per endpoint:
/// all the preset routers (`PrefixCacheRouter`, `VtcRouter`) keep besides
/// their settings.
#[derive(Debug, Clone)]
pub struct Counted {
    pub pipeline: Pipeline,
    pub states: Vec<EndpointState>,
}

impl Counted {
    pub fn new(pipeline: Pipeline) -> Self {
        let states = vec![EndpointState::default(); pipeline.endpoints().len()];
        Self { pipeline, states }
    }
    pub fn names(&self) -> &[String] {
        self.pipeline.endpoints().names()
    }
    /// Running requests per endpoint, in endpoint order.
    pub fn running(&self) -> Vec<u64> {
        self.states.iter().map(|s| s.in_flight).collect()
    }
    pub fn add_endpoint(&mut self, name: &str) -> Result<()> {
        self.pipeline.add_endpoint(name)?;
        self.states.push(EndpointState::default());
        Ok(())
    }
    /// Removes an endpoint (and what its plugins hold of it); returns its index.
    pub fn remove_endpoint(&mut self, name: &str) -> Result<usize> {
        let i = self.pipeline.remove_endpoint(name)?;
        self.states.remove(i);
        Ok(i)
    }
    pub fn set_running(&mut self, counts: &[i64]) -> Result<()> {
        set_in_flight(&mut self.states, counts)
    }
    /// Picks for `req` and starts it there (one more in flight); None when
    /// no endpoint is left.
    pub fn start(&mut self, req: &PickRequest<'_>) -> Result<Option<usize>> {
        let Some(endpoint) = self.pipeline.pick_one(req, &self.states)? else {
            return Ok(None);
        };
        self.pipeline.started(req, endpoint)?;
        self.states[endpoint].in_flight += 1;
        Ok(Some(endpoint))
    }
    /// Ends one request in flight on `name`; returns its index.
    pub fn complete(&mut self, name: &str) -> Result<usize> {
        let i = self.pipeline.endpoints().index(name)?;
        complete_one(&mut self.states[i], name)?;
        Ok(i)
    }
    /// Endpoint names and running counts, for a snapshot.
    pub fn write_counts(&self, w: &mut Writer) {
        w.u64(self.states.len() as u64);
        for (name, s) in self.names().iter().zip(&self.states) {
            w.str(name).u64(s.in_flight);
        }
    }
    /// What `write_counts` wrote: the names and the running counts.
    pub fn read_counts(r: &mut Reader<'_>) -> Result<(Vec<String>, Vec<u64>)> {
        let n = r.count(12)?;
        let mut names = Vec::with_capacity(n);
        let mut running = Vec::with_capacity(n);
        for _ in 0..n {
            names.push(r.str()?);
            running.push(r.u64()?);
        }
        Ok((names, running))
    }
    /// Running counts from a snapshot (same order as the endpoints).
    pub fn restore_running(&mut self, running: &[u64]) {
        for (s, &c) in self.states.iter_mut().zip(running) {
            s.in_flight = c;
        }
    }
}
