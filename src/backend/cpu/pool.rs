//! The CPU backend's compute pool: `threads` rayon workers named `tboost-cpu-{i}`,
//! optionally each pinned to its own CPU.
//!
//! Pinning (`TBOOST_PIN_THREADS=1`) puts worker `i` on the `i`-th CPU this process may run
//! on (its `sched_getaffinity` set, so a host's own affinity is respected), when there are
//! at least as many such CPUs as workers. Unpinned workers sleep between ops and the
//! scheduler may wake two of them on one CPU; pinned, each op's split runs on distinct
//! CPUs. It changes no result (the kernels' outputs do not depend on the split).

/// Whether `TBOOST_PIN_THREADS` asks for pinned workers (`1`, `true`, `on`).
fn pin_requested() -> bool {
    std::env::var("TBOOST_PIN_THREADS")
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "on" | "yes"))
        .unwrap_or(false)
}

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

/// Builds the compute pool of `threads` workers (pinned when `TBOOST_PIN_THREADS` asks and
/// the process may use enough CPUs). The error says what failed.
pub(crate) fn build_pool(threads: usize) -> Result<rayon::ThreadPool, String> {
    let cpus = if pin_requested() { allowed_cpus() } else { Vec::new() };
    let pin = cpus.len() >= threads && threads > 1;
    if pin_requested() && !pin {
        log::warn!("TBOOST_PIN_THREADS: {threads} workers but {} usable CPUs; not pinning", cpus.len());
    }
    let mut b = rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("tboost-cpu-{i}"));
    if pin {
        b = b.start_handler(move |i| {
            if !pin_to(cpus[i]) {
                log::warn!("TBOOST_PIN_THREADS: could not pin worker {i} to CPU {}", cpus[i]);
            }
        });
    }
    b.build().map_err(|e| format!("cannot start {threads} threads: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_has_the_threads_asked_for_pinned_or_not() {
        let pool = build_pool(2).unwrap();
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
}
