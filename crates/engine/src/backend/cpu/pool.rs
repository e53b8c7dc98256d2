//! The CPU backend's compute pool: `threads` rayon workers named `tboost-cpu-{i}`,
//! optionally each pinned to its own CPU.
//!
//! Pinning (the `pin_threads` key, `TBOOST_PIN_THREADS=1`) puts worker `i` on the `i`-th CPU this process may run
//! on (its `sched_getaffinity` set, so a host's own affinity is respected), when there are
//! at least as many such CPUs as workers. Unpinned, the scheduler may run two workers on
//! one CPU; pinned, each op's split runs on distinct CPUs. It changes no result (the
//! kernels' outputs do not depend on the split).
//!
//! While the backend runs a queue of ops, the workers that do not run it poll for the ops'
//! parallel tasks instead of sleeping between ops ([`with_workers_polling`]).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The CPUs this process may run on, in increasing order (empty if unknown).
#[cfg(target_os = "linux")]
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: `set` is a plain bit set of the size passed; the call only writes it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// Pins the calling thread to `cpu`; false if the kernel refused.
#[cfg(target_os = "linux")]
fn pin_to(cpu: usize) -> bool {
    // SAFETY: as above; pid 0 is the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn allowed_cpus() -> Vec<usize> {
    Vec::new()
}

#[cfg(not(target_os = "linux"))]
fn pin_to(_cpu: usize) -> bool {
    false
}

/// Builds the compute pool of `threads` workers (pinned when `pin_requested` — the
/// `pin_threads` key — and the process may use enough CPUs). The error says what failed.
pub(crate) fn build_pool(threads: usize, pin_requested: bool) -> Result<rayon::ThreadPool, String> {
    let cpus = if pin_requested { allowed_cpus() } else { Vec::new() };
    let pin = cpus.len() >= threads && threads > 1;
    if pin_requested && !pin {
        log::warn!("pin_threads: {threads} workers but {} usable CPUs; not pinning", cpus.len());
    }
    let mut b = rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("tboost-cpu-{i}"));
    if pin {
        b = b.start_handler(move |i| {
            if !pin_to(cpus[i]) {
                log::warn!("pin_threads: could not pin worker {i} to CPU {}", cpus[i]);
            }
        });
    }
    b.build().map_err(|e| format!("cannot start {threads} threads: {e}"))
}

/// Runs `f` on this pool worker while every other worker of its pool polls for work
/// (`rayon::yield_now`) instead of going to sleep between the parallel loops inside `f`.
///
/// Why: in a decode step the matmuls are separated by short serial ops (norms, rope, a
/// head's attention). An idle rayon worker sleeps after about 33 empty polls, and waking it
/// again took a mean 20 us per matmul on the Xeon VM (Q4_0 tinyllama decode, 39% of the
/// matmuls over 10 us; 1.2 us with the workers polling), while the op itself lasts
/// 75-400 us: the first part of every matmul streamed weights with one thread.
///
/// No allocation (the pollers are `rayon::join` halves on this worker's deque, which the
/// idle workers steal) and no deadlock: a poller that lands on the calling worker, or on a
/// worker already polling, returns at once, and the pollers stop when `f` returns or
/// unwinds. The cost is that the other workers spin for as long as `f` runs.
pub(crate) fn with_workers_polling<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    polling(f, &AtomicUsize::new(0))
}

/// [`with_workers_polling`], counting in `active` the workers polling at any moment.
fn polling<R: Send>(f: impl FnOnce() -> R + Send, active: &AtomicUsize) -> R {
    let (Some(me), threads) = (rayon::current_thread_index(), rayon::current_num_threads()) else {
        return f();
    };
    if threads < 2 {
        return f();
    }
    let done = AtomicBool::new(false);
    let poll = Poll { done: &done, active, me, helpers: threads - 1 };
    let mut f = Some(f);
    let mut out = None;
    let mut run = || {
        let _stop = StopOnDrop(&done);
        if let Some(f) = f.take() {
            out = Some(f());
        }
    };
    spread(threads - 1, &poll, &mut run);
    // `spread` calls `run` exactly once, at its innermost level.
    out.expect("with_workers_polling: the body did not run")
}

/// What the pollers share: when to stop, how many poll, and which worker runs the body.
struct Poll<'a> {
    done: &'a AtomicBool,
    active: &'a AtomicUsize,
    me: usize,
    helpers: usize,
}

