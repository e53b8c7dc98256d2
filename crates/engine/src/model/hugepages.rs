//! Weights in transparent huge pages.
//!
//! A decode step streams every weight once; over 4 KiB page-cache pages that is one TLB
//! refill per 4 KiB, which a bandwidth-bound GEMV feels (the measurements are in
//! docs/perf/journal.md). So the CPU backend gives every weight of a large model file its own
//! copy in anonymous memory marked `MADV_HUGEPAGE` (2 MiB pages), an
//! [`Arena`]: repacked tensors are packed there from their stored rows, tensors used as
//! stored are read there ([`fill_in_pieces`], with `pread`: see `Tensor::read_range`), and
//! each tensor's file pages are then dropped from the process (a prefault may have mapped
//! them), so the weights are resident once. `TBOOST_WEIGHT_PAGES=small` (old name
//! `file`) and small files (tests) use 4 KiB pages instead. No weight is read from the file
//! map (an engine build reads them with `pread`), so a model file changed under an engine,
//! running or being built, cannot crash the host.
//!
//! Why per tensor at upload, not the whole file at load: the first touch of fresh memory
//! is what a load costs, and a whole-file copy touched every repacked tensor's bytes twice
//! (the copy, then the panels). On a VM whose host takes back free memory (free page
//! reporting), first-touching fresh huge pages costs far more than writing memory touched
//! before, so each byte is touched once, by the pool's threads side by side.

use memmap2::{Mmap, MmapMut, MmapOptions};
use rayon::prelude::*;

/// Files below this stay mapped: the copy would not pay for itself.
const MIN_BYTES: usize = 64 << 20;
/// Bytes per parallel piece of [`fill_in_pieces`] into fresh memory: whole 2 MiB pages per
/// piece, so no two threads fault in the same huge page.
pub const FRESH_PIECE: usize = 4 << 20;

/// Whether a tensor mapped from a file of `len` bytes is copied into huge pages when a
/// backend reads it in place: the file is large and [`weights_in_huge_pages`].
pub fn wanted(len: usize) -> bool {
    len >= MIN_BYTES && weights_in_huge_pages()
}

/// Whether weights can go into huge pages: the kernel offers transparent huge pages
/// (`always` or `madvise`). Whether they do is the engine's `weight_pages` key (the CPU
/// backend's `small_weight_pages` and its arena's `Arena::new(huge)`).
pub fn weights_in_huge_pages() -> bool {
    // Asked once per tensor: read the kernel's setting once per process.
    static POLICY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POLICY.get_or_init(thp_available)
}

fn thp_available() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false)
}

