//! FlashAttention's scratch is bounded by its tile sizes: over an 8192-token prompt it
//! allocates at most `flash_scratch_bytes` (and nothing on a second call: each thread keeps
//! its scratch), where standard attention would materialize
//! heads x 8192² scores. Standard attention materializes scores in row blocks of at most
//! 16 MiB per (sequence, head). Own test binary: the counting allocator sees every
//! allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use tboost_kernels::attention::{
    flash_attention, flash_scratch_bytes, standard_attention, write_kv, AttnParams, KvPool, KvPoolMut, SeqSpan,
};
use tboost_kernels::DType;

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Set on the test thread and the kernel's pool threads: the test harness's own threads
    /// allocate at unpredictable times and are not the kernel's doing.
    static TRACKED: Cell<bool> = const { Cell::new(false) };
}

fn tracked() -> bool {
    TRACKED.try_with(|t| t.get()).unwrap_or(false)
}

fn grew(n: usize) {
    if tracked() {
        let now = CURRENT.fetch_add(n, Ordering::SeqCst).saturating_add(n);
        PEAK.fetch_max(now, Ordering::SeqCst);
    }
}

fn shrank(n: usize) {
    if tracked() {
        // A free of memory allocated before tracking began floors at zero rather than
        // wrapping (which made the next `grew` overflow in debug builds).
        let _ = CURRENT.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| Some(c.saturating_sub(n)));
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(l);
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        shrank(l.size());
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            shrank(l.size());
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The counters are global: the tests of this binary take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn flash_scratch_over_8192_tokens_is_bounded_by_tiles() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const T: usize = 8192;
    let (n_heads, kv_heads, hd, bs) = (4, 2, 16, 16);
    let p = AttnParams::new(n_heads, kv_heads, hd, 0.25);
    let blocks = T / bs;
    let (mut k, mut v) = (vec![0u8; blocks * bs * kv_heads * hd * 2], vec![0u8; blocks * bs * kv_heads * hd * 2]);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let slots: Vec<u32> = (0..T).map(|pos| table[pos / bs] * bs as u32 + (pos % bs) as u32).collect();
    let kv: Vec<f32> = (0..T * kv_heads * hd).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let mut pm = KvPoolMut { dtype: DType::F16, block_size: bs, kv_heads, head_dim: hd, k: &mut k, v: &mut v };
    write_kv(&kv, &kv, &slots, &mut pm);
    let pool = KvPool { dtype: DType::F16, block_size: bs, kv_heads, head_dim: hd, k: &k, v: &v };
    let q: Vec<f32> = (0..T * n_heads * hd).map(|i| ((i * 104729) % 997) as f32 / 997.0 - 0.5).collect();
    let mut out = vec![0.0f32; q.len()];
    let spans = [SeqSpan { q_start: 0, q_len: T, ctx_len: T, block_table: &table }];

    let threads = 2;
    let pool_threads = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .start_handler(|_| TRACKED.with(|t| t.set(true)))
        .build()
        .unwrap();
    TRACKED.with(|t| t.set(true));
    // Warm-up with a smaller tile (a smaller scratch): rayon's per-thread state (e.g. the
    // ~2.3 KB crossbeam-epoch registration made the first time a worker steals a job) is
    // allocated once per thread, not per call, and is not the kernel's scratch. Each thread
    // keeps its scratch between calls, so the measured call only grows it to this tile's.
    let small = AttnParams { tile_kv: 16, ..p };
    assert!(flash_scratch_bytes(&small, 1) < flash_scratch_bytes(&p, 1));
    pool_threads.install(|| flash_attention(&q, &pool, &spans, &small, &mut out));

    let mut measure = || {
        pool_threads.install(|| {
            let base = CURRENT.load(Ordering::SeqCst);
            PEAK.store(base, Ordering::SeqCst);
            flash_attention(&q, &pool, &spans, &p, &mut out);
            PEAK.load(Ordering::SeqCst) - base
        })
    };
    let peak = measure();
    // The same call again: the scratch is reused, nothing is allocated (a decode step).
    let again = measure();
    assert_eq!(again, 0, "a second call of the same shape allocated {again} bytes");
    let bound = flash_scratch_bytes(&p, threads);
    let standard = n_heads * T * T * 4;
    println!("flash scratch peak {peak} B (bound {bound} B) for {T} tokens, {n_heads} heads, head_dim {hd}");
    println!("standard attention would hold {n_heads} x {T}^2 x 4 B = {standard} B of scores for this case");
    println!("  and {} B (32 heads x {T}^2 x 4) for a 32-head model", 32 * T * T * 4);
    assert!(out.iter().all(|x| x.is_finite()), "flash produced non-finite values");
    assert!(peak > 0, "the counting allocator saw no scratch: is it installed?");
    assert!(peak <= bound, "flash allocated {peak} bytes, more than flash_scratch_bytes = {bound}");
    assert!(bound < standard / 1000);
}

