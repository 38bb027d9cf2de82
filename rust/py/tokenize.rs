use std::path::PathBuf;
use std::sync::Arc;

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use serde_json::Value;

use super::{json_arg, text_bytes};
use crate::error::invalid;
use crate::tokenize::{SpecialTokens, Tokenizer};

fn optional_json(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<Value>> {
    obj.filter(|o| !o.is_none())
        .map(|o| json_arg(o, what))
        .transpose()
}

/// A model's tokenizer: a Hugging Face ``tokenizer.json`` (encoded in Rust
/// by the ``tokenizers`` crate) and, optionally, its chat template (Jinja
/// source, rendered as ``apply_chat_template`` renders it, with
/// ``add_generation_prompt`` true, and ``bos_token`` / ``eos_token`` as given:
/// the values of the model's ``tokenizer_config.json``; one not given renders
/// as nothing).
///
/// A file that cannot be read or is not a tokenizer, and a template that does
/// not compile or cannot render a one-message conversation, raise ValueError.
/// Truncation and padding set in the file are ignored: counts are never cut.
/// Every call releases the interpreter while it tokenizes. Token ids come back
/// as uint32 NumPy arrays (``block_hashes`` reads them in place).
///
/// Give it to ``TokenBudgetRouter.route_request(body, tokenizer=...)`` to
/// route on the exact prompt token count.
#[pyclass(frozen, name = "Tokenizer", module = "routecore")]
pub struct PyTokenizer {
    pub inner: Arc<Tokenizer>,
    path: PathBuf,
}

#[pymethods]
impl PyTokenizer {
    #[new]
    #[pyo3(signature = (path, chat_template=None, *, bos_token=None, eos_token=None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        chat_template: Option<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> PyResult<Self> {
        let special = SpecialTokens {
            bos_token,
            eos_token,
        };
        let inner = py.detach(|| Tokenizer::load(&path, chat_template.as_deref(), special))?;
        Ok(Self {
            inner: Arc::new(inner),
            path,
        })
    }

    /// The ``tokenizer.json`` it was read from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// The chat template's Jinja source, or None.
    #[getter]
    fn chat_template(&self) -> Option<&str> {
        self.inner.chat_template().map(|c| c.source())
    }

    /// The BOS token the chat template is given, or None.
    #[getter]
    fn bos_token(&self) -> Option<&str> {
        let chat = self.inner.chat_template()?;
        chat.special_tokens().bos_token.as_deref()
    }

    /// The EOS token the chat template is given, or None.
    #[getter]
    fn eos_token(&self) -> Option<&str> {
        let chat = self.inner.chat_template()?;
        chat.special_tokens().eos_token.as_deref()
    }

    /// The vocabulary size, added tokens included.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// The token ids of ``text`` (with the tokenizer's special tokens, such
    /// as BOS, when ``add_special_tokens``).
    #[pyo3(signature = (text, add_special_tokens=true))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        add_special_tokens: bool,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let ids = py.detach(|| self.inner.encode(text, add_special_tokens))?;
        Ok(ids.into_pyarray(py))
    }

    /// ``len(encode(text, add_special_tokens))``.
    #[pyo3(signature = (text, add_special_tokens=true))]
    fn count(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<usize> {
        Ok(py
            .detach(|| self.inner.encode(text, add_special_tokens))?
            .len())
    }

    /// The chat template over ``messages`` (a list of ``{"role", "content"}``
    /// dicts) and ``tools``: the prompt text the model reads.
    #[pyo3(signature = (messages, tools=None))]
    fn render_chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        let (messages, tools) = (
            json_arg(messages, "messages")?,
            optional_json(tools, "tools")?,
        );
        Ok(py.detach(|| self.inner.render_chat(&messages, tools.as_ref()))?)
    }

    /// The token ids of the rendered conversation (no special tokens added:
    /// the template writes them).
    #[pyo3(signature = (messages, tools=None))]
    fn encode_chat<'py>(
        &self,
        py: Python<'py>,
        messages: &Bound<'py, PyAny>,
        tools: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let (messages, tools) = (
            json_arg(messages, "messages")?,
            optional_json(tools, "tools")?,
        );
        let ids = py.detach(|| self.inner.encode_chat(&messages, tools.as_ref()))?;
        Ok(ids.into_pyarray(py))
    }

    /// ``len(encode_chat(messages, tools))``.
    #[pyo3(signature = (messages, tools=None))]
    fn count_chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (messages, tools) = (
            json_arg(messages, "messages")?,
            optional_json(tools, "tools")?,
        );
        Ok(py
            .detach(|| self.inner.encode_chat(&messages, tools.as_ref()))?
            .len())
    }

    /// The prompt's token ids of an OpenAI chat or completion body (str or
    /// bytes): a chat rendered through the template (without one, the texts
    /// ``parse_openai_request`` counts), a completion prompt encoded with
    /// special tokens, a prompt of token ids as it is.
    fn encode_request<'py>(
        &self,
        py: Python<'py>,
        body: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let bytes = text_bytes(body, "body")?;
        let ids = py.detach(|| {
            let v: Value = serde_json::from_slice(bytes)
                .map_err(|e| invalid(format!("malformed JSON: {e}")))?;
            self.inner.encode_request(&v)
        })?;
        Ok(ids.into_pyarray(py))
    }

    fn __repr__(&self) -> String {
        format!(
            "Tokenizer({:?}, vocab_size={}, chat_template={})",
            self.path.display().to_string(),
            self.inner.vocab_size(),
            if self.inner.chat_template().is_some() {
                "..."
            } else {
                "None"
            }
        )
    }
}
