//! Quantized matmul: every ISA path against `dequantize_row` + an f64 dot product, bit-exact
//! agreement between paths, multi-segment calls with bias, the fused SwiGLU, and batch
//! invariance (a row alone, inside a batch, on 1/2/3-thread pools).
//!
//! Tolerance against f64: every output is a chain of k/16 fused multiply-adds per lane, a
//! 4-level tree and a bias add, so its error is at most (k/16 + 5) * 2^-24 * (sum |x*w| +
//! |bias|) to first order; the weights themselves are exact (the reference dequantizes the
//! same blocks).

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::gemm::quant::{self, dequantize_row, matmul_quant_with, matmul_swiglu_quant_with};
use tboost_kernels::gemm::{MatMulCase, MatSeg};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::{DType, WeightMat, WeightVec};

mod quant_util;
use quant_util::*;

/// f64 reference `x · wᵀ + bias` and the error bound of each output.
fn reference(w: &WeightMat<'_>, bias: Option<&[f32]>, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let k = w.cols;
    let (mut y, mut tol) = (vec![0f64; m * w.rows], vec![0f64; m * w.rows]);
    let mut row = vec![0f32; k];
    for j in 0..w.rows {
        dequantize_row(w.dtype, w.row(j), &mut row).unwrap();
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            let b = bias.map_or(0.0, |b| b[j] as f64);
            let dot: f64 = xi.iter().zip(&row).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = xi.iter().zip(&row).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            y[i * w.rows + j] = dot + b;
            tol[i * w.rows + j] = (k / 16 + 5) as f64 * 2f64.powi(-24) * (mag + b.abs()) * 1.001;
        }
    }
    (y, tol)
}

fn run(isa: Isa, x: &[f32], m: usize, w: WeightMat<'_>, bias: Option<WeightVec<'_>>) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    matmul_quant_with(isa, x, m, &mut [MatSeg { w, bias, out: &mut out }]);
    out
}

#[test]
fn every_isa_matches_f64_reference_and_each_other() {
    let mut rng = StdRng::seed_from_u64(1);
    for dt in QUANT {
        let ks: &[usize] = if dt.block_elems() == 32 { &[32, 96, 896] } else { &[256, 768] };
        for &k in ks {
            for &(m, n) in &[(1, 37), (2, 5), (3, 17), (4, 8), (5, 9), (8, 6), (9, 11), (13, 33), (70, 19)] {
                let wb = random_weights(dt, n, k, &mut rng);
                let w = WeightMat::new(dt, n, k, &wb).unwrap();
                let x = random_x(m, k, &mut rng);
                let bias: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                let (want, tol) = reference(&w, Some(&bias), &x, m);
                let scalar = run(Isa::Scalar, &x, m, w, Some(WeightVec::from_f32(&bias)));
                for isa in isas() {
                    let what = format!("{dt} {} m={m} n={n} k={k}", isa.name());
                    let got = run(isa, &x, m, w, Some(WeightVec::from_f32(&bias)));
                    assert_close(&got, &want, &tol, &what);
                    assert_bits_eq(&got, &scalar, &what);
                }
            }
        }
    }
}

#[test]
fn huge_scales_stay_within_tolerance() {
    // Every block at the largest f16 scale (and min), maximal quants: outputs near 1e9.
    let mut rng = StdRng::seed_from_u64(2);
    for dt in QUANT {
        let (n, k, m) = (9, 512, 6);
        let mut wb = random_weights(dt, n, k, &mut rng);
        for b in wb.chunks_exact_mut(dt.block_bytes()) {
            match dt {
                DType::Q6K => put_f16(b, 208, -65504.0),
                DType::Q4K | DType::Q5K => {
                    put_f16(b, 0, 65504.0);
                    put_f16(b, 2, -65504.0);
                }
                _ => put_f16(b, 0, 65504.0),
            }
        }
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        let x = random_x(m, k, &mut rng);
        let (want, tol) = reference(&w, None, &x, m);
        for isa in isas() {
            let got = run(isa, &x, m, w, None);
            assert!(got.iter().all(|v| v.is_finite()), "{dt} {}: non-finite output", isa.name());
            assert_close(&got, &want, &tol, &format!("{dt} {} huge scales", isa.name()));
        }
    }
}

