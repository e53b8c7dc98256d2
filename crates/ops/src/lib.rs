//! tboost-ops: the op vocabulary, owned by the orchestrator.
//!
//! The orchestrator (`tboost`) decides which operator runs where; backends and kernel
//! crates implement operators. Both sides need the same words for what an operator is asked
//! to do: element types ([`DType`]), the *case* a capability check is asked about
//! ([`AttentionCase`], [`MatMulCase`], ...), the op parameters that define the math
//! ([`AttnParams`], [`RopeParams`]), the tunables of their work split ([`MatMulTiling`],
//! [`MoeTiling`]) and the structured answer of a check ([`Unsupported`]).
//! They live here, in a crate with no kernels in it, so that a device backend depends on
//! the vocabulary and never on the CPU kernel crate; kernel crates depend on this crate,
//! never the reverse.

pub mod case;
pub mod dtype;
pub mod rope;
pub mod tiling;

pub use case::{
    check_tile_kv, AttentionCase, AttnParams, AttnPhase, MatMulCase, Precision, Unsupported, DEFAULT_TILE_KV,
    TILE_KV_CHOICES,
};
pub use dtype::DType;
pub use rope::{Llama3Scaling, RopeParams, RopeScaling, RopeStyle, YarnScaling};
pub use tiling::{
    check_matmul_tiling, check_moe_tiling, default_only, MatMulTiling, MoeTiling, Tiling, Tunable,
    DEFAULT_DECODE_TASKS_PER_THREAD, DEFAULT_DECODE_TASK_MIN_BYTES, DEFAULT_TASKS_PER_THREAD,
};
