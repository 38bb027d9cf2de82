//! Reading the fields routing needs from an OpenAI-style request body
//! (`/v1/chat/completions` or `/v1/completions`), with serde_json.
//!
//! - Prompt bytes: the UTF-8 byte length of every text the engine will
//!   tokenize ([`prompt_texts`]):
//!   - each chat message's `content` when it is a string; in an array of
//!     parts, the `text` of each `{"type": "text"}` part and every string of
//!     any other part that is not an image or audio part (a part without a
//!     `type`, a `refusal`, a file);
//!   - every string of a message's other fields but `role`, `name` and
//!     `tool_call_id`: the assistant's `tool_calls` (names and arguments),
//!     `function_call`, reasoning text;
//!   - the compact JSON of the request's `tools`, `functions` and
//!     `response_format` (the schemas the chat template renders);
//!   - or the completion `prompt` (a string or an array of strings).
//!
//!   Roles, names and the chat template itself are not counted; the
//!   calibrator learns that overhead from `usage.prompt_tokens`.
//! - Image and audio parts (`image_url`, `image`, `input_image`; `input_audio`,
//!   `audio`) cost a fixed number of tokens each ([`MediaTokens`]), reported
//!   as `media_tokens` and added to the estimate as they are.
//! - A completion `prompt` given as token ids (an array of integers) has no
//!   bytes: its length is reported as `prompt_tokens`, known exactly.
//! - Output bound: `max_completion_tokens`, else `max_tokens`, else the
//!   caller's documented default, times the number of sequences generated
//!   (the larger of `n` and `best_of`, each in [1, [`MAX_CHOICES`]]): each
//!   choice may generate up to the bound.
//! - `model`, `stream` (default false) and `user` as given.
//!
//! Malformed JSON, wrong types, a body over [`MAX_BODY_BYTES`] and absurd token
//! counts are errors.

use std::borrow::Cow;

use serde_json::Value;

use crate::budget::MAX_TOKENS;
use crate::classify::classify;
use crate::error::{invalid, Result};

/// The largest body `parse_request` reads (64 MiB).
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// The output bound assumed when a request gives none (documented in the API).
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 4096;
/// The largest `n` / `best_of` (OpenAI's limit for `n`).
pub const MAX_CHOICES: u64 = 128;
/// Tokens charged per image part by default: OpenAI's documented cost of a
/// 1024x1024 high-detail image (85 base tokens + 170 per 512 px tile, four
/// tiles).
pub const DEFAULT_IMAGE_TOKENS: u64 = 765;
/// Tokens charged per audio part by default: a 30 s clip (the Whisper
/// encoder's window) at Qwen2-Audio's rate of one encoder frame per 40 ms
/// (Chu et al. 2024, "Qwen2-Audio Technical Report").
pub const DEFAULT_AUDIO_TOKENS: u64 = 750;

/// The fixed token cost of one image and of one audio part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaTokens {
    pub image: u64,
    pub audio: u64,
}

impl Default for MediaTokens {
    fn default() -> Self {
        Self {
            image: DEFAULT_IMAGE_TOKENS,
            audio: DEFAULT_AUDIO_TOKENS,
        }
    }
}

