//! A streaming-read kernel: the memory-bandwidth yardstick benchmarks compare decode with.

use std::sync::atomic::{AtomicU64, Ordering};

/// Reads every byte of `data` once, in parallel on the current pool the way the matmuls
/// split a weight matrix (chunks claimed in order, so the threads stream side by side), and
/// returns a checksum so the reads cannot be optimized away. Bandwidth = `data.len()` /
/// elapsed time.
///
/// `prefetch` adds software prefetches 2 KiB ahead. Which variant is faster depends on the
/// machine (on a Xeon the hardware prefetcher alone left bandwidth unused; on a Zen 4 the
/// prefetches cost a quarter of it), so a roof is the best of both.
pub fn stream_read_with(data: &[u8], prefetch: bool) -> u64 {
    const CHUNK: usize = 256 << 10;
    let chunks: Vec<&[u8]> = data.chunks(CHUNK).collect();
    let sum = AtomicU64::new(0);
    crate::par::for_each_in_order(&chunks, |c| {
        sum.fetch_add(read_part(c, prefetch), Ordering::Relaxed);
    });
    sum.into_inner()
}

/// One thread's plain read of `c` (the benchmarks place the threads' parts themselves).
pub fn stream_read_serial(c: &[u8]) -> u64 {
    read_part(c, false)
}

/// [`stream_read_with`] without software prefetch.
pub fn stream_read(data: &[u8]) -> u64 {
    stream_read_with(data, false)
}

fn read_part(c: &[u8], prefetch: bool) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa::active() >= crate::isa::Isa::Avx512 {
            // SAFETY: AVX-512F availability checked at run time.
            return unsafe {
                if prefetch {
                    read_avx512::<true>(c)
                } else {
                    read_avx512::<false>(c)
                }
            };
        }
        if crate::isa::active() >= crate::isa::Isa::Avx2 {
            // SAFETY: AVX2 availability checked at run time.
            return unsafe { read_avx2(c) };
        }
    }
    let _ = prefetch;
    read_scalar(c)
}

fn read_scalar(c: &[u8]) -> u64 {
    let mut acc = [0u64; 4];
    let mut it = c.chunks_exact(32);
    for b in &mut it {
        for (i, a) in acc.iter_mut().enumerate() {
            *a ^= u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
        }
    }
    acc.iter().fold(it.remainder().iter().map(|&b| b as u64).sum(), |s, &a| s.wrapping_add(a))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_avx2(c: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut a = [_mm256_setzero_si256(); 4];
    let mut it = c.chunks_exact(128);
    for b in &mut it {
        let p = b.as_ptr() as *const __m256i;
        for (i, acc) in a.iter_mut().enumerate() {
            *acc = _mm256_xor_si256(*acc, _mm256_loadu_si256(p.add(i)));
        }
    }
    let x = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
    let mut lanes = [0u64; 4];
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, x);
    lanes.iter().fold(read_scalar(it.remainder()), |s, &l| s.wrapping_add(l))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_avx512<const PREFETCH: bool>(c: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut a = [_mm512_setzero_si512(); 4];
    let mut it = c.chunks_exact(256);
    for b in &mut it {
        let p = b.as_ptr() as *const __m512i;
        if PREFETCH {
            for l in 0..4 {
                _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(2048 + 64 * l) as *const i8);
            }
        }
        for (i, acc) in a.iter_mut().enumerate() {
            *acc = _mm512_xor_si512(*acc, _mm512_loadu_si512(p.add(i) as *const _));
        }
    }
    let x = _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]), _mm512_xor_si512(a[2], a[3]));
    let mut lanes = [0u64; 8];
    _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, x);
    lanes.iter().fold(read_scalar(it.remainder()), |s, &l| s.wrapping_add(l))
}
