//! `Precision::Fast` quantized matmul (8-bit activations, integer dot products), on every
//! kernel level this CPU has: scalar, AVX2 without and with AVX-VNNI, AVX-512 without and
//! with AVX512-VNNI (the faster ones forced off through `_prec_with`).
//!
//! Two references per output, both from `quant::fast_reference`:
//! - the same 8-bit activations and exact integer group dot products, scaled in f64: the
//!   kernels may differ from it only by the rounding of their f32 chain, `(n + 5) 2^-24`
//!   times the summed term magnitudes (`n` terms per chain), plus the bias add;
//! - the f64 dot product of the f32 activations with the `dequantize_row` weights: the above
//!   plus the activation quantization bound `Σ |w| (X_g / 2 + 3.01 2^-24 |x|)` and the
//!   weight rounding Fast skips (derived in `FastReference`'s docs).
//!
//! The Fast arithmetic is the same float operations on the same exact integers on every
//! level, so the levels must also agree bit for bit, and a row's result must not depend on
//! the batch, the thread count or the split.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::gemm::quant::{
    dequantize_row, fast_reference, matmul_quant_prec_with, matmul_swiglu_quant_prec_with, panel_pack, IntDot,
    Precision,
};
use tboost_kernels::gemm::{self, MatSeg};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::{DType, WeightMat, WeightVec};

mod quant_util;
use quant_util::*;

const U: f64 = 1.0 / (1u64 << 24) as f64;

/// Every (level, integer units) this CPU can run: VNNI and AMX-INT8 (packed panels, many
/// rows) forced off in turn.
fn levels() -> Vec<(Isa, IntDot)> {
    let (plain, vnni, amx) =
        (IntDot { vnni: false, amx: false }, IntDot { vnni: true, amx: false }, IntDot { vnni: true, amx: true });
    [
        (Isa::Scalar, plain),
        (Isa::Avx2, plain),
        (Isa::Avx2, vnni),
        (Isa::Avx512, plain),
        (Isa::Avx512, vnni),
        (Isa::Avx512, amx),
    ]
    .into_iter()
    .filter(|&(i, d)| {
        i <= isa::detected() && (!d.vnni || isa::vnni_detected(i)) && (!d.amx || isa::amx_int8_detected())
    })
    .collect()
}

fn name((i, d): (Isa, IntDot)) -> String {
    format!("{}+{}", i.name(), d.name())
}

fn fast(level: (Isa, IntDot), x: &[f32], m: usize, w: WeightMat<'_>, bias: Option<WeightVec<'_>>) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    matmul_quant_prec_with(level.0, level.1, Precision::Fast, x, m, &mut [MatSeg { w, bias, out: &mut out }]);
    out
}

/// Per output: (Fast reference, its tolerance, exact f64 reference, its tolerance).
struct Refs {
    fast: Vec<f64>,
    fast_tol: Vec<f64>,
    exact: Vec<f64>,
    exact_tol: Vec<f64>,
}

fn refs(w: &WeightMat<'_>, bias: Option<&[f32]>, x: &[f32], m: usize) -> Refs {
    let (k, n) = (w.cols, w.rows);
    let mut r = Refs { fast: vec![], fast_tol: vec![], exact: vec![], exact_tol: vec![] };
    let mut wd = vec![0f32; k];
    for i in 0..m {
        let xi = &x[i * k..(i + 1) * k];
        for j in 0..n {
            dequantize_row(w.dtype, w.row(j), &mut wd).unwrap();
            let f = fast_reference(w.dtype, w.row(j), xi).unwrap();
            let b = bias.map_or(0.0, |b| b[j] as f64);
            let exact: f64 = xi.iter().zip(&wd).map(|(&a, &b)| a as f64 * b as f64).sum();
            // The bias add rounds the f32 sum once.
            let bias_add = U * (f.value.abs() + f.rounding + b.abs()) * 1.001;
            r.fast.push(f.value + b);
            r.fast_tol.push(f.rounding + bias_add);
            r.exact.push(exact + b);
            r.exact_tol.push(f.rounding + f.quantization + bias_add);
        }
    }
    r
}

