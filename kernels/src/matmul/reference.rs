//! Plain scalar references for the tests: float64 accumulation, no tiling, no threads.

use crate::{DType, WeightMat, WeightVec};

/// Element `(r, c)` of a dense weight matrix, widened to f32.
///
/// # Panics
/// For quantized dtypes (the reference covers the dense ones only).
pub fn weight_at(w: &WeightMat<'_>, r: usize, c: usize) -> f32 {
    let row = w.row(r);
    match w.dtype {
        DType::F32 => f32::from_le_bytes(row[4 * c..4 * c + 4].try_into().unwrap()),
        DType::F16 => half::f16::from_le_bytes([row[2 * c], row[2 * c + 1]]).to_f32(),
        DType::BF16 => half::bf16::from_le_bytes([row[2 * c], row[2 * c + 1]]).to_f32(),
        other => panic!("matmul reference: {other} is not a dense dtype"),
    }
}

/// `x · wᵀ + bias` accumulated in f64, `[m, w.rows]`.
pub fn matmul(x: &[f32], m: usize, w: &WeightMat<'_>, bias: Option<&WeightVec<'_>>) -> Vec<f64> {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "reference matmul: x is not [m={m}, k={k}]");
    let mut out = vec![0f64; m * n];
    for j in 0..n {
        let wr: Vec<f64> = (0..k).map(|c| weight_at(w, j, c) as f64).collect();
        let b = bias.map_or(0.0, |b| b.get(j) as f64);
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            out[i * n + j] = xr.iter().zip(&wr).map(|(&a, &b)| a as f64 * b).sum::<f64>() + b;
        }
    }
    out
}

/// `silu(x · gateᵀ) * (x · upᵀ)` in f64, `[m, gate.rows]`.
pub fn matmul_swiglu(x: &[f32], m: usize, gate: &WeightMat<'_>, up: &WeightMat<'_>) -> Vec<f64> {
    let g = matmul(x, m, gate, None);
    let u = matmul(x, m, up, None);
    g.iter().zip(&u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect()
}
