//! Quantized matmul throughput (a plain timing harness: short runs, median of repeats).
//!
//! `cargo bench -p tboost-kernels --bench quant -- [bw] [peak] [gemv] [batch] [gemm] [decode] [small]
//! [bf16] [threads=N] [exact] [fast]`
//! - bw:     streaming-read memory bandwidth (the ceiling for m=1 GEMV), and how it depends
//!   on how far apart the threads' streams are
//! - peak:   f32 FMA and bf16 pair-dot peaks of N threads at once (register-only loops), the
//!   yardsticks for gemm
//! - bf16:   BF16 weights under fast precision, rows against pair panels, m = 1..512, and
//!   TinyLlama's other projection shapes at m = 512 (only when named; `COLD_GEMM=1` cycles
//!   the weights at every m)
//! - gemv:   m=1, GB/s of weight bytes per type and shape (weights cycled through > 256 MiB;
//!   `SHAPES=q8_0:4864x896,...` measures those shapes instead)
//! - batch:  m=16 (batched decode; `BATCH_M=N` for another m), GB/s and GFLOP/s
//! - gemm:   m=512, GFLOP/s
//! - small:  m = 1..12, one thread (only when named)
//! - decode: the m=1 matmuls of one Qwen2.5-0.5B Q4_K_M token (24 layers + output head)
//!
//! `exact` / `fast` pick the precision (default: both). Each line is the fastest of many
//! calls; `PCTL=1` also prints each case's percentiles (to stderr, before its line). Shapes:
//! Qwen2.5-0.5B (896 x 4864) and TinyLlama-1.1B (2048 x 5632). Weights are random blocks with
//! ordinary scales; the kernels' speed does not depend on values.

use std::hint::black_box;
use std::time::{Duration, Instant};

use half::f16;
use tboost_kernels::gemm::quant::{matmul_quant_prec, matmul_swiglu_quant_prec, panel_pack, Precision};
use tboost_kernels::gemm::MatSeg;
use tboost_kernels::{DType, WeightMat};

/// Bytes of weights cycled through so that calls read from DRAM rather than cache (the
/// machine's L3 may be large: raise with COLD_MIB=N).
fn cold_bytes() -> usize {
    std::env::var("COLD_MIB").ok().and_then(|s| s.parse().ok()).unwrap_or(256usize) << 20
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn weights(dt: DType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut r = Lcg(seed);
    let mut w: Vec<u8> = (0..dt.bytes_for(k).unwrap() * rows).map(|_| r.next() as u8).collect();
    let d = f16::from_f32(0.01).to_le_bytes();
    for b in w.chunks_exact_mut(dt.block_bytes()) {
        let at = if dt == DType::Q6K { 208 } else { 0 };
        b[at..at + 2].copy_from_slice(&d);
        if matches!(dt, DType::Q4K | DType::Q5K) {
            b[2..4].copy_from_slice(&d);
        }
    }
    w
}

/// Whether the Fast runs use the packed panel layout for `dt` (as the CPU backend uploads
/// it); `ROWS=1` measures the GGUF row layout instead.
fn packed_wanted(dt: DType) -> bool {
    panel_pack::packable(dt) && std::env::var_os("ROWS").is_none()
}

/// Bytes in anonymous memory advised for transparent huge pages, as the engine keeps its
/// weights (`model::hugepages`): with 4 KiB pages a GEMV pays a TLB miss per page.
struct Huge(*mut u8, usize);
// SAFETY: owned memory, like a Vec.
unsafe impl Send for Huge {}
unsafe impl Sync for Huge {}
impl Huge {
    fn new(src: &[u8]) -> Huge {
        let len = src.len().max(1);
        // SAFETY: a fresh private anonymous mapping of `len` bytes, filled before use.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert!(p != libc::MAP_FAILED, "mmap {len} bytes");
            libc::madvise(p, len, libc::MADV_HUGEPAGE);
            std::ptr::copy_nonoverlapping(src.as_ptr(), p as *mut u8, src.len());
            Huge(p as *mut u8, src.len())
        }
    }
}
impl std::ops::Deref for Huge {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping holds `self.1` initialized bytes while `self` lives.
        unsafe { std::slice::from_raw_parts(self.0, self.1) }
    }
}
impl Drop for Huge {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1.max(1)) };
    }
}

/// `weights`, packed when asked, in huge pages.
fn weights_in(dt: DType, rows: usize, k: usize, seed: u64, packed: bool) -> Huge {
    let w = weights(dt, rows, k, seed);
    if !packed {
        return Huge::new(&w);
    }
    let mut p = vec![0u8; panel_pack::packed_bytes(dt, rows, k)];
    panel_pack::pack(dt, rows, k, &w, &mut p);
    Huge::new(&p)
}

