//! The front door of a request, shared by both front ends: Envoy's ext_proc
//! ([`super::extproc`], one stream per request) and the RouteCore API
//! (`DataPlane.route_body` / `route_fields` / `feedback` / `authenticate`,
//! one call per RPC, through [`route_once`], [`feedback_once`] and
//! [`authenticate_once`]). A front end only translates its messages into the
//! calls of a [`Door`] and the [`Outcome`] back into its own answer; the
//! rules live here, once:
//!
//! - the tenant's API key ([`Engine::authenticate`]: 401 missing or unknown,
//!   403 expired), for every call (Route, Feedback, Plan); a body that comes
//!   before any key was checked is checked as a request without a key;
//! - who may end a request ([`Door::feedback`]): the RouteCore API ends only
//!   what its caller's tenant routed through it, by an id that is bounded
//!   ([`MAX_REQUEST_ID_BYTES`], 400 past it) and never echoed; a request
//!   that is not in flight and one that is not the caller's are the same
//!   404;
//! - the body limit `limits.max_body_bytes` of the current configuration
//!   (413 above), checked as the chunks come and again on the whole body;
//! - the time of each decision (`routecore_decision_seconds`);
//! - `server.failure_mode`: a routing step that fails (an error or a panic)
//!   sends the request to the default pool (open; not put to admission again)
//!   or is refused with 503 (closed); a failure of a front end's own step
//!   ([`Door::fail`]) is counted under the mode and refused with 503. The
//!   client never sees the failure's detail;
//! - the refusal itself ([`Reject`]: the HTTP status a gateway answers), and
//!   [`Reject::is_bad_request`], the refusals that say the request itself is
//!   bad (400, 413): the RouteCore API answers those with INVALID_ARGUMENT.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use futures_util::FutureExt;

use super::engine::{Caller, Engine, Fields, Hints, Outcome, Reject, Shared, MAX_REQUEST_ID_BYTES};
use super::failure::FailureMode;
use super::usage::Usage;
use crate::error::{invalid, Result};