#[test]
fn every_level_matches_both_references_and_the_scalar_bits() {
    println!("levels: {:?}", levels().into_iter().map(name).collect::<Vec<_>>());
    let mut rng = StdRng::seed_from_u64(11);
    for dt in QUANT {
        // 32-value blocks: 1, 3, 17 (odd: a half unit), 28 (896: a short last chunk), 48 groups.
        let ks: &[usize] = if dt.block_elems() == 32 { &[32, 96, 544, 896, 1536] } else { &[256, 768, 4864] };
        for &k in ks {
            for &(m, n) in &[(1, 37), (2, 5), (3, 9), (4, 8), (5, 6), (9, 3)] {
                let wb = random_weights(dt, n, k, &mut rng);
                let w = WeightMat::new(dt, n, k, &wb).unwrap();
                let x = random_x(m, k, &mut rng);
                let bias: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                let r = refs(&w, Some(&bias), &x, m);
                let scalar = fast((Isa::Scalar, false.into()), &x, m, w, Some(WeightVec::from_f32(&bias)));
                for level in levels() {
                    let what = format!("{dt} {} m={m} n={n} k={k}", name(level));
                    let got = fast(level, &x, m, w, Some(WeightVec::from_f32(&bias)));
                    assert_close(&got, &r.fast, &r.fast_tol, &format!("{what} vs Fast reference"));
                    assert_close(&got, &r.exact, &r.exact_tol, &format!("{what} vs exact f64"));
                    assert_bits_eq(&got, &scalar, &what);
                }
            }
        }
    }
}

/// Activation rows that exercise the quantizer: zeros, a group flushed as tiny, one large
/// value among small ones, exact halves of a step, and the largest f32 magnitudes.
fn special_x(k: usize) -> Vec<f32> {
    let mut rows: Vec<Vec<f32>> = vec![vec![0.0; k]];
    rows.push((0..k).map(|e| if e < 32 { 1e-31 } else { (e % 7) as f32 - 3.0 }).collect());
    rows.push((0..k).map(|e| if e % 32 == 5 { 1000.0 } else { 1e-3 * (e % 5) as f32 }).collect());
    // amax 127: every value x * 127/127 lands on an integer or exactly between two.
    rows.push((0..k).map(|e| if e % 32 == 0 { 127.0 } else { (e % 9) as f32 - 4.5 }).collect());
    rows.push((0..k).map(|e| if e % 3 == 0 { f32::MAX } else { -f32::MAX / (e % 11 + 1) as f32 }).collect());
    rows.push((0..k).map(|e| f32::MIN_POSITIVE * (e % 13) as f32).collect());
    rows.concat()
}

#[test]
fn special_activations_and_extreme_scales() {
    let mut rng = StdRng::seed_from_u64(12);
    for dt in QUANT {
        let (n, k) = (7, 512);
        let x = special_x(k);
        let m = x.len() / k;
        let wb = random_weights(dt, n, k, &mut rng);
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        let r = refs(&w, None, &x, m);
        let scalar = fast((Isa::Scalar, false.into()), &x, m, w, None);
        for level in levels() {
            let what = format!("{dt} {} special rows", name(level));
            let got = fast(level, &x, m, w, None);
            assert_bits_eq(&got, &scalar, &what);
            for (idx, ((&g, &f), &t)) in got.iter().zip(&r.fast).zip(&r.fast_tol).enumerate() {
                // Finite references must be met; infinite ones (f32::MAX rows times large scales)
                // are allowed to be non-finite.
                if f.is_finite() && t.is_finite() && f.abs() < f32::MAX as f64 / 2.0 {
                    assert!((g as f64 - f).abs() <= t, "{what}: output {idx} is {g}, reference {f}, tolerance {t}");
                }
            }
        }
    }
}

#[test]
fn non_finite_activations_give_nan() {
    let mut rng = StdRng::seed_from_u64(13);
    let (n, k) = (5, 256);
    for dt in QUANT {
        let wb = random_weights(dt, n, k, &mut rng);
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        let mut x = random_x(3, k, &mut rng);
        x[40] = f32::NAN;
        x[k + 200] = f32::INFINITY;
        for level in levels() {
            let got = fast(level, &x, 3, w, None);
            assert!(got[..2 * n].iter().all(|v| v.is_nan()), "{dt} {}: {:?}", name(level), &got[..2 * n]);
            assert!(got[2 * n..].iter().all(|v| v.is_finite()), "{dt} {}: the clean row", name(level));
        }
    }
}