fn mat(dt: DType, rows: usize, k: usize, data: &[u8], packed: bool) -> WeightMat<'_> {
    if packed {
        WeightMat::packed(dt, rows, k, data).unwrap()
    } else {
        WeightMat::new(dt, rows, k, data).unwrap()
    }
}

/// Activations, 64-byte aligned like the engine's buffers (the tiled kernels copy others).
struct Act(Vec<f32>, usize, usize);
impl std::ops::Deref for Act {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0[self.1..self.1 + self.2]
    }
}

fn x(m: usize, k: usize) -> Act {
    let mut r = Lcg(99);
    let v: Vec<f32> = (0..m * k + 16).map(|_| (r.next() % 2001) as f32 / 1000.0 - 1.0).collect();
    let off = v.as_ptr().align_offset(64);
    Act(v, off, m * k)
}

/// CPU time of the calling thread (Linux), so single-thread numbers do not count the time
/// other processes on this shared machine hold the core.
fn thread_cpu_secs() -> Option<f64> {
    #[cfg(target_os = "linux")]
    {
        #[repr(C)]
        struct Timespec {
            sec: i64,
            nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
        }
        const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
        let mut ts = Timespec { sec: 0, nsec: 0 };
        // SAFETY: clock_gettime writes one timespec to a valid pointer.
        if unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
            return Some(ts.sec as f64 + ts.nsec as f64 * 1e-9);
        }
    }
    None
}

