//! The router in front of the fleet: which pool serves a request, and with how
//! many input tokens.
//!
//! - [`Homogeneous`]: the baseline, one pool takes everything.
//! - [`TokenBudgetRouting`]: routecore's real [`TokenBudgetRouter`] in the loop.
//!   A simulated request's prompt is `round(L_in * c_k)` bytes, `c_k` its
//!   category's true bytes-per-token ratio; the router estimates its tokens
//!   with the calibrator, and every completed request feeds its
//!   `(prompt_bytes, L_in)` back, as `usage.prompt_tokens` would.
//!   With `compress` set it is compress-and-route (FleetOpt section 5): a
//!   request of a compressible category whose estimated L_total falls in the
//!   borderline band `(B, gamma * B]` of the smallest-budget pool (budget `B`)
//!   has its input cut to `T_c = B - L_out` tokens and is routed with that
//!   total, `B`, which the short pool holds by construction.

use std::sync::{Arc, RwLock};

use crate::budget::{Pool, Request, TokenBudgetRouter};
use crate::calibrate::Calibrator;
use crate::error::{invalid, Result};

use super::{Category, SimRequest};

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routed {
    pub pool: usize,
    /// The input tokens the pool serves (fewer than L_in when compressed).
    pub input_tokens: u64,
    pub compressed: bool,
}

/// A router in the simulation loop.
pub trait FleetRouter {
    /// The pool for a request (None: rejected by the router).
    fn route(&mut self, request: &SimRequest) -> Result<Option<Routed>>;
    /// A routed request finished in its pool: it leaves the pool's count,
    /// and the router learns from its usage.
    fn complete(&mut self, request: &SimRequest, routed: Routed) -> Result<()>;
    /// A routed request a later step refused (admission: too long for the
    /// pool's context) leaves the pool's count; it ran nowhere, so nothing
    /// is learned from it (the data plane's refusals have no usage either).
    fn unroute(&mut self, routed: Routed) -> Result<()>;
}

/// Everything to pool 0.
#[derive(Debug, Clone, Copy, Default)]
pub struct Homogeneous;

impl FleetRouter for Homogeneous {
    fn route(&mut self, request: &SimRequest) -> Result<Option<Routed>> {
        Ok(Some(Routed {
            pool: 0,
            input_tokens: request.input_tokens,
            compressed: false,
        }))
    }
    fn complete(&mut self, _: &SimRequest, _: Routed) -> Result<()> {
        Ok(())
    }
    fn unroute(&mut self, _: Routed) -> Result<()> {
        Ok(())
    }
}

/// Compress-and-route's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compress {
    /// The band's width: borderline is `(B, gamma * B]`; gamma >= 1.
    pub gamma: f64,
}

pub struct TokenBudgetRouting {
    router: TokenBudgetRouter,
    categories: Vec<Category>,
    /// Calibrator id of each category.
    ids: Vec<usize>,
}

impl TokenBudgetRouting {
    /// `pools` in the fleet's order (name, max_context, budget); the
    /// calibrator starts cold with the defaults (`Calibrator::with_defaults`).
    pub fn new(
        pools: Vec<Pool>,
        categories: &[Category],
        compress: Option<Compress>,
    ) -> Result<Self> {
        let mut cal = Calibrator::with_defaults();
        let ids = categories
            .iter()
            .map(|c| cal.intern(&c.name))
            .collect::<Result<Vec<_>>>()?;
        let router = TokenBudgetRouter::new(pools, Arc::new(RwLock::new(cal)))?;
        // Compress-and-route is the router's own band rule (crate::budget):
        // (B, gamma * B] of the largest budget below L_total, target B - L_out.
        let router = match compress {
            // The simulator's parameter is `gamma`: name it in the error.
            Some(Compress { gamma }) => router
                .with_compress_band(gamma)
                .map_err(|_| invalid(format!("gamma must be a finite number >= 1, got {gamma}")))?,
            None => router,
        };
        Ok(Self {
            router,
            categories: categories.to_vec(),
            ids,
        })
    }

    fn prompt_bytes(&self, request: &SimRequest, tokens: u64) -> u64 {
        let ratio = self.categories[request.category].bytes_per_token;
        (tokens as f64 * ratio).round().max(1.0) as u64
    }
}

impl FleetRouter for TokenBudgetRouting {
    fn route(&mut self, request: &SimRequest) -> Result<Option<Routed>> {
        let bytes = self.prompt_bytes(request, request.input_tokens);
        let id = self.ids[request.category];
        let req = Request::new(
            i64::try_from(bytes).map_err(|_| invalid("prompt too large"))?,
            Some(id),
            i64::try_from(request.output_tokens).map_err(|_| invalid("output too large"))?,
        )?;
        let est = self
            .router
            .read_calibrator()
            .estimate_tokens_id(req.prompt_bytes, req.category);
        let compressible = self.categories[request.category].compressible;
        let decision = self
            .router
            .route_with(est, request.output_tokens, compressible);
        let compressed = decision.compress_target_tokens.is_some();
        let input_tokens = decision
            .compress_target_tokens
            .map_or(request.input_tokens, |t_c| request.input_tokens.min(t_c));
        Ok(decision.pool.map(|pool| Routed {
            pool,
            input_tokens,
            compressed,
        }))
    }

    fn unroute(&mut self, routed: Routed) -> Result<()> {
        self.router.complete(routed.pool)
    }
    fn complete(&mut self, request: &SimRequest, routed: Routed) -> Result<()> {
        self.router.complete(routed.pool)?;
        let bytes = self.prompt_bytes(request, routed.input_tokens);
        let c_obs = Calibrator::check_observation(
            i64::try_from(bytes).map_err(|_| invalid("prompt too large"))?,
            i64::try_from(routed.input_tokens).map_err(|_| invalid("input too large"))?,
        )?;
        self.router
            .write_calibrator()
            .observe_ratio_id(self.ids[request.category], c_obs)
    }
}