#[test]
fn batch_invariance_across_batches_threads_and_levels() {
    let mut rng = StdRng::seed_from_u64(14);
    let (n, k, m) = (45, 512, 64);
    for dt in QUANT {
        let wb = random_weights(dt, n, k, &mut rng);
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        let x = random_x(m, k, &mut rng);
        let full = in_pool(1, || fast((Isa::Scalar, false.into()), &x, m, w, None));
        for level in levels() {
            for threads in [1, 2, 3] {
                let what = format!("{dt} {} threads={threads}", name(level));
                assert_bits_eq(&in_pool(threads, || fast(level, &x, m, w, None)), &full, &what);
                for (start, len) in [(0, 1), (37, 1), (63, 1), (5, 3), (10, 4), (20, 17), (30, 13)] {
                    let part = in_pool(threads, || fast(level, &x[start * k..(start + len) * k], len, w, None));
                    assert_bits_eq(&part, &full[start * n..(start + len) * n], &format!("{what} rows {start}+{len}"));
                }
            }
        }
    }
}

#[test]
fn multi_segment_call_quantizes_once_and_matches_single_calls() {
    let mut rng = StdRng::seed_from_u64(15);
    let k = 512;
    // A merged projection mixing formats (as Q4_K_M files do: Q5_0 / Q8_0, Q4_K / Q6_K).
    let specs = [(DType::Q5_0, 37), (DType::Q8_0, 8), (DType::Q6K, 5), (DType::Q4K, 3), (DType::Q4_0, 2)];
    let wbs: Vec<Vec<u8>> = specs.iter().map(|&(dt, n)| random_weights(dt, n, k, &mut rng)).collect();
    let ws: Vec<WeightMat<'_>> =
        specs.iter().zip(&wbs).map(|(&(dt, n), b)| WeightMat::new(dt, n, k, b).unwrap()).collect();
    let b0: Vec<f32> = (0..37).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    for m in [1, 9] {
        let x = random_x(m, k, &mut rng);
        for level in levels() {
            let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; m * w.rows]).collect();
            let mut segs: Vec<MatSeg<'_, '_>> = ws
                .iter()
                .zip(outs.iter_mut())
                .enumerate()
                .map(|(s, (&w, out))| MatSeg { w, bias: (s == 0).then(|| WeightVec::from_f32(&b0)), out })
                .collect();
            matmul_quant_prec_with(level.0, level.1, Precision::Fast, &x, m, &mut segs);
            for (s, (w, out)) in ws.iter().zip(&outs).enumerate() {
                let bias = (s == 0).then(|| WeightVec::from_f32(&b0));
                assert_bits_eq(out, &fast(level, &x, m, *w, bias), &format!("{} m={m} segment {s}", name(level)));
            }
        }
    }
}

/// The kernels' silu (their own exp, the same bits on every vector width).
fn silu(g: f32) -> f32 {
    tboost_kernels::activation::silu(g)
}

#[test]
fn swiglu_equals_two_fast_matmuls_then_silu_mul() {
    let mut rng = StdRng::seed_from_u64(16);
    let (n, k) = (23, 256);
    for (gdt, udt) in [(DType::Q5_0, DType::Q8_0), (DType::Q4K, DType::Q6K), (DType::Q4_0, DType::Q5K)] {
        let (gb, ub) = (random_weights(gdt, n, k, &mut rng), random_weights(udt, n, k, &mut rng));
        let (gate, up) = (WeightMat::new(gdt, n, k, &gb).unwrap(), WeightMat::new(udt, n, k, &ub).unwrap());
        for m in [1, 3, 6, 33] {
            let x = random_x(m, k, &mut rng);
            for level in levels() {
                let g = fast(level, &x, m, gate, None);
                let u = fast(level, &x, m, up, None);
                let want: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
                for threads in [1, 2] {
                    let mut out = vec![f32::NAN; m * n];
                    in_pool(threads, || {
                        matmul_swiglu_quant_prec_with(level.0, level.1, Precision::Fast, &x, m, gate, up, &mut out)
                    });
                    assert_bits_eq(&out, &want, &format!("{gdt}/{udt} {} m={m} threads={threads}", name(level)));
                }
            }
        }
    }
}

