//! Traffic category of a prompt from byte-level statistics, no tokenizer:
//! "prose", "code", "cjk" or "mixed". These are the calibrator's categories in
//! the token-budget paper (its Table 4), whose bytes-per-token ratios differ
//! (about 4.5, 3.5, 2.0 and 3.8).
//!
//! Only a bounded sample is read: the first and last [`SAMPLE_BYTES`]/2 bytes of
//! a longer prompt, so classifying a 100 MB prompt costs the same as 64 KiB.
//!
//! Signals, over the sample's characters and lines:
//! - script: CJK characters (Han, kana, Hangul, CJK and full-width punctuation)
//!   against Latin letters and letters of other scripts;
//! - code: the share of non-blank characters that are code punctuation
//!   (`{}[]();=<>_*&|#$\`), and the share of non-blank lines that look like
//!   code (end in `;`, `{`, `}`, `)`, `:` or `,`; hold `==`, `!=`, `=>`, `->`,
//!   `::`, `&&`, `||`; or start with a common keyword). Indentation is not a
//!   signal: licences and lists are indented too.
//!
//! Rules, in order: CJK share >= 0.6 -> "cjk"; CJK share >= 0.1 or other
//! scripts >= 0.3 -> "mixed"; code lines >= 40% with punctuation >= 5%, or
//! code lines >= 20% with punctuation >= 12% -> "code"; code lines >= 20% with
//! punctuation >= 2.5% (prose with embedded snippets) -> "mixed"; otherwise
//! "prose". An empty or letter-less text is "prose", the cold-start category.
//! Measured on this machine's files: Python stdlib modules and C headers have
//! 40-66% code lines and 7-19% punctuation; licence texts 7-17% and 0.5-3.7%;
//! Markdown READMEs with snippets 14-33% and 1.5-7%.

use std::borrow::Cow;

pub const SAMPLE_BYTES: usize = 64 * 1024;

pub const CATEGORIES: [&str; 4] = ["prose", "code", "cjk", "mixed"];

/// Han, kana, Hangul, CJK symbols and punctuation, full-width forms.
pub fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x3000..=0x303F   // CJK symbols and punctuation
        | 0x3040..=0x30FF // Hiragana, Katakana
        | 0x3400..=0x4DBF // CJK extension A
        | 0x4E00..=0x9FFF // CJK unified ideographs
        | 0xAC00..=0xD7AF // Hangul syllables
        | 0x1100..=0x11FF // Hangul jamo
        | 0xF900..=0xFAFF // CJK compatibility ideographs
        | 0xFF00..=0xFFEF // half- and full-width forms
        | 0x20000..=0x2FA1F)
}

const fn is_code_punct(c: char) -> bool {
    matches!(
        c,
        '{' | '}'
            | '['
            | ']'
            | '('
            | ')'
            | ';'
            | '='
            | '<'
            | '>'
            | '_'
            | '*'
            | '&'
            | '|'
            | '#'
            | '$'
            | '\\'
    )
}

const KEYWORDS: [&str; 24] = [
    "def ", "class ", "import ", "from ", "return", "fn ", "let ", "const ", "var ", "function",
    "if (", "for (", "while (", "#include", "#define", "public ", "private ", "static ",
    "package ", "use ", "struct ", "impl ", "func ", "@",
];

/// Whether two adjacent ASCII bytes form a code operator (`==`, `!=`, `=>`,
/// `->`, `::`, `&&`, `||`).
fn operator(prev: u8, b: u8) -> bool {
    matches!(
        (prev, b),
        (b'=', b'=')
            | (b'!', b'=')
            | (b'=', b'>')
            | (b'-', b'>')
            | (b':', b':')
            | (b'&', b'&')
            | (b'|', b'|')
    )
}

const WHITESPACE: u8 = 0;
const LETTER: u8 = 1;
const PUNCT: u8 = 2;
const OTHER: u8 = 3;
const CLASS: u8 = 3;
/// Flag: the byte is the second of some operator (`=`, `>`, `:`, `&`, `|`).
const ENDS_OPERATOR: u8 = 4;

/// The class of every ASCII byte (whitespace as `char::is_whitespace` says:
/// tab to carriage return, space; Latin letter; code punctuation; other),
/// with the `ENDS_OPERATOR` flag.
const ASCII_CLASS: [u8; 128] = {
    let mut t = [OTHER; 128];
    let mut i = 0;
    while i < 128 {
        let b = i as u8;
        let class = if matches!(b, 9..=13 | b' ') {
            WHITESPACE
        } else if b.is_ascii_alphabetic() {
            LETTER
        } else if is_code_punct(b as char) {
            PUNCT
        } else {
            OTHER
        };
        let ends = matches!(b, b'=' | b'>' | b':' | b'&' | b'|');
        t[i] = class | if ends { ENDS_OPERATOR } else { 0 };
        i += 1;
    }
    t
};

/// Per byte, one count in the 16-bit field of its ASCII class (field k at
/// bits 16k..16k+16); 0 for the bytes of non-ASCII characters. Summing these
/// counts the classes in one register.
const PACKED_CLASS: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 128 {
        t[i] = 1 << (16 * (ASCII_CLASS[i] & CLASS) as u64);
        i += 1;
    }
    t
};

/// Bytes summed into one packed accumulator before it is spilled: below
/// 2^16, so no 16-bit field overflows.
const PACKED_RUN: usize = 1 << 14;

