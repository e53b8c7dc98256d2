//! Elementwise activations and softmax.
//!
//! `swiglu` is kept scalar on purpose: `matmul::matmul_swiglu` must give the same bits, and
//! both use [`silu`] (`g / (1 + exp(-g))` in f32 with the platform's `f32::exp`). It is not a
//! hot path: the fused matmul is.

use rayon::prelude::*;

const PAR_MIN: usize = 1 << 14;

/// `silu(g) = g / (1 + exp(-g))` in f32, exactly this formula (shared with the fused matmul).
#[inline]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// `out = silu(gate) * up`, `silu(g) = g / (1 + exp(-g))`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "swiglu: gate has {} values, up {}, out {}",
        gate.len(),
        up.len(),
        out.len()
    );
    out.par_chunks_mut(PAR_MIN).zip(gate.par_chunks(PAR_MIN)).zip(up.par_chunks(PAR_MIN)).for_each(|((o, g), u)| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = silu(g) * u;
        }
    });
}

/// In-place softmax of each row of `cols` values (max-subtracted). Exponentials in f32,
/// their sum in f64, each output `e / sum` rounded once. A row of all `-inf` becomes NaN
/// (there is no distribution to return).
pub fn softmax_rows(x: &mut [f32], cols: usize) {
    if x.is_empty() {
        return;
    }
    assert!(cols > 0 && x.len().is_multiple_of(cols), "softmax_rows: {} values are not whole rows of {cols}", x.len());
    let min_rows = (PAR_MIN / cols).max(1);
    x.par_chunks_mut(cols).with_min_len(min_rows).for_each(|row| {
        let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sum = 0.0f64;
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v as f64;
        }
        for v in row.iter_mut() {
            *v = (*v as f64 / sum) as f32;
        }
    });
}

/// Plain f64 references for the tests.
pub mod reference {
    pub fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f64> {
        gate.iter().zip(up).map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64).collect()
    }

    pub fn softmax_rows(x: &[f32], cols: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks(cols) {
            let mx = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let e: Vec<f64> = row.iter().map(|&v| (v as f64 - mx).exp()).collect();
            let s: f64 = e.iter().sum();
            out.extend(e.iter().map(|v| v / s));
        }
        out
    }
}