#[test]
fn matmul_prec_routes_by_precision_and_dtype() {
    let mut rng = StdRng::seed_from_u64(17);
    let (k, m) = (256, 3);
    let qb = random_weights(DType::Q4K, 6, k, &mut rng);
    let q = WeightMat::new(DType::Q4K, 6, k, &qb).unwrap();
    let dense: Vec<f32> = (0..4 * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let d = WeightMat::from_f32(&dense, 4, k).unwrap();
    let x = random_x(m, k, &mut rng);
    let run = |prec: Option<Precision>| {
        let (mut oq, mut od) = (vec![f32::NAN; m * 6], vec![f32::NAN; m * 4]);
        let mut segs = [MatSeg { w: q, bias: None, out: &mut oq }, MatSeg { w: d, bias: None, out: &mut od }];
        match prec {
            Some(p) => gemm::matmul_prec(p, &x, m, &mut segs),
            None => gemm::matmul(&x, m, &mut segs),
        }
        (oq, od)
    };
    let (eq, ed) = run(Some(Precision::Exact));
    let (mq, md) = run(None);
    assert_bits_eq(&eq, &mq, "Exact quantized = matmul");
    assert_bits_eq(&ed, &md, "Exact dense = matmul");
    let (fq, fd) = run(Some(Precision::Fast));
    assert_bits_eq(&fd, &md, "Fast leaves dense weights exact");
    assert_bits_eq(&fq, &fast((isa::active(), IntDot::active()), &x, m, q, None), "Fast quantized");
    assert!(fq.iter().zip(&mq).any(|(a, b)| a != b), "Fast must actually quantize the activations");
    let (mut g1, mut g2) = (vec![0f32; m * 6], vec![0f32; m * 6]);
    gemm::matmul_swiglu_prec(Precision::Exact, &x, m, q, q, &mut g1);
    gemm::matmul_swiglu(&x, m, q, q, &mut g2);
    assert_bits_eq(&g1, &g2, "Exact swiglu = matmul_swiglu");
}

/// The measured error of Fast against the exact f64 product, relative to its bound and to
/// the output scale (printed for the record; the bound itself is asserted above).
#[test]
fn measured_error_is_within_the_bound() {
    let mut rng = StdRng::seed_from_u64(18);
    let level = (isa::active(), IntDot::active());
    for dt in QUANT {
        let (n, k, m) = (64, 2048, 4);
        // Ordinary weights (no extreme scales): rows of random blocks rescaled to 0.02.
        let mut wb = random_weights(dt, n, k, &mut rng);
        for b in wb.chunks_exact_mut(dt.block_bytes()) {
            match dt {
                DType::Q6K => put_f16(b, 208, 0.002),
                DType::Q4K | DType::Q5K => {
                    put_f16(b, 0, 0.002);
                    put_f16(b, 2, 0.001);
                }
                _ => put_f16(b, 0, 0.002),
            }
        }
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0) * rng.random_range(0.0f32..1.0)).collect();
        let r = refs(&w, None, &x, m);
        let got = fast(level, &x, m, w, None);
        let (mut worst, mut err2, mut ref2) = (0f64, 0f64, 0f64);
        for ((&g, &e), &t) in got.iter().zip(&r.exact).zip(&r.exact_tol) {
            let d = (g as f64 - e).abs();
            assert!(d <= t, "{dt}: error {d} above bound {t}");
            worst = worst.max(d / t);
            err2 += d * d;
            ref2 += e * e;
        }
        println!("{dt}: rms error / rms output = {:.2e}, worst error / bound = {:.3}", (err2 / ref2).sqrt(), worst);
    }
}

#[test]
fn isa_caps_name_vnni_separately() {
    assert_eq!(isa::parse_cap("avx512"), Some((Isa::Avx512, false)));
    assert_eq!(isa::parse_cap("AVX512VNNI"), Some((Isa::Avx512, true)));
    assert_eq!(isa::parse_cap("avx2+vnni"), Some((Isa::Avx2, true)));
    assert_eq!(isa::parse_cap("avx2"), Some((Isa::Avx2, false)));
    assert_eq!(isa::parse_cap("scalar"), Some((Isa::Scalar, false)));
    assert_eq!(isa::parse_cap("scalarvnni"), None);
    assert_eq!(isa::parse_cap("sse"), None);
    assert!(!isa::vnni_detected(Isa::Scalar));
    if isa::vnni_active() {
        assert!(isa::vnni_detected(isa::active()));
    }
}

