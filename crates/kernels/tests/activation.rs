//! SwiGLU and row softmax against f64 references; SwiGLU gives the scalar `silu`'s bits (the
//! fused matmuls' formula) on every vector width.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::activation::{reference, silu, softmax_rows, swiglu, swiglu_serial_with};
use tboost_kernels::isa::{self, Isa};

#[test]
fn swiglu_matches_reference_and_the_scalar_formula_bit_for_bit_on_every_isa() {
    let mut rng = StdRng::seed_from_u64(1);
    let n = 50_000;
    let mut gate: Vec<f32> = (0..n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
    gate.extend([
        0.0,
        -0.0,
        100.0,
        -100.0,
        1e-30,
        -88.0,
        89.0,
        87.5,
        -86.9,
        -88.4,
        -88.7,
        -88.8,
        86.5,
        f32::INFINITY,
        1e-45,
    ]);
    let up: Vec<f32> = (0..gate.len()).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let want = reference::swiglu(&gate, &up);
    let mut out = vec![0.0f32; gate.len()];
    swiglu(&gate, &up, &mut out);
    for i in 0..gate.len() {
        let (g, u) = (gate[i], up[i]);
        assert_eq!(out[i].to_bits(), (silu(g) * u).to_bits(), "g={g} u={u}");
        // exp (about 2 ulp), add, divide, multiply in f32: a few ulps. Past g = -88.72 exp(-g)
        // overflows (as libm's expf does) and silu's |value| < 1e-37 becomes -0.
        if !want[i].is_finite() {
            assert_eq!(out[i] as f64, want[i], "g={g} u={u}");
            continue;
        }
        let err = (out[i] as f64 - want[i]).abs();
        assert!(err <= 1e-6 * want[i].abs() + 1e-37, "g={g} u={u}: {} vs {}", out[i], want[i]);
    }
    // Every vector width gives the scalar bits, at every length (whole vectors and tails).
    let levels = [Isa::Scalar, Isa::Avx2, Isa::Avx512];
    for isa in levels.into_iter().filter(|&l| l <= isa::detected()) {
        for len in [1, 7, 8, 15, 16, 17, 40, gate.len()] {
            let mut o = vec![f32::NAN; len];
            swiglu_serial_with(isa, &gate[..len], &up[..len], &mut o);
            for i in 0..len {
                assert_eq!(o[i].to_bits(), out[i].to_bits(), "{} len {len} at {i}: g={}", isa.name(), gate[i]);
            }
        }
    }
    // NaN in, NaN out; silu(+inf) = +inf.
    let mut o = [0.0f32; 17];
    swiglu_serial_with(isa::detected(), &[f32::NAN; 17], &[1.0; 17], &mut o);
    assert!(o.iter().all(|v| v.is_nan()));
    assert_eq!(silu(f32::INFINITY), f32::INFINITY);
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

/// GeGLU (tanh GELU) against the f64 formula, including large and negative gates.
#[test]
fn geglu_tanh_matches_the_formula() {
    use tboost_kernels::activation::{geglu_tanh, reference};
    let gate: Vec<f32> = (0..5000).map(|i| (i as f32 - 2500.0) * 0.0061).collect();
    let up: Vec<f32> = (0..5000).map(|i| ((i * 7) % 13) as f32 * 0.3 - 1.7).collect();
    let mut out = vec![0.0; gate.len()];
    geglu_tanh(&gate, &up, &mut out);
    let want = reference::geglu_tanh(&gate, &up);
    for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
        assert!((o as f64 - w).abs() <= 2e-6 * w.abs().max(1.0), "{i}: gate {} up {}: {o} vs {w}", gate[i], up[i]);
    }
    // gelu_tanh(0) = 0, gelu_tanh(large) ~ g, gelu_tanh(-large) ~ 0.
    assert_eq!(tboost_kernels::activation::gelu_tanh(0.0), 0.0);
    assert!((tboost_kernels::activation::gelu_tanh(10.0) - 10.0).abs() < 1e-5);
    assert!(tboost_kernels::activation::gelu_tanh(-10.0).abs() < 1e-5);
}
