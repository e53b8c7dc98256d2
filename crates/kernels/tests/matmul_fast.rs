//! `Precision::Fast` dense matmul (`matmul_fast`): the AVX512_BF16 kernel against the bit-exact
//! scalar emulation (`reference::matmul_fast_bf16`) and the f64 reference, batch and thread
//! invariance, the fused SwiGLU, and the fallbacks (other dtypes, the kernel switched off,
//! lower ISA levels) being exactly the exact kernels.

mod matmul_util;

use matmul_util::*;
use rand::rngs::StdRng;
use rand::SeedableRng;
use tboost_kernels::gemm::{self, reference, FastBf16, MatSeg};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::{DType, WeightMat, WeightVec};

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|&i| i <= isa::detected()).collect()
}

/// The bf16 dot-product kernel can run here (its tests are skipped, loudly, where not).
fn have_bf16() -> bool {
    let have = isa::avx512bf16_detected();
    if !have {
        eprintln!("note: this CPU has no AVX512_BF16; only the fallbacks are tested");
    }
    have
}

/// The bf16 kernels this machine can run (Dot, and Amx where the CPU and OS allow).
fn kernels() -> Vec<FastBf16> {
    let mut v = Vec::new();
    if isa::avx512bf16_detected() {
        v.push(FastBf16::Dot);
    }
    if isa::amx_bf16_detected() {
        v.push(FastBf16::Amx);
    } else {
        eprintln!("note: no AMX-BF16 here (CPU or OS); the AMX kernel is not tested");
    }
    v
}

/// (kernel, dtype) pairs where the kernel computes the dtype in rows (BF16; F16 runs fast
/// only in pair panels, `tests/matmul_pair_tiles.rs`).
fn cases() -> Vec<(FastBf16, DType)> {
    let mut v = Vec::new();
    for kn in kernels() {
        for d in [DType::BF16, DType::F16] {
            if kn.applies(d) {
                v.push((kn, d));
            }
        }
    }
    v
}

/// `got` within the bf16-activation bound of the f64 reference: each activation carries a
/// relative rounding error of at most 2^-8 (8 significant bits); the f32 accumulation (in whatever order the
/// kernel uses) adds at most the exact kernels' bound, taken here for a sequential chain.
fn check_bf16_bound(what: &str, got: &[f32], x: &[f32], m: usize, w: &WeightMat<'_>, bias: Option<&[f32]>) {
    let (n, k) = (w.rows, w.cols);
    let want = reference::matmul(x, m, w, None);
    for i in 0..m {
        for j in 0..n {
            let mag: f64 =
                (0..k).map(|c| (x[i * k + c] as f64 * reference::weight_at(w, j, c) as f64).abs()).sum::<f64>()
                    + bias.map_or(0.0, |b| (b[j] as f64).abs());
            let tol = (2f64.powi(-8) + 2.0 * (k as f64 + 6.0) * 2f64.powi(-24)) * mag + 1e-30;
            let (g, r) = (got[i * n + j] as f64, want[i * n + j] + bias.map_or(0.0, |b| b[j] as f64));
            assert!((g - r).abs() <= tol, "{what}: y[{i},{j}] = {g}, f64 {r}, |err| {} > tol {tol}", (g - r).abs());
        }
    }
}

/// Around every tile and block boundary: k below, at and across multiples of 32 (the
/// masked tail), m covering every remainder tile (1..5 rows) and several 6-row tiles, n not
/// a multiple of the 4- and 8-row sub-tiles, and n large enough for several L2 blocks.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (1, 9, 31),
    (1, 17, 32),
    (1, 33, 33),
    (2, 8, 63),
    (3, 5, 64),
    (4, 12, 95),
    (5, 7, 100),
    (6, 4, 129),
    (7, 11, 2048),
    (13, 23, 7),
    (16, 600, 520),
    (19, 10, 77),
    (64, 19, 531),
];

#[test]
fn bf16_kernel_matches_its_scalar_emulation_bit_for_bit() {
    if !have_bf16() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(11);
    for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
        let wb = bf16_bytes(&rand_vec(&mut rng, n * k, 0.5));
        let w = WeightMat::new(DType::BF16, n, k, &wb[1..]).unwrap();
        let x = rand_vec(&mut rng, m * k, 2.0);
        let bias_vals = rand_vec(&mut rng, n, 1.0);
        let bias = (s % 2 == 1).then(|| WeightVec::from_f32(&bias_vals));
        let want = reference::matmul_fast_bf16(&x, m, &w, bias.as_ref());
        let got = pool(2).install(|| run_fast(Isa::Avx512, FastBf16::Dot, &x, m, w, bias));
        assert!(bits_eq(&got, &want), "m={m} n={n} k={k}: kernel differs from the emulation");
    }
}

