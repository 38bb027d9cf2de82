//! Reading the fields routing needs from an OpenAI-style request body
//! (`/v1/chat/completions` or `/v1/completions`), with serde_json.
//!
//! - Prompt bytes: the UTF-8 byte length of every text the model will read:
//!   each chat message's `content` when it is a string, the `text` of each
//!   `{"type": "text"}` part when it is an array (image and audio parts carry no
//!   text and are not counted), or the completion `prompt` (a string or an
//!   array of strings). Roles, names and the chat template are not counted;
//!   the calibrator learns that overhead from `usage.prompt_tokens`.
//! - A completion `prompt` given as token ids (an array of integers) has no
//!   bytes: its length is reported as `prompt_tokens`, known exactly.
//! - Output bound: `max_completion_tokens`, else `max_tokens`, else the
//!   caller's documented default.
//! - `model`, `stream` (default false) and `user` as given.
//!
//! Malformed JSON, wrong types, a body over [`MAX_BODY_BYTES`] and absurd token
//! counts are errors.

use serde_json::Value;

use crate::budget::MAX_TOKENS;
use crate::classify::classify;
use crate::error::{invalid, Result};

/// The largest body `parse_request` reads (64 MiB).
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// The output bound assumed when a request gives none (documented in the API).
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    /// "chat" (a `messages` body) or "completion" (a `prompt` body).
    pub kind: &'static str,
    pub prompt_bytes: u64,
    /// Exact prompt length when the prompt was given as token ids.
    pub prompt_tokens: Option<u64>,
    /// `classify` over the prompt text.
    pub category: &'static str,
    pub max_output_tokens: u64,
    /// Whether the body set `max_tokens` / `max_completion_tokens`.
    pub max_tokens_given: bool,
    pub model: Option<String>,
    pub stream: bool,
    pub user: Option<String>,
    /// Number of chat messages (0 for a completion).
    pub messages: usize,
}

fn opt_str(body: &Value, key: &str) -> Result<Option<String>> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(invalid(format!("'{key}' must be a string"))),
    }
}

fn max_tokens(body: &Value, key: &str) -> Result<Option<u64>> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) if n >= 1 && n as u64 <= MAX_TOKENS => Ok(Some(n as u64)),
            _ => Err(invalid(format!(
                "'{key}' must be an integer in [1, {MAX_TOKENS}], got {v}"
            ))),
        },
    }
}

/// Appends the text of one chat `content` value.
fn content_text(content: &Value, index: usize, text: &mut String) -> Result<()> {
    match content {
        Value::Null => Ok(()),
        Value::String(s) => {
            text.push_str(s);
            Ok(())
        }
        Value::Array(parts) => {
            for part in parts {
                let Value::Object(part) = part else {
                    return Err(invalid(format!(
                        "messages[{index}].content parts must be objects"
                    )));
                };
                if part.get("type").and_then(Value::as_str) == Some("text") {
                    match part.get("text") {
                        Some(Value::String(s)) => text.push_str(s),
                        _ => {
                            return Err(invalid(format!(
                                "messages[{index}] has a text part without a string 'text'"
                            )))
                        }
                    }
                }
            }
            Ok(())
        }
        _ => Err(invalid(format!(
            "messages[{index}].content must be a string, an array of parts or null"
        ))),
    }
}

/// Parses a request body; `default_max_tokens` applies when it sets none.
pub fn parse_request(body: &[u8], default_max_tokens: u64) -> Result<ParsedRequest> {
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
    if !v.is_object() {
        return Err(invalid("request body must be a JSON object"));
    }
    let mut text = String::new();
    let mut prompt_tokens = None;
    let (kind, messages) =
        match (v.get("messages"), v.get("prompt")) {
            (Some(_), Some(_)) => return Err(invalid("request has both 'messages' and 'prompt'")),
            (Some(Value::Array(msgs)), None) => {
                for (i, m) in msgs.iter().enumerate() {
                    let Value::Object(m) = m else {
                        return Err(invalid(format!("messages[{i}] must be an object")));
                    };
                    content_text(m.get("content").unwrap_or(&Value::Null), i, &mut text)?;
                }
                ("chat", msgs.len())
            }
            (Some(_), None) => return Err(invalid("'messages' must be an array")),
            (None, Some(p)) => {
                match p {
                    Value::String(s) => text.push_str(s),
                    Value::Array(items) if items.iter().all(Value::is_string) => {
                        items
                            .iter()
                            .filter_map(Value::as_str)
                            .for_each(|s| text.push_str(s));
                    }
                    Value::Array(items) if items.iter().all(|x| x.as_u64().is_some()) => {
                        prompt_tokens = Some(items.len() as u64);
                    }
                    _ => return Err(invalid(
                        "'prompt' must be a string, an array of strings or an array of token ids",
                    )),
                }
                ("completion", 0)
            }
            (None, None) => return Err(invalid("request has neither 'messages' nor 'prompt'")),
        };
    let given = match max_tokens(&v, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => max_tokens(&v, "max_tokens")?,
    };
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("'stream' must be a boolean")),
    };
    Ok(ParsedRequest {
        kind,
        prompt_bytes: text.len() as u64,
        prompt_tokens,
        category: classify(text.as_bytes()),
        max_output_tokens: given.unwrap_or(default_max_tokens),
        max_tokens_given: given.is_some(),
        model: opt_str(&v, "model")?,
        stream,
        user: opt_str(&v, "user")?,
        messages,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ParsedRequest> {
        parse_request(s.as_bytes(), DEFAULT_MAX_OUTPUT_TOKENS)
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
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(parse_request(&vec![b' '; MAX_BODY_BYTES + 1], 16).is_err());
        assert!(parse_request(b"{\"prompt\":\"x\"}", 0).is_err());
    }
}
