//! Exact prompt token counts: a model's Hugging Face `tokenizer.json` (the
//! `tokenizers` crate, with its pure-Rust regex engine) and an optional chat
//! template (Jinja, rendered with minijinja the way Hugging Face's
//! `apply_chat_template` renders it).
//!
//! - [`Tokenizer::encode`]: a text's token ids; with `add_special_tokens`
//!   the tokenizer's post-processor adds its special tokens (BOS), as an
//!   engine does for a completion prompt. Truncation and padding configured
//!   in the file are turned off: a count is never cut.
//! - [`Tokenizer::render_chat`]: the chat template over `messages` (and
//!   `tools` when given), with `add_generation_prompt` true, Jinja's
//!   `trim_blocks` and `lstrip_blocks` on, `raise_exception(msg)` and
//!   Python's string and dict methods (`.strip()`, `.items()`, ...), and
//!   `bos_token` / `eos_token` when given ([`SpecialTokens`]; a template that
//!   writes one not given renders nothing there).
//! - [`Tokenizer::encode_request`]: the prompt ids of an OpenAI body: a chat
//!   body rendered through the template and encoded without special tokens
//!   (the template writes them), as vLLM does; without a template, the texts
//!   `parse_openai_request` counts, in order (no template overhead); a
//!   completion prompt encoded with special tokens (each string of a list,
//!   concatenated); a prompt of token ids as it is.
//! - [`route_tokenized`]: token-budget routing on the exact count (plus the
//!   fixed cost of image and audio parts) instead of the bytes-per-token
//!   estimate; in two steps, [`Encoded::new`] (parse and tokenize: slow,
//!   no shared state) and [`Encoded::route`], for a caller that tokenizes
//!   on another thread.
//!
//! A file that cannot be read or is not a tokenizer, and a template that does
//! not compile or cannot render a one-message conversation, are refused at
//! load. A template that fails on a given conversation is an error of that
//! call (the data plane then routes on the estimate).

use std::path::Path;

use serde_json::{json, Value};

use crate::budget::{Decision, TokenBudgetRouter};
use crate::error::{invalid, Result};
use crate::openai::{parse_request, prompt_texts, MediaTokens, ParsedRequest};

/// The template's name inside its minijinja environment.
const TEMPLATE: &str = "chat_template";

/// The special tokens a chat template may write (`{{ bos_token }}`), named
/// as in Hugging Face's `tokenizer_config.json`; one not given renders as
/// nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// A chat template, compiled.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    special: SpecialTokens,
    /// `special`, as template variables (only those given).
    variables: minijinja::Value,
}

fn raise_exception(message: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        message,
    ))
}

/// A minijinja error with its cause chain (where the template failed).
fn template_error(e: &minijinja::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

impl ChatTemplate {
    /// Compiles `source` and renders a one-message conversation with it.
    pub fn new(source: &str, special: SpecialTokens) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(
            syntax
                .build()
                .map_err(|e| invalid(format!("chat_template: {}", template_error(&e))))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE, source.to_owned())
            .map_err(|e| invalid(format!("chat_template: {}", template_error(&e))))?;
        let given = [
            ("bos_token", &special.bos_token),
            ("eos_token", &special.eos_token),
        ];
        let variables = given
            .into_iter()
            .filter_map(|(name, token)| Some((name, minijinja::Value::from(token.as_deref()?))))
            .collect::<std::collections::BTreeMap<_, _>>();
        let template = Self {
            env,
            source: source.to_owned(),
            special,
            variables: minijinja::Value::from(variables),
        };
        template
            .render(&json!([{"role": "user", "content": "Hello"}]), None)
            .map_err(|e| invalid(format!("{e} (a one-message conversation)")))?;
        Ok(template)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The prompt text of `messages` (and `tools`), ready for the model's reply.
    pub fn render(&self, messages: &Value, tools: Option<&Value>) -> Result<String> {
        let fail = |e: minijinja::Error| invalid(format!("chat_template: {}", template_error(&e)));
        let template = self.env.get_template(TEMPLATE).map_err(fail)?;
        template
            .render(minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                tools => tools.map(|t| minijinja::Value::from(minijinja::value::Serde(t))),
                add_generation_prompt => true,
                ..self.variables.clone()
            })
            .map_err(fail)
    }
}

