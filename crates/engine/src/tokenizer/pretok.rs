//! Byte-level BPE pre-tokenizers: the text is cut into words before merges run.
//!
//! llama.cpp picks a list of regexes by `tokenizer.ggml.pre` and applies them one after the
//! other; each regex re-splits every piece produced by the previous one, and the stretches a
//! regex does not match stay pieces of their own ("gaps"). Lookaheads see the end of the
//! *piece* as the end of the text. Here each regex is a hand-written matcher with exactly the
//! leftmost-first (Perl/ECMAScript) semantics of the original pattern; `tests/tokenizer_pretok.rs`
//! checks every matcher against the pattern itself run by `fancy-regex`.
//!
//! Character classes use the Unicode general categories (`\p{L}`, `\p{N}`, `\p{P}`) from
//! `regex-syntax`'s tables and `\s` = the Unicode `White_Space` property, which is what
//! llama.cpp's own category tables give (they may differ only for code points assigned in
//! different Unicode versions).

use std::ops::Range;
use std::sync::OnceLock;

use crate::{Error, Result};

/// The pre-tokenizer patterns, named after llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `tokenizer.ggml.pre = "default"` (or absent): four regexes applied in sequence:
    /// punctuation runs, the GPT-2 pattern, digit runs, then groups of three ASCII digits.
    Default,
    /// `gpt-2` (also accepted as `gpt2`): `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`.
    Gpt2,
    /// `llama3` / `llama-bpe` / `llama-v3`: the Llama-3 pattern, digits in groups of up to three.
    Llama3,
    /// `qwen2`: the Llama-3 pattern with single digits.
    Qwen2,
}

impl PreTokenizer {
    /// Maps a `tokenizer.ggml.pre` value; unknown names are an error naming the value.
    pub fn from_gguf_name(name: &str) -> Result<PreTokenizer> {
        Ok(match name {
            "default" => PreTokenizer::Default,
            "gpt-2" | "gpt2" => PreTokenizer::Gpt2,
            "llama3" | "llama-v3" | "llama-bpe" => PreTokenizer::Llama3,
            "qwen2" | "deepseek-r1-qwen" => PreTokenizer::Qwen2,
            other => {
                return Err(Error::Unsupported(format!(
                    "tokenizer.ggml.pre = `{other}`: unknown BPE pre-tokenizer (supported: default, gpt-2/gpt2, \
                     llama3/llama-bpe/llama-v3, qwen2/deepseek-r1-qwen)"
                )))
            }
        })
    }

    /// The regexes llama.cpp applies for this pre-tokenizer, in order (used by tests as the
    /// reference the hand-written matchers must agree with).
    pub fn regexes(self) -> &'static [&'static str] {
        match self {
            PreTokenizer::Default => &[r"[\p{P}\$\+<=>\^~\|]+", GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"],
            PreTokenizer::Gpt2 => &[GPT2_RE],
            PreTokenizer::Llama3 => &[LLAMA3_RE],
            PreTokenizer::Qwen2 => &[QWEN2_RE],
        }
    }

    /// Whether llama.cpp looks a whole pre-token up in the vocabulary before running merges.
    pub fn ignore_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Splits `text` into pre-tokens, returned as byte ranges of `text` in order, covering
    /// all of it.
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        if text.is_empty() {
            return Vec::new();
        }
        let chars: Vec<char> = text.chars().collect();
        // Byte offset of every char, plus the end, so char ranges map back to byte ranges.
        let mut offsets = Vec::with_capacity(chars.len() + 1);
        offsets.extend(text.char_indices().map(|(i, _)| i));
        offsets.push(text.len());

        let mut pieces: Vec<Range<usize>> = std::iter::once(0..chars.len()).collect();
        for m in self.matchers() {
            pieces = apply(&chars, &pieces, *m);
        }
        pieces.into_iter().map(|r| offsets[r.start]..offsets[r.end]).collect()
    }

    fn matchers(self) -> &'static [Matcher] {
        match self {
            PreTokenizer::Default => &[match_punct_run, match_gpt2, match_digit_run, match_ascii_digit3],
            PreTokenizer::Gpt2 => &[match_gpt2],
            PreTokenizer::Llama3 => &[match_llama3],
            PreTokenizer::Qwen2 => &[match_qwen2],
        }
    }
}

