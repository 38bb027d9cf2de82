//! Extractive compression of borderline prompts (FleetOpt, Chen et al. 2026,
//! section 5.2): the "compress" half of compress-and-route.
//!
//! A prompt whose `L_total` lands just above the short pool's budget `B` is
//! cut down to `T_c = B - L_out` tokens by dropping whole sentences, so it can
//! be served by the short pool. No model runs; the pipeline is:
//!
//! 1. **Split** into sentences, Unicode-aware (see [`split_sentences`]): Latin
//!    `. ! ? …` followed by a space (not after an abbreviation or an initial,
//!    not before a lower-case word), CJK `。！？．` with no space needed,
//!    blank lines, and new lines that start a list item or a heading. A fenced
//!    code block (```` ``` ````) is one unit that is always kept.
//! 2. **Score** each sentence with the paper's composite
//!    `w_tr * TextRank + w_pos * position + w_tfidf * TF-IDF + w_nov * novelty`
//!    (defaults 0.20, 0.40, 0.35, 0.05). Terms are lower-cased words of two or
//!    more characters that are not English stop words, and character bigrams
//!    of CJK runs.
//!    - TextRank (Mihalcea and Tarau 2004): PageRank (d = 0.85) over the graph
//!      whose edge weight is the cosine of the sentences' distinct-term sets,
//!      `|S_i ∩ S_j| / sqrt(|S_i| |S_j|)`. Mihalcea and Tarau divide the
//!      overlap by `ln|S_i| + ln|S_j|` instead; the cosine form factorises,
//!      so the ranking never builds the n^2 graph (see `textrank`).
//!    - Position: `1 / sqrt(1 + min(i, n - 1 - i))`, primacy and recency.
//!    - TF-IDF: the mean over the sentence's terms of `tf_doc(t) * idf(t)`,
//!      `idf(t) = ln((1 + n) / (1 + df(t))) + 1`, sentences as documents:
//!      sentences that carry the document's own frequent-but-specific terms.
//!    - Novelty: the share of the sentence's distinct terms not yet covered by
//!      the sentences already kept; it changes as sentences are kept.
//!
//!    TextRank, position and TF-IDF are each scaled to a maximum of 1.
//! 3. **Select** greedily by score: first the first `keep_first` and last
//!    `keep_last` sentences (and fenced code), then the others in score order
//!    (lazy greedy: novelty only falls as more is kept), each kept if it still
//!    fits, skipped if not.
//! 4. **Output** the kept sentences in their original order, each with the
//!    white space that followed it in the original, so lists and paragraphs
//!    keep their shape.
//!
//! The guarantee: sizes are counted as the router counts them, with the
//! conservative estimate `ceil(bytes / bytes_per_token)`. A sentence is kept
//! only if the output, with it, still estimates within the budget, so
//! `tokens_after <= token_budget` whenever the result succeeded. When the
//! mandatory sentences alone exceed the budget the result says so
//! (`Status::Impossible`) and leaves the text unchanged: such a request must
//! not go to the short pool.
//!
//! The safety gate: a text of category "code" (given, or by
//! [`crate::classify::classify`]) is never compressed (`Status::Code`).
//!
//! OpenAI bodies ([`Compressor::compress_request`]): only long content is
//! compressed, that is documents and RAG context. Kept intact: every `system`
//! and `developer` message, the last `user` message, every content shorter
//! than [`MIN_DOCUMENT_BYTES`], and every content that classifies as code.
//! Everything else (earlier user turns, assistant and tool messages, each
//! text part of a content array, a completion `prompt`) shares what is left of
//! the budget in proportion to its size, in message order, and the slack one
//! leaves goes to the next. Every other text the engine tokenizes (tool
//! schemas, tool calls, `response_format`, other parts; see
//! [`crate::openai::prompt_texts`]) counts toward the size and is never
//! rewritten.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

use crate::budget::{compressible_category, MAX_TOKENS};
use crate::calibrate::{estimate, MAX_RATIO, MIN_RATIO};
use crate::classify::{classify, is_cjk};
use crate::error::{finite, invalid, non_negative, Result};
use crate::openai::{prompt_texts, PathStep, MAX_BODY_BYTES};

/// Contents of an OpenAI body shorter than this are never compressed.
pub const MIN_DOCUMENT_BYTES: usize = 1024;
const DAMPING: f64 = 0.85;
const TEXTRANK_ITERATIONS: usize = 50;
const TEXTRANK_TOLERANCE: f64 = 1e-6;

/// The conservative bytes per token assumed for a category when the caller
/// gives none: below the typical ratios of the token-budget paper (prose
/// about 4.5, code 3.5, CJK 2.0, mixed 3.8), so the estimate errs high.
pub fn default_bytes_per_token(category: &str) -> f64 {
    match category {
        "cjk" => 1.5,
        "mixed" | "code" => 3.0,
        _ => 4.0,
    }
}

/// The largest byte count whose estimate `ceil(bytes / ratio)` is within
/// `tokens`.
pub fn max_bytes(tokens: u64, ratio: f64) -> u64 {
    let mut b = (tokens as f64 * ratio).floor() as u64;
    while b > 0 && estimate(b, ratio) > tokens {
        b -= 1;
    }
    while estimate(b + 1, ratio) <= tokens {
        b += 1;
    }
    b
}

/// The composite score weights of section 5.2.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub textrank: f64,
    pub position: f64,
    pub tfidf: f64,
    pub novelty: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            textrank: 0.20,
            position: 0.40,
            tfidf: 0.35,
            novelty: 0.05,
        }
    }
}