#[test]
fn multi_segment_with_biases_matches_single_calls() {
    let mut rng = StdRng::seed_from_u64(3);
    let k = 512;
    let specs = [(DType::Q5_0, 37), (DType::Q8_0, 8), (DType::Q6K, 5), (DType::Q4K, 3)];
    let wbs: Vec<Vec<u8>> = specs.iter().map(|&(dt, n)| random_weights(dt, n, k, &mut rng)).collect();
    let ws: Vec<WeightMat<'_>> =
        specs.iter().zip(&wbs).map(|(&(dt, n), b)| WeightMat::new(dt, n, k, b).unwrap()).collect();
    let b0: Vec<f32> = (0..37).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let b1: Vec<u8> = (0..8).flat_map(|i| f16::from_f32(i as f32 * 0.25 - 1.0).to_le_bytes()).collect();
    let b2: Vec<u8> = (0..5).flat_map(|i| bf16::from_f32(3.0 - i as f32).to_le_bytes()).collect();
    let biases = [
        Some(WeightVec::from_f32(&b0)),
        Some(WeightVec::new(DType::F16, 8, &b1).unwrap()),
        Some(WeightVec::new(DType::BF16, 5, &b2).unwrap()),
        None,
    ];
    for m in [1, 9] {
        let x = random_x(m, k, &mut rng);
        for isa in isas() {
            let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; m * w.rows]).collect();
            let mut segs: Vec<MatSeg<'_, '_>> =
                ws.iter().zip(&biases).zip(outs.iter_mut()).map(|((&w, &bias), out)| MatSeg { w, bias, out }).collect();
            matmul_quant_with(isa, &x, m, &mut segs);
            for (s, ((w, bias), out)) in ws.iter().zip(&biases).zip(&outs).enumerate() {
                let what = format!("{} m={m} segment {s} ({})", isa.name(), w.dtype);
                assert_bits_eq(out, &run(isa, &x, m, *w, *bias), &what);
                let bias_f32 = bias.map(|b| b.to_f32());
                let (want, tol) = reference(w, bias_f32.as_deref(), &x, m);
                assert_close(out, &want, &tol, &what);
            }
        }
    }
}

#[test]
fn batch_invariance_across_batches_threads_and_isas() {
    let mut rng = StdRng::seed_from_u64(4);
    // k = 512: tiled tasks take 96 activation rows, so m = 97 is a tiled task plus one row
    // on the direct path.
    let (n, k, m) = (45, 512, 97);
    for dt in QUANT {
        let wb = random_weights(dt, n, k, &mut rng);
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        let x = random_x(m, k, &mut rng);
        let full = in_pool(1, || run(Isa::Scalar, &x, m, w, None));
        for isa in isas() {
            for threads in [1, 2, 3] {
                let what = format!("{dt} {} threads={threads}", isa.name());
                // The whole batch.
                assert_bits_eq(&in_pool(threads, || run(isa, &x, m, w, None)), &full, &what);
                // m=64 (all tiled), and rows alone or in small batches (direct path).
                let m64 = in_pool(threads, || run(isa, &x[..64 * k], 64, w, None));
                assert_bits_eq(&m64, &full[..64 * n], &format!("{what} m=64"));
                for (start, len) in [(0, 1), (37, 1), (96, 1), (5, 3), (10, 4), (20, 7), (30, 13)] {
                    let part = in_pool(threads, || run(isa, &x[start * k..(start + len) * k], len, w, None));
                    assert_bits_eq(&part, &full[start * n..(start + len) * n], &format!("{what} rows {start}+{len}"));
                }
            }
        }
    }
}

/// The kernels' silu (their own exp, the same bits on every vector width).
fn silu(g: f32) -> f32 {
    tboost_kernels::activation::silu(g)
}

#[test]
fn swiglu_equals_two_matmuls_then_silu_mul() {
    let mut rng = StdRng::seed_from_u64(5);
    let (n, k) = (23, 256);
    for (gdt, udt) in [(DType::Q5_0, DType::Q8_0), (DType::Q4K, DType::Q6K), (DType::Q4_0, DType::Q5K)] {
        let (gb, ub) = (random_weights(gdt, n, k, &mut rng), random_weights(udt, n, k, &mut rng));
        let (gate, up) = (WeightMat::new(gdt, n, k, &gb).unwrap(), WeightMat::new(udt, n, k, &ub).unwrap());
        for m in [1, 3, 6, 33] {
            let x = random_x(m, k, &mut rng);
            for isa in isas() {
                let g = run(isa, &x, m, gate, None);
                let u = run(isa, &x, m, up, None);
                let want: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
                for threads in [1, 2, 3] {
                    let mut out = vec![f32::NAN; m * n];
                    in_pool(threads, || matmul_swiglu_quant_with(isa, &x, m, gate, up, &mut out));
                    assert_bits_eq(&out, &want, &format!("{gdt}/{udt} {} m={m} threads={threads}", isa.name()));
                }
            }
        }
    }
}