#[test]
fn emulation_is_within_the_bf16_rounding_bound_of_f64() {
    // Each activation carries a relative error of at most 2^-8 after rounding; the f32
    // accumulation adds the exact kernels' bound. Checks the emulation means what it says.
    let mut rng = StdRng::seed_from_u64(12);
    let (m, n, k) = (3, 7, 300);
    let wb = bf16_bytes(&rand_vec(&mut rng, n * k, 0.5));
    let w = WeightMat::new(DType::BF16, n, k, &wb[1..]).unwrap();
    let x = rand_vec(&mut rng, m * k, 2.0);
    let got = reference::matmul_fast_bf16(&x, m, &w, None);
    let want = reference::matmul(&x, m, &w, None);
    for i in 0..m {
        for j in 0..n {
            let mag: f64 = (0..k).map(|c| (x[i * k + c] as f64 * reference::weight_at(&w, j, c) as f64).abs()).sum();
            let tol = (2f64.powi(-8) + 2.0 * (k as f64 / 16.0 + 6.0) * 2f64.powi(-24)) * mag;
            let (g, r) = (got[i * n + j] as f64, want[i * n + j]);
            assert!((g - r).abs() <= tol, "y[{i},{j}] = {g}, f64 {r}, tol {tol}");
        }
    }
}

#[test]
fn special_activations_round_as_the_hardware_does() {
    // Denormal activations become zeros, ties round to even, large values stay finite.
    if !have_bf16() {
        return;
    }
    let k = 40;
    let mut x = vec![0f32; k];
    x[0] = 1e-40; // denormal: flushed
    x[1] = f32::from_bits(0x3f80_8000); // exactly halfway between two bf16: to even
    x[2] = f32::from_bits(0x3f81_8000); // halfway, rounds up to even
    x[3] = 3.0e38;
    x[35] = -1.5e-39;
    x[36] = 1.0;
    let wv: Vec<f32> = (0..2 * k).map(|i| 1.0 + i as f32 / 64.0).collect();
    let wb = bf16_bytes(&wv);
    let w = WeightMat::new(DType::BF16, 2, k, &wb[1..]).unwrap();
    let got = run_fast(Isa::Avx512, FastBf16::Dot, &x, 1, w, None);
    assert!(bits_eq(&got, &reference::matmul_fast_bf16(&x, 1, &w, None)), "{got:?}");
    assert_eq!(reference::bf16_round(1e-40), 0);
    assert_eq!(reference::bf16_round(f32::from_bits(0x3f80_8000)), 0x3f80);
    assert_eq!(reference::bf16_round(f32::from_bits(0x3f81_8000)), 0x3f82);
}

#[test]
fn every_kernel_is_within_the_bf16_bound_of_f64() {
    let mut rng = StdRng::seed_from_u64(17);
    for (kernel, dtype) in cases() {
        for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
            let wb = half_bytes(dtype, &rand_vec(&mut rng, n * k, 0.5));
            let w = WeightMat::new(dtype, n, k, &wb[1..]).unwrap();
            let x = rand_vec(&mut rng, m * k, 2.0);
            let bv = rand_vec(&mut rng, n, 1.0);
            let bias = (s % 2 == 0).then(|| WeightVec::from_f32(&bv));
            let got = pool(2).install(|| run_fast(Isa::Avx512, kernel, &x, m, w, bias));
            let what = format!("{} {dtype} m={m} n={n} k={k}", kernel.name());
            check_bf16_bound(&what, &got, &x, m, &w, bias.is_some().then_some(&bv[..]));
        }
    }
}