/// `len` bytes of zeroed anonymous memory, advised for huge pages when `huge` (and against
/// them otherwise, so that `always` mode does not give them anyway).
pub fn anon(len: usize, huge: bool) -> std::io::Result<MmapMut> {
    let mut anon = MmapOptions::new().len(len.max(1)).map_anon()?;
    #[cfg(target_os = "linux")]
    // SAFETY: advice over exactly the mapping just created; it changes only how the kernel
    // backs these pages.
    unsafe {
        let advice = if huge { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
        libc::madvise(anon.as_mut_ptr() as *mut libc::c_void, anon.len(), advice);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = huge;
    Ok(anon)
}

/// `src` copied into a region of `arena` ([`fill_in_pieces`]).
pub fn copy_into(arena: &mut Arena, src: &[u8]) -> std::io::Result<Region> {
    let mut dst = arena.alloc(src.len())?;
    let copied: Result<(), std::convert::Infallible> = fill_in_pieces(&mut dst, FRESH_PIECE, |at, d| {
        d.copy_from_slice(&src[at..at + d.len()]);
        Ok(())
    });
    let Ok(()) = copied;
    Ok(dst.freeze())
}

/// Fills `dst` by calling `fill(offset, piece)` for its consecutive pieces of `piece` bytes,
/// in parallel on the current rayon pool: the first touch of fresh memory is most of a copy's
/// cost, and the pool's threads fault pages in side by side ([`FRESH_PIECE`]). The first
/// error wins.
pub fn fill_in_pieces<E: Send>(
    dst: &mut [u8],
    piece: usize,
    fill: impl Fn(usize, &mut [u8]) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let piece = piece.max(1);
    dst.par_chunks_mut(piece).enumerate().try_for_each(|(i, d)| fill(i * piece, d))
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
/// few of those: much of the repacked weights would stay in 4 KiB pages, each a TLB refill
/// per read (as above). In chunks nearly every byte is huge-page backed; the unused end of a
/// chunk is never touched, so it costs address space, not memory.
pub struct Arena {
    current: Option<(std::sync::Arc<Chunk>, usize)>,
    /// Advise the chunks for huge pages (`weight_pages` = huge), else against them.
    huge: bool,
}

impl Default for Arena {
    fn default() -> Arena {
        Arena::new(true)
    }
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
    /// huge pages when [`weights_in_huge_pages`] ([`anon`], 2 MiB larger; the unaligned head
    /// is never touched).
    fn new(len: usize, huge: bool) -> std::io::Result<Chunk> {
        let mut map = anon(len + HUGE, huge && weights_in_huge_pages())?;
        let head = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        // SAFETY: `head + len <= map.len()`, so the pointer stays inside the mapping.
        let base = unsafe { map.as_mut_ptr().add(head) };
        Ok(Chunk { _map: map, base, len })
    }
}

impl Arena {
    /// An empty arena whose memory is advised for huge pages when `huge` (and the kernel
    /// offers them), else against them.
    pub fn new(huge: bool) -> Arena {
        Arena { current: None, huge }
    }

    /// A zeroed region of `len` bytes.
    pub fn alloc(&mut self, len: usize) -> std::io::Result<RegionMut> {
        let need = len.max(1).next_multiple_of(REGION_ALIGN);
        if need > ARENA_CHUNK / 4 {
            // Its own mapping, exactly as long: its partial last 2 MiB stays in small pages
            // rather than faulting in a huge page mostly unused.
            let chunk = std::sync::Arc::new(Chunk::new(need, self.huge)?);
            return Ok(RegionMut { chunk, offset: 0, len });
        }
        let fits = matches!(&self.current, Some((c, used)) if used + need <= c.len);
        if !fits {
            self.current = Some((std::sync::Arc::new(Chunk::new(ARENA_CHUNK, self.huge)?), 0));
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn small_files_stay_mapped() {
        assert!(!wanted(MIN_BYTES - 1));
    }

    #[test]
    fn a_copy_holds_the_files_bytes_and_the_file_pages_can_be_dropped() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let len = 2 * ARENA_CHUNK + 12345; // several copy pieces and a partial last one
        let bytes: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
        f.write_all(&bytes).unwrap();
        f.flush().unwrap();
        let map = crate::formats::files::map_file(f.path()).unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let mut arena = Arena::default();
        // A small region first, so the copy starts inside a shared chunk too.
        let small = copy_into(&mut arena, &bytes[..100]).unwrap();
        let copy = pool.install(|| copy_into(&mut arena, &map[1000..])).expect("anonymous memory for the copy");
        assert!(small[..] == bytes[..100]);
        assert!(copy[..] == bytes[1000..], "copy differs from the file");
        // Dropping the map's pages frees their memory from this process and keeps every byte.
        let rss = || {
            let s = std::fs::read_to_string("/proc/self/statm").unwrap();
            s.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * page_bytes()
        };
        let before = rss();
        release_file_pages(&map, 0, len);
        let after = rss();
        #[cfg(target_os = "linux")]
        assert!(before.saturating_sub(after) >= ARENA_CHUNK, "RSS {before} -> {after}: the file pages stayed resident");
        assert!(map[..] == bytes[..], "file map changed");
        assert!(copy[..] == bytes[1000..], "the copy changed");
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
