//! Shared helpers for the tokenizer tests: locating test data (read in place, never copied).

#![allow(dead_code)]

use std::path::PathBuf;

use tboost::model::gguf::{read_metadata, Metadata};
use tboost::tokenizer::Tokenizer;

/// /work/shared when the worktree is /work/wt/<name>; also tries the main checkout layout.
pub fn shared_file(rel: &str) -> PathBuf {
    let candidates = [
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared").join(rel),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared").join(rel),
    ];
    for c in &candidates {
        if c.exists() {
            return c.clone();
        }
    }
    panic!("test data {rel} not found in ../shared or ../../shared (relative to the crate): it ships in the shared/ directory beside the repository")
}

pub fn llama2_tiny_path() -> PathBuf {
    shared_file("models/llama-2-tiny-random.gguf")
}

/// `$TBOOST_DEMO_MODEL`, else `${TBOOST_CACHE:-$HOME/.cache/tboost}/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`.
pub fn demo_model_path() -> PathBuf {
    if let Ok(p) = std::env::var("TBOOST_DEMO_MODEL") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("TBOOST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/tboost"));
    cache.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
}

/// Metadata of the demo model; fails (does not skip) when the file is missing.
pub fn demo_metadata() -> Metadata {
    let p = demo_model_path();
    assert!(
        p.exists(),
        "demo model {} is missing: run scripts/fetch-demo-model.sh (or set TBOOST_DEMO_MODEL)",
        p.display()
    );
    read_metadata(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

pub fn gguf_tokenizer(meta: &Metadata) -> Tokenizer {
    Tokenizer::from_gguf(meta).expect("tokenizer loads").expect("file has a tokenizer")
}

pub fn golden_json() -> serde_json::Value {
    let p = shared_file("models/qwen-demo-golden.json");
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).expect("golden JSON parses")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}
