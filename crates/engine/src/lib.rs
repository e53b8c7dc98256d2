//! tboost-engine: the orchestrator of an embeddable LLM inference engine.
//!
//! The operator provider is the `tboost-kernels` crate; this crate decides which operator
//! runs where (`plan`), loads models (`model`), runs them on a `backend`, manages the paged
//! KV cache (`kv`), schedules requests (`sched`) and samples (`sample`). The C ABI is the
//! `tboost-capi` crate and the command-line tool `tboost-cli`; both are thin layers over this
//! one. See docs/architecture.md for the picture.

pub mod backend;
pub mod comm;
pub mod engine;
pub mod error;
pub mod formats;
pub mod kv;
pub mod model;
pub mod op_api;
pub mod plan;
pub mod runner;
pub mod session;

pub mod sample;
pub mod sched;
pub mod tokenizer;

pub use error::{Error, Result};
