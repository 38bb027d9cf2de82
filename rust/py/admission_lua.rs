//! The Redis admission scripts for the Python `RedisAdmission`: the same
//! text and constants as the data plane's Redis backend (rust/serve/admission/).

use std::collections::HashMap;

use pyo3::prelude::*;

use super::admission::{PyEntitlement, PyQuota};
use super::int_arg;
use crate::serve::admission::scripts;

/// The admission Lua scripts by name (``configure``, ``admit``,
/// ``complete``, ``void``, ``set_state``, ``sweep``); KEYS[1] is a quota's
/// key prefix.
#[pyfunction]
pub fn admission_lua() -> HashMap<&'static str, &'static str> {
    scripts::SCRIPTS.into_iter().collect()
}

/// The configure script's JSON argument for every quota, by quota name: the
/// quota's capacity, ``window_s`` and ``lease_s``, the bounds on what the
/// scripts keep (window entries per entitlement and per quota, void markers
/// per quota; each in [1, 2^24], else ``ValueError``), equation 1's constants
/// and each entitlement's class weight, burst right and baseline.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn admission_redis_config(
    quotas: Vec<PyRef<'_, PyQuota>>,
    entitlements: Vec<PyRef<'_, PyEntitlement>>,
    window_s: f64,
    lease_s: f64,
    #[pyo3(from_py_with = int_arg)] max_window_entries: u64,
    #[pyo3(from_py_with = int_arg)] max_window_entries_per_quota: u64,
    #[pyo3(from_py_with = int_arg)] max_void_markers: u64,
) -> PyResult<HashMap<String, String>> {
    let bounds = scripts::Bounds::new(
        max_window_entries,
        max_window_entries_per_quota,
        max_void_markers,
    )?;
    let ents: Vec<_> = entitlements.iter().map(|e| e.inner.clone()).collect();
    Ok(quotas
        .iter()
        .map(|p| {
            (
                p.inner.name.clone(),
                scripts::quota_config(&p.inner, &ents, window_s, lease_s, &bounds),
            )
        })
        .collect())
}
