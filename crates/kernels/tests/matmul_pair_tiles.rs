//! F16 and BF16 weights in pair panels on the tile arithmetic under `Precision::Fast`
//! (`tboost_kernels::gemm::dense::amx_pair_panels`): the AMX path and the vector path against the bit-exact scalar
//! emulation (`reference::matmul_fast_pair_tiles`) for every batch size, split and thread
//! count (so a row's result does not depend on the batch: decode runs the vector path,
//! prefill the tiles), the fused SwiGLU, flushed denormals, the error against the f64
//! reference, and BF16's bits against the row layout's AMX kernel.

mod matmul_util;

use matmul_util::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::gemm::dense::amx_pair_panels;
use tboost_kernels::gemm::{self, reference, FastBf16};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::{DType, WeightMat, WeightVec};

/// The kernels that run `dtype` pair panels on the tile arithmetic here: for F16 `Amx`
/// (the tiles from `amx_min_rows` rows) and `Dot` (the vector path for every m); for BF16
/// `Amx` (with `Dot`, BF16 panels run `bf16_pair_panels`, tested in `matmul_fast.rs`). Says so
/// loudly where this CPU cannot run them, naming what is missing.
fn paths(dtype: DType) -> Vec<FastBf16> {
    if !isa::avx512bf16_detected() {
        println!("SKIPPED: this CPU has no AVX512_BF16; these pair panels are made only where AMX-BF16 runs");
        return Vec::new();
    }
    let mut v = if dtype == DType::F16 { vec![FastBf16::Dot] } else { Vec::new() };
    if isa::amx_bf16_detected() {
        v.push(FastBf16::Amx);
    } else {
        println!("note: no AMX-BF16 here (CPU or OS); {dtype} pair panels on the tile arithmetic untested");
    }
    v
}

const DTYPES: [DType; 2] = [DType::F16, DType::BF16];

struct Packed {
    dtype: DType,
    rows: Vec<u8>,
    panels: Vec<u8>,
    n: usize,
    k: usize,
}

impl Packed {
    fn new(dtype: DType, vals: &[f32], n: usize, k: usize) -> Packed {
        let rows = half_bytes(dtype, vals);
        let mut panels = vec![0u8; amx_pair_panels::packed_bytes(n, k)];
        amx_pair_panels::pack(n, k, &rows[1..], &mut panels);
        Packed { dtype, rows, panels, n, k }
    }
    fn stored(&self) -> WeightMat<'_> {
        WeightMat::new(self.dtype, self.n, self.k, &self.rows[1..]).unwrap()
    }
    fn packed(&self) -> WeightMat<'_> {
        match self.dtype {
            DType::F16 => WeightMat::f16_pair_panels(self.n, self.k, &self.panels).unwrap(),
            _ => WeightMat::pair_panels(self.n, self.k, &self.panels).unwrap(),
        }
    }
}

fn run(
    kernel: FastBf16,
    threads: usize,
    x: &[f32],
    m: usize,
    w: WeightMat<'_>,
    bias: Option<WeightVec<'_>>,
) -> Vec<f32> {
    pool(threads).install(|| run_fast(Isa::Avx512, kernel, x, m, w, bias))
}

#[test]
fn both_paths_match_the_emulation_for_every_batch_and_split() {
    for dtype in DTYPES {
        both_paths_match_the_emulation(dtype);
    }
}

fn both_paths_match_the_emulation(dtype: DType) {
    let paths = paths(dtype);
    if paths.is_empty() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(1601);
    let a = amx_pair_panels::amx_min_rows(dtype);
    // k: whole 32-blocks, partial and odd ones, none (bias alone); n: partial and several
    // panels, more than the four C tiles of a group; m: around the AMX threshold and the
    // 16-row tiles.
    for &(n, k) in &[(5, 32), (16, 100), (45, 512), (33, 2050), (70, 17), (20, 0), (130, 64)] {
        let w = Packed::new(dtype, &rand_vec(&mut rng, n * k, 1.0), n, k);
        let bias = rand_vec(&mut rng, n, 1.0);
        let bv = WeightVec::from_f32(&bias);
        for m in [1, 2, a - 1, a, a + 1, 15, 16, 17, 33] {
            let x = rand_vec(&mut rng, m * k, 2.0);
            let want = reference::matmul_fast_pair_tiles(&x, m, &w.stored(), Some(&bv));
            for &kernel in &paths {
                for threads in [1, 3] {
                    let got = run(kernel, threads, &x, m, w.packed(), Some(bv));
                    assert!(
                        bits_eq(&got, &want),
                        "{dtype} pair panels n={n} k={k} m={m} {} threads={threads} differ from their emulation",
                        kernel.name()
                    );
                }
            }
            // Each row alone (decode: the vector path) gives the bits it gave in the batch.
            for i in [0, m - 1] {
                let row = run(paths[paths.len() - 1], 2, &x[i * k..(i + 1) * k], 1, w.packed(), Some(bv));
                assert!(bits_eq(&row, &want[i * n..(i + 1) * n]), "{dtype} n={n} k={k} m={m}: row {i} alone differs");
            }
        }
    }
}

