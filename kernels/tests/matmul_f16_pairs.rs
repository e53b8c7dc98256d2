//! F16 weights in pair panels under `Precision::Fast` (`matmul::packed_f16`): the AMX path
//! and the vector path against the bit-exact scalar emulation
//! (`reference::matmul_fast_f16_pairs`) for every batch size, split and thread count (so a
//! row's result does not depend on the batch: decode runs the vector path, prefill the
//! tiles), the fused SwiGLU, flushed denormals, and the error against the f64 reference.

mod matmul_util;

use matmul_util::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::matmul::{self, packed_f16, reference, FastBf16, MatSeg};
use tboost_kernels::{DType, WeightMat, WeightVec};

/// The kernels whose F16 pair-panel path runs here: `Amx` (the tiles from
/// `AMX_MIN_ROWS` rows) and `Dot` (the vector path for every m). Fails loudly where this
/// CPU cannot run them, naming what is missing, rather than passing without testing.
fn paths() -> Vec<FastBf16> {
    if !isa::avx512bf16_detected() {
        println!("SKIPPED: this CPU has no AVX512_BF16; f16 pair panels are made only where AMX-BF16 runs");
        return Vec::new();
    }
    let mut v = vec![FastBf16::Dot];
    if isa::amx_bf16_detected() {
        v.push(FastBf16::Amx);
    } else {
        println!("note: no AMX-BF16 here (CPU or OS); only the vector path of f16 pair panels is tested");
    }
    v
}

struct Packed {
    rows: Vec<u8>,
    panels: Vec<u8>,
    n: usize,
    k: usize,
}

impl Packed {
    fn new(vals: &[f32], n: usize, k: usize) -> Packed {
        let rows = half_bytes(DType::F16, vals);
        let mut panels = vec![0u8; packed_f16::packed_bytes(n, k)];
        packed_f16::pack(n, k, &rows[1..], &mut panels);
        Packed { rows, panels, n, k }
    }
    fn stored(&self) -> WeightMat<'_> {
        WeightMat::new(DType::F16, self.n, self.k, &self.rows[1..]).unwrap()
    }
    fn packed(&self) -> WeightMat<'_> {
        WeightMat::f16_pair_panels(self.n, self.k, &self.panels).unwrap()
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
    let mut out = vec![f32::NAN; m * w.rows];
    pool(threads)
        .install(|| matmul::matmul_fast_with(Isa::Avx512, kernel, x, m, &mut [MatSeg { w, bias, out: &mut out }]));
    out
}

#[test]
fn both_paths_match_the_emulation_for_every_batch_and_split() {
    let paths = paths();
    if paths.is_empty() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(1601);
    let a = packed_f16::AMX_MIN_ROWS;
    // k: whole 32-blocks, partial and odd ones, none (bias alone); n: partial and several
    // panels, more than the four C tiles of a group; m: around the AMX threshold and the
    // 16-row tiles.
    for &(n, k) in &[(5, 32), (16, 100), (45, 512), (33, 2050), (70, 17), (20, 0), (130, 64)] {
        let w = Packed::new(&rand_vec(&mut rng, n * k, 1.0), n, k);
        let bias = rand_vec(&mut rng, n, 1.0);
        let bv = WeightVec::from_f32(&bias);
        for m in [1, 2, a - 1, a, a + 1, 15, 16, 17, 33] {
            let x = rand_vec(&mut rng, m * k, 2.0);
            let want = reference::matmul_fast_f16_pairs(&x, m, &w.stored(), Some(&bv));
            for &kernel in &paths {
                for threads in [1, 3] {
                    let got = run(kernel, threads, &x, m, w.packed(), Some(bv));
                    assert!(
                        bits_eq(&got, &want),
                        "f16 pair panels n={n} k={k} m={m} {} threads={threads} differ from their emulation",
                        kernel.name()
                    );
                }
            }
            // Each row alone (decode: the vector path) gives the bits it gave in the batch.
            for i in [0, m - 1] {
                let row = run(paths[paths.len() - 1], 2, &x[i * k..(i + 1) * k], 1, w.packed(), Some(bv));
                assert!(bits_eq(&row, &want[i * n..(i + 1) * n]), "n={n} k={k} m={m}: row {i} alone differs");
            }
        }
    }
}

#[test]
fn fused_swiglu_is_bit_identical_to_two_matmuls() {
    let paths = paths();
    let mut rng = StdRng::seed_from_u64(1602);
    for &kernel in &paths {
        for &(n, k) in &[(40, 96), (17, 33), (70, 300)] {
            let (g, u) = (
                Packed::new(&rand_vec(&mut rng, n * k, 1.0), n, k),
                Packed::new(&rand_vec(&mut rng, n * k, 1.0), n, k),
            );
            for m in [1, 3, 4, 20] {
                let x = rand_vec(&mut rng, m * k, 2.0);
                let (gs, us) = (
                    reference::matmul_fast_f16_pairs(&x, m, &g.stored(), None),
                    reference::matmul_fast_f16_pairs(&x, m, &u.stored(), None),
                );
                let unfused: Vec<f32> = gs.iter().zip(&us).map(|(&g, &u)| matmul::silu(g) * u).collect();
                let mut fused = vec![f32::NAN; m * n];
                pool(2).install(|| {
                    matmul::matmul_swiglu_fast_with(Isa::Avx512, kernel, &x, m, g.packed(), u.packed(), &mut fused)
                });
                assert!(bits_eq(&fused, &unfused), "f16 pair-panel swiglu {} n={n} k={k} m={m}", kernel.name());
            }
        }
    }
}

/// Products and sums below f32's normal range: the tiles flush them to zero, and so must the
/// vector path (it sets `MXCSR.FTZ/DAZ`) and the emulation. Without the flush the two paths
/// differ here.
#[test]
fn denormal_results_are_flushed_on_both_paths() {
    let paths = paths();
    let mut rng = StdRng::seed_from_u64(1603);
    let (n, k) = (32, 64);
    // f16 weights down to 2^-24 and activations near 2^-110: products near 2^-134.
    let wv: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0f32..1.0) * 2f32.powi(-16)).collect();
    let w = Packed::new(&wv, n, k);
    for m in [1, 4, 16] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0) * 2f32.powi(-110)).collect();
        let want = reference::matmul_fast_f16_pairs(&x, m, &w.stored(), None);
        assert!(want.contains(&0.0), "the case must produce flushed results");
        for &kernel in &paths {
            let got = run(kernel, 1, &x, m, w.packed(), None);
            assert!(bits_eq(&got, &want), "denormals {} m={m}: {:?} vs {:?}", kernel.name(), &got[..4], &want[..4]);
        }
    }
}

/// The split keeps 16 significant bits of each activation and every bit of each weight:
/// the error is near the f32 path's, far inside the bf16 bound.
#[test]
fn emulation_is_within_the_split_bound_of_f64() {
    let mut rng = StdRng::seed_from_u64(1604);
    for &(m, n, k) in &[(3, 20, 2048), (2, 9, 77)] {
        let w = Packed::new(&rand_vec(&mut rng, n * k, 1.0), n, k);
        let x = rand_vec(&mut rng, m * k, 3.0);
        let got = reference::matmul_fast_f16_pairs(&x, m, &w.stored(), None);
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
