//! Weights in transparent huge pages.
//!
//! A decode step streams every weight once; over 4 KiB page-cache pages that is one TLB
//! refill per 4 KiB, which costs a GGUF Q4_0 GEMV about 15% of its speed here (tinyllama-1.1b
//! Q4_0, 2 threads: 23.4 → 27.2 tokens/s). So a large model file is copied once at load into
//! anonymous memory marked `MADV_HUGEPAGE` (2 MiB pages), and the copy is what the kernels
//! read. `TBOOST_WEIGHT_PAGES=file` keeps the zero-copy file map instead (several processes
//! then share one page-cache copy of the weights); small files (tests, tokenizers) always
//! stay mapped.
//!
//! A backend that repacks a tensor into its own layout hands the tensor's pages back
//! (`Tensor::release_resident`): whole pages of the copy are mapped from the file again
//! (same bytes, read back only if something reads them), so the weights are not resident
//! twice.

use std::path::Path;

use memmap2::{Mmap, MmapMut, MmapOptions};

use super::tensor::FileCopy;

/// Files below this stay mapped: the copy would not pay for itself.
const MIN_BYTES: usize = 64 << 20;
/// Bytes copied between two releases of the file pages (a multiple of every page size).
const CHUNK: usize = 32 << 20;

/// Whether `len` bytes of weights go into huge pages: large enough, not opted out, and the
/// kernel offers transparent huge pages (`always` or `madvise`).
pub fn wanted(len: usize) -> bool {
    if len < MIN_BYTES {
        return false;
    }
    match std::env::var("TBOOST_WEIGHT_PAGES").as_deref() {
        Ok("file") => return false,
        Ok("huge") | Err(_) => {}
        Ok(other) => {
            log::warn!("TBOOST_WEIGHT_PAGES={other} is not file or huge; using huge");
        }
    }
    thp_available()
}

fn thp_available() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false)
}

/// `len` bytes of zeroed anonymous memory advised for huge pages (weights the CPU backend
/// repacks go there too).
pub fn anon(len: usize) -> std::io::Result<MmapMut> {
    let mut anon = MmapOptions::new().len(len.max(1)).map_anon()?;
    #[cfg(target_os = "linux")]
    // SAFETY: advice over exactly the mapping just created; it changes only how the kernel
    // backs these pages.
    unsafe {
        libc::madvise(anon.as_mut_ptr() as *mut libc::c_void, anon.len(), libc::MADV_HUGEPAGE);
    }
    Ok(anon)
}

/// A read-only copy of `map` (of `file`) in anonymous memory advised for huge pages, or
/// `None` (with a debug line) when the kernel refuses the memory: the caller keeps the file
/// map then.
pub fn copy(path: &Path, map: &Mmap, file: std::fs::File) -> Option<FileCopy> {
    let mut anon = match anon(map.len()) {
        Ok(m) => m,
        Err(e) => {
            log::debug!("{}: no anonymous memory for the weights ({e}); reading the file map", path.display());
            return None;
        }
    };
    // In chunks, dropping each copied chunk's file pages from this process (they stay in the
    // page cache), so the peak RSS of a load stays near one copy of the weights.
    for (i, (dst, src)) in anon.chunks_mut(CHUNK).zip(map.chunks(CHUNK)).enumerate() {
        dst.copy_from_slice(src);
        #[cfg(target_os = "linux")]
        // SAFETY: the range lies inside `map`, a read-only file mapping: dropping its pages
        // only makes a later read fault them in again from the page cache.
        unsafe {
            libc::madvise(map.as_ptr().add(i * CHUNK) as *mut libc::c_void, src.len(), libc::MADV_DONTNEED);
        }
    }
    match anon.make_read_only() {
        Ok(map) => Some(FileCopy { map, file }),
        Err(e) => {
            log::debug!("{}: cannot make the weight copy read-only ({e}); reading the file map", path.display());
            None
        }
    }
}

fn page_bytes() -> usize {
    #[cfg(unix)]
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    #[cfg(not(unix))]
    let p = 4096;
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// The whole pages inside `offset..offset + len` of a mapping that starts at `base` (page
/// aligned): `(start, bytes)`, or `None` when no whole page lies inside.
fn whole_pages(base: *const u8, offset: usize, len: usize) -> Option<(usize, usize)> {
    let page = page_bytes();
    let start = (base as usize + offset).next_multiple_of(page);
    let end = (base as usize + offset + len) / page * page;
    (end > start).then(|| (start, end - start))
}

/// Drops the whole pages of `offset..offset + len` of the file map `map` from this process
/// (a later read faults them in again from the page cache).
pub fn release_file_pages(map: &Mmap, offset: usize, len: usize) {
    #[cfg(target_os = "linux")]
    if let Some((start, bytes)) = whole_pages(map.as_ptr(), offset, len) {
        // SAFETY: the range lies inside `map`, a read-only private file mapping: dropping its
        // pages only makes a later read fault them in again, with the same bytes.
        unsafe { libc::madvise(start as *mut libc::c_void, bytes, libc::MADV_DONTNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (map, offset, len);
}

/// Maps the whole pages of `offset..offset + len` of the huge-page copy `c` from its file
/// again (the copy holds the file's bytes at the same offsets, so reads see no change), which
/// frees their anonymous memory. On failure the copy keeps them (debug line).
pub fn remap_from_file(c: &FileCopy, offset: usize, len: usize) {
    #[cfg(target_os = "linux")]
    if let Some((start, bytes)) = whole_pages(c.map.as_ptr(), offset, len) {
        use std::os::fd::AsRawFd;
        let file_off = start - c.map.as_ptr() as usize;
        // SAFETY: `start..start + bytes` lies inside the copy's mapping, which `c` keeps alive
        // (its drop unmaps the whole range, these pages included). MAP_FIXED replaces those
        // pages with a read-only private map of the same file range, whose bytes the copy
        // already holds: readers, even concurrent ones, see the same values before and after.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                bytes,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                c.file.as_raw_fd(),
                file_off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            log::debug!(
                "could not hand {bytes} bytes of weights back to their file: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (c, offset, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn small_files_stay_mapped() {
        assert!(!wanted(MIN_BYTES - 1));
    }

    #[test]
    fn the_copy_holds_the_files_bytes() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let len = 2 * CHUNK + 12345; // a partial last chunk
        let bytes: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
        f.write_all(&bytes).unwrap();
        f.flush().unwrap();
        let map = crate::model::map_file(f.path()).unwrap();
        let file = std::fs::File::open(f.path()).unwrap();
        let copy = copy(f.path(), &map, file).expect("anonymous memory for 64 MiB");
        assert_eq!(copy.map.len(), len);
        assert!(copy.map[..] == bytes[..], "copy differs from the file");
        // The file map still reads the same bytes after its pages were dropped.
        assert!(map[..] == bytes[..], "file map changed");
        // Handing a range back to the file keeps every byte, and frees its memory.
        let rss = || {
            let s = std::fs::read_to_string("/proc/self/statm").unwrap();
            s.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * page_bytes()
        };
        let before = rss();
        remap_from_file(&copy, 1000, CHUNK + 5000);
        release_file_pages(&map, 0, len);
        let after = rss();
        #[cfg(target_os = "linux")]
        assert!(before.saturating_sub(after) >= CHUNK / 2, "RSS {before} -> {after}: the range stayed resident");
        assert!(copy.map[..] == bytes[..], "a handed-back range changed");
    }
}
