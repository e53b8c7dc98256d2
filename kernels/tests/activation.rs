//! SwiGLU and row softmax against f64 references; SwiGLU is bit-exact with the scalar
//! formula the fused matmul uses.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::activation::{reference, silu, softmax_rows, swiglu};

#[test]
fn swiglu_matches_reference_and_the_scalar_formula_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(1);
    let n = 50_000;
    let mut gate: Vec<f32> = (0..n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
    gate.extend([0.0, -0.0, 100.0, -100.0, 1e-30, -88.0, 89.0]);
    let up: Vec<f32> = (0..gate.len()).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let mut out = vec![0.0f32; gate.len()];
    swiglu(&gate, &up, &mut out);
    let want = reference::swiglu(&gate, &up);
    for i in 0..gate.len() {
        let (g, u) = (gate[i], up[i]);
        assert_eq!(out[i].to_bits(), (g / (1.0 + (-g).exp()) * u).to_bits(), "g={g} u={u}");
        assert_eq!(silu(g).to_bits(), (g / (1.0 + (-g).exp())).to_bits());
        // exp, add, divide, multiply in f32: a few ulps.
        let err = (out[i] as f64 - want[i]).abs();
        assert!(err <= 1e-6 * want[i].abs() + 1e-38, "g={g} u={u}: {} vs {}", out[i], want[i]);
    }
}

#[test]
fn softmax_rows_match_reference_and_handle_masked_entries() {
    let mut rng = StdRng::seed_from_u64(2);
    for cols in [1, 5, 64, 1000, 32_000] {
        let rows = 3;
        let mut x: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-30.0f32..30.0)).collect();
        if cols > 1 {
            x[1] = f32::NEG_INFINITY;
        }
        let want = reference::softmax_rows(&x, cols);
        softmax_rows(&mut x, cols);
        for (r, row) in x.chunks(cols).enumerate() {
            let sum: f64 = row.iter().map(|&v| v as f64).sum();
            assert!((sum - 1.0).abs() < 1e-5, "cols={cols} row {r}: sums to {sum}");
        }
        // Relative error grows with |x - max| (the f32 subtraction before exp rounds), so tiny
        // probabilities get an absolute floor of 1e-9.
        for (i, (&g, &w)) in x.iter().zip(&want).enumerate() {
            assert!((g as f64 - w).abs() <= 2e-6 * w + 1e-9, "cols={cols} [{i}]: {g} vs {w}");
        }
        if cols > 1 {
            assert_eq!(x[1], 0.0, "a -inf logit gets probability 0");
        }
    }
}

#[test]
#[should_panic(expected = "softmax_rows: 10 values are not whole rows of 3")]
fn softmax_rows_rejects_partial_rows() {
    softmax_rows(&mut [0.0; 10], 3);
}
