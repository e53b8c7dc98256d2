//! What tboost's tests and tools share, so that no test carries its own copy:
//!
//! - `golden`: where `../shared` lives, the golden cases and their comparison rules;
//! - `synthetic`: random-weight models of named shapes, built in memory (benchmarks, tests);
//! - `gguf_write`: the GGUF writer (synthetic models, hand-built files, edited real files);
//! - `model_files`: broken and odd model files for the reliability tests and the fuzzers;
//! - `tokenizer_data`: the tokenizer suites' shared files.
//!
//! The CLI's `synth` and `bench --synthetic` use `synthetic` and `gguf_write` too; the engine
//! library itself never depends on this crate.
#![allow(clippy::missing_panics_doc)]

pub mod backends;
pub mod gguf_write;
pub mod golden;
pub mod llama_vocab;
pub mod model_files;
pub mod synthetic;
pub mod tokenizer_data;
