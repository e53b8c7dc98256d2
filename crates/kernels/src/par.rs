//! Running a matmul's tasks on the pool in order.
//!
//! rayon's `par_iter` splits a task list in halves: one thread walks the first half while
//! another steals the second, so two threads stream weights megabytes apart. Here every
//! thread claims the next task from one counter, so the threads walk the list side by side,
//! and a thread that falls behind (a noisy neighbour) simply claims fewer tasks.
//!
//! Measured on tinyllama decode (2 threads, alternating builds): Q4_0 39.5 -> 43.5 tok/s,
//! F16 11.5 -> 14.6. Why is not settled: a first probe suggested far-apart streams read less
//! bandwidth than adjacent ones, but repeated with the order varied
//! (`cargo bench -p tboost-kernels --bench quant -- bw threads=2`, "streams placed" lines)
//! both placements read the same, and this VM's bandwidth swings between about 30 and 52 GB/s
//! on its own.

use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

/// Size of the next task of a decode split when `left` units (bytes, panels) of the matmul
/// remain: `full` until the last `2 × threads` tasks' worth, then `left / (2 × threads)` (a
/// quarter of what is left, for 2 threads), down to `least`. Tasks are claimed in order
/// ([`for_each_in_order`]), so the last ones claimed are the smallest and the threads finish
/// within about one small task of each other. Before, in the model (Q4_0 tinyllama decode,
/// 2 threads, 16.5 even tasks of about 24 us per matmul), a matmul's wall was 14 us longer
/// than each thread's busy time: at the end one thread ran a last task while the other
/// waited. Decode, binaries alternated 5 times: Q4_0 50.2 -> 51.3 tokens/s, F16 14.3 -> 14.6.
pub(crate) fn guided_size(left: usize, threads: usize, full: usize, least: usize) -> usize {
    if threads <= 1 {
        return full;
    }
    (left / (2 * threads)).clamp(least.min(full), full)
}

/// Runs `f` on every item, each exactly once, the pool's threads claiming items in order.
pub(crate) fn for_each_in_order<T: Sync>(items: &[T], f: impl Fn(&T) + Sync + Send) {
    let threads = rayon::current_num_threads().min(items.len());
    if threads <= 1 {
        items.iter().for_each(f);
        return;
    }
    let next = AtomicUsize::new(0);
    (0..threads).into_par_iter().with_max_len(1).for_each(|_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        match items.get(i) {
            Some(item) => f(item),
            None => break,
        }
    });
}
