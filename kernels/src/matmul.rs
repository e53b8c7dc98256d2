//! MatMul / GEMV: `y = x · Wᵀ (+ bias)` with f32 activations and f32/f16/bf16 weights
//! (quantized weights: see the `quant` work in a later issue).
//!
//! CONTRACT (the helpers implementing this module must keep it):
//! - `x` is `[m, k]` row-major f32, each weight is `[n, k]` row-major (HF layout), each
//!   output is `[m, n]` row-major f32.
//! - Batch invariance: `y[i, j]` is computed with one fixed reduction order over `k` that
//!   does not depend on `m`, on the other rows, on the thread count or on how the work was
//!   split. Threads split over `n` (and `m`), never over `k`. The same holds across ISAs
//!   only within one ISA (scalar and SIMD results may differ in the last bits).
//! - Several weight matrices sharing the same `x` may be computed in one call (`segs`),
//!   each writing its own output: this is the merged QKV projection without copying weights.
//! - `matmul_swiglu` computes `silu(x·Gᵀ) * (x·Uᵀ)` with the same dot products as two
//!   separate `matmul` calls followed by `activation::swiglu` (bit-identical result), but
//!   reads `x` once and never writes the gate/up intermediates.
//! - Runs on the current rayon pool.

use crate::{DType, WeightMat, WeightVec};

/// One weight matrix of a (possibly merged) projection and where its result goes.
pub struct MatSeg<'a, 'o> {
    pub w: WeightMat<'a>,
    pub bias: Option<WeightVec<'a>>,
    /// `[m, w.rows]` row-major.
    pub out: &'o mut [f32],
}

/// Case a caller asks `supports` about.
#[derive(Clone, Copy, Debug)]
pub struct MatMulCase {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

pub fn supports(case: &MatMulCase) -> Result<(), String> {
    match case.dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        other => Err(format!("matmul has no kernel for {other} weights yet")),
    }
}

/// `seg.out = x · seg.wᵀ + seg.bias` for every segment. `x` is `[m, k]`.
pub fn matmul(x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    let _ = (x, m, segs);
    unimplemented!("matmul: being written")
}

/// `out = silu(x · gateᵀ) * (x · upᵀ)`, `out` is `[m, gate.rows]`.
pub fn matmul_swiglu(x: &[f32], m: usize, gate: WeightMat<'_>, up: WeightMat<'_>, out: &mut [f32]) {
    let _ = (x, m, gate, up, out);
    unimplemented!("matmul_swiglu: being written")
}
