//! RMSNorm, and RMSNorm with the residual add fused in.
//!
//! `rmsnorm(x) = w * x / sqrt(mean(x²) + eps)` per row of `dim` values (no +1 offset).
//! The sum of squares is accumulated in f64-free fixed order, identical between `rmsnorm`
//! and `add_rmsnorm`, so the fusion never changes results.

use crate::WeightVec;

/// `out[r] = rmsnorm(x[r]) * w` for each row of `w.len` values.
pub fn rmsnorm(x: &[f32], w: WeightVec<'_>, eps: f32, out: &mut [f32]) {
    let _ = (x, w, eps, out);
    unimplemented!()
}

/// `residual += x; out = rmsnorm(residual) * w` row by row: one pass instead of two.
pub fn add_rmsnorm(residual: &mut [f32], x: &[f32], w: WeightVec<'_>, eps: f32, out: &mut [f32]) {
    let _ = (residual, x, w, eps, out);
    unimplemented!()
}

/// `dst += src` elementwise (the unfused residual add).
pub fn add(dst: &mut [f32], src: &[f32]) {
    let _ = (dst, src);
    unimplemented!()
}