/// One sentence: the byte range `start..end` of the text, trailing white
/// space included, and whether it must be kept (fenced code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
    pub pinned: bool,
}

impl Span {
    fn len(&self) -> u64 {
        (self.end - self.start) as u64
    }
}

/// How a compression came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Already within the budget: unchanged.
    Fits,
    /// Sentences dropped; within the budget.
    Compressed,
    /// Code is never compressed: unchanged.
    Code,
    /// The mandatory sentences alone exceed the budget: unchanged.
    Impossible,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Fits => "fits",
            Status::Compressed => "compressed",
            Status::Code => "code",
            Status::Impossible => "impossible",
        }
    }

    /// True when the output is within the budget.
    pub fn succeeded(self) -> bool {
        matches!(self, Status::Fits | Status::Compressed)
    }
}

/// Sizes (by the estimate `ceil(bytes / bytes_per_token)`) and outcome of a
/// compression.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub tokens_before: u64,
    pub tokens_after: u64,
    pub bytes_per_token: f64,
    pub status: Status,
}

impl Summary {
    /// The checks both entry points make first, for an input of `bytes`: the
    /// ratio, the size before, and a final summary when the input stays as it
    /// is (code, or already within the budget).
    fn plan(
        bytes: usize,
        token_budget: i64,
        category: &str,
        bytes_per_token: Option<f64>,
    ) -> Result<(Self, u64)> {
        let budget = check_budget(token_budget)?;
        let ratio = ratio_for(category, bytes_per_token)?;
        let tokens_before = estimate(bytes as u64, ratio);
        let status = if !compressible_category(category) {
            Status::Code
        } else if tokens_before <= budget {
            Status::Fits
        } else {
            Status::Impossible
        };
        let summary = Self {
            tokens_before,
            tokens_after: tokens_before,
            bytes_per_token: ratio,
            status,
        };
        Ok((summary, max_bytes(budget, ratio)))
    }

    /// This summary for an output of `bytes`, compressed.
    fn compressed(self, bytes: u64) -> Self {
        Self {
            tokens_after: estimate(bytes, self.bytes_per_token),
            status: Status::Compressed,
            ..self
        }
    }
}

/// The outcome of compressing one text.
#[derive(Debug, Clone, PartialEq)]
pub struct Compression {
    pub text: String,
    /// Indices of the sentences in `text`, ascending; all of them unless
    /// the status is `Compressed`.
    pub kept: Vec<usize>,
    pub sentences: usize,
    pub summary: Summary,
}

/// The outcome of compressing an OpenAI request body.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestCompression {
    /// The new body (the original bytes unless the status is `Compressed`).
    pub body: Vec<u8>,
    /// Chat message indices (or completion prompt indices) whose text changed.
    pub compressed: Vec<usize>,
    pub summary: Summary,
}

fn check_size(what: &str, bytes: usize) -> Result<()> {
    if bytes > MAX_BODY_BYTES {
        return Err(invalid(format!(
            "{what} is {bytes} bytes, over the {MAX_BODY_BYTES}-byte limit"
        )));
    }
    Ok(())
}

fn is_stop_word(w: &str) -> bool {
    matches!(
        w,
        "a" | "an"
            | "and"
            | "are"
            | "as"
            | "at"
            | "be"
            | "been"
            | "but"
            | "by"
            | "can"
            | "do"
            | "does"
            | "for"
            | "from"
            | "had"
            | "has"
            | "have"
            | "he"
            | "her"
            | "his"
            | "if"
            | "in"
            | "into"
            | "is"
            | "it"
            | "its"
            | "may"
            | "no"
            | "not"
            | "of"
            | "on"
            | "or"
            | "our"
            | "she"
            | "so"
            | "such"
            | "than"
            | "that"
            | "the"
            | "their"
            | "them"
            | "then"
            | "there"
            | "these"
            | "they"
            | "this"
            | "those"
            | "to"
            | "was"
            | "we"
            | "were"
            | "what"
            | "when"
            | "which"
            | "who"
            | "will"
            | "with"
            | "would"
            | "you"
            | "your"
    )
}

fn is_abbreviation(w: &str) -> bool {
    matches!(
        w,
        "mr" | "mrs"
            | "ms"
            | "dr"
            | "prof"
            | "sr"
            | "jr"
            | "st"
            | "vs"
            | "etc"
            | "e.g"
            | "i.e"
            | "cf"
            | "al"
            | "fig"
            | "figs"
            | "no"
            | "nos"
            | "vol"
            | "pp"
            | "ed"
            | "eds"
            | "inc"
            | "ltd"
            | "co"
            | "corp"
            | "approx"
            | "u.s"
            | "u.k"
            | "a.m"
            | "p.m"
            | "ph.d"
            | "sec"
            | "art"
            | "ch"
    )
}

fn is_closer(c: char) -> bool {
    matches!(
        c,
        '"' | '\'' | ')' | ']' | '”' | '’' | '»' | '」' | '』' | '）' | '】' | '〉' | '》' | '〕'
    )
}

fn is_cjk_terminal(c: char) -> bool {
    matches!(c, '。' | '！' | '？' | '．' | '｡')
}

/// The character starting at byte `k`, if any.
fn char_at(text: &str, k: usize) -> Option<char> {
    text.get(k..)?.chars().next()
}

