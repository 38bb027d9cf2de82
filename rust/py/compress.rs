use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use pyo3::PyClassInitializer;

use super::{int_arg, text_bytes};
use crate::compress::{Compression, Compressor, RequestCompression, Summary, Weights};

/// Extractive prompt compression (FleetOpt section 5.2).
///
/// Splits a prompt into sentences (Latin and CJK punctuation, abbreviations,
/// list items, blank lines; a fenced code block is one unit, always kept),
/// scores them by ``textrank * TextRank + position * Position + tfidf * TF-IDF
/// + novelty * Novelty``, always keeps the first ``keep_first`` and last
/// ``keep_last`` sentences, then keeps the others greedily by score while the
/// output still fits, and returns them in their original order. The budget is
/// checked with the conservative estimate ``ceil(bytes / bytes_per_token)``, so
/// a successful result never exceeds it. Code is never compressed.
///
/// >>> c = Compressor()
/// >>> r = c.compress("First. Second. Third. Fourth. Fifth. Sixth.", 9, bytes_per_token=4.0)
/// >>> r.status, r.kept_sentence_indices
/// ('compressed', [0, 1, 2, 4, 5])
#[pyclass(frozen, name = "Compressor", module = "routecore")]
pub struct PyCompressor {
    pub inner: Compressor,
}

fn count(what: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{what} must be >= 0, got {v}")))
}

#[pymethods]
impl PyCompressor {
    #[new]
    #[pyo3(signature = (textrank=0.20, position=0.40, tfidf=0.35, novelty=0.05, keep_first=3, keep_last=2))]
    fn new(
        textrank: f64,
        position: f64,
        tfidf: f64,
        novelty: f64,
        #[pyo3(from_py_with = int_arg)] keep_first: i64,
        #[pyo3(from_py_with = int_arg)] keep_last: i64,
    ) -> PyResult<Self> {
        let weights = Weights {
            textrank,
            position,
            tfidf,
            novelty,
        };
        Ok(Self {
            inner: Compressor::new(
                weights,
                count("keep_first", keep_first)?,
                count("keep_last", keep_last)?,
            )?,
        })
    }

    /// Compresses ``text`` to at most ``token_budget`` tokens (estimated as
    /// ``ceil(bytes / bytes_per_token)``). ``category`` defaults to
    /// ``classify(text)``: "code" is returned unchanged. ``bytes_per_token``
    /// defaults to a conservative ratio for the category (prose 4.0, mixed and
    /// code 3.0, cjk 1.5); pass the calibrator's ``conservative_ratio`` to count
    /// as the router does.
    #[pyo3(signature = (text, token_budget, category=None, bytes_per_token=None))]
    fn compress(
        &self,
        py: Python<'_>,
        text: &str,
        #[pyo3(from_py_with = int_arg)] token_budget: i64,
        category: Option<&str>,
        bytes_per_token: Option<f64>,
    ) -> PyResult<Py<PyCompressionResult>> {
        let c = py.detach(|| {
            self.inner
                .compress(text, token_budget, category, bytes_per_token)
        })?;
        PyCompressionResult::new(py, c)
    }

    /// Compresses an OpenAI chat or completion body (str or bytes) so its
    /// prompt estimates within ``token_budget`` tokens, and returns the new
    /// body. Only long content (documents, RAG context: earlier turns,
    /// assistant and tool messages, text parts, a completion prompt; at least
    /// 1 KiB and not code) is compressed; system and developer messages and
    /// the last user message stay intact. Sizes count every text
    /// ``parse_openai_request`` counts (tool schemas and calls included, never
    /// rewritten); image and audio parts are not counted here
    /// (``route_request`` subtracts their tokens from the target).
    #[pyo3(signature = (body, token_budget, category=None, bytes_per_token=None))]
    fn compress_request(
        &self,
        py: Python<'_>,
        body: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = int_arg)] token_budget: i64,
        category: Option<&str>,
        bytes_per_token: Option<f64>,
    ) -> PyResult<Py<PyRequestCompression>> {
        let bytes = text_bytes(body, "body")?;
        let c = py.detach(|| {
            self.inner
                .compress_request(bytes, token_budget, category, bytes_per_token)
        })?;
        PyRequestCompression::new(py, c)
    }

    #[getter]
    fn textrank(&self) -> f64 {
        self.inner.weights().textrank
    }
    #[getter]
    fn position(&self) -> f64 {
        self.inner.weights().position
    }
    #[getter]
    fn tfidf(&self) -> f64 {
        self.inner.weights().tfidf
    }
    #[getter]
    fn novelty(&self) -> f64 {
        self.inner.weights().novelty
    }
    #[getter]
    fn keep_first(&self) -> usize {
        self.inner.keep_first()
    }
    #[getter]
    fn keep_last(&self) -> usize {
        self.inner.keep_last()
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let c = &slf.get().inner;
        let w = c.weights();
        let args = (
            w.textrank,
            w.position,
            w.tfidf,
            w.novelty,
            c.keep_first(),
            c.keep_last(),
        )
            .into_pyobject(py)?;
        PyTuple::new(py, [slf.get_type().into_any(), args.into_any()])
    }

    fn __repr__(&self) -> String {
        let w = self.inner.weights();
        format!(
            "Compressor(textrank={}, position={}, tfidf={}, novelty={}, keep_first={}, keep_last={})",
            w.textrank,
            w.position,
            w.tfidf,
            w.novelty,
            self.inner.keep_first(),
            self.inner.keep_last()
        )
    }
}

