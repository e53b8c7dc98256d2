//! Pre-faulting memory-mapped weights at load time.
//!
//! A GGUF or safetensors file is mapped, not read: until a page is touched it may not be in
//! memory at all. On a machine whose page cache is under pressure (a shared build box keeps
//! only a few GB of file pages across all users; a 2.2 GB model written minutes earlier was
//! found 94% evicted) the first forward pass then reads the weights from disk through page
//! faults, and a 512-token prefill took seconds longer than the next one. llama.cpp maps
//! with `MAP_POPULATE` for the same reason.
//!
//! `prefault` asks the kernel to read ahead (`MADV_WILLNEED`) and to populate the page
//! tables of the whole mapping (`MADV_POPULATE_READ`, Linux 5.14+; with large page-cache
//! folios the kernel then maps most of a file with 2 MiB entries), in slices so a progress
//! bar can follow; elsewhere, or when the kernel refuses, it touches one byte per page.
//! It changes no data and no result, only when the reads happen.

use super::weights::ModelWeights;

/// Bytes per `madvise` call: small enough for a smooth progress bar, large enough that the
/// calls cost nothing.
const SLICE: usize = 64 << 20;

impl ModelWeights {
    /// Reads every page of the weights once, so the first request does not pay for page
    /// faults, calling `progress(done, total)` in bytes along the way (progress bars, the C
    /// ABI's load callback). Stops early, returning false, when `progress` returns false.
    pub fn touch(&self, progress: &mut dyn FnMut(u64, u64) -> bool) -> bool {
        // `prefault` asks the kernel to read the pages in (MADV_POPULATE_READ) before
        // falling back to touching each one.
        prefault(self, progress)
    }
}

/// Pre-faults every memory-mapped tensor of `weights` (owned tensors are already in memory),
/// calling `progress(done, total)` in bytes. Stops early and returns false when `progress`
/// returns false.
pub fn prefault(weights: &ModelWeights, progress: &mut dyn FnMut(u64, u64) -> bool) -> bool {
    let mut ranges: Vec<(usize, usize)> = weights
        .tensors()
        .iter()
        .filter(|t| t.is_mapped())
        .map(|t| {
            let b = t.bytes();
            (b.as_ptr() as usize, b.len())
        })
        .collect();
    // Tensors of one file are adjacent: merge them so each page is advised once.
    ranges.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
    for (start, len) in ranges {
        match merged.last_mut() {
            Some((s, l)) if start <= *s + *l + 4096 => *l = (*l).max(start + len - *s),
            _ => merged.push((start, len)),
        }
    }
    let total: u64 = merged.iter().map(|&(_, l)| l as u64).sum();
    let mut done = 0u64;
    if !progress(0, total) {
        return false;
    }
    for &(start, len) in &merged {
        // SAFETY: every range lies inside a live read-only mapping held by `weights`
        // (tensors keep their storage alive), and advice never changes its contents.
        unsafe { advise(start, len, Advice::WillNeed) };
        let mut off = 0;
        while off < len {
            let n = SLICE.min(len - off);
            // SAFETY: as above; `start + off .. + n` is inside the range.
            if !unsafe { advise(start + off, n, Advice::PopulateRead) } {
                // SAFETY: as above.
                unsafe { touch(start + off, n) };
            }
            off += n;
            done += n as u64;
            if !progress(done, total) {
                return false;
            }
        }
    }
    true
}

#[derive(Clone, Copy)]
enum Advice {
    WillNeed,
    PopulateRead,
}

/// `madvise` over the whole pages covering `start..start + len`; true if the kernel took it.
///
/// # Safety
/// The range must lie inside a live mapping of this process.
#[cfg(target_os = "linux")]
unsafe fn advise(start: usize, len: usize, a: Advice) -> bool {
    let page = 4096usize;
    let lo = start & !(page - 1);
    let hi = (start + len).div_ceil(page) * page;
    let advice = match a {
        Advice::WillNeed => libc::MADV_WILLNEED,
        Advice::PopulateRead => libc::MADV_POPULATE_READ,
    };
    // The mapping starts on a page boundary and covers whole pages, so `lo..hi` stays in it.
    libc::madvise(lo as *mut libc::c_void, hi - lo, advice) == 0
}

#[cfg(not(target_os = "linux"))]
unsafe fn advise(_start: usize, _len: usize, _a: Advice) -> bool {
    false
}

/// Reads one byte per page of `start..start + len`.
///
/// # Safety
/// The range must be readable memory of this process.
unsafe fn touch(start: usize, len: usize) {
    let mut sum = 0u8;
    let mut p = start;
    while p < start + len {
        // Volatile so the page touch is not optimized away.
        sum ^= std::ptr::read_volatile(p as *const u8);
        p += 4096;
    }
    std::hint::black_box(sum);
}