/// Byte offset just past the run of characters from `k` that satisfy `f`.
fn skip_while(text: &str, mut k: usize, f: impl Fn(char) -> bool) -> usize {
    while let Some(c) = char_at(text, k).filter(|&c| f(c)) {
        k += c.len_utf8();
    }
    k
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// A list item or heading starts at byte `k` (after indentation): `-`, `*`,
/// `+`, `•` or `#` followed by a space, or digits then `.` or `)` and a space.
fn item_marker_at(text: &str, k: usize) -> bool {
    let at = |j: usize| text.as_bytes().get(j).copied();
    match char_at(text, k) {
        Some(c @ ('-' | '*' | '+' | '•' | '#')) => {
            matches!(at(k + c.len_utf8()), Some(b' ' | b'\t' | b'#'))
        }
        Some(c) if c.is_ascii_digit() => {
            let j = skip_while(text, k, |c| c.is_ascii_digit());
            matches!(at(j), Some(b'.' | b')')) && matches!(at(j + 1), Some(b' ' | b'\t'))
        }
        _ => false,
    }
}

/// If a fenced code block opens at line start `k`, the byte offset just past
/// its closing fence line (or the end of the text when it is never closed).
fn fence_end(text: &str, k: usize) -> Option<usize> {
    let fence = |j: usize| text.get(j..).is_some_and(|t| t.starts_with("```"));
    let open = skip_while(text, k, is_blank);
    if !fence(open) {
        return None;
    }
    let line_end = |j: usize| text[j..].find('\n').map(|n| j + n);
    let mut line = open + 3;
    while let Some(nl) = line_end(line) {
        line = nl + 1;
        if fence(skip_while(text, line, is_blank)) {
            return Some(line_end(line).map_or(text.len(), |nl| nl + 1));
        }
    }
    Some(text.len())
}

/// Whether the `.` at byte `k` ends a sentence: not after an abbreviation or a
/// single-letter initial, not before a lower-case letter.
fn period_ends_sentence(text: &str, k: usize) -> bool {
    let word_start = text[..k]
        .char_indices()
        .rev()
        .find(|&(_, c)| c.is_whitespace() || is_closer(c))
        .map_or(0, |(i, c)| i + c.len_utf8());
    let word = text[word_start..k].trim_start_matches(['(', '[', '"', '\'']);
    if word.chars().count() == 1 && word.chars().all(char::is_alphabetic) {
        return false;
    }
    if is_abbreviation(&word.to_lowercase()) {
        return false;
    }
    let next = text[k + 1..]
        .chars()
        .find(|c| !c.is_whitespace() && !is_closer(*c));
    !next.is_some_and(char::is_lowercase)
}

/// Splits `text` into sentence spans that tile it: every byte belongs to
/// exactly one span, and a span ends with the white space that follows it.
pub fn split_sentences(text: &str) -> Vec<Span> {
    let n = text.len();
    let mut spans: Vec<Span> = Vec::new();
    let mut start = 0usize;
    let push = |spans: &mut Vec<Span>, start: &mut usize, end: usize, pinned: bool| {
        if end <= *start {
            return;
        }
        if text[*start..end].trim().is_empty() {
            // White space only: belongs to the sentence before, if any.
            if let Some(last) = spans.last_mut() {
                last.end = end;
                *start = end;
            }
            return;
        }
        spans.push(Span {
            start: *start,
            end,
            pinned,
        });
        *start = end;
    };
    let mut k = 0;
    let mut line_start = true;
    while let Some(c) = char_at(text, k) {
        if line_start {
            if let Some(end) = fence_end(text, k) {
                push(&mut spans, &mut start, k, false);
                push(&mut spans, &mut start, end, true);
                k = end;
                continue;
            }
        }
        line_start = false;
        if c == '\n' {
            // Where the next line's text starts, and whether a blank line
            // lies between.
            let mut j = k + 1;
            let mut last_newline = k;
            while let Some(d) = char_at(text, j).filter(|d| d.is_whitespace()) {
                if d == '\n' {
                    last_newline = j;
                }
                j += d.len_utf8();
            }
            let blank = last_newline > k;
            if blank
                || j >= n
                || item_marker_at(text, j)
                || fence_end(text, last_newline + 1).is_some()
            {
                push(&mut spans, &mut start, last_newline + 1, false);
                k = last_newline + 1;
                line_start = true;
            } else {
                k += 1;
            }
            continue;
        }
        let latin = matches!(c, '.' | '!' | '?' | '…');
        if !(latin || is_cjk_terminal(c)) {
            // Skip to the next byte that can start a newline or a terminal:
            // `\n . ! ?` or the lead byte of a 3- or 4-byte character (all
            // of `…` and the CJK terminals); continuation bytes never match.
            let from = k + c.len_utf8();
            k = text.as_bytes()[from..]
                .iter()
                .position(|&b| matches!(b, b'\n' | b'.' | b'!' | b'?') || b >= 0xE2)
                .map_or(n, |skip| from + skip);
            continue;
        }
        let j = skip_while(text, k + c.len_utf8(), |d| {
            is_closer(d) || matches!(d, '.' | '!' | '?' | '…')
        });
        let ends = if latin {
            let next = char_at(text, j);
            let spaced = next.is_none_or(|d| d.is_whitespace() || is_cjk(d));
            spaced && (c != '.' || j > k + 1 || period_ends_sentence(text, k))
        } else {
            true
        };
        if !ends {
            k = j;
            continue;
        }
        // Trailing white space up to the start of the next line's text.
        let after = skip_while(text, j, char::is_whitespace);
        let end = match text[j..after].rfind('\n') {
            Some(nl) if after < n => j + nl + 1,
            _ => after,
        };
        push(&mut spans, &mut start, end, false);
        line_start = text[..end].ends_with('\n');
        k = end;
    }
    push(&mut spans, &mut start, n, false);
    if spans.is_empty() && !text.is_empty() {
        // White space only: one sentence.
        spans.push(Span {
            start: 0,
            end: n,
            pinned: false,
        });
    }
    spans
}

/// Term ids of each sentence: distinct ids with their counts.
struct Terms {
    /// Per sentence: (term id, count), sorted by id.
    sentences: Vec<Vec<(u32, u32)>>,
    n_terms: usize,
}

/// A hasher for keys that are already hashes (xxh3-64 of a term): the key
/// itself is the hash.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Dense ids for terms, keyed by the xxh3-64 hash of the term's UTF-8 (two
/// different terms share an id with probability about 2^-64 per pair).
#[derive(Default)]
struct Interner(HashMap<u64, u32, BuildHasherDefault<Prehashed>>);

impl Interner {
    fn id(&mut self, term: &[u8]) -> u32 {
        let next = self.0.len() as u32;
        *self.0.entry(xxh3_64(term)).or_insert(next)
    }
}

fn terms(text: &str, spans: &[Span]) -> Terms {
    let mut ids = Interner::default();
    let mut word = String::new();
    let mut sentences = Vec::with_capacity(spans.len());
    let mut occurrences: Vec<u32> = Vec::new();
    let flush = |word: &mut String, occ: &mut Vec<u32>, ids: &mut Interner| {
        if word.chars().nth(1).is_some() && !is_stop_word(word) {
            occ.push(ids.id(word.as_bytes()));
        }
        word.clear();
    };
    for span in spans {
        occurrences.clear();
        let mut prev_cjk: Option<char> = None;
        for c in text[span.start..span.end].chars() {
            if c.is_ascii() {
                prev_cjk = None;
                if c.is_ascii_alphanumeric() {
                    word.push(c.to_ascii_lowercase());
                } else {
                    flush(&mut word, &mut occurrences, &mut ids);
                }
            } else if c.is_alphabetic() && is_cjk(c) {
                flush(&mut word, &mut occurrences, &mut ids);
                if let Some(p) = prev_cjk {
                    let mut bigram = [0u8; 8];
                    let a = p.encode_utf8(&mut bigram).len();
                    let b = c.encode_utf8(&mut bigram[a..]).len();
                    occurrences.push(ids.id(&bigram[..a + b]));
                }
                prev_cjk = Some(c);
            } else if c.is_alphanumeric() {
                prev_cjk = None;
                word.extend(c.to_lowercase());
            } else {
                prev_cjk = None;
                flush(&mut word, &mut occurrences, &mut ids);
            }
        }
        flush(&mut word, &mut occurrences, &mut ids);
        occurrences.sort_unstable();
        let mut counted: Vec<(u32, u32)> = Vec::new();
        for &t in &occurrences {
            match counted.last_mut() {
                Some((last, count)) if *last == t => *count += 1,
                _ => counted.push((t, 1)),
            }
        }
        sentences.push(counted);
    }
    Terms {
        sentences,
        n_terms: ids.0.len(),
    }
}

/// Scales `xs` so the largest is 1 (all zero stays zero).
fn scale_to_max(xs: &mut [f64]) {
    let max = xs.iter().copied().fold(0.0, f64::max);
    if max > 0.0 {
        xs.iter_mut().for_each(|x| *x /= max);
    }
}

/// TextRank over the sentence-similarity graph (see the module docs).
///
/// With `A` the sentence-by-term incidence matrix (distinct terms) and
/// `D = diag(|S_i|)`, the similarity matrix is `W = D^-1/2 A A^T D^-1/2`
/// without its diagonal. `W` is never formed: `W x` is computed as
/// `D^-1/2 (A (A^T (D^-1/2 x))) - x`, linear in the number of terms, so the
/// whole ranking costs `O(iterations * terms)` however many sentences share a
/// word.
fn textrank(t: &Terms) -> Vec<f64> {
    let n = t.sentences.len();
    let inv_sqrt: Vec<f64> = t
        .sentences
        .iter()
        .map(|s| {
            if s.is_empty() {
                0.0
            } else {
                1.0 / (s.len() as f64).sqrt()
            }
        })
        .collect();
    let mut by_term = vec![0.0; t.n_terms];
    // y -> W y (diagonal removed), into `out`.
    let mut product = |y: &[f64], out: &mut [f64]| {
        by_term.iter_mut().for_each(|x| *x = 0.0);
        for (i, s) in t.sentences.iter().enumerate() {
            let v = y[i] * inv_sqrt[i];
            for &(term, _) in s {
                by_term[term as usize] += v;
            }
        }
        for (i, s) in t.sentences.iter().enumerate() {
            let sum: f64 = s.iter().map(|&(term, _)| by_term[term as usize]).sum();
            let self_loop = if s.is_empty() { 0.0 } else { y[i] };
            out[i] = (sum * inv_sqrt[i] - self_loop).max(0.0);
        }
    };
    let mut degree = vec![0.0; n];
    product(&vec![1.0; n], &mut degree);
    let mut rank = vec![1.0; n];
    let mut scaled = vec![0.0; n];
    let mut inflow = vec![0.0; n];
    for _ in 0..TEXTRANK_ITERATIONS {
        for i in 0..n {
            scaled[i] = if degree[i] > 0.0 {
                rank[i] / degree[i]
            } else {
                0.0
            };
        }
        product(&scaled, &mut inflow);
        let mut delta = 0.0;
        for i in 0..n {
            let next = (1.0 - DAMPING) + DAMPING * inflow[i];
            delta += (next - rank[i]).abs();
            rank[i] = next;
        }
        if delta < TEXTRANK_TOLERANCE * n as f64 {
            break;
        }
    }
    scale_to_max(&mut rank);
    rank
}

/// The static part of each sentence's score: TextRank, position and TF-IDF,
/// weighted.
fn base_scores(t: &Terms, w: &Weights) -> Vec<f64> {
    let n = t.sentences.len();
    let mut df = vec![0u32; t.n_terms];
    let mut tf_doc = vec![0u32; t.n_terms];
    for s in &t.sentences {
        for &(term, count) in s {
            df[term as usize] += 1;
            tf_doc[term as usize] += count;
        }
    }
    let idf: Vec<f64> = df
        .iter()
        .map(|&d| ((1.0 + n as f64) / (1.0 + d as f64)).ln() + 1.0)
        .collect();
    let mut tfidf: Vec<f64> = t
        .sentences
        .iter()
        .map(|s| {
            let words: u32 = s.iter().map(|&(_, c)| c).sum();
            let total: f64 = s
                .iter()
                .map(|&(term, c)| c as f64 * tf_doc[term as usize] as f64 * idf[term as usize])
                .sum();
            total / (1.0 + words as f64)
        })
        .collect();
    scale_to_max(&mut tfidf);
    let tr = if w.textrank > 0.0 {
        textrank(t)
    } else {
        vec![0.0; n]
    };
    let mut position: Vec<f64> = (0..n)
        .map(|i| 1.0 / (1.0 + i.min(n - 1 - i) as f64).sqrt())
        .collect();
    scale_to_max(&mut position);
    (0..n)
        .map(|i| w.textrank * tr[i] + w.position * position[i] + w.tfidf * tfidf[i])
        .collect()
}

/// A candidate in the lazy-greedy heap: highest score first, then the
/// earlier sentence.
#[derive(PartialEq)]
struct Candidate {
    score: f64,
    index: usize,
}

impl Eq for Candidate {}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.index.cmp(&self.index))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The kept sentences of `text`, in order, each with its trailing space.
fn join(text: &str, spans: &[Span], kept: &[usize]) -> String {
    kept.iter()
        .map(|&i| &text[spans[i].start..spans[i].end])
        .collect()
}

