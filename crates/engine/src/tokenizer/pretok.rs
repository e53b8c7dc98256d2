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

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Mutex, OnceLock};

use crate::{Error, Result};

/// The pre-tokenizer patterns, named after llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `tokenizer.ggml.pre = "default"` (or absent): four regexes applied in sequence:
    /// punctuation runs, the GPT-2 pattern, digit runs, then groups of three ASCII digits.
    Default,
    /// `gpt-2` (also `gpt2`, `mpt`, `phi-2`, `olmo`...): `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`.
    Gpt2,
    /// `llama3` / `llama-bpe` / `llama-v3`: the Llama-3 pattern, digits in groups of up to three.
    Llama3,
    /// `qwen2`: the Llama-3 pattern with single digits.
    Qwen2,
    /// `qwen35`: the Qwen2 pattern with combining marks (`\p{M}`) counted as letters.
    Qwen35,
    /// `starcoder` / `refact` / `command-r` / `smollm`: single digits, then the GPT-2 pattern.
    Starcoder,
    /// `falcon`: punctuation runs (with the backtick), the GPT-2 pattern, ASCII digit triples.
    Falcon,
    /// `deepseek-llm`: newlines, explicit letter and punctuation ranges, trailing spaces, CJK
    /// runs, digit runs.
    DeepseekLlm,
    /// `deepseek-coder`: newlines, letter runs, punctuation runs, CJK runs, single digits.
    DeepseekCoder,
    /// `gemma4`: SentencePiece-style BPE on raw UTF-8; the text is only cut into newline runs
    /// and the stretches between them.
    Gemma4,
}

/// One step of a pre-tokenizer: a hand-written matcher (for patterns with lookaheads, which
/// the `regex` crate lacks) or a plain regex run by the `regex` crate (same leftmost-first
/// semantics as llama.cpp's `std::regex`).
enum Step {
    Hand(Matcher),
    Re(&'static str),
}

impl PreTokenizer {
    /// Maps a `tokenizer.ggml.pre` value; unknown names are an error naming the value.
    pub fn from_gguf_name(name: &str) -> Result<PreTokenizer> {
        Ok(match name {
            "default" => PreTokenizer::Default,
            "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jina-es" | "jina-de" | "jina-v2-es" | "jina-v2-de"
            | "gigachat" | "mellum" | "modern-bert" => PreTokenizer::Gpt2,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => PreTokenizer::Llama3,
            "qwen2" | "deepseek-r1-qwen" => PreTokenizer::Qwen2,
            "qwen35" => PreTokenizer::Qwen35,
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => {
                PreTokenizer::Starcoder
            }
            "falcon" => PreTokenizer::Falcon,
            "deepseek-llm" => PreTokenizer::DeepseekLlm,
            "deepseek-coder" => PreTokenizer::DeepseekCoder,
            "gemma4" => PreTokenizer::Gemma4,
            other => {
                return Err(Error::Unsupported(format!(
                    "tokenizer.ggml.pre = `{other}`: unknown BPE pre-tokenizer (supported: default, \
                     gpt-2/gpt2/mpt/phi-2/olmo, llama3/llama-bpe/llama-v3, qwen2/deepseek-r1-qwen, qwen35, \
                     starcoder/refact/command-r/smollm, falcon, deepseek-llm, deepseek-coder, gemma4)"
                )))
            }
        })
    }

    /// The regexes llama.cpp applies for this pre-tokenizer, in order (used by tests as the
    /// reference the hand-written matchers must agree with).
    pub fn regexes(self) -> &'static [&'static str] {
        match self {
            PreTokenizer::Default => &[PUNCT_RUN_RE, GPT2_RE, r"\p{N}+", ASCII_DIGIT3_RE],
            PreTokenizer::Gpt2 => &[GPT2_RE],
            PreTokenizer::Llama3 => &[LLAMA3_RE],
            PreTokenizer::Qwen2 => &[QWEN2_RE],
            PreTokenizer::Qwen35 => &[QWEN35_RE],
            PreTokenizer::Starcoder => &[r"\p{N}", GPT2_RE],
            PreTokenizer::Falcon => &[FALCON_PUNCT_RE, GPT2_RE, ASCII_DIGIT3_RE],
            PreTokenizer::DeepseekLlm => {
                &[NEWLINE_RE, DEEPSEEK_LLM_LETTERS_RE, DEEPSEEK_LLM_PUNCT_RE, r"\s+$", DEEPSEEK_CJK_RE, r"\p{N}+"]
            }
            PreTokenizer::DeepseekCoder => &[NEWLINE_RE, r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK_RE, r"\p{N}"],
            PreTokenizer::Gemma4 => &[r"[^\n]+|[\n]+"],
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
        for step in self.steps() {
            pieces = match step {
                Step::Hand(m) => apply(&chars, &pieces, *m),
                Step::Re(pattern) => apply_regex(text, &offsets, &pieces, compiled(pattern)),
            };
        }
        pieces.into_iter().map(|r| offsets[r.start]..offsets[r.end]).collect()
    }

    fn steps(self) -> &'static [Step] {
        use Step::{Hand, Re};
        match self {
            PreTokenizer::Default => {
                &[Hand(match_punct_run), Hand(match_gpt2), Hand(match_digit_run), Hand(match_ascii_digit3)]
            }
            PreTokenizer::Gpt2 => &[Hand(match_gpt2)],
            PreTokenizer::Llama3 => &[Hand(match_llama3)],
            PreTokenizer::Qwen2 => &[Hand(match_qwen2)],
            PreTokenizer::Qwen35 => &[Hand(match_qwen35)],
            PreTokenizer::Starcoder => &[Re(r"\p{N}"), Hand(match_gpt2)],
            PreTokenizer::Falcon => &[Re(FALCON_PUNCT_RE), Hand(match_gpt2), Re(ASCII_DIGIT3_RE)],
            PreTokenizer::DeepseekLlm => &[
                Re(NEWLINE_RE),
                Re(DEEPSEEK_LLM_LETTERS_RE),
                Re(DEEPSEEK_LLM_PUNCT_RE),
                Re(r"\s+$"),
                Re(DEEPSEEK_CJK_RE),
                Re(r"\p{N}+"),
            ],
            PreTokenizer::DeepseekCoder => {
                &[Re(NEWLINE_RE), Re(r"\s?\p{L}+"), Re(r"\s?\p{P}+"), Re(DEEPSEEK_CJK_RE), Re(r"\p{N}")]
            }
            PreTokenizer::Gemma4 => &[Re(r"[^\n]+|[\n]+")],
        }
    }
}