#[test]
fn fast_row_result_is_independent_of_batch_and_threads() {
    let mut rng = StdRng::seed_from_u64(13);
    let k = 1000;
    for (kernel, dtype) in cases() {
        // n = 10 makes the plan split m as well as n; n = 300 splits n only.
        for &n in &[10, 300] {
            let wb = half_bytes(dtype, &rand_vec(&mut rng, n * k, 0.5));
            let w = WeightMat::new(dtype, n, k, &wb[1..]).unwrap();
            let bv = rand_vec(&mut rng, n, 1.0);
            let bias = Some(WeightVec::from_f32(&bv));
            let x = rand_vec(&mut rng, 64 * k, 1.0);
            let alone: Vec<Vec<f32>> =
                (0..64).map(|i| run_fast(Isa::Avx512, kernel, &x[i * k..(i + 1) * k], 1, w, bias)).collect();
            for m in [1, 3, 16, 17, 33, 64] {
                for threads in [1, 2, 3] {
                    let got = pool(threads).install(|| run_fast(Isa::Avx512, kernel, &x[..m * k], m, w, bias));
                    for (i, row) in alone.iter().enumerate().take(m) {
                        assert!(
                            bits_eq(&got[i * n..(i + 1) * n], row),
                            "{} {dtype} n={n} m={m} threads={threads}: row {i} differs",
                            kernel.name()
                        );
                    }
                }
            }
            // The same row at another position among other neighbours.
            let mut other = rand_vec(&mut rng, 40 * k, 1.0);
            other[37 * k..38 * k].copy_from_slice(&x[5 * k..6 * k]);
            let got = pool(2).install(|| run_fast(Isa::Avx512, kernel, &other, 40, w, bias));
            assert!(bits_eq(&got[37 * n..38 * n], &alone[5]), "{} {dtype} n={n}: row 5 at 37", kernel.name());
        }
    }
}

#[test]
fn fast_swiglu_is_bit_identical_to_two_fast_matmuls() {
    let mut rng = StdRng::seed_from_u64(14);
    for (&(m, n, k), dtype) in
        [(1, 1, 5), (1, 13, 64), (3, 9, 17), (5, 6, 100), (7, 21, 33), (37, 11, 129), (16, 40, 2048)]
            .iter()
            .flat_map(|s| [(s, DType::BF16), (s, DType::F16)])
    {
        let gb = half_bytes(dtype, &rand_vec(&mut rng, n * k, 0.5));
        let ub = half_bytes(dtype, &rand_vec(&mut rng, n * k, 0.5));
        let g = WeightMat::new(dtype, n, k, &gb[1..]).unwrap();
        let u = WeightMat::new(dtype, n, k, &ub[1..]).unwrap();
        let x = rand_vec(&mut rng, m * k, 4.0);
        let mut runs: Vec<(Isa, FastBf16)> = isas().into_iter().map(|i| (i, FastBf16::Off)).collect();
        runs.extend(kernels().into_iter().map(|kn| (Isa::Avx512, kn)));
        for (isa, kernel) in runs {
            let gs = run_fast(isa, kernel, &x, m, g, None);
            let us = run_fast(isa, kernel, &x, m, u, None);
            let unfused: Vec<f32> = gs.iter().zip(&us).map(|(&g, &u)| gemm::silu(g) * u).collect();
            let mut fused = vec![f32::NAN; m * n];
            pool(3).install(|| gemm::matmul_swiglu_fast_with(isa, kernel, &x, m, g, u, &mut fused));
            assert!(bits_eq(&fused, &unfused), "{} {} {dtype} m={m} n={n} k={k}", isa.name(), kernel.name());
        }
    }
}

#[test]
fn fallbacks_are_exactly_the_exact_kernels() {
    // Other dtypes, the bf16 kernel switched off, and lower ISA levels: Fast = Exact bits.
    let mut rng = StdRng::seed_from_u64(15);
    let (m, n, k) = (9, 13, 77);
    let x = rand_vec(&mut rng, m * k, 1.0);
    let vals = rand_vec(&mut rng, n * k, 0.5);
    let f16: Vec<u8> = vals.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    let bf = bf16_bytes(&vals);
    let mats = [
        WeightMat::from_f32(&vals, n, k).unwrap(),
        WeightMat::new(DType::F16, n, k, &f16).unwrap(),
        WeightMat::new(DType::BF16, n, k, &bf[1..]).unwrap(),
    ];
    for w in mats {
        for isa in isas() {
            let mut exact = vec![0f32; m * n];
            gemm::matmul_with(isa, &x, m, &mut [MatSeg { w, bias: None, out: &mut exact }]);
            let off = run_fast(isa, FastBf16::Off, &x, m, w, None);
            assert!(bits_eq(&off, &exact), "{} {}: kernel off differs from exact", isa.name(), w.dtype);
            if isa == Isa::Avx512 {
                for kernel in kernels().into_iter().filter(|kn| !kn.applies(w.dtype)) {
                    let on = run_fast(isa, kernel, &x, m, w, None);
                    assert!(
                        bits_eq(&on, &exact),
                        "{} {}: Fast of a non-bf16 dtype differs from exact",
                        kernel.name(),
                        w.dtype
                    );
                }
            }
        }
    }
}

