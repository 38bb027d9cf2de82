//! The one failure mode of the data plane, read by the front door
//! (`server.failure_mode`) and by admission (`admission.redis.failure_mode`);
//! a leaf both import.

use serde::Deserialize;

/// What a failure does to a request, the one enum of `server.failure_mode`
/// (routing failed) and `admission.redis.failure_mode` (the backend
/// failed): `Open` lets it through unaccounted (the default pool without
/// admission; admitted without a ticket), `Closed` refuses it with 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    Open,
    #[default]
    Closed,
}

impl FailureMode {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureMode::Open => "open",
            FailureMode::Closed => "closed",
        }
    }
}
