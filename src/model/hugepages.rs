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
//! twice. Repacked tensors go into an [`Arena`]: chunks aligned to 2 MiB, so that they get
//! huge pages too.

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

/// Huge-page size the arena aligns to (x86-64 and aarch64 with 4 KiB base pages).
const HUGE: usize = 2 << 20;
/// Bytes of one arena chunk; a tensor larger than a quarter of it gets a mapping of its own.
const ARENA_CHUNK: usize = 64 << 20;
/// Alignment of each region inside a chunk (a page: kernels' aligned loads never straddle).
const REGION_ALIGN: usize = 4096;

/// Anonymous memory for weights a backend repacks one tensor at a time, handed out in
/// regions of large chunks that start on a 2 MiB boundary.
///
/// Why not one mapping per tensor: the kernel backs a mapping with huge pages only over the
/// 2 MiB-aligned ranges inside it, and a per-tensor mapping (a few MiB, placed anywhere) has
/// few of those: on tinyllama-1.1b Q4_0 only 370 of 638 MB of the repacked weights got huge
/// pages (612 of 648 MB in chunks), each 4 KiB page a TLB refill per read (as above). In
/// chunks nearly every byte is huge-page backed; the unused end of a chunk is never touched,
/// so it costs address space, not memory.
#[derive(Default)]
pub struct Arena {
    current: Option<(std::sync::Arc<Chunk>, usize)>,
}

/// One aligned anonymous mapping; regions keep it alive.
pub struct Chunk {
    /// Owns the mapping (unmapped on drop); only reached through `base`.
    _map: MmapMut,
    base: *mut u8,
    len: usize,
}

// SAFETY: a chunk is plain memory; every access goes through a `Region` / `RegionMut`, and
// the arena hands out disjoint ranges only.
unsafe impl Send for Chunk {}
// SAFETY: as for Send: shared access is to disjoint ranges, or reads only.
unsafe impl Sync for Chunk {}

/// A region being filled: the only handle to its bytes until [`RegionMut::freeze`].
pub struct RegionMut {
    chunk: std::sync::Arc<Chunk>,
    offset: usize,
    len: usize,
}

/// A filled region, read-only from here on.
pub struct Region {
    chunk: std::sync::Arc<Chunk>,
    offset: usize,
    len: usize,
}

impl Chunk {
    /// `len` bytes of zeroed anonymous memory starting on a 2 MiB boundary and advised for
    /// huge pages ([`anon`], 2 MiB larger; the unaligned head is never touched).
    fn new(len: usize) -> std::io::Result<Chunk> {
        let mut map = anon(len + HUGE)?;
        let head = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        // SAFETY: `head + len <= map.len()`, so the pointer stays inside the mapping.
        let base = unsafe { map.as_mut_ptr().add(head) };
        Ok(Chunk { _map: map, base, len })
    }
}

impl Arena {
    /// A zeroed region of `len` bytes.
    pub fn alloc(&mut self, len: usize) -> std::io::Result<RegionMut> {
        let need = len.max(1).next_multiple_of(REGION_ALIGN);
        if need > ARENA_CHUNK / 4 {
            // Its own mapping, exactly as long: its partial last 2 MiB stays in small pages
            // rather than faulting in a huge page mostly unused.
            let chunk = std::sync::Arc::new(Chunk::new(need)?);
            return Ok(RegionMut { chunk, offset: 0, len });
        }
        let fits = matches!(&self.current, Some((c, used)) if used + need <= c.len);
        if !fits {
            self.current = Some((std::sync::Arc::new(Chunk::new(ARENA_CHUNK)?), 0));
        }
        let Some((chunk, used)) = self.current.as_mut() else { unreachable!("a chunk was just made") };
        let r = RegionMut { chunk: chunk.clone(), offset: *used, len };
        *used += need;
        Ok(r)
    }
}

impl RegionMut {
    /// The region, now read-only.
    pub fn freeze(self) -> Region {
        Region { chunk: self.chunk, offset: self.offset, len: self.len }
    }
}

impl std::ops::Deref for RegionMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `offset + len` lies inside the chunk, which `self.chunk` keeps mapped; the
        // arena gave this range to this handle alone.
        unsafe { std::slice::from_raw_parts(self.chunk.base.add(self.offset), self.len) }
    }
}

impl std::ops::DerefMut for RegionMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only borrow of the range.
        unsafe { std::slice::from_raw_parts_mut(self.chunk.base.add(self.offset), self.len) }
    }
}

impl std::ops::Deref for Region {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: inside the chunk, kept mapped by `self.chunk`; nothing writes a frozen
        // region (its `RegionMut` was consumed).
        unsafe { std::slice::from_raw_parts(self.chunk.base.add(self.offset), self.len) }
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

    #[test]
    fn arena_regions_are_zeroed_disjoint_and_huge_page_aligned() {
        let mut arena = Arena::default();
        let sizes = [5000, 1, 3 << 20, ARENA_CHUNK / 4 + 1, 4096, ARENA_CHUNK / 4, ARENA_CHUNK / 5];
        let mut regions = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let mut r = arena.alloc(n).unwrap();
            assert_eq!(r.len(), n);
            assert!(r.iter().all(|&b| b == 0), "region {i} of {n} bytes is not zeroed");
            assert_eq!(r.as_ptr() as usize % REGION_ALIGN, 0, "region {i} is not page aligned");
            r.fill(i as u8 + 1);
            regions.push(r.freeze());
        }
        // Every chunk starts on a 2 MiB boundary: the first region, and a tensor larger than
        // a quarter chunk (its own mapping).
        assert_eq!(regions[0].as_ptr() as usize % HUGE, 0);
        assert_eq!(regions[3].as_ptr() as usize % HUGE, 0);
        // Writes to one region never reached another.
        for (i, r) in regions.iter().enumerate() {
            assert!(r.iter().all(|&b| b == i as u8 + 1), "region {i} was overwritten");
        }
        // Small regions share chunks (the point of the arena): the first two are adjacent.
        let (a, b) = (regions[0].as_ptr() as usize, regions[1].as_ptr() as usize);
        assert_eq!(b - a, 5000usize.next_multiple_of(REGION_ALIGN));
        // Regions outlive the arena.
        drop(arena);
        assert!(regions[2].iter().all(|&b| b == 3));
    }
}