/// Fastest of repeats of `f` on pool `p` lasting about `budget`: thread CPU time with one
/// thread, wall time otherwise (the machine is shared: the fastest run is the one least
/// disturbed by other processes).
fn time(p: &rayon::ThreadPool, budget: Duration, mut f: impl FnMut() + Send) -> f64 {
    let one = p.current_num_threads() == 1;
    p.install(|| {
        f();
        let mut best = f64::MAX;
        let (start, mut runs) = (Instant::now(), 0);
        let mut all = Vec::new();
        while start.elapsed() < budget || runs < 5 {
            let (s, c) = (Instant::now(), thread_cpu_secs());
            f();
            let secs = match (one, c, thread_cpu_secs()) {
                (true, Some(a), Some(b)) => b - a,
                _ => s.elapsed().as_secs_f64(),
            };
            best = best.min(secs);
            all.push(secs);
            runs += 1;
        }
        if std::env::var_os("PCTL").is_some() {
            // The spread behind "fastest": on a VM with a noisy neighbour's memory traffic the
            // typical call can take twice the fastest.
            all.sort_by(f64::total_cmp);
            let q = |f: f64| all[((all.len() - 1) as f64 * f) as usize] * 1e6;
            eprintln!(
                "  {} calls: p10 {:.0} us, p50 {:.0}, p90 {:.0}, mean {:.0}",
                all.len(),
                q(0.1),
                q(0.5),
                q(0.9),
                all.iter().sum::<f64>() / all.len() as f64 * 1e6
            );
        }
        best
    })
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

/// Streaming read of 512 MiB, plain and with software prefetch 8 KiB ahead (as the GEMV does).
fn bandwidth(threads: usize) {
    let n = 512 << 20;
    let buf: Vec<u64> = (0..n / 8).map(|i| i as u64).collect();
    let p = pool(threads);
    for prefetch in [false, true] {
        let secs = time(&p, Duration::from_secs(2), || {
            let s: u64 = {
                use rayon::prelude::*;
                buf.par_chunks(1 << 18)
                    .map(|c| {
                        let mut acc = [0u64; 8];
                        for (i, ch) in c.chunks_exact(8).enumerate() {
                            if prefetch {
                                #[cfg(target_arch = "x86_64")]
                                // SAFETY: prefetch is a hint; it never faults.
                                unsafe {
                                    use std::arch::x86_64::*;
                                    _mm_prefetch::<_MM_HINT_T0>(c.as_ptr().wrapping_add(8 * i + 1024) as *const i8)
                                }
                            }
                            for l in 0..8 {
                                acc[l] = acc[l].wrapping_add(ch[l]);
                            }
                        }
                        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                    })
                    .reduce(|| 0, |a, b| a.wrapping_add(b))
            };
            black_box(s);
        });
        let how = if prefetch { "with prefetch" } else { "plain" };
        println!("bw       threads={threads}: streaming read ({how}) {:.1} GB/s", n as f64 / secs / 1e9);
    }
    // The yardstick `tboost bench` reports: membw::stream_read_with of 256 MiB on huge pages,
    // best of 8 alternating plain and prefetching reads.
    let data = Huge::new(&vec![1u8; 256 << 20]);
    let mut best = 0f64;
    for i in 0..8 {
        let s = Instant::now();
        black_box(p.install(|| tboost_kernels::membw::stream_read_with(&data, i % 2 == 1)));
        best = best.max(data.len() as f64 / s.elapsed().as_secs_f64());
    }
    println!("bw       threads={threads}: membw::stream_read (tboost bench's yardstick) {:.1} GB/s", best / 1e9);
    // How far apart the threads' streams are (kernels/src/par.rs): each thread reading one
    // contiguous half (rayon's split of a task list), against chunks claimed in order.
    for (how, chunk) in [("one half per thread", data.len().div_ceil(threads.max(1))), ("1 MiB chunks", 1 << 20)] {
        let mut best = 0f64;
        for _ in 0..6 {
            let s = Instant::now();
            black_box(p.install(|| {
                use rayon::prelude::*;
                data.par_chunks(chunk).with_max_len(1).map(tboost_kernels::membw::stream_read_serial).sum::<u64>()
            }));
            best = best.max(data.len() as f64 / s.elapsed().as_secs_f64());
        }
        println!("bw       threads={threads}: streams placed {how}: {:.1} GB/s", best / 1e9);
    }
}

/// The f32 FMA and bf16 pair-dot peaks of `threads` threads running at once: 12 independent
/// zmm chains per thread (ymm where the CPU has no AVX-512). Measured, not one thread's times
/// `threads`: with every core busy the clock may be lower.
fn peak(threads: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use rayon::prelude::*;
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f")]
        unsafe fn run(iters: usize) -> f32 {
            let (a, b) = (_mm512_set1_ps(0.999), _mm512_set1_ps(1e-6));
            let mut acc = [_mm512_set1_ps(1.0); 12];
            for _ in 0..iters {
                for v in acc.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, a, b);
                }
            }
            acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run_avx2(iters: usize) -> f32 {
            let (a, b) = (_mm256_set1_ps(0.999), _mm256_set1_ps(1e-6));
            let mut acc = [_mm256_set1_ps(1.0); 12];
            for _ in 0..iters {
                for v in acc.iter_mut() {
                    *v = _mm256_fmadd_ps(*v, a, b);
                }
            }
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), acc.iter().fold(_mm256_setzero_ps(), |s, v| _mm256_add_ps(s, *v)));
            out.iter().sum()
        }
        let iters = 20_000_000;
        let p = pool(threads);
        // One item per thread; a run where one thread took both items is slower and dropped.
        let on_all = |f: &(dyn Fn() + Sync)| {
            time(&p, Duration::from_secs(2), || (0..threads).into_par_iter().with_max_len(1).for_each(|_| f()))
        };
        let gflops =
            |secs: f64, lanes: usize, per_lane: usize| (threads * iters * 12 * lanes * per_lane) as f64 / secs / 1e9;
        if is_x86_feature_detected!("avx512f") {
            let secs = on_all(&|| {
                // SAFETY: AVX-512F checked above.
                black_box(unsafe { run(black_box(iters)) });
            });
            println!("peak     threads={threads}: f32 FMA (zmm) {:.1} GFLOP/s", gflops(secs, 16, 2));
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let secs = on_all(&|| {
                // SAFETY: AVX2 and FMA checked above.
                black_box(unsafe { run_avx2(black_box(iters)) });
            });
            println!("peak     threads={threads}: f32 FMA (ymm) {:.1} GFLOP/s", gflops(secs, 8, 2));
        } else {
            println!("peak     (no AVX2+FMA)");
        }
        // The int8 dot without VNNI: vpmaddubsw (u8 x i8 pairs to i16), then vpmaddwd by
        // ones (i16 pairs to i32), then vpaddd; 32 multiply-adds (64 ops) per ymm. The packed
        // kernels widen once per run of i16 sums for 4- to 6-bit weights, so they can pass it;
        // Q8_0 (signed bytes) cannot.
        #[target_feature(enable = "avx2")]
        unsafe fn run_int8_avx2(iters: usize) -> i32 {
            let (step, one) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
            let mut b = _mm256_set1_epi8(-2);
            let x: [__m256i; 12] = std::array::from_fn(|i| _mm256_set1_epi8(i as i8 + 1));
            let mut acc = [_mm256_setzero_si256(); 12];
            for _ in 0..iters {
                // One shared add per 12 dots keeps the products from being hoisted.
                b = _mm256_add_epi8(b, step);
                for (v, xv) in acc.iter_mut().zip(&x) {
                    *v = _mm256_add_epi32(*v, _mm256_madd_epi16(_mm256_maddubs_epi16(*xv, b), one));
                }
            }
            acc.iter().map(|v| _mm256_extract_epi32::<0>(*v)).sum()
        }
        if is_x86_feature_detected!("avx2") {
            let secs = on_all(&|| {
                // SAFETY: AVX2 checked above.
                black_box(unsafe { run_int8_avx2(black_box(iters / 4)) });
            });
            let gops = (threads * iters / 4 * 12 * 64) as f64 / secs / 1e9;
            println!("peak     threads={threads}: int8 maddubs+maddwd (ymm) {gops:.1} GOP/s");
        }
        // The bf16 pair dot: 16 lanes x 2 products x 2 FLOPs per instruction.
        #[target_feature(enable = "avx512f,avx512bf16")]
        unsafe fn run_bf16(iters: usize) -> f32 {
            let (a, b) = (_mm512_set1_epi32(0x3f80_3f80), _mm512_set1_epi32(0x3380_3380));
            let (a, b) = (std::mem::transmute::<__m512i, __m512bh>(a), std::mem::transmute::<__m512i, __m512bh>(b));
            let mut acc = [_mm512_set1_ps(1.0); 12];
            for _ in 0..iters {
                for v in acc.iter_mut() {
                    *v = _mm512_dpbf16_ps(*v, a, b);
                }
            }
            acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        if is_x86_feature_detected!("avx512bf16") {
            let secs = on_all(&|| {
                // SAFETY: AVX512_BF16 checked above.
                black_box(unsafe { run_bf16(black_box(iters)) });
            });
            println!("peak     threads={threads}: bf16 pair dot {:.1} GFLOP/s", gflops(secs, 16, 4));
        }
    }
}

