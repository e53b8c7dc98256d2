//! Tokenizers built from small hand-made vocabularies: metadata defaults and errors, the
//! llama3 BOS/ignore-merges rules, and a SentencePiece-style Hugging Face tokenizer.json.

use serde_json::json;
use tboost_engine::formats::gguf::{Metadata, Value};
use tboost_engine::tokenizer::bpe::byte_to_char_table;
use tboost_engine::tokenizer::{ChatTemplate, Decoder, TokenAttr, Tokenizer};

fn strings(v: &[&str]) -> Value {
    Value::Array(v.iter().map(|s| Value::String((*s).to_owned())).collect())
}

/// A byte-level vocabulary: the 256 byte chars, then `extra` tokens, then `<|eot|>`-style specials.
fn gpt2_meta(pre: Option<&str>, extra: &[&str], merges: &[&str], specials: &[&str]) -> Metadata {
    let mut tokens: Vec<String> = byte_to_char_table().iter().map(|c| c.to_string()).collect();
    tokens.extend(extra.iter().map(|s| s.to_string()));
    let mut types = vec![Value::I32(1); tokens.len()];
    for s in specials {
        tokens.push(s.to_string());
        types.push(Value::I32(3));
    }
    let mut m = Metadata::new();
    m.insert("general.name".into(), Value::String("tiny-bpe".into()));
    m.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
    if let Some(p) = pre {
        m.insert("tokenizer.ggml.pre".into(), Value::String(p.into()));
    }
    m.insert("tokenizer.ggml.tokens".into(), Value::Array(tokens.into_iter().map(Value::String).collect()));
    m.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
    m.insert("tokenizer.ggml.merges".into(), strings(merges));
    m
}

fn id(t: &Tokenizer, text: &str) -> u32 {
    t.token_id(text).unwrap_or_else(|| panic!("{text:?} in vocab"))
}

#[test]
fn bpe_merges_by_rank_leftmost_first() {
    // "aaa": both pairs have the same rank; the leftmost merges first → "aa" + "a".
    let m = gpt2_meta(Some("qwen2"), &["aa", "ab", "aab"], &["a a", "a b", "aa b"], &[]);
    let t = Tokenizer::from_gguf(&m).unwrap().unwrap();
    assert_eq!(t.encode("aaa", false).unwrap(), [id(&t, "aa"), id(&t, "a")]);
    // "aab": "a a" (rank 0) beats "a b" (rank 1), then "aa b" applies.
    assert_eq!(t.encode("aab", false).unwrap(), [id(&t, "aab")]);
    assert_eq!(t.decode(&t.encode("aab aaa", false).unwrap()).unwrap(), "aab aaa");
}

#[test]
fn gpt2_defaults_no_bos_and_pre_default() {
    let mut m = gpt2_meta(None, &[], &[], &["<|endoftext|>"]);
    let eot = 256;
    m.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(eot));
    m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(eot));
    let t = Tokenizer::from_gguf(&m).unwrap().unwrap();
    assert!(!t.add_bos());
    assert_eq!(
        t.kind(),
        tboost_engine::tokenizer::TokenizerKind::ByteLevelBpe(tboost_engine::tokenizer::PreTokenizer::Default)
    );
    assert_eq!(t.encode("hi", true).unwrap().len(), 2, "no BOS for gpt2 vocabularies by default");
    assert_eq!(t.eos_ids(), &[eot]);
}

#[test]
fn llama3_adds_bos_and_looks_up_whole_words() {
    // "ab" is a token but no merge builds it: llama3 (ignore_merges) still emits it whole.
    let mut m = gpt2_meta(Some("llama-bpe"), &["ab"], &[], &["<|begin_of_text|>", "<|eot_id|>"]);
    let bos = 257;
    m.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(bos));
    m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(258));
    let t = Tokenizer::from_gguf(&m).unwrap().unwrap();
    assert!(t.add_bos());
    assert_eq!(t.encode("ab", true).unwrap(), [bos, id(&t, "ab")]);
    assert!(t.is_eog(258));
    let qwen = Tokenizer::from_gguf(&{
        let mut m = m.clone();
        m.insert("tokenizer.ggml.pre".into(), Value::String("qwen2".into()));
        m
    })
    .unwrap()
    .unwrap();
    assert_eq!(qwen.encode("ab", false).unwrap(), [id(&qwen, "a"), id(&qwen, "b")], "qwen2 runs merges only");
    // add_bos_token in the file wins over the llama3 default.
    m.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
    assert!(!Tokenizer::from_gguf(&m).unwrap().unwrap().add_bos());
}

#[test]
fn end_of_turn_tokens_are_control_and_end_generation() {
    let mut m = gpt2_meta(Some("qwen2"), &[], &[], &[]);
    // <|im_end|> stored as a normal token: llama.cpp forces it to control and EOG.
    if let Some(Value::Array(toks)) = m.get_mut("tokenizer.ggml.tokens") {
        toks.push(Value::String("<|im_end|>".into()));
    }
    if let Some(Value::Array(types)) = m.get_mut("tokenizer.ggml.token_type") {
        types.push(Value::I32(1));
    }
    m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(0));
    let t = Tokenizer::from_gguf(&m).unwrap().unwrap();
    assert_eq!(t.eos_ids(), &[0, 256]);
    assert_eq!(t.token_attr(256), Some(TokenAttr::Control));
    assert_eq!(t.decode(&[id(&t, "h"), 256]).unwrap(), "h");
    assert_eq!(t.decode_with_special(&[id(&t, "h"), 256]).unwrap(), "h<|im_end|>");
}

