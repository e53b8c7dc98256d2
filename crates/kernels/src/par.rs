//! Running a matmul's tasks on the pool in order.
//!
//! rayon's `par_iter` splits a task list in halves: one thread walks the first half while
//! another steals the second, so two threads stream weights megabytes apart. Here every
//! thread claims the next task from one counter, so the threads walk the list side by side,
//! and a thread that falls behind (a noisy neighbour) simply claims fewer tasks. Decode is
//! faster this way; why is not settled (`cargo bench -p tboost-kernels --bench quant -- bw
//! threads=2` compares far-apart and adjacent streams). The numbers are in
//! docs/perf/journal.md.

use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

/// Size of the next task of a decode split when `left` units (bytes, panels) of the matmul
/// remain: `full` until the last `2 × threads` tasks' worth, then `left / (2 × threads)` (a
/// quarter of what is left, for 2 threads), down to `least`. Tasks are claimed in order
/// ([`for_each_in_order`]), so the last ones claimed are the smallest and the threads finish
/// within about one small task of each other. With even tasks one thread ran the last task
/// while the other waited, so a matmul's wall was longer than each thread's busy time.
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