fn prec_name(p: Precision) -> &'static str {
    match p {
        Precision::Exact => "exact",
        Precision::Fast => "fast ",
    }
}

/// `SHAPES=q8_0:4864x896,q4_0:5632x2048` (type:rows x cols) in place of a bench's own list.
fn shapes_or(default: &[(DType, usize, usize)]) -> Vec<(DType, usize, usize)> {
    let Ok(list) = std::env::var("SHAPES") else { return default.to_vec() };
    fn bad<T>(s: &str) -> T {
        panic!("SHAPES entry {s:?} is not TYPE:ROWSxCOLS (e.g. q8_0:4864x896)")
    }
    list.split(',')
        .map(|s| {
            let (t, dims) = s.split_once(':').unwrap_or_else(|| bad(s));
            let (n, k) = dims.split_once('x').unwrap_or_else(|| bad(s));
            let dt = DType::parse(t).unwrap_or_else(|| bad(s));
            (dt, n.parse().unwrap_or_else(|_| bad(s)), k.parse().unwrap_or_else(|_| bad(s)))
        })
        .collect()
}

fn gemv(threads: usize, prec: Precision) {
    let p = pool(threads);
    let shapes: [(DType, usize, usize); 15] = [
        (DType::Q5_0, 4864, 896),
        (DType::Q5_0, 896, 4864),
        (DType::Q4_0, 4864, 896),
        (DType::Q4_0, 896, 4864),
        (DType::Q8_0, 4864, 896),
        (DType::Q8_0, 896, 4864),
        (DType::Q4K, 896, 4864),
        (DType::Q5K, 896, 4864),
        (DType::Q6K, 896, 4864),
        (DType::Q8_0, 151936, 896),
        (DType::Q4_0, 5632, 2048),
        (DType::Q4_0, 2048, 5632),
        (DType::Q8_0, 5632, 2048),
        (DType::Q4K, 5632, 2048),
        (DType::Q6K, 2048, 5632),
    ];
    for (dt, n, k) in shapes_or(&shapes) {
        let bytes = dt.bytes_for(k).unwrap() * n;
        let copies = if std::env::var_os("HOT").is_some() { 1 } else { (cold_bytes() / bytes).max(2) };
        let packed = prec == Precision::Fast && packed_wanted(dt);
        let ws: Vec<Huge> = (0..copies).map(|c| weights_in(dt, n, k, c as u64, packed)).collect();
        let xs = x(1, k);
        let mut out = vec![0f32; n];
        let mut c = 0;
        let secs = time(&p, Duration::from_millis(1500), || {
            let w = mat(dt, n, k, &ws[c % copies], packed);
            c += 1;
            matmul_quant_prec(prec, &xs, 1, &mut [MatSeg { w, bias: None, out: &mut out }]);
        });
        println!(
            "gemv     threads={threads} {}{} {dt:>5} n={n:>6} k={k:>4}: {:8.1} us  {:5.1} GB/s",
            prec_name(prec),
            if packed { " packed" } else { "" },
            secs * 1e6,
            bytes as f64 / secs / 1e9
        );
    }
}

