use pyo3::prelude::*;

use super::text_bytes;

/// The traffic category of a prompt: ``"prose"``, ``"code"``, ``"cjk"`` or
/// ``"mixed"``, from byte-level statistics (script of the characters, code
/// punctuation, code-shaped and indented lines). Reads at most the first and
/// last 32 KiB of a longer prompt.
///
/// >>> classify("def f(x):\n    return x + 1\n")
/// 'code'
#[pyfunction]
pub fn classify(text: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    Ok(crate::classify::classify(text_bytes(text, "text")?))
}
