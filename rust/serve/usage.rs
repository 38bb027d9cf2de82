//! Reading `usage` from a response body given chunk by chunk, in linear time.
//!
//! JSON bodies are accumulated up to a limit and parsed at the end. SSE
//! bodies are scanned as they pass: only the new bytes are searched for line
//! ends and only the unfinished line is kept, up to [`MAX_SSE_LINE`] bytes (a
//! longer line is skipped to its end); the last `data:` event carrying usage
//! wins. What is kept is held in the data plane's buffer budget
//! (`limits.max_buffered_bytes`, [`Buffer`]): when it is full, the usage of
//! the body is not read.

use std::sync::Arc;

use serde_json::Value;

use super::limits::{Buffer, Overload};

/// The longest SSE line kept while looking for usage.
pub const MAX_SSE_LINE: usize = 64 * 1024;
pub use crate::budget::MAX_TOKENS;

/// `(prompt_tokens, completion_tokens)` reported by an engine (integers; a
/// count too large for u64 saturates, so it is still seen as absurd).
pub type Usage = (u64, u64);

fn count(v: Option<&Value>) -> Option<u64> {
    let v = v?;
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    // Integers beyond u64 are parsed as floats: huge, hence absurd.
    let f = v.as_f64()?;
    (v.is_f64() && f.is_finite() && f >= 0.0 && f.fract() == 0.0).then_some(u64::MAX)
}

/// The usage in a response object, when it reports one.
pub fn usage_of(body: &[u8]) -> Option<Usage> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let usage = v.get("usage")?.as_object()?;
    let prompt = count(usage.get("prompt_tokens"))?;
    let completion = match usage.get("completion_tokens") {
        None | Some(Value::Null) => 0,
        c => count(c)?,
    };
    Some((prompt, completion))
}

/// Whether a reported usage could be real on an engine whose context is
/// `context` tokens (a pool's `max_context`): the prompt and the completion
/// fit in it together. One check for every report, the engine's response
/// and a RouteCore `Feedback` alike.
pub fn plausible(usage: Usage, context: u64) -> bool {
    usage.0.saturating_add(usage.1) <= context.min(MAX_TOKENS)
}

/// Whether a response body whose headers routecore did not see (Envoy's
/// `response_header_mode: SKIP`) is an SSE stream, from its first chunk: an
/// OpenAI JSON answer is an object, an event stream starts with a field
/// (`data:`) or a comment. An empty chunk reads as JSON.
pub fn looks_like_sse(first: &[u8]) -> bool {
    first.trim_ascii_start().first().is_some_and(|&b| b != b'{')
}

pub struct UsageReader {
    sse: bool,
    limit: usize,
    buf: Buffer,
    skipping: bool,
    usage: Option<Usage>,
}

impl UsageReader {
    /// A reader of a JSON body of at most `limit` bytes, or of an SSE body
    /// (`sse`), whose buffer is held in `overload`'s budget.
    pub fn new(sse: bool, limit: usize, overload: &Arc<Overload>) -> Self {
        Self {
            sse,
            limit,
            buf: Buffer::new(overload),
            skipping: false,
            usage: None,
        }
    }

    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    pub fn feed(&mut self, chunk: &[u8], end: bool) {
        if self.sse {
            let mut rest = chunk;
            while let Some(i) = rest.iter().position(|&b| b == b'\n') {
                self.append(&rest[..i]);
                self.end_line();
                rest = &rest[i + 1..];
            }
            self.append(rest);
            if end {
                self.end_line();
            }
            return;
        }
        if self.buf.len() + chunk.len() > self.limit || !self.buf.extend(chunk, self.limit) {
            // Too large to hold: usage is not learned from it.
            self.buf.release();
            self.limit = 0;
            return;
        }
        if end {
            if let Some(u) = usage_of(self.buf.data()) {
                self.usage = Some(u);
            }
            self.buf.release();
        }
    }

    fn append(&mut self, part: &[u8]) {
        if self.skipping || part.is_empty() {
            return;
        }
        if self.buf.len() + part.len() > MAX_SSE_LINE || !self.buf.extend(part, MAX_SSE_LINE) {
            self.buf.release();
            self.skipping = true;
        }
    }

    fn end_line(&mut self) {
        if !self.skipping {
            if let Some(data) = self.buf.data().strip_prefix(b"data:") {
                if contains(data, b"\"usage\"") {
                    if let Some(u) = usage_of(data) {
                        self.usage = Some(u);
                    }
                }
            }
        }
        self.buf.clear();
        self.skipping = false;
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::metrics::Metrics;

    fn budget(bytes: u64) -> Arc<Overload> {
        let o = Arc::new(Overload::new(Arc::new(Metrics::new())));
        o.set_max_buffered(bytes);
        o
    }

    fn reader(sse: bool, limit: usize) -> UsageReader {
        UsageReader::new(sse, limit, &budget(u64::MAX))
    }

    fn sse(prompt: u64, completion: u64) -> Vec<u8> {
        format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"hi\"}}}}]}}\n\n\
             data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion}}}}}\n\n\
             data: [DONE]\n\n"
        )
        .into_bytes()
    }

