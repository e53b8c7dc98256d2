//! SentencePiece (GGUF `llama`) tokenizer on the real Llama-2 vocabulary of
//! shared/models/llama-2-tiny-random.gguf, against llama.cpp's outputs.

use tboost_testkit::tokenizer_data as tokenizer_common;

use std::sync::OnceLock;

use proptest::prelude::*;
use tboost_engine::formats::gguf::read_metadata;
use tboost_engine::tokenizer::{Decoder, TokenAttr, Tokenizer, TokenizerKind};
use tokenizer_common::llama2_tiny_path;

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let p = llama2_tiny_path();
        let meta = read_metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        Tokenizer::from_gguf(&meta).expect("tokenizer loads").expect("has a tokenizer")
    })
}

#[test]
fn vocabulary_and_special_ids() {
    let t = tok();
    assert_eq!(t.kind(), TokenizerKind::SentencePiece);
    assert_eq!(t.vocab_size(), 32000);
    assert_eq!(t.bos_id(), Some(1));
    assert_eq!(t.eos_id(), Some(2));
    assert_eq!(t.eos_ids(), &[2]);
    assert_eq!(t.unk_id(), Some(0));
    assert!(t.add_bos(), "no add_bos_token key: SentencePiece defaults to adding BOS");
    assert_eq!(t.token_attr(1), Some(TokenAttr::Control));
    assert_eq!(t.token_attr(13), Some(TokenAttr::Byte));
    assert_eq!(t.token_text(9038), Some("▁Once"));
    assert_eq!(t.token_bytes(9038), Some(&b" Once"[..]));
    assert_eq!(t.token_bytes(13), Some(&b"\n"[..]));
}

/// research/golden-llamacpp.md, section 1: the prompt ids llama.cpp evaluated.
#[test]
fn once_upon_a_time_matches_llama_cpp() {
    assert_eq!(tok().encode("Once upon a time", true).unwrap(), [1, 9038, 2501, 263, 931]);
    assert_eq!(tok().encode("Once upon a time", false).unwrap(), [9038, 2501, 263, 931]);
}

/// research/golden-llamacpp.md, section 1: the 32 generated ids detokenize to the listed text.
#[test]
fn golden_continuation_decodes_to_llama_cpp_text() {
    let generated = [
        17196, 5211, 21440, 25431, 7455, 3285, 29710, 4660, 29509, 31364, 19741, 8021, 29710, 4660, 29509, 31364,
        28253, 12321, 12681, 14340, 1189, 30070, 29182, 9645, 20945, 16138, 2451, 19209, 19982, 8317, 15492, 19741,
    ];
    let want = "ernalrightarrow попуdevelopment Gar(), successo status heutigenโ zesificate successo status heutigenโgele HarttekupsologЕfahrtникиizaçãountaException inwonersleb Ele Werk zes";
    assert_eq!(tok().decode(&generated).unwrap(), want);
    // llama-cli's stdout: the prompt as decoded (BOS first keeps the word-marker space).
    let mut all = vec![1, 9038, 2501, 263, 931];
    all.extend_from_slice(&generated);
    assert_eq!(tok().decode(&all).unwrap(), format!(" Once upon a time{want}"));
    // Streaming the continuation gives the same text.
    let mut d = Decoder::new();
    let mut s = String::new();
    for id in generated {
        s += &d.push(tok(), id).unwrap();
    }
    s += &d.finish();
    assert_eq!(s, want);
}

/// Cases from llama.cpp's test-tokenizer-0 for the Llama SentencePiece vocabulary (no BOS):
/// leading-space handling, whitespace runs, byte fallback for an emoji.
#[test]
fn llama_cpp_tokenizer_cases() {
    let t = tok();
    let cases: &[(&str, &[u32])] = &[
        ("", &[]),
        ("Hello world", &[15043, 3186]),
        (" Hello world", &[29871, 15043, 3186]),
        ("Hello World", &[15043, 2787]),
        (" Hello World!", &[29871, 15043, 2787, 29991]),
        ("Hello, world!", &[15043, 29892, 3186, 29991]),
        ("\n", &[29871, 13]),
        ("\t\n", &[29871, 12, 13]),
        (" this is 🦙.cpp", &[29871, 445, 338, 29871, 243, 162, 169, 156, 29889, 8223]),
    ];
    for (text, want) in cases {
        assert_eq!(&t.encode(text, false).unwrap(), want, "text {text:?}");
    }
}

