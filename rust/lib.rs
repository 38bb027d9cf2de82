//! routecore: the hot path of LLM request routing.
//!
//! Pure-Rust modules hold the algorithms and know nothing of Python; the
//! `python` feature adds the pyo3 bindings in `py/` and the `_core` module
//! below, which only registers what `py/` defines.

pub mod admission;
pub mod assign;
pub mod autoscale;
pub mod budget;
pub mod calibrate;
pub mod classify;
pub mod clock;
pub mod compress;
pub mod dispatch;
pub mod endpoint;
pub mod error;
pub mod flow;
pub mod kv;
#[cfg(test)]
mod layout;
pub mod openai;
pub mod pd;
pub mod pick;
pub mod pipeline;
pub mod planner;
pub mod prefix;
pub mod profile;
pub mod queueing;
pub mod rng;
#[cfg(feature = "server")]
pub mod serve;
pub mod sim;
pub mod snapshot;
#[cfg(feature = "tokenizer")]
pub mod tokenize;
pub mod vtc;
pub mod workload;

#[cfg(feature = "python")]
mod py;

#[cfg(feature = "python")]
#[pyo3::pymodule(gil_used = false)]
mod _core {
    #[pymodule_export]
    use crate::py::admission::{
        priority_weight, PyAdmission, PyAdmissionController, PyEntitlement, PyQuota,
    };
    #[cfg(feature = "server")]
    #[pymodule_export]
    use crate::py::admission_lua::{admission_lua, admission_redis_config};
    #[pymodule_export]
    use crate::py::assign::{assign_eval, PyBatchScheduler, PyEndpoint, PyKnnEstimator};
    #[pymodule_export]
    use crate::py::autoscale::PyAutoscaler;
    #[pymodule_export]
    use crate::py::autoscale_sim::{autoscale_simulate, PyRateProfile};
    #[pymodule_export]
    use crate::py::budget::{PyPool, PyRouteDecision, PyTokenBudgetRouter};
    #[pymodule_export]
    use crate::py::calibrate::PyCalibrator;
    #[pymodule_export]
    use crate::py::classify::classify;
    #[pymodule_export]
    use crate::py::compress::{
        PyCompressionResult, PyCompressionSummary, PyCompressor, PyRequestCompression,
    };
    #[pymodule_export]
    use crate::py::disagg::{
        plan_disaggregated, simulate_disaggregated, PyDisaggPlan, PyDisaggReport,
    };
    #[pymodule_export]
    use crate::py::dispatch::PyDispatchSteps;
    #[pymodule_export]
    use crate::py::flow::PyFlowQueue;
    #[pymodule_export]
    use crate::py::flow_sim::flow_eval;
    #[cfg(feature = "kv-events")]
    #[pymodule_export]
    use crate::py::kv::PyKvEventIndex;
    #[cfg(feature = "server")]
    #[pymodule_export]
    use crate::py::loadgen::load;
    #[pymodule_export]
    use crate::py::monotonic;
    #[pymodule_export]
    use crate::py::openai::parse_openai_request;
    #[pymodule_export]
    use crate::py::pick::PyEndpointPicker;
    #[pymodule_export]
    use crate::py::pipeline::PyRoutedRequest;
    #[pymodule_export]
    use crate::py::planner::{
        annual_cost_usd, g_dual, plan, pool_routing_savings, PyCandidate, PyPlan,
    };
    #[pymodule_export]
    use crate::py::prefix::{block_hashes, block_hashes_many, PyPrefixCacheRouter, PyPrefixIndex};
    #[pymodule_export]
    use crate::py::profile::{PyProfile, PyService};
    #[pymodule_export]
    use crate::py::queueing::{erlang_b, erlang_c, erlang_c_many, p99_wait, PyErlangScan};
    #[cfg(feature = "server")]
    #[pymodule_export]
    use crate::py::serve::PyDataPlane;
    #[pymodule_export]
    use crate::py::sim::{simulate, PyPrefixWorkload, PySimPool, PySimReport};
    #[pymodule_export]
    use crate::py::tokenize::PyTokenizer;
    #[pymodule_export]
    use crate::py::vtc::PyVtcRouter;
    #[pymodule_export]
    use crate::py::workload::PyWorkload;
    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add(
            "NotInFlightError",
            m.py().get_type::<crate::py::NotInFlightError>(),
        )?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        // The core's constants, so that Python never re-types them.
        m.add(
            "CATEGORIES",
            pyo3::types::PyTuple::new(m.py(), crate::classify::CATEGORIES)?,
        )?;
        m.add(
            "INCOMPRESSIBLE_CATEGORIES",
            pyo3::types::PyTuple::new(m.py(), crate::budget::INCOMPRESSIBLE_CATEGORIES)?,
        )?;
        m.add(
            "AUTOSCALE_POLICIES",
            pyo3::types::PyTuple::new(m.py(), crate::py::autoscale_sim::POLICIES)?,
        )?;
        m.add("MAX_TOKENS", crate::budget::MAX_TOKENS)
    }
}