/// Dense f32 / f16 / bf16 weights (exact precision) at m = 1, 16 and 512, in the row layout
/// and in 16-row panels (`tboost_kernels::gemm::dense::exact_panels`, as the CPU backend uploads them), weights cycled
/// through more than the caches for m < 512. `ROWS=1` measures the row layout only.
/// `len` dense weights (F32, F16 or BF16) uniform in [-1, 1], from the generator seeded `seed`.
fn dense_weights(dt: DType, len: usize, seed: u64) -> Vec<u8> {
    let mut r = Lcg(seed);
    (0..len)
        .flat_map(|_| {
            let v = (r.next() % 2001) as f32 / 1000.0 - 1.0;
            match dt {
                DType::F32 => v.to_le_bytes().to_vec(),
                DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                _ => f16::from_f32(v).to_le_bytes().to_vec(),
            }
        })
        .collect()
}

fn dense(threads: usize) {
    use tboost_kernels::gemm;
    let p = pool(threads);
    let (n, k) = (5632, 2048);
    for dt in [DType::F16, DType::BF16, DType::F32] {
        for m in [1, 16, 512] {
            for packed in [false, true] {
                if packed && std::env::var_os("ROWS").is_some() {
                    continue;
                }
                let bytes = n * k * dt.block_bytes();
                let copies =
                    if m == 512 || std::env::var_os("HOT").is_some() { 1 } else { (cold_bytes() / bytes).max(2) };
                let ws: Vec<Huge> = (0..copies)
                    .map(|c| {
                        let w = dense_weights(dt, n * k, c as u64 + 5);
                        if packed {
                            let mut pk = vec![0u8; tboost_kernels::gemm::dense::exact_panels::packed_bytes(dt, n, k)];
                            tboost_kernels::gemm::dense::exact_panels::pack(dt, n, k, &w, &mut pk);
                            Huge::new(&pk)
                        } else {
                            Huge::new(&w)
                        }
                    })
                    .collect();
                let xs = x(m, k);
                let mut out = vec![0f32; m * n];
                let mut c = 0;
                let secs = time(&p, Duration::from_millis(1500), || {
                    let w = if packed {
                        WeightMat::packed(dt, n, k, &ws[c % copies]).unwrap()
                    } else {
                        WeightMat::new(dt, n, k, &ws[c % copies]).unwrap()
                    };
                    c += 1;
                    gemm::matmul(&xs, m, &mut [MatSeg { w, bias: None, out: &mut out }]);
                });
                println!(
                    "dense    threads={threads} {:>5}{} m={m:>3} n={n} k={k}: {:9.1} us  {:5.1} GB/s  {:6.1} GFLOP/s",
                    dt.to_string(),
                    if packed { " packed" } else { "       " },
                    secs * 1e6,
                    bytes as f64 / secs / 1e9,
                    2.0 * (m * n * k) as f64 / secs / 1e9
                );
            }
        }
    }
}

