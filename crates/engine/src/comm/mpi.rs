//! The `mpi` communicator: Open MPI's `libmpi.so.40` (Debian's `libopenmpi3`) loaded at run
//! time, so tboost builds and runs where MPI is absent and needs no MPI headers. The ranks
//! are the processes `mpirun` starts; rank and world come from `MPI_COMM_WORLD`.
//!
//! MPI's blocking collectives have no timeout, so every collective here is the non-blocking
//! one (`MPI_Iallreduce`, `MPI_Iallgather`, `MPI_Ibcast`, `MPI_Ibarrier`, MPI-3) polled with
//! `MPI_Test` until it completes or the timeout passes. A collective that timed out stays
//! pending inside MPI: its buffers are leaked on purpose (MPI may still write them) and the
//! communicator refuses every later collective.
//!
//! Open MPI's handles are the addresses of its predefined objects (`MPI_COMM_WORLD` is
//! `&ompi_mpi_comm_world`, `MPI_FLOAT` `&ompi_mpi_float`, `MPI_SUM` `&ompi_mpi_op_sum`;
//! `mpi.h` of Open MPI 4), which `dlsym` returns; `MPI_STATUS_IGNORE` is NULL.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use libloading::Library;

use super::{error, Communicator};
use crate::{Error, Result};

type Handle = *mut c_void;

/// `MPI_THREAD_SERIALIZED` (Open MPI's `mpi.h`): one thread at a time calls MPI, which the
/// engine's step lock guarantees.
const MPI_THREAD_SERIALIZED: c_int = 2;
const MPI_SUCCESS: c_int = 0;

struct Api {
    _lib: Library,
    comm_rank: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    comm_size: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    iallreduce: unsafe extern "C" fn(*const c_void, *mut c_void, c_int, Handle, Handle, Handle, *mut Handle) -> c_int,
    iallgather:
        unsafe extern "C" fn(*const c_void, c_int, Handle, *mut c_void, c_int, Handle, Handle, *mut Handle) -> c_int,
    ibcast: unsafe extern "C" fn(*mut c_void, c_int, Handle, c_int, Handle, *mut Handle) -> c_int,
    ibarrier: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    test: unsafe extern "C" fn(*mut Handle, *mut c_int, *mut c_void) -> c_int,
    finalize: unsafe extern "C" fn() -> c_int,
    abort: unsafe extern "C" fn(Handle, c_int) -> c_int,
    world: Handle,
    float: Handle,
    byte: Handle,
    sum: Handle,
}

// SAFETY: the handles are addresses of Open MPI's immutable predefined objects; calls are
// serialized by `CALL` below.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
static FINALIZED: AtomicBool = AtomicBool::new(false);
/// A collective of this process failed or it left its group: the other ranks can no longer
/// be waited for, so `finalize` ends the job instead.
static BROKEN: AtomicBool = AtomicBool::new(false);
/// MPI is initialized with `MPI_THREAD_SERIALIZED`: one call at a time in the process.
static CALL: Mutex<()> = Mutex::new(());

/// The library names tried, in order (`TBOOST_MPI_LIB` first when set).
fn candidates() -> Vec<String> {
    let mut v: Vec<String> = std::env::var("TBOOST_MPI_LIB").into_iter().filter(|s| !s.is_empty()).collect();
    v.extend(["libmpi.so.40".to_string(), "libmpi.so".to_string()]);
    v
}

fn load() -> std::result::Result<Api, String> {
    let mut why = Vec::new();
    let lib = candidates().into_iter().find_map(|name| {
        // SAFETY: loading Open MPI runs its constructors, which have no preconditions.
        match unsafe { Library::new(&name) } {
            Ok(l) => Some(l),
            Err(e) => {
                why.push(format!("{name}: {e}"));
                None
            }
        }
    });
    let lib = lib.ok_or_else(|| format!("Open MPI is not installed ({}); apt install openmpi-bin", why.join("; ")))?;
    // SAFETY: each symbol is looked up with the C signature of Open MPI 4's mpi.h.
    unsafe {
        macro_rules! f {
            ($name:literal) => {
                *lib.get(concat!($name, "\0").as_bytes()).map_err(|e| format!("{}: {e}", $name))?
            };
        }
        macro_rules! obj {
            ($name:literal) => {{
                let p: *mut c_void =
                    *lib.get::<*mut c_void>(concat!($name, "\0").as_bytes()).map_err(|e| format!("{}: {e}", $name))?;
                p
            }};
        }
        let init_thread: unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, *mut c_int) -> c_int =
            f!("MPI_Init_thread");
        let initialized: unsafe extern "C" fn(*mut c_int) -> c_int = f!("MPI_Initialized");
        let api = Api {
            comm_rank: f!("MPI_Comm_rank"),
            comm_size: f!("MPI_Comm_size"),
            iallreduce: f!("MPI_Iallreduce"),
            iallgather: f!("MPI_Iallgather"),
            ibcast: f!("MPI_Ibcast"),
            ibarrier: f!("MPI_Ibarrier"),
            test: f!("MPI_Test"),
            finalize: f!("MPI_Finalize"),
            abort: f!("MPI_Abort"),
            world: obj!("ompi_mpi_comm_world"),
            float: obj!("ompi_mpi_float"),
            byte: obj!("ompi_mpi_byte"),
            sum: obj!("ompi_mpi_op_sum"),
            _lib: lib,
        };
        let mut done = 0;
        initialized(&mut done);
        if done == 0 {
            let mut provided = 0;
            let rc = init_thread(std::ptr::null_mut(), std::ptr::null_mut(), MPI_THREAD_SERIALIZED, &mut provided);
            if rc != MPI_SUCCESS {
                return Err(format!("MPI_Init_thread failed with {rc}"));
            }
            if provided < MPI_THREAD_SERIALIZED {
                return Err(format!("MPI gives thread level {provided}, tboost needs MPI_THREAD_SERIALIZED"));
            }
        }
        Ok(api)
    }
}