/// A `tokenizer.json` read from `source` (a path, for the error message).
fn parse(json: &str, source: &str) -> Result<tokenizers::Tokenizer> {
    json.parse().map_err(|e| {
        invalid(format!(
            "tokenizer: {source} is not a Hugging Face tokenizer.json: {e}"
        ))
    })
}

/// A model's tokenizer and, optionally, its chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field(
                "chat_template",
                &self.chat.as_ref().map(ChatTemplate::source),
            )
            .finish()
    }
}

impl Tokenizer {
    /// Reads a `tokenizer.json` and compiles its chat template (Jinja
    /// source) with the special tokens it writes, which need a template.
    pub fn load(path: &Path, chat_template: Option<&str>, special: SpecialTokens) -> Result<Self> {
        let chat = match chat_template {
            Some(source) => Some(ChatTemplate::new(source, special)?),
            None if special.bos_token.is_some() => {
                return Err(invalid("bos_token: only with a chat_template"))
            }
            None if special.eos_token.is_some() => {
                return Err(invalid("eos_token: only with a chat_template"))
            }
            None => None,
        };
        Self::from_file(path, chat)
    }

    /// Reads a `tokenizer.json`.
    pub fn from_file(path: &Path, chat_template: Option<ChatTemplate>) -> Result<Self> {
        let shown = path.display().to_string();
        let json = std::fs::read_to_string(path)
            .map_err(|e| invalid(format!("tokenizer: cannot read {shown}: {e}")))?;
        Self::new(parse(&json, &shown)?, chat_template)
    }

    /// A tokenizer from the text of a `tokenizer.json`.
    pub fn from_json(json: &str, chat_template: Option<ChatTemplate>) -> Result<Self> {
        Self::new(parse(json, "the text")?, chat_template)
    }

    fn new(mut inner: tokenizers::Tokenizer, chat: Option<ChatTemplate>) -> Result<Self> {
        inner
            .with_truncation(None)
            .map_err(|e| invalid(format!("tokenizer: cannot turn truncation off: {e}")))?;
        inner.with_padding(None);
        Ok(Self { inner, chat })
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// The vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The token ids of `text`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| invalid(format!("tokenizer: {e}")))
    }

    /// The chat template over `messages`; an error without a template.
    pub fn render_chat(&self, messages: &Value, tools: Option<&Value>) -> Result<String> {
        self.chat
            .as_ref()
            .ok_or_else(|| invalid("this tokenizer has no chat_template"))?
            .render(messages, tools)
    }

    /// The token ids of a rendered conversation (no special tokens added:
    /// the template writes them).
    pub fn encode_chat(&self, messages: &Value, tools: Option<&Value>) -> Result<Vec<u32>> {
        self.encode(&self.render_chat(messages, tools)?, false)
    }

    /// The prompt's token ids of an OpenAI chat or completion body (see the
    /// module docs).
    pub fn encode_request(&self, body: &Value) -> Result<Vec<u32>> {
        let texts = prompt_texts(body)?;
        if let Some(Value::Array(ids)) =
            body.get("prompt").filter(|_| texts.prompt_tokens.is_some())
        {
            return ids
                .iter()
                .map(|id| {
                    id.as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .ok_or_else(|| invalid(format!("token id {id} is out of range")))
                })
                .collect();
        }
        match (&self.chat, body.get("messages")) {
            (Some(chat), Some(messages)) => {
                let tools = body.get("tools").filter(|t| !t.is_null());
                self.encode(&chat.render(messages, tools)?, false)
            }
            (None, Some(_)) => {
                let text: String = texts.texts.iter().map(|t| t.text.as_ref()).collect();
                self.encode(&text, false)
            }
            (_, None) => {
                let mut ids = Vec::new();
                for t in &texts.texts {
                    ids.extend(self.encode(&t.text, true)?);
                }
                Ok(ids)
            }
        }
    }
}