/// BF16 weights under `Precision::Fast` (the `vdpbf16ps` kernels): rows against pair panels
/// at m = 1, 16, 128 and 512, n=5632 k=2048 (TinyLlama's gate/up), then its down, q/o and
/// k/v shapes at m = 512; weights cycled through more than the caches for m <= 16, and for
/// every m with `COLD_GEMM=1` (as a model's prefill reads them: each matrix once per pass).
/// Compare GFLOP/s with `peak`'s bf16 pair dot line.
fn bf16_fast(threads: usize) {
    use tboost_kernels::gemm;
    if gemm::FastBf16::best() == gemm::FastBf16::Amx {
        return amx_fast(threads);
    }
    if !tboost_kernels::gemm::dense::bf16_pair_panels::applies() {
        println!("bf16     (no avx512bf16 kernel here)");
        return;
    }
    let p = pool(threads);
    let cases = [1, 16, 128, 512].map(|m| (m, 5632, 2048)).into_iter().chain([
        (512, 2048, 5632),
        (512, 2048, 2048),
        (512, 256, 2048),
    ]);
    for (m, n, k) in cases {
        let bytes = n * k * 2;
        for packed in [false, true] {
            let copies =
                if m > 16 && std::env::var_os("COLD_GEMM").is_none() { 1 } else { (cold_bytes() / bytes).max(2) };
            let ws: Vec<Huge> = (0..copies)
                .map(|c| {
                    let w = dense_weights(DType::BF16, n * k, c as u64 + 5);
                    if packed {
                        let mut pk = vec![0u8; tboost_kernels::gemm::dense::bf16_pair_panels::packed_bytes(n, k)];
                        tboost_kernels::gemm::dense::bf16_pair_panels::pack(n, k, &w, &mut pk);
                        Huge::new(&pk)
                    } else {
                        Huge::new(&w)
                    }
                })
                .collect();
            let xs = x(m, k);
            let mut out = vec![0f32; m * n];
            let mut c = 0;
            let secs = time(&p, Duration::from_millis(1500), || {
                let d = &ws[c % copies];
                let w = if packed {
                    WeightMat::pair_panels(n, k, d).unwrap()
                } else {
                    WeightMat::new(DType::BF16, n, k, d).unwrap()
                };
                c += 1;
                gemm::matmul_prec(Precision::Fast, &xs, m, &mut [MatSeg { w, bias: None, out: &mut out }]);
            });
            println!(
                "bf16     threads={threads} fast {} m={m:>3} n={n} k={k}: {:9.1} us  {:5.1} GB/s  {:6.1} GFLOP/s",
                if packed { "pairs" } else { "rows " },
                secs * 1e6,
                bytes as f64 / secs / 1e9,
                2.0 * (m * n * k) as f64 / secs / 1e9
            );
        }
    }
}

/// BF16 weights in rows and BF16 and F16 ones in pair panels under the AMX-BF16 kernels:
/// decode, small batches and prefill, weights cycled as in `gemv` for the small batches.
fn amx_fast(threads: usize) {
    use tboost_kernels::gemm::{self, FastBf16};
    use tboost_kernels::isa;
    let p = pool(threads);
    // BF16 in rows (the row AMX kernel) and in pair panels, F16 in pair panels (both on
    // `amx_pair_panels`: tiles, and the vector replay of their products below `amx_min_rows`).
    for (dt, kernel, pairs) in
        [(DType::BF16, FastBf16::Amx, false), (DType::BF16, FastBf16::Amx, true), (DType::F16, FastBf16::Amx, true)]
    {
        for (m, n, k) in [1, 2, 3, 4, 16, 512].map(|m| (m, 5632, 2048)) {
            let bytes = n * k * 2;
            let copies = if m > 16 { 1 } else { (cold_bytes() / bytes).max(2) };
            let ws: Vec<Huge> = (0..copies)
                .map(|c| {
                    let rows = dense_weights(dt, n * k, c as u64 + 5);
                    if pairs {
                        let mut p = vec![0u8; tboost_kernels::gemm::dense::amx_pair_panels::packed_bytes(n, k)];
                        tboost_kernels::gemm::dense::amx_pair_panels::pack(n, k, &rows, &mut p);
                        Huge::new(&p)
                    } else {
                        Huge::new(&rows)
                    }
                })
                .collect();
            let xs = x(m, k);
            let mut out = vec![0f32; m * n];
            let mut c = 0;
            let secs = time(&p, Duration::from_millis(1500), || {
                let d = &ws[c % copies];
                let w = if pairs && dt == DType::F16 {
                    WeightMat::f16_pair_panels(n, k, d).unwrap()
                } else if pairs {
                    WeightMat::pair_panels(n, k, d).unwrap()
                } else {
                    WeightMat::new(dt, n, k, d).unwrap()
                };
                c += 1;
                gemm::matmul_fast_with(isa::active(), kernel, &xs, m, &mut [MatSeg { w, bias: None, out: &mut out }]);
            });
            println!(
                "amx      threads={threads} {:>5} {:20} m={m:>3} n={n} k={k}: {:9.1} us  {:5.1} GB/s  {:6.1} GFLOP/s",
                dt.to_string(),
                if pairs { "pair panels" } else { "rows" },
                secs * 1e6,
                bytes as f64 / secs / 1e9,
                2.0 * (m * n * k) as f64 / secs / 1e9
            );
        }
    }
}

