//! The disaggregation metrics (`crate::pd`): the fallbacks of routecore's
//! prefill sender (`serve::pd_send`, which counts them through
//! `serve::handoff`) and each endpoint's prefill/decode role.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::{FCounter, FGauge};
use crate::pd::Role;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    pub pool: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabels {
    pub pool: String,
    pub endpoint: String,
    pub role: String,
}

/// The disaggregation metrics of the data plane.
#[derive(Debug, Default)]
pub struct PdMetrics {
    pub fallbacks: Family<FallbackLabels, FCounter>,
    pub roles: Family<RoleLabels, FGauge>,
}

impl PdMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "routecore_pd_fallbacks",
            "Split requests served aggregated on their decode endpoint because \
             routecore could not hand them off, per pool and reason",
            m.fallbacks.clone(),
        );
        registry.register(
            "routecore_endpoint_role",
            "1 for each endpoint's prefill/decode role (prefill, decode or both), per pool",
            m.roles.clone(),
        );
        m
    }

    /// The role gauges of the running configuration's endpoints, as
    /// (pool, endpoint, role); those of a previous one are dropped.
    pub fn set_roles<'a>(&self, roles: impl IntoIterator<Item = (&'a str, &'a str, Role)>) {
        self.roles.clear();
        for (pool, endpoint, role) in roles {
            self.roles
                .get_or_create(&RoleLabels {
                    pool: pool.into(),
                    endpoint: endpoint.into(),
                    role: role.as_str().into(),
                })
                .set(1.0);
        }
    }
}