#[test]
fn empty_text_with_bos_is_just_bos() {
    assert_eq!(tok().encode("", true).unwrap(), [1]);
}

/// Special tokens in the text are single tokens and SentencePiece restarts the word-marker
/// space after them, as llama.cpp does; with parse_special off they are plain text.
#[test]
fn special_tokens_in_text() {
    let t = tok();
    let ids = t.encode("<s>Hi</s>", false).unwrap();
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(&ids[1..ids.len() - 1], t.encode("Hi", false).unwrap().as_slice());
    let literal = t.encode_with("<s>", false, false).unwrap();
    assert!(!literal.contains(&1), "{literal:?}");
    assert_eq!(t.decode(&literal).unwrap(), "<s>");
    assert_eq!(t.decode_with_special(&ids).unwrap(), "<s> Hi</s>");
}

#[test]
fn out_of_range_id_is_an_error_naming_it() {
    let err = tok().decode(&[5, 32000]).unwrap_err().to_string();
    assert!(err.contains("32000") && err.contains("32000)"), "{err}");
    let err = Decoder::new().push(tok(), 40000).unwrap_err().to_string();
    assert!(err.contains("40000"), "{err}");
}

/// Text strategy: mixes of ASCII, Latin-1, Cyrillic, CJK, emoji, combining marks, control
/// chars, runs of spaces, tabs and newlines.
fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z0-9]{1,6}",
        "[ ]{1,4}",
        "[\t\n\r]{1,3}",
        "[àéîõüßçñÆø]{1,3}",
        "[а-яА-Я]{1,4}",
        "[一-龥]{1,3}",
        "[\u{1F300}-\u{1F64F}\u{1F980}-\u{1F9FF}]{1,2}",
        "[a-z][\u{0300}-\u{036F}]{1,2}",
        "[\u{0000}-\u{001F}\u{007F}-\u{009F}]",
        "[!-/:-@\\[-`{-~]{1,3}",
        // Any char but U+2581 (SentencePiece's own space marker decodes as a space) and
        // U+FFFD (the streaming check looks for replacement characters).
        any::<char>()
            .prop_filter("not ▁ or U+FFFD", |c| !matches!(c, '\u{2581}' | '\u{FFFD}'))
            .prop_map(|c| c.to_string()),
    ];
    proptest::collection::vec(piece, 0..12).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// decode(encode(text)) == text: encode adds one leading space (the SentencePiece word
    /// marker) and decode removes exactly one from the first token, as llama.cpp does. With
    /// BOS first, llama.cpp's decode keeps that space.
    #[test]
    fn round_trip(s in text()) {
        // Control-token texts can be formed by merges and then decode to nothing (as in llama.cpp).
        prop_assume!(!["<s>", "</s>", "<unk>"].iter().any(|c| s.contains(c)));
        let t = tok();
        let ids = t.encode_with(&s, false, false).unwrap();
        prop_assert_eq!(t.decode(&ids).unwrap(), s.clone());
        let with_bos = t.encode_with(&s, true, false).unwrap();
        let want = if s.is_empty() { String::new() } else { format!(" {s}") };
        prop_assert_eq!(t.decode(&with_bos).unwrap(), want);
    }

    /// Streaming from the start of a sequence equals decode(all), and every chunk is complete
    /// UTF-8 (no replacement characters appear for input that was valid text).
    #[test]
    fn streaming_matches_decode(s in text()) {
        let t = tok();
        let ids = t.encode_with(&s, false, false).unwrap();
        let mut d = Decoder::at_sequence_start(t);
        let mut out = String::new();
        for &id in &ids {
            let chunk = d.push(t, id).unwrap();
            prop_assert!(!chunk.contains('\u{FFFD}'), "chunk {:?}", chunk);
            out += &chunk;
        }
        out += &d.finish();
        prop_assert_eq!(out, t.decode(&ids).unwrap());
    }
}