/// Batched decode: m = 16 activation rows, weights cycled as in `gemv`.
fn batch(threads: usize, prec: Precision) {
    let p = pool(threads);
    // `BATCH_M=N` measures another batch (e.g. where AMX starts to pay).
    let m = std::env::var("BATCH_M").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
    for (dt, n, k) in
        [(DType::Q5_0, 4864, 896), (DType::Q4K, 896, 4864), (DType::Q4_0, 5632, 2048), (DType::Q8_0, 5632, 2048)]
    {
        let bytes = dt.bytes_for(k).unwrap() * n;
        let copies = (cold_bytes() / bytes).max(2);
        let packed = prec == Precision::Fast && packed_wanted(dt);
        let ws: Vec<Huge> = (0..copies).map(|c| weights_in(dt, n, k, c as u64, packed)).collect();
        let xs = x(m, k);
        let mut out = vec![0f32; m * n];
        let mut c = 0;
        let secs = time(&p, Duration::from_millis(1500), || {
            let w = mat(dt, n, k, &ws[c % copies], packed);
            c += 1;
            matmul_quant_prec(prec, &xs, m, &mut [MatSeg { w, bias: None, out: &mut out }]);
        });
        println!(
            "batch    threads={threads} {}{} {dt:>5} m={m} n={n:>5} k={k:>4}: {:8.1} us  {:5.1} GB/s  {:6.1} GFLOP/s",
            prec_name(prec),
            if packed { " packed" } else { "" },
            secs * 1e6,
            bytes as f64 / secs / 1e9,
            2.0 * (m * n * k) as f64 / secs / 1e9
        );
    }
}

fn gemm(threads: usize, prec: Precision) {
    let p = pool(threads);
    let m = 512;
    for (dt, n, k) in [
        (DType::Q5_0, 4864, 896),
        (DType::Q5_0, 896, 896),
        (DType::Q4K, 896, 4864),
        (DType::Q6K, 896, 4864),
        (DType::Q4_0, 5632, 2048),
        (DType::Q8_0, 5632, 2048),
        (DType::Q4K, 2048, 5632),
    ] {
        let packed = prec == Precision::Fast && packed_wanted(dt);
        let wb = weights_in(dt, n, k, 1, packed);
        let w = mat(dt, n, k, &wb, packed);
        let xs = x(m, k);
        let mut out = vec![0f32; m * n];
        let secs = time(&p, Duration::from_secs(2), || {
            matmul_quant_prec(prec, &xs, m, &mut [MatSeg { w, bias: None, out: &mut out }]);
        });
        println!(
            "gemm     threads={threads} {}{} {dt:>5} m={m} n={n:>5} k={k:>4}: {:8.2} ms  {:6.1} GFLOP/s",
            prec_name(prec),
            if packed { " packed" } else { "" },
            secs * 1e3,
            2.0 * (m * n * k) as f64 / secs / 1e9
        );
    }
}

