//! Byte-level BPE (GGUF `gpt2`, pre-tokenizer `qwen2`) on the demo model
//! Qwen2.5-Coder-0.5B-Instruct, against llama.cpp's references in
//! shared/models/qwen-demo-golden.json. Needs the demo model: scripts/fetch-demo-model.sh.

use tboost_testkit::tokenizer_data as tokenizer_common;

use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::json;
use tboost_engine::formats::gguf::Metadata;
use tboost_engine::tokenizer::{ChatTemplate, Decoder, Message, PreTokenizer, TokenAttr, Tokenizer, TokenizerKind};
use tokenizer_common::{demo_metadata, gguf_tokenizer, golden_json, ids};

fn meta() -> &'static Metadata {
    static META: OnceLock<Metadata> = OnceLock::new();
    META.get_or_init(demo_metadata)
}

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| gguf_tokenizer(meta()))
}

fn golden() -> &'static serde_json::Value {
    static G: OnceLock<serde_json::Value> = OnceLock::new();
    G.get_or_init(golden_json)
}

#[test]
fn vocabulary_and_special_ids() {
    let t = tok();
    assert_eq!(t.kind(), TokenizerKind::ByteLevelBpe(PreTokenizer::Qwen2));
    assert_eq!(t.vocab_size(), 151936);
    assert!(!t.add_bos(), "add_bos_token is false in the file");
    assert_eq!(t.bos_id(), Some(151643));
    assert_eq!(t.eos_id(), Some(151645));
    // <|im_end|> (EOS) and <|endoftext|> both end generation.
    assert!(t.is_eog(151645) && t.is_eog(151643), "{:?}", t.eos_ids());
    assert!(!t.is_eog(151644));
    assert_eq!(t.token_text(151644), Some("<|im_start|>"));
    assert_eq!(t.token_attr(151644), Some(TokenAttr::Control));
    assert_eq!(t.token_bytes(220), Some(&b" "[..]));
}

/// Every row of the golden `tokenization` table (llama-tokenize, no BOS).
#[test]
fn golden_tokenization_table() {
    let rows = golden()["tokenization"].as_array().expect("tokenization rows");
    assert_eq!(rows.len(), 16);
    for (i, row) in rows.iter().enumerate() {
        let text = row["text"].as_str().unwrap();
        let parse_special = row["parse_special"].as_bool().unwrap();
        let want = ids(&row["ids"]);
        let got = tok().encode_with(text, true, parse_special).unwrap();
        assert_eq!(got, want, "row {} text {text:?} parse_special {parse_special}", i + 1);
        // Rows without special tokens give the same ids either way.
        if row["same_with_other_parse_special"].as_bool() == Some(true) {
            assert_eq!(tok().encode_with(text, true, !parse_special).unwrap(), want, "row {} flipped", i + 1);
        }
        // And the ids decode back to the text (control tokens rendered when parsed as such).
        let back = if parse_special { tok().decode_with_special(&got) } else { tok().decode(&got) };
        assert_eq!(back.unwrap(), text, "row {} decode", i + 1);
    }
}

/// Prompt ids of the four greedy prompts, and their continuations decode to the listed text.
#[test]
fn golden_prompts_and_continuations() {
    let prompts = golden()["prompts"].as_array().expect("prompts");
    assert_eq!(prompts.len(), 4);
    let md = std::fs::read_to_string(tokenizer_common::shared_file("models/qwen-demo-golden.md")).unwrap();
    for p in prompts {
        let index = p["index"].as_u64().unwrap();
        let text = p["prompt"].as_str().unwrap();
        assert_eq!(tok().encode(text, true).unwrap(), ids(&p["prompt_ids"]), "prompt {index}");
        // The continuation text is listed in the .md (as a JSON string) for each prompt.
        let want = continuation_text(&md, index);
        for key in ["llamacpp_generated_ids", "f64_ids"] {
            let gen = ids(&p[key]);
            assert_eq!(tok().decode(&gen).unwrap(), want, "prompt {index} {key}");
            let mut d = Decoder::new();
            let mut s = String::new();
            for id in gen {
                s += &d.push(tok(), id).unwrap();
            }
            s += &d.finish();
            assert_eq!(s, want, "prompt {index} streamed");
        }
    }
}

