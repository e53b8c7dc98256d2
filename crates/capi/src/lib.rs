//! The C ABI: `include/tboost.h` is generated from this crate, and only this crate, by cbindgen
//! (pinned version, see `cbindgen.toml`) and checked in; `scripts/test-embedding.sh` fails when
//! it drifts. Everything here is a thin layer over `tboost-engine`: handles, status codes, the
//! panic barrier, and copying values across the boundary.
//!
//! Shape (see README.md, "Embedding", for the host's view):
//! - Opaque handles (`tboost_config`, `tboost_model`, `tboost_engine`) live in per-kind
//!   registries (`handle`): a call looks the handle up and holds its own reference for the
//!   call's duration, so an unknown, freed or wrong-kind handle is an error, never a wild read.
//! - Every exported body runs under one panic barrier (`status::guard`): a panic becomes
//!   `TBOOST_ERR_PANIC`, poisons the engine it happened in, and never unwinds into the host.
//! - Failures return a stable status code; the message goes to a per-thread last error that
//!   `tboost_last_error` copies into a caller buffer.
//! - Inputs are copied before a call returns; outputs go into caller-owned buffers, with
//!   `TBOOST_ERR_BUFFER_TOO_SMALL` and the size needed when they do not fit. Growable structs
//!   start with `struct_size`.
//! - The host owns the loop (enqueue → step → read); the only callbacks are the log sink and
//!   the model-load progress function.

#![allow(non_camel_case_types)]
// Every export's safety contract is the same and is stated once, in the header preamble
// (pointers valid for the sizes given, strings NUL-terminated, handles from this library).
#![allow(clippy::missing_safety_doc)]

// The header lists declarations in this order (cbindgen follows the `mod` order, so each
// sits in its own group that rustfmt does not sort): what every call returns, the shared
// types, then the lifecycle (config → model → engine), the log sink, and last the op API and
// custom graphs. Imports form layers, each importing only from the ones below it:
//   graph → op → guard, handle, util, status
//   engine → model → config → log_bridge → guard, handle, types, util, status
//   tokenizer → log_bridge, guard, handle, types, util, status
//   guard → util → status; handle → status; types → status
mod status;

mod guard;

mod types;

mod config;

mod model;

mod engine;

mod tokenizer;

mod log_bridge;

mod op;

mod graph;

mod handle;
mod util;

pub use config::*;
pub use engine::*;
pub use graph::*;
pub use guard::*;
pub use log_bridge::*;
pub use model::*;
pub use op::*;
pub use status::*;
pub use tokenizer::*;
pub use types::*;

/// Version of the library this header belongs to (the crate version).
pub const TBOOST_VERSION_MAJOR: u32 = 0;
pub const TBOOST_VERSION_MINOR: u32 = 1;
pub const TBOOST_VERSION_PATCH: u32 = 0;
/// ABI version: bumped on any incompatible change to a function signature, a struct's
/// existing fields or a status number (CHANGELOG-ABI.md). The shared library's SONAME is
/// `libtboost.so.<TBOOST_ABI_VERSION>`; `build.rs` holds the same number.
pub const TBOOST_ABI_VERSION: u32 = 1;

/// The ABI version of the loaded library. A host that loads `libtboost.so` at run time
/// compares it with `TBOOST_ABI_VERSION` from the header it was built with.
#[no_mangle]
pub extern "C" fn tboost_abi_version() -> u32 {
    TBOOST_ABI_VERSION
}

/// The library version as "MAJOR.MINOR.PATCH": a static string, never free it.
#[no_mangle]
pub extern "C" fn tboost_version() -> *const std::os::raw::c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

#[cfg(test)]
mod tests;
