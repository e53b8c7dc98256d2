//! A streaming-read kernel: the memory-bandwidth yardstick benchmarks compare decode with.

use rayon::prelude::*;

/// Reads every byte of `data` once (in parallel on the current pool) and returns a checksum
/// so the reads cannot be optimized away. Bandwidth = `data.len()` / elapsed time.
pub fn stream_read(data: &[u8]) -> u64 {
    data.par_chunks(1 << 20).map(read_chunk).reduce(|| 0, u64::wrapping_add)
}

fn read_chunk(c: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa::active() >= crate::isa::Isa::Avx2 {
            // SAFETY: AVX2 availability checked at run time.
            return unsafe { read_chunk_avx2(c) };
        }
    }
    read_chunk_scalar(c)
}

fn read_chunk_scalar(c: &[u8]) -> u64 {
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
unsafe fn read_chunk_avx2(c: &[u8]) -> u64 {
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
    lanes.iter().fold(read_chunk_scalar(it.remainder()), |s, &l| s.wrapping_add(l))
}