fn api() -> Result<&'static Api> {
    API.get_or_init(load).as_ref().map_err(|e| Error::Unsupported(format!("comm `mpi`: {e}")))
}

/// Ends MPI in this process (once, after the last collective); a no-op when MPI was never
/// started. `mpirun` treats a rank that exits without it as failed.
///
/// When a collective of this process failed (a rank died or hangs) or it left its group,
/// the job cannot end cleanly: the other ranks are dead or still inside a step. Then this
/// calls `MPI_Abort`, which ends every rank and `mpirun`, and does not return. Without it,
/// `mpirun --mca orte_abort_on_non_zero_status 0` (which keeps the leader alive to report a
/// dead follower) waits forever for the dead rank (Open MPI 4.1).
pub fn finalize() {
    if let Some(Ok(a)) = API.get() {
        if !FINALIZED.swap(true, Ordering::SeqCst) {
            let _g = CALL.lock().unwrap_or_else(|p| p.into_inner());
            if BROKEN.load(Ordering::SeqCst) {
                // SAFETY: MPI was initialized by `load`; MPI_Abort takes any communicator.
                unsafe { (a.abort)(a.world, 1) };
            }
            // SAFETY: MPI was initialized by `load`; nothing calls MPI after this.
            unsafe { (a.finalize)() };
        }
    }
}

/// When this process was started by `mpirun` with more than one rank: its place on this node,
/// (local rank, ranks on this node), from the launcher's environment (Open MPI's
/// `OMPI_COMM_WORLD_*`, MPICH/PMI's `PMI_*`), read without starting MPI.
pub fn launched_locally() -> Option<(usize, usize)> {
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<usize>().ok());
    let world = var("OMPI_COMM_WORLD_SIZE").or_else(|| var("PMI_SIZE"))?;
    if world < 2 {
        return None;
    }
    let local = var("OMPI_COMM_WORLD_LOCAL_RANK").or_else(|| var("MPI_LOCALRANKID")).or_else(|| var("PMI_LOCAL_RANK"));
    let local_size =
        var("OMPI_COMM_WORLD_LOCAL_SIZE").or_else(|| var("MPI_LOCALNRANKS")).or_else(|| var("PMI_LOCAL_SIZE"));
    let rank = var("OMPI_COMM_WORLD_RANK").or_else(|| var("PMI_RANK")).unwrap_or(0);
    Some((local.unwrap_or(rank), local_size.unwrap_or(world)))
}

/// This process's rank of `MPI_COMM_WORLD`.
pub struct MpiComm {
    api: &'static Api,
    rank: usize,
    world: usize,
    timeout: Duration,
    broken: Mutex<Option<String>>,
}

impl MpiComm {
    /// Starts MPI (once per process) and joins `MPI_COMM_WORLD`.
    pub fn join_world(timeout: Duration) -> Result<MpiComm> {
        let api = api()?;
        let (mut rank, mut size) = (0, 0);
        let _g = CALL.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: MPI is initialized; the out-pointers are valid.
        unsafe {
            (api.comm_rank)(api.world, &mut rank);
            (api.comm_size)(api.world, &mut size);
        }
        Ok(MpiComm { api, rank: rank as usize, world: size as usize, timeout, broken: Mutex::new(None) })
    }