#[test]
fn fused_swiglu_is_bit_identical_to_two_matmuls() {
    let mut rng = StdRng::seed_from_u64(1602);
    for (dtype, kernel) in DTYPES.into_iter().flat_map(|d| paths(d).into_iter().map(move |k| (d, k))) {
        for &(n, k) in &[(40, 96), (17, 33), (70, 300)] {
            let (g, u) = (
                Packed::new(dtype, &rand_vec(&mut rng, n * k, 1.0), n, k),
                Packed::new(dtype, &rand_vec(&mut rng, n * k, 1.0), n, k),
            );
            for m in [1, 3, 4, 20] {
                let x = rand_vec(&mut rng, m * k, 2.0);
                let (gs, us) = (
                    reference::matmul_fast_pair_tiles(&x, m, &g.stored(), None),
                    reference::matmul_fast_pair_tiles(&x, m, &u.stored(), None),
                );
                let unfused: Vec<f32> = gs.iter().zip(&us).map(|(&g, &u)| gemm::silu(g) * u).collect();
                let mut fused = vec![f32::NAN; m * n];
                pool(2).install(|| {
                    gemm::matmul_swiglu_fast_with(Isa::Avx512, kernel, &x, m, g.packed(), u.packed(), &mut fused)
                });
                assert!(bits_eq(&fused, &unfused), "{dtype} pair-panel swiglu {} n={n} k={k} m={m}", kernel.name());
            }
        }
    }
}

/// Products and sums below f32's normal range: the tiles flush them to zero, and so must the
/// vector path (it sets `MXCSR.FTZ/DAZ`) and the emulation. Without the flush the two paths
/// differ here.
#[test]
fn denormal_results_are_flushed_on_both_paths() {
    for dtype in DTYPES {
        let paths = paths(dtype);
        let mut rng = StdRng::seed_from_u64(1603);
        let (n, k) = (32, 64);
        // Weights near 2^-16 (f16 down to 2^-24) and activations near 2^-110: products near
        // 2^-134. BF16 weights can be denormal themselves: those of every third column are,
        // and meet activations near 2^20, so their products (near 2^-110) are normal and
        // only reading the weights as zero (DAZ) zeroes them.
        let big = |c: usize| dtype == DType::BF16 && c.is_multiple_of(3);
        let wv: Vec<f32> = (0..n * k)
            .map(|i| rng.random_range(-1.0f32..1.0) * if big(i % k) { 1e-39 } else { 2f32.powi(-16) })
            .collect();
        let w = Packed::new(dtype, &wv, n, k);
        for m in [1, 4, 16] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| rng.random_range(-1.0f32..1.0) * if big(i % k) { 2f32.powi(20) } else { 2f32.powi(-110) })
                .collect();
            let want = reference::matmul_fast_pair_tiles(&x, m, &w.stored(), None);
            assert!(want.contains(&0.0), "the case must produce flushed results");
            for &kernel in &paths {
                let got = run(kernel, 1, &x, m, w.packed(), None);
                assert!(
                    bits_eq(&got, &want),
                    "{dtype} denormals {} m={m}: {:?} vs {:?}",
                    kernel.name(),
                    &got[..4],
                    &want[..4]
                );
            }
        }
    }
}

/// BF16 moved from the row layout to pair panels where AMX runs; it must keep its bits: the
/// tiles and the vector replay equal the row layout's AMX kernel (which takes the same tile
/// products with weights and activations in the other tile roles), special values included.
#[test]
fn bf16_panels_give_the_row_amx_kernels_bits() {
    if !isa::amx_bf16_detected() {
        println!("SKIPPED: no AMX-BF16 here (CPU or OS): the row kernel to compare with does not run");
        return;
    }
    let mut rng = StdRng::seed_from_u64(1605);
    let specials = [1e-40, -0.0, f32::from_bits(0x3f80_8000), -1.5e-39, f32::from_bits(0x3f81_8000), -2.5, 0.0, 1.0];
    for &(n, k) in &[(5, 32), (45, 512), (33, 2050), (70, 17), (130, 64)] {
        let wv: Vec<f32> = (0..n * k)
            .map(|i| match i % 11 {
                0 => -0.0,
                3 => 1e-39,
                _ => rng.random_range(-1.0f32..1.0),
            })
            .collect();
        let w = Packed::new(DType::BF16, &wv, n, k);
        let bias = rand_vec(&mut rng, n, 1.0);
        let bv = WeightVec::from_f32(&bias);
        for m in [1, 2, 3, 16, 17, 40] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| if i % 13 == 0 { specials[i % specials.len()] } else { rng.random_range(-3.0..3.0) })
                .collect();
            let rows = run(FastBf16::Amx, 2, &x, m, w.stored(), Some(bv));
            let panels = run(FastBf16::Amx, 2, &x, m, w.packed(), Some(bv));
            assert!(bits_eq(&panels, &rows), "bf16 n={n} k={k} m={m}: pair panels differ from the row AMX kernel");
        }
    }
}

/// The split keeps 16 significant bits of each activation and every bit of each weight:
/// the error is near the f32 path's, far inside the bf16 bound.
#[test]
fn emulation_is_within_the_split_bound_of_f64() {
    let mut rng = StdRng::seed_from_u64(1604);
    for &(m, n, k) in &[(3, 20, 2048), (2, 9, 77)] {
        let w = Packed::new(DType::F16, &rand_vec(&mut rng, n * k, 1.0), n, k);
        let x = rand_vec(&mut rng, m * k, 3.0);
        let got = reference::matmul_fast_pair_tiles(&x, m, &w.stored(), None);
        let want = reference::matmul(&x, m, &w.stored(), None);
        for i in 0..m {
            for j in 0..n {
                let mag: f64 =
                    (0..k).map(|c| (x[i * k + c] as f64 * reference::weight_at(&w.stored(), j, c) as f64).abs()).sum();
                // 2^-16 for the activation split and the dropped lo·lo product, plus a
                // sequential f32 chain over the 3 products of each block.
                let tol = (2f64.powi(-16) + 3.0 * (k as f64 + 6.0) * 2f64.powi(-24)) * mag + 1e-30;
                let err = (got[i * n + j] as f64 - want[i * n + j]).abs();
                assert!(err <= tol, "y[{i},{j}] |err| {err} > {tol}");
            }
        }
    }
}