/// A validated compressor configuration; it holds no state between calls.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compressor {
    weights: Weights,
    keep_first: usize,
    keep_last: usize,
}

impl Default for Compressor {
    fn default() -> Self {
        Self {
            weights: Weights::default(),
            keep_first: 3,
            keep_last: 2,
        }
    }
}

fn check_budget(token_budget: i64) -> Result<u64> {
    if token_budget < 1 || token_budget as u64 > MAX_TOKENS {
        return Err(invalid(format!(
            "token_budget must be in [1, {MAX_TOKENS}], got {token_budget}"
        )));
    }
    Ok(token_budget as u64)
}

fn ratio_for(category: &str, bytes_per_token: Option<f64>) -> Result<f64> {
    match bytes_per_token {
        None => Ok(default_bytes_per_token(category)),
        Some(r) => {
            let r = finite("bytes_per_token", r)?;
            if !(MIN_RATIO..=MAX_RATIO).contains(&r) {
                return Err(invalid(format!(
                    "bytes_per_token must be within [{MIN_RATIO}, {MAX_RATIO}], got {r}"
                )));
            }
            Ok(r)
        }
    }
}

fn check_category(category: Option<&str>) -> Result<Option<&str>> {
    match category {
        Some(c) if c.is_empty() || c.len() > 128 => Err(invalid(format!(
            "category must be 1 to 128 bytes, got {} bytes",
            c.len()
        ))),
        c => Ok(c),
    }
}