pub const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
pub const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Tries to match at `i` in `s` (one piece); returns the end of the match (always > i).
type Matcher = fn(&[char], usize) -> Option<usize>;

/// Runs one regex over every piece: matches and the gaps between them become the new pieces.
fn apply(chars: &[char], pieces: &[Range<usize>], m: Matcher) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(pieces.len() * 2);
    for piece in pieces {
        let s = &chars[piece.clone()];
        let base = piece.start;
        let (mut pos, mut gap_start) = (0, 0);
        while pos < s.len() {
            match m(s, pos) {
                Some(end) => {
                    if gap_start < pos {
                        out.push(base + gap_start..base + pos);
                    }
                    out.push(base + pos..base + end);
                    pos = end;
                    gap_start = end;
                }
                None => pos += 1,
            }
        }
        if gap_start < s.len() {
            out.push(base + gap_start..base + s.len());
        }
    }
    out
}

// ---- character classes ----

struct Classes {
    letter: Vec<(char, char)>,
    number: Vec<(char, char)>,
    punct: Vec<(char, char)>,
}

fn classes() -> &'static Classes {
    static CLASSES: OnceLock<Classes> = OnceLock::new();
    CLASSES.get_or_init(|| Classes {
        letter: unicode_class(r"\p{L}"),
        number: unicode_class(r"\p{N}"),
        punct: unicode_class(r"\p{P}"),
    })
}

fn unicode_class(pattern: &str) -> Vec<(char, char)> {
    use regex_syntax::hir::{Class, HirKind};
    // A constant pattern: only a bug (or a regex-syntax built without Unicode tables) fails here.
    let hir = regex_syntax::Parser::new().parse(pattern).expect("constant Unicode class pattern");
    match hir.kind() {
        HirKind::Class(Class::Unicode(cls)) => cls.ranges().iter().map(|r| (r.start(), r.end())).collect(),
        other => panic!("{pattern} did not parse to a Unicode class: {other:?}"),
    }
}

