//! Rotary position embedding, both pairings, with llama3 frequency scaling.
//!
//! - `HalfSplit` (HF `rotate_half`, GGML "NeoX"): dim `i` pairs with `i + rot_dim/2`.
//! - `Adjacent` (GGML "normal", llama2.c, GGUF llama q/k): dim `2i` pairs with `2i+1`.
//!
//! Both rotate pair `i` by angle `pos * inv_freq[i]`; only the first `rot_dim` dims of each
//! head rotate (partial rotary), the rest pass through. Frequencies and angles are computed
//! in f64 and the tables stored in f32 (transformers computes the angles in f32, so at long
//! positions its tables are the less accurate ones). The rotation itself is
//! `(x0 cos - x1 sin, x0 sin + x1 cos)` in f32, unfused, so every ISA gives the same bits.

use rayon::prelude::*;

pub use tboost_ops::rope::inv_freq;
use tboost_ops::Unsupported;
pub use tboost_ops::{Llama3Scaling, RopeScaling, RopeStyle};

/// RoPE rotates pairs: `rot_dim` must be even and at most `head_dim`.
pub fn supports(head_dim: usize, rot_dim: usize) -> Result<(), Unsupported> {
    if rot_dim == 0 || !rot_dim.is_multiple_of(2) || rot_dim > head_dim {
        return Err(Unsupported::new("rope_dim", rot_dim, format!("even and in 2..={head_dim} (head_dim)")));
    }
    Ok(())
}

/// cos/sin tables `[positions.len(), inv_freq.len()]` (angles computed in f64, stored f32).
pub fn cos_sin(positions: &[u32], inv_freq: &[f64]) -> (Vec<f32>, Vec<f32>) {
    let n = positions.len() * inv_freq.len();
    let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for &p in positions {
        for &f in inv_freq {
            let (s, c) = (p as f64 * f).sin_cos();
            cos.push(c as f32);
            sin.push(s as f32);
        }
    }
    (cos, sin)
}

/// [`cos_sin`] into caller buffers (`[positions.len(), inv_freq.len()]` each).
///
/// # Panics
/// When `cos` or `sin` do not have that size.
pub fn cos_sin_into(positions: &[u32], inv_freq: &[f64], cos: &mut [f32], sin: &mut [f32]) {
    let n = positions.len() * inv_freq.len();
    assert!(cos.len() == n && sin.len() == n, "rope tables: {} and {} values, expected {n}", cos.len(), sin.len());
    if inv_freq.is_empty() {
        return;
    }
    let rows = cos.chunks_exact_mut(inv_freq.len()).zip(sin.chunks_exact_mut(inv_freq.len()));
    for ((c, s), &p) in rows.zip(positions) {
        for ((c, s), &f) in c.iter_mut().zip(s.iter_mut()).zip(inv_freq) {
            let (sv, cv) = (p as f64 * f).sin_cos();
            *c = cv as f32;
            *s = sv as f32;
        }
    }
}

/// [`cos_sin_into`] with both tables multiplied by `factor` (YaRN's and LongRoPE's attention
/// factor; 1 leaves the values as they are).
pub fn cos_sin_scaled_into(positions: &[u32], inv_freq: &[f64], factor: f64, cos: &mut [f32], sin: &mut [f32]) {
    if factor == 1.0 {
        return cos_sin_into(positions, inv_freq, cos, sin);
    }
    let n = positions.len() * inv_freq.len();
    assert!(cos.len() == n && sin.len() == n, "rope tables: {} and {} values, expected {n}", cos.len(), sin.len());
    if inv_freq.is_empty() {
        return;
    }
    let rows = cos.chunks_exact_mut(inv_freq.len()).zip(sin.chunks_exact_mut(inv_freq.len()));
    for ((c, s), &p) in rows.zip(positions) {
        for ((c, s), &f) in c.iter_mut().zip(s.iter_mut()).zip(inv_freq) {
            let (sv, cv) = (p as f64 * f).sin_cos();
            *c = (cv * factor) as f32;
            *s = (sv * factor) as f32;
        }
    }
}

/// Rotates `x` (`[rows, heads, head_dim]`, row `r` at the position whose tables are row `r`
/// of `cos`/`sin`) in place. Only the first `2 * cos-row-len` dims of each head rotate.
pub fn apply(x: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32], style: RopeStyle) {
    let row = heads * head_dim;
    assert!(row > 0, "rope: heads ({heads}) and head_dim ({head_dim}) must be > 0");
    assert!(x.len().is_multiple_of(row), "rope: {} values are not whole rows of {heads} heads x {head_dim}", x.len());
    let rows = x.len() / row;
    assert_eq!(cos.len(), sin.len(), "rope: cos table has {} values, sin {}", cos.len(), sin.len());
    if rows == 0 {
        return;
    }
    assert!(cos.len().is_multiple_of(rows), "rope: {} table values are not whole rows for {rows} rows", cos.len());
    let half = cos.len() / rows;
    assert!(2 * half <= head_dim, "rope: tables rotate {} dims, more than head_dim {head_dim}", 2 * half);
    if half == 0 {
        return;
    }
    let min_rows = ((1 << 14) / row).max(1);
    x.par_chunks_mut(row).zip(cos.par_chunks(half)).zip(sin.par_chunks(half)).with_min_len(min_rows).for_each(
        |((xr, c), s)| {
            for h in xr.chunks_exact_mut(head_dim) {
                rotate(h, &c[..half], &s[..half], style);
            }
        },
    );
}

#[inline]
fn rotate(h: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    let half = cos.len();
    match style {
        RopeStyle::HalfSplit => {
            let (a, b) = h[..2 * half].split_at_mut(half);
            for i in 0..half {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * cos[i] - x1 * sin[i];
                b[i] = x0 * sin[i] + x1 * cos[i];
            }
        }
        RopeStyle::Adjacent => {
            for (i, pair) in h[..2 * half].chunks_exact_mut(2).enumerate() {
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0 * cos[i] - x1 * sin[i];
                pair[1] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

/// Plain f64 references for the tests.
pub mod reference {
    use super::RopeStyle;

    /// Rotates one head of `head_dim` values at `pos` with `inv_freq` (f64 throughout).
    pub fn rotate(x: &[f32], pos: u32, inv_freq: &[f64], style: RopeStyle) -> Vec<f64> {
        let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let half = inv_freq.len();
        for (i, &f) in inv_freq.iter().enumerate() {
            let (s, c) = (pos as f64 * f).sin_cos();
            let (i0, i1) = match style {
                RopeStyle::HalfSplit => (i, i + half),
                RopeStyle::Adjacent => (2 * i, 2 * i + 1),
            };
            let (x0, x1) = (y[i0], y[i1]);
            y[i0] = x0 * c - x1 * s;
            y[i1] = x0 * s + x1 * c;
        }
        y
    }
}