/// `- Continuation text (decoded, JSON string): `"..."`` under `## Prompt N`.
fn continuation_text(md: &str, index: u64) -> String {
    let section = md.split(&format!("## Prompt {index}\n")).nth(1).expect("prompt section");
    let line = section.lines().find(|l| l.starts_with("- Continuation text")).expect("continuation line");
    let start = line.find("`\"").expect("opening quote") + 1;
    let end = line.rfind("\"`").expect("closing quote") + 1;
    serde_json::from_str(&line[start..end]).expect("JSON string")
}

/// The model's own chat template renders a system + user conversation exactly as prompt 3.
#[test]
fn chat_template_renders_prompt_3() {
    let t = ChatTemplate::from_gguf(meta()).expect("the demo model has a chat template");
    let msgs = [
        Message::new("system", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
        Message::new("user", "Write a Rust function that reverses a string."),
    ];
    let want = golden()["prompts"][2]["prompt"].as_str().unwrap();
    assert_eq!(t.render(&msgs, true).unwrap(), want);
    // Without a system message Qwen's template inserts the same default one.
    assert_eq!(t.render(&msgs[1..], true).unwrap(), want);
    let no_gen = t.render(&msgs, false).unwrap();
    assert_eq!(format!("{no_gen}<|im_start|>assistant\n"), want);
}

/// A Hugging Face tokenizer.json built from the GGUF vocabulary and merges (Qwen2 split regex,
/// byte-level, special added tokens, no normalizer: the setup the golden notes say reproduces
/// llama.cpp) loads through `from_hf_dir` and gives the same ids and text.
#[test]
fn hf_tokenizer_json_matches_gguf_path() {
    let tmp = hf_dir_from_gguf();
    let dir = tmp.path();
    let hf = Tokenizer::from_hf_dir(dir).unwrap().expect("tokenizer.json present");
    assert_eq!(hf.kind(), TokenizerKind::HuggingFace);
    assert_eq!(hf.vocab_size(), tok().vocab_size());
    assert_eq!(hf.eos_id(), Some(151645));
    assert!(hf.is_eog(151643));
    for row in golden()["tokenization"].as_array().unwrap() {
        let text = row["text"].as_str().unwrap();
        let parse_special = row["parse_special"].as_bool().unwrap();
        let want = ids(&row["ids"]);
        assert_eq!(hf.encode_with(text, false, parse_special).unwrap(), want, "{text:?} parse_special {parse_special}");
    }
    for p in golden()["prompts"].as_array().unwrap() {
        let gen = ids(&p["f64_ids"]);
        assert_eq!(hf.decode(&gen).unwrap(), tok().decode(&gen).unwrap());
    }
    let tmpl = ChatTemplate::from_hf_dir(dir).unwrap().expect("chat_template in tokenizer_config.json");
    let msgs = [
        Message::new("system", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
        Message::new("user", "Write a Rust function that reverses a string."),
    ];
    assert_eq!(tmpl.render(&msgs, true).unwrap(), golden()["prompts"][2]["prompt"].as_str().unwrap());
}

#[test]
fn hf_dir_without_tokenizer_json_is_none() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    assert!(Tokenizer::from_hf_dir(&dir).unwrap().is_none());
    assert!(ChatTemplate::from_hf_dir(&dir).unwrap().is_none());
}

fn hf_dir_from_gguf() -> tempfile::TempDir {
    let m = meta();
    let tokens = m["tokenizer.ggml.tokens"].as_array().unwrap();
    let types = m["tokenizer.ggml.token_type"].as_array().unwrap();
    let merges: Vec<&str> =
        m["tokenizer.ggml.merges"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, (t, ty)) in tokens.iter().zip(types).enumerate() {
        let t = t.as_str().unwrap();
        match ty.as_i64().unwrap() {
            1 => {
                vocab.insert(t.to_owned(), json!(i));
            }
            code => added.push(json!({
                "id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": code == 3
            })),
        }
    }
    let re = PreTokenizer::Qwen2.regexes()[0];
    let tj = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    let config = json!({
        "add_bos_token": false,
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "chat_template": m["tokenizer.chat_template"].as_str().unwrap(),
    });
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tj).unwrap()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec(&config).unwrap()).unwrap();
    std::fs::write(dir.join("generation_config.json"), br#"{"eos_token_id": [151645, 151643]}"#).unwrap();
    tmp
}