#[test]
fn empty_shapes_do_nothing() {
    let wb = vec![0u8; 0];
    let w = WeightMat::new(DType::Q8_0, 0, 64, &wb).unwrap();
    let x = vec![1.0f32; 3 * 64];
    for isa in isas() {
        assert!(run(isa, &x, 3, w, None).is_empty());
        let w2b = vec![0u8; 2 * 68];
        let w2 = WeightMat::new(DType::Q8_0, 2, 64, &w2b).unwrap();
        assert!(run(isa, &[], 0, w2, None).is_empty());
    }
}

#[test]
fn supports_names_the_problem() {
    assert!(quant::supports(&MatMulCase::f32(DType::Q6K, 896, 4864)).is_ok());
    let e = quant::supports(&MatMulCase::f32(DType::Q4K, 896, 896)).unwrap_err();
    assert_eq!((e.param.as_ref(), e.value.as_str()), ("cols", "896"), "{e}");
    assert!(e.need.contains("q4_k"), "{e}");
    let e = quant::supports(&MatMulCase::f32(DType::F16, 8, 8)).unwrap_err();
    assert_eq!((e.param.as_ref(), e.value.as_str()), ("weight_dtype", "f16"), "{e}");
}

#[test]
#[should_panic(expected = "matmul_quant: x has 10 values, expected [m=1, k=32]")]
fn wrong_x_length_panics_with_shape() {
    let wb = vec![0u8; 34];
    let w = WeightMat::new(DType::Q8_0, 1, 32, &wb).unwrap();
    run(Isa::Scalar, &[0.0; 10], 1, w, None);
}

#[test]
#[should_panic(expected = "matmul_quant: segment 0: weight_dtype=f32 is not a block-quantized type")]
fn dense_weights_panic_with_dtype() {
    let wb = vec![0u8; 4 * 32];
    let w = WeightMat::new(DType::F32, 1, 32, &wb).unwrap();
    run(Isa::Scalar, &[0.0; 32], 1, w, None);
}

#[test]
#[should_panic(expected = "matmul_quant: segment 1 has 64 columns, expected k=32")]
fn mismatched_segments_panic() {
    let (ab, bb) = (vec![0u8; 34], vec![0u8; 68]);
    let a = WeightMat::new(DType::Q8_0, 1, 32, &ab).unwrap();
    let b = WeightMat::new(DType::Q8_0, 1, 64, &bb).unwrap();
    let (mut oa, mut ob) = (vec![0.0; 1], vec![0.0; 1]);
    let mut segs = [MatSeg { w: a, bias: None, out: &mut oa }, MatSeg { w: b, bias: None, out: &mut ob }];
    matmul_quant_with(Isa::Scalar, &[0.0; 32], 1, &mut segs);
}

#[test]
fn activation_alignment_does_not_change_results() {
    // The tiled kernels read 64-byte aligned activations in place and copy others into aligned
    // scratch: both must give the same bits (the engine's buffers are aligned, Vecs usually not).
    let mut rng = StdRng::seed_from_u64(6);
    let (n, k, m) = (13, 768, 11);
    for dt in [DType::Q4_0, DType::Q4K, DType::Q6K] {
        let wb = random_weights(dt, n, k, &mut rng);
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        let x = random_x(m, k, &mut rng);
        let mut buf = vec![0f32; m * k + 32];
        let at = |a: usize| (0..16).find(|o| (buf.as_ptr() as usize + 4 * o) % 64 == a).unwrap();
        let (aligned, off) = (at(0), at(4));
        buf[aligned..aligned + m * k].copy_from_slice(&x);
        let a = run(isa::active(), &buf[aligned..aligned + m * k], m, w, None);
        buf[off..off + m * k].copy_from_slice(&x);
        let b = run(isa::active(), &buf[off..off + m * k], m, w, None);
        assert_bits_eq(&a, &b, &format!("{dt} aligned vs offset activations"));
        assert_bits_eq(&a, &run(Isa::Scalar, &x, m, w, None), &format!("{dt} vs scalar"));
    }
}
