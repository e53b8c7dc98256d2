//! llama.cpp's tokenizer suite through `tboost tokenize`: every vocabulary of its
//! `test-tokenizer-0` (vocabulary-only GGUF files, no weights) gives llama.cpp's ids on every
//! string, tokenized as llama.cpp's test does (no BOS/EOS, control tokens as plain text).

use std::process::Command;

use tboost_testkit::llama_vocab::{self, Tally, SUITE};

#[test]
fn tboost_tokenize_matches_llama_cpp_on_every_suite_vocabulary() {
    let mut tallies: Vec<Tally> = Vec::new();
    for name in SUITE {
        let v = llama_vocab::load(name);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tboost"));
        cmd.args(["tokenize", "--json", "--no-special", "--no-parse-special", "--model"]).arg(&v.gguf);
        for (text, _) in &v.cases {
            cmd.arg("--text").arg(text);
        }
        let out = cmd.env("RUST_LOG", "warn").output().expect("run tboost");
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
            tallies.push((name, 0, v.cases.len(), vec![format!("tboost tokenize failed: {err}")]));
            continue;
        }
        let stdout = String::from_utf8(out.stdout).expect("UTF-8 output");
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), v.cases.len(), "{name}: one JSON line per --text");
        let mut bad = Vec::new();
        for ((text, want), line) in v.cases.iter().zip(lines) {
            let got: serde_json::Value = serde_json::from_str(line).expect("JSON line");
            let got: Vec<u32> =
                got["ids"].as_array().expect("ids").iter().map(|x| x.as_u64().unwrap() as u32).collect();
            if &got != want {
                bad.push(format!("{text:?}: got {got:?}, llama.cpp {want:?}"));
            }
        }
        tallies.push((name, v.cases.len() - bad.len(), v.cases.len(), bad));
    }
    llama_vocab::assert_all_match("tboost tokenize", &tallies);
}

#[test]
fn tokenize_needs_no_weights_and_names_a_missing_file() {
    // A vocabulary-only file (no tensor at all) tokenizes; a missing path is an error naming it.
    let v = llama_vocab::load("llama-spm");
    let out = Command::new(env!("CARGO_BIN_EXE_tboost"))
        .args(["tokenize", "--json", "--text", "Hello world", "--model"])
        .arg(&v.gguf)
        .output()
        .expect("run tboost");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    // BOS (1) first: the SentencePiece vocabulary asks for it.
    assert_eq!(got["ids"][0], 1, "{got}");
    let out = Command::new(env!("CARGO_BIN_EXE_tboost"))
        .args(["tokenize", "--text", "x", "--model", "/nonexistent/vocab.gguf"])
        .output()
        .expect("run tboost");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/vocab.gguf"));
}