/// What a request is routed on.
#[derive(Debug, Clone, Copy)]
pub enum Routing<'a> {
    /// Nothing (a request without a body): the default pool.
    Default,
    /// An OpenAI request body.
    Body(&'a [u8]),
    /// A request's measured fields.
    Fields(Fields<'a>),
}

impl Reject {
    /// The request itself is bad (malformed, too long, too large), rather
    /// than refused by a decision (key, model, endpoint, admission, failure).
    pub fn is_bad_request(&self) -> bool {
        matches!(self.status, 400 | 413)
    }
}

/// One request at the door, from its key to its routing.
pub struct Door {
    engine: Arc<Engine>,
    shared: Arc<Shared>,
    tenant: Option<usize>,
    /// The key was checked (or the caller is trusted).
    checked: bool,
}

impl Door {
    /// A request on `engine` (pinned: a reload does not move it).
    pub fn new(engine: Arc<Engine>, shared: Arc<Shared>) -> Self {
        Self {
            engine,
            shared,
            tenant: None,
            checked: false,
        }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The tenant the key authenticated (None: no tenants configured, or
    /// not yet authenticated).
    pub fn tenant(&self) -> Option<usize> {
        self.tenant
    }

    /// Authenticates the tenant by `key` (None: no key given).
    pub fn authenticate(&mut self, key: Option<&[u8]>) -> std::result::Result<(), Reject> {
        self.tenant = self.engine.authenticate(key)?;
        self.checked = true;
        Ok(())
    }

    /// A caller the server trusts (the Python API called without a key): no
    /// tenant, nothing to check.
    pub fn trust(&mut self) {
        self.checked = true;
    }

    /// Ends the request `request_id` with its usage if the caller's tenant
    /// routed it through the RouteCore API. The id is never echoed: 400
    /// past [`MAX_REQUEST_ID_BYTES`], 404 when no request of the caller's is
    /// in flight under it.
    pub fn feedback(
        &mut self,
        request_id: &str,
        usage: Option<Usage>,
    ) -> std::result::Result<(), Reject> {
        if !self.checked {
            self.authenticate(None)?;
        }
        if request_id.len() > MAX_REQUEST_ID_BYTES {
            let message = format!("request_id exceeds {MAX_REQUEST_ID_BYTES} bytes");
            return Err(self
                .engine
                .refuse(self.tenant, 400, "invalid-request", message, 0.0));
        }
        let caller = Caller::Tenant(self.engine.tenant_name(self.tenant));
        if self.shared.release_request(request_id, caller, usage) {
            return Ok(());
        }
        let message = "no request of yours is in flight with this id";
        Err(self
            .engine
            .refuse(self.tenant, 404, "not-in-flight", message, 0.0))
    }

    /// Checks the key if it was not (as a request without one), then that a
    /// body of `bytes` bytes is within `limits.max_body_bytes`.
    pub fn check_body(&mut self, bytes: usize) -> std::result::Result<(), Reject> {
        if !self.checked {
            self.authenticate(None)?;
        }
        let limit = self.engine.spec.limits.max_body_bytes;
        if bytes as u64 > limit {
            let message = format!("request body exceeds {limit} bytes");
            return Err(self
                .engine
                .refuse(self.tenant, 413, "body-too-large", message, 0.0));
        }
        Ok(())
    }

    /// Routes the request (pool, endpoint, admission, lease) under
    /// `server.failure_mode`, timing the decision.
    pub async fn route(&mut self, routing: Routing<'_>, hints: &Hints) -> Outcome {
        match routing {
            Routing::Body(body) => self.check_body(body.len())?,
            _ if !self.checked => self.authenticate(None)?,
            _ => {}
        }
        let start = Instant::now();
        let engine = Arc::clone(&self.engine);
        let tenant = self.tenant;
        let step = async {
            match routing {
                Routing::Default => engine.route_default(tenant, hints, true).await,
                Routing::Body(body) => engine.route_body(body, tenant, hints).await,
                Routing::Fields(f) => engine.route_fields(&f, tenant, hints).await,
            }
        };
        let outcome = AssertUnwindSafe(step)
            .catch_unwind()
            .await
            .unwrap_or_else(|_| Err(invalid("panic while routing")));
        let outcome = self.decide(outcome, hints).await;
        self.shared
            .metrics
            .decision_seconds
            .observe(start.elapsed().as_secs_f64());
        outcome
    }

    /// A routing step that failed goes by `server.failure_mode`: open sends
    /// the request to the default pool (not put to admission again: the
    /// failure is handled once), closed refuses it with 503. Logged as
    /// `route-failed`.
    async fn decide(&self, outcome: Result<Outcome>, hints: &Hints) -> Outcome {
        let err = match outcome {
            Ok(o) => return o,
            Err(e) => e,
        };
        let mode = self.count_failure();
        tracing::error!(error = %err, failure_mode = mode, "route-failed");
        if self.engine.failure_mode() == FailureMode::Open {
            match self.engine.route_default(self.tenant, hints, false).await {
                Ok(o) => return o,
                Err(e) => tracing::error!(error = %e, failure_mode = mode, "route-failed"),
            }
        }
        Err(self.internal_error())
    }

    /// A step of the front end itself failed (`error`, never shown to the
    /// client): logged as `stream-failed` and counted under the failure
    /// mode. The request, if still unanswered, is refused with
    /// [`Door::internal_error`].
    pub fn fail(&self, error: &str) {
        let mode = self.count_failure();
        tracing::error!(error, failure_mode = mode, "stream-failed");
    }

    /// The refusal of a request whose handling failed: 503, no detail.
    pub fn internal_error(&self) -> Reject {
        self.engine
            .refuse(self.tenant, 503, "internal-error", "internal error", 0.0)
    }

    /// Counts a failure under the failure mode; returns the mode's name.
    fn count_failure(&self) -> &'static str {
        let mode = self.engine.failure_mode().as_str();
        self.shared.metrics.failure(mode);
        mode
    }
}

/// The door of one RouteCore call: the key checked (None: a trusted
/// caller, no tenant).
fn door_for(
    engine: Arc<Engine>,
    shared: Arc<Shared>,
    key: Option<&[u8]>,
) -> std::result::Result<Door, Reject> {
    let mut door = Door::new(engine, shared);
    match key {
        Some(k) => door.authenticate(Some(k))?,
        None => door.trust(),
    }
    Ok(door)
}

/// The whole door in one call, for a unary API: the key (None: a trusted
/// caller, no tenant), the body limit, then the routing. The request is
/// ended by a [`feedback_once`] from the same tenant (or the timeout).
pub async fn route_once(
    engine: Arc<Engine>,
    shared: Arc<Shared>,
    key: Option<&[u8]>,
    routing: Routing<'_>,
    hints: &Hints,
) -> Outcome {
    let shared_ = Arc::clone(&shared);
    let routed = door_for(engine, shared, key)?.route(routing, hints).await?;
    shared_.accept_feedback(routed.id);
    Ok(routed)
}

/// A RouteCore `Feedback`: the key, then [`Door::feedback`].
pub fn feedback_once(
    engine: Arc<Engine>,
    shared: Arc<Shared>,
    key: &[u8],
    request_id: &str,
    usage: Option<Usage>,
) -> std::result::Result<(), Reject> {
    door_for(engine, shared, Some(key))?.feedback(request_id, usage)
}

/// A RouteCore call that touches no request (`Plan`): the key only. The
/// tenant's name (None: no tenants configured).
pub fn authenticate_once(
    engine: Arc<Engine>,
    shared: Arc<Shared>,
    key: &[u8],
) -> std::result::Result<Option<String>, Reject> {
    let door = door_for(engine, shared, Some(key))?;
    Ok(door.engine.tenant_name(door.tenant).map(String::from))
}
