//! GEMM efficiency against the machine's measured FMA peak, robust to a shared machine:
//! each round times the peak loop (independent AVX-512 FMAs on every thread) and then each
//! GEMM right after it, and prints both and their ratio; the summary is the median ratio.
//!
//! `cargo run --release -p tboost-kernels --example gemm_efficiency -- [threads] [rounds] [m n k]`

use std::hint::black_box;
use std::time::Instant;
use tboost_kernels::matmul::{self, FastBf16, MatSeg};
use tboost_kernels::{DType, WeightMat};

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop(iters: usize, seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(seed));
    let mut a = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for v in a.iter_mut() {
            *v = _mm512_fmadd_ps(*v, b, c);
        }
    }
    a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let threads = args.first().copied().unwrap_or(2);
    let rounds = args.get(1).copied().unwrap_or(5);
    let (m, n, k) = (
        args.get(2).copied().unwrap_or(512),
        args.get(3).copied().unwrap_or(2048),
        args.get(4).copied().unwrap_or(2048),
    );
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
    let vals: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 1000.0).collect();
    let enc = |d: DType| -> Vec<u8> {
        vals.iter()
            .flat_map(|&v| match d {
                DType::F32 => v.to_le_bytes().to_vec(),
                DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
            })
            .collect()
    };
    let off = FastBf16::Off;
    let mut mats: Vec<(String, DType, Vec<u8>, FastBf16)> = vec![
        ("f32".into(), DType::F32, enc(DType::F32), off),
        ("f16".into(), DType::F16, enc(DType::F16), off),
        ("bf16".into(), DType::BF16, enc(DType::BF16), off),
    ];
    if tboost_kernels::isa::avx512bf16() {
        mats.push(("bf16-fast-dot".into(), DType::BF16, enc(DType::BF16), FastBf16::Dot));
    }
    if tboost_kernels::isa::amx_bf16() {
        mats.push(("bf16-fast-amx".into(), DType::BF16, enc(DType::BF16), FastBf16::Amx));
    }
    let flop = 2.0 * (m * n * k) as f64;
    let mut out = vec![0f32; m * n];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); mats.len()];
    for r in 0..rounds {
        let iters = 1 << 21;
        let t = Instant::now();
        pool.broadcast(|c| unsafe { black_box(fma_loop(iters, black_box(c.index() as f32 * 1e-9))) });
        let peak = (threads * iters * 12 * 32) as f64 / t.elapsed().as_secs_f64();
        let mut line = format!("round {r}: peak {:.1} GFLOP/s", peak / 1e9);
        for (i, (name, d, bytes, kernel)) in mats.iter().enumerate() {
            let w = WeightMat::new(*d, n, k, bytes).unwrap();
            let run = |out: &mut Vec<f32>| {
                pool.install(|| {
                    let mut segs = [MatSeg { w, bias: None, out }];
                    matmul::matmul_fast_with(tboost_kernels::isa::active(), *kernel, &x, m, &mut segs)
                })
            };
            run(&mut out);
            let t = Instant::now();
            run(&mut out);
            let g = flop / t.elapsed().as_secs_f64();
            ratios[i].push(g / peak);
            line += &format!(" | {name} {:.1} ({:.0}%)", g / 1e9, 100.0 * g / peak);
        }
        println!("{line}");
    }
    for (i, (name, ..)) in mats.iter().enumerate() {
        let mut v = ratios[i].clone();
        v.sort_by(f64::total_cmp);
        println!(
            "median {name}: {:.0}% of the FMA peak (m={m} n={n} k={k}, {threads} threads)",
            100.0 * v[v.len() / 2]
        );
    }
}