    /// Starts a collective with `start` and polls it until it completes or the timeout
    /// passes. `keep` holds the buffers MPI reads and writes: leaked if it never completes.
    fn run<K>(&self, op: &str, keep: K, start: impl FnOnce(&mut Handle) -> c_int) -> Result<K> {
        let mut broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = broken.as_ref() {
            return Err(error(self.rank, op, format!("the group is broken: {b}; re-create the engine")));
        }
        if FINALIZED.load(Ordering::SeqCst) {
            return Err(error(self.rank, op, "MPI was finalized"));
        }
        let mut req: Handle = std::ptr::null_mut();
        let rc = {
            let _g = CALL.lock().unwrap_or_else(|p| p.into_inner());
            start(&mut req)
        };
        if rc != MPI_SUCCESS {
            return Err(error(self.rank, op, format!("MPI error {rc}")));
        }
        let deadline = Instant::now() + self.timeout;
        let mut spins = 0u32;
        loop {
            let mut flag = 0;
            let rc = {
                let _g = CALL.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: `req` is the active request `start` made; status ignored (NULL).
                unsafe { (self.api.test)(&mut req, &mut flag, std::ptr::null_mut()) }
            };
            if rc != MPI_SUCCESS {
                let why = format!("MPI_Test failed with {rc} ({} died?)", self.others());
                *broken = Some(why.clone());
                BROKEN.store(true, Ordering::SeqCst);
                std::mem::forget(keep);
                return Err(error(self.rank, op, why));
            }
            if flag != 0 {
                return Ok(keep);
            }
            if Instant::now() >= deadline {
                let why = format!("{} did not complete {op} within {:?} (died or hangs)", self.others(), self.timeout);
                *broken = Some(why.clone());
                BROKEN.store(true, Ordering::SeqCst);
                // MPI may still write into the buffers: never free them.
                std::mem::forget(keep);
                return Err(error(self.rank, op, why));
            }
            spins += 1;
            if spins < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// The ranks this one waits for in a collective: MPI does not say which of them is
    /// missing, so all of them are named ("rank 1" in a group of two).
    fn others(&self) -> String {
        let r: Vec<String> = (0..self.world).filter(|&r| r != self.rank).map(|r| r.to_string()).collect();
        match r.len() {
            0 => "no other rank".to_string(),
            1 => format!("rank {}", r[0]),
            _ => format!("one of ranks {}", r.join(", ")),
        }
    }

    fn count(&self, op: &str, n: usize) -> Result<c_int> {
        c_int::try_from(n).map_err(|_| error(self.rank, op, format!("{n} elements exceed MPI's int count")))
    }
}

impl Communicator for MpiComm {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        const OP: &str = "all_reduce";
        let n = self.count(OP, buf.len())?;
        let a = self.api;
        let keep = (buf.to_vec(), vec![0f32; buf.len()]);
        let (send, recv) = (keep.0.as_ptr(), keep.1.as_ptr() as *mut f32);
        let keep = self.run(OP, keep, |req| {
            // SAFETY: `send`/`recv` point into `keep`, alive (or leaked) until completion.
            unsafe { (a.iallreduce)(send.cast(), recv.cast(), n, a.float, a.sum, a.world, req) }
        })?;
        buf.copy_from_slice(&keep.1);
        Ok(())
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        const OP: &str = "all_gather";
        if out.len() != local.len() * self.world {
            return Err(error(self.rank, OP, format!("an output of {} values for {} ranks", out.len(), self.world)));
        }
        let n = self.count(OP, local.len())?;
        let a = self.api;
        let keep = (local.to_vec(), vec![0f32; out.len()]);
        let (send, recv) = (keep.0.as_ptr(), keep.1.as_ptr() as *mut f32);
        let keep = self.run(OP, keep, |req| {
            // SAFETY: as in `all_reduce_sum`.
            unsafe { (a.iallgather)(send.cast(), n, a.float, recv.cast(), n, a.float, a.world, req) }
        })?;
        out.copy_from_slice(&keep.1);
        Ok(())
    }

    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        const OP: &str = "broadcast";
        let a = self.api;
        let r = root as c_int;
        // The length first, then the bytes.
        let len = Box::new((bytes.len() as u64).to_le_bytes());
        let p = len.as_ptr() as *mut u8;
        let len = self.run(OP, len, |req| {
            // SAFETY: `p` points into `len`, alive (or leaked) until completion.
            unsafe { (a.ibcast)(p.cast(), 8, a.byte, r, a.world, req) }
        })?;
        let n = u64::from_le_bytes(*len) as usize;
        let count = self.count(OP, n)?;
        let data = if self.rank == root { std::mem::take(bytes) } else { vec![0u8; n] };
        let p = data.as_ptr() as *mut u8;
        let data = self.run(OP, data, |req| {
            // SAFETY: as above.
            unsafe { (a.ibcast)(p.cast(), count, a.byte, r, a.world, req) }
        })?;
        *bytes = data;
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let a = self.api;
        // SAFETY: no buffers.
        self.run("barrier", (), |req| unsafe { (a.ibarrier)(a.world, req) })
    }

    fn abandon(&self, why: &str) {
        // MPI has no way to tell the others without a collective: they time out.
        log::error!("tensor-parallel rank {}: leaving: {why}", self.rank);
        *self.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.to_string());
        BROKEN.store(true, Ordering::SeqCst);
    }
}
