//! The steady decode step allocates no large buffers: after a warm-up (every pool thread has
//! run every op), a step of 16
//! sequences makes no heap allocation of 16 KiB or more (kernel scratch is kept per thread,
//! activations are reserved at load) and few small ones (a call's segments and work items
//! live on the stack). Own test binary: the counting allocator sees every allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tboost_engine::backend::DType;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::plan::PrecisionPolicy;
use tboost_engine::sched::Request;

struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

fn seen(size: usize) {
    if ON.load(Ordering::Relaxed) {
        COUNT.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(size, Ordering::Relaxed);
        LARGEST.fetch_max(size, Ordering::Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        seen(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        seen(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        seen(new);
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Largest single allocation a steady step may make (the flash-attention scratch, once
/// allocated per rayon split, was 66 KiB on this model).
const LARGE: usize = 16 << 10;
/// Allocations per step of 16 sequences on the small model: 17-30 today (the scheduler's
/// and runner's per-step lists; was 379 before kernel scratch and dispatch lists were kept);
/// this catches a per-op, per-row or per-head allocation.
const MAX_PER_STEP: usize = 100;

#[test]
fn steady_decode_steps_make_no_large_allocations() {
    for (dtype, precision) in [
        (DType::F32, PrecisionPolicy::Exact),
        (DType::Q4_0, PrecisionPolicy::Fast),
        (DType::BF16, PrecisionPolicy::Fast),
    ] {
        let model = tboost_testkit::synthetic::build("small", dtype, 7).unwrap();
        let cfg = EngineConfig {
            threads: 2,
            kv_size: KvSize::Blocks(300),
            max_batched_tokens: 512,
            precision,
            ..Default::default()
        };
        let e = Engine::new(cfg).unwrap();
        e.load_model(&model).unwrap();
        for s in 0..16u32 {
            let prompt: Vec<u32> = (0..20).map(|i| 3 + (i * 7 + s * 13) % 500).collect();
            e.enqueue(Request { ignore_eos: true, ..Request::new(prompt, 200) }).unwrap();
        }
        // Prefill, then decode until every pool thread has run each op at least once: the
        // step's ops run on whichever worker takes the step, and per-thread buffers (the
        // quantized activations, kernel scratch) grow on a thread's first call of a size.
        for _ in 0..40 {
            e.step().unwrap();
        }
        let steps = 20;
        LARGEST.store(0, Ordering::Relaxed);
        let (c0, b0) = (COUNT.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
        ON.store(true, Ordering::Relaxed);
        for _ in 0..steps {
            let out = e.step().unwrap();
            assert_eq!(out.batched_tokens, 16, "{dtype}: the steps measured must be decode steps of 16 sequences");
        }
        ON.store(false, Ordering::Relaxed);
        let (count, bytes) = (COUNT.load(Ordering::Relaxed) - c0, BYTES.load(Ordering::Relaxed) - b0);
        let largest = LARGEST.load(Ordering::Relaxed);
        println!(
            "{dtype} ({precision:?}): {} allocations, {} bytes per decode step of 16 sequences; largest {largest} bytes",
            count / steps,
            bytes / steps
        );
        assert!(largest < LARGE, "{dtype}: a steady decode step allocated {largest} bytes at once");
        assert!(count / steps <= MAX_PER_STEP, "{dtype}: {} allocations per steady decode step", count / steps);
    }
}
