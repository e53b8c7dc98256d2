//! Running a matmul's tasks on the pool in order.
//!
//! rayon's `par_iter` splits a task list in halves: one thread walks the first half while
//! another steals the second, so two threads stream weights megabytes apart. On a 2-vCPU
//! Zen 4 VM two such far-apart streams read 28-32 GB/s where two streams within a megabyte
//! of each other read 50-55 (a streaming read of 256 MiB on huge pages, in 128 MiB halves
//! against chunks of 1 MiB and less). Here every thread
//! claims the next task from one counter, so the threads walk the list side by side, and a
//! thread that falls behind (a noisy neighbour) simply claims fewer tasks.

use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

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
