//! Weights in transparent huge pages.
//!
//! A decode step streams every weight once; over 4 KiB page-cache pages that is one TLB
//! refill per 4 KiB, which costs a GGUF Q4_0 GEMV about 15% of its speed here (tinyllama-1.1b
//! Q4_0, 2 threads: 23.4 → 27.2 tokens/s). So a large model file is copied once at load into
//! anonymous memory marked `MADV_HUGEPAGE` (2 MiB pages), and the copy is what the kernels
//! read. `TBOOST_WEIGHT_PAGES=file` keeps the zero-copy file map instead (several processes
//! then share one page-cache copy of the weights); small files (tests, tokenizers) always
//! stay mapped.

use std::path::Path;

use memmap2::{Mmap, MmapOptions};

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

/// A read-only copy of `map` in anonymous memory advised for huge pages, or `None` (with a
/// debug line) when the kernel refuses the memory: the caller keeps the file map then.
pub fn copy(path: &Path, map: &Mmap) -> Option<Mmap> {
    let mut anon = match MmapOptions::new().len(map.len()).map_anon() {
        Ok(m) => m,
        Err(e) => {
            log::debug!("{}: no anonymous memory for the weights ({e}); reading the file map", path.display());
            return None;
        }
    };
    #[cfg(target_os = "linux")]
    // SAFETY: advice over exactly the mapping just created; it changes only how the kernel
    // backs these pages.
    unsafe {
        libc::madvise(anon.as_mut_ptr() as *mut libc::c_void, anon.len(), libc::MADV_HUGEPAGE);
    }
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
        Ok(m) => Some(m),
        Err(e) => {
            log::debug!("{}: cannot make the weight copy read-only ({e}); reading the file map", path.display());
            None
        }
    }
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
        let copy = copy(f.path(), &map).expect("anonymous memory for 64 MiB");
        assert_eq!(copy.len(), len);
        assert!(copy[..] == bytes[..], "copy differs from the file");
        // The file map still reads the same bytes after its pages were dropped.
        assert!(map[..] == bytes[..], "file map changed");
    }
}