/// A request and its prompt's token ids: the slow part of exact routing
/// (parse, render, encode), which touches no shared state, so it can run on
/// any thread.
#[derive(Debug, Clone)]
pub struct Encoded {
    pub request: ParsedRequest,
    /// The prompt's token ids (what prefix hashing reads).
    pub ids: Vec<u32>,
}

impl Encoded {
    /// Parses an OpenAI body and tokenizes its prompt.
    pub fn new(
        tokenizer: &Tokenizer,
        body: &[u8],
        default_max_tokens: u64,
        media: MediaTokens,
    ) -> Result<Self> {
        let request = parse_request(body, default_max_tokens, media)?;
        let v: Value =
            serde_json::from_slice(body).map_err(|e| invalid(format!("malformed JSON: {e}")))?;
        let ids = tokenizer.encode_request(&v)?;
        Ok(Self { request, ids })
    }

    /// Routes on the exact count (plus the request's media tokens; no
    /// bytes-per-token estimate, no compress-and-route); counted in flight.
    pub fn route(self, router: &TokenBudgetRouter) -> Tokenized {
        let input = (self.ids.len() as u64).saturating_add(self.request.media_tokens);
        let decision = router.route_estimated(input, self.request.max_output_tokens);
        Tokenized {
            request: self.request,
            ids: self.ids,
            decision,
        }
    }
}

/// A request routed on its exact prompt length.
#[derive(Debug, Clone)]
pub struct Tokenized {
    pub request: ParsedRequest,
    /// The prompt's token ids (what prefix hashing reads).
    pub ids: Vec<u32>,
    /// Routed on `ids.len()` plus the request's media tokens; counted in flight.
    pub decision: Decision,
}

