//! Pre-faulting memory-mapped weights at load time.
//!
//! A GGUF or safetensors file is mapped, not read: until a page is touched it may not be in
//! memory at all. On a machine whose page cache is under pressure (a shared build box keeps
//! only a few GB of file pages across all users; a 2.2 GB model written minutes earlier was
//! found 94% evicted) the first forward pass then reads the weights from disk through page
//! faults, and a 512-token prefill took seconds longer than the next one. llama.cpp maps
//! with `MAP_POPULATE` for the same reason.
//!
//! `prefault` asks the kernel to read ahead (`MADV_WILLNEED`) and reads every slice with
//! `pread` into a small buffer, which brings it into the page cache, in slices so a progress
//! bar can follow. It does not map the pages into this process (no `MADV_POPULATE_READ`): the
//! engine reads weights with `pread` too and copies them out, so mapped file pages would only
//! add the whole file to the process's peak RSS while its copies are made. Never by touching
//! the map: a touch of a page past the end of a file truncated since load would be SIGBUS;
//! `pread` returns short, and the prefault skips the rest of that file (building an engine on
//! it is then an error naming the file). It changes no data and no result, only when the
//! reads happen.

use super::weights::ModelWeights;
use crate::formats::files::MappedFile;

/// Bytes per `madvise` call: small enough for a smooth progress bar, large enough that the
/// calls cost nothing.
const SLICE: usize = 64 << 20;
/// Bytes per `pread` of the fallback (a buffer that stays in the caches).
const READ_PIECE: usize = 1 << 20;

impl ModelWeights {
    /// Reads every page of the weights once into the page cache, so building an engine does
    /// not wait on the disk, calling `progress(done, total)` in bytes along the way (progress
    /// bars, the C ABI's load callback). Stops early, returning false, when `progress` returns
    /// false.
    pub fn touch(&self, progress: &mut dyn FnMut(u64, u64) -> bool) -> bool {
        prefault(self, progress)
    }
}

/// Pre-faults every memory-mapped tensor of `weights` (owned tensors are already in memory),
/// calling `progress(done, total)` in bytes. Stops early and returns false when `progress`
/// returns false. A file that shrank since load is not an error here: its pages past the
/// new end are skipped (and counted as done).
pub fn prefault(weights: &ModelWeights, progress: &mut dyn FnMut(u64, u64) -> bool) -> bool {
    // (file, offset, len) of every mapped tensor; the address of the map names the file.
    let mut ranges: Vec<(&MappedFile, usize, usize)> =
        weights.tensors().into_iter().filter_map(|t| t.mapped_from().map(|(f, at)| (f, at, t.bytes().len()))).collect();
    // Tensors of one file are adjacent: merge them so each page is advised once.
    ranges.sort_unstable_by_key(|&(f, at, _)| (f.as_ptr() as usize, at));
    let mut merged: Vec<(&MappedFile, usize, usize)> = Vec::with_capacity(ranges.len());
    for (f, start, len) in ranges {
        match merged.last_mut() {
            Some((mf, s, l)) if std::ptr::eq(*mf, f) && start <= *s + *l + 4096 => *l = (*l).max(start + len - *s),
            _ => merged.push((f, start, len)),
        }
    }
    let total: u64 = merged.iter().map(|&(_, _, l)| l as u64).sum();
    let mut done = 0u64;
    if !progress(0, total) {
        return false;
    }
    let mut buf = Vec::new();
    for &(file, start, len) in &merged {
        let base = file.as_ptr() as usize;
        // SAFETY: every range lies inside the live read-only mapping `file` (held by the
        // tensors of `weights`), and advice never changes its contents.
        unsafe { will_need(base + start, len) };
        let mut off = 0;
        let mut shrank = false;
        while off < len {
            let n = SLICE.min(len - off);
            if !shrank {
                shrank = !read_through(file, start + off, n, &mut buf);
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

/// Reads bytes `at..at + len` of `file` with `pread` (into the page cache; `buf` is scratch);
/// false when the file ends before them (it shrank since load).
fn read_through(file: &MappedFile, at: usize, len: usize, buf: &mut Vec<u8>) -> bool {
    buf.resize(READ_PIECE, 0);
    let mut off = 0;
    while off < len {
        let n = READ_PIECE.min(len - off);
        if let Err(e) = file.read_range(at + off, &mut buf[..n], "(prefault)") {
            log::debug!("prefault stops reading: {e}");
            return false;
        }
        off += n;
    }
    true
}

/// `madvise(MADV_WILLNEED)` over the whole pages covering `start..start + len`: read-ahead
/// into the page cache, without mapping the pages.
///
/// # Safety
/// The range must lie inside a live mapping of this process.
#[cfg(target_os = "linux")]
unsafe fn will_need(start: usize, len: usize) {
    let page = 4096usize;
    let lo = start & !(page - 1);
    let hi = (start + len).div_ceil(page) * page;
    // The mapping starts on a page boundary and covers whole pages, so `lo..hi` stays in it.
    libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_WILLNEED);
}

#[cfg(not(target_os = "linux"))]
unsafe fn will_need(_start: usize, _len: usize) {}