impl MediaTokens {
    /// Checks both costs are in [0, `MAX_TOKENS`].
    pub fn new(image: i64, audio: i64) -> Result<Self> {
        let check = |name: &str, n: i64| {
            u64::try_from(n)
                .ok()
                .filter(|&n| n <= MAX_TOKENS)
                .ok_or_else(|| invalid(format!("{name} must be in [0, {MAX_TOKENS}], got {n}")))
        };
        Ok(Self {
            image: check("image_tokens", image)?,
            audio: check("audio_tokens", audio)?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    /// "chat" (a `messages` body) or "completion" (a `prompt` body).
    pub kind: &'static str,
    pub prompt_bytes: u64,
    /// Exact prompt length when the prompt was given as token ids.
    pub prompt_tokens: Option<u64>,
    /// Tokens charged for image and audio parts.
    pub media_tokens: u64,
    /// `classify` over the prompt text.
    pub category: &'static str,
    /// The output bound of the whole request: per choice times `n`.
    pub max_output_tokens: u64,
    /// Whether the body set `max_tokens` / `max_completion_tokens`.
    pub max_tokens_given: bool,
    /// Sequences generated: the larger of `n` and `best_of` (default 1).
    pub n: u64,
    pub model: Option<String>,
    pub stream: bool,
    pub user: Option<String>,
    /// Number of chat messages (0 for a completion).
    pub messages: usize,
}

/// One step of a JSON path into a request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathStep {
    Key(&'static str),
    Index(usize),
}

/// One text of a request body that the engine tokenizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptText<'a> {
    pub text: Cow<'a, str>,
    /// The path of a message `content` string, a text part's `text` or a
    /// completion prompt string: prose a compressor may rewrite. None for
    /// everything else (tool schemas, tool calls, other parts), which is
    /// counted but never rewritten.
    pub path: Option<Vec<PathStep>>,
    /// The chat message (or completion prompt item) it belongs to; for
    /// request-level texts (tools, `response_format`), the message count.
    pub item: usize,
}

/// Everything of a request body the engine turns into prompt tokens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptTexts<'a> {
    pub texts: Vec<PromptText<'a>>,
    pub images: u64,
    pub audios: u64,
    /// Exact prompt length when the prompt was given as token ids.
    pub prompt_tokens: Option<u64>,
    /// Number of chat messages (0 for a completion).
    pub messages: usize,
}

/// Request-level fields whose JSON the chat template renders into the prompt.
const SCHEMA_FIELDS: [&str; 3] = ["tools", "functions", "response_format"];
/// Message fields that are not prompt text (or are counted as `content`).
const MESSAGE_METADATA: [&str; 4] = ["role", "name", "tool_call_id", "content"];

impl<'a> PromptTexts<'a> {
    fn push(&mut self, text: Cow<'a, str>, path: Option<Vec<PathStep>>, item: usize) {
        if !text.is_empty() {
            self.texts.push(PromptText { text, path, item });
        }
    }

    /// Every string inside `v` (not object keys, nor the `skip` key of the
    /// top object).
    fn push_strings(&mut self, v: &'a Value, skip: &str, item: usize) {
        match v {
            Value::String(s) => self.push(Cow::Borrowed(s), None, item),
            Value::Array(items) => {
                for x in items {
                    self.push_strings(x, "", item);
                }
            }
            Value::Object(map) => {
                for (_, x) in map.iter().filter(|(k, _)| k.as_str() != skip) {
                    self.push_strings(x, "", item);
                }
            }
            _ => {}
        }
    }

    /// One chat message's `content`.
    fn content(&mut self, content: &'a Value, i: usize) -> Result<()> {
        let base = |steps: &[PathStep]| {
            let mut p = vec![
                PathStep::Key("messages"),
                PathStep::Index(i),
                PathStep::Key("content"),
            ];
            p.extend_from_slice(steps);
            p
        };
        match content {
            Value::Null => {}
            Value::String(s) => self.push(Cow::Borrowed(s), Some(base(&[])), i),
            Value::Array(parts) => {
                for (j, part) in parts.iter().enumerate() {
                    let Value::Object(fields) = part else {
                        return Err(invalid(format!(
                            "messages[{i}].content parts must be objects"
                        )));
                    };
                    match fields.get("type").and_then(Value::as_str) {
                        Some("text") => match fields.get("text") {
                            Some(Value::String(s)) => self.push(
                                Cow::Borrowed(s),
                                Some(base(&[PathStep::Index(j), PathStep::Key("text")])),
                                i,
                            ),
                            _ => {
                                return Err(invalid(format!(
                                    "messages[{i}] has a text part without a string 'text'"
                                )))
                            }
                        },
                        Some("image_url" | "image" | "input_image") => self.images += 1,
                        Some("input_audio" | "audio") => self.audios += 1,
                        _ => self.push_strings(part, "type", i),
                    }
                }
            }
            _ => {
                return Err(invalid(format!(
                    "messages[{i}].content must be a string, an array of parts or null"
                )))
            }
        }
        Ok(())
    }
}

/// Every text the engine tokenizes in a chat or completion body, in body
/// order (messages, then tool schemas), with its image and audio parts.
pub fn prompt_texts(v: &Value) -> Result<PromptTexts<'_>> {
    let Value::Object(body) = v else {
        return Err(invalid("request body must be a JSON object"));
    };
    let mut p = PromptTexts::default();
    match (body.get("messages"), body.get("prompt")) {
        (Some(_), Some(_)) => return Err(invalid("request has both 'messages' and 'prompt'")),
        (Some(Value::Array(msgs)), None) => {
            for (i, m) in msgs.iter().enumerate() {
                let Value::Object(fields) = m else {
                    return Err(invalid(format!("messages[{i}] must be an object")));
                };
                p.content(fields.get("content").unwrap_or(&Value::Null), i)?;
                for (key, value) in fields {
                    if !MESSAGE_METADATA.contains(&key.as_str()) {
                        p.push_strings(value, "", i);
                    }
                }
            }
            p.messages = msgs.len();
        }
        (Some(_), None) => return Err(invalid("'messages' must be an array")),
        (None, Some(Value::String(s))) => {
            p.push(Cow::Borrowed(s), Some(vec![PathStep::Key("prompt")]), 0)
        }
        (None, Some(Value::Array(items))) if items.iter().all(Value::is_string) => {
            for (i, s) in items.iter().filter_map(Value::as_str).enumerate() {
                let path = vec![PathStep::Key("prompt"), PathStep::Index(i)];
                p.push(Cow::Borrowed(s), Some(path), i);
            }
        }
        (None, Some(Value::Array(items))) if items.iter().all(|x| x.as_u64().is_some()) => {
            p.prompt_tokens = Some(items.len() as u64);
        }
        (None, Some(_)) => {
            return Err(invalid(
                "'prompt' must be a string, an array of strings or an array of token ids",
            ))
        }
        (None, None) => return Err(invalid("request has neither 'messages' nor 'prompt'")),
    }
    for key in SCHEMA_FIELDS {
        match body.get(key) {
            None | Some(Value::Null) => {}
            Some(schema) => {
                let json =
                    serde_json::to_string(schema).map_err(|e| invalid(format!("'{key}': {e}")))?;
                p.push(Cow::Owned(json), None, p.messages);
            }
        }
    }
    Ok(p)
}

