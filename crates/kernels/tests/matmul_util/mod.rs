//! Shared by the dense `Fast` matmul test binaries (`matmul_fast`, `matmul_pair_tiles`):
//! random values, half-precision bytes at an odd address, bit-exact comparison, pools, one
//! `matmul_fast_with` call.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::Rng;
use tboost_kernels::gemm::{self, FastBf16, MatSeg};
use tboost_kernels::isa::Isa;
use tboost_kernels::{DType, WeightMat, WeightVec};

/// `x · wᵀ + bias` through `matmul_fast_with` on `isa` with `kernel` (outputs start as NaN,
/// so an output the kernel skips shows).
pub fn run_fast(
    isa: Isa,
    kernel: FastBf16,
    x: &[f32],
    m: usize,
    w: WeightMat<'_>,
    bias: Option<WeightVec<'_>>,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    gemm::matmul_fast_with(isa, kernel, x, m, &mut [MatSeg { w, bias, out: &mut out }]);
    out
}

pub fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// `vals` stored as `dtype` (BF16 or F16) after one padding byte, so `&b[1..]` sits at an
/// odd address and unaligned loads are exercised.
pub fn half_bytes(dtype: DType, vals: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8];
    for &v in vals {
        match dtype {
            DType::BF16 => b.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            _ => b.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
        }
    }
    b
}

/// BF16 bytes at an odd address ([`half_bytes`]).
pub fn bf16_bytes(vals: &[f32]) -> Vec<u8> {
    half_bytes(DType::BF16, vals)
}

pub fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}
