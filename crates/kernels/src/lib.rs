//! tboost-kernels: the operator provider (the role ops-transformer plays in CANN).
//!
//! Each module owns the math inside one operator and states what it supports through a
//! `supports(&case) -> Result<(), String>` check; the orchestrator (`tboost`) decides which
//! operator runs where. Kernels never know about requests, layers or block allocation: a
//! block table reaches a kernel only as a plain index array describing a memory layout.
//!
//! Every kernel has a plain scalar reference (`reference` submodules) used by its tests.
//! Parallel kernels run on whatever rayon pool is current: the engine calls them inside
//! its own pool's `install`, never the host's global pool.
//!
//! Numerical contract shared by all kernels: the value computed for one output row depends
//! only on that row's inputs, never on how many other rows are in the call or how the work
//! was split across threads. This makes a request's output independent of its batch.

pub mod activation;
pub mod attention;
pub mod convert;
pub mod dtype;
pub mod embed;
pub mod gemm;
pub mod isa;
pub mod membw;
pub mod moe;
pub mod norm;
mod par;

/// A short list kept on the stack (a call's segments, their row counts and dtypes): the
/// steady decode step allocates none for them.
pub type Few<T> = smallvec::SmallVec<[T; 4]>;

/// A call's work items (4 per pool thread, 8 and a shrinking tail in decode), kept on the
/// stack up to 64.
pub(crate) type Items<T> = smallvec::SmallVec<[T; 64]>;
pub mod rope;
pub(crate) mod simd;
pub mod weight;

pub use dtype::DType;
pub use weight::{Layout, WeightMat, WeightVec};
