//! Scorer `session-affinity`: 1 for the endpoint the request's session went
//! to last (recorded by `started`), 0 for the others and for requests
//! without a session. At most `max_sessions` sessions are held; beyond, the
//! one first recorded longest ago is forgotten.

use std::collections::{HashMap, VecDeque};

use serde_json::Value;

use super::plugin::{params, Built, Describe, Kind, Needs, Scorer};
use super::{Ctx, PickConfig, PickRequest, Recorded};
use crate::error::{invalid, Error, Result};
use crate::snapshot::{Reader, Writer};

pub const PLUGIN: Describe = Describe {
    name: "session-affinity",
    kind: Kind::Scorer,
    needs: Needs::NOTHING,
    build,
    shared: None,
    resolve: None,
};

/// The parameters: `max_sessions`.
#[derive(Debug, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Params {
    max_sessions: usize,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            max_sessions: DEFAULT_MAX_SESSIONS,
        }
    }
}

fn build(p: &Value, _: &PickConfig) -> Result<Built> {
    let p: Params = params(p)?;
    Ok(Built::Scorer(Box::new(SessionAffinity::new(
        p.max_sessions,
    )?)))
}

/// Default bound on sessions held.
pub const DEFAULT_MAX_SESSIONS: usize = 100_000;
/// Largest `max_sessions`.
pub const MAX_SESSIONS: usize = 10_000_000;

#[derive(Debug, Clone, PartialEq)]
pub struct SessionAffinity {
    max_sessions: usize,
    endpoint_of: HashMap<String, usize>,
    /// Sessions in the order first recorded (the oldest is forgotten first).
    order: VecDeque<String>,
}

impl SessionAffinity {
    pub fn new(max_sessions: usize) -> Result<Self> {
        if max_sessions == 0 || max_sessions > MAX_SESSIONS {
            return Err(invalid(format!(
                "max_sessions must be in [1, {MAX_SESSIONS}], got {max_sessions}"
            )));
        }
        Ok(Self {
            max_sessions,
            endpoint_of: HashMap::new(),
            order: VecDeque::new(),
        })
    }

    fn bind(&mut self, session: Option<&str>, endpoint: usize) {
        let Some(s) = session else { return };
        if let Some(e) = self.endpoint_of.get_mut(s) {
            *e = endpoint;
            return;
        }
        if self.endpoint_of.len() >= self.max_sessions {
            if let Some(old) = self.order.pop_front() {
                self.endpoint_of.remove(&old);
            }
        }
        self.endpoint_of.insert(s.to_owned(), endpoint);
        self.order.push_back(s.to_owned());
    }
}

impl Scorer for SessionAffinity {
    fn score(&mut self, req: &PickRequest<'_>, ctx: &Ctx<'_>, out: &mut [f64]) -> Result<()> {
        let bound = req.session.and_then(|s| self.endpoint_of.get(s)).copied();
        for (o, &i) in out.iter_mut().zip(ctx.cand) {
            *o = if bound == Some(i) { 1.0 } else { 0.0 };
        }
        Ok(())
    }

    fn started(
        &mut self,
        req: &PickRequest<'_>,
        _: &[String],
        endpoint: usize,
        _: Option<&mut Recorded>,
    ) -> Result<()> {
        self.bind(req.session, endpoint);
        Ok(())
    }

    /// Endpoint `i` was removed: its sessions are unbound, later ones move
    /// down one index.
    fn removed(&mut self, i: usize, _: &str) -> Result<()> {
        self.endpoint_of.retain(|_, e| *e != i);
        self.order.retain(|s| self.endpoint_of.contains_key(s));
        for e in self.endpoint_of.values_mut() {
            if *e > i {
                *e -= 1;
            }
        }
        Ok(())
    }

    fn write(&self, w: &mut Writer) {
        w.u64(self.order.len() as u64);
        for s in &self.order {
            w.str(s).u64(self.endpoint_of[s] as u64);
        }
    }

    fn read(&mut self, r: &mut Reader<'_>, endpoints: usize) -> Result<()> {
        let n = r.count(13)?;
        if n > self.max_sessions {
            return Err(Error::Snapshot(format!("{n} sessions exceed max_sessions")));
        }
        self.endpoint_of.clear();
        self.order.clear();
        for _ in 0..n {
            let s = r.str()?;
            let e = r.u64()?;
            if e >= endpoints as u64 || self.endpoint_of.contains_key(&s) {
                return Err(Error::Snapshot("bad session entry".into()));
            }
            self.bind(Some(&s), e as usize);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointState;

    fn scores(a: &mut SessionAffinity, session: Option<&str>, cand: &[usize]) -> Vec<f64> {
        let names: Vec<String> = (0..4).map(|i| format!("e{i}")).collect();
        let states = vec![EndpointState::default(); 4];
        let ctx = Ctx {
            names: &names,
            states: &states,
            cand,
        };
        let req = PickRequest {
            session,
            ..PickRequest::default()
        };
        let mut out = vec![0.5; cand.len()];
        a.score(&req, &ctx, &mut out).expect("score");
        out
    }

    fn start(a: &mut SessionAffinity, session: &str, endpoint: usize) {
        let req = PickRequest {
            session: Some(session),
            ..PickRequest::default()
        };
        a.started(&req, &[], endpoint, None).expect("started");
    }

    #[test]
    fn binds_the_last_endpoint_forgets_the_oldest_and_follows_removals() {
        let mut a = SessionAffinity::new(2).expect("affinity");
        assert_eq!(scores(&mut a, Some("s"), &[0, 1]), [0.0, 0.0]);
        start(&mut a, "s", 1);
        start(&mut a, "s", 2);
        assert_eq!(scores(&mut a, Some("s"), &[0, 1, 2]), [0.0, 0.0, 1.0]);
        assert_eq!(scores(&mut a, None, &[2]), [0.0], "no session");
        start(&mut a, "t", 3);
        start(&mut a, "u", 0); // past max_sessions: "s" is forgotten
        assert_eq!(scores(&mut a, Some("s"), &[2]), [0.0]);
        assert_eq!(scores(&mut a, Some("t"), &[3]), [1.0]);
        a.removed(1, "e1").expect("removed");
        assert_eq!(scores(&mut a, Some("t"), &[2]), [1.0], "moved down one");
        a.removed(2, "e2").expect("removed");
        assert_eq!(scores(&mut a, Some("t"), &[0, 1, 2]), [0.0, 0.0, 0.0]);
        assert!(SessionAffinity::new(0).is_err());
    }
}
