//! tboost: an embeddable LLM inference engine (the orchestrator).
//!
//! The operator provider is the `tboost-kernels` crate; this crate decides which operator
//! runs where (`plan`), loads models (`model`), runs them on a `backend`, manages the paged
//! KV cache (`kv`), schedules requests (`sched`), samples (`sample`) and exposes a C ABI
//! (`ffi`). See README.md for the architecture picture.

pub mod backend;
pub mod cli;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod kv;
pub mod model;
pub mod op_api;
pub mod plan;
pub mod runner;
pub mod session;

pub use error::{Error, Result};
pub mod sample;
pub mod sched;
pub mod tokenizer;