/// A 2048-row chunk over a 4096-token context: the whole score matrix would be 32 MiB for
/// one head; standard attention holds at most a 16 MiB block of it, and the blocked rows are
/// bit-identical to the same rows computed in small chunks (one block each).
#[test]
fn standard_attention_scores_are_blocked_without_changing_a_bit() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const T: usize = 4096;
    const Q: usize = 2048;
    let (n_heads, kv_heads, hd, bs) = (1, 1, 8, 16);
    let p = AttnParams::new(n_heads, kv_heads, hd, 0.3);
    let blocks = T / bs;
    let (mut k, mut v) = (vec![0u8; blocks * bs * kv_heads * hd * 4], vec![0u8; blocks * bs * kv_heads * hd * 4]);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let slots: Vec<u32> = (0..T).map(|pos| table[pos / bs] * bs as u32 + (pos % bs) as u32).collect();
    let kv: Vec<f32> = (0..T * kv_heads * hd).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let mut pm = KvPoolMut { dtype: DType::F32, block_size: bs, kv_heads, head_dim: hd, k: &mut k, v: &mut v };
    write_kv(&kv, &kv, &slots, &mut pm);
    let pool = KvPool { dtype: DType::F32, block_size: bs, kv_heads, head_dim: hd, k: &k, v: &v };
    let q: Vec<f32> = (0..Q * n_heads * hd).map(|i| ((i * 104729) % 997) as f32 / 997.0 - 0.5).collect();
    let mut whole = vec![0.0f32; q.len()];
    let spans = [SeqSpan { q_start: 0, q_len: Q, ctx_len: T, block_table: &table }];

    let pool_threads = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .start_handler(|_| TRACKED.with(|t| t.set(true)))
        .build()
        .unwrap();
    TRACKED.with(|t| t.set(true));
    let peak = pool_threads.install(|| {
        let base = CURRENT.load(Ordering::SeqCst);
        PEAK.store(base, Ordering::SeqCst);
        standard_attention(&q, &pool, &spans, &p, &mut whole);
        PEAK.load(Ordering::SeqCst) - base
    });
    let full = Q * T * 4;
    println!("standard attention peak {peak} B for {Q} rows x {T} positions (whole score matrix: {full} B)");
    assert!(peak <= (16 << 20) + (1 << 20), "standard attention held {peak} bytes");
    assert!(peak < full, "the score matrix was not blocked");

    // The same rows in chunks of 256 (each one block): identical bits.
    let first = T - Q;
    for c0 in (0..Q).step_by(256) {
        let rows = &q[c0 * hd..(c0 + 256) * hd];
        let mut out = vec![0.0f32; rows.len()];
        let span = [SeqSpan { q_start: 0, q_len: 256, ctx_len: first + c0 + 256, block_table: &table }];
        pool_threads.install(|| standard_attention(rows, &pool, &span, &p, &mut out));
        assert!(
            out.iter().zip(&whole[c0 * hd..(c0 + 256) * hd]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "rows {c0}..{} differ between the blocked call and a chunked one",
            c0 + 256
        );
    }
}
