//! Shared helpers for the tokenizer tests: locating test data (read in place, never copied).

#![allow(dead_code)]

use std::path::PathBuf;

use tboost_engine::formats::gguf::{read_metadata, Metadata};
use tboost_engine::tokenizer::Tokenizer;

// One place knows where the shared data and the demo model live (`TBOOST_SHARED`,
// `TBOOST_DEMO_MODEL`, the cache): `golden`.
use crate::golden as base;

/// A file under the shared test data directory (`../shared`, or `TBOOST_SHARED`).
pub fn shared_file(rel: &str) -> PathBuf {
    let p = base::shared_dir().join(rel);
    assert!(p.exists(), "test data {} not found: it ships in the shared/ directory beside the repository", p.display());
    p
}

pub fn llama2_tiny_path() -> PathBuf {
    shared_file("models/llama-2-tiny-random.gguf")
}

/// The demo model; fails (does not skip) with the fetch command when it is missing.
pub fn demo_model_path() -> PathBuf {
    base::demo_model()
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
