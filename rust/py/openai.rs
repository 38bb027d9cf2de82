use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{int_arg, text_bytes};
use crate::openai::parse_request;

/// Reads the fields routing needs from an OpenAI request body (chat or
/// completion), in Rust.
///
/// Returns a dict with ``kind`` ("chat" or "completion"), ``prompt_bytes``
/// (UTF-8 bytes of every message content / text part, or of the prompt),
/// ``prompt_tokens`` (the exact count when the prompt is token ids, else
/// None), ``category`` (``classify`` of the prompt text),
/// ``max_output_tokens`` (``max_completion_tokens``, else ``max_tokens``, else
/// ``default_max_tokens``), ``max_tokens_given``, ``model``, ``stream``,
/// ``user`` and ``messages`` (count). Malformed JSON, wrong types, bodies over
/// 64 MiB and token counts outside [1, 2^30] raise ValueError.
///
/// >>> parse_openai_request(b'{"messages": [{"role": "user", "content": "hi"}]}')["prompt_bytes"]
/// 2
#[pyfunction]
#[pyo3(signature = (body, default_max_tokens=4096))]
pub fn parse_openai_request<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = int_arg)] default_max_tokens: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let bytes = text_bytes(body, "body")?;
    let p = py.detach(|| parse_request(bytes, default_max_tokens))?;
    let d = PyDict::new(py);
    d.set_item("kind", p.kind)?;
    d.set_item("prompt_bytes", p.prompt_bytes)?;
    d.set_item("prompt_tokens", p.prompt_tokens)?;
    d.set_item("category", p.category)?;
    d.set_item("max_output_tokens", p.max_output_tokens)?;
    d.set_item("max_tokens_given", p.max_tokens_given)?;
    d.set_item("model", p.model)?;
    d.set_item("stream", p.stream)?;
    d.set_item("user", p.user)?;
    d.set_item("messages", p.messages)?;
    Ok(d)
}
