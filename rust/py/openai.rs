use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{int_arg, text_bytes};
use crate::openai::{parse_request, MediaTokens};

/// Reads the fields routing needs from an OpenAI request body (chat or
/// completion), in Rust.
///
/// Returns a dict with ``kind`` ("chat" or "completion"), ``prompt_bytes``
/// (UTF-8 bytes of every text the engine tokenizes: message contents and
/// text parts, other parts' strings, tool calls, and the JSON of ``tools``,
/// ``functions`` and ``response_format``; or the completion prompt),
/// ``prompt_tokens`` (the exact count when the prompt is token ids, else
/// None), ``media_tokens`` (``image_tokens`` per image part plus
/// ``audio_tokens`` per audio part; defaults 765, OpenAI's cost of a
/// 1024x1024 high-detail image, and 750, a 30 s clip at Qwen2-Audio's 40 ms
/// per token), ``category`` (``classify`` of the prompt text), ``n`` (the
/// larger of ``n`` and ``best_of``, default 1), ``max_output_tokens``
/// (``max_completion_tokens``, else ``max_tokens``, else
/// ``default_max_tokens``; times ``n``), ``max_tokens_given``, ``model``,
/// ``stream``, ``user`` and ``messages`` (count). Malformed JSON, wrong
/// types, bodies over 64 MiB, ``n`` outside [1, 128] and token counts
/// outside their range ([1, 2^30]; [0, 2^30] for the media costs) raise
/// ValueError.
///
/// >>> parse_openai_request(b'{"messages": [{"role": "user", "content": "hi"}]}')["prompt_bytes"]
/// 2
#[pyfunction]
#[pyo3(signature = (body, default_max_tokens=4096, *, image_tokens=765, audio_tokens=750))]
pub fn parse_openai_request<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = int_arg)] default_max_tokens: u64,
    #[pyo3(from_py_with = int_arg)] image_tokens: i64,
    #[pyo3(from_py_with = int_arg)] audio_tokens: i64,
) -> PyResult<Bound<'py, PyDict>> {
    let bytes = text_bytes(body, "body")?;
    let media = MediaTokens::new(image_tokens, audio_tokens)?;
    let p = py.detach(|| parse_request(bytes, default_max_tokens, media))?;
    let d = PyDict::new(py);
    d.set_item("kind", p.kind)?;
    d.set_item("prompt_bytes", p.prompt_bytes)?;
    d.set_item("prompt_tokens", p.prompt_tokens)?;
    d.set_item("media_tokens", p.media_tokens)?;
    d.set_item("category", p.category)?;
    d.set_item("max_output_tokens", p.max_output_tokens)?;
    d.set_item("max_tokens_given", p.max_tokens_given)?;
    d.set_item("n", p.n)?;
    d.set_item("model", p.model)?;
    d.set_item("stream", p.stream)?;
    d.set_item("user", p.user)?;
    d.set_item("messages", p.messages)?;
    Ok(d)
}