#[test]
fn metadata_errors_name_the_key_and_value() {
    let err = |m: &Metadata| Tokenizer::from_gguf(m).unwrap_err().to_string();

    let e = err(&gpt2_meta(Some("martian-v9"), &[], &[], &[]));
    assert!(e.contains("martian-v9") && e.contains("tokenizer.ggml.pre"), "{e}");

    let mut m = gpt2_meta(Some("qwen2"), &[], &[], &[]);
    m.insert("tokenizer.ggml.model".into(), Value::String("t5".into()));
    let e = err(&m);
    assert!(e.contains("t5") && e.contains("tiny-bpe"), "{e}");

    let mut m = gpt2_meta(Some("qwen2"), &[], &[], &[]);
    m.remove("tokenizer.ggml.merges");
    let e = err(&m);
    assert!(e.contains("tokenizer.ggml.merges") && e.contains("missing"), "{e}");

    let mut m = gpt2_meta(Some("qwen2"), &[], &[], &[]);
    m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(999));
    let e = err(&m);
    assert!(e.contains("eos_token_id") && e.contains("999"), "{e}");

    let mut m = gpt2_meta(Some("qwen2"), &[], &[], &[]);
    if let Some(Value::Array(toks)) = m.get_mut("tokenizer.ggml.tokens") {
        toks.push(Value::String("a".into()));
    }
    if let Some(Value::Array(types)) = m.get_mut("tokenizer.ggml.token_type") {
        types.push(Value::I32(1));
    }
    let e = err(&m);
    assert!(e.contains("duplicate") && e.contains("\"a\""), "{e}");

    // SentencePiece adds BOS by default; a one-token vocabulary has no id 1 for it.
    let mut m = Metadata::new();
    m.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
    m.insert("tokenizer.ggml.tokens".into(), strings(&["<unk>"]));
    let e = err(&m);
    assert!(e.contains("add_bos_token") && e.contains("BOS"), "{e}");

    let mut m = gpt2_meta(Some("qwen2"), &[], &[], &[]);
    m.insert("tokenizer.ggml.tokens".into(), Value::String("oops".into()));
    let e = err(&m);
    assert!(e.contains("tokenizer.ggml.tokens") && e.contains("array"), "{e}");
}

#[test]
fn no_tokenizer_in_metadata_is_none() {
    assert!(Tokenizer::from_gguf(&Metadata::new()).unwrap().is_none());
    let mut m = Metadata::new();
    m.insert("tokenizer.ggml.model".into(), Value::String("no_vocab".into()));
    assert!(Tokenizer::from_gguf(&m).unwrap().is_none());
    assert!(ChatTemplate::from_gguf(&m).is_none());
}

/// A SentencePiece-style tokenizer.json (Metaspace normalizer, byte fallback, BOS through the
/// post-processor, decoder stripping the leading space), as Llama/Mistral ship it.
fn spm_hf_dir() -> tempfile::TempDir {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for b in 0..256 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    let words = ["▁", "h", "i", "▁h", "▁hi", "!"];
    for (i, w) in words.iter().enumerate() {
        vocab.insert(w.to_string(), json!(259 + i));
    }
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": ["▁ h", "▁h i"]}
    });
    let config = json!({
        "add_bos_token": true, "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"}]
    });
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tj).unwrap()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec(&config).unwrap()).unwrap();
    tmp
}

#[test]
fn hf_sentencepiece_style_tokenizer() {
    let tmp = spm_hf_dir();
    let dir = tmp.path();
    let t = Tokenizer::from_hf_dir(dir).unwrap().unwrap();
    let (hi, bang) = (id(&t, "▁hi"), id(&t, "!"));
    assert_eq!(t.encode("hi hi!", true).unwrap(), [1, hi, hi, bang]);
    assert_eq!(t.bos_id(), Some(1));
    assert_eq!(t.eos_ids(), &[2]);
    assert_eq!(t.token_attr(3 + 0xF0), Some(TokenAttr::Byte));
    // "é" is not in the vocabulary: byte fallback to <0xC3> <0xA9>.
    let ids = t.encode("hi é", false).unwrap();
    assert_eq!(ids, [hi, id(&t, "▁"), 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(t.decode(&ids).unwrap(), "hi é", "leading space of the first token dropped");
    let mut d = Decoder::at_sequence_start(&t);
    let chunks: Vec<String> = ids.iter().map(|&i| d.push(&t, i).unwrap()).collect();
    assert_eq!(chunks, ["hi", " ", "", "é"]);
    // Continuation streaming keeps the word-marker space.
    let mut d = Decoder::new();
    assert_eq!(d.push(&t, hi).unwrap(), " hi");
    let tmpl = ChatTemplate::from_hf_dir(dir).unwrap().unwrap();
    let msgs = [tboost_engine::tokenizer::Message::new("user", "hey")];
    assert_eq!(tmpl.render(&msgs, false).unwrap(), "<s>[user] hey</s>");
}

#[test]
fn hf_unsupported_decoder_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": {"[UNK]": 0, "a": 1}}
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tj).unwrap()).unwrap();
    let e = Tokenizer::from_hf_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("WordPiece") && e.contains("tokenizer.json"), "{e}");
}

/// Engines share one tokenizer between threads and move decoders into request state.
#[test]
fn tokenizer_and_decoder_are_thread_safe() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
    send_sync::<Decoder>();
    send_sync::<ChatTemplate>();
}