fn opt_str(body: &Value, key: &str) -> Result<Option<String>> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(invalid(format!("'{key}' must be a string"))),
    }
}

/// An optional integer field in [1, `max`].
fn bounded(body: &Value, key: &str, max: u64) -> Result<Option<u64>> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) if n >= 1 && n as u64 <= max => Ok(Some(n as u64)),
            _ => Err(invalid(format!(
                "'{key}' must be an integer in [1, {max}], got {v}"
            ))),
        },
    }
}

/// Parses a request body; `default_max_tokens` applies when it sets none,
/// `media` prices its image and audio parts.
pub fn parse_request(
    body: &[u8],
    default_max_tokens: u64,
    media: MediaTokens,
) -> Result<ParsedRequest> {
    if body.len() > MAX_BODY_BYTES {
        return Err(invalid(format!(
            "request body is {} bytes, over the {MAX_BODY_BYTES}-byte limit",
            body.len()
        )));
    }
    if default_max_tokens == 0 || default_max_tokens > MAX_TOKENS {
        return Err(invalid(format!(
            "default_max_tokens must be in [1, {MAX_TOKENS}]"
        )));
    }
    let v: Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("malformed JSON: {e}")))?;
    let p = prompt_texts(&v)?;
    let text: String = p.texts.iter().map(|t| t.text.as_ref()).collect();
    let given = match bounded(&v, "max_completion_tokens", MAX_TOKENS)? {
        Some(n) => Some(n),
        None => bounded(&v, "max_tokens", MAX_TOKENS)?,
    };
    let n = bounded(&v, "n", MAX_CHOICES)?
        .unwrap_or(1)
        .max(bounded(&v, "best_of", MAX_CHOICES)?.unwrap_or(1));
    let max_output_tokens = given.unwrap_or(default_max_tokens) * n;
    if max_output_tokens > MAX_TOKENS {
        return Err(invalid(format!(
            "n times the output bound is {max_output_tokens} tokens, over {MAX_TOKENS}"
        )));
    }
    let media_tokens = p.images * media.image + p.audios * media.audio;
    if media_tokens > MAX_TOKENS {
        return Err(invalid(format!(
            "image and audio parts cost {media_tokens} tokens, over {MAX_TOKENS}"
        )));
    }
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("'stream' must be a boolean")),
    };
    Ok(ParsedRequest {
        kind: if v.get("messages").is_some() {
            "chat"
        } else {
            "completion"
        },
        prompt_bytes: text.len() as u64,
        prompt_tokens: p.prompt_tokens,
        media_tokens,
        category: classify(text.as_bytes()),
        max_output_tokens,
        max_tokens_given: given.is_some(),
        n,
        model: opt_str(&v, "model")?,
        stream,
        user: opt_str(&v, "user")?,
        messages: p.messages,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ParsedRequest> {
        parse_request(
            s.as_bytes(),
            DEFAULT_MAX_OUTPUT_TOKENS,
            MediaTokens::default(),
        )
    }

    #[test]
    fn chat_with_parts() {
        let p = parse(
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},
            {"role":"user","content":[{"type":"text","text":"héllo"},{"type":"image_url","image_url":{"url":"x"}}]},
            {"role":"assistant","content":null}],"max_tokens":100,"stream":true,"user":"u1"}"#,
        )
        .expect("valid");
        assert_eq!(p.kind, "chat");
        assert_eq!(p.prompt_bytes, 9 + 6);
        assert_eq!(p.max_output_tokens, 100);
        assert!(p.max_tokens_given && p.stream);
        assert_eq!(
            (p.model.as_deref(), p.user.as_deref(), p.messages),
            (Some("m"), Some("u1"), 3)
        );
    }

    #[test]
    fn completion_forms_and_defaults() {
        let p =
            parse(r#"{"prompt":"abcd","max_completion_tokens":7,"max_tokens":9}"#).expect("valid");
        assert_eq!(
            (p.kind, p.prompt_bytes, p.max_output_tokens),
            ("completion", 4, 7)
        );
        let p = parse(r#"{"prompt":["ab","cd"]}"#).expect("valid");
        assert_eq!(
            (p.prompt_bytes, p.max_output_tokens, p.max_tokens_given),
            (4, 4096, false)
        );
        let p = parse(r#"{"prompt":[1,2,3]}"#).expect("valid");
        assert_eq!((p.prompt_bytes, p.prompt_tokens), (0, Some(3)));
    }

    #[test]
    fn errors() {
        for bad in [
            "",
            "{",
            "[]",
            "3",
            r#"{"model":"m"}"#,
            r#"{"messages":{}}"#,
            r#"{"messages":[1]}"#,
            r#"{"messages":[{"content":5}]}"#,
            r#"{"messages":[{"content":[{"type":"text"}]}]}"#,
            r#"{"prompt":"x","messages":[]}"#,
            r#"{"prompt":{}}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":"x","max_tokens":0}"#,
            r#"{"prompt":"x","max_tokens":-3}"#,
            r#"{"prompt":"x","max_tokens":1.5}"#,
            r#"{"prompt":"x","max_tokens":99999999999}"#,
            r#"{"prompt":"x","stream":"yes"}"#,
            r#"{"prompt":"x","model":3}"#,
            r#"{"prompt":"x","n":0}"#,
            r#"{"prompt":"x","n":129}"#,
            r#"{"prompt":"x","best_of":"2"}"#,
            r#"{"prompt":"x","n":2,"max_tokens":1073741824}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let media = MediaTokens::default();
        assert!(parse_request(&vec![b' '; MAX_BODY_BYTES + 1], 16, media).is_err());
        assert!(parse_request(b"{\"prompt\":\"x\"}", 0, media).is_err());
        assert!(MediaTokens::new(-1, 0).is_err() && MediaTokens::new(0, 1 << 31).is_err());
    }

    #[test]
    fn tools_tool_calls_and_schemas_are_counted() {
        let p = parse(
            r#"{"messages":[{"role":"user","content":"hi"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
              "function":{"name":"f","arguments":"{\"a\":1}"}}]},
            {"role":"tool","tool_call_id":"c1","content":[{"text":"42"}]}],
            "tools":[{"type":"function","function":{"name":"f"}}],
            "response_format":{"type":"json_object"}}"#,
        )
        .expect("valid");
        let tools = r#"[{"type":"function","function":{"name":"f"}}]"#;
        let format = r#"{"type":"json_object"}"#;
        let calls = "c1".len() + "function".len() + "f".len() + r#"{"a":1}"#.len();
        assert_eq!(
            p.prompt_bytes as usize,
            2 + calls + 2 + tools.len() + format.len()
        );
    }

    #[test]
    fn media_parts_cost_their_tokens_and_n_multiplies_the_output() {
        let body = br#"{"messages":[{"role":"user","content":[
            {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},
            {"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}},
            {"type":"image_url","image_url":{"url":"x"}}]}],"n":3,"best_of":2,"max_tokens":10}"#;
        let p = parse_request(body, 16, MediaTokens::new(100, 7).expect("valid")).expect("valid");
        assert_eq!((p.prompt_bytes, p.media_tokens), (0, 207));
        assert_eq!((p.n, p.max_output_tokens), (3, 30));
        let p = parse(r#"{"prompt":"x","best_of":4}"#).expect("valid");
        assert_eq!(
            (p.n, p.max_output_tokens),
            (4, 4 * DEFAULT_MAX_OUTPUT_TOKENS)
        );
    }
}
