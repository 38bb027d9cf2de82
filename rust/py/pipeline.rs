//! The binding of the request pipeline (`crate::pipeline`):
//! `TokenBudgetRouter.route_request` and the `RoutedRequest` it returns. The
//! method is a second `#[pymethods]` block of the router (pyo3's
//! `multiple-pymethods`), so the router's and the compressor's bindings do not
//! import each other or this module.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::budget::{PyRouteDecision, PyTokenBudgetRouter};
use super::compress::{PyCompressor, PyRequestCompression};
use super::tokenize::PyTokenizer;
use super::{int_arg, text_bytes};
use crate::compress::Compressor;
use crate::openai::MediaTokens;
use crate::pipeline::{route_request, RoutedRequest};
use crate::tokenize::route_tokenized;

#[pymethods]
impl PyTokenBudgetRouter {
    /// Parses an OpenAI body (str or bytes), routes it and carries out
    /// compress-and-route: when the decision is "compress", the body is
    /// compressed with ``compressor`` (default ``Compressor()``) to the target,
    /// counting with the calibrator's conservative ratio for its category. If
    /// that fails the request is routed as it is (``action`` "route",
    /// ``compression.status`` says why). The estimate counts what
    /// ``parse_openai_request`` counts (message text, tool schemas and calls,
    /// ``response_format``, ``image_tokens`` / ``audio_tokens`` per media part)
    /// and the output bound is ``n`` times the per-choice bound; only message
    /// prose is ever compressed. Counts the request in flight.
    ///
    /// With a ``tokenizer`` (``routecore.Tokenizer``), the prompt is tokenized
    /// (``Tokenizer.encode_request``) and routed on its exact token count plus
    /// the media tokens: no estimate, no compression.
    #[pyo3(signature = (body, compressor=None, default_max_tokens=4096, *, image_tokens=765, audio_tokens=750, tokenizer=None))]
    #[allow(clippy::too_many_arguments)]
    fn route_request(
        &self,
        py: Python<'_>,
        body: &Bound<'_, PyAny>,
        compressor: Option<&Bound<'_, PyCompressor>>,
        #[pyo3(from_py_with = int_arg)] default_max_tokens: u64,
        #[pyo3(from_py_with = int_arg)] image_tokens: i64,
        #[pyo3(from_py_with = int_arg)] audio_tokens: i64,
        tokenizer: Option<&Bound<'_, PyTokenizer>>,
    ) -> PyResult<PyRoutedRequest> {
        let bytes = text_bytes(body, "body")?;
        let compressor = compressor.map_or_else(Compressor::default, |c| c.get().inner);
        let media = MediaTokens::new(image_tokens, audio_tokens)?;
        let r = match tokenizer {
            Some(t) => {
                let t = &t.get().inner;
                let r = py
                    .detach(|| route_tokenized(&self.inner, t, bytes, default_max_tokens, media))?;
                RoutedRequest {
                    request: r.request,
                    decision: r.decision,
                    body: bytes.to_vec(),
                    compression: None,
                }
            }
            None => py.detach(|| {
                route_request(&self.inner, &compressor, bytes, default_max_tokens, media)
            })?,
        };
        Ok(PyRoutedRequest {
            decision: Py::new(py, self.decision(py, r.decision))?,
            body: r.body,
            compression: r
                .compression
                .map(|c| PyRequestCompression::new(py, c))
                .transpose()?,
            category: r.request.category,
            prompt_bytes: r.request.prompt_bytes,
            media_tokens: r.request.media_tokens,
            max_output_tokens: r.request.max_output_tokens,
        })
    }
}

/// A request routed by ``TokenBudgetRouter.route_request``: ``decision``,
/// ``body`` (bytes to send to ``decision.pool``: compressed when
/// ``decision.action`` is "compress"), ``compression`` (the outcome when
/// compression was tried, else None), and what was read from the body:
/// ``category``, ``prompt_bytes`` (of the original body), ``media_tokens``
/// (charged for its image and audio parts), ``max_output_tokens`` (times
/// ``n``).
#[pyclass(frozen, name = "RoutedRequest", module = "routecore")]
pub struct PyRoutedRequest {
    #[pyo3(get)]
    pub decision: Py<PyRouteDecision>,
    pub body: Vec<u8>,
    #[pyo3(get)]
    pub compression: Option<Py<PyRequestCompression>>,
    #[pyo3(get)]
    pub category: &'static str,
    #[pyo3(get)]
    pub prompt_bytes: u64,
    #[pyo3(get)]
    pub media_tokens: u64,
    #[pyo3(get)]
    pub max_output_tokens: u64,
}

#[pymethods]
impl PyRoutedRequest {
    #[getter]
    fn body<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.body)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "RoutedRequest(decision={}, category={:?}, body_bytes={})",
            self.decision.bind(py).repr()?,
            self.category,
            self.body.len()
        ))
    }
}