/// Puts `helpers` pollers on this worker's deque (one `join` each), then runs `f`.
fn spread(helpers: usize, poll: &Poll<'_>, f: &mut (dyn FnMut() + Send)) {
    if helpers == 0 {
        f();
        return;
    }
    rayon::join(|| spread(helpers - 1, poll, f), || poll_until(poll));
}

/// Sets the flag when dropped, so the pollers stop even if the body panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

thread_local! {
    /// Whether this worker is already inside `poll_until` (a second poller it steals
    /// returns at once).
    static POLLING: Cell<bool> = const { Cell::new(false) };
}

/// Runs the pool's pending jobs as they appear until `done`; returns at once on the worker
/// that runs the body, or on a worker already polling.
fn poll_until(p: &Poll<'_>) {
    if rayon::current_thread_index() == Some(p.me) || POLLING.with(|c| c.replace(true)) {
        return;
    }
    p.active.fetch_add(1, Ordering::Relaxed);
    // Leave the other pollers on the body's deque for the workers still waking up (this one
    // would otherwise steal them and return them at once), for up to a millisecond.
    let t0 = std::time::Instant::now();
    while p.active.load(Ordering::Relaxed) < p.helpers
        && !p.done.load(Ordering::Acquire)
        && t0.elapsed() < std::time::Duration::from_millis(1)
    {
        std::hint::spin_loop();
    }
    while !p.done.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::hint::spin_loop();
        }
    }
    p.active.fetch_sub(1, Ordering::Relaxed);
    POLLING.with(|c| c.set(false));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_has_the_threads_asked_for_pinned_or_not() {
        let pool = build_pool(2, false).unwrap();
        assert_eq!(pool.current_num_threads(), 2);
        let names: Vec<String> = pool.broadcast(|_| std::thread::current().name().unwrap_or_default().to_string());
        assert_eq!(names, ["tboost-cpu-0", "tboost-cpu-1"]);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn pinning_puts_each_worker_on_its_own_allowed_cpu() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty(), "sched_getaffinity works here");
        if cpus.len() < 2 {
            return;
        }
        // The start handler body, run in a pool of our own (the env var is process-wide).
        let c = cpus.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .start_handler(move |i| assert!(pin_to(c[i])))
            .build()
            .unwrap();
        let on: Vec<Vec<usize>> = pool.broadcast(|_| allowed_cpus());
        assert_eq!(on, [vec![cpus[0]], vec![cpus[1]]]);
    }

    /// Waits up to 10 s for `cond`.
    fn eventually(cond: impl Fn() -> bool) -> bool {
        let t0 = std::time::Instant::now();
        while !cond() {
            if t0.elapsed() > std::time::Duration::from_secs(10) {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    #[test]
    fn the_other_worker_polls_through_serial_work_and_stops_after() {
        use rayon::prelude::*;
        let pool = build_pool(2, false).unwrap();
        let active = AtomicUsize::new(0);
        let (out, on) = pool.install(|| {
            polling(
                || {
                    assert!(eventually(|| active.load(Ordering::Relaxed) == 1), "the other worker never polled");
                    // Serial work far longer than rayon's spin before sleeping.
                    std::thread::sleep(std::time::Duration::from_millis(30));
                    assert_eq!(active.load(Ordering::Relaxed), 1, "the other worker stopped polling");
                    let on: std::collections::BTreeSet<Option<usize>> = (0..64)
                        .into_par_iter()
                        .with_max_len(1)
                        .map(|_| {
                            std::thread::sleep(std::time::Duration::from_micros(200));
                            rayon::current_thread_index()
                        })
                        .collect();
                    (42, on)
                },
                &active,
            )
        });
        assert_eq!(out, 42);
        assert_eq!(on.len(), 2, "the parallel loop ran on both workers: {on:?}");
        assert_eq!(active.load(Ordering::Relaxed), 0, "a poller outlived the body");
    }

    #[test]
    fn a_panicking_body_stops_the_pollers_and_the_pool_keeps_working() {
        let pool = build_pool(3, false).unwrap();
        let active = AtomicUsize::new(0);
        let r = pool.install(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                polling(
                    || {
                        assert!(eventually(|| active.load(Ordering::Relaxed) >= 1), "no worker polled");
                        panic!("body failed")
                    },
                    &active,
                )
            }))
        });
        assert!(r.is_err(), "the body's panic reaches the caller");
        assert_eq!(active.load(Ordering::Relaxed), 0, "a poller outlived the panicking body");
        let (a, b) = pool.install(|| rayon::join(|| 1, || 2));
        assert_eq!(a + b, 3);
        // Outside any pool the body simply runs here.
        assert_eq!(with_workers_polling(|| 7), 7);
    }
}