impl Compressor {
    /// Weights must be finite, non-negative and not all zero; `keep_first`
    /// and `keep_last` are sentence counts.
    pub fn new(weights: Weights, keep_first: usize, keep_last: usize) -> Result<Self> {
        let all = [
            ("textrank", weights.textrank),
            ("position", weights.position),
            ("tfidf", weights.tfidf),
            ("novelty", weights.novelty),
        ];
        for (name, x) in all {
            non_negative(name, x)?;
        }
        if all.iter().all(|&(_, x)| x == 0.0) {
            return Err(invalid("at least one weight must be > 0"));
        }
        Ok(Self {
            weights,
            keep_first,
            keep_last,
        })
    }

    pub fn weights(&self) -> Weights {
        self.weights
    }
    pub fn keep_first(&self) -> usize {
        self.keep_first
    }
    pub fn keep_last(&self) -> usize {
        self.keep_last
    }

    /// The sentences to keep (ascending) so that their bytes total at most
    /// `max_bytes`, or None when the mandatory ones alone exceed it.
    pub fn select(&self, text: &str, spans: &[Span], max_bytes: u64) -> Option<Vec<usize>> {
        let n = spans.len();
        let total: u64 = spans.iter().map(Span::len).sum();
        if total <= max_bytes {
            return Some((0..n).collect());
        }
        let mut kept = vec![false; n];
        let mut used = 0u64;
        for (i, s) in spans.iter().enumerate() {
            if i < self.keep_first || i + self.keep_last >= n || s.pinned {
                kept[i] = true;
                used += s.len();
            }
        }
        if used > max_bytes {
            return None;
        }
        let t = terms(text, spans);
        let base = base_scores(&t, &self.weights);
        let mut covered = vec![false; t.n_terms];
        let cover = |i: usize, covered: &mut [bool]| {
            for &(term, _) in &t.sentences[i] {
                covered[term as usize] = true;
            }
        };
        let novelty = |i: usize, covered: &[bool]| {
            let s = &t.sentences[i];
            if s.is_empty() {
                return 0.0;
            }
            let new = s
                .iter()
                .filter(|&&(term, _)| !covered[term as usize])
                .count();
            new as f64 / s.len() as f64
        };
        for i in (0..n).filter(|&i| kept[i]) {
            cover(i, &mut covered);
        }
        let w_nov = self.weights.novelty;
        let mut heap: BinaryHeap<Candidate> = (0..n)
            .filter(|&i| !kept[i])
            .map(|i| Candidate {
                score: base[i] + w_nov * novelty(i, &covered),
                index: i,
            })
            .collect();
        let smallest = spans
            .iter()
            .enumerate()
            .filter(|&(i, _)| !kept[i])
            .map(|(_, s)| s.len())
            .min()
            .unwrap_or(0);
        while let Some(top) = heap.pop() {
            if used + smallest > max_bytes {
                break;
            }
            let i = top.index;
            if spans[i].len() + used > max_bytes {
                continue;
            }
            let score = base[i] + w_nov * novelty(i, &covered);
            if heap
                .peek()
                .is_some_and(|next| Candidate { score, index: i }.cmp(next) == Ordering::Less)
            {
                heap.push(Candidate { score, index: i });
                continue;
            }
            kept[i] = true;
            used += spans[i].len();
            cover(i, &mut covered);
        }
        Some((0..n).filter(|&i| kept[i]).collect())
    }

