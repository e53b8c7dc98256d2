//! MatMul / GEMV / fused SwiGLU against the f64 reference, on every ISA this CPU has, plus
//! the batch-invariance and fusion bit-equality claims.
//!
//! Tolerance (stated, not guessed): each output is a chain of `ceil(k/16)` fused
//! multiply-adds per lane followed by a 4-level tree and the bias add, so to first order
//! `|y - y_f64| <= (k/16 + 6) * 2^-24 * (Σ_c |x_c w_c| + |bias|)`; the tests allow twice that.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::gemm::{self, reference, MatSeg};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::{DType, WeightMat, WeightVec};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Every ISA this CPU can run. On the CI machine (AVX-512) that is all three paths.
fn isas() -> Vec<Isa> {
    let all = [Isa::Scalar, Isa::Avx2, Isa::Avx512];
    all.into_iter().filter(|&i| i <= isa::detected()).collect()
}

/// Bytes of `vals` stored as `dtype`, placed at an odd address (offset 1 in the returned
/// buffer) so the kernels' unaligned loads are exercised. Also returns the values as stored.
fn encode(dtype: DType, vals: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = vec![0u8];
    let mut stored = Vec::with_capacity(vals.len());
    for &v in vals {
        match dtype {
            DType::F32 => {
                bytes.extend_from_slice(&v.to_le_bytes());
                stored.push(v);
            }
            DType::F16 => {
                let h = half::f16::from_f32(v);
                bytes.extend_from_slice(&h.to_le_bytes());
                stored.push(h.to_f32());
            }
            DType::BF16 => {
                let h = half::bf16::from_f32(v);
                bytes.extend_from_slice(&h.to_le_bytes());
                stored.push(h.to_f32());
            }
            other => panic!("test encode: {other} is not dense"),
        }
    }
    (bytes, stored)
}

fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

struct OwnedMat {
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    vals: Vec<f32>,
}

impl OwnedMat {
    fn random(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> Self {
        let (bytes, vals) = encode(dtype, &rand_vec(rng, rows * cols));
        OwnedMat { dtype, rows, cols, bytes, vals }
    }
    fn view(&self) -> WeightMat<'_> {
        WeightMat::new(self.dtype, self.rows, self.cols, &self.bytes[1..]).unwrap()
    }
}

struct OwnedVec {
    dtype: DType,
    bytes: Vec<u8>,
    vals: Vec<f32>,
}

impl OwnedVec {
    fn random(rng: &mut StdRng, dtype: DType, len: usize) -> Self {
        let (bytes, vals) = encode(dtype, &rand_vec(rng, len));
        OwnedVec { dtype, bytes, vals }
    }
    fn view(&self) -> WeightVec<'_> {
        WeightVec::new(self.dtype, self.vals.len(), &self.bytes[1..]).unwrap()
    }
}

/// Asserts `got` is within the stated bound of the f64 reference.
#[allow(clippy::too_many_arguments)]
fn check_close(what: &str, got: &[f32], want: &[f64], x: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, k: usize) {
    let n = want.len() / m.max(1);
    for i in 0..m {
        for j in 0..n {
            let mag: f64 = (0..k).map(|c| (x[i * k + c] as f64 * w[j * k + c] as f64).abs()).sum::<f64>()
                + bias.map_or(0.0, |b| (b[j] as f64).abs());
            let tol = 2.0 * (k as f64 / 16.0 + 6.0) * 2f64.powi(-24) * mag;
            let (g, r) = (got[i * n + j] as f64, want[i * n + j]);
            assert!(
                (g - r).abs() <= tol,
                "{what}: y[{i},{j}] = {g}, reference {r}, |err| {} > tol {tol}",
                (g - r).abs()
            );
        }
    }
}

fn run_one(isa: Isa, x: &[f32], m: usize, w: WeightMat<'_>, bias: Option<WeightVec<'_>>) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    gemm::matmul_with(isa, x, m, &mut [MatSeg { w, bias, out: &mut out }]);
    out
}