/// The m=1 matmuls of one decode step of Qwen2.5-Coder-0.5B Q4_K_M (types per layer from
/// the model file), every layer with its own weights as in the real model.
fn decode(threads: usize, prec: Precision) {
    let p = pool(threads);
    let (d, ff, kv) = (896, 4864, 128);
    let q6_layers = [0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21];
    struct Layer {
        q: Vec<u8>,
        k: Vec<u8>,
        v: Vec<u8>,
        v_dt: DType,
        o: Vec<u8>,
        gate: Vec<u8>,
        up: Vec<u8>,
        down: Vec<u8>,
        down_dt: DType,
    }
    let layers: Vec<Layer> = (0..24u64)
        .map(|l| {
            let six = q6_layers.contains(&(l as usize));
            let (v_dt, down_dt) = if six { (DType::Q8_0, DType::Q6K) } else { (DType::Q5_0, DType::Q4K) };
            Layer {
                q: weights(DType::Q5_0, d, d, 10 * l),
                k: weights(DType::Q5_0, kv, d, 10 * l + 1),
                v: weights(v_dt, kv, d, 10 * l + 2),
                v_dt,
                o: weights(DType::Q5_0, d, d, 10 * l + 3),
                gate: weights(DType::Q5_0, ff, d, 10 * l + 4),
                up: weights(DType::Q5_0, ff, d, 10 * l + 5),
                down: weights(down_dt, d, ff, 10 * l + 6),
                down_dt,
            }
        })
        .collect();
    let head = weights(DType::Q8_0, 151936, d, 7);
    let total: usize = layers
        .iter()
        .map(|l| l.q.len() + l.k.len() + l.v.len() + l.o.len() + l.gate.len() + l.up.len() + l.down.len())
        .sum::<usize>()
        + head.len();
    let xd = x(1, d);
    let xf = x(1, ff);
    let (mut q, mut k, mut v, mut o, mut h, mut y) =
        (vec![0f32; d], vec![0f32; kv], vec![0f32; kv], vec![0f32; d], vec![0f32; ff], vec![0f32; d]);
    let mut logits = vec![0f32; 151936];
    let secs = time(&p, Duration::from_secs(3), || {
        for l in &layers {
            let wq = WeightMat::new(DType::Q5_0, d, d, &l.q).unwrap();
            let wk = WeightMat::new(DType::Q5_0, kv, d, &l.k).unwrap();
            let wv = WeightMat::new(l.v_dt, kv, d, &l.v).unwrap();
            matmul_quant_prec(
                prec,
                &xd,
                1,
                &mut [
                    MatSeg { w: wq, bias: None, out: &mut q },
                    MatSeg { w: wk, bias: None, out: &mut k },
                    MatSeg { w: wv, bias: None, out: &mut v },
                ],
            );
            let wo = WeightMat::new(DType::Q5_0, d, d, &l.o).unwrap();
            matmul_quant_prec(prec, &xd, 1, &mut [MatSeg { w: wo, bias: None, out: &mut o }]);
            let wg = WeightMat::new(DType::Q5_0, ff, d, &l.gate).unwrap();
            let wu = WeightMat::new(DType::Q5_0, ff, d, &l.up).unwrap();
            matmul_swiglu_quant_prec(prec, &xd, 1, wg, wu, &mut h);
            let wd = WeightMat::new(l.down_dt, d, ff, &l.down).unwrap();
            matmul_quant_prec(prec, &xf, 1, &mut [MatSeg { w: wd, bias: None, out: &mut y }]);
        }
        let wh = WeightMat::new(DType::Q8_0, 151936, d, &head).unwrap();
        matmul_quant_prec(prec, &xd, 1, &mut [MatSeg { w: wh, bias: None, out: &mut logits }]);
    });
    println!(
        "decode   threads={threads} {}: matmuls of one token {:.2} ms ({:.0} MB of weights, {:.1} GB/s) -> at most {:.1} tokens/s",
        prec_name(prec),
        secs * 1e3,
        total as f64 / 1e6,
        total as f64 / secs / 1e9,
        1.0 / secs
    );
}

/// Cost per activation row for m = 1..12 on one thread (where the direct and tiled paths meet).
fn small_m(prec: Precision) {
    let p = pool(1);
    for (dt, n, k) in [(DType::Q5_0, 4864, 896), (DType::Q4K, 896, 4864), (DType::Q8_0, 4864, 896)] {
        let wb = weights(dt, n, k, 1);
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        for m in [1, 2, 3, 4, 6, 8, 12, 16] {
            let xs = x(m, k);
            let mut out = vec![0f32; m * n];
            let secs = time(&p, Duration::from_millis(300), || {
                matmul_quant_prec(prec, &xs, m, &mut [MatSeg { w, bias: None, out: &mut out }]);
            });
            println!("small {} {dt} m={m}: {:.1} us  {:.1} us/row", prec_name(prec), secs * 1e6, secs * 1e6 / m as f64);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let threads: Vec<usize> = match args.iter().find_map(|a| a.strip_prefix("threads=")) {
        Some(t) => vec![t.parse().expect("threads=N")],
        None => vec![1, 2],
    };
    let is_opt = |a: &String| a.starts_with("threads=") || a == "exact" || a == "fast";
    let want = |name: &str| args.iter().all(is_opt) || args.iter().any(|a| a == name);
    let precs: Vec<Precision> = match (args.iter().any(|a| a == "exact"), args.iter().any(|a| a == "fast")) {
        (true, false) => vec![Precision::Exact],
        (false, true) => vec![Precision::Fast],
        _ => vec![Precision::Exact, Precision::Fast],
    };
    println!("isa: {} vnni: {}", tboost_kernels::isa::active().name(), tboost_kernels::isa::vnni_active());
    for &t in &threads {
        if args.iter().any(|a| a == "peak") {
            peak(t);
        }
        if want("bw") {
            bandwidth(t);
        }
        for &prec in &precs {
            if want("gemv") {
                gemv(t, prec);
            }
            if args.iter().any(|a| a == "batch") {
                batch(t, prec);
            }
            if args.iter().any(|a| a == "dense") && prec == Precision::Exact {
                dense(t);
            }
            if args.iter().any(|a| a == "bf16") && prec == Precision::Fast {
                bf16_fast(t);
            }
            if want("gemm") {
                gemm(t, prec);
            }
            if want("decode") {
                decode(t, prec);
            }
            if t == 1 && args.iter().any(|a| a == "small") {
                small_m(prec);
            }
        }
    }
}