    /// Compresses `text` to at most `token_budget` tokens by the estimate
    /// `ceil(bytes / bytes_per_token)`. `category` defaults to `classify`
    /// of the text; `bytes_per_token` to [`default_bytes_per_token`].
    pub fn compress(
        &self,
        text: &str,
        token_budget: i64,
        category: Option<&str>,
        bytes_per_token: Option<f64>,
    ) -> Result<Compression> {
        check_size("text", text.len())?;
        let category = check_category(category)?.unwrap_or_else(|| classify(text.as_bytes()));
        let (summary, limit) = Summary::plan(text.len(), token_budget, category, bytes_per_token)?;
        let spans = split_sentences(text);
        let selected = match summary.status {
            Status::Impossible => self.select(text, &spans, limit),
            _ => None,
        };
        let Some(kept) = selected else {
            return Ok(Compression {
                text: text.to_owned(),
                kept: (0..spans.len()).collect(),
                sentences: spans.len(),
                summary,
            });
        };
        let out = join(text, &spans, &kept);
        Ok(Compression {
            summary: summary.compressed(out.len() as u64),
            text: out,
            kept,
            sentences: spans.len(),
        })
    }

    /// Compresses an OpenAI chat or completion body so its prompt estimates
    /// within `token_budget` tokens; see the module docs for what is kept
    /// intact. `category` is the request's (default: `classify` of all its
    /// text, as `parse_openai_request` computes it).
    pub fn compress_request(
        &self,
        body: &[u8],
        token_budget: i64,
        category: Option<&str>,
        bytes_per_token: Option<f64>,
    ) -> Result<RequestCompression> {
        let category = check_category(category)?;
        check_size("request body", body.len())?;
        let mut v: Value =
            serde_json::from_slice(body).map_err(|e| invalid(format!("malformed JSON: {e}")))?;
        let slots = text_slots(&v)?;
        let all: String = slots.iter().map(|s| s.text.as_str()).collect();
        let category = category.unwrap_or_else(|| classify(all.as_bytes()));
        let (summary, limit) = Summary::plan(all.len(), token_budget, category, bytes_per_token)?;
        let unchanged = || RequestCompression {
            body: body.to_vec(),
            compressed: Vec::new(),
            summary,
        };
        if summary.status != Status::Impossible {
            return Ok(unchanged());
        }
        let fixed: u64 = slots
            .iter()
            .filter(|s| !s.compressible)
            .map(|s| s.text.len() as u64)
            .sum();
        let Some(mut room) = limit.checked_sub(fixed) else {
            return Ok(unchanged());
        };
        let mut rest: u64 = slots
            .iter()
            .filter(|s| s.compressible)
            .map(|s| s.text.len() as u64)
            .sum();
        let mut after = fixed;
        let mut compressed = Vec::new();
        for slot in slots.iter().filter(|s| s.compressible) {
            let size = slot.text.len() as u64;
            // This slot's share of what is left, by size (exact in u128).
            let share = (room as u128 * size as u128 / rest.max(1) as u128) as u64;
            let spans = split_sentences(&slot.text);
            let Some(kept) = self.select(&slot.text, &spans, share) else {
                return Ok(unchanged());
            };
            let out = join(&slot.text, &spans, &kept);
            room -= out.len() as u64;
            rest -= size;
            after += out.len() as u64;
            if out.len() < slot.text.len() {
                if compressed.last() != Some(&slot.item) {
                    compressed.push(slot.item);
                }
                if let Some(target) = slot.path.as_ref().and_then(|p| lookup(&mut v, p)) {
                    *target = Value::String(out);
                }
            }
        }
        let body = serde_json::to_vec(&v).map_err(|e| invalid(format!("JSON: {e}")))?;
        Ok(RequestCompression {
            body,
            compressed,
            summary: summary.compressed(after),
        })
    }
}

/// One text of a request body: where it is, whether it may be compressed,
/// and which message (or prompt item) it belongs to.
struct Slot {
    path: Option<Vec<PathStep>>,
    text: String,
    compressible: bool,
    item: usize,
}