/// `w` repacked into 16-row panels (`tboost_kernels::gemm::quant::panel_pack`).
fn pack(w: &WeightMat<'_>) -> Vec<u8> {
    let mut p = vec![0u8; panel_pack::packed_bytes(w.dtype, w.rows, w.cols)];
    panel_pack::pack(w.dtype, w.rows, w.cols, w.data, &mut p);
    p
}

#[test]
fn packed_panels_give_the_row_layouts_bits_on_every_level_batch_and_split() {
    let mut rng = StdRng::seed_from_u64(21);
    // The formats without a packed layout keep the row layout (the engine packs only these).
    for dt in QUANT.into_iter().filter(|&d| panel_pack::packable(d)) {
        // Rows: a partial panel, exactly one, several with a partial last one. Groups: 1, a
        // short chunk (28), whole chunks (48), one super-block (8) for the K types. The last
        // shape's panels (74-139 KiB at k = 8192) fill several of the many-row walk's L2
        // blocks on one thread.
        let shapes: &[(usize, usize)] = if dt.block_elems() == 32 {
            &[(5, 32), (16, 896), (45, 1536), (67, 512), (150, 8192)]
        } else {
            &[(5, 256), (16, 768), (45, 1536), (35, 4864), (150, 8192)]
        };
        for &(n, k) in shapes {
            let wb = random_weights(dt, n, k, &mut rng);
            let w = WeightMat::new(dt, n, k, &wb).unwrap();
            let pb = pack(&w);
            let wp = WeightMat::packed(dt, n, k, &pb).unwrap();
            let bias: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            for m in [1, 2, 3, 4, 5, 9, 13, 16, 17, 33, 50] {
                let x = random_x(m, k, &mut rng);
                let want = fast((Isa::Scalar, false.into()), &x, m, w, Some(WeightVec::from_f32(&bias)));
                for level in levels() {
                    for threads in [1, 2, 3] {
                        let what = format!("{dt} packed {} n={n} k={k} m={m} threads={threads}", name(level));
                        let got = in_pool(threads, || fast(level, &x, m, wp, Some(WeightVec::from_f32(&bias))));
                        assert_bits_eq(&got, &want, &what);
                    }
                }
            }
            // Swiglu with packed gate and up.
            let ub = random_weights(dt, n, k, &mut rng);
            let u = WeightMat::new(dt, n, k, &ub).unwrap();
            let upb = pack(&u);
            let up = WeightMat::packed(dt, n, k, &upb).unwrap();
            for m in [1, 6, 40] {
                let x = random_x(m, k, &mut rng);
                for level in levels() {
                    let (mut a, mut b) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                    matmul_swiglu_quant_prec_with(level.0, level.1, Precision::Fast, &x, m, w, u, &mut a);
                    matmul_swiglu_quant_prec_with(level.0, level.1, Precision::Fast, &x, m, wp, up, &mut b);
                    assert_bits_eq(&b, &a, &format!("{dt} packed swiglu {} n={n} k={k} m={m}", name(level)));
                }
            }
        }
    }
}

#[test]
fn packed_layout_is_refused_where_it_does_not_apply() {
    assert!(!panel_pack::packable(DType::F32) && !panel_pack::packable(DType::BF16));
    let wb = vec![0u8; 18 * 3];
    assert!(WeightMat::packed(DType::Q4_0, 3, 32, &wb).is_err(), "a packed matrix is whole panels");
    let pb = vec![0u8; panel_pack::packed_bytes(DType::Q4_0, 3, 32)];
    let wp = WeightMat::packed(DType::Q4_0, 3, 32, &pb).unwrap();
    let x = vec![1f32; 32];
    let r = std::panic::catch_unwind(|| {
        let mut out = vec![0f32; 3];
        matmul_quant_prec_with(
            Isa::Scalar,
            false,
            Precision::Exact,
            &x,
            1,
            &mut [MatSeg { w: wp, bias: None, out: &mut out }],
        );
    });
    assert!(r.is_err(), "Exact precision has no packed kernels");
}
