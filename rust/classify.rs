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

fn is_code_punct(c: char) -> bool {
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

/// Whether two adjacent characters form a code operator (`==`, `!=`, `=>`,
/// `->`, `::`, `&&`, `||`).
fn operator(prev: char, c: char) -> bool {
    matches!(
        (prev, c),
        ('=', '=') | ('!', '=') | ('=', '>') | ('-', '>') | (':', ':') | ('&', '&') | ('|', '|')
    )
}

/// The sample of `bytes` that is classified: all of it up to SAMPLE_BYTES,
/// else the head and tail halves; decoded lossily, borrowed when valid UTF-8.
fn sample(bytes: &[u8]) -> Cow<'_, str> {
    if bytes.len() <= SAMPLE_BYTES {
        return String::from_utf8_lossy(bytes);
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
    cjk: usize,
    latin: usize,
    other: usize,
    punct: usize,
    visible: usize,
    lines: usize,
    code_lines: usize,
}

impl Counts {
    fn of(text: &str) -> Self {
        let mut n = Self::default();
        for line in text.lines() {
            let t = line.trim();
            if t.is_empty() {
                continue;
            }
            n.lines += 1;
            let (mut op, mut prev) = (false, ' ');
            for c in t.chars() {
                op |= operator(prev, c);
                prev = c;
                n.count(c);
            }
            let ends = t.ends_with([';', '{', '}', ')', ':', ',']);
            if op || ends || KEYWORDS.iter().any(|k| t.starts_with(k)) {
                n.code_lines += 1;
            }
        }
        n
    }

    fn count(&mut self, c: char) {
        if c.is_ascii() {
            if c.is_ascii_whitespace() {
                return;
            }
            self.visible += 1;
            if c.is_ascii_alphabetic() {
                self.latin += 1;
            } else if is_code_punct(c) {
                self.punct += 1;
            }
            return;
        }
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
    let letters = n.cjk + n.latin + n.other;
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
    let punct_share = n.punct as f64 / n.visible.max(1) as f64;
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
    fn huge_input_reads_a_bounded_sample() {
        let mut big = "def f(x):\n    return x == 1\n"
            .repeat(100_000)
            .into_bytes();
        big.extend(std::iter::repeat_n(b'a', 10));
        assert_eq!(sample(&big).len(), SAMPLE_BYTES + 1);
        assert_eq!(classify(&big), "code");
    }
}