#[test]
fn merged_segments_mix_fast_and_exact_kernels_per_segment() {
    let mut rng = StdRng::seed_from_u64(16);
    let (m, k) = (5, 96);
    let x = rand_vec(&mut rng, m * k, 1.0);
    let qv = rand_vec(&mut rng, 24 * k, 0.5);
    let vv = rand_vec(&mut rng, 8 * k, 0.5);
    let qb = bf16_bytes(&qv);
    let q = WeightMat::new(DType::BF16, 24, k, &qb[1..]).unwrap();
    let v = WeightMat::from_f32(&vv, 8, k).unwrap();
    for kernel in kernels() {
        let (mut oq, mut ov) = (vec![0f32; m * 24], vec![0f32; m * 8]);
        let mut segs = [MatSeg { w: q, bias: None, out: &mut oq }, MatSeg { w: v, bias: None, out: &mut ov }];
        gemm::matmul_fast_with(Isa::Avx512, kernel, &x, m, &mut segs);
        assert!(bits_eq(&oq, &run_fast(Isa::Avx512, kernel, &x, m, q, None)), "{} bf16 segment", kernel.name());
        let mut exact = vec![0f32; m * 8];
        gemm::matmul_with(Isa::Avx512, &x, m, &mut [MatSeg { w: v, bias: None, out: &mut exact }]);
        assert!(bits_eq(&ov, &exact), "{} f32 segment", kernel.name());
    }
}

#[test]
fn the_bf16_kernel_is_on_only_with_the_extension() {
    // `avx512bf16()` never claims more than the CPU has, and follows the active level.
    assert!(!isa::avx512bf16() || (isa::avx512bf16_detected() && isa::active() == Isa::Avx512));
    assert!(!isa::amx_bf16() || (isa::amx_bf16_detected() && isa::avx512bf16()));
    let best = FastBf16::best();
    assert_eq!(best == FastBf16::Amx, isa::amx_bf16());
    assert_eq!(best == FastBf16::Off, !isa::avx512bf16());
    assert_eq!(gemm::fast_bf16_applies(DType::BF16), best != FastBf16::Off);
    // F16 at fast: pair panels wherever a bf16 kernel runs: AMX-BF16's split kernel, or the
    // `vdpbf16ps` kernel on weights the engine rounds to bf16 (rows stay exact).
    assert_eq!(gemm::fast_bf16_applies(DType::F16), best != FastBf16::Off);
    assert_eq!(tboost_kernels::gemm::dense::amx_pair_panels::applies(), best == FastBf16::Amx);
    assert!(!FastBf16::Amx.applies(DType::F16) && !FastBf16::Dot.applies(DType::F16), "f16 in rows stays exact");
    assert!(!gemm::fast_bf16_applies(DType::F32));
}

#[test]
#[should_panic(expected = "segment 0 is q8_0; quantized weights run in gemm::quant")]
fn quantized_weights_are_refused() {
    let bytes = [0u8; 34];
    let w = WeightMat::new(DType::Q8_0, 1, 32, &bytes).unwrap();
    let mut out = [0f32; 1];
    gemm::matmul_fast(&[0.0; 32], 1, &mut [MatSeg { w, bias: None, out: &mut out }]);
}

