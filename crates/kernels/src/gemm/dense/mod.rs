//! Dense weights (f32, f16, bf16): the `Exact` kernels that keep the canonical 16-lane order
//! ([`lanes`]), and the `Fast` kernels that round activations to bf16 (dot-product
//! instructions or AMX tiles).
//!
//! - `columns`: where a tile's dot products go (plain outputs, SwiGLU pairs) and the direct
//!   loop nest (decode);
//! - `register_blocked`: the k-blocked loop nest over row-major weights (prefill);
//! - `exact_panels`: weights repacked into k-blocked panels for the `Exact` nest;
//! - `fast_bf16`: the `Fast` precision on row-major weights (AVX512_BF16 dots or AMX);
//! - `bf16_pair_panels`, `amx_pair_panels`: the `Fast` precision on weights packed as
//!   pairs of rows (AVX512_BF16; AMX tiles, also for f16), over `amx_tiles`' tile helpers.

pub mod amx_pair_panels;
#[cfg(target_arch = "x86_64")]
mod amx_tiles;
pub mod bf16_pair_panels;
#[cfg(target_arch = "x86_64")]
mod bf16_round;
pub(super) mod columns;
pub mod exact_panels;
pub(super) mod fast_bf16;
pub(super) mod lanes;
pub(super) mod register_blocked;

use super::{
    check_isa, check_weight, execute, matmul_swiglu_with, matmul_with, plan_items, run_pair_panels, silu,
    swiglu_pair_panels, Item, MatSeg, PairPath,
};
use fast_bf16::FastBf16;