/// The compiled form of a constant pattern, built once per process.
fn compiled(pattern: &'static str) -> &'static regex::Regex {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, &'static regex::Regex>>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    // A constant pattern of this file: only a bug fails to compile. Each is leaked once (a
    // handful per process) so pieces can borrow it without holding the lock.
    cache
        .entry(pattern)
        .or_insert_with(|| Box::leak(Box::new(regex::Regex::new(pattern).expect("constant pre-tokenizer regex"))))
}

/// As [`apply`] for a regex: its matches in each piece (whose end is the end of text for `$`)
/// and the gaps between them become the new pieces.
fn apply_regex(text: &str, offsets: &[usize], pieces: &[Range<usize>], re: &regex::Regex) -> Vec<Range<usize>> {
    // Byte offset -> char index (only char boundaries are ever looked up).
    let char_at = |b: usize| offsets.partition_point(|&o| o < b);
    let mut out = Vec::with_capacity(pieces.len() * 2);
    for piece in pieces {
        let (b0, b1) = (offsets[piece.start], offsets[piece.end]);
        let mut gap_start = piece.start;
        for m in re.find_iter(&text[b0..b1]) {
            if m.is_empty() {
                continue;
            }
            let (s, e) = (char_at(b0 + m.start()), char_at(b0 + m.end()));
            if gap_start < s {
                out.push(gap_start..s);
            }
            out.push(s..e);
            gap_start = e;
        }
        if gap_start < piece.end {
            out.push(gap_start..piece.end);
        }
    }
    out
}

pub const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
pub const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub const QWEN35_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const PUNCT_RUN_RE: &str = r"[\p{P}\$\+<=>\^~\|]+";
const FALCON_PUNCT_RE: &str = r"[\p{P}\$\+<=>\^~\|`]+";
const ASCII_DIGIT3_RE: &str = r"[0-9][0-9][0-9]";
const NEWLINE_RE: &str = r"[\r\n]";
/// DeepSeek LLM's letter runs (its tokenizer.json's explicit letter ranges).
pub const DEEPSEEK_LLM_LETTERS_RE: &str = r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+";
/// DeepSeek LLM's ASCII and full-width punctuation runs.
pub const DEEPSEEK_LLM_PUNCT_RE: &str = r"\s?[!-/:-~！-／：-～‘-‟　-。]+";
/// CJK ideograph and Hangul runs (DeepSeek LLM and Coder).
pub const DEEPSEEK_CJK_RE: &str = r"[一-龥ࠀ-一가-퟿]+";

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
    mark: Vec<(char, char)>,
}

fn classes() -> &'static Classes {
    static CLASSES: OnceLock<Classes> = OnceLock::new();
    CLASSES.get_or_init(|| Classes {
        letter: unicode_class(r"\p{L}"),
        number: unicode_class(r"\p{N}"),
        punct: unicode_class(r"\p{P}"),
        mark: unicode_class(r"\p{M}"),
    })
}

pub(crate) fn unicode_class(pattern: &str) -> Vec<(char, char)> {
    use regex_syntax::hir::{Class, HirKind};
    // A constant pattern: only a bug (or a regex-syntax built without Unicode tables) fails here.
    let hir = regex_syntax::Parser::new().parse(pattern).expect("constant Unicode class pattern");
    match hir.kind() {
        HirKind::Class(Class::Unicode(cls)) => cls.ranges().iter().map(|r| (r.start(), r.end())).collect(),
        other => panic!("{pattern} did not parse to a Unicode class: {other:?}"),
    }
}

pub(crate) fn in_ranges(ranges: &[(char, char)], c: char) -> bool {
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

/// `\p{M}`
fn is_mark(c: char) -> bool {
    !c.is_ascii() && in_ranges(&classes().mark, c)
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
    match_llama3_family(s, i, 3, is_letter)
}

fn match_qwen2(s: &[char], i: usize) -> Option<usize> {
    match_llama3_family(s, i, 1, is_letter)
}

/// Qwen 3.5: the Qwen2 pattern with `[\p{L}\p{M}]+` for letter runs and marks taken out of
/// the "other" class. A mark may also be the optional prefix of a letter run; either way the
/// run starts at the mark, so treating it as a letter gives the same match.
fn match_qwen35(s: &[char], i: usize) -> Option<usize> {
    match_llama3_family(s, i, 1, |c| is_letter(c) || is_mark(c))
}

/// `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}|
///  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+` with D = `max_digits` and `\p{L}` = `letter`
/// (the "other" class excludes `letter` too).
fn match_llama3_family(s: &[char], i: usize, max_digits: usize, letter: fn(char) -> bool) -> Option<usize> {
    let is_letter = letter;
    let is_other = |c: char| !is_space(c) && !letter(c) && !is_number(c);
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
