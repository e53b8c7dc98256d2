//! Shared by the quantized-matmul test binaries: random GGUF blocks that stress the
//! kernels, random activations, bit-exact comparison, and pools of a given size.
#![allow(dead_code)]

use half::f16;
use rand::rngs::StdRng;
use rand::Rng;
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::DType;

pub const QUANT: [DType; 12] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::IQ4NL,
    DType::IQ4XS,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
];

pub fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|&i| i <= isa::detected()).collect()
}

/// f16 scales that stress the kernels: the largest, the smallest subnormal, zero, negative.
pub const EXTREME_SCALES: [f32; 7] = [65504.0, -65504.0, 5.9604645e-8, 0.0, -0.0, -0.5, 6.1035156e-5];

pub fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Random blocks: random quant bytes, scales mostly ordinary with some extreme, some blocks all
/// zero and some with every quant bit set.
pub fn random_weights(dt: DType, rows: usize, k: usize, rng: &mut StdRng) -> Vec<u8> {
    let bb = dt.block_bytes();
    let mut w = vec![0u8; dt.bytes_for(k).unwrap() * rows];
    rng.fill(&mut w[..]);
    let scale = |rng: &mut StdRng| {
        if rng.random_range(0..6) == 0 {
            EXTREME_SCALES[rng.random_range(0..EXTREME_SCALES.len())]
        } else {
            rng.random_range(-0.05f32..0.05)
        }
    };
    for b in w.chunks_exact_mut(bb) {
        match rng.random_range(0..16) {
            0 => b.fill(0),
            1 => b.fill(0xFF),
            _ => {}
        }
        match dt {
            DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::IQ4NL | DType::IQ4XS => put_f16(b, 0, scale(rng)),
            DType::Q3K => put_f16(b, 108, scale(rng)),
            DType::Q2K => {
                put_f16(b, 80, scale(rng));
                put_f16(b, 82, scale(rng));
            }
            DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => {
                put_f16(b, 0, scale(rng));
                put_f16(b, 2, scale(rng));
            }
            DType::Q6K => put_f16(b, 208, scale(rng)),
            _ => unreachable!(),
        }
    }
    w
}

pub fn random_x(m: usize, k: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

pub fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (p, q)) in a.iter().zip(b).enumerate() {
        assert!(p.to_bits() == q.to_bits(), "{what}: value {i} is {p} vs {q}");
    }
}

pub fn assert_close(got: &[f32], want: &[f64], tol: &[f64], what: &str) {
    for (i, ((&g, &w), &t)) in got.iter().zip(want).zip(tol).enumerate() {
        assert!((g as f64 - w).abs() <= t, "{what}: value {i} is {g}, f64 reference {w}, tolerance {t}");
    }
}

pub fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}