/// Unicode text mixes: emoji (with modifiers and ZWJ), CJK, combining marks, control chars,
/// runs of spaces, tabs and newlines, digits, punctuation, apostrophes.
fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z0-9]{1,6}",
        "[ ]{1,5}",
        "[\t\n\r\u{0B}\u{0C}]{1,3}",
        "'(s|t|re|ve|m|ll|d|S|LL)",
        "[àéîõüßçñÆø]{1,3}",
        "[а-яА-Я]{1,4}",
        "[一-龥ぁ-んァ-ン]{1,3}",
        "[\u{1F300}-\u{1F64F}\u{1F980}-\u{1F9FF}][\u{1F3FB}-\u{1F3FF}\u{200D}\u{FE0F}]?",
        "[a-z][\u{0300}-\u{036F}]{1,2}",
        "[\u{0000}-\u{001F}\u{007F}-\u{009F}\u{00A0}\u{2000}-\u{200B}\u{3000}]",
        "[!-/:-@\\[-`{-~]{1,3}",
        "[٠-٩०-९①-⑨]{1,2}",
        any::<char>().prop_filter("not U+FFFD", |c| *c != '\u{FFFD}').prop_map(|c| c.to_string()),
    ];
    proptest::collection::vec(piece, 0..12).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Byte-level BPE is lossless: decode(encode(text)) == text.
    #[test]
    fn round_trip(s in text()) {
        let t = tok();
        let ids = t.encode_with(&s, false, false).unwrap();
        prop_assert_eq!(t.decode(&ids).unwrap(), s.clone());
        // With special-token parsing on, control tokens that appear decode back with special on.
        let ids = t.encode(&s, true).unwrap();
        prop_assert_eq!(t.decode_with_special(&ids).unwrap(), s);
    }

    /// Streamed chunks are complete UTF-8 and concatenate to decode(all), even when tokens
    /// split multi-byte characters (emoji, CJK).
    #[test]
    fn streaming_matches_decode(s in text()) {
        let t = tok();
        let ids = t.encode_with(&s, false, false).unwrap();
        let mut d = Decoder::new();
        let mut out = String::new();
        for &id in &ids {
            let chunk = d.push(t, id).unwrap();
            prop_assert!(!chunk.contains('\u{FFFD}'), "chunk {:?}", chunk);
            out += &chunk;
        }
        prop_assert!(d.pending_bytes().is_empty());
        out += &d.finish();
        prop_assert_eq!(out, t.decode(&ids).unwrap());
    }
}

/// A stream cut in the middle of a character holds the bytes back and flushes U+FFFD at the
/// end, exactly as the one-shot lossy decode.
#[test]
fn streaming_holds_partial_sequences() {
    let t = tok();
    // " 🦀" is split over three byte-level tokens in golden row 9: " \xF0\x9F", "\xA6", "\x80".
    let ids = [11162, 99, 222];
    assert_eq!(t.token_bytes(11162), Some(&b" \xF0\x9F"[..]));
    let mut d = Decoder::new();
    assert_eq!(d.push(t, ids[0]).unwrap(), " ", "the space is complete, the crab's first bytes wait");
    assert_eq!(d.pending_bytes(), b"\xF0\x9F");
    assert_eq!(d.push(t, ids[1]).unwrap(), "");
    assert_eq!(d.push(t, ids[2]).unwrap(), "🦀");
    assert!(d.pending_bytes().is_empty());
    let mut d = Decoder::new();
    assert_eq!(d.push(t, ids[0]).unwrap(), " ");
    assert_eq!(d.finish(), "\u{FFFD}");
    assert_eq!(t.decode(&ids[..1]).unwrap(), " \u{FFFD}");
}

/// Bytes that can never complete a character (a truncated sequence followed by ASCII, a lone
/// continuation byte) come out as U+FFFD right away, matching the one-shot lossy decode.
#[test]
fn streaming_replaces_broken_sequences_like_decode() {
    let t = tok();
    let byte_tok =
        |b: u8| t.token_id(&tboost_engine::tokenizer::bpe::byte_to_char_table()[b as usize].to_string()).unwrap();
    let ids = [11162, byte_tok(b'a'), byte_tok(0x80), byte_tok(0xE4), byte_tok(0xB8), byte_tok(0x80)];
    let mut d = Decoder::new();
    let chunks: Vec<String> = ids.iter().map(|&id| d.push(t, id).unwrap()).collect();
    assert_eq!(chunks, [" ", "\u{FFFD}a", "\u{FFFD}", "", "", "一"]);
    assert_eq!(d.finish(), "");
    assert_eq!(chunks.concat(), t.decode(&ids).unwrap());
}
