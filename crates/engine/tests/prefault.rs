//! `model::prefault`: after it, every page of a mapped model is resident (checked with
//! `mincore` on a file first dropped from the page cache), progress ends at the total, and
//! a `false` from the progress callback stops it.

use tboost_engine::model::prefault::prefault;
use tboost_engine::model::Model;
use tboost_ops::DType;
use tboost_testkit::gguf_write;

/// Pages of `bytes` that are resident (`mincore`), and the page count.
#[cfg(target_os = "linux")]
fn resident(bytes: &[u8]) -> (usize, usize) {
    let page = 4096;
    let lo = bytes.as_ptr() as usize & !(page - 1);
    let hi = (bytes.as_ptr() as usize + bytes.len()).div_ceil(page) * page;
    let n = (hi - lo) / page;
    let mut v = vec![0u8; n];
    // SAFETY: `lo..hi` covers whole pages of a live mapping; `v` has one byte per page.
    let rc = unsafe { libc::mincore(lo as *mut libc::c_void, hi - lo, v.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore");
    (v.iter().filter(|&&b| b & 1 == 1).count(), n)
}

#[cfg(target_os = "linux")]
#[test]
fn prefault_makes_every_weight_page_resident() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.gguf");
    gguf_write::write_synthetic("small", DType::F16, 42, &path, &mut |_, _| {}).unwrap();
    // Drop the file from the page cache (written pages are clean after write_synthetic's sync).
    let f = std::fs::File::open(&path).unwrap();
    // SAFETY: a valid descriptor; advice only.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let model = Model::load(&path).unwrap();
    let lm = model.weights.lm_head.bytes();
    let before = resident(lm);
    assert!(before.0 < before.1, "the output matrix was dropped from the page cache: {before:?}");
    let mut last = (0, 0);
    assert!(prefault(&model.weights, &mut |d, t| {
        last = (d, t);
        true
    }));
    let after = resident(lm);
    assert_eq!(after.0, after.1, "all pages resident after prefault (before: {before:?})");
    let total: u64 = model.weights.tensors().iter().map(|t| t.bytes().len() as u64).sum();
    assert_eq!(last.0, last.1);
    assert!(last.1 >= total, "progress total {} covers the {total} weight bytes", last.1);
}

#[test]
fn prefault_stops_when_progress_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.gguf");
    gguf_write::write_synthetic("small", DType::BF16, 42, &path, &mut |_, _| {}).unwrap();
    let model = Model::load(&path).unwrap();
    let mut calls = 0;
    assert!(!prefault(&model.weights, &mut |_, _| {
        calls += 1;
        false
    }));
    assert_eq!(calls, 1);
    // Owned (in-memory) weights have nothing to fault in: done at once.
    let synth = tboost_testkit::synthetic::build("small", DType::F32, 1).unwrap();
    let mut last = None;
    assert!(prefault(&synth.weights, &mut |d, t| {
        last = Some((d, t));
        true
    }));
    assert_eq!(last, Some((0, 0)));
}