fn lookup<'a>(v: &'a mut Value, path: &[PathStep]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, step| match step {
        PathStep::Key(k) => v.get_mut(*k),
        PathStep::Index(i) => v.get_mut(*i),
    })
}

fn long_prose(text: &str) -> bool {
    text.len() >= MIN_DOCUMENT_BYTES && compressible_category(classify(text.as_bytes()))
}

/// Every text the engine tokenizes in a chat or completion body, in order
/// (the texts `parse_openai_request` counts as prompt bytes). Only prose
/// with a path (message content, text parts, prompt strings) may be
/// compressed; tool schemas, tool calls and other parts are counted intact.
fn text_slots(v: &Value) -> Result<Vec<Slot>> {
    let prompt = prompt_texts(v)?;
    let msgs = v.get("messages").and_then(Value::as_array);
    let role = |i: usize| {
        msgs.and_then(|m| m.get(i))
            .and_then(|m| m.get("role"))
            .and_then(Value::as_str)
    };
    let last_user = msgs.and_then(|m| {
        m.iter()
            .rposition(|m| m.get("role").and_then(Value::as_str) == Some("user"))
    });
    Ok(prompt
        .texts
        .into_iter()
        .map(|t| {
            let intact =
                matches!(role(t.item), Some("system" | "developer")) || Some(t.item) == last_user;
            Slot {
                compressible: t.path.is_some() && !intact && long_prose(&t.text),
                path: t.path,
                text: t.text.into_owned(),
                item: t.item,
            }
        })
        .collect())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn texts(text: &str) -> Vec<&str> {
        split_sentences(text)
            .iter()
            .map(|s| &text[s.start..s.end])
            .collect()
    }

    #[test]
    fn splits_latin_abbreviations_and_lists() {
        assert_eq!(
            texts("Dr. Smith met Mr. J. Doe at 3.15 p.m. today. He said no! Why? Because."),
            vec![
                "Dr. Smith met Mr. J. Doe at 3.15 p.m. today. ",
                "He said no! ",
                "Why? ",
                "Because."
            ]
        );
        assert_eq!(
            texts("It costs approx. five dollars, e.g. less. \"Done.\" Next one"),
            vec![
                "It costs approx. five dollars, e.g. less. ",
                "\"Done.\" ",
                "Next one"
            ]
        );
        assert_eq!(
            texts("Items:\n- first item\n- second item\n1. numbered\nplain\ncontinued\n\nNew para"),
            vec![
                "Items:\n",
                "- first item\n",
                "- second item\n",
                "1. numbered\nplain\ncontinued\n\n",
                "New para"
            ]
        );
    }

    #[test]
    fn splits_cjk_and_fences() {
        assert_eq!(
            texts("今日は晴れです。明日は雨でしょう！「本当？」はい。"),
            vec![
                "今日は晴れです。",
                "明日は雨でしょう！",
                "「本当？」",
                "はい。"
            ]
        );
        let text = "Run this.\n```\nx = 1. y = 2.\n\nz = 3\n```\nThen stop.";
        let spans = split_sentences(text);
        let got: Vec<(&str, bool)> = spans
            .iter()
            .map(|s| (&text[s.start..s.end], s.pinned))
            .collect();
        assert_eq!(
            got,
            vec![
                ("Run this.\n", false),
                ("```\nx = 1. y = 2.\n\nz = 3\n```\n", true),
                ("Then stop.", false)
            ]
        );
    }

    #[test]
    fn spans_tile_the_text() {
        for text in ["", "   ", "\n\nA. B.\n\n", "x", "。。。", "a.b.c. D! ?? …"] {
            let spans = split_sentences(text);
            let joined: String = spans.iter().map(|s| &text[s.start..s.end]).collect();
            assert_eq!(joined, text);
            for w in spans.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
        }
    }

    #[test]
    fn max_bytes_is_the_largest_that_fits() {
        for (tokens, ratio) in [(10, 4.0), (7, 3.3), (1, 0.5), (1000, 1.5), (3, 32.0)] {
            let b = max_bytes(tokens, ratio);
            assert!(estimate(b, ratio) <= tokens);
            assert!(estimate(b + 1, ratio) > tokens);
        }
    }

    /// `n` sentences of prose about a few recurring topics.
    pub(crate) fn prose(n: usize) -> String {
        (0..n)
            .map(|i| {
                format!(
                    "Sentence {i} talks about topic{} and topic{} in some detail. ",
                    i % 7,
                    i % 5
                )
            })
            .collect()
    }

    #[test]
    fn keeps_first_and_last_in_order_within_budget() {
        let c = Compressor::default();
        let text = prose(40);
        let r = c
            .compress(&text, 400, Some("prose"), Some(4.0))
            .expect("valid");
        assert_eq!(r.summary.status, Status::Compressed);
        assert!(r.summary.tokens_after <= 400 && r.summary.tokens_before > 400);
        assert_eq!(r.sentences, 40);
        assert_eq!(&r.kept[..3], &[0, 1, 2]);
        assert_eq!(&r.kept[r.kept.len() - 2..], &[38, 39]);
        assert!(r.kept.windows(2).all(|w| w[0] < w[1]));
        let spans = split_sentences(&text);
        let expected: String = r
            .kept
            .iter()
            .map(|&i| &text[spans[i].start..spans[i].end])
            .collect();
        assert_eq!(r.text, expected);
        assert_eq!(r.summary.tokens_after, estimate(r.text.len() as u64, 4.0));
    }

    #[test]
    fn code_fits_impossible_and_empty() {
        let c = Compressor::default();
        let code = "fn main() {\n    let x = 1;\n    println!(\"{}\", x);\n}\n".repeat(50);
        let r = c.compress(&code, 10, None, None).expect("valid");
        assert_eq!(
            (r.summary.status, r.text.as_str()),
            (Status::Code, code.as_str())
        );
        let r = c
            .compress(&prose(3), 1, Some("prose"), None)
            .expect("valid");
        assert_eq!(r.summary.status, Status::Impossible);
        assert_eq!(r.text, prose(3));
        let r = c.compress("", 1, None, None).expect("valid");
        assert_eq!(
            (r.summary.status, r.sentences, r.summary.tokens_after),
            (Status::Fits, 0, 0)
        );
        let one = "Just one sentence here.";
        let r = c.compress(one, 100, None, None).expect("valid");
        assert_eq!((r.summary.status, r.kept.clone()), (Status::Fits, vec![0]));
        let r = c.compress(one, 2, None, None).expect("valid");
        assert_eq!(r.summary.status, Status::Impossible);
    }

    #[test]
    fn invalid_arguments() {
        let c = Compressor::default();
        assert!(c.compress("x", 0, None, None).is_err());
        assert!(c.compress("x", -5, None, None).is_err());
        assert!(c.compress("x", 10, None, Some(f64::NAN)).is_err());
        assert!(c.compress("x", 10, None, Some(0.1)).is_err());
        assert!(c.compress("x", 10, Some(""), None).is_err());
        let w = Weights {
            novelty: -0.1,
            ..Weights::default()
        };
        assert!(Compressor::new(w, 3, 2).is_err());
        let zero = Weights {
            textrank: 0.0,
            position: 0.0,
            tfidf: 0.0,
            novelty: 0.0,
        };
        assert!(Compressor::new(zero, 3, 2).is_err());
    }

    #[test]
    fn textrank_favours_the_central_sentence() {
        // Sentence 1 shares terms with every other; it ranks first.
        let text = "Alpha beta. Alpha beta gamma delta epsilon. Gamma delta. Epsilon zeta.";
        let spans = split_sentences(text);
        let r = textrank(&terms(text, &spans));
        assert_eq!(r[1], 1.0);
        assert!(r.iter().enumerate().all(|(i, &x)| i == 1 || x < 1.0));
    }

    #[test]
    fn chat_keeps_system_and_last_user_turn() {
        let doc = prose(60);
        let body = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "You answer from the document. ".repeat(40)},
                {"role": "user", "content": doc},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": "What does sentence 30 say about topic2? ".repeat(30)},
            ],
            "max_tokens": 100
        });
        let bytes = serde_json::to_vec(&body).expect("json");
        let c = Compressor::default();
        let r = c
            .compress_request(&bytes, 1200, Some("prose"), Some(4.0))
            .expect("valid");
        assert_eq!(r.summary.status, Status::Compressed);
        assert_eq!(r.compressed, vec![1]);
        assert!(r.summary.tokens_after <= 1200 && r.summary.tokens_before > 1200);
        let out: Value = serde_json::from_slice(&r.body).expect("json");
        for i in [0, 2, 3] {
            assert_eq!(out["messages"][i], body["messages"][i]);
        }
        assert_eq!(out["max_tokens"], 100);
        let parsed =
            crate::openai::parse_request(&r.body, 16, crate::openai::MediaTokens::default())
                .expect("parses");
        assert_eq!(estimate(parsed.prompt_bytes, 4.0), r.summary.tokens_after);
        // The intact parts alone exceed a tiny budget.
        let r = c
            .compress_request(&bytes, 300, Some("prose"), Some(4.0))
            .expect("valid");
        assert_eq!(
            (r.summary.status, r.body.as_slice()),
            (Status::Impossible, &bytes[..])
        );
        let r = c
            .compress_request(&bytes, 1200, Some("code"), Some(4.0))
            .expect("valid");
        assert_eq!(r.summary.status, Status::Code);
        assert!(c.compress_request(b"{", 10, None, None).is_err());
        assert!(c
            .compress_request(b"{\"model\":1}", 10, None, None)
            .is_err());
    }

    #[test]
    fn factorised_textrank_equals_the_explicit_graph() {
        let text = prose(30) + "Empty?! 12. Another sentence about topic3 and more.";
        let spans = split_sentences(&text);
        let t = terms(&text, &spans);
        let n = t.sentences.len();
        let w = |i: usize, j: usize| {
            let (a, b) = (&t.sentences[i], &t.sentences[j]);
            if i == j || a.is_empty() || b.is_empty() {
                return 0.0;
            }
            let common = a.iter().filter(|x| b.iter().any(|y| y.0 == x.0)).count();
            common as f64 / ((a.len() * b.len()) as f64).sqrt()
        };
        let degree: Vec<f64> = (0..n).map(|i| (0..n).map(|j| w(i, j)).sum()).collect();
        let mut rank = vec![1.0; n];
        for _ in 0..200 {
            rank = (0..n)
                .map(|i| {
                    let inflow: f64 = (0..n)
                        .filter(|&j| degree[j] > 0.0)
                        .map(|j| w(j, i) / degree[j] * rank[j])
                        .sum();
                    (1.0 - DAMPING) + DAMPING * inflow
                })
                .collect();
        }
        let max = rank.iter().copied().fold(0.0, f64::max);
        let fast = textrank(&t);
        for i in 0..n {
            assert!((fast[i] - rank[i] / max).abs() < 1e-4, "{i}");
        }
    }
}