/// Shapes around every tile and vector-width boundary: k not a multiple of 16 (or 8),
/// n not a multiple of the 4/8 (AVX-512) or 2/4 (AVX2) tiles, m covering every remainder
/// and both loop nests (direct below 16 rows; k-blocked with weights read in place below
/// 32 rows, packed from 32), k spanning more than one 512-wide k block.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (1, 9, 15),
    (1, 17, 16),
    (1, 33, 17),
    (2, 8, 31),
    (3, 5, 33),
    (4, 12, 47),
    (5, 7, 64),
    (6, 4, 65),
    (7, 11, 100),
    (11, 13, 129),
    (13, 23, 7),
    (16, 16, 160),
    (19, 10, 77),
    (23, 9, 531),
    (32, 5, 530),
    (37, 19, 83),
];

#[test]
fn every_isa_matches_f64_reference_for_every_dtype() {
    let mut rng = StdRng::seed_from_u64(1);
    let mut checked = 0;
    for &dtype in &DTYPES {
        for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
            let w = OwnedMat::random(&mut rng, dtype, n, k);
            let x = rand_vec(&mut rng, m * k);
            // Bias on every other shape, its dtype cycling through the dense types.
            let bias = (s % 2 == 1).then(|| OwnedVec::random(&mut rng, DTYPES[s / 2 % 3], n));
            let want = reference::matmul(&x, m, &w.view(), bias.as_ref().map(|b| b.view()).as_ref());
            for isa in isas() {
                let got = run_one(isa, &x, m, w.view(), bias.as_ref().map(|b| b.view()));
                let what = format!("{} {dtype} m={m} n={n} k={k} bias={}", isa.name(), bias.is_some());
                check_close(&what, &got, &want, &x, &w.vals, bias.as_ref().map(|b| &b.vals[..]), m, k);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, DTYPES.len() * SHAPES.len() * isas().len());
}

#[test]
fn all_isas_give_identical_bits() {
    // Stronger than the module contract: the canonical order is implemented exactly by
    // every path, so a model gives the same tokens on an AVX2 and an AVX-512 machine.
    let mut rng = StdRng::seed_from_u64(2);
    assert!(isas().len() >= 2 || isa::detected() == Isa::Scalar);
    for &dtype in &DTYPES {
        for &(m, n, k) in &[(1, 21, 300), (9, 10, 257), (13, 9, 1000)] {
            let w = OwnedMat::random(&mut rng, dtype, n, k);
            let x = rand_vec(&mut rng, m * k);
            let base = run_one(Isa::Scalar, &x, m, w.view(), None);
            for isa in isas() {
                let got = run_one(isa, &x, m, w.view(), None);
                assert!(bits_eq(&got, &base), "{} {dtype} m={m} n={n} k={k} differs from scalar", isa.name());
            }
        }
    }
}

fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

#[test]
fn row_result_is_independent_of_batch_and_threads() {
    let mut rng = StdRng::seed_from_u64(3);
    let (m, k) = (64, 2051);
    // n = 10 makes the 3-thread plan split m as well as n; n = 70 splits n only.
    for &n in &[10, 70] {
        for &dtype in &DTYPES {
            let w = OwnedMat::random(&mut rng, dtype, n, k);
            let bias = OwnedVec::random(&mut rng, DType::BF16, n);
            let x = rand_vec(&mut rng, m * k);
            let mut other = rand_vec(&mut rng, m * k);
            for isa in isas() {
                let batch = run_one(isa, &x, m, w.view(), Some(bias.view()));
                for threads in [1, 2, 3] {
                    let p = pool(threads).install(|| run_one(isa, &x, m, w.view(), Some(bias.view())));
                    assert!(bits_eq(&p, &batch), "{} {dtype} n={n}: {threads} threads differ", isa.name());
                }
                for i in [0, 1, 5, 6, 31, 63] {
                    let row = &x[i * k..(i + 1) * k];
                    let alone = run_one(isa, row, 1, w.view(), Some(bias.view()));
                    assert!(bits_eq(&alone, &batch[i * n..(i + 1) * n]), "{} {dtype}: row {i} alone", isa.name());
                    // Same row at another position among different neighbours.
                    other[(i * 7 % m) * k..(i * 7 % m + 1) * k].copy_from_slice(row);
                    let o = pool(2).install(|| {
                        run_one(isa, &other[..(i * 7 % m + 1) * k], i * 7 % m + 1, w.view(), Some(bias.view()))
                    });
                    let pos = i * 7 % m;
                    assert!(bits_eq(&o[pos * n..(pos + 1) * n], &alone), "{} {dtype}: row {i} at {pos}", isa.name());
                }
            }
        }
    }
}

#[test]
fn large_shape_crosses_every_cache_block_boundary() {
    // k = 3000: several k blocks and a k tail; m = 100 and n = 300: several L2 blocks of
    // x rows and of weight rows, each ending in a partial block and a partial tile.
    let mut rng = StdRng::seed_from_u64(6);
    let (m, n, k) = (100, 300, 3000);
    for &dtype in &[DType::F32, DType::BF16] {
        let w = OwnedMat::random(&mut rng, dtype, n, k);
        let bias = OwnedVec::random(&mut rng, DType::F32, n);
        let x = rand_vec(&mut rng, m * k);
        let want = reference::matmul(&x, m, &w.view(), Some(&bias.view()));
        for isa in isas() {
            let got = pool(2).install(|| run_one(isa, &x, m, w.view(), Some(bias.view())));
            check_close(&format!("{} {dtype}", isa.name()), &got, &want, &x, &w.vals, Some(&bias.vals), m, k);
            for i in [0, 59, 60, 99] {
                let alone = run_one(isa, &x[i * k..(i + 1) * k], 1, w.view(), Some(bias.view()));
                assert!(bits_eq(&alone, &got[i * n..(i + 1) * n]), "{} {dtype}: row {i} alone", isa.name());
            }
        }
    }
}

#[test]
fn merged_segments_equal_separate_calls() {
    let mut rng = StdRng::seed_from_u64(4);
    let (m, k) = (7, 131);
    // QKV-like: different row counts, dtypes and biases, one x.
    let q = OwnedMat::random(&mut rng, DType::BF16, 24, k);
    let kk = OwnedMat::random(&mut rng, DType::F16, 9, k);
    let v = OwnedMat::random(&mut rng, DType::F32, 13, k);
    let bq = OwnedVec::random(&mut rng, DType::F32, 24);
    let bv = OwnedVec::random(&mut rng, DType::F16, 13);
    let x = rand_vec(&mut rng, m * k);
    for isa in isas() {
        let (mut oq, mut ok, mut ov) = (vec![0f32; m * 24], vec![0f32; m * 9], vec![0f32; m * 13]);
        let mut segs = [
            MatSeg { w: q.view(), bias: Some(bq.view()), out: &mut oq },
            MatSeg { w: kk.view(), bias: None, out: &mut ok },
            MatSeg { w: v.view(), bias: Some(bv.view()), out: &mut ov },
        ];
        pool(2).install(|| gemm::matmul_with(isa, &x, m, &mut segs));
        assert!(bits_eq(&oq, &run_one(isa, &x, m, q.view(), Some(bq.view()))), "{} q", isa.name());
        assert!(bits_eq(&ok, &run_one(isa, &x, m, kk.view(), None)), "{} k", isa.name());
        assert!(bits_eq(&ov, &run_one(isa, &x, m, v.view(), Some(bv.view()))), "{} v", isa.name());
        let want = reference::matmul(&x, m, &v.view(), Some(&bv.view()));
        check_close("merged v", &ov, &want, &x, &v.vals, Some(&bv.vals), m, k);
    }
}

#[test]
fn fused_swiglu_is_bit_identical_to_unfused() {
    let mut rng = StdRng::seed_from_u64(5);
    for &dtype in &DTYPES {
        for &(m, n, k) in &[(1, 1, 5), (1, 13, 40), (3, 9, 17), (5, 6, 64), (7, 21, 33), (37, 11, 129)] {
            let g = OwnedMat::random(&mut rng, dtype, n, k);
            let u = OwnedMat::random(&mut rng, dtype, n, k);
            // Scale x so gate sums reach the saturating regions of silu too.
            let x: Vec<f32> = rand_vec(&mut rng, m * k).iter().map(|v| v * 8.0).collect();
            let want = reference::matmul_swiglu(&x, m, &g.view(), &u.view());
            for isa in isas() {
                let gs = run_one(isa, &x, m, g.view(), None);
                let us = run_one(isa, &x, m, u.view(), None);
                let unfused: Vec<f32> = gs.iter().zip(&us).map(|(&g, &u)| gemm::silu(g) * u).collect();
                let mut fused = vec![f32::NAN; m * n];
                pool(3).install(|| gemm::matmul_swiglu_with(isa, &x, m, g.view(), u.view(), &mut fused));
                assert!(bits_eq(&fused, &unfused), "{} {dtype} m={m} n={n} k={k}", isa.name());
                for (i, (&f, &r)) in fused.iter().zip(&want).enumerate() {
                    // silu' is bounded by 1.1 and |u| by the dot bound: relative 1e-4 of the
                    // product magnitudes is far above the f32 chain error stated above.
                    let tol = 1e-4 * (1.0 + r.abs());
                    assert!((f as f64 - r).abs() <= tol, "{} {dtype}: swiglu[{i}] = {f}, reference {r}", isa.name());
                }
            }
        }
    }
}

#[test]
fn zero_k_gives_bias_and_zero_m_is_a_no_op() {
    let bias = [1.5f32, -2.0, 0.25];
    let w = WeightMat::new(DType::BF16, 3, 0, &[]).unwrap();
    for isa in isas() {
        let got = run_one(isa, &[], 2, w, Some(WeightVec::from_f32(&bias)));
        assert_eq!(got, [1.5, -2.0, 0.25, 1.5, -2.0, 0.25], "{}", isa.name());
        let got = run_one(isa, &[], 0, w, Some(WeightVec::from_f32(&bias)));
        assert!(got.is_empty());
    }
}

#[test]
fn weight_from_f32_views_the_values() {
    let v = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let w = WeightMat::from_f32(&v, 2, 3).unwrap();
    assert_eq!(reference::weight_at(&w, 1, 2), 6.0);
    assert!(WeightMat::from_f32(&v, 4, 2).unwrap_err().contains("needs 32 bytes"));
}

#[test]
#[should_panic(expected = "output has 5 values, expected [m=2, rows=3]")]
fn wrong_output_shape_is_named() {
    let v = [0f32; 6];
    let w = WeightMat::from_f32(&v, 3, 2).unwrap();
    let mut out = [0f32; 5];
    gemm::matmul(&[0.0; 4], 2, &mut [MatSeg { w, bias: None, out: &mut out }]);
}

#[test]
#[should_panic(expected = "segment 1 has 3 columns but segment 0 has 2")]
fn segments_with_different_k_are_rejected() {
    let (a, b) = ([0f32; 4], [0f32; 6]);
    let (mut oa, mut ob) = ([0f32; 2], [0f32; 2]);
    let mut segs = [
        MatSeg { w: WeightMat::from_f32(&a, 2, 2).unwrap(), bias: None, out: &mut oa },
        MatSeg { w: WeightMat::from_f32(&b, 2, 3).unwrap(), bias: None, out: &mut ob },
    ];
    gemm::matmul(&[0.0; 2], 1, &mut segs);
}

#[test]
fn quantized_weights_route_to_the_quant_kernels() {
    use tboost_kernels::gemm::quant::{matmul_quant, quantize_row_reference};
    use tboost_kernels::gemm::{supports, MatMulCase};
    assert!(supports(&MatMulCase::f32(DType::BF16, 8, 8)).is_ok());
    assert!(supports(&MatMulCase::f32(DType::Q4_0, 8, 32)).is_ok());
    let e = supports(&MatMulCase::f32(DType::Q4_0, 8, 40)).unwrap_err();
    assert_eq!((e.param.as_ref(), e.value.as_str()), ("cols", "40"), "{e}");
    assert!(e.need.contains("q4_0"), "{e}");

    // A merged projection mixing a quantized and a dense matrix gives, per segment, exactly
    // what the kernel of its own kind gives.
    let (m, k, n) = (3, 64, 5);
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
    let wd: Vec<f32> = (0..n * k).map(|i| ((i * 7 % 31) as f32 - 15.0) / 40.0).collect();
    let wq: Vec<u8> = wd.chunks(k).flat_map(|r| quantize_row_reference(DType::Q8_0, r).unwrap()).collect();
    let (qmat, dmat) = (WeightMat::new(DType::Q8_0, n, k, &wq).unwrap(), WeightMat::from_f32(&wd, n, k).unwrap());
    let (mut yq, mut yd) = (vec![0.0; m * n], vec![0.0; m * n]);
    gemm::matmul(
        &x,
        m,
        &mut [MatSeg { w: qmat, bias: None, out: &mut yq }, MatSeg { w: dmat, bias: None, out: &mut yd }],
    );
    let (mut wantq, mut wantd) = (vec![0.0; m * n], vec![0.0; m * n]);
    matmul_quant(&x, m, &mut [MatSeg { w: qmat, bias: None, out: &mut wantq }]);
    gemm::matmul(&x, m, &mut [MatSeg { w: dmat, bias: None, out: &mut wantd }]);
    assert_eq!((yq, yd), (wantq, wantd));
}

#[test]
#[should_panic(expected = "segment 0: 4x8 bf16 weight has 60 bytes")]
fn forged_weight_view_is_rejected_before_any_read() {
    // The fields are public: a view built without `WeightMat::new` must not be trusted.
    let bytes = [0u8; 60];
    let w = WeightMat { dtype: DType::BF16, rows: 4, cols: 8, data: &bytes, layout: Default::default() };
    let mut out = [0f32; 4];
    gemm::matmul(&[0.0; 8], 1, &mut [MatSeg { w, bias: None, out: &mut out }]);
}

/// `w` (row-major) repacked into 16-row panels (`tboost_kernels::gemm::dense::exact_panels`).
fn packed_of(w: &WeightMat<'_>) -> Vec<u8> {
    let mut p = vec![0u8; tboost_kernels::gemm::dense::exact_panels::packed_bytes(w.dtype, w.rows, w.cols)];
    tboost_kernels::gemm::dense::exact_panels::pack(w.dtype, w.rows, w.cols, w.data, &mut p);
    p
}

#[test]
fn packed_panels_give_the_row_layouts_bits_on_every_isa_batch_and_split() {
    let mut rng = StdRng::seed_from_u64(41);
    for dt in DTYPES {
        for &(m, n, k) in SHAPES.iter().chain(&[(1, 40, 2048), (3, 67, 512), (20, 33, 300)]) {
            let w = OwnedMat::random(&mut rng, dt, n, k);
            let b = OwnedVec::random(&mut rng, DType::F32, n);
            let x = rand_vec(&mut rng, m * k);
            let pb = packed_of(&w.view());
            let wp = WeightMat::packed(dt, n, k, &pb).unwrap();
            let want = run_one(Isa::Scalar, &x, m, w.view(), Some(b.view()));
            for isa in isas() {
                for threads in [1, 3] {
                    let what = format!("{dt} packed {} m={m} n={n} k={k} threads={threads}", isa.name());
                    let got = pool(threads).install(|| run_one(isa, &x, m, wp, Some(b.view())));
                    assert!(bits_eq(&got, &want), "{what}: differs from the row layout");
                }
                // Fused SwiGLU with packed gate and up, and a merged call mixing layouts.
                let u = OwnedMat::random(&mut rng, dt, n, k);
                let upb = packed_of(&u.view());
                let up = WeightMat::packed(dt, n, k, &upb).unwrap();
                let (mut a, mut c) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                gemm::matmul_swiglu_with(isa, &x, m, w.view(), u.view(), &mut a);
                gemm::matmul_swiglu_with(isa, &x, m, wp, up, &mut c);
                assert!(bits_eq(&a, &c), "{dt} packed swiglu {} m={m} n={n} k={k}", isa.name());
                let (mut y1, mut y2) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                gemm::matmul_with(
                    isa,
                    &x,
                    m,
                    &mut [MatSeg { w: wp, bias: None, out: &mut y1 }, MatSeg { w: u.view(), bias: None, out: &mut y2 }],
                );
                assert!(bits_eq(&y1, &run_one(isa, &x, m, w.view(), None)), "{dt} mixed call, packed segment");
                assert!(bits_eq(&y2, &run_one(isa, &x, m, u.view(), None)), "{dt} mixed call, row segment");
            }
        }
    }
}