/// The sample of `bytes` that is classified: all of it up to SAMPLE_BYTES,
/// else the head and tail halves; decoded lossily, borrowed when valid UTF-8.
fn sample(bytes: &[u8]) -> Cow<'_, str> {
    if bytes.len() <= SAMPLE_BYTES {
        // `from_utf8` validates valid text much faster than the lossy decoder.
        return match std::str::from_utf8(bytes) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) => String::from_utf8_lossy(bytes),
        };
    }
    let half = SAMPLE_BYTES / 2;
    let mut s = String::from_utf8_lossy(&bytes[..half]).into_owned();
    s.push('\n');
    s.push_str(&String::from_utf8_lossy(&bytes[bytes.len() - half..]));
    Cow::Owned(s)
}

/// Character and line counts of a sample, gathered in one pass.
#[derive(Default)]
struct Counts {
    /// ASCII bytes by class (`WHITESPACE`, `LETTER`, `PUNCT`, `OTHER`).
    ascii: [usize; 4],
    cjk: usize,
    /// Non-ASCII Latin letters (U+00C0 to U+024F).
    latin: usize,
    other: usize,
    /// Visible non-ASCII characters.
    visible: usize,
    lines: usize,
    code_lines: usize,
}

impl Counts {
    fn latin(&self) -> usize {
        self.latin + self.ascii[LETTER as usize]
    }
    fn punct(&self) -> usize {
        self.ascii[PUNCT as usize]
    }
    fn visible(&self) -> usize {
        self.visible
            + self.ascii[LETTER as usize]
            + self.ascii[PUNCT as usize]
            + self.ascii[OTHER as usize]
    }
}

impl Counts {
    fn of(text: &str) -> Self {
        let mut n = Self::default();
        for run in text.as_bytes().chunks(PACKED_RUN) {
            let packed: u64 = run.iter().map(|&b| PACKED_CLASS[b as usize]).sum();
            for (k, count) in n.ascii.iter_mut().enumerate() {
                *count += ((packed >> (16 * k)) & 0xFFFF) as usize;
            }
        }
        if !text.is_ascii() {
            text.chars()
                .filter(|c| !c.is_ascii())
                .for_each(|c| n.count_non_ascii(c));
        }
        for line in text.lines() {
            let t = line.trim();
            if t.is_empty() {
                continue;
            }
            n.lines += 1;
            let op = t.as_bytes().windows(2).any(|w| {
                w[1].is_ascii()
                    && ASCII_CLASS[w[1] as usize] & ENDS_OPERATOR != 0
                    && operator(w[0], w[1])
            });
            let ends = t.ends_with([';', '{', '}', ')', ':', ',']);
            if op || ends || KEYWORDS.iter().any(|k| t.starts_with(k)) {
                n.code_lines += 1;
            }
        }
        n
    }

    fn count_non_ascii(&mut self, c: char) {
        if c.is_whitespace() {
            return;
        }
        self.visible += 1;
        if is_cjk(c) {
            self.cjk += 1;
        } else if ('\u{C0}'..='\u{24F}').contains(&c) {
            self.latin += 1;
        } else if c.is_alphabetic() {
            self.other += 1;
        }
    }
}

/// The category of a prompt given as UTF-8 bytes (invalid sequences tolerated).
pub fn classify(bytes: &[u8]) -> &'static str {
    let n = Counts::of(&sample(bytes));
    let letters = n.cjk + n.latin() + n.other;
    if letters == 0 {
        return "prose";
    }
    let cjk_share = n.cjk as f64 / letters as f64;
    let other_share = n.other as f64 / letters as f64;
    if cjk_share >= 0.6 {
        return "cjk";
    }
    if cjk_share >= 0.1 || other_share >= 0.3 {
        return "mixed";
    }
    let line_share = n.code_lines as f64 / n.lines.max(1) as f64;
    let punct_share = n.punct() as f64 / n.visible().max(1) as f64;
    if (line_share >= 0.4 && punct_share >= 0.05) || (line_share >= 0.2 && punct_share >= 0.12) {
        "code"
    } else if line_share >= 0.2 && punct_share >= 0.025 {
        "mixed"
    } else {
        "prose"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_and_code() {
        assert_eq!(classify(b""), "prose");
        assert_eq!(classify(b"12345 !!! ..."), "prose");
        assert_eq!(
            classify(
                "The quick brown fox jumps over the lazy dog. It was not amused, and said so."
                    .as_bytes()
            ),
            "prose"
        );
        assert_eq!(
            classify("今日は良い天気ですね。明日も晴れるでしょう。".as_bytes()),
            "cjk"
        );
        assert_eq!(
            classify(
                "请把这段 English text 翻译成中文, please keep the formatting and names."
                    .as_bytes()
            ),
            "mixed"
        );
        assert_eq!(
            classify("Привет, как дела? Всё хорошо, спасибо.".as_bytes()),
            "mixed"
        );
        let code = b"fn main() {\n    let x = vec![1, 2, 3];\n    for i in &x {\n        println!(\"{}\", i);\n    }\n}\n";
        assert_eq!(classify(code), "code");
    }

    #[test]
    fn ascii_table_agrees_with_the_char_predicates() {
        for b in 0u8..128 {
            let c = b as char;
            let class = if c.is_whitespace() {
                WHITESPACE
            } else if c.is_alphabetic() {
                LETTER
            } else if is_code_punct(c) {
                PUNCT
            } else {
                OTHER
            };
            assert_eq!(ASCII_CLASS[b as usize] & CLASS, class, "byte {b}");
        }
        assert_eq!(classify("x\u{0B}y".as_bytes()), classify(b"x y"));
    }

    #[test]
    fn huge_input_reads_a_bounded_sample() {
        let mut big = "def f(x):\n    return x == 1\n"
            .repeat(100_000)
            .into_bytes();
        big.extend(std::iter::repeat_n(b'a', 10));
        assert_eq!(sample(&big).len(), SAMPLE_BYTES + 1);
        assert_eq!(classify(&big), "code");
    }
}
