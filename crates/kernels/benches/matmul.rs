//! MatMul speed: GEMV (decode), batched decode and prefill GEMM, plus a streaming-read
//! baseline to compare GEMV against. Runs on a pool of `TBOOST_BENCH_THREADS` threads
//! (default 2). Weights for the memory-bound cases rotate through copies totalling more
//! than 4x a 32 MiB L3, so each call reads them from DRAM.
//!
//! `cargo bench -p tboost-kernels --bench matmul [-- filter]`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;
use tboost_kernels::gemm::{self, MatSeg};
use tboost_kernels::{DType, WeightMat};

fn weights(dtype: DType, n: usize, k: usize) -> Vec<u8> {
    (0..n * k)
        .flat_map(|i| {
            let v = ((i * 7919 % 1000) as f32 - 500.0) / 1000.0;
            match dtype {
                DType::F32 => v.to_le_bytes().to_vec(),
                DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                _ => half::f16::from_f32(v).to_le_bytes().to_vec(),
            }
        })
        .collect()
}

fn pool() -> rayon::ThreadPool {
    let threads = std::env::var("TBOOST_BENCH_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

fn bench_decode(c: &mut Criterion) {
    let pool = pool();
    let (n, k) = (5632, 2048);
    let mut g = c.benchmark_group("decode_n5632_k2048");
    g.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));

    // Baseline: a plain streaming read over the same amount of memory per iteration.
    let copies = 4 * (128 << 20) / (n * k * 4) + 1;
    let buf: Vec<Vec<f32>> = (0..copies).map(|c| vec![c as f32; n * k]).collect();
    g.throughput(Throughput::Bytes((n * k * 4) as u64));
    let mut i = 0;
    g.bench_function("stream_read_f32", |b| {
        b.iter(|| {
            i = (i + 1) % copies;
            let v = &buf[i];
            pool.install(|| {
                use rayon::prelude::*;
                // 16 independent lanes so the adds keep up with memory.
                v.par_chunks(1 << 16)
                    .map(|c| {
                        let a = c.chunks_exact(16).fold([0f32; 16], |mut a, ch| {
                            for (a, &x) in a.iter_mut().zip(ch) {
                                *a += x;
                            }
                            a
                        });
                        a.iter().sum::<f32>()
                    })
                    .sum::<f32>()
            })
        })
    });
    drop(buf);

    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let copies = (128 << 20) / (n * k * dtype.block_bytes()) + 1;
        let wbs: Vec<Vec<u8>> = (0..copies).map(|_| weights(dtype, n, k)).collect();
        let ws: Vec<WeightMat<'_>> = wbs.iter().map(|b| WeightMat::new(dtype, n, k, b).unwrap()).collect();
        g.throughput(Throughput::Bytes(wbs[0].len() as u64));
        for m in [1usize, 4, 16] {
            let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
            let mut out = vec![0f32; m * n];
            let mut c = 0;
            g.bench_with_input(BenchmarkId::new(format!("{dtype}_weights"), format!("m{m}")), &m, |b, &m| {
                b.iter(|| {
                    c = (c + 1) % copies;
                    pool.install(|| {
                        gemm::matmul(black_box(&x), m, &mut [MatSeg { w: ws[c], bias: None, out: &mut out }])
                    })
                })
            });
            if gemm::fast_bf16_applies(dtype) {
                g.bench_with_input(BenchmarkId::new(format!("{dtype}_weights_fast"), format!("m{m}")), &m, |b, &m| {
                    b.iter(|| {
                        c = (c + 1) % copies;
                        pool.install(|| {
                            gemm::matmul_fast(black_box(&x), m, &mut [MatSeg { w: ws[c], bias: None, out: &mut out }])
                        })
                    })
                });
            }
        }
    }
    g.finish();
}

fn bench_prefill(c: &mut Criterion) {
    let pool = pool();
    let (m, n, k) = (512, 2048, 2048);
    let mut g = c.benchmark_group("prefill_m512_n2048_k2048");
    g.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    // Elements = floating-point operations (2 per multiply-add): read "elem/s" as FLOP/s.
    g.throughput(Throughput::Elements((2 * m * n * k) as u64));
    let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let wb = weights(dtype, n, k);
        let w = WeightMat::new(dtype, n, k, &wb).unwrap();
        let mut out = vec![0f32; m * n];
        g.bench_function(format!("{dtype}_flop"), |b| {
            b.iter(|| pool.install(|| gemm::matmul(black_box(&x), m, &mut [MatSeg { w, bias: None, out: &mut out }])))
        });
        let mut out = vec![0f32; m * n / 2];
        let half = n / 2;
        let (gw, uw) = (w.rows_range(0, half), w.rows_range(half, n));
        g.bench_function(format!("{dtype}_swiglu_flop"), |b| {
            b.iter(|| pool.install(|| gemm::matmul_swiglu(black_box(&x), m, gw, uw, &mut out)))
        });
        if gemm::fast_bf16_applies(dtype) {
            let mut out = vec![0f32; m * n];
            g.bench_function(format!("{dtype}_fast_flop"), |b| {
                b.iter(|| {
                    pool.install(|| gemm::matmul_fast(black_box(&x), m, &mut [MatSeg { w, bias: None, out: &mut out }]))
                })
            });
        }
    }
    g.finish();
}

/// The machine's arithmetic peak, the yardstick of the GEMM numbers: a tight loop of
/// independent AVX-512 FMAs (f32) and, where present, `vdpbf16ps` on every pool thread.
/// Elements = floating-point operations.
fn bench_peak(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const ITERS: usize = 1 << 20;
        const CHAINS: usize = 12;
        #[target_feature(enable = "avx512f")]
        unsafe fn fma_loop(seed: f32) -> f32 {
            let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(seed));
            let mut a = [_mm512_set1_ps(1.0); CHAINS];
            for _ in 0..ITERS {
                for v in a.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, b, c);
                }
            }
            a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        #[target_feature(enable = "avx512f,avx512bf16")]
        unsafe fn dpbf16_loop(seed: f32) -> f32 {
            let x: __m512bh = _mm512_cvtne2ps_pbh(_mm512_set1_ps(seed), _mm512_set1_ps(1.0));
            let mut a = [_mm512_setzero_ps(); CHAINS];
            for _ in 0..ITERS {
                for v in a.iter_mut() {
                    *v = _mm512_dpbf16_ps(*v, x, x);
                }
            }
            a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        if tboost_kernels::isa::active() < tboost_kernels::isa::Isa::Avx512 {
            return;
        }
        let pool = pool();
        let threads = pool.current_num_threads();
        let mut g = c.benchmark_group("peak");
        g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
        g.throughput(Throughput::Elements((threads * ITERS * CHAINS * 32) as u64));
        g.bench_function("f32_fma_flop", |b| {
            b.iter(|| {
                pool.broadcast(|ctx| unsafe { fma_loop(black_box(ctx.index() as f32 * 1e-9)) });
            })
        });
        if tboost_kernels::isa::avx512bf16() {
            g.throughput(Throughput::Elements((threads * ITERS * CHAINS * 64) as u64));
            g.bench_function("bf16_dot_flop", |b| {
                b.iter(|| {
                    pool.broadcast(|ctx| unsafe { dpbf16_loop(black_box(ctx.index() as f32 * 1e-9)) });
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = bench_peak, bench_decode, bench_prefill
}
criterion_main!(benches);