/// Parses an OpenAI body, tokenizes its prompt and routes it on the exact
/// count ([`Encoded::new`] then [`Encoded::route`]). Nothing is counted when
/// parsing or tokenizing fails.
pub fn route_tokenized(
    router: &TokenBudgetRouter,
    tokenizer: &Tokenizer,
    body: &[u8],
    default_max_tokens: u64,
    media: MediaTokens,
) -> Result<Tokenized> {
    Ok(Encoded::new(tokenizer, body, default_max_tokens, media)?.route(router))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Arc, RwLock};
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;

    use crate::budget::Pool;
    use crate::calibrate::Calibrator;

    /// A word-level tokenizer over a few words, as `tokenizer.json` text.
    fn vocab_json() -> String {
        let words = ["[UNK]", "hello", "world", "<s>", "user", ":", "assistant"];
        let vocab: HashMap<String, u32> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), i as u32))
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("[UNK]".into())
            .build()
            .expect("word-level model");
        let mut t = tokenizers::Tokenizer::new(model);
        t.with_pre_tokenizer(Some(WhitespaceSplit));
        serde_json::to_string(&t).expect("serializes")
    }

    const CHAT: &str = "<s> {% for m in messages %}{{ m['role'] }} : {{ m['content'].strip() }}\n{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}";

    fn chat(source: &str) -> ChatTemplate {
        ChatTemplate::new(source, SpecialTokens::default()).expect("compiles")
    }

    #[test]
    fn special_tokens_render_when_given() {
        let source = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}";
        let messages = json!([{"role": "user", "content": "hello"}]);
        assert_eq!(chat(source).render(&messages, None).expect("ok"), "hello");
        let special = SpecialTokens {
            bos_token: Some("<s>".into()),
            eos_token: None,
        };
        let t = ChatTemplate::new(source, special.clone()).expect("compiles");
        assert_eq!(t.render(&messages, None).expect("ok"), "<s>hello");
        assert_eq!(t.special_tokens(), &special);
    }

    #[test]
    fn encode_counts_words() {
        let t = Tokenizer::from_json(&vocab_json(), None).expect("loads");
        assert_eq!(t.encode("hello world hello", false).expect("ok"), [1, 2, 1]);
        assert_eq!(t.encode("hello nope", false).expect("ok"), [1, 0]);
        assert_eq!(t.vocab_size(), 7);
    }

    #[test]
    fn chat_template_renders_and_encodes() {
        let t = Tokenizer::from_json(&vocab_json(), Some(chat(CHAT))).expect("loads");
        let messages = json!([{"role": "user", "content": " hello world "}]);
        let text = t.render_chat(&messages, None).expect("renders");
        assert_eq!(text, "<s> user : hello world\nassistant :");
        // <s> user : hello world assistant :
        assert_eq!(
            t.encode_chat(&messages, None).expect("ok"),
            [3, 4, 5, 1, 2, 6, 5]
        );
        let body = json!({"model": "m", "messages": messages});
        assert_eq!(t.encode_request(&body).expect("ok").len(), 7);
    }

    #[test]
    fn requests_without_template_count_their_texts() {
        let t = Tokenizer::from_json(&vocab_json(), None).expect("loads");
        let chat = json!({"messages": [{"role": "user", "content": "hello world"}]});
        assert_eq!(t.encode_request(&chat).expect("ok"), [1, 2]);
        let prompt = json!({"prompt": ["hello", "world world"]});
        assert_eq!(t.encode_request(&prompt).expect("ok"), [1, 2, 2]);
        let ids = json!({"prompt": [5, 6, 7]});
        assert_eq!(t.encode_request(&ids).expect("ok"), [5, 6, 7]);
        let too_big = json!({"prompt": [1u64 << 40]});
        assert!(t.encode_request(&too_big).is_err());
    }

    #[test]
    fn special_tokens_need_a_template() {
        let special = SpecialTokens {
            bos_token: None,
            eos_token: Some("</s>".into()),
        };
        let e = Tokenizer::load(Path::new("/nonexistent"), None, special).err();
        assert!(e.is_some_and(|e| e.to_string() == "eos_token: only with a chat_template"));
    }

    #[test]
    fn bad_files_and_templates_are_refused_at_load() {
        let missing = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json"), None);
        assert!(missing
            .err()
            .is_some_and(|e| e.to_string().contains("cannot read")));
        let not_one = Tokenizer::from_json("{\"hello\": 1}", None);
        assert!(not_one
            .err()
            .is_some_and(|e| e.to_string().contains("not a Hugging Face tokenizer.json")));
        for bad in ["{% for m in messages %}", "{{ raise_exception('no') }}"] {
            let e = ChatTemplate::new(bad, SpecialTokens::default()).err();
            assert!(
                e.is_some_and(|e| e.to_string().starts_with("chat_template:")),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_template_failing_on_one_conversation_is_an_error_of_that_call() {
        let strict = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}{{ messages[0]['content'] }}";
        let t = Tokenizer::from_json(&vocab_json(), Some(chat(strict))).expect("loads");
        let two = json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]);
        let e = t.encode_chat(&two, None).expect_err("fails");
        assert!(e.to_string().contains("one message only"), "{e}");
        assert_eq!(
            t.encode_chat(&json!([two[0].clone()]), None).expect("ok"),
            [0]
        );
    }

    #[test]
    fn route_tokenized_uses_the_exact_count() {
        let t = Tokenizer::from_json(&vocab_json(), Some(chat(CHAT))).expect("loads");
        let cal = Calibrator::new(0.95, 1.0, 4.0, 16).expect("calibrator");
        let pools = vec![
            Pool::new("short", 16, None, None).expect("pool"),
            Pool::new("long", 1024, None, None).expect("pool"),
        ];
        let router = TokenBudgetRouter::new(pools, Arc::new(RwLock::new(cal))).expect("router");
        let body =
            br#"{"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 9}"#;
        let r = route_tokenized(&router, &t, body, 4096, MediaTokens::default()).expect("ok");
        assert_eq!(r.ids.len(), 7);
        assert_eq!(r.decision.est_input_tokens, 7);
        assert_eq!(r.decision.pool, Some(0)); // 7 + 9 = 16 fits the short pool
        assert_eq!(router.in_flight(0).expect("pool"), 1);
        let bad = route_tokenized(&router, &t, b"{", 4096, MediaTokens::default());
        assert!(bad.is_err());
        assert_eq!(router.in_flight(0).expect("pool"), 1);
    }
}