    #[test]
    fn json_usage_is_read_at_the_end_in_any_chunking() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":120,"completion_tokens":20}}"#;
        for size in [1, 3, 7, body.len()] {
            let mut r = reader(false, 1 << 20);
            let chunks: Vec<&[u8]> = body.chunks(size).collect();
            for (i, c) in chunks.iter().enumerate() {
                r.feed(c, i + 1 == chunks.len());
            }
            assert_eq!(r.usage(), Some((120, 20)), "chunk size {size}");
        }
    }

    #[test]
    fn sse_usage_is_read_from_the_last_event_in_any_chunking() {
        let body = sse(170, 3);
        for size in [1, 2, 5, 64, body.len()] {
            let mut r = reader(true, 1 << 20);
            let chunks: Vec<&[u8]> = body.chunks(size).collect();
            for (i, c) in chunks.iter().enumerate() {
                r.feed(c, i + 1 == chunks.len());
            }
            assert_eq!(r.usage(), Some((170, 3)), "chunk size {size}");
        }
    }

    #[test]
    fn the_first_chunk_tells_sse_from_json() {
        assert!(looks_like_sse(&sse(1, 2)));
        assert!(looks_like_sse(b": keep-alive\n\n"));
        assert!(!looks_like_sse(b"  {\"id\":\"x\"}"));
        assert!(!looks_like_sse(b""));
    }

    #[test]
    fn json_body_over_the_limit_is_not_learned_from() {
        let mut r = reader(false, 10);
        r.feed(br#"{"usage":{"prompt_tokens":1}}"#, true);
        assert_eq!(r.usage(), None);
    }

    #[test]
    fn a_body_the_buffer_budget_cannot_hold_is_not_read_and_holds_nothing() {
        let o = budget(48);
        let body = br#"{"id":"x","usage":{"prompt_tokens":120,"completion_tokens":20}}"#;
        assert!(body.len() > 48);
        let sse = [&b"data: "[..], body, b"\n"].concat();
        for (is_sse, bytes) in [(false, &body[..]), (true, &sse[..])] {
            let mut r = UsageReader::new(is_sse, 1 << 20, &o);
            let chunks: Vec<&[u8]> = bytes.chunks(16).collect();
            for (i, c) in chunks.iter().enumerate() {
                r.feed(c, i + 1 == chunks.len());
            }
            assert_eq!(r.usage(), None, "sse {is_sse}");
            assert!(o.buffered() <= 48);
            drop(r);
            assert_eq!(o.buffered(), 0);
            // With room, the same body is read.
            let mut r = UsageReader::new(is_sse, 1 << 20, &budget(1 << 10));
            for (i, c) in chunks.iter().enumerate() {
                r.feed(c, i + 1 == chunks.len());
            }
            assert_eq!(r.usage(), Some((120, 20)), "sse {is_sse}");
        }
    }

    #[test]
    fn long_sse_line_is_skipped_and_later_lines_still_read() {
        let mut r = reader(true, 1 << 20);
        let junk = vec![b'x'; 1024];
        for _ in 0..(2 * MAX_SSE_LINE / 1024) {
            r.feed(&junk, false);
        }
        assert!(r.buf.is_empty() && r.skipping);
        r.feed(b"\n", false);
        r.feed(&sse(5, 6), true);
        assert_eq!(r.usage(), Some((5, 6)));
    }

    #[test]
    fn bad_or_missing_usage_is_none_and_huge_counts_are_absurd() {
        assert_eq!(usage_of(b"{oops"), None);
        assert_eq!(usage_of(br#"{"usage":{"prompt_tokens":-1}}"#), None);
        assert_eq!(usage_of(br#"{"usage":{"prompt_tokens":1.5}}"#), None);
        assert_eq!(usage_of(br#"{"usage":{"prompt_tokens":true}}"#), None);
        assert_eq!(usage_of(br#"{"usage":{"prompt_tokens":7}}"#), Some((7, 0)));
        let huge = usage_of(br#"{"usage":{"prompt_tokens":1000000000000000000000000000000}}"#);
        assert_eq!(huge, Some((u64::MAX, 0)));
        assert!(!plausible((u64::MAX, 0), MAX_TOKENS));
        assert!(!plausible((u64::MAX, u64::MAX), u64::MAX));
        assert!(!plausible((1, MAX_TOKENS), MAX_TOKENS));
        assert!(plausible((MAX_TOKENS, 0), MAX_TOKENS));
        // 2^30 / 2^30 (a Feedback that locked a tenant out) on an 8K pool.
        assert!(!plausible((1 << 30, 1 << 30), 8192));
        assert!(!plausible((0, 8193), 8192));
        assert!(plausible((8000, 192), 8192));
    }
}
