//! RMSNorm against the f64 reference; the fused add+norm is bit-identical to add then norm.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::norm::{add_rmsnorm_with, add_with, reference, rmsnorm_with};
use tboost_kernels::{DType, WeightVec};

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|&i| i <= isa::detected()).collect()
}

fn rand_vec(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// Weight bytes in `dtype` and the f32 values they hold.
fn weight(rng: &mut StdRng, dtype: DType, n: usize) -> (Vec<u8>, Vec<f32>) {
    let w = rand_vec(rng, n, 2.0);
    match dtype {
        DType::F32 => (w.iter().flat_map(|x| x.to_le_bytes()).collect(), w),
        DType::F16 => {
            let h: Vec<half::f16> = w.iter().map(|&x| half::f16::from_f32(x)).collect();
            (h.iter().flat_map(|x| x.to_le_bytes()).collect(), h.iter().map(|x| x.to_f32()).collect())
        }
        _ => {
            let h: Vec<half::bf16> = w.iter().map(|&x| half::bf16::from_f32(x)).collect();
            (h.iter().flat_map(|x| x.to_le_bytes()).collect(), h.iter().map(|x| x.to_f32()).collect())
        }
    }
}

const DIMS: [usize; 7] = [1, 7, 16, 64, 100, 896, 4099];

/// Relative to the row's largest |output|: the sum of squares (f32, up to 4099 terms) is
/// the only long computation; measured worst is ~2e-7.
const TOL: f64 = 2e-6;

#[test]
fn rmsnorm_matches_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    let mut worst = 0.0f64;
    for dim in DIMS {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let rows = 5;
            let amp = [1e-3f32, 1.0, 300.0][rng.random_range(0..3)];
            let x = rand_vec(&mut rng, rows * dim, amp);
            let (wb, wf) = weight(&mut rng, dtype, dim);
            let w = WeightVec::new(dtype, dim, &wb).unwrap();
            let want = reference::rmsnorm(&x, &wf, 1e-5f32 as f64);
            for isa in isas() {
                let mut out = vec![0.0f32; x.len()];
                rmsnorm_with(isa, &x, w, 1e-5, &mut out);
                for (r, (o, e)) in out.chunks(dim).zip(want.chunks(dim)).enumerate() {
                    let scale = e.iter().fold(0.0f64, |a, b| a.max(b.abs()));
                    let err = o.iter().zip(e).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
                    worst = worst.max(err / scale);
                    assert!(err <= TOL * scale, "{} dim={dim} {dtype} row {r}: error {err:e} of {scale:e}", isa.name());
                }
            }
        }
    }
    println!("rmsnorm: worst error relative to the row's largest output {worst:e}");
}

#[test]
fn fused_add_rmsnorm_is_bit_identical_to_add_then_rmsnorm() {
    let mut rng = StdRng::seed_from_u64(2);
    for dim in DIMS {
        let rows = 3;
        let res0 = rand_vec(&mut rng, rows * dim, 3.0);
        let x = rand_vec(&mut rng, rows * dim, 3.0);
        let (wb, _) = weight(&mut rng, DType::BF16, dim);
        let w = WeightVec::new(DType::BF16, dim, &wb).unwrap();
        for isa in isas() {
            let mut res_a = res0.clone();
            let mut out_a = vec![0.0f32; x.len()];
            add_with(isa, &mut res_a, &x);
            rmsnorm_with(isa, &res_a, w, 1e-6, &mut out_a);
            let mut res_b = res0.clone();
            let mut out_b = vec![0.0f32; x.len()];
            add_rmsnorm_with(isa, &mut res_b, &x, w, 1e-6, &mut out_b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&res_a), bits(&res_b), "{} dim={dim}: residual", isa.name());
            assert_eq!(bits(&out_a), bits(&out_b), "{} dim={dim}: output", isa.name());
        }
    }
}

#[test]
fn add_is_exact_on_every_isa_and_size() {
    let mut rng = StdRng::seed_from_u64(3);
    for n in [0, 1, 15, 17, 40_000, 100_003] {
        let a = rand_vec(&mut rng, n, 10.0);
        let b = rand_vec(&mut rng, n, 10.0);
        for isa in isas() {
            let mut d = a.clone();
            add_with(isa, &mut d, &b);
            assert!(
                d.iter().zip(a.iter().zip(&b)).all(|(&s, (&x, &y))| s.to_bits() == (x + y).to_bits()),
                "{}",
                isa.name()
            );
        }
    }
}

#[test]
fn a_row_normalizes_the_same_alone_or_in_a_batch() {
    let mut rng = StdRng::seed_from_u64(4);
    let dim = 2048;
    let x = rand_vec(&mut rng, 64 * dim, 1.0);
    let (wb, _) = weight(&mut rng, DType::F32, dim);
    let w = WeightVec::new(DType::F32, dim, &wb).unwrap();
    let mut all = vec![0.0f32; x.len()];
    rmsnorm_with(isa::active(), &x, w, 1e-5, &mut all);
    for r in [0, 17, 63] {
        let mut one = vec![0.0f32; dim];
        rmsnorm_with(isa::active(), &x[r * dim..(r + 1) * dim], w, 1e-5, &mut one);
        assert!(one.iter().zip(&all[r * dim..]).all(|(a, b)| a.to_bits() == b.to_bits()), "row {r}");
    }
}

#[test]
#[should_panic(expected = "rmsnorm: 10 values are not whole rows of 4")]
fn rmsnorm_rejects_partial_rows() {
    let w = [1.0f32; 4];
    rmsnorm_with(Isa::Scalar, &[0.0; 10], WeightVec::from_f32(&w), 1e-5, &mut [0.0; 10]);
}