/// Sizes and outcome shared by ``CompressionResult`` and
/// ``RequestCompression``: prompt ``tokens_before`` and ``tokens_after`` by
/// the estimate ``ceil(bytes / bytes_per_token)``; ``status``: "fits" (already
/// within the budget), "compressed", "code" (never compressed) or
/// "impossible" (what must stay exceeds the budget); ``succeeded``: the output
/// is within the budget.
#[pyclass(frozen, subclass, name = "CompressionSummary", module = "routecore")]
pub struct PyCompressionSummary {
    inner: Summary,
}

#[pymethods]
impl PyCompressionSummary {
    #[getter]
    fn tokens_before(&self) -> u64 {
        self.inner.tokens_before
    }
    #[getter]
    fn tokens_after(&self) -> u64 {
        self.inner.tokens_after
    }
    #[getter]
    fn bytes_per_token(&self) -> f64 {
        self.inner.bytes_per_token
    }
    #[getter]
    fn status(&self) -> &'static str {
        self.inner.status.as_str()
    }
    #[getter]
    fn succeeded(&self) -> bool {
        self.inner.status.succeeded()
    }
}

impl PyCompressionSummary {
    fn repr(&self, name: &str, extra: String) -> String {
        let r = &self.inner;
        format!(
            "{name}(status={:?}, tokens_before={}, tokens_after={}, {extra})",
            r.status.as_str(),
            r.tokens_before,
            r.tokens_after,
        )
    }
}

/// The outcome of ``Compressor.compress`` (see ``CompressionSummary``):
/// ``text`` (the input itself unless ``status`` is "compressed") and
/// ``kept_sentence_indices`` (0-based, ascending) of its ``sentences``.
#[pyclass(frozen, extends = PyCompressionSummary, name = "CompressionResult", module = "routecore")]
pub struct PyCompressionResult {
    text: String,
    kept: Vec<usize>,
    sentences: usize,
}

impl PyCompressionResult {
    fn new(py: Python<'_>, c: Compression) -> PyResult<Py<Self>> {
        let base = PyCompressionSummary { inner: c.summary };
        let this = Self {
            text: c.text,
            kept: c.kept,
            sentences: c.sentences,
        };
        Py::new(py, PyClassInitializer::from(base).add_subclass(this))
    }
}

#[pymethods]
impl PyCompressionResult {
    #[getter]
    fn text(&self) -> &str {
        &self.text
    }
    #[getter]
    fn kept_sentence_indices(&self) -> Vec<usize> {
        self.kept.clone()
    }
    #[getter]
    fn sentences(&self) -> usize {
        self.sentences
    }
    fn __repr__(slf: &Bound<'_, Self>) -> String {
        let this = slf.get();
        let extra = format!("kept={}/{}", this.kept.len(), this.sentences);
        slf.as_super().get().repr("CompressionResult", extra)
    }
}

/// The outcome of ``Compressor.compress_request`` (see
/// ``CompressionSummary``): ``body`` (bytes, the original unless ``status`` is
/// "compressed") and ``compressed_messages`` (indices of the messages, or
/// prompt items, whose text changed).
#[pyclass(frozen, extends = PyCompressionSummary, name = "RequestCompression", module = "routecore")]
pub struct PyRequestCompression {
    body: Vec<u8>,
    compressed: Vec<usize>,
}

impl PyRequestCompression {
    pub fn new(py: Python<'_>, c: RequestCompression) -> PyResult<Py<Self>> {
        let base = PyCompressionSummary { inner: c.summary };
        let this = Self {
            body: c.body,
            compressed: c.compressed,
        };
        Py::new(py, PyClassInitializer::from(base).add_subclass(this))
    }
}

#[pymethods]
impl PyRequestCompression {
    #[getter]
    fn body<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.body)
    }
    #[getter]
    fn compressed_messages(&self) -> Vec<usize> {
        self.compressed.clone()
    }
    fn __repr__(slf: &Bound<'_, Self>) -> String {
        let extra = format!("compressed_messages={:?}", slf.get().compressed);
        slf.as_super().get().repr("RequestCompression", extra)
    }
}