#[test]
fn bf16_pair_panels_match_their_emulation_for_every_batch_and_split() {
    if !kernels().contains(&FastBf16::Dot) {
        println!("SKIPPED: this CPU has no AVX512_BF16 (the pair panels are for that kernel only)");
        return;
    }
    let mut rng = StdRng::seed_from_u64(61);
    // k: whole 32-blocks, a partial one, an odd one, one below a block, none (the bias
    // alone); n: partial and several panels, more than one register tile of them.
    for &(n, k) in &[(5, 32), (16, 100), (45, 512), (33, 2050), (70, 17), (20, 0)] {
        let (gv, uv) = (rand_vec(&mut rng, n * k, 1.0), rand_vec(&mut rng, n * k, 1.0));
        // `bf16_bytes` puts the values at an odd address (offset 1).
        let (gb, ub) = (bf16_bytes(&gv), bf16_bytes(&uv));
        let (gb, ub) = (&gb[1..], &ub[1..]);
        let (g, u) = (WeightMat::new(DType::BF16, n, k, gb).unwrap(), WeightMat::new(DType::BF16, n, k, ub).unwrap());
        let pack = |b: &[u8]| {
            let mut p = vec![0u8; tboost_kernels::gemm::dense::bf16_pair_panels::packed_bytes(n, k)];
            tboost_kernels::gemm::dense::bf16_pair_panels::pack(n, k, b, &mut p);
            p
        };
        let (gp, up) = (pack(gb), pack(ub));
        let (pg, pu) = (WeightMat::pair_panels(n, k, &gp).unwrap(), WeightMat::pair_panels(n, k, &up).unwrap());
        let bias = rand_vec(&mut rng, n, 1.0);
        let bv = WeightVec::from_f32(&bias);
        // From GEMM_MIN_ROWS a call's x rows are rounded once for all tasks: every x-tile
        // remainder on both sides of it.
        let gm = tboost_kernels::gemm::dense::bf16_pair_panels::GEMM_MIN_ROWS;
        for m in [1, 2, 3, 5, 9].into_iter().chain(gm..gm + 6) {
            let x = rand_vec(&mut rng, m * k, 2.0);
            let want = reference::matmul_fast_bf16_pairs(&x, m, &g, Some(&bv));
            for threads in [1, 3] {
                let mut got = vec![f32::NAN; m * n];
                pool(threads).install(|| {
                    gemm::matmul_fast_with(
                        Isa::Avx512,
                        FastBf16::Dot,
                        &x,
                        m,
                        &mut [MatSeg { w: pg, bias: Some(bv), out: &mut got }],
                    )
                });
                assert!(
                    bits_eq(&got, &want),
                    "pair panels n={n} k={k} m={m} threads={threads} differ from their emulation"
                );
            }
            let (gs, us) = (
                reference::matmul_fast_bf16_pairs(&x, m, &g, None),
                reference::matmul_fast_bf16_pairs(&x, m, &u, None),
            );
            let unfused: Vec<f32> = gs.iter().zip(&us).map(|(&g, &u)| gemm::silu(g) * u).collect();
            let mut fused = vec![f32::NAN; m * n];
            pool(3).install(|| gemm::matmul_swiglu_fast_with(Isa::Avx512, FastBf16::Dot, &x, m, pg, pu, &mut fused));
            assert!(bits_eq(&fused, &unfused), "pair-panel swiglu n={n} k={k} m={m}");
            check_bf16_bound("pair panels", &want, &x, m, &g, Some(&bias));
        }
    }
}

#[test]
fn pair_panel_emulation_rounds_special_activations_as_the_hardware_does() {
    if !kernels().contains(&FastBf16::Dot) {
        println!("SKIPPED: this CPU has no AVX512_BF16 (the pair panels are for that kernel only)");
        return;
    }
    // Denormal activations and weights flush, -0.0 products and sums, ties round to even,
    // at k = 3 (a padded pair) and 40 (a padded block).
    for k in [3usize, 40] {
        let n = 17;
        let specials =
            [1e-40, -0.0, f32::from_bits(0x3f80_8000), -1.5e-39, f32::from_bits(0x3f81_8000), -2.5, 0.0, 1.0];
        let x: Vec<f32> = (0..2 * k).map(|i| specials[i % specials.len()]).collect();
        let wv: Vec<f32> = (0..n * k)
            .map(|i| match i % 7 {
                0 => -0.0,
                3 => 1e-39,
                _ => 1.0 + (i % 9) as f32 / 64.0,
            })
            .collect();
        let wb = bf16_bytes(&wv);
        let w = WeightMat::new(DType::BF16, n, k, &wb[1..]).unwrap();
        let mut p = vec![0u8; tboost_kernels::gemm::dense::bf16_pair_panels::packed_bytes(n, k)];
        tboost_kernels::gemm::dense::bf16_pair_panels::pack(n, k, &wb[1..], &mut p);
        let pw = WeightMat::pair_panels(n, k, &p).unwrap();
        let want = reference::matmul_fast_bf16_pairs(&x, 2, &w, None);
        let mut got = vec![0f32; 2 * n];
        gemm::matmul_fast_with(Isa::Avx512, FastBf16::Dot, &x, 2, &mut [MatSeg { w: pw, bias: None, out: &mut got }]);
        assert!(bits_eq(&got, &want), "k={k}: {got:?} vs {want:?}");
    }
}
