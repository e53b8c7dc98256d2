//! The hand-written pre-tokenizers against the very regexes llama.cpp uses for the same
//! `tokenizer.ggml.pre` names, run by a backtracking regex engine (`fancy-regex`, which
//! supports the `(?!\S)` lookahead). llama.cpp applies its regexes in sequence, each one
//! re-splitting the pieces of the previous one and keeping unmatched stretches as pieces.

use std::cell::RefCell;
use std::collections::HashMap;

use fancy_regex::Regex;
use proptest::prelude::*;
use tboost_engine::tokenizer::PreTokenizer;

/// Compiles each pattern once per thread (compiling dominates the test time otherwise).
fn compiled(pattern: &'static str) -> Regex {
    thread_local! {
        static CACHE: RefCell<HashMap<&'static str, Regex>> = RefCell::new(HashMap::new());
    }
    CACHE.with(|c| {
        c.borrow_mut().entry(pattern).or_insert_with(|| Regex::new(pattern).expect("llama.cpp regex compiles")).clone()
    })
}

/// The reference: llama.cpp's `unicode_regex_split` semantics over `fancy-regex`.
fn reference_split(pre: PreTokenizer, text: &str) -> Vec<String> {
    let mut pieces = if text.is_empty() { vec![] } else { vec![text.to_owned()] };
    for re in pre.regexes() {
        let re = compiled(re);
        let mut next = Vec::new();
        for p in &pieces {
            let mut last = 0;
            for m in re.find_iter(p) {
                let m = m.expect("regex match");
                if m.start() > last {
                    next.push(p[last..m.start()].to_owned());
                }
                next.push(m.as_str().to_owned());
                last = m.end();
            }
            if last < p.len() {
                next.push(p[last..].to_owned());
            }
        }
        pieces = next;
    }
    pieces
}

fn split(pre: PreTokenizer, text: &str) -> Vec<String> {
    pre.split(text).into_iter().map(|r| text[r].to_owned()).collect()
}

const ALL: [PreTokenizer; 10] = [
    PreTokenizer::Default,
    PreTokenizer::Gpt2,
    PreTokenizer::Llama3,
    PreTokenizer::Qwen2,
    PreTokenizer::Qwen35,
    PreTokenizer::Starcoder,
    PreTokenizer::Falcon,
    PreTokenizer::DeepseekLlm,
    PreTokenizer::DeepseekCoder,
    PreTokenizer::Gemma4,
];

#[test]
fn fixed_cases_agree_with_regex() {
    let cases = [
        "",
        " ",
        "Hello world! The quick brown fox can't jump; don't I'll we've they're DON'T WE'VE.",
        "   three leading, two  inner,     five inner and trailing   ",
        "tab\tseparated\t\tcols\nline two\n\n\nafter three newlines \n x\n",
        "1234567890 3.14159 1,000,000 -42 0x1F 2024-01-01 12345678901234567890",
        "!!!???... --- ***!?!? ;;; (([[{{}}]])) ...!!!",
        "I ❤️ Rust 🦀🚀 emojis 👍🏽 😀😀😀",
        "Café naïve résumé à Zürich, São Paulo; Привет, мир!",
        "昇腾CANN生态 東京は日本の首都です。カタカナ",
        "a\u{A0}b \u{3000}c\u{2028}\r\n\r\n \t x'S 'll '",
        "x=$1+2<3>4^5~6|7 ٣٤ ①②",
    ];
    for pre in ALL {
        for text in cases {
            assert_eq!(split(pre, text), reference_split(pre, text), "{pre:?} on {text:?}");
        }
    }
}

fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z]{1,4}",
        "[0-9]{1,5}",
        "[ ]{1,4}",
        "[\t\n\r\u{0B}\u{0C}]{1,3}",
        "'[a-zA-Z]{0,3}",
        "[!-/:-@\\[-`{-~]{1,3}",
        "[àéÆøß]{1,2}",
        "[а-я一-龥ぁ-ん]{1,3}",
        "[\u{1F300}-\u{1F64F}\u{200D}\u{FE0F}]{1,2}",
        "[a-z][\u{0300}-\u{036F}]{1,2}",
        "[\u{0000}-\u{001F}\u{0085}\u{00A0}\u{1680}\u{2000}-\u{200B}\u{2028}\u{202F}\u{3000}]",
        "[٠-٩०-९①-⑨Ⅰ-Ⅻ]{1,3}",
        "[¡-¿‐-‧€-₿]{1,2}",
        any::<char>().prop_map(|c| c.to_string()),
    ];
    proptest::collection::vec(piece, 0..16).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn splitters_agree_with_regex(s in text()) {
        for pre in ALL {
            let got = split(pre, &s);
            prop_assert_eq!(got.concat(), s.clone(), "{:?} pieces must cover the text", pre);
            prop_assert_eq!(got, reference_split(pre, &s), "{:?}", pre);
        }
    }
}