fn in_ranges(ranges: &[(char, char)], c: char) -> bool {
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// `\p{L}`
pub fn is_letter(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    in_ranges(&classes().letter, c)
}

/// `\p{N}`
pub fn is_number(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    in_ranges(&classes().number, c)
}

/// `\p{P}`
fn is_punct(c: char) -> bool {
    in_ranges(&classes().punct, c)
}

/// `\s` (Unicode White_Space)
pub fn is_space(c: char) -> bool {
    c.is_whitespace()
}

/// `[^\s\p{L}\p{N}]`
fn is_other(c: char) -> bool {
    !is_space(c) && !is_letter(c) && !is_number(c)
}

fn run(s: &[char], mut i: usize, pred: impl Fn(char) -> bool) -> usize {
    while i < s.len() && pred(s[i]) {
        i += 1;
    }
    i
}

// ---- matchers ----

/// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`
fn match_gpt2(s: &[char], i: usize) -> Option<usize> {
    let c = s[i];
    if c == '\'' {
        if let Some(&c1) = s.get(i + 1) {
            if matches!(c1, 's' | 't' | 'm' | 'd') {
                return Some(i + 2);
            }
            if let Some(&c2) = s.get(i + 2) {
                if matches!((c1, c2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    return Some(i + 3);
                }
            }
        }
    }
    // ` ?X+` for the three classes, in pattern order.
    for pred in [is_letter as fn(char) -> bool, is_number, is_other] {
        if c == ' ' && s.get(i + 1).is_some_and(|&n| pred(n)) {
            return Some(run(s, i + 1, pred));
        }
        if pred(c) {
            return Some(run(s, i, pred));
        }
    }
    ws_not_followed_by_non_ws(s, i)
}

/// `\s+(?!\S)`: the whitespace run, minus its last char when a non-space follows it.
fn ws_not_followed_by_non_ws(s: &[char], i: usize) -> Option<usize> {
    if !is_space(s[i]) {
        return None;
    }
    let j = run(s, i, is_space);
    if j == s.len() {
        Some(j)
    } else if j - i >= 2 {
        Some(j - 1)
    } else {
        None
    }
}

fn match_llama3(s: &[char], i: usize) -> Option<usize> {
    match_llama3_family(s, i, 3)
}

fn match_qwen2(s: &[char], i: usize) -> Option<usize> {
    match_llama3_family(s, i, 1)
}

/// `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}|
///  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+` with D = `max_digits`.
fn match_llama3_family(s: &[char], i: usize, max_digits: usize) -> Option<usize> {
    let c = s[i];
    let is_nl = |c: char| c == '\r' || c == '\n';
    if c == '\'' {
        if let Some(c1) = s.get(i + 1).map(|c| c.to_ascii_lowercase()) {
            if matches!(c1, 's' | 't' | 'm' | 'd') {
                return Some(i + 2);
            }
            if let Some(c2) = s.get(i + 2).map(|c| c.to_ascii_lowercase()) {
                if matches!((c1, c2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    return Some(i + 3);
                }
            }
        }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if is_letter(c) {
        return Some(run(s, i, is_letter));
    }
    if !is_nl(c) && !is_number(c) && s.get(i + 1).is_some_and(|&n| is_letter(n)) {
        return Some(run(s, i + 1, is_letter));
    }
    // \p{N}{1,D}
    if is_number(c) {
        let mut j = i + 1;
        while j < s.len() && j - i < max_digits && is_number(s[j]) {
            j += 1;
        }
        return Some(j);
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let start = if c == ' ' && s.get(i + 1).is_some_and(|&n| is_other(n)) { i + 1 } else { i };
    if is_other(s[start]) {
        let j = run(s, start, is_other);
        return Some(run(s, j, is_nl));
    }
    if !is_space(c) {
        return None;
    }
    let j = run(s, i, is_space);
    // \s*[\r\n]+ : up to and including the last newline of the whitespace run.
    if let Some(k) = (i..j).rev().find(|&k| is_nl(s[k])) {
        return Some(k + 1);
    }
    // \s+(?!\S) then \s+
    Some(ws_not_followed_by_non_ws(s, i).unwrap_or(j))
}

/// `[\p{P}\$\+<=>\^~\|]+`
fn match_punct_run(s: &[char], i: usize) -> Option<usize> {
    let pred = |c: char| matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|') || is_punct(c);
    if pred(s[i]) {
        Some(run(s, i, pred))
    } else {
        None
    }
}

/// `\p{N}+`
fn match_digit_run(s: &[char], i: usize) -> Option<usize> {
    if is_number(s[i]) {
        Some(run(s, i, is_number))
    } else {
        None
    }
}

/// `[0-9][0-9][0-9]`
fn match_ascii_digit3(s: &[char], i: usize) -> Option<usize> {
    if s.len() >= i + 3 && s[i..i + 3].iter().all(|c| c.is_ascii_digit()) {
        Some(i + 3)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(p: PreTokenizer, text: &str) -> Vec<&str> {
        p.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn qwen2_splits_digits_singly_and_keeps_trailing_space_run() {
        assert_eq!(pieces(PreTokenizer::Qwen2, "ab 123  x  "), ["ab", " ", "1", "2", "3", " ", " x", "  "]);
    }

    #[test]
    fn llama3_groups_three_digits_and_newlines() {
        assert_eq!(pieces(PreTokenizer::Llama3, "12345\n\n  y's"), ["123", "45", "\n\n", " ", " y", "'s"]);
    }

    #[test]
    fn gpt2_leaves_unmatched_whitespace_as_gap() {
        // A lone tab before a letter matches no alternative: it stays a piece of its own.
        assert_eq!(pieces(PreTokenizer::Gpt2, "a\tb"), ["a", "\t", "b"]);
    }

    #[test]
    fn default_splits_punctuation_then_digit_triples() {
        assert_eq!(pieces(PreTokenizer::Default, "x=12345!"), ["x", "=", "123", "45", "!"]);
    }

    #[test]
    fn unknown_pre_name_is_an_error_naming_it() {
        let err = PreTokenizer::from_gguf_name("mystery-pre").unwrap_err().to_string();
        assert!(err.contains("mystery-pre"), "{err}");
    }
}
